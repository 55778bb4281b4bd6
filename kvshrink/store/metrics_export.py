"""Exporting collectors: register them in prometheus_client's registry, wrap a ``snapshot()`` dict
of numbers as one, and mirror collector values into file-backed metrics for prometheus_client's
multiprocess mode (where a scrape reads files and never asks a collector). Used by the store's
LMCache glue (the L2 adapter, the in-process plugin, the prefetch-hint and tier-reporter modules);
why each path exists: :mod:`kvshrink.store.metrics`.

Threads: :func:`register` / :func:`unregister` may be called from any thread;
:class:`MultiprocessMirror` copies on its own thread under one lock.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable, Iterator, Sequence

from prometheus_client import Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger(__name__)


class SnapshotCollector:
    """A collector over a ``snapshot()`` dict of numbers: ``<prefix>_<name>_total`` counters for
    ``counters``, ``<prefix>_<name>`` gauges for ``gauges`` (read at scrape time)."""

    def __init__(self, prefix: str, snapshot: Callable[[], dict], counters: Sequence[str],
                 gauges: Sequence[str] = (), what: str = "") -> None:
        self._prefix, self._snapshot, self._what = prefix, snapshot, what or prefix
        self._counters, self._gauges = tuple(counters), tuple(gauges)

    def collect(self) -> Iterator[Metric]:
        values = self._snapshot()
        for name in self._counters:
            yield CounterMetricFamily(f"{self._prefix}_{name}", f"{self._what} {name}", value=values[name])
        for name in self._gauges:
            yield GaugeMetricFamily(f"{self._prefix}_{name}", f"{self._what} {name}", value=values[name])


def register(collector: Any, registry: Any = None) -> bool:
    """Register ``collector`` in ``registry`` (prometheus_client's default); False, logged, when
    its names are taken (a second store or module in this process)."""
    if registry is None:
        from prometheus_client import REGISTRY as registry
    try:
        registry.register(collector)
        return True
    except ValueError as exc:
        log.info("metrics of %s not exported: %s", type(collector).__name__, exc)
        return False


def unregister(collector: Any, registry: Any = None) -> None:
    """Undo :func:`register`; a collector that was not registered is ignored."""
    if registry is None:
        from prometheus_client import REGISTRY as registry
    try:
        registry.unregister(collector)
    except KeyError:
        pass


def multiprocess_mode() -> bool:
    """Whether prometheus_client keeps values in files (``PROMETHEUS_MULTIPROC_DIR`` was set when it
    was imported): then only metric objects, not collectors, reach a multiprocess ``/metrics``."""
    from prometheus_client import values

    return values.ValueClass is not values.MutexValue


class MultiprocessMirror:
    """Copies the counter and gauge families of ``collect()`` into file-backed prometheus_client
    metrics every ``interval`` seconds, on its own thread, for prometheus_client's multiprocess mode
    (a scrape there reads the files of every process; collectors are never asked). Counters move by
    their increase (a value that went down, e.g. a store reopened, restarts the count); gauges are
    set (``livesum``: summed over live processes). :meth:`sync` copies once; :meth:`close` copies a
    last time and stops."""

    def __init__(self, collect: Callable[[], Iterable[Metric]], interval: float = 5.0) -> None:
        self._collect = collect
        self._interval = interval
        self._metrics: dict[str, Any] = {}
        self._last: dict[tuple, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvshrink-metrics-mirror", daemon=True)
        self._thread.start()

    def sync(self) -> None:
        with self._lock:
            for family in self._collect():
                if family.type not in ("counter", "gauge") or not family.samples:
                    continue
                for sample in family.samples:
                    if family.type == "counter" and not sample.name.endswith("_total"):
                        continue  # _created
                    self._copy(family, sample)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(self._interval + 5)
        try:
            self.sync()
        except Exception:  # noqa: BLE001 - closing must not fail on a last copy
            log.exception("metrics mirror: last copy failed")

    def _copy(self, family: Metric, sample: Any) -> None:
        names = tuple(sorted(sample.labels))
        metric = self._metrics.get(family.name)
        if metric is None:
            kind = Counter if family.type == "counter" else Gauge
            extra = {} if kind is Counter else {"multiprocess_mode": "livesum"}
            metric = kind(family.name, family.documentation or family.name, names, registry=None, **extra)
            self._metrics[family.name] = metric
        child = metric.labels(*(sample.labels[n] for n in names)) if names else metric
        if family.type == "gauge":
            child.set(sample.value)
            return
        key = (family.name, tuple(sample.labels[n] for n in names))
        last = self._last.get(key, 0.0)
        self._last[key] = sample.value
        child.inc(sample.value - last if sample.value >= last else sample.value)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.sync()
            except Exception:  # noqa: BLE001 - a failing copy is logged, the next one may work
                log.exception("metrics mirror: copy failed")
