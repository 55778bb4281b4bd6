"""TieredStore: the public face of the store. Chunks flow engine -> store -> tiers -> codec.

* ``put`` stages the chunk and returns a Future at once; workers compress (per tier: raw frames
  for uncompressed tiers) and write it to the ``put`` tiers; the Future is True once it is durable
  there, False when the engine was full and dropped it (counted). Write-back to ``write_back``
  tiers follows in the background. Before the Future is True, every older copy of the key in the
  other tiers is unreachable: deleted from local tiers, hidden on remote ones until overwritten
  (see :class:`~kvshrink.store.ledger.CopyLedger`). A put of the value a DRAM first tier holds
  already, byte for byte, refreshes it there instead of rewriting it (no moment without a copy).
* A chunk evicted from tier *i* is demoted to tier *i+1* unless that tier already holds its
  current value (a write-back copy), whose own evictions demote further; the last tier drops.
  Demotion to a local tier runs on the worker that evicted; demotion to a remote tier (Redis) is
  queued in the background, the chunk waiting in memory (*parked*, still readable; retried while
  Redis refuses it; at most ``engine.staging_bytes`` of them, beyond which the oldest are given
  up and reported dropped), so a slow or hung Redis never holds up a put to a faster tier.
* ``get`` / ``get_many`` / ``get_into`` read from the fastest tier holding the chunk; a hit below
  the first tier is promoted in the background: *moved* out of an exclusive tier (neither ``put``
  nor ``write_back``: the budgets add up), copied out of the others (they hold copies by design).
  ``get_many`` reads chunks on different tiers in parallel and decodes in parallel into the
  caller's buffers.
* ``prefetch(keys)`` moves chunks up to the first tier ahead of a read, bounded, on its own threads
  (a read of a chunk being moved waits for that move: :mod:`~kvshrink.store.prefetch`); with
  ``idle_demotion.after_s`` set, first-tier chunks idle that long move one tier down
  (:mod:`~kvshrink.store.idle`), never a pinned one.
* ``lock`` / ``unlock`` pin chunks in the local tiers (LMCache's lookup-and-lock); ``header`` gives
  a chunk's dtype and shape before the caller allocates.
* ``add_drop_listener`` tells an owner (an LMCache adapter mirroring the store's contents) which
  keys left the store on the store's own initiative; see :class:`~kvshrink.store.drops.DropListeners`.
  ``add_placement_listener`` tells one which keys may have changed tier (written into one, evicted,
  deleted, dropped), to ask ``where`` again; see :mod:`~kvshrink.store.placements`.

Buffers: ``put`` copies the caller's chunk into a staging buffer (or, with ``lend=True``, reads
it in place until its Future completes) and never modifies it; reads
write only into the ``out`` buffers given. Errors: the KVShrinkError family only; reads never
raise for a missing, corrupt or unreachable chunk (a miss), a put's Future fails with the error
of the tier that refused it, background failures are counted (``background_errors``) and logged.
Threads: any method may be called from any thread. Locks, outermost first: a tier's write lock
(``_write_locks[i]``: plan, evict and write of tier *i*), then the tiers' own locks; the ledger's
condition is only ever held for bookkeeping, never across a tier call.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future, wait
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from kvshrink.errors import KVShrinkError, StoreClosedError, StoreUnavailableError
from kvshrink.store.config import StoreConfig, TierConfig
from kvshrink.store.copy_engine import CopyEngine
from kvshrink.store.drops import DROP_COUNTERS, RECENT_DROPS, DropListener, DropListeners  # noqa: F401 (re-exported)
from kvshrink.store.ledger import PUMP_RETRY_S, CopyLedger, Move, Parked  # noqa: F401 (re-exported)
from kvshrink.store.idle import IdleDemoter, IdleTracker
from kvshrink.store.placements import PlacementListener, PlacementListeners
from kvshrink.store.prefetch import PrefetchHandle, Prefetcher
from kvshrink.store.tier_base import Tier, TierFullError, Victim, check_key
from kvshrink.store import tier_codecs

log = logging.getLogger(__name__)


def build_tier(config: TierConfig, is_pinned: Any) -> Tier:
    if config.kind == "dram":
        from kvshrink.store.dram import DramTier

        return DramTier(config, is_pinned)
    if config.kind == "ssd":
        from kvshrink.store.ssd import SsdTier

        return SsdTier(config, is_pinned)
    from kvshrink.store.redis_tier import RedisTier

    return RedisTier(config, is_pinned)


HINT_SHARE = 0.5  # most of the first tier one prefetch hint may fill (an arena holds 85-90 % in steady state, less when small)
READ_LOOKS = 3  # a read that missed everywhere while a chunk moved up looks again, this often at most
EVICTED_WAIT_S = 5.0  # longest a read waits for the demotion of a chunk evicted before it was copied


def _done(value: bool) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class TieredStore:
    """Ordered tiers (fastest first) behind one asynchronous, crash-safe key -> chunk API."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self._pins: Counter[bytes] = Counter()
        self._lock = threading.Lock()
        self._inflight: dict[bytes, Future] = {}
        self._read_lanes_busy = 0  # get_many lanes reserved now (under _lock): see _reserve_lanes
        self._write_locks = [threading.Lock() for _ in config.tiers]
        self.tiers: list[Tier] = []
        try:
            for tier_config in config.tiers:
                self.tiers.append(build_tier(tier_config, self._is_pinned))
        except BaseException:
            for tier in self.tiers:
                tier.close()
            raise
        self._put_tiers = [i for i, t in enumerate(config.tiers) if t.put]
        self._write_back_tiers = [i for i, t in enumerate(config.tiers) if t.write_back and not t.put]
        # neither put nor write_back: holds a chunk only instead of a faster tier (promotion moves)
        self._exclusive = {i for i, t in enumerate(config.tiers) if not t.put and not t.write_back}
        self._remote = [i for i, t in enumerate(self.tiers) if t.batch_reads]  # a round trip per call
        self._local = [i for i in range(len(self.tiers)) if i not in self._remote]
        self._ledger = CopyLedger(self._remote)
        self.engine = CopyEngine(config.engine)
        self._drops = DropListeners()
        self._placements = PlacementListeners()
        self._closed = False
        self._prefetch = Prefetcher(config.prefetch, self._prefetch_move, self.tiers[0].contains)
        self._idle: IdleTracker | None = None
        self._idle_demoter: IdleDemoter | None = None
        if config.idle_demotion.after_s > 0:
            self._idle = IdleTracker(self.tiers[0].keys())
            self._idle_demoter = IdleDemoter(config.idle_demotion, self._idle, self._demote_idle)

    @classmethod
    def from_config(cls, source: "str | Path | Mapping[str, Any] | StoreConfig") -> "TieredStore":
        """Build from a YAML path, a dict of the same structure, or a StoreConfig."""
        return cls(StoreConfig.load(source))

    # -- writes -----------------------------------------------------------------------------------
    def put(self, key: bytes, kv: Any, *, lend: bool = False) -> Future:
        """Store ``kv`` (numpy array or torch tensor, left untouched) under ``key``; never waits.

        The Future is True once the chunk is durable on the ``put`` tiers and no tier serves an
        older value of ``key`` any more, False when the engine was full and dropped it; it fails
        with a KVShrinkError when a tier refused the write. A put of a key already in flight
        returns the in-flight Future. ``kv`` is copied into a staging buffer before ``put``
        returns, unless ``lend``: then the caller keeps ``kv`` unchanged (and alive) until the
        Future completes, and the workers encode it where it lies (a chunk they cannot read in
        place, e.g. non-contiguous, is staged all the same).
        """
        key = check_key(key)
        self._check_open()
        with self._lock:
            running = self._inflight.get(key)
        if running is not None:
            return running
        lent = self.engine.borrow(kv) if lend else None
        staged = (lent, None) if lent is not None else self.engine.stage(kv)
        if staged is None:
            self.engine.counters.add("dropped_staging_full")
            return _done(False)
        chunk, buf = staged
        future = self.engine.puts.try_submit(self._store_job, key, chunk, buf)
        if future is None:
            if buf is not None:
                self.engine.staging.release(buf)
            self.engine.counters.add("dropped_queue_full")
            return _done(False)
        self.engine.counters.add("puts")
        with self._lock:
            self._inflight[key] = future
        future.add_done_callback(lambda f, k=key: self._forget_inflight(k, f))
        return future

    def in_flight(self, key: bytes) -> bool:
        """Whether a put of ``key`` is queued or running (LMCache's ``exists_in_put_tasks``)."""
        with self._lock:
            return key in self._inflight

    def _store_job(self, key: bytes, chunk: Any, buf: Any) -> bool:
        lost: list[bytes] = []
        try:
            encoded = tier_codecs.FrameSet(chunk=chunk)
            for n, index in enumerate(self._put_tiers):
                supersede = n == 0 and len(self.tiers) > 1
                self._write(index, key, encoded.frame_for(self.tiers[index]), lost, supersede=supersede)
        except KVShrinkError:
            self.engine.counters.add("put_errors")
            raise
        finally:
            if buf is not None:  # None: a lent chunk, the caller's
                self.engine.staging.release(buf)
            self._report_dropped(lost)  # before the put's Future completes
        if self._write_back_tiers:
            self._schedule(self._write_back_job, key)
        return True

    def _write(self, index: int, key: bytes, frame: Any, lost: list[bytes], move: Move | None = None, *,
               supersede: bool = False, promoted_from: int | None = None) -> bool:
        """Write a frame into tier ``index``; what it must evict is demoted to the tier below.
        Returns False when ``move`` was doomed (a put of the key came after its frame was read):
        nothing was written.

        Demote-then-evict: under the tier's write lock, the chunks the write will evict are
        first copied below (durably; to a remote tier: parked in memory), and only then evicted
        (those first), so neither a crash nor a concurrent reader ever finds a chunk in no tier.
        Victims the plan did not foresee (the tier's plan changed meanwhile: reads, pins) are
        demoted after; a read that misses one in between waits for that demotion. Planned
        victims the write did not evict (pinned meanwhile) lose their copy in an exclusive tier
        below again (:meth:`_settle_planned`): a chunk is never in two exclusive tiers.
        Keys that may have left the store (every victim not demoted by this call: last-tier
        victims, failed demotions, planned victims) are appended to ``lost``; the job checks and
        reports them once every lock is released, so whichever writer removes a key's last copy
        reports it. ``supersede`` (a put, into its first put tier): once written, retire every
        older copy of the key (see :class:`CopyLedger`; a write that fails retires nothing).
        ``promoted_from``: a promotion out of that tier, which drops its copy once this one is
        written if it is exclusive.
        """
        marked: list[bytes] = []  # unplanned victims readers wait for until they are demoted
        try:
            return self._write_locked(index, key, frame, lost, move, supersede, promoted_from, marked)
        finally:
            if marked:
                self._ledger.evicted(marked)

    def _write_locked(self, index: int, key: bytes, frame: Any, lost: list[bytes], move: Move | None,
                      supersede: bool, promoted_from: int | None, marked: list[bytes]) -> bool:
        """``_write`` up to the demotion of the unplanned victims (listed in ``marked``)."""
        tier = self.tiers[index]
        last = index + 1 == len(self.tiers)
        with self._write_locks[index] if self._locked(index) else nullcontext():
            if move is not None and move.doomed:
                return False
            if promoted_from in self._local and not self.tiers[promoted_from].contains(key):
                return False  # dropped from there meanwhile: a promotion must not bring it back
            # a re-put of the value stored here is a refresh, not a rewrite: a full DRAM arena
            # frees the old block before the new one is indexed, and a read in between would
            # find no copy anywhere (an exclusive tier below has none)
            refresh = supersede and tier.holds_frame(key, frame)
            planned = [] if last or refresh else tier.plan_eviction(key, memoryview(frame).nbytes)
            early = set(planned)
            copied = self._demote(index, self._capture(index, planned), lost, count=False) if planned else []
            unnamed = None if last else self._ledger.begin_victims()
            victims: list[Victim] = []
            try:
                with self._ledger.landing(move, key, index) as ok:
                    if not ok:
                        return False
                    if not refresh:
                        keep = False if last else partial(self._keep_unplanned, index, early, marked)
                        victims = tier.write_frame(key, frame, keep_victims=keep, evict_first=planned)
                    self._ledger.landed(index, key, move)
                later = [] if unnamed is None else [
                    (v.key, v.frame, self._ledger.adopt(unnamed, v.key)) for v in victims if v.key not in early]
            finally:
                self._ledger.end(unnamed)
                if copied:  # also when the write failed or was doomed: it evicted nothing then
                    self._settle_planned(index, copied, victims)
            if promoted_from is not None:
                self._after_promotion(promoted_from, key, move)
            if supersede:
                with self._superseding(key, index):
                    self._retire_older_copies(key, index)
        self._drops.stored(key)
        self._placements.notify([key, *(v.key for v in victims)])
        if index == 0:
            self._prefetch.evicted([v.key for v in victims])
            if self._idle is not None:
                self._idle.touch([key])
        if last:
            lost += [v.key for v in victims]
            return True
        # a planned victim copied (or found) below may have been evicted there meanwhile, by a
        # writer that then still saw it here: check it again once every lock is released
        if index + 1 in self._local:
            lost += [v.key for v in victims if v.key in early]
        self._demote(index, later, lost)
        return True

    def _settle_planned(self, index: int, copied: list[bytes], victims: list[Victim]) -> None:
        """Count the demotions of the planned victims of tier ``index`` that the write evicted,
        and undo the copies below of those it did not evict after all: pinned by a lookup
        between the plan and the write (the tier skips pinned chunks), no longer needed by the
        tier's plan, or the write failed or was doomed. They stay in tier ``index``; in an
        exclusive tier below, the copy goes (a parked one is recalled), so the chunk is in one
        tier and the budgets add up; a later eviction demotes it again. Called under tier
        ``index``'s write lock, so nothing else evicts it from there meanwhile: a read finds it
        there throughout. A key gone from tier ``index`` meanwhile (deleted, quarantined) keeps
        its copy below, which may be the only good one. A put or write-back tier below holds
        copies by design: nothing is undone there."""
        below = index + 1
        evicted = {v.key for v in victims}
        undone: list[bytes] = []
        if below in self._exclusive:
            undone = [k for k in copied if k not in evicted and self.tiers[index].contains(k)]
        for key in undone:
            if below in self._remote:
                self._ledger.recall(key, below)
            else:
                self.tiers[below].delete(key)
        if below in self._local:  # a parked chunk counts as a demotion once it lands
            self.tiers[index].counters.add("demotions", len(copied) - len(undone))
        self._placements.notify(undone)

    def _keep_unplanned(self, index: int, planned: set[bytes], marked: list[bytes], key: bytes) -> bool:
        """keep_victims of a write into tier ``index`` (called by the tier, under its lock, for
        each victim): a victim the plan did not name, and the tier below lacks, is evicted before
        it is demoted; its frame is kept, and readers are told to wait for its demotion."""
        if key in planned or self._holds_current(index + 1, key):
            return False
        self._ledger.evicting(key)
        marked.append(key)
        return True

    def _locked(self, index: int) -> bool:
        """Whether writes into tier ``index`` take its write lock: every tier but the last, and
        a last tier that is the first put tier of several (so its puts exclude demotions into it)."""
        return index + 1 < len(self.tiers) or (index == self._put_tiers[0] and len(self.tiers) > 1)

    def _superseding(self, key: bytes, index: int) -> Any:
        """The ledger's superseding section for a put of ``key`` into tier ``index``: wait for
        copies landing in local tiers (and in this one), hide the key in remote tiers that are not
        put tiers (a put tier gets the new value from this put)."""
        wait_for = sorted(set(self._local) | {index})
        hide_in = [t for t in self._remote if t not in self._put_tiers]
        return self._ledger.superseding(key, wait_for, hide_in)

    def _retire_older_copies(self, key: bytes, index: int) -> None:
        """Delete ``key`` from the local tiers that are not put tiers (a put tier gets the new
        value from this put): what they held is an older value. In the superseding section.

        The new copy is readable in tier ``index`` already, but a read that looked there just
        before it landed and looks at the older copy's tier just after it went would miss a
        chunk stored throughout (a re-put of a chunk on an exclusive SSD). So the ledger's
        ``moved`` count goes up before each delete, as for a promotion: such a read looks again."""
        for t in self._local:
            if t != index and t not in self._put_tiers:
                if self.tiers[t].contains(key):
                    self._ledger.note_moved()
                self.tiers[t].delete(key)  # also when not indexed: an SSD rescan must not adopt it

    def _after_promotion(self, source: int, key: bytes, move: Move | None) -> None:
        """A promotion of ``key`` out of tier ``source`` landed: an exclusive source lets go of
        its copy (now that the faster tier holds it durably, so the chunk is always in one tier);
        a remote write-back source is known to hold the current value."""
        if move is not None and move.doomed:
            return
        if source in self._exclusive:
            self._ledger.note_moved()  # before the copy goes: a read that missed both looks again
            if source in self._remote:
                self._ledger.hide(source, key)  # no Redis call here: the copy is hidden instead
            else:
                self.tiers[source].delete(key)
        elif source in self._remote:
            self._ledger.landed(source, key, move)

    def _capture(self, index: int, keys: list[bytes]) -> list[tuple[bytes, bytes | None, Move | None]]:
        """The frames of planned victims ``keys`` of tier ``index``, each under a registered move
        (call with the tier's write lock held); none for a key the tier below holds already."""
        captured = []
        for key in keys:
            if self._holds_current(index + 1, key):
                captured.append((key, None, None))
                continue
            move = self._ledger.begin(key)
            captured.append((key, self.tiers[index].read_frame(key), move))
        return captured

    def _holds_current(self, index: int, key: bytes) -> bool:
        """Whether tier ``index`` holds the current value of ``key``, without a remote round trip:
        a local tier's copy is current (puts delete older ones); a remote tier's is known."""
        if index in self._remote:
            return self._ledger.holds(index, key)
        return self.tiers[index].contains(key)

    def _demote(self, index: int, victims: list[tuple[bytes, bytes | None, Move | None]],
                lost: list[bytes], count: bool = True) -> list[bytes]:
        """Move victims of tier ``index`` (key, frame, move) to the tier below; ends each move.
        Returns the keys this call copied there (written, or parked for a remote tier); counts
        the written ones as demotions unless ``count`` is False (the caller counts them)."""
        below = index + 1
        copied: list[bytes] = []
        for key, frame, move in victims:
            try:
                if self._holds_current(below, key):
                    if below in self._remote and not self._held_elsewhere(key, index):
                        self._ledger.forget_backed(below, key)  # no local copy left to evict again
                    continue
                if move is not None and move.doomed:
                    continue  # a put of the key came after this frame was read: it must vanish
                if frame is None:
                    lost.append(key)  # nothing to move (file vanished, or gone before the plan ran)
                    continue
                if below in self._remote:
                    self._park(key, frame, index, move, lost)
                    copied.append(key)
                    move = None  # the parked chunk owns it now
                    continue
                try:
                    if not self._write(below, key, tier_codecs.convert(frame, self.tiers[below]), lost, move):
                        continue
                except KVShrinkError as exc:
                    self.engine.counters.add("background_errors")
                    log.warning("demotion of %s to tier %s failed: %s", key.hex()[:32], self.tiers[below].name, exc)
                    lost.append(key)
                    continue
                copied.append(key)
                if count:
                    self.tiers[index].counters.add("demotions")
            finally:
                self._ledger.end(move)
        return copied

    def _held_elsewhere(self, key: bytes, index: int) -> bool:
        return any(self.tiers[t].contains(key) for t in self._local if t != index)

    def _park(self, key: bytes, frame: bytes, source: int, move: Move | None, lost: list[bytes]) -> None:
        """Hold a victim of tier ``source`` bound for remote tier ``source + 1`` in memory (still
        readable) and make sure the pump will land it; takes over ``move``. Beyond the parking
        budget (``engine.staging_bytes``) the oldest parked chunks are given up: hidden there
        and appended to ``lost``."""
        entry = Parked(frame, source, source + 1, move, len(frame))
        for old_key, old in self._ledger.park(key, entry, self.config.engine.staging_bytes):
            self._give_up(old_key, old, "the parking budget is spent")
            lost.append(old_key)
        self._kick_pump()

    def _give_up(self, key: bytes, entry: Parked, why: str) -> None:
        """A parked chunk will not land: hide whatever its target holds under the key (a write
        that timed out may still apply), so that the drop report that follows is true."""
        self._ledger.hide(entry.target, key)
        self._ledger.end(entry.move)
        log.warning("demotion of %s to tier %s abandoned: %s", key.hex()[:32], self.tiers[entry.target].name, why)

    def _kick_pump(self, force: bool = False) -> None:
        """Queue the pump unless it is queued already (or refused lately, unless ``force``)."""
        if self._ledger.claim_pump(force) and not self._schedule(self._pump_job):
            self._ledger.release_pump(failed=False)  # the lane is full: the next park or flush retries

    def _pump_job(self) -> None:
        """Land parked chunks on their remote tiers, oldest first; each is unparked only once it
        landed, so a read finds it in one place or the other. The first refusal (the tier is down
        or hung) stops the run: the rest stay parked until the next try."""
        lost: list[bytes] = []
        failed = False
        try:
            while (item := self._ledger.oldest_parked()) is not None:
                key, entry = item
                target = self.tiers[entry.target]
                try:
                    entry.frame = tier_codecs.convert(entry.frame, target)
                except KVShrinkError as exc:  # a frame that fails to decode: nothing to land
                    self._ledger.unpark(key, entry)
                    self._give_up(key, entry, str(exc))
                    lost.append(key)
                    continue
                try:
                    landed = self._write(entry.target, key, entry.frame, lost, entry.move)
                except StoreUnavailableError as exc:
                    failed = True
                    log.warning("tier %s refused a parked chunk (%s); %d evicted chunks wait in memory",
                                target.name, exc, len(self._ledger.parked))
                    break
                self._ledger.unpark(key, entry)
                self._ledger.end(entry.move)
                if landed:
                    self.tiers[entry.source].counters.add("demotions")
        finally:
            self._ledger.release_pump(failed)
            self._report_dropped(lost)
        if not failed:
            self._kick_pump()  # parked while this run finished

    def _report_dropped(self, candidates: list[bytes]) -> None:
        """Fire the drop listeners for the ``candidates`` no tier holds any more; a key a remote
        tier may hold is checked with it in the background (see :class:`DropListeners`). Call
        with no store lock held: listeners run on this thread."""
        if not candidates:
            return
        self._placements.notify(candidates)
        gone, unsure = [], []
        for key in dict.fromkeys(candidates):
            if self._held_here(key):
                continue
            (unsure if any(not self._ledger.is_stale(t, key) for t in self._remote) else gone).append(key)
        if gone:
            self._drops.fire(gone)
        if unsure:
            self._schedule(self._check_drops_job, unsure)

    def _held_here(self, key: bytes) -> bool:
        """Held by a local tier, parked, or known to be held by a remote tier (no round trip)."""
        return self._held_locally(key) or any(self._ledger.holds(t, key) for t in self._remote)

    def _check_drops_job(self, keys: list[bytes]) -> None:
        """Ask the remote tiers about drop candidates; report those every tier answered it lacks.
        A tier that could not answer (it counted an error meanwhile) stops the check: no notice."""
        for index in self._remote:
            ask = [k for k in keys if not self._ledger.is_stale(index, k)]
            if not ask:
                continue
            tier = self.tiers[index]
            errors = tier.counters["errors"]
            held = tier.contains_many(ask)
            if tier.counters["errors"] != errors:
                log.info("tier %s did not answer; %d possibly dropped keys are not reported", tier.name, len(keys))
                return
            present = {k for k, here in zip(ask, held) if here}
            keys = [k for k in keys if k not in present]
        gone = [k for k in keys if not self._held_here(k)]
        if gone:
            self._drops.fire(gone)

    def _write_back_job(self, key: bytes) -> None:
        """Background copy of a put chunk from the first put tier to the write-back tiers that
        lack its current value, encoding it at most once per codec method."""
        targets = [t for t in self._write_back_tiers if not self._holds_current(t, key)]
        if not targets:
            return
        move = self._ledger.begin(key)
        lost: list[bytes] = []
        try:
            frame = self.tiers[self._put_tiers[0]].read_frame(key)
            if frame is None:
                return  # evicted meanwhile: the eviction demoted (or parked) it
            converted = tier_codecs.FrameSet(frame=frame)
            for target in targets:
                if not self._write(target, key, converted.frame_for(self.tiers[target]), lost, move):
                    return  # re-put meanwhile: that put's own write-back follows
        finally:
            self._ledger.end(move)
            self._report_dropped(lost)

    def _promote_job(self, source: int, key: bytes) -> None:
        """Background promotion of a hit in tier ``source`` to the first tier (see ``_write``)."""
        if self.tiers[0].contains(key) or self._ledger.is_stale(source, key):
            return  # promoted already, re-put, or hidden there meanwhile
        move = self._ledger.begin(key)
        lost: list[bytes] = []
        try:
            frame = self.tiers[source].read_frame(key)
            if frame is None:
                return  # evicted meanwhile
            self._write(0, key, tier_codecs.convert(frame, self.tiers[0]), lost, move, promoted_from=source)
        finally:
            self._ledger.end(move)
            self._report_dropped(lost)

    # -- prefetch and idle demotion ---------------------------------------------------------------
    def prefetch(self, keys: Sequence[bytes]) -> PrefetchHandle:
        """Move the chunks of ``keys`` (prefix order) from slower tiers up to the first one, at most
        ``prefetch.max_in_flight`` at once; returns at once. Bounds, counters and what a read that
        overlaps a move does: :mod:`kvshrink.store.prefetch`. Keys are checked here
        (InvalidKeyError); StoreClosedError after close."""
        keys = [check_key(k) for k in keys]
        self._check_open()
        return self._prefetch.submit(keys, self._prefetch_room())

    def _prefetch_room(self) -> int | None:
        """How many chunks one hint may move: what fills :data:`HINT_SHARE` of the first tier at
        the local tiers' mean chunk size (None: nothing stored yet to size them by). A hint bigger
        than the tier would evict its own first chunks before the read wants them."""
        held = [self.tiers[i].usage() for i in self._local]  # (bytes, chunks); a remote tier's costs a round trip
        stored, chunks = sum(b for b, _ in held), sum(c for _, c in held)
        if not chunks or not stored:
            return None
        return max(1, int(HINT_SHARE * self.tiers[0].capacity_bytes * chunks / stored))

    def _prefetch_move(self, key: bytes) -> str:
        """One prefetch move (on a prefetch thread): the chunk read from the fastest lower tier
        holding it and written into the first tier as a promotion (an exclusive source lets go of
        its copy once it landed). ``moved``, ``present``, ``missing`` or ``dropped`` (no room: the
        first tier is full of pinned chunks); any other refused write raises."""
        if self.tiers[0].contains(key):
            return "present"
        move = self._ledger.begin(key)
        lost: list[bytes] = []
        try:
            for index in range(1, len(self.tiers)):
                if index in self._remote and self._ledger.is_stale(index, key):
                    continue
                if index in self._local and not self.tiers[index].contains(key):
                    continue
                frame = self.tiers[index].read_frame(key)
                if frame is None:
                    continue  # evicted meanwhile, or not there (a remote tier is asked only here)
                try:
                    landed = self._write(0, key, tier_codecs.convert(frame, self.tiers[0]), lost, move,
                                         promoted_from=index)
                except TierFullError:
                    return "dropped"  # the tier logged and counted it; the chunk stays below
                return "moved" if landed else "missing"
            return "missing"
        finally:
            self._ledger.end(move)
            self._report_dropped(lost)

    def _demote_idle(self, key: bytes) -> str:
        """Move an idle chunk of the first tier one tier down (on the idle thread): copied below
        first, then removed here, under the first tier's write lock, so a put of the key waits and
        a reader finds it in one tier or the other. Never a pinned chunk, nor one with a prefetch
        queued or running. ``demoted``, ``pinned``, ``gone`` or ``failed``."""
        lost: list[bytes] = []
        try:
            with self._write_locks[0]:
                if self._is_pinned(key) or self._prefetch.busy(key):
                    return "pinned"
                if not self.tiers[0].contains(key):
                    return "gone"
                captured = self._capture(0, [key])
                self._demote(0, captured, lost)
                if not (self._holds_current(1, key) or self._ledger.parked_frame(key, 1) is not None):
                    return "failed"  # the tier below refused it (counted there): it stays here
                with self._lock:  # lock() pins under this lock: pinned from now on, it stays here
                    if key in self._pins:
                        if captured[0][1] is not None and 1 in self._local:
                            self.tiers[1].delete(key)  # the copy this made: the chunk stays in one tier
                        return "pinned"
                    self.tiers[0].delete(key)
        finally:
            self._report_dropped(lost)
        self._placements.notify([key])
        self._prefetch.evicted([key])
        return "demoted"

    def _schedule(self, job: Any, *args: Any) -> bool:
        """Queue a background job; False (counted) when the background lane is full."""
        future = self.engine.background.try_submit(job, *args)
        if future is None:
            self.engine.counters.add("background_dropped")
            return False
        self.engine.counters.add("background_jobs")
        future.add_done_callback(self._count_background_failure)
        return True

    def _count_background_failure(self, future: Future) -> None:
        exc = future.exception()
        if exc is not None:
            self.engine.counters.add("background_errors")
            if not isinstance(exc, KVShrinkError):
                log.error("background store job failed", exc_info=exc)

    # -- reads ------------------------------------------------------------------------------------
    def get(self, key: bytes, out: Any = None) -> Any:
        """The chunk, bit-exact (decoded into ``out`` when given), or None on a miss."""
        return self.get_many([key], None if out is None else [out])[0]

    def get_into(self, key: bytes, out: Any) -> bool:
        """Decode ``key`` into the caller's buffer; True on a hit."""
        return self.get(key, out) is not None

    def get_many(self, keys: Sequence[bytes], outs: Sequence[Any] | None = None) -> list[Any]:
        """Chunks for ``keys`` (None for misses); with ``outs``, decoded into those buffers.

        Local chunks (DRAM, SSD) are read and decoded on a few lanes, the caller's thread among
        them, each taking the next chunk until none is left: as many lanes as the codec budget
        has tokens (see :meth:`_reserve_lanes`), each decoding its chunk alone while there are
        chunks for every lane, so a batch neither hands blocks to helpers nor queues more
        threads than there are tokens (a single chunk, and the last few when no other batch
        reads, decode block-parallel; see :meth:`_drain_reads`). Chunks of a batch-reading tier
        (Redis) are fetched one per key on the reader pool, each decoded as it arrives.
        Threads: returns only once no lane writes into ``outs`` any more, also when it raises
        (the first error of any chunk's read, e.g. a buffer of the wrong size).
        """
        keys = [check_key(k) for k in keys]
        outs = list(outs) if outs is not None else [None] * len(keys)
        if len(outs) != len(keys):
            raise ValueError(f"get_many: {len(keys)} keys but {len(outs)} output buffers")
        self._check_open()
        self._prefetch.before_read(keys)  # wait for moves running, take queued ones over
        results: list[Any] = [None] * len(keys)
        found_in: list[int | None] = [None] * len(keys)
        held = [self._held_locally(k) for k in keys]
        local = [i for i, here in enumerate(held) if here]
        remote = [i for i, here in enumerate(held) if not here]
        lanes, crowded = self._reserve_lanes([keys[i] for i in local])
        # lanes pull local chunks from one counter, the caller's among them (a single get never
        # changes threads); see _drain_reads for which decodes run alone
        take = itertools.count().__next__
        drain = partial(self._drain_reads, take, local, keys, outs, lanes, crowded)
        pending = []
        try:
            for _ in range(lanes - 1):
                pending.append(self.engine.readers.submit(drain))
        except RuntimeError:  # the pool shut down (a close racing this read): the caller reads more
            self._release_lanes(lanes - 1 - len(pending))
        try:
            done = list(self._read_remote(keys, outs, remote))
            if lanes:
                done += drain()
        finally:
            wait(pending)  # no lane writes into the caller's buffers once this returns or raises
        for future in pending:
            done += future.result()
        for i, chunk, tier_index in done:
            results[i], found_in[i] = chunk, tier_index
            if tier_index and self.config.promote_on_hit and self._schedule(self._promote_job, tier_index, keys[i]):
                self.engine.counters.add("promotions")
        first = [keys[i] for i, chunk in enumerate(results) if chunk is not None and found_in[i] == 0]
        self._prefetch.read(first)
        if self._idle is not None:
            self._idle.touch(first)
        # a chunk held when the read began but read as a miss was quarantined (or its file vanished)
        self._report_dropped([keys[i] for i in local if results[i] is None])
        return results

    def _reserve_lanes(self, keys: list[bytes]) -> tuple[int, bool]:
        """Threads that read ``keys`` (held locally) at once, the caller included, counted as
        busy until each lane ends (:meth:`_drain_reads`): as many as the codec budget has
        tokens, plus one reading ahead when some chunk waits on a device (its read overlaps the
        decodes), less the lanes other reads run now, at most ``engine.read_workers + 1``.
        More would only queue for tokens: each chunk's decode would then end by waking a waiting
        thread, which on a small host costs more than it gains. Also whether other reads held
        lanes already (``crowded``: then no decode of this batch hands blocks to helpers)."""
        from kvshrink.codec.cpu_budget import budget

        cap = 1
        if len(keys) > 1:
            device = [t for t in self._local if self.tiers[t].device_reads]
            ahead = 1 if device and any(self.tiers[t].contains(k) for k in keys for t in device) else 0
            cap = min(budget().limit() + ahead, self.config.engine.read_workers + 1)
        with self._lock:
            crowded = self._read_lanes_busy > 0
            lanes = min(len(keys), max(1, cap - self._read_lanes_busy))
            self._read_lanes_busy += lanes
        return lanes, crowded

    def _release_lanes(self, n: int) -> None:
        with self._lock:
            self._read_lanes_busy -= n

    def _drain_reads(self, take: Callable[[], int], local: list[int], keys: list[bytes], outs: list[Any],
                     lanes: int, crowded: bool) -> list[tuple[int, Any, int | None]]:
        """One of the ``lanes`` read lanes of ``get_many`` (reserved by :meth:`_reserve_lanes`;
        released here): ``_read_from`` the chunks ``local[take()]`` until none is left (``take``
        is shared: each chunk is read once). While there are chunks for every lane, or other
        reads run lanes too (``crowded``), each is decoded alone (serial); else the last few
        block-parallel, so the tokens of lanes that ran out of chunks help finish them."""
        done = []
        try:
            while (j := take()) < len(local):
                i = local[j]
                serial = crowded or len(local) - j >= lanes > 1
                done.append(self._read_from(i, keys[i], outs[i], serial))
        finally:
            self._release_lanes(1)
        return done

    def _held_locally(self, key: bytes) -> bool:
        """Whether a local (non-batch) tier holds ``key``, or it is parked on its way to a remote
        one; the others go to one batched fetch. Looked at in the order chunks flow down (so a
        demotion, which copies before it evicts, is never missed) and again if a chunk moved up
        meanwhile."""
        return self._settled(key, lambda: any(self.tiers[t].contains(key) for t in self._local)
                             or self._ledger.parked_frame(key) is not None)

    def _settled(self, key: bytes, look: Callable[[], Any]) -> Any:
        """``look()`` for ``key``; looked again (a few times at most) while it finds nothing and
        a chunk moved meanwhile (up, out of the parking, or evicted before its demotion, which
        is waited for): a look tier by tier could have passed it."""
        for _ in range(READ_LOOKS):
            moved = self._ledger.moved
            found = look()
            if found:
                return found
            if not self._ledger.wait_evicted(key, EVICTED_WAIT_S) and self._ledger.moved == moved:
                return found
        return found

    def _read_from(self, i: int, key: bytes, out: Any, serial: bool = False) -> tuple[int, Any, int | None]:
        """Try the tiers in order; the first hit wins. A tier that lacks the key counts a miss.
        A parked chunk is read from memory (reported as found in no tier: nothing to promote).
        ``serial``: decode on this thread alone (see :meth:`Tier.decode_frame`)."""
        def look() -> tuple[Any, int | None] | None:
            for index, tier in enumerate(self.tiers):
                parked = self._ledger.parked_frame(key, index)
                if parked is not None:
                    chunk = _decode(parked, out)
                    if chunk is not None:
                        return chunk, None
                if index in self._remote and self._ledger.is_stale(index, key):
                    continue
                chunk = tier.get(key, out, serial=serial)
                if chunk is not None:
                    return chunk, index
            return None

        found = self._settled(key, look)
        return (i, None, None) if found is None else (i, *found)

    def _read_remote(self, keys: list[bytes], outs: list[Any], indices: list[int]):
        """Keys no local tier holds, from each batch tier in turn: one fetch per key on the reader
        pool, each decoded as soon as it arrives, so decodes overlap the transfers still on the
        wire (one batched fetch would hold every decode back until its last byte arrived; where
        the link is the limit, that costs the compression's gain)."""
        for index, tier in enumerate(self.tiers):
            if not indices:
                return
            if not tier.batch_reads:
                for i in indices:
                    tier.counters.add("misses")
                continue
            ask = [i for i in indices if not self._ledger.is_stale(index, keys[i])]
            reads = [self.engine.readers.submit(self._fetch_decode, tier, keys[i], outs[i]) for i in ask]
            missing = set(indices) - set(ask)
            for i, read in zip(ask, reads):
                chunk = read.result()
                if chunk is None:
                    missing.add(i)
                else:
                    yield i, chunk, index
            for i in set(indices) - set(ask):
                tier.counters.add("misses")
            indices = sorted(missing)

    @staticmethod
    def _fetch_decode(tier: Tier, key: bytes, out: Any) -> Any:
        """One chunk of a batch tier, decoded into ``out``; None for a miss (counted) or a corrupt
        frame (the tier counts and quarantines it)."""
        (frame,) = tier.fetch_frames([key])
        if frame is None:
            tier.counters.add("misses")
            return None
        return tier.decode_frame(key, frame, out)

    def header(self, key: bytes) -> Any:
        """The stored chunk's frame header (dtype, shape, sizes) without decoding it, or None.
        Lets a caller allocate the right buffer before ``get_into``."""
        from kvshrink.codec import CodecError, read_header

        key = check_key(key)

        def look() -> Any:
            for index, tier in enumerate(self.tiers):
                parked = self._ledger.parked_frame(key, index)
                if parked is not None:
                    try:
                        return read_header(parked)
                    except CodecError:
                        pass
                if index in self._remote and self._ledger.is_stale(index, key):
                    continue
                found = tier.header(key)
                if found is not None:
                    return found
            return None

        return self._settled(key, look)

    def contains(self, key: bytes) -> bool:
        """Whether some tier holds ``key`` (a remote answer may be stale by the time you read)."""
        return self.where(key) is not None

    def where(self, key: bytes) -> str | None:
        """Name of the fastest tier holding ``key`` (a parked chunk: the tier it is bound for)."""
        key = check_key(key)

        def look() -> str | None:
            for index, tier in enumerate(self.tiers):
                if self._ledger.parked_frame(key, index) is not None:
                    return tier.name
                if index in self._remote and self._ledger.is_stale(index, key):
                    continue
                if tier.contains(key):
                    return tier.name
            return None

        return self._settled(key, look)

    # -- pinning and removal ---------------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """``contains`` for a batch: local tiers first, then one round trip per remote tier."""
        keys = [check_key(k) for k in keys]
        found = [self._held_locally(k) for k in keys]
        for index in self._remote:
            missing = [i for i, hit in enumerate(found) if not hit and not self._ledger.is_stale(index, keys[i])]
            if missing:
                for i, hit in zip(missing, self.tiers[index].contains_many([keys[i] for i in missing])):
                    found[i] = hit
        return found

    def lock(self, keys: Sequence[bytes]) -> list[bool]:
        """Look keys up and pin the ones found so local tiers will not evict them until
        :meth:`unlock`. (A Redis-only chunk is reported but cannot be pinned: Redis evicts.)"""
        keys = [check_key(k) for k in keys]
        found = self.contains_many(keys)
        with self._lock:
            for key, hit in zip(keys, found):
                if hit:
                    self._pins[key] += 1
        return found

    def unlock(self, keys: Sequence[bytes]) -> None:
        """Undo one :meth:`lock` per key; unknown keys are ignored (unlock never fails)."""
        with self._lock:
            for key in keys:
                key = bytes(key)
                if self._pins[key] > 1:
                    self._pins[key] -= 1
                else:
                    self._pins.pop(key, None)

    def _is_pinned(self, key: bytes) -> bool:
        return key in self._pins

    def delete(self, key: bytes) -> bool:
        """Remove ``key`` from every tier; True if some tier held it. Drop listeners are not
        told: the return value is the caller's notice. Copies in flight between tiers are
        abandoned (one already writing may still land)."""
        key = check_key(key)
        self._prefetch.forget(key)
        parked = self._ledger.forget(key)
        held = [tier.delete(key) for tier in self.tiers]
        for index in self._remote:
            if held[index]:
                self._ledger.unhide(index, [key])
        self._placements.notify([key])
        return parked or any(held)

    def keys(self, tier: str | None = None) -> list[bytes]:
        """Keys held by one tier (by name) or by any tier, without duplicates (a parked chunk
        counts for the tier it is bound for). Listing is best effort: an unreachable tier is
        logged and left out (its error is counted)."""
        found: dict[bytes, None] = {}
        for index, t in enumerate(self.tiers):
            if tier is not None and t.name != tier:
                continue
            try:
                listed = t.keys()
            except StoreUnavailableError as exc:
                log.warning("listing keys: %s", exc)
                listed = []
            if index in self._remote:
                listed = [k for k in listed if not self._ledger.is_stale(index, k)]
            found.update(dict.fromkeys(listed))
            found.update(dict.fromkeys(self._ledger.parked_keys(index)))
        return list(found)

    def add_drop_listener(self, listener: DropListener) -> None:
        """Call ``listener(keys)`` with keys that left the store by eviction or quarantine, once no
        tier holds them (never for ``delete()``); see :class:`DropListeners` for the contract."""
        self._drops.add(listener)

    def remove_drop_listener(self, listener: DropListener) -> None:
        self._drops.remove(listener)

    def add_placement_listener(self, listener: PlacementListener) -> None:
        """Call ``listener(keys)`` with keys whose tiers may have changed (a hint to ask ``where``
        again); it runs on store threads, maybe under a tier's lock: it must only enqueue them."""
        self._placements.add(listener)

    def remove_placement_listener(self, listener: PlacementListener) -> None:
        self._placements.remove(listener)

    # -- lifecycle ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters per tier and for the copy engine (see stats.StoreCollector for Prometheus)."""
        with self._lock:
            pinned = len(self._pins)
        engine = {**self.engine.stats(), **self._drops.counters.snapshot(), **self._placements.counters.snapshot(),
                  **self._prefetch.stats(), "pinned": pinned}
        if self._idle_demoter is not None:
            engine.update(self._idle_demoter.stats())
        return {"tiers": {t.name: t.stats() for t in self.tiers}, "engine": engine}

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every put and background job queued so far (and the write-backs they
        queue) has finished, and parked chunks had one more try at their remote tier (those it
        refuses stay parked, readable), and prefetch moves queued so far; TimeoutError after
        ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._prefetch.wait_idle(timeout):
            raise TimeoutError(f"store flush: prefetch moves still running after {timeout} s")
        lanes = (self.engine.puts, self.engine.background)
        pumped = False
        while True:
            while any(lane.pending() for lane in lanes):  # a finishing put may queue a write-back
                for lane in lanes:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    if not lane.wait_idle(left):
                        raise TimeoutError(f"store flush: {lane.name} jobs still running after {timeout} s")
            if pumped or not self._ledger.parked:
                return
            pumped = True
            self._kick_pump(force=True)

    def close(self) -> None:
        """Finish queued work, then close every tier; stored chunks stay on their media. Parked
        chunks get a last try at their remote tier (those it refuses are dropped, and reported);
        older copies still hidden on remote tiers are deleted there (best effort)."""
        if self._closed:
            return
        self._closed = True
        if self._idle_demoter is not None:
            self._idle_demoter.close()
        self._prefetch.close()
        self.engine.close()
        try:
            if self.config.persist_on_close:
                self._persist_down()  # its evictions may park chunks bound for a remote tier
            if self._ledger.parked:
                self._pump_job()
                self._give_up_parked()
            self._delete_hidden()
        finally:
            for tier in self.tiers:
                tier.close()

    def _give_up_parked(self) -> None:
        """At close: what is still parked will not land; report it dropped."""
        lost = []
        while (item := self._ledger.oldest_parked()) is not None:
            key, entry = item
            self._ledger.unpark(key, entry)
            self._give_up(key, entry, "the store closed while the tier refused it")
            lost.append(key)
        self._report_dropped(lost)

    def _persist_down(self) -> None:
        """Copy every chunk that only tier *i* holds into tier *i+1*, oldest first, so that what
        the slower tier has to evict for them is the oldest too. Runs in ``close`` after the
        queues drained; a failed copy is counted and logged, the chunk stays where it was (and
        after one failure on a remote tier, the rest are not tried: each would wait its timeout)."""
        started, copied, lost = time.monotonic(), 0, []
        for index, (tier, below) in enumerate(zip(self.tiers, self.tiers[1:])):
            for key in tier.keys():
                if self._holds_current(index + 1, key):
                    continue
                frame = tier.read_frame(key)
                if frame is None:
                    continue
                try:
                    self._write(index + 1, key, tier_codecs.convert(frame, below), lost)
                except KVShrinkError as exc:
                    self.engine.counters.add("background_errors")
                    log.warning("persisting %s to tier %s failed: %s", key.hex()[:32], below.name, exc)
                    if index + 1 in self._remote:
                        break
                    continue
                tier.counters.add("demotions")
                copied += 1
        self._report_dropped(lost)
        if copied:
            log.info("close: persisted %d chunks to slower tiers in %.2f s", copied, time.monotonic() - started)

    def _delete_hidden(self) -> None:
        """Delete from each remote tier the older copies the ledger hides there, so that the next
        process (which knows nothing of them) does not serve them; stops at the first error."""
        for index in self._remote:
            tier = self.tiers[index]
            for key in list(self._ledger.stale[index]):
                errors = tier.counters["errors"]
                tier.delete(key)
                if tier.counters["errors"] != errors:
                    log.warning("close: tier %s unreachable; %d older copies stay there",
                                tier.name, len(self._ledger.stale[index]))
                    break
                self._ledger.unhide(index, [key])

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed")

    def _forget_inflight(self, key: bytes, future: Future) -> None:
        with self._lock:
            if self._inflight.get(key) is future:
                del self._inflight[key]


def _decode(frame: bytes, out: Any) -> Any:
    """A parked frame decoded (into ``out`` when given); None if it does not decode."""
    from kvshrink.codec import CodecError, decode

    try:
        return decode(frame, out=out)
    except CodecError:
        return None
