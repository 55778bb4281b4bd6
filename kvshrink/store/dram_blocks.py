"""The DRAM tier's index of its arena: which committed block holds which key, and who reads it.

Why apart from the tier: the tier decides *what* to write and evict (its write protocol, the
read-only attach); this table keeps the books those decisions change: key -> block, the LRU
order, the running total of frame bytes (``usage()`` is O(1): a prefetch hint is sized by it),
and the blocks being read in this process. A removed block that a read still uses is *doomed*:
its space goes back to the arena only when the last reader ends, so a read in this process
always finishes on the bytes it started on.

Contract: not thread-safe; the tier calls every method under its lock. Buffers: none (blocks
are offsets into the arena). Errors: none raised; a block header found damaged when it is freed
is freed by its indexed size and reported through ``on_damage(offset)`` (the tier counts and
logs it).
"""

from __future__ import annotations

from typing import Callable

from kvshrink.store.arena import Arena, Block
from kvshrink.store.tier_base import LruIndex


class BlockTable:
    """key -> committed :class:`~kvshrink.store.arena.Block` of one arena, in eviction order."""

    def __init__(self, arena: Arena, eviction: str, on_damage: Callable[[int], None]) -> None:
        self.arena = arena
        self.eviction = eviction
        self.on_damage = on_damage
        self.blocks: dict[bytes, Block] = {}
        self.frame_bytes = 0  # sum of frame_len over blocks
        self.lru = LruIndex(eviction)
        self.readers: dict[int, int] = {}  # block offset -> reads in progress
        self.doomed: dict[int, int] = {}  # removed while read (offset -> size): freed by the last reader

    def load(self, blocks: list[Block]) -> None:
        """Take over what a scan found (oldest first: the best LRU guess after a restart)."""
        self.blocks = {b.key: b for b in blocks}
        self.frame_bytes = sum(b.frame_len for b in self.blocks.values())
        self.lru = LruIndex(self.eviction)
        for block in blocks:
            self.lru.add(block.key, block.size)

    def add(self, key: bytes, block: Block) -> None:
        """Index a block just committed for ``key`` (its old copy, if any, is removed first)."""
        if key in self.blocks:
            self.remove(key)
        self.blocks[key] = block
        self.frame_bytes += block.frame_len
        self.lru.add(key, block.size)

    def remove(self, key: bytes) -> None:
        """Unindex ``key`` and free its block, or doom it while a read uses it."""
        block = self.forget(key)
        if block.offset in self.readers:
            self.doomed[block.offset] = block.size
        else:
            self._free(block.offset, block.size)

    def forget(self, key: bytes) -> Block:
        """Unindex ``key`` without freeing its block (a read-only attacher never frees)."""
        block = self.blocks.pop(key)
        self.frame_bytes -= block.frame_len
        self.lru.pop(key)
        return block

    def start_read(self, block: Block) -> None:
        self.readers[block.offset] = self.readers.get(block.offset, 0) + 1

    def end_read(self, offset: int) -> bool:
        """One read of the block at ``offset`` ended; True when that freed a doomed block."""
        remaining = self.readers[offset] - 1
        if remaining:
            self.readers[offset] = remaining
            return False
        del self.readers[offset]
        if offset not in self.doomed:
            return False
        self._free(offset, self.doomed.pop(offset))
        return True

    def _free(self, offset: int, size: int) -> None:
        """Free by the size this process indexed (the file's header may have been scribbled on
        since: the arena checks it, and a damaged one is reported and rewritten)."""
        if not self.arena.free(offset, size):
            self.on_damage(offset)
