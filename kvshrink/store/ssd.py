"""SSD tier: one file per chunk under a directory, an append-only index, LRU eviction.

The directory's layout, the chunk file format and its single owner: ssd_files.py. Writes go to
``tmp/`` and are renamed into place, so a reader sees the old file or the new one, never a torn
one. Reads check the stored key and the frame checksum; a mismatch moves the file to
``quarantine/`` and is a miss.

**Durability, priced like a cache** (``fsync``, default ``false``, as in the shipped config). What a
put must survive is a restart of the cache, not a power cut at the chunk's moment: a lost chunk
costs one prefill, an fsync per chunk (file and directory, ~2 syncs per put) costs the SSD's
write bandwidth all the time. So with ``fsync: false`` a put is durable once its file is renamed
into place: it survives the process (``kill -9`` included: the page cache outlives it), and a
clean close syncs the file system (``syncfs``) before it writes ``CLEAN``, so a reboot after a
clean close loses nothing either. After an OS crash or power cut the chunks written since the
last sync may be gone or torn: there is no ``CLEAN`` marker then, so the open rescans (below),
an index entry whose file is gone is dropped, and a torn file fails its header or frame checksum
at read and is quarantined: a miss, never wrong bytes. ``fsync: true`` fsyncs each file before
its rename and the directory after it, for callers that want every put to outlive a power cut.

**Recovery.** The index (ssd_index.py) is trusted at open only when the clean-close marker
agrees with it (ssd_recovery.py); otherwise :meth:`SsdTier.reconcile` rescans the chunk files in
the background, adopting those the index lacks and forgetting entries whose file is gone.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from kvshrink.errors import ConfigError, StoreUnavailableError
from kvshrink.store.config import TierConfig
from kvshrink.store.ssd_files import (FILE_HEADER, SUFFIX, chunk_files, chunk_name, clear_tmp, file_prefix,
                                      own_directory, parse_prefix, quarantine_path, read_chunk_file,
                                      release_directory, sync_filesystem, take_evicted_frame, write_chunk_file)
from kvshrink.store.ssd_index import DELETE, ChunkIndex
from kvshrink.store.ssd_recovery import NOT_CLOSED, check_clean_marker, clean_state, write_clean_marker
from kvshrink.store.tier_base import Buffer, KeepVictims, Tier, TierFullError, Victim, wants_frame

log = logging.getLogger(__name__)

_OPEN_TRIES = 3  # opens of a chunk file that a concurrent write keeps replacing, before a miss


@dataclass(frozen=True)
class SsdTierConfig(TierConfig):
    """An SSD tier's own keys: its directory, and whether each put is fsync'ed (see above)."""

    path: str = ""
    fsync: bool = False

    @classmethod
    def parse_kind_keys(cls, data: Mapping[str, Any], name: str, prefix: str) -> dict[str, Any]:
        out = super().parse_kind_keys(data, name, prefix)
        if not data.get("path"):
            raise ConfigError(f"{prefix}.path", "required: the directory that holds this tier's files")
        out["path"] = str(Path(str(data["path"])).expanduser())
        return out


class SsdTier(Tier):
    kind = "ssd"
    config_class = SsdTierConfig
    config: SsdTierConfig
    device_reads = True

    def __init__(self, config: SsdTierConfig, is_pinned: Callable[[bytes], bool] | None = None) -> None:
        super().__init__(config, is_pinned)
        self.root = Path(config.path)
        self._fsync = config.fsync
        self.chunks_dir, self.tmp_dir, self.quarantine_dir = (self.root / d for d in ("chunks", "tmp", "quarantine"))
        try:
            for folder in (self.chunks_dir, self.tmp_dir, self.quarantine_dir):
                folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailableError(f"tier {self.name}: cannot use directory {self.root}: {exc}") from exc
        self._lock_fds = own_directory(self.root, self.name)
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._tmp_ids = itertools.count()
        self._reserved = 0  # bytes of writes in flight, counted against capacity
        self._scanning = 0  # reconcile() calls running: files may exist that the index lacks
        try:
            self._load_index()
        except BaseException as exc:
            release_directory(self._lock_fds)
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
        clear_tmp(self.tmp_dir)
        self._index = ChunkIndex(self.root / "index.log", self.config.eviction, self._index_failed)
        if self._index.log.damaged:
            log.warning("tier %s: index %s is damaged; rebuilding it from the chunk files", self.name,
                        self._index.log.path)
        disagreement = check_clean_marker(self.root, self._index.log, self._clean_state)
        self.clean_start = disagreement is None
        if disagreement is not None:
            self._index.unverified = set(self._index.lru.keys())
            log.log(logging.INFO if disagreement == NOT_CLOSED else logging.WARNING,
                    "tier %s: %s; rescanning %s in the background", self.name, disagreement, self.chunks_dir)

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
        excess = self._index.lru.total - (self._index.lru.get(key) or 0) + self._reserved + size - self.capacity_bytes
        chosen: list[bytes] = []
        for victim in self._index.lru.oldest(self.is_pinned, exclude=key, first=first):
            if excess <= 0:
                break
            chosen.append(victim)
            excess -= self._index.lru.get(victim)
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
            self._index.add(key, size)
        self.counters.add("puts")
        self.counters.add("put_bytes", size)
        return [Victim(k, None if held is None else take_evicted_frame(held, k)) for k, held in victims]

    def _write_file(self, key: bytes, prefix: bytes, frame: Buffer) -> None:
        final = self.path_for(key)
        tmp = self.tmp_dir / f"{final.stem}.{os.getpid()}.{next(self._tmp_ids)}.tmp"
        write_chunk_file(tmp, final, prefix, frame, self._fsync, self._lock)

    def _make_room_locked(self, key: bytes, size: int, keep_victims: KeepVictims,
                          first: Sequence[bytes]) -> list[tuple[bytes, Path | None]]:
        """Evict oldest unpinned chunks until ``size`` more bytes fit. With ``keep_victims`` the
        victim files are renamed into tmp/ (read later, outside the lock), else unlinked now."""
        chosen, missing = self._choose_victims_locked(key, size, first)
        if missing > 0:
            raise self._count_write_error(key, TierFullError("every resident chunk is pinned or in flight"))
        victims: list[tuple[bytes, Path | None]] = []
        for victim in chosen:
            self._index.lru.pop(victim)
            path = self.path_for(victim)
            held = None
            if wants_frame(keep_victims, victim):
                held = self.tmp_dir / f"{path.stem}.{next(self._tmp_ids)}.evicted"
            try:
                if held is not None:
                    os.replace(path, held)
                else:
                    path.unlink()
            except FileNotFoundError:
                held = None
            # file first, record second: a crash between them leaves a record naming a missing
            # file (dropped at the next read), never a file whose DELETE is on record (adopted again)
            self._index.record(DELETE, victim, 0)
            self.counters.add("evictions")
            victims.append((victim, held))
        return victims

    def _index_failed(self, exc: OSError) -> None:
        """Index failures (disk full) are counted; the files stay right and reconcile() re-adopts."""
        self.counters.add("errors")
        log.warning("tier %s: index update failed (%s); reconcile will repair it", self.name, exc)

    # -- reads ------------------------------------------------------------------------------------
    @contextmanager
    def _open_frame(self, key: bytes, touch: bool = True) -> Iterator[Buffer | None]:
        with self._lock:
            known = key in self._index.lru
            if touch:
                self._index.lru.touch(key)
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
            return read_chunk_file(fd, self._tls)
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
                        self._index.forget(key)
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
                os.replace(path, quarantine_path(self.quarantine_dir, path))
            except FileNotFoundError:
                pass
            self._index.forget(key)

    # -- bookkeeping ------------------------------------------------------------------------------
    def delete(self, key: bytes) -> bool:
        """Remove ``key``; during a rescan also a file not adopted yet, which must not be adopted
        after its key was deleted (the store deletes older copies when a key is overwritten)."""
        with self._lock:
            known = self._index.lru.pop(key) is not None
            if not known and not self._scanning:
                return False
            try:
                self.path_for(key).unlink()  # before the record: see _make_room_locked
                removed = True
            except FileNotFoundError:
                removed = False
            if known:
                self._index.record(DELETE, key, 0)
            return known or removed

    def contains(self, key: bytes) -> bool:
        """Whether the tier holds ``key``. After a crash or a damaged index, until the reconcile
        is done, an entry the index names is checked against its file once: the store skips
        demoting a chunk a lower tier claims to hold, so a claim for a file that is gone would
        lose the only copy."""
        with self._lock:
            if key not in self._index.lru:
                return False
            if key in self._index.unverified:
                self._index.unverified.discard(key)
                if not self.path_for(key).exists():
                    self._index.forget(key)
                    return False
            return True

    def keys(self) -> list[bytes]:
        with self._lock:
            return self._index.lru.keys()

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return self._index.lru.total, len(self._index.lru)

    def extra_stats(self) -> dict[str, Any]:
        return {"path": str(self.root), "quarantine_files": sum(1 for _ in self.quarantine_dir.iterdir())}

    def reconcile(self) -> int:
        """Adopt complete chunk files the index does not name (a lost index tail, a damaged or
        stale index) and forget index entries whose file is gone; return how many entries
        changed. Reads file headers only: a damaged body is found, and quarantined, when read.
        Safe beside reads and writes: each file is adopted or quarantined under the tier lock,
        only if it is still the file whose header was read and its key is still unknown."""
        with self._lock:
            by_name = {chunk_name(k): k for k in self._index.lru.keys()}
            self._scanning += 1
        try:
            changed = 0
            on_disk: set[str] = set()
            for entry in chunk_files(self.chunks_dir):
                name = entry.name[: -len(SUFFIX)]
                on_disk.add(name)
                if name not in by_name and entry.name.endswith(SUFFIX):
                    changed += self._adopt(Path(entry.path))
            for name, key in by_name.items():
                if name not in on_disk:
                    with self._lock:
                        if self._index.lru.get(key) is not None and not self.path_for(key).exists():
                            self._index.forget(key)
                            changed += 1
            with self._lock:  # every entry named at the start was found on disk or dropped
                self._index.unverified.difference_update(by_name.values())
            return changed
        finally:
            with self._lock:
                self._scanning -= 1

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
                os.replace(path, quarantine_path(self.quarantine_dir, path))
                self.counters.add("quarantined")
                return 0
            if key in self._index.lru:
                return 0
            self._index.add(key, stat.st_size)
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
                if self._index.log.records:  # the next open reads one snapshot, no records
                    self._index.compact()
                self._index.log.sync()
                if not self._fsync:  # the chunk files too, before CLEAN vouches for them
                    sync_filesystem(self._lock_fds[-1])
                if not self._index.incomplete:  # else the next open rescans, as after a crash
                    write_clean_marker(self.root, self._clean_state())
            except OSError as exc:
                log.warning("tier %s: index or chunks not synced at close (%s); the next open rescans", self.name, exc)
            self._index.log.close()
        release_directory(self._lock_fds)

    def _clean_state(self) -> dict[str, Any]:
        """What a clean close leaves and the next open compares (see the module docstring)."""
        return clean_state(self._index.log, len(self._index.lru), self._index.lru.total, self.chunks_dir)
