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
* ``metrics`` (:class:`~kvshrink.store.metrics.StoreMetrics`, a Prometheus collector) counts raw and
  stored bytes per tier, times gets, puts and each tier's reads and writes, and exports ``stats()``;
  it wraps the tiers' methods on the instance, so no other module carries metrics code.

Buffers: ``put`` copies the caller's chunk into a staging buffer (or, with ``lend=True``, reads
it in place until its Future completes) and never modifies it; reads
write only into the ``out`` buffers given. Errors: the KVShrinkError family only; reads never
raise for a missing, corrupt or unreachable chunk (a miss), a put's Future fails with the error
of the tier that refused it, background failures are counted (``background_errors``) and logged.
Threads: any method may be called from any thread. Locks, outermost first: a tier's write lock
(``_write_locks[i]``: plan, evict and write of tier *i*), then the tiers' own locks; the ledger's
condition is only ever held for bookkeeping, never across a tier call (docs/store-consistency.md).

This class is a facade: the work is done by :class:`~kvshrink.store.write_path.WritePath` (write,
evict, demote, retire older copies), :class:`~kvshrink.store.copy_jobs.CopyJobs` (put, write-back,
promotion, prefetch and idle moves), :class:`~kvshrink.store.read_path.ReadPath` (reads and
lookups), :class:`~kvshrink.store.parking.RemoteParking` (chunks bound for Redis) and
:class:`~kvshrink.store.drop_reports.DropReports`, over a :class:`~kvshrink.store.tier_set.TierSet`.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Mapping, Sequence

from kvshrink.errors import StoreClosedError
from kvshrink.store.config import StoreConfig
from kvshrink.store.tier_registry import build_tier  # noqa: F401 (re-exported)
from kvshrink.store.copy_engine import CopyEngine
from kvshrink.store.copy_jobs import CopyJobs
from kvshrink.store.drop_reports import DropReports
from kvshrink.store.drops import DROP_COUNTERS, RECENT_DROPS, DropListener, DropListeners  # noqa: F401 (re-exported)
from kvshrink.store.idle import IdleDemoter, IdleTracker
from kvshrink.store.ledger import CopyLedger, Move, Parked  # noqa: F401 (re-exported)
from kvshrink.store.metrics import StoreMetrics
from kvshrink.store.parking import PUMP_RETRY_S, RemoteParking  # noqa: F401 (re-exported)
from kvshrink.store.pins import Pins
from kvshrink.store.placements import PlacementListener, PlacementListeners
from kvshrink.store.prefetch import PrefetchHandle, Prefetcher
from kvshrink.store.read_path import ReadPath
from kvshrink.store.tier_base import Tier, check_key
from kvshrink.store.tier_set import EVICTED_WAIT_S, READ_LOOKS, TierSet  # noqa: F401 (re-exported)
from kvshrink.store.write_path import WritePath


HINT_SHARE = 0.5  # most of the first tier one prefetch hint may fill (an arena holds 85-90 % in steady state, less when small)


