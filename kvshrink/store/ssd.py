"""SSD tier: one file per chunk under a directory, an append-only index, LRU eviction.

Layout under ``path``::

    LOCK               flock'ed by the owner too, and holds its pid (see below)
    CLEAN              present only between a clean close and the next open (see below)
    index.log          see ssd_index.py
    chunks/ab/<40 hex>.kvc   blake2b(key) names: no caller byte ever reaches a path
    tmp/               writes in progress (deleted at open: torn writes never become chunks)
    quarantine/        files that failed verification, moved aside for inspection

A chunk file is ``KVSC | version | key_len | key | codec frame``. Writes go to ``tmp/`` and are
renamed into place, so a reader sees the old file or the new one, never a torn one. Reads check
the stored key and the frame checksum; a mismatch moves the file to ``quarantine/`` and is a miss.

**Durability, priced like a cache** (``fsync``, default ``false`` in the shipped config). What a
put must survive is a restart of the cache, not a power cut at the chunk's moment: a lost chunk
costs one prefill, an fsync per chunk (file and directory, ~2 syncs per put) costs the SSD's
write bandwidth all the time. So with ``fsync: false`` a put is durable once its file is renamed
into place: it survives the process (``kill -9`` included: the page cache outlives it), and a
clean close syncs the file system (``syncfs``) before it writes ``CLEAN``, so a reboot after a
clean close loses nothing either. After an OS crash or power cut the chunks written since the
last sync may be gone or torn: there is no ``CLEAN`` marker then, so the open rescans (below),
an index entry whose file is gone is dropped, and a torn file fails its header or frame checksum
at read and is quarantined: a miss, never wrong bytes. ``fsync: true`` fsyncs each file before
its rename and the directory after it, for callers that want every put to outlive a power cut
(and is what a config that leaves the key out gets).

**One owner.** The owning process holds an exclusive ``flock`` on the directory itself (an
``O_RDONLY`` descriptor of ``path``) and one on ``LOCK``, so a second process (or a second tier in
this one) is refused with :class:`~kvshrink.errors.StoreUnavailableError` while the owner lives;
the kernel drops both when the owner dies, even by SIGKILL. A lock on a file alone would not do:
deleting ``LOCK`` by hand leaves the owner locking a nameless file, and a second process would
lock the new ``LOCK`` it creates and corrupt the directory alongside the first. The directory's
lock cannot be deleted from under a live owner, so deleting ``LOCK`` by hand changes nothing
(the next owner creates it again); removing or renaming the whole directory does, but then the
owner's files go with it. Where the file system cannot flock a directory (NFS emulates flock with
POSIX locks, which need a file open for writing) the tier says so in the log and relies on
``LOCK`` alone, which then must not be deleted while the tier runs.

**Clean close.** ``CLEAN`` records what the index and the chunk directories looked like at close:
the index's fingerprint (length and CRCs, ssd_index.py), its entry count and bytes, and the
modification times of ``chunks/`` and its sub-directories. At open the index is trusted, and the
file scan skipped, only when all of these still agree; otherwise (no marker: a crash; an index
deleted, replaced by an older copy, truncated or corrupted; chunk files added or removed by hand;
an index append that failed during the last run) :meth:`SsdTier.reconcile` runs in the background:
it adopts every intact chunk file the index does not name and drops entries whose file is gone;
until it is done, a chunk it has not reached yet is a miss. Checking costs a few hundred ``stat``
calls, not a listing of the chunks; the price is that a file changed by hand within one tick of
the file system's timestamps after the close can go unnoticed (a damaged index never does).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import itertools
import json
import logging
import os
import struct
import threading
import time
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from kvshrink.errors import StoreUnavailableError
from kvshrink.store.config import TierConfig
from kvshrink.store.ssd_index import DELETE, PUT, IndexLog
from kvshrink.store.tier_base import Buffer, KeepVictims, LruIndex, Tier, TierFullError, Victim, wants_frame

log = logging.getLogger(__name__)

FILE_HEADER = struct.Struct("<4sHHI")  # magic, version, reserved, key_len
FILE_MAGIC = b"KVSC"
FILE_VERSION = 1
SUFFIX = ".kvc"
CLEAN_MARKER = "CLEAN"
CLEAN_FORMAT = 1
LOCK_FILE = "LOCK"
NOT_CLOSED = "the last owner did not close cleanly"
_OPEN_TRIES = 3  # opens of a chunk file that a concurrent write keeps replacing, before a miss


def chunk_name(key: bytes) -> str:
    """Fixed-length hex name: the only thing derived from a key that touches the file system."""
    return hashlib.blake2b(key, digest_size=20).hexdigest()


def file_prefix(key: bytes) -> bytes:
    return FILE_HEADER.pack(FILE_MAGIC, FILE_VERSION, 0, len(key)) + key


def parse_prefix(data: Buffer) -> bytes | None:
    """The key stored in a chunk file's header, or None if the header is not ours."""
    if len(data) < FILE_HEADER.size:
        return None
    magic, version, _, key_len = FILE_HEADER.unpack_from(data, 0)
    if magic != FILE_MAGIC or version != FILE_VERSION or FILE_HEADER.size + key_len > len(data):
        return None
    return bytes(data[FILE_HEADER.size : FILE_HEADER.size + key_len])


