"""TieredStore: the public face of the store. Chunks flow engine -> store -> tiers -> codec.

* ``put`` stages the chunk and returns a Future at once; workers compress (per tier: raw frames
  for uncompressed tiers) and write it to the ``put`` tiers; the Future is True once it is durable
  there, False when the engine was full and dropped it (counted). Write-back to ``write_back``
  tiers follows in the background.
* A chunk evicted from tier *i* is demoted to tier *i+1* (unless already there), whose own
  evictions demote further; the last tier drops. Demotion runs on the worker that evicted.
* ``get`` / ``get_many`` / ``get_into`` read from the fastest tier holding the chunk; a hit below
  the first tier is promoted in the background. ``get_many`` reads chunks on different tiers in
  parallel and decodes in parallel into the caller's buffers.
* ``lock`` / ``unlock`` pin chunks in the local tiers (LMCache's lookup-and-lock); ``header`` gives
  a chunk's dtype and shape before the caller allocates.
* ``add_drop_listener`` tells an owner (an LMCache adapter mirroring the store's contents) which
  keys left the store on the store's own initiative; see :class:`DropListeners`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from kvshrink.errors import KVShrinkError, StoreUnavailableError
from kvshrink.store.config import StoreConfig, TierConfig
from kvshrink.store.engine import CopyEngine
from kvshrink.store.stats import Counters
from kvshrink.store.tier import Tier, Victim, check_key
from kvshrink.store import frames

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


DropListener = Callable[[list[bytes]], None]
DROP_COUNTERS = ("keys_dropped", "drop_listener_errors")
RECENT_DROPS = 4096  # keys remembered as reported, so racing removals of one key report it once


class DropListeners:
    """Who hears about keys that left the store without a ``delete()`` call.

    A key is *dropped* when a tier removed it on its own and afterwards no tier holds it: evicted
    from the last tier, evicted from a tier whose demotion below failed or had nothing to move,
    or quarantined (corrupt, or its file vanished) during a read. A demotion is not a drop, and
    neither is an eviction of a key that another tier (a write-back copy, Redis) still holds.

    ``delete()`` never fires listeners: its caller learns the outcome from its return value.
    Every removal is checked after it happens, so whoever removes a key's last copy reports it,
    and a key is reported once per drop: the last :data:`RECENT_DROPS` reported keys are
    remembered (until a tier takes the key again), so two racing removals (an eviction and a
    read that found the chunk gone) do not report it twice. What the check cannot rule out: a
    key removed by ``delete()`` at the same instant as an eviction may be reported too, and a
    key re-``put`` between the check and the report is reported although it is back. An owner
    that mirrors the store's contents therefore keeps its own set of announced keys and
    re-checks ``contains`` under its own lock before it reports (as the LMCache MP adapter
    does). Evictions Redis makes on its own (maxmemory, TTL) are invisible to the store and
    never reported; an unreachable Redis counts as not holding a key.

    Listeners get the keys (no sizes: a tier does not keep a victim's size) on the thread that
    removed them, a store worker or a reader, after the store released its locks; they must be
    quick and must not call ``put``/``flush``/``close`` of this store. An exception in a listener
    is logged and counted (``drop_listener_errors``), never raised into the store.
    """

    def __init__(self) -> None:
        self._listeners: list[DropListener] = []
        self._recent: dict[bytes, None] = {}  # reported keys, oldest first
        self._lock = threading.Lock()
        self.counters = Counters(DROP_COUNTERS)

    def add(self, listener: DropListener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove(self, listener: DropListener) -> None:
        """Stop calling ``listener``; unknown listeners are ignored."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def stored(self, key: bytes) -> None:
        """A tier took ``key`` (a put, a demotion): its next drop is news again."""
        with self._lock:
            self._recent.pop(key, None)

    def fire(self, keys: list[bytes]) -> None:
        """Count the ``keys`` not reported yet as dropped and tell every listener; never raises."""
        with self._lock:
            keys = [k for k in keys if k not in self._recent]
            self._recent.update(dict.fromkeys(keys))
            while len(self._recent) > RECENT_DROPS:
                del self._recent[next(iter(self._recent))]
            listeners = list(self._listeners)
        if not keys:
            return
        self.counters.add("keys_dropped", len(keys))
        for listener in listeners:
            try:
                listener(keys)
            except Exception:  # a listener bug must not kill a store worker or fail a put
                self.counters.add("drop_listener_errors")
                log.exception("drop listener %r failed on %d keys", listener, len(keys))


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
        self.engine = CopyEngine(config.engine)
        self._drops = DropListeners()
        self._closed = False

    @classmethod
    def from_config(cls, source: "str | Path | Mapping[str, Any] | StoreConfig") -> "TieredStore":
        """Build from a YAML path, a dict of the same structure, or a StoreConfig."""
        return cls(StoreConfig.load(source))

    # -- writes -----------------------------------------------------------------------------------
    def put(self, key: bytes, kv: Any) -> Future:
        """Store ``kv`` (numpy array or torch tensor, left untouched) under ``key``; never waits.

        The Future is True once the chunk is durable on the ``put`` tiers, False when the engine
        was full and dropped it; it fails with a KVShrinkError when a tier refused the write.
        A put of a key already in flight returns the in-flight Future.
        """
        key = check_key(key)
        self._check_open()
        with self._lock:
            running = self._inflight.get(key)
        if running is not None:
            return running
        staged = self.engine.stage(kv)
        if staged is None:
            self.engine.counters.add("dropped_staging_full")
            return _done(False)
        chunk, buf = staged
        future = self.engine.puts.try_submit(self._store_job, key, chunk, buf)
        if future is None:
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
            encoded = frames.FrameSet(chunk=chunk)
            for index in self._put_tiers:
                self._write(index, key, encoded.frame_for(self.tiers[index]), lost)
        except KVShrinkError:
            self.engine.counters.add("put_errors")
            raise
        finally:
            self.engine.staging.release(buf)
            self._report_dropped(lost)  # before the put's Future completes
        if self._write_back_tiers:
            self._schedule(self._copy_job, self._put_tiers[0], self._write_back_tiers, key)
        return True

    def _write(self, index: int, key: bytes, frame: Any, lost: list[bytes]) -> None:
        """Write a frame into tier ``index``; what it must evict is demoted to the tier below.

        Demote-then-evict: under the tier's write lock, the chunks the write will evict are
        first copied below (durably), and only then evicted (those first), so neither a crash
        nor a concurrent reader ever finds a chunk in no tier. Victims the plan did not foresee
        (a planned chunk pinned meanwhile) are demoted after. Keys that may have left the store
        (every victim not demoted by this call: last-tier victims, failed demotions, planned
        victims) are appended to ``lost``; the job checks and reports them once every lock is
        released, so whichever writer removes a key's last copy reports it.
        """
        tier = self.tiers[index]
        if index + 1 == len(self.tiers):
            lost += [v.key for v in tier.write_frame(key, frame)]
            self._drops.stored(key)
            return
        below = self.tiers[index + 1]
        with self._write_locks[index]:
            planned = tier.plan_eviction(key, memoryview(frame).nbytes)
            self._demote(index, [Victim(k, tier.read_frame(k)) for k in planned if not below.contains(k)], lost)
            early = set(planned)
            victims = tier.write_frame(key, frame, keep_victims=lambda k: k not in early, evict_first=planned)
        self._drops.stored(key)
        # a planned victim copied (or found) below may have been evicted there meanwhile, by a
        # writer that then still saw it here: check it again once every lock is released
        lost += [v.key for v in victims if v.key in early]
        self._demote(index, [v for v in victims if v.key not in early], lost)

    def _demote(self, index: int, victims: list[Victim], lost: list[bytes]) -> None:
        below = self.tiers[index + 1]
        for victim in victims:
            if below.contains(victim.key):
                continue  # already below (write-back)
            if victim.frame is None:
                lost.append(victim.key)  # nothing to move (file vanished, or gone before the plan ran)
                continue
            try:
                self._write(index + 1, victim.key, frames.convert(victim.frame, below), lost)
            except KVShrinkError as exc:
                self.engine.counters.add("background_errors")
                log.warning("demotion of %s to tier %s failed: %s", victim.key.hex()[:32], below.name, exc)
                lost.append(victim.key)
                continue
            self.tiers[index].counters.add("demotions")

    def _report_dropped(self, candidates: list[bytes]) -> None:
        """Fire the drop listeners for the ``candidates`` no tier holds any more. Call with no
        store lock held: the check may ask Redis, and listeners run on this thread."""
        if not candidates:
            return
        keys = list(dict.fromkeys(candidates))
        gone = [k for k, held in zip(keys, self.contains_many(keys)) if not held]
        if gone:
            self._drops.fire(gone)

    def _copy_job(self, source: int, targets: list[int], key: bytes) -> None:
        """Background copy of one chunk to other tiers (write-back down, promotion up),
        encoding it at most once per codec method."""
        targets = [t for t in targets if not self.tiers[t].contains(key)]
        if not targets:
            return
        frame = self.tiers[source].read_frame(key)
        if frame is None:
            return  # evicted meanwhile; the eviction demoted it
        converted = frames.FrameSet(frame=frame)
        lost: list[bytes] = []
        try:
            for target in targets:
                self._write(target, key, converted.frame_for(self.tiers[target]), lost)
        finally:
            self._report_dropped(lost)

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

        Chunks on different tiers are read at once (DRAM and SSD on the reader pool, one MGET
        per batch-reading tier) and decoded in parallel.
        """
        keys = [check_key(k) for k in keys]
        outs = list(outs) if outs is not None else [None] * len(keys)
        if len(outs) != len(keys):
            raise ValueError(f"get_many: {len(keys)} keys but {len(outs)} output buffers")
        self._check_open()
        results: list[Any] = [None] * len(keys)
        found_in: list[int | None] = [None] * len(keys)
        held = [self._held_locally(k) for k in keys]
        local = [i for i, here in enumerate(held) if here]
        remote = [i for i, here in enumerate(held) if not here]
        # the caller reads one local chunk itself (a single get never changes threads)
        pending = [self.engine.readers.submit(self._read_from, i, keys[i], outs[i]) for i in local[1:]]
        done = list(self._read_remote(keys, outs, remote))
        if local:
            done.append(self._read_from(local[0], keys[local[0]], outs[local[0]]))
        done += [future.result() for future in pending]
        for i, chunk, tier_index in done:
            results[i], found_in[i] = chunk, tier_index
            if tier_index and self.config.promote_on_hit and self._schedule(self._copy_job, tier_index, [0], keys[i]):
                self.engine.counters.add("promotions")
        # a chunk held when the read began but read as a miss was quarantined (or its file vanished)
        self._report_dropped([keys[i] for i in local if results[i] is None])
        return results

    def _held_locally(self, key: bytes) -> bool:
        """Whether a local (non-batch) tier holds ``key``; the others go to one batched fetch."""
        return any(t.contains(key) for t in self.tiers if not t.batch_reads)

    def _read_from(self, i: int, key: bytes, out: Any) -> tuple[int, Any, int | None]:
        """Try the tiers in order; the first hit wins. A tier that lacks the key counts a miss."""
        for index, tier in enumerate(self.tiers):
            chunk = tier.get(key, out)
            if chunk is not None:
                return i, chunk, index
        return i, None, None

    def _read_remote(self, keys: list[bytes], outs: list[Any], indices: list[int]):
        """Keys no local tier holds: one batched fetch per batch tier, parallel decodes."""
        for index, tier in enumerate(self.tiers):
            if not indices:
                return
            if not tier.batch_reads:
                for i in indices:
                    tier.counters.add("misses")
                continue
            fetched = tier.fetch_frames([keys[i] for i in indices])
            decodes = [(i, self.engine.readers.submit(tier.decode_frame, keys[i], frame, outs[i]))
                       for i, frame in zip(indices, fetched) if frame is not None]
            missing = {i for i, frame in zip(indices, fetched) if frame is None}
            for i in missing:
                tier.counters.add("misses")
            for i, future in decodes:
                chunk = future.result()
                if chunk is None:
                    missing.add(i)
                else:
                    yield i, chunk, index
            indices = sorted(missing)

    def header(self, key: bytes) -> Any:
        """The stored chunk's frame header (dtype, shape, sizes) without decoding it, or None.
        Lets a caller allocate the right buffer before ``get_into``."""
        key = check_key(key)
        for tier in self.tiers:
            found = tier.header(key)
            if found is not None:
                return found
        return None

    def contains(self, key: bytes) -> bool:
        """Whether some tier holds ``key`` (a remote answer may be stale by the time you read)."""
        key = check_key(key)
        return any(t.contains(key) for t in self.tiers)

    def where(self, key: bytes) -> str | None:
        """Name of the fastest tier holding ``key``."""
        key = check_key(key)
        return next((t.name for t in self.tiers if t.contains(key)), None)

    # -- pinning and removal ---------------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """``contains`` for a batch: local tiers first, then one round trip per remote tier."""
        keys = [check_key(k) for k in keys]
        found = [self._held_locally(k) for k in keys]
        for tier in self.tiers:
            missing = [i for i, hit in enumerate(found) if not hit]
            if tier.batch_reads and missing:
                for i, hit in zip(missing, tier.contains_many([keys[i] for i in missing])):
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
        told: the return value is the caller's notice."""
        key = check_key(key)
        return any([tier.delete(key) for tier in self.tiers])

    def keys(self, tier: str | None = None) -> list[bytes]:
        """Keys held by one tier (by name) or by any tier, without duplicates. Listing is best
        effort: an unreachable tier is logged and left out (its error is counted)."""
        found: dict[bytes, None] = {}
        for t in self.tiers:
            if tier is not None and t.name != tier:
                continue
            try:
                found.update(dict.fromkeys(t.keys()))
            except StoreUnavailableError as exc:
                log.warning("listing keys: %s", exc)
        return list(found)

    def add_drop_listener(self, listener: DropListener) -> None:
        """Call ``listener(keys)`` with keys that left the store by eviction or quarantine, once no
        tier holds them (never for ``delete()``); see :class:`DropListeners` for the contract."""
        self._drops.add(listener)

    def remove_drop_listener(self, listener: DropListener) -> None:
        self._drops.remove(listener)

    # -- lifecycle ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters per tier and for the copy engine (see stats.StoreCollector for Prometheus)."""
        with self._lock:
            pinned = len(self._pins)
        engine = {**self.engine.stats(), **self._drops.counters.snapshot(), "pinned": pinned}
        return {"tiers": {t.name: t.stats() for t in self.tiers}, "engine": engine}

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every put and background job queued so far (and the write-backs they
        queue) has finished; TimeoutError after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        lanes = (self.engine.puts, self.engine.background)
        while any(lane.pending() for lane in lanes):  # a finishing put may queue a write-back
            for lane in lanes:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not lane.wait_idle(left):
                    raise TimeoutError(f"store flush: {lane.name} jobs still running after {timeout} s")

    def close(self) -> None:
        """Finish queued work, then close every tier; stored chunks stay on their media."""
        if self._closed:
            return
        self._closed = True
        self.engine.close()
        try:
            if self.config.persist_on_close:
                self._persist_down()
        finally:
            for tier in self.tiers:
                tier.close()

    def _persist_down(self) -> None:
        """Copy every chunk that only tier *i* holds into tier *i+1*, oldest first, so that what
        the slower tier has to evict for them is the oldest too. Runs in ``close`` after the
        queues drained; a failed copy is counted and logged, the chunk stays where it was."""
        started, copied, lost = time.monotonic(), 0, []
        for index, (tier, below) in enumerate(zip(self.tiers, self.tiers[1:])):
            for key in tier.keys():
                if below.contains(key):
                    continue
                frame = tier.read_frame(key)
                if frame is None:
                    continue
                try:
                    self._write(index + 1, key, frames.convert(frame, below), lost)
                except KVShrinkError as exc:
                    self.engine.counters.add("background_errors")
                    log.warning("persisting %s to tier %s failed: %s", key.hex()[:32], below.name, exc)
                    continue
                tier.counters.add("demotions")
                copied += 1
        self._report_dropped(lost)
        if copied:
            log.info("close: persisted %d chunks to slower tiers in %.2f s", copied, time.monotonic() - started)

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise KVShrinkError("the store is closed")

    def _forget_inflight(self, key: bytes, future: Future) -> None:
        with self._lock:
            if self._inflight.get(key) is future:
                del self._inflight[key]
