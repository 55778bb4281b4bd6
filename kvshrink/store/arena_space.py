"""The free space of an :class:`~kvshrink.store.arena.Arena`: best fit, merging, and room planning.

Why apart from the arena: the arena owns the file (headers, crash-safe state changes, recovery);
where a chunk goes and which chunks must go to make room for it is bookkeeping over offsets and
sizes alone, testable and readable without a mapping. Free blocks are kept twice, by start and
by end, so that freeing a block finds both neighbours in O(1) and merges with them.

Contract: not thread-safe (the arena's caller, the DRAM tier, serialises every call); touches no
memory (the arena writes the headers these offsets describe); raises nothing for valid offsets
(``take`` of a start that is not free is a caller bug: KeyError).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from kvshrink.store.arena import Block


@dataclass
class Room:
    """What :meth:`FreeSpace.room_for` found: whether room can be made, the blocks to free for it
    (in the order given; empty when a hole fits already), and the largest hole it saw (the one
    used when ``fits``; otherwise the largest that freeing every candidate would make)."""

    fits: bool
    blocks: list[Block]
    largest: int


class FreeSpace:
    """Free blocks by start (start -> size) and by end (end -> start)."""

    def __init__(self) -> None:
        self.by_start: dict[int, int] = {}
        self.by_end: dict[int, int] = {}

    def clear(self) -> None:
        self.by_start.clear()
        self.by_end.clear()

    def add(self, start: int, size: int) -> None:
        self.by_start[start] = size
        self.by_end[start + size] = start

    def take(self, start: int) -> int:
        """Remove the free block at ``start``; its size."""
        size = self.by_start.pop(start)
        del self.by_end[start + size]
        return size

    def largest(self) -> int:
        return max(self.by_start.values(), default=0)

    def best_fit(self, need: int) -> tuple[int, int] | None:
        """(start, size) of the smallest free block of at least ``need`` bytes, taken out of the
        free space; None when none is large enough. Best fit keeps large holes for large frames."""
        fits = [(size, start) for start, size in self.by_start.items() if size >= need]
        if not fits:
            return None
        size, start = min(fits)
        self.take(start)
        return start, size

    def merged(self, offset: int, size: int) -> tuple[int, int]:
        """The block being freed at ``offset`` joined with its free neighbours, which leave the
        free space: (start, size) of the merged block (not added: the caller writes its header
        first, then :meth:`add`)."""
        if offset + size in self.by_start:
            size += self.take(offset + size)
        if offset in self.by_end:
            prev = self.by_end[offset]
            size += self.take(prev)
            offset = prev
        return offset, size

    def room_for(self, need: int, candidates: Iterable[Block], cheap: bytes | None = None) -> Room:
        """Which of ``candidates`` to free so that a block of ``need`` bytes fits: a dry run of
        freeing with its merges, touching nothing. Candidates are taken in order until one hole
        would be large enough; of those, only the ones in the cheapest run of neighbouring
        blocks inside that hole that is large enough are kept (fewest blocks, then not the block
        of key ``cheap``, then the lowest offset), so that leaving out any kept block would
        leave no hole large enough. Consumes ``candidates`` up to that point (all of them when
        no room can be made)."""
        by_start, by_end = dict(self.by_start), dict(self.by_end)
        largest = max(by_start.values(), default=0)
        if largest >= need:
            return Room(True, [], largest)
        chosen: list[Block] = []
        for block in candidates:
            chosen.append(block)
            start, size = block.offset, block.size
            if start + size in by_start:
                size += by_start.pop(start + size)
                del by_end[start + size]
            if start in by_end:
                prev = by_end.pop(start)
                size += by_start.pop(prev)
                start = prev
            by_start[start] = size
            by_end[start + size] = start
            if size >= need:  # the only hole that fits: the one this block just joined
                return Room(True, self._cheapest_run(start, start + size, need, chosen, cheap), size)
            largest = max(largest, size)
        return Room(False, [], largest)

    def _cheapest_run(self, low: int, high: int, need: int, chosen: list[Block], cheap: bytes | None) -> list[Block]:
        """The blocks of ``chosen`` in the cheapest run of neighbours in [low, high) (free
        blocks and chosen ones, which tile it) that holds ``need`` bytes; in ``chosen`` order."""
        parts = sorted([(start, size, 0) for start, size in self.by_start.items() if low <= start < high]
                       + [(b.offset, b.size, 1 if b.key == cheap else 2) for b in chosen if low <= b.offset < high])
        best = (len(parts) * 2 + 1, 0, len(parts))  # cost (2 a block, 1 the cheap one), first, end
        right, total, spent = 0, 0, 0
        for left in range(len(parts)):  # two pointers: no cost is negative
            while total < need and right < len(parts):
                total, spent, right = total + parts[right][1], spent + parts[right][2], right + 1
            if total < need:
                break
            if spent < best[0]:
                best = (spent, left, right)
            total, spent = total - parts[left][1], spent - parts[left][2]
        keep = {offset for offset, _, weight in parts[best[1]:best[2]] if weight}
        return [b for b in chosen if b.offset in keep]
