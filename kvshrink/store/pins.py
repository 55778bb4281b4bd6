"""Pins: chunks LMCache's lookup-and-lock asked the local tiers to keep until it unlocks them.

A pin is counted per key (two locks need two unlocks); local tiers skip pinned chunks when they
evict, and idle demotion leaves them in place. Threads: any thread; ``lock`` guards the counts
and is also what idle demotion holds while it removes a chunk, so a pin taken meanwhile either
comes first (the chunk stays) or after (the chunk is below). Errors: none. Buffers: none.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Sequence


class Pins:
    """Pin counts per key; ``key in pins`` is read without the lock (a dict lookup)."""

    def __init__(self) -> None:
        self._counts: Counter[bytes] = Counter()
        self.lock = threading.Lock()

    def pin(self, keys: Sequence[bytes]) -> None:
        with self.lock:
            for key in keys:
                self._counts[key] += 1

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Undo one :meth:`pin` per key; unknown keys are ignored (unlock never fails)."""
        with self.lock:
            for key in keys:
                key = bytes(key)
                if self._counts[key] > 1:
                    self._counts[key] -= 1
                else:
                    self._counts.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._counts

    def __len__(self) -> int:
        with self.lock:
            return len(self._counts)
