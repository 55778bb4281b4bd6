"""The Host → Blocks view: which instance holds which prefix block, on which tier, LRU-capped.

Every block (a chained prefix hash, see ``hashing``) maps to one int of 4-bit nibbles, one per
instance: bit ``4 * i + t`` set means instance ``i`` holds the block on tier ``t`` (GPU, DRAM, SSD,
remote). A lookup therefore looks each of a prompt's blocks up once (in C) and decodes holders
only where they change, whatever the number of instances; the nibble of instance ``i`` is its tier
code, read off the int's bytes without unpacking bits.

Blocks arrive through *feeds*: one event stream for one instance (a vLLM publisher, an LMCache
emitter). A feed maps the engine's opaque key of each block it reported to our block hash, so that
removals and parents can be resolved, and remembers which tiers it feeds, so that resetting the
stream (restart, ``AllBlocksCleared``, unrecoverable gap) clears exactly what it contributed.

Memory is bounded: past ``max_blocks`` entries the least recently stored/accessed block is
forgotten for every instance (lookups do not refresh recency); each feed's key map is capped at
``max_blocks`` keys too, oldest first (a well-behaved engine reports removals, which keeps it at
the size of its cache). A key may outlive its evicted block; it still resolves a parent correctly.
Not thread-safe: the owner (``state.IndexState``) serializes access with one lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import groupby, islice
from typing import Hashable, Iterable, Sequence

import numpy as np

TIERS = ("gpu", "dram", "ssd", "remote")
TIER_INDEX = {name: i for i, name in enumerate(TIERS)}


@dataclass(eq=False)
class Feed:
    """One event stream of one instance; owns the engine-key → block-hash map of that stream."""

    feed_id: int
    instance_bit: int
    name: str
    mask: int = 0  # 1 << 4 * instance_bit: the instance's GPU bit, ``mask << t`` its tier-t bit
    key_map: dict[Hashable, int] = field(default_factory=dict)
    tiers_fed: int = 0  # bitmask over TIERS this feed ever reported


@dataclass
class StoreOutcome:
    stored: int = 0
    conflicts: int = 0  # engine key already mapped to another block hash in this feed


class BlockIndex:
    """Entries are packed into one int per block (see the module doc), so a million blocks are a
    million ints: no per-block container for the garbage collector to scan, and an int only as
    wide as the highest instance holding the block. The ``OrderedDict`` itself is still one tracked
    container whose traversal visits every entry (~60 ms per million blocks in a full collection,
    measured): the service freezes it out of the collector's sight at start-up (``app.freeze_gc``)."""

    def __init__(self, max_blocks: int, width: int = 256) -> None:
        if max_blocks <= 0 or width <= 0:
            raise ValueError("max_blocks and width must be positive")
        self.max_blocks = max_blocks
        self.width = width
        self._entries: OrderedDict[int, int] = OrderedDict()  # block hash -> tier nibbles of every instance
        self._next_feed_id = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def masks_of(self, block_hash: int) -> tuple[int, int, int, int] | None:
        """The block's holders as one instance bitmask per tier (GPU, DRAM, SSD, remote), or None."""
        packed = self._entries.get(block_hash)
        if packed is None:
            return None
        codes = tier_codes([packed], self.width)[0]
        return tuple(int.from_bytes(np.packbits(codes >> t & 1, bitorder="little").tobytes(), "little")
                     for t in range(4))

    @staticmethod
    def _instance_bits(mask: int, tiers: Iterable[int]) -> int:
        out = 0
        for t in tiers:
            out |= mask << t
        return out

    # -- feeds --------------------------------------------------------------------------------

    def open_feed(self, instance_bit: int, name: str) -> Feed:
        if not 0 <= instance_bit < self.width:
            raise ValueError(f"instance bit {instance_bit} outside [0, {self.width})")
        feed = Feed(self._next_feed_id, instance_bit, name, mask=1 << 4 * instance_bit)
        self._next_feed_id += 1
        return feed

    def clear_feed(self, feed: Feed) -> int:
        """Forget everything ``feed`` reported (its tiers on its instance); returns blocks touched."""
        keep = ~self._instance_bits(feed.mask, (t for t in range(4) if feed.tiers_fed >> t & 1))
        touched = 0
        entries = self._entries
        for block_hash in set(feed.key_map.values()):
            packed = entries.get(block_hash)
            if packed is None:
                continue
            touched += 1
            packed &= keep
            if packed:
                entries[block_hash] = packed
            else:
                del entries[block_hash]
        feed.key_map.clear()
        return touched

    # -- updates ------------------------------------------------------------------------------

    def store(self, feed: Feed, engine_keys: Iterable[Hashable], block_hashes: Iterable[int],
              tier: int) -> StoreOutcome:
        """Record that ``feed``'s instance holds these blocks on ``tier``."""
        bit = feed.mask << tier
        feed.tiers_fed |= 1 << tier
        entries, key_map = self._entries, feed.key_map
        get, move = entries.get, entries.move_to_end
        # blocks that had equal entries share one new int: less memory, and a lookup walking a run
        # of them compares one object with itself instead of loading one int per block
        updated: dict[int, int] = {}
        stored = conflicts = 0
        for engine_key, block_hash in zip(engine_keys, block_hashes):
            previous = key_map.get(engine_key)
            if previous is not None and previous != block_hash:
                conflicts += 1  # the key meant another block: that one is no longer known to be held
                old = get(previous)
                if old is not None:
                    old &= ~bit
                    if old:
                        entries[previous] = old
                    else:
                        del entries[previous]
            packed = get(block_hash)
            if packed is None:
                entries[block_hash] = bit
            else:
                merged = updated.get(packed)
                if merged is None:
                    merged = updated[packed] = packed | bit
                entries[block_hash] = merged
                move(block_hash)
            key_map[engine_key] = block_hash
            stored += 1
        if len(entries) > self.max_blocks:
            for _ in range(len(entries) - self.max_blocks):
                entries.popitem(last=False)
                self.evictions += 1
        excess = len(key_map) - self.max_blocks
        if excess > 0:
            for key in list(islice(key_map, excess)):
                del key_map[key]
        return StoreOutcome(stored, conflicts)

    def remove(self, feed: Feed, engine_keys: Iterable[Hashable], tier: int | None) -> tuple[int, int]:
        """Clear ``tier`` (``None``: every tier the feed feeds) for these blocks; (removed, unknown)."""
        removed = unknown = 0
        tiers = [tier] if tier is not None else [t for t in range(4) if feed.tiers_fed >> t & 1]
        keep = ~self._instance_bits(feed.mask, tiers)
        mine = self._instance_bits(feed.mask, range(4))
        entries, key_map = self._entries, feed.key_map
        for engine_key in engine_keys:
            block_hash = key_map.get(engine_key)
            if block_hash is None:
                unknown += 1
                continue
            removed += 1
            packed = entries.get(block_hash)
            if packed is None:
                del key_map[engine_key]
                continue
            packed &= keep
            if not packed & mine:
                del key_map[engine_key]
            if packed:
                entries[block_hash] = packed
            else:
                del entries[block_hash]
        return removed, unknown

    def touch(self, feed: Feed, engine_keys: Iterable[Hashable]) -> int:
        """Refresh LRU recency of blocks ``feed`` reports as accessed; returns how many were known."""
        known = 0
        for engine_key in engine_keys:
            block_hash = feed.key_map.get(engine_key)
            if block_hash is not None and block_hash in self._entries:
                self._entries.move_to_end(block_hash)
                known += 1
        return known

    def block_hash_of(self, feed: Feed, engine_key: Hashable) -> int | None:
        return feed.key_map.get(engine_key)

    # -- lookup -------------------------------------------------------------------------------

    def prefix_runs(self, block_hashes: Iterable[int]) -> tuple[list[int], list[int]]:
        """The known prefix of ``block_hashes`` (up to the first block nobody holds), as runs of
        consecutive blocks with identical entries: (packed entry of each run, blocks in each run).

        Holders change only where some instance's cached prefix ends or changes tier, so a 2048-block
        prompt is a few dozen runs. The per-block work — dict lookups, run detection, stopping at the
        first unknown block — happens in C (``map``, ``groupby``); Python runs once per run.
        """
        packed: list[int] = []
        blocks: list[int] = []
        for entry, run in groupby(map(self._entries.get, block_hashes)):
            if entry is None:
                break
            packed.append(entry)
            blocks.append(len(list(run)))
        return packed, blocks

    def fastest_tiers(self, packed: Sequence[int], bits: Sequence[int]) -> np.ndarray:
        """``[runs, len(bits)]`` int8: the fastest tier on which instance bit ``bits[k]`` holds run ``r``
        (an entry of ``packed``), -1 where it does not hold it."""
        codes = tier_codes(packed, max(bits, default=0) + 1)
        return _FIRST_TIER.take(codes.take(np.asarray(bits, dtype=np.intp), axis=1))


def tier_codes(packed: Sequence[int], instances: int) -> np.ndarray:
    """``[len(packed), instances]`` uint8: the nibble of each instance in each packed entry (bit ``t``:
    held on tier ``t``). One ``to_bytes`` per entry; the nibbles of all are split in two numpy steps."""
    nbytes = (instances + 1) // 2
    keep = (1 << 8 * nbytes) - 1  # drops the nibbles of instances above the ones asked for
    raw = np.frombuffer(b"".join([(entry & keep).to_bytes(nbytes, "little") for entry in packed]), dtype=np.uint8)
    raw = raw.reshape(len(packed), nbytes)
    codes = np.empty((len(packed), 2 * nbytes), dtype=np.uint8)
    codes[:, 0::2] = raw & 15
    codes[:, 1::2] = raw >> 4
    return codes[:, :instances]


# lowest set bit of a 4-bit tier code (bit t: held on tier t), -1 for none: tiers are ordered fastest first
_FIRST_TIER = np.array([-1] + [(code & -code).bit_length() - 1 for code in range(1, 16)], dtype=np.int8)
