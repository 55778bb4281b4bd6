"""DRAM tier: a bounded :class:`~kvshrink.store.arena.Arena` in ``/dev/shm`` with LRU eviction.

One process owns the arena for writing (an exclusive ``flock`` on the file, taken by the arena
before it touches the file and released by the kernel when the owner dies, so ``kill -9`` never
leaves it locked); any number of processes may attach read-only. A reader never trusts its
snapshot: it re-checks the header of the block it read after decoding or copying it, and a block
freed or rewritten underneath it is a miss, not corruption. Within the owner's process a block
being read is freed only once the read ends.

Making room: a write that does not fit plans which blocks to free (:meth:`Arena.room_for`): the
old copy of its own key first (it is being replaced, and freeing it often makes the room in
place), then the store's planned victims, then the rest oldest first, pinned chunks never (a
pinned old copy of the key only as a last resort), until a hole would fit; of those, only the
fewest neighbours that make that hole large enough are freed, so a chunk is evicted only when
the room needs it. When no hole can be made, nothing is evicted and the
:class:`~kvshrink.store.tier_base.TierFullError` gives the sizes (frame, capacity, largest free hole,
largest hole evicting could make, pinned bytes). ``plan_eviction`` runs the same plan.

The arena's pages are reserved when the owner opens it: a ``/dev/shm`` too small for the
capacity is a :class:`~kvshrink.errors.StoreUnavailableError` from the constructor (naming the
arena, the size asked and the free space), not a SIGBUS after some puts. Damaged block headers
found when the owner opens the arena, or when it frees a block, are counted as ``quarantined``
and logged; their chunks are gone, never listed or evicted (see :mod:`kvshrink.store.arena`).

Page requests on the arena's mapping (huge pages, ``mlock``, ``prefault``): see
:mod:`kvshrink.store.arena_pages`.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from kvshrink.errors import ConfigError, CorruptDataError, StoreUnavailableError
from kvshrink.store.arena import SUPERBLOCK, Arena, Block, block_size_for
from kvshrink.store.arena_pages import advise_hugepages, lock_in_ram, prefault
from kvshrink.store.arena_space import Room
from kvshrink.store.config import TierConfig
from kvshrink.store.dram_blocks import BlockTable
from kvshrink.store.tier_base import Buffer, KeepVictims, Tier, TierFullError, Victim, wants_frame

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_RESCAN_INTERVAL_S = 0.1
_DOOMED_WAIT_S = 5.0  # longest a writer waits for a read of an evicted block to finish
_SHM_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


@dataclass(frozen=True)
class DramTierConfig(TierConfig):
    """A DRAM tier's own keys: the arena's file name in /dev/shm, and two page requests."""

    shm_name: str = ""
    hugepages: bool = False
    mlock: bool = False
    prefault: bool = True

    codec_by_default = "fast"  # loads wait on the hot tier: see configs/store-default.yaml

    @classmethod
    def parse_kind_keys(cls, data: Mapping[str, Any], name: str, prefix: str) -> dict[str, Any]:
        out = super().parse_kind_keys(data, name, prefix)
        shm_name = str(data.get("shm_name") or f"kvshrink-{name}")
        if not _SHM_NAME_RE.match(shm_name):
            raise ConfigError(f"{prefix}.shm_name", f"use letters, digits, '.', '_' or '-' only, got {shm_name!r}")
        out["shm_name"] = shm_name
        return out


def arena_path(config: DramTierConfig) -> Path:
    return SHM_DIR / config.shm_name


class DramTier(Tier):
    kind = "dram"
    config_class = DramTierConfig
    config: DramTierConfig

    def __init__(self, config: DramTierConfig, is_pinned: Callable[[bytes], bool] | None = None,
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
        self.hugepages = advise_hugepages(self._arena.mm) if config.hugepages else False
        self.mlocked = lock_in_ram(self._arena.mm, self._arena.size) if config.mlock and not readonly else False
        self.prefaulted = prefault(self._arena.mm, self.name) if config.prefault and not readonly else False
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # a block evicted while being read came back
        self._table = BlockTable(self._arena, config.eviction, self._count_damage)  # under _lock
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
        self._table.load(blocks)
        self._scanned_at = time.monotonic()

    @property
    def _blocks(self) -> dict[bytes, Block]:
        """key -> the committed block holding it (the table's own dict: read it under the lock)."""
        return self._table.blocks

    # -- Tier -------------------------------------------------------------------------------------
    def plan_eviction(self, key: bytes, frame_len: int) -> list[bytes]:
        # the victims write_frame would evict now, in its order (a block being read is evicted
        # too; its space comes back when the read ends, which write_frame waits for); the old
        # copy of ``key`` is no victim: the write replaces it, nobody should demote it
        with self._lock:
            room = self._arena.room_for(len(key), frame_len, self._candidates_locked(key, ()), cheap=key)
            return [b.key for b in room.blocks if b.key != key]

    def write_frame(self, key: bytes, frame: Buffer, keep_victims: KeepVictims = False,
                    evict_first: Sequence[bytes] = ()) -> list[Victim]:
        """Room is made by a plan (:meth:`_candidates_locked`, :meth:`Arena.room_for`) that
        evicts nothing unless it yields a hole the frame fits in; when none can be made the
        TierFullError says why and nothing was evicted. The old copy of ``key`` may be freed
        before the new one is committed: a read of it in this process finishes on the old bytes
        (the block is freed when the read ends), a read from another process sees the header
        change and misses; a new read finds no key until the commit."""
        if self.readonly:
            raise StoreUnavailableError(f"tier {self.name}: attached read-only")
        frame_len = memoryview(frame).nbytes
        need = block_size_for(len(key), frame_len)
        if need > self.capacity_bytes:
            raise self._count_write_error(key, TierFullError(
                f"tier {self.name}: a {frame_len}-byte frame needs a {need}-byte block, more than "
                f"the arena's capacity of {self.capacity_bytes} bytes"))
        victims: list[Victim] = []
        with self._freed:
            reading: set[int] = set()  # offsets we freed whose space returns when a read ends
            while (block := self._arena.allocate(key, frame_len)) is None:
                if reading & self._table.doomed.keys():
                    # wait for those reads rather than evict more than plan_eviction promised
                    if not self._freed.wait(_DOOMED_WAIT_S):
                        reading.clear()  # a read that slow: make room elsewhere instead
                    continue
                room = self._arena.room_for(len(key), frame_len, self._candidates_locked(key, evict_first),
                                          cheap=key)
                if not room.blocks:  # no room can be made (fits with nothing to free: allocate would not fail)
                    if self._table.doomed and self._freed.wait(_DOOMED_WAIT_S):
                        continue  # a read of an evicted block ended: its space is back
                    raise self._count_write_error(key, TierFullError(self._no_room_locked(key, frame_len, room)))
                for planned in room.blocks:
                    if self._make_room_locked(key, planned, keep_victims, victims):
                        reading.add(planned.offset)
        self._arena.commit(block, frame)  # outside the lock: the block is invisible until indexed
        with self._lock:
            self._table.add(key, block)  # frees the old copy, when room was made without freeing it
        self.counters.add("puts")
        self.counters.add("put_bytes", frame_len)
        return victims

    def holds_frame(self, key: bytes, frame: Buffer) -> bool:
        """A memory compare with the indexed block (cheaper than the rewrite it saves); the
        chunk is touched when it is found. A read-only attacher never claims it (it does not write)."""
        if self.readonly:
            return False
        with self._open_block(key) as block:
            if block is None or block.frame_len != memoryview(frame).nbytes:
                return False
            return bool(np.array_equal(self._arena.payload(block), np.frombuffer(frame, dtype=np.uint8)))

    @contextmanager
    def _open_block(self, key: bytes, touch: bool = True) -> Iterator[Block | None]:
        """The indexed block of ``key`` (or None), registered as being read: the owner frees it
        only once the read ends. A reader in another process is not registered with the owner:
        it re-checks the block's header after reading (:meth:`Arena.still_holds`)."""
        with self._lock:
            block = self._lookup_locked(key)
            if block is not None:
                self._table.start_read(block)
                if touch:
                    self._table.lru.touch(key)
        if block is None:
            yield None
            return
        try:
            yield block
        finally:
            with self._lock:
                if self._table.end_read(block.offset):
                    self._freed.notify_all()

    @contextmanager
    def _open_frame(self, key: bytes, touch: bool = True) -> Iterator[Buffer | None]:
        with self._open_block(key, touch) as block:
            yield None if block is None else self._arena.payload(block)

    def get(self, key: bytes, out: Any = None, *, serial: bool = False) -> Any:
        if not self.readonly:
            return super().get(key, out, serial=serial)
        with self._open_block(key) as block:
            if block is None:
                self.counters.add("misses")
                return None
            chunk = self.decode_frame(key, self._arena.payload(block), out, serial=serial)
        if chunk is not None and not self._arena.still_holds(block):
            self.counters.add("hits", -1)
            self.counters.add("misses")
            return None  # rewritten by the owner while we decoded: a miss, never a mix
        return chunk

    def read_frame(self, key: bytes) -> bytes | None:
        with self._open_block(key, touch=False) as block:
            if block is None:
                return None
            data = bytes(self._arena.payload(block))
        if self.readonly and not self._arena.still_holds(block):
            return None  # the owner freed or rewrote the block while we copied it
        return data

    def _discard_corrupt(self, key: bytes, reason: str) -> None:
        if not self.readonly:
            self.delete(key)
            return
        with self._lock:  # a reader cannot free the owner's block; it stops looking at it
            if key in self._table.blocks:
                self._table.forget(key)

    def _verified(self, key: bytes) -> bool:
        return not self.readonly or self._still_current(key)

    def delete(self, key: bytes) -> bool:
        if self.readonly:
            raise StoreUnavailableError(f"tier {self.name}: attached read-only")
        with self._lock:
            if key not in self._table.blocks:
                return False
            self._table.remove(key)
            return True

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return self._lookup_locked(key) is not None

    def keys(self) -> list[bytes]:
        with self._lock:
            return self._table.lru.keys()

    def usage(self) -> tuple[int, int]:
        """(frame bytes, chunks): a running total, O(1), since a prefetch hint is sized by it."""
        with self._lock:
            return self._table.frame_bytes, len(self._table.blocks)

    def extra_stats(self) -> dict[str, Any]:
        return {"hugepages": self.hugepages, "mlocked": self.mlocked, "prefaulted": self.prefaulted,
                "path": str(self.path)}

    def close(self) -> None:
        if self._arena is None:
            return  # closed already
        with self._lock:
            if self._table.readers:
                raise StoreUnavailableError(f"tier {self.name}: close() while {len(self._table.readers)} reads run")
            self._table.load([])
        self._arena.close()  # closing the fd also releases the owner flock
        self._arena = None

    def destroy(self) -> None:
        """Close and delete the arena file: every chunk in it is gone."""
        self.close()
        self.path.unlink(missing_ok=True)

    # -- helpers (call with self._lock held) ----------------------------------------------------
    def _lookup_locked(self, key: bytes) -> Block | None:
        block = self._table.blocks.get(key)
        if not self.readonly:
            return block
        if block is not None and not self._arena.still_holds(block):
            block = None  # freed or rewritten by the owner since our last look
        if block is None and time.monotonic() - self._scanned_at > _RESCAN_INTERVAL_S:
            self._load()  # the owner may have written it (again) since our last look
            block = self._table.blocks.get(key)
            if block is not None and not self._arena.still_holds(block):
                return None
        return block

    def _still_current(self, key: bytes) -> bool:
        with self._lock:
            block = self._table.blocks.get(key)
            return block is not None and self._arena.still_holds(block)

    def _candidates_locked(self, key: bytes, evict_first: Sequence[bytes]) -> Iterator[Block]:
        """What a write of ``key`` may free, in order: the old copy of ``key`` first (it is
        being replaced; freeing it often makes the room in place), then ``evict_first``, then
        the rest oldest first. Pinned chunks are never candidates, except a pinned old copy of
        ``key`` as the last one: the write replaces it anyway once committed."""
        old = self._table.blocks.get(key)
        old_pinned = old is not None and self.is_pinned(key)
        if old is not None and not old_pinned:
            yield old
        for victim in self._table.lru.oldest(self.is_pinned, exclude=key, first=evict_first):
            yield self._table.blocks[victim]
        if old is not None and old_pinned:
            yield old

    def _make_room_locked(self, key: bytes, block: Block, keep_victims: KeepVictims,
                          victims: list[Victim]) -> bool:
        """Free one planned block for a write of ``key``: another key's is an eviction (a
        victim, with its frame when asked), the old copy of ``key`` is not. Returns whether a
        read still holds the block (its space comes back when that read ends)."""
        if block.key == key:
            self._table.remove(key)
        else:
            kept = bytes(self._arena.payload(block)) if wants_frame(keep_victims, block.key) else None
            self._table.remove(block.key)
            self.counters.add("evictions")
            victims.append(Victim(block.key, kept))
        return block.offset in self._table.doomed

    def _no_room_locked(self, key: bytes, frame_len: int, room: Room) -> str:
        """Why no room can be made for this frame, in sizes."""
        pinned = [b.size for k, b in self._table.blocks.items() if k != key and self.is_pinned(k)]
        return (f"tier {self.name}: no room for a {frame_len}-byte frame "
                f"({block_size_for(len(key), frame_len)}-byte block) in an arena of {self.capacity_bytes} "
                f"bytes: the largest free hole is {self._arena.largest_free()} bytes and evicting every "
                f"unpinned chunk would make one of {room.largest} bytes at most; {sum(pinned)} bytes are "
                f"pinned ({len(pinned)} chunks), {sum(self._table.doomed.values())} bytes await the end of "
                f"reads of evicted chunks")

    def _count_damage(self, offset: int) -> None:
        self.counters.add("quarantined")
        log.warning("tier %s: arena %s: the header of the block at offset %d was damaged while in use; "
                    "freed by its indexed size", self.name, self.path, offset)
