"""Counters for the store, shaped for Prometheus: monotonically increasing ``*_total`` counters
per tier and per engine lane, plus a few gauges (bytes and chunks held).

:meth:`TieredStore.stats` returns plain dicts; :class:`StoreCollector` exposes the same numbers to
``prometheus_client`` (``REGISTRY.register(StoreCollector(store.stats))``: it takes the callable,
read at every scrape) without a second bookkeeping. Every store also has a
:class:`~kvshrink.store.metrics.StoreMetrics` (``store.metrics``), which exports these families
and the byte, latency and loss metrics beside them.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterator

TIER_COUNTERS = ("hits", "misses", "puts", "put_bytes", "errors", "quarantined", "evictions", "demotions")
ENGINE_COUNTERS = ("puts", "dropped_queue_full", "dropped_staging_full", "put_errors",
                   "background_jobs", "background_dropped", "background_errors", "promotions",
                   "keys_dropped", "drop_listener_errors", "placement_listener_errors")
PREFETCH_COUNTERS = ("prefetch_hints", "prefetch_issued", "prefetch_moved", "prefetch_skipped", "prefetch_missing",
                     "prefetch_useful", "prefetch_wasted", "prefetch_cancelled", "prefetch_dropped", "prefetch_errors")
IDLE_COUNTERS = ("idle_scans", "idle_demotions", "idle_skipped_pinned", "idle_demote_failed")
MONOTONIC = frozenset(ENGINE_COUNTERS + PREFETCH_COUNTERS + IDLE_COUNTERS)  # exported as counters, the rest as gauges


class Counters:
    """A thread-safe bag of named integer counters."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self._values = dict.fromkeys(names, 0)
        self._lock = threading.Lock()

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._values[name] += amount

    def __getitem__(self, name: str) -> int:
        return self._values[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


class StoreCollector:
    """A ``prometheus_client`` custom collector reading ``stats()`` at scrape time."""

    def __init__(self, stats: Callable[[], dict], prefix: str = "kvshrink_store") -> None:
        self._stats = stats
        self._prefix = prefix

    def collect(self) -> Iterator[object]:
        yield from self.families(self._stats())

    def families(self, snapshot: dict) -> Iterator[object]:
        """The metric families of one ``stats()`` snapshot."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        tiers = snapshot["tiers"]
        for name in TIER_COUNTERS:
            family = CounterMetricFamily(f"{self._prefix}_tier_{name}", f"tier {name}", labels=["tier"])
            for tier, values in tiers.items():
                family.add_metric([tier], values[name])
            yield family
        for name in ("bytes_stored", "chunks", "capacity_bytes"):
            family = GaugeMetricFamily(f"{self._prefix}_tier_{name}", f"tier {name}", labels=["tier"])
            for tier, values in tiers.items():
                family.add_metric([tier], values[name])
            yield family
        for name, value in snapshot["engine"].items():
            if name in MONOTONIC:
                yield CounterMetricFamily(f"{self._prefix}_engine_{name}", f"copy engine {name}", value=value)
            else:
                yield GaugeMetricFamily(f"{self._prefix}_engine_{name}", f"copy engine {name}", value=value)
