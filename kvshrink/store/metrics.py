"""Prometheus metrics of one :class:`~kvshrink.store.tiered.TieredStore`: bytes in and resident per
tier (raw and as stored, so the live compression ratio and the bytes saved are one division),
latency histograms, chunk losses per tier, and every counter of ``stats()``.

Every store owns a :class:`StoreMetrics` (``store.metrics``), a ``prometheus_client`` collector:
``REGISTRY.register(store.metrics)`` exports it all. The names and what they mean are listed in
``docs/observability.md``; the dashboard built on them is ``docs/grafana/kvshrink-dashboard.json``.

How it is measured. The store wraps each tier's ``write_frame``, ``get``, ``fetch_frames`` (remote
tiers) and ``quarantine`` on the instance (:meth:`StoreMetrics.instrument`), so the tiers, the
write path and the read path carry no metrics code:

* a frame written into a tier adds its header's ``raw_size`` to ``..._raw_bytes_in_total`` and its
  length (the bytes after the codec) to ``..._stored_bytes_in_total``, and times the write;
* resident bytes as stored are the tier's own ``usage()`` (exact). Resident *raw* bytes are the
  stored bytes times the tier's resident ratio: writes add their exact raw and stored sizes, and
  bytes that left the tier (evicted, deleted, moved) are taken to have had the tier's average ratio
  (a tier keeps no per-chunk raw size, and one per chunk here would cost ~100 bytes each). So the
  gauge is exact while nothing left the tier (also when a scrape falls in a write: it folds in what
  left only when no write was in flight) and never drifts from ``usage()``. Chunks the tier held
  when the store opened (an SSD directory, a kept DRAM arena) get the ratio of a few of them read
  at the first scrape. A Redis tier reports no usage (Redis evicts on its own): no gauge;
* reads are timed per tier (``get`` of a local tier: read and decode; ``fetch_frames`` of a remote
  one: the round trip) with ``result`` hit / miss, and per call at the facade (``get_many``);
  puts from the call to their Future's result (queueing, encoding, the write to the put tiers);
* a chunk that left the store (a drop notice) is attributed to the tier that last evicted or
  quarantined it since it was last written (a parked chunk given up: the tier that evicted it),
  else to ``tier="unknown"``, reason ``other`` (a file that vanished, a key Redis lost).

Export paths. ``lmcache server`` (multiprocess mode) serves prometheus_client's default registry
on its HTTP port (``/metrics``, 8080): the L2 adapter registers ``store.metrics`` there. LMCache's
in-process engine, which runs inside vLLM's engine process, keeps its own ``lmcache:*`` metrics as
prometheus_client objects in the default registry of that process; vLLM's ``/metrics`` shows them
when ``PROMETHEUS_MULTIPROC_DIR`` is set for every vLLM process (prometheus_client's multiprocess
mode: values live in files the API server reads), otherwise LMCache's internal API server
(``internal_api_server_enabled``) serves that process's registry. The in-process plugin does the
same: it registers ``store.metrics`` in the default registry, and in multiprocess mode starts a
:class:`MultiprocessMirror` that copies the scrape-time values into file-backed metrics every few
seconds (the histograms and byte counters are file-backed already), so vLLM's ``/metrics`` shows
``kvshrink_*`` beside ``lmcache:*``. Two stores in one multiprocess-mode process write the same
series there (the last write wins): one store per process is what that mode supports. Registering
and the multiprocess copy live in :mod:`kvshrink.store.metrics_export`.

Threads: every method may be called from any thread; instruments are prometheus_client's
(thread-safe); the resident and drop bookkeeping each have one leaf lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Iterator, Sequence

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvshrink.errors import KVShrinkError
from kvshrink.store.stats import StoreCollector

log = logging.getLogger(__name__)

PREFIX = "kvshrink_store"
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)
RATIO_SAMPLE = 8  # chunks read to learn the ratio of what a tier held at open
RECENT_LOSSES = 8192  # evicted / quarantined keys remembered to attribute the drop notice that follows
UNKNOWN = "unknown"
# engine counter -> reason of kvshrink_store_dropped_total: work the store dropped instead of queueing
DROPPED_WORK = {"dropped_queue_full": "put_queue_full", "dropped_staging_full": "put_staging_full",
                "background_dropped": "background_queue_full", "prefetch_dropped": "prefetch_queue_full"}


class _Resident:
    """One tier's resident bytes: stored from ``usage()``, raw at the tier's resident ratio.

    A scrape folds what left the tier into the ratio only when no write was in flight from before
    it read ``usage()`` until it folds: a write's bytes appear in ``usage()`` before :meth:`wrote`
    adds them here, and folding them then would count them twice. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._raw = 0.0
        self._stored = 0.0
        self._begun = 0  # writes begun / ended: equal when none is in flight
        self._ended = 0

    def writing(self) -> None:
        """A write into the tier begins; :meth:`wrote` must follow, failed or not."""
        with self._lock:
            self._begun += 1

    def wrote(self, raw: int, stored: int) -> None:
        """A write begun with :meth:`writing` ended, adding ``raw`` / ``stored`` bytes (0, 0: it failed)."""
        with self._lock:
            self._raw += raw
            self._stored += stored
            self._ended += 1

    def mark(self) -> tuple[int, int]:
        """Taken before ``usage()`` is read, for :meth:`raw_now`."""
        with self._lock:
            return self._begun, self._ended

    def raw_now(self, stored_now: int, seed_ratio: Callable[[], float], mark: tuple[int, int]) -> float:
        """Raw bytes for ``stored_now`` resident bytes (read after :meth:`mark` gave ``mark``); what
        left took the average ratio with it."""
        with self._lock:
            known = self._stored
        ratio = None if known > 0 or stored_now <= 0 else seed_ratio()  # outside the lock: it reads chunks
        with self._lock:
            raw = self._raw * stored_now / self._stored if self._stored > 0 else stored_now * (ratio or 1.0)
            if mark[0] == mark[1] == self._begun == self._ended:  # no write in flight since the mark
                self._raw, self._stored = raw, float(max(stored_now, 0))
            return raw


