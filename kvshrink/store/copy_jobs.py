"""The store's copy jobs: each moves one chunk between tiers through the write path.

* :meth:`CopyJobs.store` — a put on a put worker: encode once per codec, write the put tiers
  (the first retires older copies), then queue the write-back;
* :meth:`CopyJobs.write_back` — background copy from the first put tier to write-back tiers;
* :meth:`CopyJobs.promote` — background copy of a read hit up to the first tier;
* :meth:`CopyJobs.prefetch_move` — the same on a prefetch thread (:mod:`~kvshrink.store.prefetch`);
* :meth:`CopyJobs.demote_idle` — a first-tier chunk idle too long, one tier down (:mod:`~kvshrink.store.idle`);
* :meth:`CopyJobs.persist_down` — at close, what only a faster tier holds copied one tier down.

Every job registers a :class:`~kvshrink.store.ledger.Move` before it reads a frame, so a put of
the same key that comes later wins (docs/store-consistency.md), and reports the drop candidates
its writes returned once it holds no lock. Threads: the job's own (put, background, prefetch or
idle thread, or the closer). Errors: a put's tier refusal propagates (the put's Future fails);
background failures are counted by the engine. Buffers: a put's staging buffer goes back to the
pool when its job ends; frames read from tiers are the job's own bytes.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvshrink.errors import KVShrinkError
from kvshrink.store import tier_codecs
from kvshrink.store.copy_engine import CopyEngine
from kvshrink.store.drop_reports import DropReports
from kvshrink.store.pins import Pins
from kvshrink.store.prefetch import Prefetcher
from kvshrink.store.tier_base import TierFullError
from kvshrink.store.tier_set import TierSet
from kvshrink.store.write_path import WritePath, drop_candidates_of

log = logging.getLogger(__name__)


class CopyJobs:
    """The jobs that copy a chunk from one tier (or a put's staging buffer) into another."""

    def __init__(self, tiers: TierSet, writes: WritePath, reports: DropReports, engine: CopyEngine,
                 pins: Pins) -> None:
        self._tiers = tiers
        self._ledger = tiers.ledger
        self._writes = writes
        self._reports = reports
        self._engine = engine
        self._pins = pins
        self.prefetch: Prefetcher | None = None  # set by the store once built (it calls prefetch_move)

    def store(self, key: bytes, chunk: Any, buf: Any) -> bool:
        """A put's job: write the encoded chunk into every put tier (the first one supersedes older
        copies), then queue the write-back. True once durable; raises the refusing tier's error."""
        drop_candidates: list[bytes] = []
        try:
            encoded = tier_codecs.FrameSet(chunk=chunk)
            for n, index in enumerate(self._tiers.put):
                supersede = n == 0 and len(self._tiers) > 1
                written = self._writes.write(index, key, encoded.frame_for(self._tiers.tiers[index]),
                                             supersede=supersede)
                drop_candidates += written.drop_candidates
        except KVShrinkError as exc:
            drop_candidates += drop_candidates_of(exc)
            self._engine.counters.add("put_errors")
            raise
        finally:
            if buf is not None:  # None: a lent chunk, the caller's
                self._engine.staging.release(buf)
            self._reports.report(drop_candidates)  # before the put's Future completes
        if self._tiers.write_back:
            self._engine.schedule(self.write_back, key)
        return True

    def write_back(self, key: bytes) -> None:
        """Copy a put chunk from the first put tier to the write-back tiers that lack its current
        value, encoding it at most once per codec method."""
        targets = [t for t in self._tiers.write_back if not self._tiers.holds_current(t, key)]
        if not targets:
            return
        move = self._ledger.begin(key)
        drop_candidates: list[bytes] = []
        try:
            frame = self._tiers.tiers[self._tiers.put[0]].read_frame(key)
            if frame is None:
                return  # evicted meanwhile: the eviction demoted (or parked) it
            converted = tier_codecs.FrameSet(frame=frame)
            for target in targets:
                written = self._writes.write(target, key, converted.frame_for(self._tiers.tiers[target]), move)
                drop_candidates += written.drop_candidates
                if not written.landed:
                    return  # re-put meanwhile: that put's own write-back follows
        finally:
            self._ledger.end(move)
            self._reports.report(drop_candidates)

    def promote(self, source: int, key: bytes) -> None:
        """Copy a read hit in tier ``source`` to the first tier (moved out of an exclusive tier)."""
        if self._tiers.tiers[0].contains(key) or self._ledger.is_stale(source, key):
            return  # promoted already, re-put, or hidden there meanwhile
        move = self._ledger.begin(key)
        drop_candidates: list[bytes] = []
        try:
            frame = self._tiers.tiers[source].read_frame(key)
            if frame is None:
                return  # evicted meanwhile
            written = self._writes.write(0, key, tier_codecs.convert(frame, self._tiers.tiers[0]), move,
                                         promoted_from=source)
            drop_candidates = written.drop_candidates
        except KVShrinkError as exc:
            self._reports.report(drop_candidates_of(exc))
            raise
        finally:
            self._ledger.end(move)
            self._reports.report(drop_candidates)

    def prefetch_move(self, key: bytes) -> str:
        """One prefetch move: the chunk read from the fastest lower tier holding it and written
        into the first tier as a promotion. ``moved``, ``present``, ``missing`` or ``dropped`` (no
        room: the first tier is full of pinned chunks); any other refused write raises."""
        if self._tiers.tiers[0].contains(key):
            return "present"
        move = self._ledger.begin(key)
        drop_candidates: list[bytes] = []
        try:
            for index in range(1, len(self._tiers)):
                if self._tiers.hidden(index, key):
                    continue
                if index in self._tiers.local and not self._tiers.tiers[index].contains(key):
                    continue
                frame = self._tiers.tiers[index].read_frame(key)
                if frame is None:
                    continue  # evicted meanwhile, or not there (a remote tier is asked only here)
                try:
                    written = self._writes.write(0, key, tier_codecs.convert(frame, self._tiers.tiers[0]), move,
                                                 promoted_from=index)
                except TierFullError as exc:
                    drop_candidates += drop_candidates_of(exc)
                    return "dropped"  # the tier logged and counted it; the chunk stays below
                except KVShrinkError as exc:
                    drop_candidates += drop_candidates_of(exc)
                    raise
                drop_candidates += written.drop_candidates
                return "moved" if written.landed else "missing"
            return "missing"
        finally:
            self._ledger.end(move)
            self._reports.report(drop_candidates)

    def demote_idle(self, key: bytes) -> str:
        """Move an idle chunk of the first tier one tier down: copied below first, then removed
        here, under the first tier's write lock, so a put of the key waits and a reader finds it
        in one tier or the other. Never a pinned chunk, nor one with a prefetch queued or
        running. ``demoted``, ``pinned``, ``gone`` or ``failed``."""
        drop_candidates: list[bytes] = []
        try:
            with self._writes.write_locks[0]:
                if key in self._pins or (self.prefetch is not None and self.prefetch.busy(key)):
                    return "pinned"
                if not self._tiers.tiers[0].contains(key):
                    return "gone"
                captured = self._writes.capture(0, [key])
                drop_candidates = self._writes.demote(0, captured).drop_candidates
                if not (self._tiers.holds_current(1, key) or self._ledger.parked_frame(key, 1) is not None):
                    return "failed"  # the tier below refused it (counted there): it stays here
                with self._pins.lock:  # lock() pins under this lock: pinned from now on, it stays here
                    if key in self._pins:
                        if captured[0][1] is not None and 1 in self._tiers.local:
                            self._tiers.tiers[1].delete(key)  # the copy this made: the chunk stays in one tier
                        return "pinned"
                    self._tiers.tiers[0].delete(key)
        finally:
            self._reports.report(drop_candidates)
        self._writes.placements.notify([key])
        if self.prefetch is not None:
            self.prefetch.evicted([key])
        return "demoted"

    def persist_down(self) -> None:
        """Copy every chunk that only tier *i* holds into tier *i+1*, oldest first, so that what
        the slower tier has to evict for them is the oldest too. Runs in ``close`` after the
        queues drained; a failed copy is counted and logged, the chunk stays where it was (and
        after one failure on a remote tier, the rest are not tried: each would wait its timeout)."""
        started, copied = time.monotonic(), 0
        drop_candidates: list[bytes] = []
        tiers = self._tiers.tiers
        for index, (tier, below) in enumerate(zip(tiers, tiers[1:])):
            for key in tier.keys():
                if self._tiers.holds_current(index + 1, key):
                    continue
                frame = tier.read_frame(key)
                if frame is None:
                    continue
                try:
                    written = self._writes.write(index + 1, key, tier_codecs.convert(frame, below))
                except KVShrinkError as exc:
                    drop_candidates += drop_candidates_of(exc)
                    self._engine.counters.add("background_errors")
                    log.warning("persisting %s to tier %s failed: %s", key.hex()[:32], below.name, exc)
                    if index + 1 in self._tiers.remote:
                        break
                    continue
                drop_candidates += written.drop_candidates
                tier.counters.add("demotions")
                copied += 1
        self._reports.report(drop_candidates)
        if copied:
            log.info("close: persisted %d chunks to slower tiers in %.2f s", copied, time.monotonic() - started)
