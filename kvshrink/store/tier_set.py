"""The store's tiers with their roles, and the lookups every part of the store shares.

:class:`TierSet` says which tiers take puts, which get write-back copies, which are exclusive
(they hold a chunk only instead of a faster tier) and which are remote (shared over the network,
one round trip per call), and answers "who holds this key" from the tiers and the
:class:`~kvshrink.store.ledger.CopyLedger` without a remote round trip. Reads look tier by tier;
:meth:`TierSet.settled` looks again when a chunk moved meanwhile, so a look never passes a chunk
on its way between tiers. Threads: every method may be called from any thread; it takes no
lock of its own (the tiers and the ledger guard themselves). Errors: none of its own; a tier's
``contains`` of a local tier does no I/O that fails. Buffers: none.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from kvshrink.store.config import TierConfig
from kvshrink.store.ledger import CopyLedger
from kvshrink.store.tier_base import Tier

READ_LOOKS = 3  # a read that missed everywhere while a chunk moved up looks again, this often at most
EVICTED_WAIT_S = 5.0  # longest a read waits for the demotion of a chunk evicted before it was copied


class TierSet:
    """Ordered tiers (fastest first), their roles, and the copy ledger that tracks copies in flight."""

    def __init__(self, tiers: list[Tier], configs: Sequence[TierConfig]) -> None:
        self.tiers = tiers
        self.put = [i for i, t in enumerate(configs) if t.put]
        self.write_back = [i for i, t in enumerate(configs) if t.write_back and not t.put]
        # neither put nor write_back: holds a chunk only instead of a faster tier (promotion moves)
        self.exclusive = {i for i, t in enumerate(configs) if not t.put and not t.write_back}
        self.remote = [i for i, t in enumerate(tiers) if t.is_remote]  # shared over the network: reads key by key
        self.local = [i for i in range(len(tiers)) if i not in self.remote]
        self.ledger = CopyLedger(self.remote)

    def __len__(self) -> int:
        return len(self.tiers)

    def hidden(self, index: int, key: bytes) -> bool:
        """Whether tier ``index`` is remote and what it holds under ``key`` is an older value."""
        return index in self.remote and self.ledger.is_stale(index, key)

    def holds_current(self, index: int, key: bytes) -> bool:
        """Whether tier ``index`` holds the current value of ``key``, without a remote round trip:
        a local tier's copy is current (puts delete older ones); a remote tier's is known."""
        if index in self.remote:
            return self.ledger.holds(index, key)
        return self.tiers[index].contains(key)

    def held_elsewhere(self, key: bytes, index: int) -> bool:
        """Whether a local tier other than ``index`` holds ``key``."""
        return any(self.tiers[t].contains(key) for t in self.local if t != index)

    def held_locally(self, key: bytes) -> bool:
        """Whether a local tier holds ``key``, or it is parked on its way to a remote one. Looked
        at in the order chunks flow down (a demotion copies before it evicts, so it is never
        missed) and again if a chunk moved up meanwhile."""
        return self.settled(key, lambda: any(self.tiers[t].contains(key) for t in self.local)
                            or self.ledger.parked_frame(key) is not None)

    def held_anywhere_known(self, key: bytes) -> bool:
        """Held by a local tier, parked, or known to be held by a remote tier (no round trip)."""
        return self.held_locally(key) or any(self.ledger.holds(t, key) for t in self.remote)

    def settled(self, key: bytes, look: Callable[[], Any]) -> Any:
        """``look()`` for ``key``; looked again (a few times at most) while it finds nothing and
        a chunk moved meanwhile (up, out of the parking, or evicted before its demotion, which
        is waited for): a look tier by tier could have passed it."""
        found = None
        for _ in range(READ_LOOKS):
            moved = self.ledger.moved
            found = look()
            if found:
                return found
            if not self.ledger.wait_evicted(key, EVICTED_WAIT_S) and self.ledger.moved == moved:
                return found
        return found

    def chunks_filling(self, share: float) -> int | None:
        """How many chunks fill ``share`` of the first tier at the local tiers' mean chunk size
        (None: nothing stored yet to size them by); a remote tier's usage costs a round trip."""
        held = [self.tiers[i].usage() for i in self.local]  # (bytes, chunks)
        stored, chunks = sum(b for b, _ in held), sum(c for _, c in held)
        if not chunks or not stored:
            return None
        return max(1, int(share * self.tiers[0].capacity_bytes * chunks / stored))
