"""The write protocol: write a frame into a tier, evict, demote what it evicts, retire older copies.

:class:`WritePath` is where every chunk enters a tier (a put, a demotion, a promotion, a
write-back, a parked chunk landing on its remote tier). The protocol, its states and its locks are
written out in ``docs/store-consistency.md``; in short:

* demote-then-evict: under tier *i*'s write lock the chunks a write will evict are copied below
  first (durably; bound for a remote tier: parked in memory), and only then evicted, so neither a
  crash nor a reader finds a chunk in no tier;
* a put, once its first put tier holds the new value, retires every older copy of the key
  (deleted from local tiers, hidden on remote ones; see :class:`~kvshrink.store.ledger.CopyLedger`);
* a chunk is never in two exclusive tiers (planned victims the write kept lose their copy below).

Results are returned (:class:`WriteOutcome`, :class:`Demotion`): the keys that may have left the
store are *drop candidates* the caller reports once it released every lock (so whichever writer
removes a key's last copy reports it). Threads: any thread; locks, outermost first: tier *i*'s
write lock, tier *i+1*'s (a demotion is a write below), ..., then the tiers' own locks; the
ledger's condition only for bookkeeping. Errors: a tier's refusal (KVShrinkError) propagates out
of a put's write; a failed demotion is counted, logged and makes the victim a drop candidate.
Buffers: frames are bytes-like owned by the caller for the duration of the call; tiers copy them.
"""

from __future__ import annotations

import logging
import threading
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from kvshrink.errors import KVShrinkError
from kvshrink.store import tier_codecs
from kvshrink.store.drops import DropListeners
from kvshrink.store.idle import IdleTracker
from kvshrink.store.ledger import Move
from kvshrink.store.placements import PlacementListeners
from kvshrink.store.stats import Counters
from kvshrink.store.tier_base import Victim
from kvshrink.store.tier_set import TierSet

if TYPE_CHECKING:
    from kvshrink.store.parking import RemoteParking
    from kvshrink.store.prefetch import Prefetcher

log = logging.getLogger(__name__)

Captured = tuple[bytes, "bytes | None", "Move | None"]  # a victim's key, its frame (None: nothing to copy), its move


@dataclass
class WriteOutcome:
    """What one tier write did: ``landed`` is False when a doomed move (a put of the key came
    after its frame was read) wrote nothing; ``drop_candidates`` are keys that may have left the
    store (last-tier victims, failed demotions), to check and report once no lock is held."""

    landed: bool
    drop_candidates: list[bytes] = field(default_factory=list)


@dataclass
class Demotion:
    """What a demotion of victims to the tier below did: the keys it ``copied`` there (written,
    or parked for a remote tier) and the ``drop_candidates`` it left."""

    copied: list[bytes] = field(default_factory=list)
    drop_candidates: list[bytes] = field(default_factory=list)


def drop_candidates_of(exc: BaseException) -> list[bytes]:
    """The drop candidates a refused :meth:`WritePath.write` made before the refusal (demotions of
    planned victims evict below), carried on its error so the caller can still report them."""
    return list(getattr(exc, "drop_candidates", ()))


