"""DRAM tier: a bounded :class:`~kvshrink.store.arena.Arena` in ``/dev/shm`` with LRU eviction.

One process owns the arena for writing (an exclusive ``flock`` on the file, taken by the arena
before it touches the file and released by the kernel when the owner dies, so ``kill -9`` never
leaves it locked); any number of processes may attach read-only. A reader never trusts its
snapshot: it re-checks a block's header after decoding, and a block rewritten underneath it is a
miss, not corruption.

The arena's pages are reserved when the owner opens it: a ``/dev/shm`` too small for the
capacity is a :class:`~kvshrink.errors.StoreUnavailableError` from the constructor (naming the
arena, the size asked and the free space), not a SIGBUS after some puts. Damaged block headers
found when the owner opens the arena, or when it frees a block, are counted as ``quarantined``
and logged; their chunks are gone, never listed or evicted (see :mod:`kvshrink.store.arena`).

Huge pages (``madvise(MADV_HUGEPAGE)`` on the shared mapping) and ``mlock`` are requests: when the
kernel refuses, the tier runs on normal, unlocked pages and says so once in the log. The pages
are reserved (``posix_fallocate``) before the mapping is advised, so whether they are huge is up
to the tmpfs mount (``huge=``) or khugepaged.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from kvshrink.errors import CorruptDataError, StoreUnavailableError
from kvshrink.store.arena import SUPERBLOCK, Arena, Block, block_size_for
from kvshrink.store.config import TierConfig
from kvshrink.store.tier import Buffer, KeepVictims, LruIndex, Tier, TierFullError, Victim, wants_frame

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
THP_SHMEM = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
_RESCAN_INTERVAL_S = 0.1
_DOOMED_WAIT_S = 5.0  # longest a writer waits for a read of an evicted block to finish
_warned: set[str] = set()


def _warn_once(topic: str, message: str, *args: object) -> None:
    if topic not in _warned:
        _warned.add(topic)
        log.warning(message, *args)


def arena_path(config: TierConfig) -> Path:
    return SHM_DIR / config.shm_name


class DramTier(Tier):
    kind = "dram"

    def __init__(self, config: TierConfig, is_pinned: Callable[[bytes], bool] | None = None,
                 *, readonly: bool = False) -> None:
        super().__init__(config, is_pinned)
        self.readonly = readonly
        self.path = arena_path(config)
        if readonly and not self.path.exists():
            raise StoreUnavailableError(f"tier {self.name}: no arena at {self.path} to attach to")
        try:
            self._arena = Arena(self.path, config.capacity, readonly=readonly)
        except StoreUnavailableError as exc:  # owned by another process, no room in /dev/shm, ...
            raise StoreUnavailableError(f"tier {self.name}: {exc}") from exc
        except CorruptDataError as exc:
            raise CorruptDataError(f"tier {self.name}: {exc}") from exc
        self.capacity_bytes = self._arena.size - SUPERBLOCK
        self.hugepages = self._advise_hugepages() if config.hugepages else False
        self.mlocked = self._mlock() if config.mlock and not readonly else False
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # a block evicted while being read came back
        self._blocks: dict[bytes, Block] = {}
        self._lru = LruIndex(config.eviction)
        self._readers: dict[int, int] = {}  # block offset -> threads decoding from it
        self._doomed: dict[int, int] = {}  # removed while read (offset -> size): freed by the last reader
        self._scanned_at = 0.0
        self._load()

    # -- set-up -----------------------------------------------------------------------------------
    def _load(self) -> None:
        blocks = self._arena.scan()
        if self._arena.damaged and not self.readonly:  # a reader's are the owner's to count and repair
            self.counters.add("quarantined", len(self._arena.damaged))
            log.warning("tier %s: arena %s had %d damaged block header(s) (offsets %s); their space is free "
                        "again and their chunks are dropped", self.name, self.path, len(self._arena.damaged),
                        self._arena.damaged[:8])
        self._blocks = {b.key: b for b in blocks}
        self._lru = LruIndex(self.config.eviction)
        for block in blocks:  # oldest first: insertion order is the best LRU guess after a restart
            self._lru.add(block.key, block.size)
        self._scanned_at = time.monotonic()

    def _advise_hugepages(self) -> bool:
        policy = THP_SHMEM.read_text().split("[")[-1].split("]")[0] if THP_SHMEM.exists() else "absent"
        try:
            self._arena.mm.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError) as exc:
            _warn_once("hugepages", "DRAM tier: huge pages refused (%s); using normal pages", exc)
            return False
        if policy not in ("always", "within_size", "advise", "force"):
            _warn_once("hugepages", "DRAM tier: huge pages refused by the kernel (shmem_enabled=%s); "
                       "using normal pages", policy)
            return False
        return True

    def _mlock(self) -> bool:
        libc = ctypes.CDLL(None, use_errno=True)
        anchor = ctypes.c_char.from_buffer(self._arena.mm)
        try:
            rc = libc.mlock(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(self._arena.size))
        finally:
            del anchor
        if rc != 0:
            err = ctypes.get_errno()
            _warn_once("mlock", "DRAM tier: mlock of %d bytes refused (%s); pages may be swapped out",
                       self._arena.size, errno.errorcode.get(err, err))
            return False
        return True

    # -- Tier -------------------------------------------------------------------------------------
    def plan_eviction(self, key: bytes, frame_len: int) -> list[bytes]:
        # the same candidates, in the same order, as write_frame evicts (a block being read is
        # evicted too; its space comes back when the read ends, which write_frame waits for)
        with self._lock:
            candidates = (self._blocks[k] for k in self._lru.oldest(self.is_pinned, exclude=key))
            return [b.key for b in self._arena.frees_needed(len(key), frame_len, candidates)]

    def write_frame(self, key: bytes, frame: Buffer, keep_victims: KeepVictims = False,
                    evict_first: Sequence[bytes] = ()) -> list[Victim]:
        if self.readonly:
            raise StoreUnavailableError(f"tier {self.name}: attached read-only")
        frame_len = memoryview(frame).nbytes
        if block_size_for(len(key), frame_len) > self.capacity_bytes:
            raise self._count_write_error(key, TierFullError(f"{frame_len}-byte chunk exceeds the arena"))
        victims: list[Victim] = []
        with self._freed:
            reading: set[int] = set()  # our victims whose space returns when a read ends
            while (block := self._arena.allocate(key, frame_len)) is None:
                if reading & self._doomed.keys():
                    # wait for those reads rather than evict more than plan_eviction promised
                    if not self._freed.wait(_DOOMED_WAIT_S):
                        reading.clear()  # a read that slow: evict further instead
                    continue
                victim = next(self._lru.oldest(self.is_pinned, exclude=key, first=evict_first), None)
                if victim is None:
                    if self._doomed and self._freed.wait(_DOOMED_WAIT_S):
                        continue
                    raise self._count_write_error(key, TierFullError("every resident chunk is pinned"))
                offset = self._blocks[victim].offset
                kept = bytes(self._arena.payload(self._blocks[victim])) if wants_frame(keep_victims, victim) else None
                self._remove_locked(victim)
                if offset in self._doomed:
                    reading.add(offset)
                self.counters.add("evictions")
                victims.append(Victim(victim, kept))
        self._arena.commit(block, frame)  # outside the lock: the block is invisible until indexed
        with self._lock:
            if key in self._blocks:
                self._remove_locked(key)
            self._blocks[key] = block
            self._lru.add(key, block.size)
        self.counters.add("puts")
        self.counters.add("put_bytes", frame_len)
        return victims

    @contextmanager
    def _open_frame(self, key: bytes, touch: bool = True) -> Iterator[Buffer | None]:
        with self._lock:
            block = self._lookup_locked(key)
            if block is not None:
                self._readers[block.offset] = self._readers.get(block.offset, 0) + 1
                if touch:
                    self._lru.touch(key)
        if block is None:
            yield None
            return
        try:
            yield self._arena.payload(block)
        finally:
            with self._lock:
                self._release_reader_locked(block.offset)

    def get(self, key: bytes, out: Any = None) -> Any:
        chunk = super().get(key, out)
        if chunk is not None and self.readonly and not self._still_current(key):
            self.counters.add("hits", -1)
            self.counters.add("misses")
            return None  # rewritten by the owner while we decoded: a miss, never a mix
        return chunk

    def _discard_corrupt(self, key: bytes, reason: str) -> None:
        if not self.readonly:
            self.delete(key)
            return
        with self._lock:  # a reader cannot free the owner's block; it stops looking at it
            self._blocks.pop(key, None)
            self._lru.pop(key)

    def _verified(self, key: bytes) -> bool:
        return not self.readonly or self._still_current(key)

    def delete(self, key: bytes) -> bool:
        if self.readonly:
            raise StoreUnavailableError(f"tier {self.name}: attached read-only")
        with self._lock:
            if key not in self._blocks:
                return False
            self._remove_locked(key)
            return True

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return self._lookup_locked(key) is not None

    def keys(self) -> list[bytes]:
        with self._lock:
            return self._lru.keys()

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return sum(b.frame_len for b in self._blocks.values()), len(self._blocks)

    def extra_stats(self) -> dict[str, Any]:
        return {"hugepages": self.hugepages, "mlocked": self.mlocked, "path": str(self.path)}

    def close(self) -> None:
        if self._arena is None:
            return  # closed already
        with self._lock:
            if self._readers:
                raise StoreUnavailableError(f"tier {self.name}: close() while {len(self._readers)} reads run")
            self._blocks.clear()
        self._arena.close()  # closing the fd also releases the owner flock
        self._arena = None

    def destroy(self) -> None:
        """Close and delete the arena file: every chunk in it is gone."""
        self.close()
        self.path.unlink(missing_ok=True)

    # -- helpers (call with self._lock held) ----------------------------------------------------
    def _lookup_locked(self, key: bytes) -> Block | None:
        block = self._blocks.get(key)
        if not self.readonly:
            return block
        if block is None and time.monotonic() - self._scanned_at > _RESCAN_INTERVAL_S:
            self._load()  # another process may have written it since our last look
            block = self._blocks.get(key)
        if block is not None and not self._arena.still_holds(block):
            return None
        return block

    def _still_current(self, key: bytes) -> bool:
        with self._lock:
            block = self._blocks.get(key)
            return block is not None and self._arena.still_holds(block)

    def _remove_locked(self, key: bytes) -> None:
        block = self._blocks.pop(key)
        self._lru.pop(key)
        if block.offset in self._readers:
            self._doomed[block.offset] = block.size
        else:
            self._free_locked(block.offset, block.size)

    def _free_locked(self, offset: int, size: int) -> None:
        """Free by the size this process indexed (the file's header may have been scribbled on
        since: the arena checks it, and a damaged one is counted and rewritten)."""
        if not self._arena.free(offset, size):
            self.counters.add("quarantined")
            log.warning("tier %s: arena %s: the header of the block at offset %d was damaged while in use; "
                        "freed by its indexed size", self.name, self.path, offset)

    def _release_reader_locked(self, offset: int) -> None:
        remaining = self._readers[offset] - 1
        if remaining:
            self._readers[offset] = remaining
            return
        del self._readers[offset]
        if offset in self._doomed:
            self._free_locked(offset, self._doomed.pop(offset))
            self._freed.notify_all()
