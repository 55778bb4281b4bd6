"""Per-stream sequence tracking: decide what a message's sequence number means.

vLLM numbers its published batches 0, 1, 2, ... per publisher process (a restart starts again at
0); LMCache numbers cache-event batches 1, 2, ... per (instance, incarnation). The subscriber asks
:meth:`SequenceTracker.observe` about every message and acts on the verdict:

* ``APPLY`` — the expected number: apply it.
* ``FIRST`` — first message of a stream we never saw; ``missing_from`` says where history starts
  (0 or 1) so that a replay can fetch what came before, if possible.
* ``GAP`` — numbers ``[expected, seq)`` were lost: replay them, or reset the stream's blocks.
* ``RESTART`` — the number went backwards outside the window a replay just covered, or back to the
  very first number (a publisher only numbers from the start again after it restarted, even where a
  replay covered that number): its cache is gone; reset the stream, then apply.
* ``DUPLICATE`` — already applied (a replay and the live socket overlapped): skip.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Hashable


class Verdict(enum.Enum):
    APPLY = "apply"
    FIRST = "first"
    GAP = "gap"
    RESTART = "restart"
    DUPLICATE = "duplicate"


@dataclass(slots=True)
class Observation:
    verdict: Verdict
    missing_from: int = 0  # first lost number (GAP / FIRST)


@dataclass(slots=True)
class _Stream:
    expected: int
    replayed: tuple[int, int] | None = None  # numbers applied from a replay, inclusive


class SequenceTracker:
    def __init__(self, first_seq: int = 0) -> None:
        self.first_seq = first_seq
        self._streams: dict[Hashable, _Stream] = {}

    def observe(self, stream: Hashable, seq: int) -> Observation:
        state = self._streams.get(stream)
        if state is None:
            return Observation(Verdict.FIRST, missing_from=self.first_seq)
        if seq == state.expected:
            return Observation(Verdict.APPLY)
        if seq > state.expected:
            return Observation(Verdict.GAP, missing_from=state.expected)
        if seq == self.first_seq:
            return Observation(Verdict.RESTART)
        if state.replayed is not None and state.replayed[0] <= seq <= state.replayed[1]:
            return Observation(Verdict.DUPLICATE)
        return Observation(Verdict.RESTART)

    def applied(self, stream: Hashable, seq: int) -> None:
        """``seq`` was applied (live): the next expected number is ``seq + 1``."""
        state = self._streams.get(stream)
        if state is None:
            self._streams[stream] = _Stream(seq + 1)
        else:
            state.expected = seq + 1

    def replayed(self, stream: Hashable, first: int, last: int) -> None:
        """Numbers ``first..last`` were applied from a replay."""
        state = self._streams.setdefault(stream, _Stream(last + 1))
        state.expected = max(state.expected, last + 1)
        state.replayed = (first, last)

    def forget(self, stream: Hashable) -> None:
        self._streams.pop(stream, None)

    def forget_matching(self, predicate) -> None:
        for key in [k for k in self._streams if predicate(k)]:
            del self._streams[key]