class TieredStore:
    """Ordered tiers (fastest first) behind one asynchronous, crash-safe key -> chunk API."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self._pins = Pins()
        self._inflight: dict[bytes, Future] = {}  # puts queued or running, by key
        self._inflight_lock = threading.Lock()
        self.tiers: list[Tier] = []
        try:
            for tier_config in config.tiers:
                self.tiers.append(build_tier(tier_config, self._pins.__contains__))
        except BaseException:
            for tier in self.tiers:
                tier.close()
            raise
        self.metrics = StoreMetrics(self.tiers, self.stats)  # Prometheus: kvshrink.store.metrics
        for index, tier in enumerate(self.tiers):
            self.metrics.instrument(index, tier)
        tiers = TierSet(self.tiers, config.tiers)
        self._ledger = tiers.ledger
        self.engine = CopyEngine(config.engine)
        for tier in self.tiers:  # encodes and decodes on the store's codec budget
            tier.codecs = self.engine.codecs
        self._drops = DropListeners()
        self._drops.add(self.metrics.dropped)
        self._placements = PlacementListeners()
        self._closed = False
        reports = DropReports(tiers, self._drops, self._placements, self.engine.schedule)
        self._writes = WritePath(tiers, self.engine.counters, self._drops, self._placements)
        self._write_locks = self._writes.write_locks
        self._parking = RemoteParking(tiers, self._writes, reports, config.engine.staging_bytes, self.engine.schedule)
        self._jobs = CopyJobs(tiers, self._writes, reports, self.engine, self._pins)
        self._prefetch = Prefetcher(config.prefetch, self._jobs.prefetch_move, self.tiers[0].contains)
        self._idle: IdleTracker | None = None
        if config.idle_demotion.after_s > 0:
            self._idle = IdleTracker(self.tiers[0].keys())
        self._writes.parking, self._writes.prefetch, self._writes.idle = self._parking, self._prefetch, self._idle
        self._jobs.prefetch = self._prefetch
        self._reads = ReadPath(tiers, config, self.engine, reports, self._prefetch, self._idle, self._jobs.promote)
        self._tiers = tiers
        self._idle_demoter: IdleDemoter | None = None
        if self._idle is not None:
            self._idle_demoter = IdleDemoter(config.idle_demotion, self._idle, self._jobs.demote_idle)

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
        start = time.perf_counter()
        key = check_key(key)
        _require_open(self._closed)
        with self._inflight_lock:
            running = self._inflight.get(key)
        if running is not None:
            return running
        lent = self.engine.borrow(kv) if lend else None
        staged = (lent, None) if lent is not None else self.engine.stage(kv)
        if staged is None:
            self.engine.counters.add("dropped_staging_full")
            return self.metrics.observe_put(start, _done(False))
        chunk, buf = staged
        future = self.engine.puts.try_submit(self._jobs.store, key, chunk, buf)
        if future is None:
            if buf is not None:
                self.engine.staging.release(buf)
            self.engine.counters.add("dropped_queue_full")
            return self.metrics.observe_put(start, _done(False))
        self.metrics.observe_put(start, future)
        self.engine.counters.add("puts")
        with self._inflight_lock:
            self._inflight[key] = future

        def forget(done: Future) -> None:
            with self._inflight_lock:
                if self._inflight.get(key) is done:
                    del self._inflight[key]

        future.add_done_callback(forget)
        return future

    def in_flight(self, key: bytes) -> bool:
        """Whether a put of ``key`` is queued or running (LMCache's ``exists_in_put_tasks``)."""
        with self._inflight_lock:
            return key in self._inflight

    def prefetch(self, keys: Sequence[bytes]) -> PrefetchHandle:
        """Move the chunks of ``keys`` (prefix order) from slower tiers up to the first one, at most
        ``prefetch.max_in_flight`` at once; returns at once. Bounds, counters and what a read that
        overlaps a move does: :mod:`kvshrink.store.prefetch`. Keys are checked here
        (InvalidKeyError); StoreClosedError after close."""
        keys = [check_key(k) for k in keys]
        _require_open(self._closed)
        return self._prefetch.submit(keys, self._tiers.chunks_filling(HINT_SHARE))

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
        them, as many as the codec budget has tokens; chunks only a remote tier (Redis) may hold
        are fetched one per key on the reader pool, each decoded as it arrives (see
        :mod:`~kvshrink.store.read_path`). Threads: returns only once no lane writes into
        ``outs`` any more, also when it raises (the first error of any chunk's read, e.g. a
        buffer of the wrong size).
        """
        start = time.perf_counter()
        keys = [check_key(k) for k in keys]
        outs = list(outs) if outs is not None else [None] * len(keys)
        if len(outs) != len(keys):
            raise ValueError(f"get_many: {len(keys)} keys but {len(outs)} output buffers")
        _require_open(self._closed)
        chunks = self._reads.get_many(keys, outs)
        self.metrics.observe_get(start, chunks)
        return chunks

    def header(self, key: bytes) -> Any:
        """The stored chunk's frame header (dtype, shape, sizes) without decoding it, or None.
        Lets a caller allocate the right buffer before ``get_into``."""
        return self._reads.header(check_key(key))

    def contains(self, key: bytes) -> bool:
        """Whether some tier holds ``key`` (a remote answer may be stale by the time you read)."""
        return self.where(key) is not None

    def where(self, key: bytes) -> str | None:
        """Name of the fastest tier holding ``key`` (a parked chunk: the tier it is bound for)."""
        return self._reads.where(check_key(key))

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """``contains`` for a batch: local tiers first, then one round trip per remote tier."""
        return self._reads.contains_many([check_key(k) for k in keys])

    def keys(self, tier: str | None = None) -> list[bytes]:
        """Keys held by one tier (by name) or by any tier, without duplicates (a parked chunk
        counts for the tier it is bound for). Listing is best effort: an unreachable tier is
        logged and left out (its error is counted)."""
        return self._reads.keys(tier)

    # -- pinning and removal ---------------------------------------------------------------------
    def lock(self, keys: Sequence[bytes]) -> list[bool]:
        """Look keys up and pin the ones found so local tiers will not evict them until
        :meth:`unlock`. (A Redis-only chunk is reported but cannot be pinned: Redis evicts.)"""
        keys = [check_key(k) for k in keys]
        found = self.contains_many(keys)
        self._pins.pin([key for key, hit in zip(keys, found) if hit])
        return found

    def unlock(self, keys: Sequence[bytes]) -> None:
        """Undo one :meth:`lock` per key; unknown keys are ignored (unlock never fails)."""
        self._pins.unpin(keys)

    def delete(self, key: bytes) -> bool:
        """Remove ``key`` from every tier; True if some tier held it. Drop listeners are not
        told: the return value is the caller's notice. Copies in flight between tiers are
        abandoned; one already writing is waited for (a write-back landing just after the
        delete would bring the key back), so a delete may wait for one tier write."""
        key = check_key(key)
        self._prefetch.forget(key)
        with self._ledger.superseding(key, wait_for=range(len(self.tiers)), hide_in=()) as parked:
            held = [tier.delete(key) for tier in self.tiers]
        for index in self._tiers.remote:
            if held[index]:
                self._ledger.unhide(index, [key])
        self._placements.notify([key])
        return parked or any(held)

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
        """Counters per tier and for the copy engine (Prometheus: ``REGISTRY.register(store.metrics)``,
        :mod:`kvshrink.store.metrics`)."""
        engine = {**self.engine.stats(), **self._drops.counters.snapshot(), **self._placements.counters.snapshot(),
                  **self._prefetch.stats(), "pinned": len(self._pins)}
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
            self._parking.kick(force=True)

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
                self._jobs.persist_down()  # its evictions may park chunks bound for a remote tier
            self._parking.close()
        finally:
            for tier in self.tiers:
                tier.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _require_open(closed: bool) -> None:
    if closed:
        raise StoreClosedError("the store is closed")


def _done(value: bool) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