class WritePath:
    """Writes into tiers with demote-then-evict, supersession of older copies and promotion
    hand-over; see the module docstring. ``parking``, ``prefetch`` and ``idle`` are set by the
    store once they exist (they are built around this object)."""

    def __init__(self, tiers: TierSet, counters: Counters, drops: DropListeners,
                 placements: PlacementListeners) -> None:
        self.tiers = tiers
        self.ledger = tiers.ledger
        self.counters = counters
        self.drops = drops
        self.placements = placements
        self.write_locks = [threading.Lock() for _ in tiers.tiers]
        self.parking: RemoteParking | None = None
        self.prefetch: Prefetcher | None = None
        self.idle: IdleTracker | None = None

    def write(self, index: int, key: bytes, frame: Any, move: Move | None = None, *,
              supersede: bool = False, promoted_from: int | None = None) -> WriteOutcome:
        """Write ``frame`` into tier ``index``; what it must evict is demoted to the tier below.

        Victims the plan did not foresee (the tier's plan changed meanwhile: reads, pins) are
        evicted first and demoted after; a read that misses one in between waits for that
        demotion. ``supersede`` (a put, into its first put tier): once written, retire every
        older copy of the key (a write that fails retires nothing). ``promoted_from``: a
        promotion out of that tier, which drops its copy once this one is written if it is
        exclusive. Raises the tier's KVShrinkError when it refused the write; the drop candidates
        the write made before that ride on the error (:func:`drop_candidates_of`)."""
        awaiting_demotion: list[bytes] = []  # unplanned victims readers wait for until they are demoted
        outcome = WriteOutcome(landed=True)
        try:
            return self._write_locked(index, key, frame, move, supersede, promoted_from, awaiting_demotion, outcome)
        except KVShrinkError as exc:
            exc.drop_candidates = outcome.drop_candidates  # type: ignore[attr-defined]  # see drop_candidates_of
            raise
        finally:
            if awaiting_demotion:
                self.ledger.evicted(awaiting_demotion)

    def _write_locked(self, index: int, key: bytes, frame: Any, move: Move | None, supersede: bool,
                      promoted_from: int | None, awaiting_demotion: list[bytes],
                      outcome: WriteOutcome) -> WriteOutcome:
        """``write`` up to the demotion of the unplanned victims (listed in ``awaiting_demotion``);
        ``outcome`` is the write's result, filled as it goes so a refusal still tells ``write``
        which keys the demotions before it may have dropped."""
        tier = self.tiers.tiers[index]
        last = index + 1 == len(self.tiers)
        with self.write_locks[index] if self._locked(index) else nullcontext():
            if move is not None and move.doomed:
                return WriteOutcome(landed=False)
            if promoted_from in self.tiers.local and not self.tiers.tiers[promoted_from].contains(key):
                return WriteOutcome(landed=False)  # dropped from there meanwhile: a promotion must not bring it back
            # a re-put of the value stored here is a refresh, not a rewrite: a full DRAM arena
            # frees the old block before the new one is indexed, and a read in between would
            # find no copy anywhere (an exclusive tier below has none)
            refresh = supersede and tier.holds_frame(key, frame)
            planned = [] if last or refresh else tier.plan_eviction(key, memoryview(frame).nbytes)
            planned_set = set(planned)
            demoted_first = Demotion()
            if planned:
                demoted_first = self.demote(index, self.capture(index, planned), count=False)
                outcome.drop_candidates += demoted_first.drop_candidates
            unnamed_victims = None if last else self.ledger.begin_victims()
            victims: list[Victim] = []
            try:
                with self.ledger.landing(move, key, index) as ok:
                    if not ok:
                        return WriteOutcome(landed=False, drop_candidates=outcome.drop_candidates)
                    if not refresh:
                        keep = False if last else partial(self._keep_unplanned, index, planned_set, awaiting_demotion)
                        victims = tier.write_frame(key, frame, keep_victims=keep, evict_first=planned)
                    self.ledger.landed(index, key, move)
                unplanned = [] if unnamed_victims is None else [
                    (v.key, v.frame, self.ledger.adopt(unnamed_victims, v.key))
                    for v in victims if v.key not in planned_set]
            finally:
                self.ledger.end(unnamed_victims)
                if demoted_first.copied:  # also when the write failed or was doomed: it evicted nothing then
                    self._settle_planned(index, demoted_first.copied, victims)
            if promoted_from is not None and not self._after_promotion(index, promoted_from, key, move):
                outcome.landed = False
                outcome.drop_candidates.append(key)
            if supersede:
                self._retire_older_copies(key, index)
        self._announce(index, key if outcome.landed else None, victims)
        if last:
            outcome.drop_candidates += [v.key for v in victims]
            return outcome
        # a planned victim copied (or found) below may have been evicted there meanwhile, by a
        # writer that then still saw it here: check it again once every lock is released
        if index + 1 in self.tiers.local:
            outcome.drop_candidates += [v.key for v in victims if v.key in planned_set]
        outcome.drop_candidates += self.demote(index, unplanned).drop_candidates
        return outcome

    def _announce(self, index: int, key: bytes | None, victims: list[Victim]) -> None:
        """Tell the listeners and the first tier's watchers that ``key`` went into tier ``index``
        (None: nothing stayed there) and ``victims`` left it."""
        stored = [] if key is None else [key]
        if key is not None:
            self.drops.stored(key)
        self.placements.notify([*stored, *(v.key for v in victims)])
        if index == 0:
            if self.prefetch is not None:
                self.prefetch.evicted([v.key for v in victims])
            if self.idle is not None:
                self.idle.touch(stored)

    def _settle_planned(self, index: int, copied: list[bytes], victims: list[Victim]) -> None:
        """Count the demotions of the planned victims of tier ``index`` that the write evicted,
        and undo the copies below of those it did not evict after all: pinned by a lookup
        between the plan and the write (the tier skips pinned chunks), no longer needed by the
        tier's plan, or the write failed or was doomed. They stay in tier ``index``; in an
        exclusive tier below, the copy goes (a parked one is recalled), so the chunk is in one
        tier and the budgets add up; a later eviction demotes it again. Called under tier
        ``index``'s write lock, so nothing else evicts it from there meanwhile. A key gone from
        tier ``index`` meanwhile (deleted, quarantined) keeps its copy below, which may be the
        only good one. A put or write-back tier below holds copies by design: nothing is undone."""
        below = index + 1
        evicted = {v.key for v in victims}
        undone: list[bytes] = []
        if below in self.tiers.exclusive:
            undone = [k for k in copied if k not in evicted and self.tiers.tiers[index].contains(k)]
        for key in undone:
            if below in self.tiers.remote:
                self.ledger.recall(key, below)
            else:
                self.tiers.tiers[below].delete(key)
        if below in self.tiers.local:  # a parked chunk counts as a demotion once it lands
            self.tiers.tiers[index].counters.add("demotions", len(copied) - len(undone))
        self.placements.notify(undone)

    def _keep_unplanned(self, index: int, planned: set[bytes], awaiting_demotion: list[bytes], key: bytes) -> bool:
        """keep_victims of a write into tier ``index`` (called by the tier, under its lock, for
        each victim): a victim the plan did not name, and the tier below lacks, is evicted before
        it is demoted; its frame is kept, and readers are told to wait for its demotion."""
        if key in planned or self.tiers.holds_current(index + 1, key):
            return False
        self.ledger.evicting(key)
        awaiting_demotion.append(key)
        return True

    def _locked(self, index: int) -> bool:
        """Whether writes into tier ``index`` take its write lock: every tier but the last, and
        a last tier that is the first put tier of several (so its puts exclude demotions into it)."""
        return index + 1 < len(self.tiers) or (index == self.tiers.put[0] and len(self.tiers) > 1)

    def _retire_older_copies(self, key: bytes, index: int) -> None:
        """In the ledger's superseding section for a put of ``key`` into tier ``index`` (moves of
        the key doomed, copies landing in local tiers waited for, the key hidden in remote tiers
        that are not put tiers): delete ``key`` from the local tiers that are not put tiers (a
        put tier gets the new value from this put), since what they hold is an older value.

        The new copy is readable in tier ``index`` already, but a read that looked there just
        before it landed and looks at the older copy's tier just after it went would miss a
        chunk stored throughout (a re-put of a chunk on an exclusive SSD). So the ledger's
        ``moved`` count goes up before each delete, as for a promotion: such a read looks again."""
        wait_for = sorted(set(self.tiers.local) | {index})
        hide_in = [t for t in self.tiers.remote if t not in self.tiers.put]
        with self.ledger.superseding(key, wait_for, hide_in):
            for t in self.tiers.local:
                if t != index and t not in self.tiers.put:
                    if self.tiers.tiers[t].contains(key):
                        self.ledger.note_moved()
                    self.tiers.tiers[t].delete(key)  # also when not indexed: an SSD rescan must not adopt it

    def _after_promotion(self, index: int, source: int, key: bytes, move: Move | None) -> bool:
        """A promotion of ``key`` out of tier ``source`` landed in tier ``index``: an exclusive
        source lets go of its copy (now that the faster tier holds it durably, so the chunk is
        always in one tier); a remote write-back source is known to hold the current value.

        False when a local source lost the key while it was copied (evicted or quarantined
        there: the chunk left the store, and a read in between missed it). The copy just written
        is taken back: a promotion must not resurrect a dropped chunk, or the drop's notice is
        never sent (the key is held again when it is checked) while that read missed. The
        caller reports the key as a drop candidate."""
        if move is not None and move.doomed:
            return True
        if source in self.tiers.local and not self.tiers.tiers[source].contains(key):
            self.tiers.tiers[index].delete(key)
            return False
        if source in self.tiers.exclusive:
            self.ledger.note_moved()  # before the copy goes: a read that missed both looks again
            if source in self.tiers.remote:
                self.ledger.hide(source, key)  # no Redis call here: the copy is hidden instead
            else:
                self.tiers.tiers[source].delete(key)
        elif source in self.tiers.remote:
            self.ledger.landed(source, key, move)
        return True

    def capture(self, index: int, keys: list[bytes]) -> list[Captured]:
        """The frames of planned victims ``keys`` of tier ``index``, each under a registered move
        (call with the tier's write lock held); none for a key the tier below holds already."""
        captured: list[Captured] = []
        for key in keys:
            if self.tiers.holds_current(index + 1, key):
                captured.append((key, None, None))
                continue
            move = self.ledger.begin(key)
            captured.append((key, self.tiers.tiers[index].read_frame(key), move))
        return captured

    def demote(self, index: int, victims: list[Captured], count: bool = True) -> Demotion:
        """Move victims of tier ``index`` (key, frame, move) to the tier below; ends each move.
        Counts the written ones as demotions unless ``count`` is False (the caller counts them)."""
        below = index + 1
        result = Demotion()
        for key, frame, move in victims:
            try:
                if self.tiers.holds_current(below, key):
                    if below in self.tiers.remote and not self.tiers.held_elsewhere(key, index):
                        self.ledger.forget_backed(below, key)
                    continue
                if move is not None and move.doomed:
                    continue  # a put of the key came after this frame was read: it must vanish
                if frame is None:
                    result.drop_candidates.append(key)  # nothing to move (file vanished, or gone before the plan ran)
                    continue
                if below in self.tiers.remote:
                    assert self.parking is not None
                    result.drop_candidates += self.parking.park(key, frame, index, move)
                    result.copied.append(key)
                    move = None  # the parked chunk owns it now
                    continue
                if self._demote_one(index, key, frame, move, result):
                    result.copied.append(key)
                    if count:
                        self.tiers.tiers[index].counters.add("demotions")
            finally:
                self.ledger.end(move)
        return result

    def _demote_one(self, index: int, key: bytes, frame: bytes, move: Move | None, result: Demotion) -> bool:
        """Write one victim of tier ``index`` into the local tier below; True if it landed. A
        refusal is counted and logged, and the key becomes a drop candidate of ``result``."""
        below = self.tiers.tiers[index + 1]
        try:
            written = self.write(index + 1, key, tier_codecs.convert(frame, below), move)
        except KVShrinkError as exc:
            self.counters.add("background_errors")
            log.warning("demotion of %s to tier %s failed: %s", key.hex()[:32], below.name, exc)
            result.drop_candidates += [*drop_candidates_of(exc), key]
            return False
        result.drop_candidates += written.drop_candidates
        return written.landed