class StoreMetrics:
    """The metrics of one store; a prometheus_client collector (see the module docstring)."""

    def __init__(self, tiers: Sequence[Any], stats: Callable[[], dict], prefix: str = PREFIX) -> None:
        self._tiers = list(tiers)
        self._stats = stats
        self._prefix = prefix
        labels = ["tier", "kind"]
        p = prefix
        self.raw_in = Counter(f"{p}_tier_raw_bytes_in", "Uncompressed bytes of the chunks written into the tier",
                              labels, registry=None)
        self.stored_in = Counter(f"{p}_tier_stored_bytes_in", "Bytes written into the tier after its codec "
                                 "(frames)", labels, registry=None)
        self.tier_read = Histogram(f"{p}_tier_read_seconds", "One chunk read from the tier (local: read and "
                                   "decode; remote: the fetch)", labels + ["result"], buckets=LATENCY_BUCKETS,
                                   registry=None)
        self.tier_write = Histogram(f"{p}_tier_write_seconds", "One frame written into the tier, evictions "
                                    "included", labels, buckets=LATENCY_BUCKETS, registry=None)
        self.tier_dropped = Counter(f"{p}_tier_dropped", "Chunks that left the store, by the tier that lost the "
                                    "last copy and why", labels + ["reason"], registry=None)
        self.get_seconds = Histogram(f"{p}_get_seconds", "One get / get_many call (result: every chunk found, "
                                     "some, none)", ["result"], buckets=LATENCY_BUCKETS, registry=None)
        self.get_chunks = Counter(f"{p}_get_chunks", "Chunks asked for by get / get_many, found or not",
                                  ["result"], registry=None)
        self.put_seconds = Histogram(f"{p}_put_seconds", "One put, from the call to its Future's result "
                                     "(stored, dropped, failed)", ["outcome"], buckets=LATENCY_BUCKETS,
                                     registry=None)
        self._instruments = (self.raw_in, self.stored_in, self.tier_read, self.tier_write, self.tier_dropped,
                             self.get_seconds, self.get_chunks, self.put_seconds)
        self._resident = [_Resident() for _ in self._tiers]
        self._losses: OrderedDict[bytes, tuple[int, str]] = OrderedDict()
        self._losses_lock = threading.Lock()
        self._legacy = StoreCollector(stats, prefix)
        for tier in self._tiers:  # every series from the start, so rate() and the dashboard see zeros
            self.raw_in.labels(tier.name, tier.kind)
            self.stored_in.labels(tier.name, tier.kind)
            for reason in ("evicted", "quarantined"):
                self.tier_dropped.labels(tier.name, tier.kind, reason)
        self.tier_dropped.labels(UNKNOWN, UNKNOWN, "other")
        for result in ("hit", "partial", "miss"):
            self.get_seconds.labels(result)
        for result in ("hit", "miss"):
            self.get_chunks.labels(result)
        for outcome in ("stored", "dropped", "failed"):
            self.put_seconds.labels(outcome)

    # -- hooks ----------------------------------------------------------------------------------
    def instrument(self, index: int, tier: Any) -> None:
        """Wrap ``tier``'s write, read and quarantine methods on the instance (once per tier)."""
        labels = (tier.name, tier.kind)
        write_frame, get, quarantine = tier.write_frame, tier.get, tier.quarantine
        raw_in, stored_in = self.raw_in.labels(*labels), self.stored_in.labels(*labels)
        write_time = self.tier_write.labels(*labels)
        read_time = {r: self.tier_read.labels(*labels, r) for r in ("hit", "miss")}
        resident = self._resident[index]

        def metered_write_frame(key: bytes, frame: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            resident.writing()
            try:
                victims = write_frame(key, frame, *args, **kwargs)
            except BaseException:
                resident.wrote(0, 0)
                raise
            write_time.observe(time.perf_counter() - start)
            raw, stored = _sizes(frame)
            raw_in.inc(raw)
            stored_in.inc(stored)
            resident.wrote(raw, stored)
            with self._losses_lock:
                self._losses.pop(key, None)  # held again: an older eviction is no longer why it may go
            if victims:
                self._lost(index, "evicted", [v.key for v in victims])
            return victims

        def metered_get(key: bytes, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            chunk = get(key, *args, **kwargs)
            read_time["miss" if chunk is None else "hit"].observe(time.perf_counter() - start)
            return chunk

        def metered_quarantine(key: bytes, reason: str) -> None:
            self._lost(index, "quarantined", [key])
            quarantine(key, reason)

        tier.write_frame, tier.get, tier.quarantine = metered_write_frame, metered_get, metered_quarantine
        if tier.is_remote:
            fetch_frames = tier.fetch_frames

            def metered_fetch_frames(keys: list[bytes]) -> list[Any]:
                start = time.perf_counter()
                frames = fetch_frames(keys)
                hit = bool(frames) and all(f is not None for f in frames)
                read_time["hit" if hit else "miss"].observe(time.perf_counter() - start)
                return frames

            tier.fetch_frames = metered_fetch_frames

    def observe_get(self, start: float, chunks: Sequence[Any]) -> None:
        """A get / get_many that began at ``start`` (``time.perf_counter()``) returned ``chunks``."""
        elapsed = time.perf_counter() - start
        hits = sum(1 for c in chunks if c is not None)
        misses = len(chunks) - hits
        self.get_seconds.labels("miss" if hits == 0 else "hit" if misses == 0 else "partial").observe(elapsed)
        if hits:
            self.get_chunks.labels("hit").inc(hits)
        if misses:
            self.get_chunks.labels("miss").inc(misses)

    def observe_put(self, start: float, future: Future) -> Future:
        """Time the put that began at ``start`` when ``future`` completes (now, if it has); returns
        ``future``."""
        def done(f: Future) -> None:
            outcome = "failed" if f.cancelled() or f.exception() is not None else \
                "stored" if f.result() is True else "dropped"
            self.put_seconds.labels(outcome).observe(time.perf_counter() - start)

        future.add_done_callback(done)
        return future

    def dropped(self, keys: list[bytes]) -> None:
        """Drop listener: count chunks that left the store against the tier that lost them."""
        with self._losses_lock:
            found = [self._losses.pop(k, None) for k in keys]
        for loss in found:
            if loss is None:
                self.tier_dropped.labels(UNKNOWN, UNKNOWN, "other").inc()
            else:
                tier = self._tiers[loss[0]]
                self.tier_dropped.labels(tier.name, tier.kind, loss[1]).inc()

    def _lost(self, index: int, reason: str, keys: Iterable[bytes]) -> None:
        with self._losses_lock:
            for key in keys:
                self._losses[key] = (index, reason)
                self._losses.move_to_end(key)
            while len(self._losses) > RECENT_LOSSES:
                self._losses.popitem(last=False)

    # -- collector ------------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        """Everything: the instruments, then :meth:`collect_snapshot`."""
        for instrument in self._instruments:
            yield from instrument.collect()
        yield from self.collect_snapshot()

    def collect_snapshot(self) -> Iterator[Metric]:
        """What is read at scrape time: ``stats()`` (:class:`~kvshrink.store.stats.StoreCollector`),
        resident bytes per tier, and the work the store dropped by reason."""
        marks = [resident.mark() for resident in self._resident]  # before stats() reads usage()
        snapshot = self._stats()
        yield from self._legacy.families(snapshot)
        raw = GaugeMetricFamily(f"{self._prefix}_tier_raw_bytes", "Uncompressed bytes of the chunks the tier "
                                "holds (stored bytes times the tier's resident ratio)", labels=["tier", "kind"])
        stored = GaugeMetricFamily(f"{self._prefix}_tier_stored_bytes", "Bytes the tier holds, as stored",
                                   labels=["tier", "kind"])
        for index, tier in enumerate(self._tiers):
            used = snapshot["tiers"][tier.name]["bytes_stored"]
            if used < 0:  # Redis: only Redis knows
                continue
            resident = self._resident[index]
            raw.add_metric([tier.name, tier.kind], resident.raw_now(used, lambda t=tier: self._seed_ratio(t),
                                                                       marks[index]))
            stored.add_metric([tier.name, tier.kind], used)
        yield raw
        yield stored
        dropped = CounterMetricFamily(f"{self._prefix}_dropped", "Puts and moves the store dropped instead of "
                                      "queueing (engine counters by reason)", labels=["reason"])
        for name, reason in DROPPED_WORK.items():
            dropped.add_metric([reason], snapshot["engine"].get(name, 0))
        yield dropped

    def _seed_ratio(self, tier: Any) -> float:
        """The raw / stored ratio of a few of the chunks ``tier`` holds (1.0 when none reads)."""
        from kvshrink.codec import CodecError, read_header

        raw = stored = 0
        try:
            keys = tier.keys()[-RATIO_SAMPLE:]  # the youngest
        except KVShrinkError as exc:  # a scrape must not fail on one tier
            log.info("store metrics: cannot list tier %s to learn its ratio: %s", tier.name, exc)
            return 1.0
        for key in keys:
            frame = tier.read_frame(key)
            if frame is None:
                continue
            try:
                raw += read_header(frame).raw_size
            except CodecError:
                continue
            stored += len(frame)
        return raw / stored if stored else 1.0


def _sizes(frame: Any) -> tuple[int, int]:
    """(raw bytes, frame bytes) of a frame the tier just stored."""
    from kvshrink.codec import CodecError, read_header

    stored = memoryview(frame).nbytes
    try:
        return read_header(frame).raw_size, stored
    except CodecError:  # the tier took it, but it is no frame of ours: count it as it is stored
        return stored, stored