class SsdTier(Tier):
    kind = "ssd"
    device_reads = True

    def __init__(self, config: TierConfig, is_pinned: Callable[[bytes], bool] | None = None) -> None:
        super().__init__(config, is_pinned)
        self.root = Path(config.path)
        self._fsync = config.fsync
        self.chunks_dir, self.tmp_dir, self.quarantine_dir = (self.root / d for d in ("chunks", "tmp", "quarantine"))
        try:
            for folder in (self.chunks_dir, self.tmp_dir, self.quarantine_dir):
                folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailableError(f"tier {self.name}: cannot use directory {self.root}: {exc}") from exc
        self._lock_fds = self._own_directory()
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._tmp_ids = itertools.count()
        self._reserved = 0  # bytes of writes in flight, counted against capacity
        self._index_incomplete = False  # an index update failed: the next open must rescan
        self._scanning = 0  # reconcile() calls running: files may exist that the index lacks
        # keys an untrusted index names whose file nobody has seen yet: a crash or a damaged index
        # may name files that are gone (a lost DELETE record, an older copy of the index restored)
        self._unverified: set[bytes] = set()
        try:
            self._load_index()
        except BaseException as exc:
            self._release_directory()
            if isinstance(exc, OSError):
                raise StoreUnavailableError(f"tier {self.name}: cannot open the index in {self.root}: {exc}") from exc
            raise
        # after a crash or a damaged index, chunk files the index does not name are adopted in the
        # background; when the index is the one a clean close left, the scan is skipped
        self._reconciler = threading.Thread(target=self._reconcile_quietly, name=f"kvshrink-{self.name}-reconcile",
                                            daemon=True)
        if not self.clean_start:
            self._reconciler.start()

    def _load_index(self) -> None:
        """Replay the index into the LRU and decide whether to trust it (``clean_start``)."""
        self._clear_tmp()
        self._index = IndexLog(self.root / "index.log")
        if self._index.damaged:
            log.warning("tier %s: index %s is damaged; rebuilding it from the chunk files", self.name,
                        self._index.path)
        self._lru = LruIndex(self.config.eviction)
        self._lru.load(self._index.recovered)
        del self._index.recovered
        disagreement = self._check_clean_marker()
        self.clean_start = disagreement is None
        if disagreement is not None:
            self._unverified = set(self._lru.keys())
            log.log(logging.INFO if disagreement == NOT_CLOSED else logging.WARNING,
                    "tier %s: %s; rescanning %s in the background", self.name, disagreement, self.chunks_dir)

    def _own_directory(self) -> list[int]:
        """Descriptors holding exclusive flocks on the directory itself and on ``LOCK`` (see the
        module docstring); StoreUnavailableError if another live process owns either."""
        held: list[int] = []
        try:
            held.append(os.open(self.root, os.O_RDONLY | os.O_DIRECTORY))
            try:
                self._flock(held[-1])
            except BlockingIOError:
                raise
            except OSError as exc:  # NFS emulates flock by POSIX locks, which need a writable file
                os.close(held.pop())
                log.warning("tier %s: cannot flock the directory %s (%s); relying on the LOCK file alone, "
                            "which must then not be deleted while the tier runs", self.name, self.root, exc)
            held.append(os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600))
            self._flock(held[-1])
            os.ftruncate(held[-1], 0)
            os.pwrite(held[-1], f"{os.getpid()}\n".encode(), 0)
        except BlockingIOError as exc:
            for fd in held:
                os.close(fd)
            owner = _read_note(self.root / LOCK_FILE)
            raise StoreUnavailableError(f"tier {self.name}: {self.root} is owned by another live process"
                                        f"{f' (pid {owner})' if owner else ''}") from exc
        except OSError as exc:
            for fd in held:
                os.close(fd)
            raise StoreUnavailableError(f"tier {self.name}: cannot lock directory {self.root}: {exc}") from exc
        return held

    @staticmethod
    def _flock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def path_for(self, key: bytes) -> Path:
        name = chunk_name(key)
        return self.chunks_dir / name[:2] / (name + SUFFIX)

    # -- writes -----------------------------------------------------------------------------------
    def plan_eviction(self, key: bytes, frame_len: int) -> list[bytes]:
        with self._lock:
            return self._choose_victims_locked(key, len(file_prefix(key)) + frame_len)[0]

    def _choose_victims_locked(self, key: bytes, size: int, first: Sequence[bytes] = ()) -> tuple[list[bytes], int]:
        """Oldest unpinned keys (``first`` before the others) whose removal makes ``size`` more
        bytes fit, and the bytes still missing after them (> 0: it cannot fit)."""
        excess = self._lru.total - (self._lru.get(key) or 0) + self._reserved + size - self.capacity_bytes
        chosen: list[bytes] = []
        for victim in self._lru.oldest(self.is_pinned, exclude=key, first=first):
            if excess <= 0:
                break
            chosen.append(victim)
            excess -= self._lru.get(victim)
        return chosen, excess

    def write_frame(self, key: bytes, frame: Buffer, keep_victims: KeepVictims = False,
                    evict_first: Sequence[bytes] = ()) -> list[Victim]:
        prefix = file_prefix(key)
        size = len(prefix) + memoryview(frame).nbytes
        if size > self.capacity_bytes:
            raise self._count_write_error(key, TierFullError(f"{size}-byte chunk exceeds capacity"))
        with self._lock:
            victims = self._make_room_locked(key, size, keep_victims, evict_first)
            self._reserved += size
        try:
            self._write_file(key, prefix, frame)
        except OSError as exc:
            for _, held in victims:  # nothing to demote them for: the write that needed room failed
                if held is not None:
                    held.unlink(missing_ok=True)
            raise self._count_write_error(key, exc) from exc
        finally:
            with self._lock:
                self._reserved -= size
        with self._lock:
            self._record_put_locked(key, size)
        self.counters.add("puts")
        self.counters.add("put_bytes", size)
        return [self._collect_victim(v) for v in victims]

    def _write_file(self, key: bytes, prefix: bytes, frame: Buffer) -> None:
        final = self.path_for(key)
        tmp = self.tmp_dir / f"{final.stem}.{os.getpid()}.{next(self._tmp_ids)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_all(fd, prefix)
            _write_all(fd, frame)
            if self._fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            final.parent.mkdir(exist_ok=True)
            with self._lock:  # so quarantine's "is it still the file I read" check cannot race it
                os.replace(tmp, final)
            if self._fsync:
                _fsync_dir(final.parent)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)
            raise

    def _make_room_locked(self, key: bytes, size: int, keep_victims: KeepVictims,
                          first: Sequence[bytes]) -> list[tuple[bytes, Path | None]]:
        """Evict oldest unpinned chunks until ``size`` more bytes fit. With ``keep_victims`` the
        victim files are renamed into tmp/ (read later, outside the lock), else unlinked now."""
        chosen, missing = self._choose_victims_locked(key, size, first)
        if missing > 0:
            raise self._count_write_error(key, TierFullError("every resident chunk is pinned or in flight"))
        victims: list[tuple[bytes, Path | None]] = []
        for victim in chosen:
            self._lru.pop(victim)
            path = self.path_for(victim)
            held = self.tmp_dir / f"{path.stem}.{next(self._tmp_ids)}.evicted" if wants_frame(keep_victims, victim) else None
            try:
                if held is not None:
                    os.replace(path, held)
                else:
                    path.unlink()
            except FileNotFoundError:
                held = None
            # file first, record second: a crash between them leaves a record naming a missing
            # file (dropped at the next read), never a file whose DELETE is on record (adopted again)
            self._append_index(DELETE, victim, 0)
            self.counters.add("evictions")
            victims.append((victim, held))
        return victims

    def _collect_victim(self, victim: tuple[bytes, Path | None]) -> Victim:
        key, held = victim
        if held is None:
            return Victim(key, None)
        try:
            data = held.read_bytes()
        finally:
            held.unlink(missing_ok=True)
        return Victim(key, data[len(file_prefix(key)) :] if parse_prefix(data) == key else None)

    def _append_index(self, op: int, key: bytes, size: int) -> None:
        """Index failures (disk full) are counted; the files stay right and reconcile() re-adopts.
        Call with the lock held."""
        try:
            self._index.append(op, key, size)
            if self._index.should_compact(len(self._lru)):
                self._compact_locked()
        except OSError as exc:
            self.counters.add("errors")
            self._index_incomplete = True
            log.warning("tier %s: index update failed (%s); reconcile will repair it", self.name, exc)

    def _record_put_locked(self, key: bytes, size: int) -> None:
        """A complete file of ``key`` is in place: index it (its file is seen, so verified)."""
        self._lru.add(key, size)
        self._unverified.discard(key)
        self._append_index(PUT, key, size)

    def _forget_locked(self, key: bytes) -> bool:
        """Drop the entry of ``key`` (its file is gone or quarantined) and record it; whether there was one."""
        if self._lru.pop(key) is None:
            return False
        self._append_index(DELETE, key, 0)
        return True

    def _compact_locked(self) -> None:
        self._index.compact(self._lru.items())

    # -- reads ------------------------------------------------------------------------------------
    @contextmanager
    def _open_frame(self, key: bytes, touch: bool = True) -> Iterator[Buffer | None]:
        with self._lock:
            known = key in self._lru
            if touch:
                self._lru.touch(key)
        if not known:
            yield None
            return
        data = self._read_file(key)
        if data is None:
            yield None
            return
        if parse_prefix(data) != key:
            self.quarantine(key, "chunk file header does not hold this key")
            yield None
            return
        yield data[len(file_prefix(key)) :]

    def _read_file(self, key: bytes) -> memoryview | None:
        """The whole file in a per-thread reusable buffer (no page faults on fresh memory)."""
        fd = self._open_chunk(key)
        if fd is None:
            return None
        try:
            stat = os.fstat(fd)
            self._tls.inode = stat.st_ino
            buf = getattr(self._tls, "buf", None)
            if buf is None or buf.nbytes < stat.st_size:
                buf = self._tls.buf = np.empty(stat.st_size, dtype=np.uint8)
            view = memoryview(buf)[: stat.st_size]
            got = 0
            while got < stat.st_size:
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    break
                got += n
            return view[:got]
        except OSError as exc:
            self.counters.add("errors")
            log.warning("tier %s: cannot read chunk %s: %s", self.name, key.hex()[:32], exc)
            return None
        finally:
            os.close(fd)

    def _open_chunk(self, key: bytes) -> int | None:
        """A read-only descriptor of the chunk file of ``key``, or None (a miss).

        A file that is not there was deleted since the caller saw the entry, by the store (an
        eviction, a re-put retiring this copy) or by hand. Only the latter leaves an entry
        behind: under the tier lock a write renames its file into place before it indexes it,
        and an eviction or delete unindexes and unlinks in one section, so an entry whose file
        is absent *under the lock* is stale and is forgotten. A file that is back under the lock
        is a write that replaced it meanwhile (a delete then a put, the demotion of a re-put
        chunk): it is read instead; forgetting the entry then would lose the chunk, its file
        unindexed until the next rescan."""
        path = self.path_for(key)
        for _ in range(_OPEN_TRIES):
            try:
                return os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                with self._lock:
                    if not path.exists():
                        self._forget_locked(key)
                        return None
            except OSError as exc:
                self.counters.add("errors")
                log.warning("tier %s: cannot open chunk %s: %s", self.name, key.hex()[:32], exc)
                return None
        return None  # replaced again and again while we opened it: a miss, the entry stays

    def _discard_corrupt(self, key: bytes, reason: str) -> None:
        path = self.path_for(key)
        with self._lock:
            try:
                if os.stat(path).st_ino != getattr(self._tls, "inode", None):
                    return  # replaced by a fresh write since we read it: keep the new file
                os.replace(path, self.quarantine_dir / f"{path.stem}.{time.time_ns()}{SUFFIX}")
            except FileNotFoundError:
                pass
            self._forget_locked(key)

    # -- bookkeeping ------------------------------------------------------------------------------
    def delete(self, key: bytes) -> bool:
        """Remove ``key``; during a rescan also a file not adopted yet, which must not be adopted
        after its key was deleted (the store deletes older copies when a key is overwritten)."""
        with self._lock:
            known = self._lru.pop(key) is not None
            if not known and not self._scanning:
                return False
            try:
                self.path_for(key).unlink()  # before the record: see _make_room_locked
                removed = True
            except FileNotFoundError:
                removed = False
            if known:
                self._append_index(DELETE, key, 0)
            return known or removed

    def contains(self, key: bytes) -> bool:
        """Whether the tier holds ``key``. After a crash or a damaged index, until the reconcile
        is done, an entry the index names is checked against its file once: the store skips
        demoting a chunk a lower tier claims to hold, so a claim for a file that is gone would
        lose the only copy."""
        with self._lock:
            if key not in self._lru:
                return False
            if key in self._unverified:
                self._unverified.discard(key)
                if not self.path_for(key).exists():
                    self._forget_locked(key)
                    return False
            return True

    def keys(self) -> list[bytes]:
        with self._lock:
            return self._lru.keys()

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return self._lru.total, len(self._lru)

    def extra_stats(self) -> dict[str, Any]:
        return {"path": str(self.root), "quarantine_files": sum(1 for _ in self.quarantine_dir.iterdir())}

    def reconcile(self) -> int:
        """Adopt complete chunk files the index does not name (a lost index tail, a damaged or
        stale index) and forget index entries whose file is gone; return how many entries
        changed. Reads file headers only: a damaged body is found, and quarantined, when read.
        Safe beside reads and writes: each file is adopted or quarantined under the tier lock,
        only if it is still the file whose header was read and its key is still unknown."""
        with self._lock:
            by_name = {chunk_name(k): k for k in self._lru.keys()}
            self._scanning += 1
        try:
            return self._reconcile(by_name)
        finally:
            with self._lock:
                self._scanning -= 1

    def _reconcile(self, by_name: dict[str, bytes]) -> int:
        changed = 0
        on_disk: set[str] = set()
        for sub in os.scandir(self.chunks_dir):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                name = entry.name[: -len(SUFFIX)]
                on_disk.add(name)
                if name not in by_name and entry.name.endswith(SUFFIX):
                    changed += self._adopt(Path(entry.path))
        for name, key in by_name.items():
            if name not in on_disk:
                with self._lock:
                    if self._lru.get(key) is not None and not self.path_for(key).exists():
                        self._forget_locked(key)
                        changed += 1
        with self._lock:  # every entry named at the start was found on disk or dropped
            self._unverified.difference_update(by_name.values())
        return changed

    def _adopt(self, path: Path) -> int:
        """Index the chunk file ``path`` (1), or quarantine it if its header is not ours or names
        another key (0); 0 if a write, delete or eviction got to it first."""
        try:
            with open(path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                key = parse_prefix(f.read(FILE_HEADER.size + 2048))
        except FileNotFoundError:
            return 0
        with self._lock:
            try:
                stat = os.stat(path)
            except FileNotFoundError:
                return 0
            if stat.st_ino != inode:
                return 0  # replaced by a fresh write since we read it
            if key is None or self.path_for(key) != path:
                os.replace(path, self.quarantine_dir / f"{path.stem}.{time.time_ns()}{SUFFIX}")
                self.counters.add("quarantined")
                return 0
            if key in self._lru:
                return 0
            self._record_put_locked(key, stat.st_size)
        return 1

    def _reconcile_quietly(self) -> None:
        try:
            adopted = self.reconcile()
        except OSError as exc:
            log.warning("tier %s: reconcile stopped: %s", self.name, exc)
            return
        if adopted:
            log.info("tier %s: reconcile repaired %d index entries", self.name, adopted)

    def close(self) -> None:
        if not self._lock_fds:
            return  # closed already
        if self._reconciler.is_alive():
            self._reconciler.join()
        with self._lock:
            try:
                if self._index.records:  # the next open reads one snapshot, no records
                    self._compact_locked()
                self._index.sync()
                if not self._fsync:  # the chunk files too, before CLEAN vouches for them
                    _sync_filesystem(self._lock_fds[-1])
                if not self._index_incomplete:  # else the next open rescans, as after a crash
                    self._write_clean_marker()
            except OSError as exc:
                log.warning("tier %s: index or chunks not synced at close (%s); the next open rescans", self.name, exc)
            self._index.close()
        self._release_directory()

    def _release_directory(self) -> None:
        for fd in self._lock_fds:
            os.close(fd)  # the flocks go with the descriptors
        self._lock_fds = []

    def _clean_state(self) -> dict[str, Any]:
        """What a clean close leaves and the next open compares (see the module docstring)."""
        return {"format": CLEAN_FORMAT, "index": self._index.fingerprint(), "entries": len(self._lru),
                "bytes": self._lru.total, "chunk_dirs": self._chunk_dirs_fingerprint()}

    def _chunk_dirs_fingerprint(self) -> str:
        """CRC of the names and mtimes of ``chunks/`` and its sub-directories: adding, removing or
        renaming a chunk file changes its directory's mtime. ~256 stat calls, no listing of chunks."""
        parts = [f"{os.stat(self.chunks_dir).st_mtime_ns}"]
        for entry in sorted(os.scandir(self.chunks_dir), key=lambda e: e.name):
            parts.append(f"{entry.name}={entry.stat(follow_symlinks=False).st_mtime_ns}")
        return f"{len(parts)}:{zlib.crc32(';'.join(parts).encode()):08x}"

    def _write_clean_marker(self) -> None:
        """Written (and fsync'ed) last: a marker cut short by a crash fails to parse: a rescan."""
        fd = os.open(self.root / CLEAN_MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, json.dumps(self._clean_state()).encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def _check_clean_marker(self) -> str | None:
        """None when the last owner closed cleanly and the index and chunk directories are as it
        left them; else what disagrees. The marker is removed (durably) so that a crash of this
        process is seen as one by the next."""
        marker = self.root / CLEAN_MARKER
        try:
            text = marker.read_bytes()
            marker.unlink()
        except FileNotFoundError:
            return NOT_CLOSED
        except OSError as exc:
            return f"cannot read the clean-close marker {marker}: {exc}"
        _fsync_dir(self.root)
        if self._index.damaged:
            return "index.log is damaged"
        if self._index.torn_bytes:
            return f"index.log had {self._index.torn_bytes} bytes past its last intact record"
        try:
            recorded = json.loads(text)
        except ValueError:
            return "the clean-close marker is unreadable"
        if not isinstance(recorded, dict):
            return "the clean-close marker is unreadable"
        current = self._clean_state()
        for what, value in current.items():
            if recorded.get(what) != value:
                return f"the index does not match the last clean close: {what} is {value!r}, was {recorded.get(what)!r}"
        return None

    def _clear_tmp(self) -> None:
        for entry in os.scandir(self.tmp_dir):
            os.unlink(entry.path)  # torn writes and half-evicted victims from a killed process


def _write_all(fd: int, data: Buffer) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_note(path: Path) -> str:
    """The first line of a small text file, '' if it cannot be read."""
    try:
        return path.read_text(errors="replace").strip()[:32]
    except OSError:
        return ""


def _sync_filesystem(fd: int) -> None:
    """Flush every dirty page of the file system holding ``fd`` (``syncfs``; ``sync`` where the
    C library lacks it). OSError when the kernel reports a write-back failure."""
    try:
        syncfs = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        os.sync()
        return
    if syncfs(ctypes.c_int(fd)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs: {os.strerror(err)}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
