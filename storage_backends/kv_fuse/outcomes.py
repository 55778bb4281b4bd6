"""What KV Fuse counts and reports: every fusion job ends in exactly one outcome counter.

The counters reach ``lmcache server``'s ``/status`` under ``kvshrink_fuse``, and its ``/metrics``
through :class:`FuseCollector` (registered by the module): ``kvshrink_fuse_<counter>_total``, the
``fallback_*`` ones as ``kvshrink_fuse_fallbacks_total{reason}``, ``kvshrink_fuse_engine_seconds_total``
and the gauges ``kvshrink_fuse_indexed_chunks`` and ``kvshrink_fuse_pending_jobs``.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Callable, Iterator

from kvshrink.errors import KVShrinkError

COUNTERS = ("fused_salt_lookups", "fusions", "already_fused", "no_match", "fallback_missing",
            "fallback_corrupt", "fallback_layout", "fallback_busy", "fallback_timeout", "fallback_error",
            "foreign_salt", "cancelled", "reused_chunks", "reused_tokens", "gap_tokens", "recomputed_tokens",
            "prefix_chunks", "fused_chunks_written", "fused_chunks_not_written", "indexed_chunks_added",
            "indexed_chunks_dropped")


class FuseFallback(KVShrinkError):
    """A fusion job gave up; ``reason`` is the counter it is counted under. Raised and caught
    inside KV Fuse only: the request is then served stock (the built-in lookup)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.reason = reason


class FuseStats:
    """Counters, time spent fusing, and the last fusion and fallback, for ``/status``.

    Thread-safe: any thread may count. Its lock is a leaf (held for a dict update, never while
    calling out), so callers may count while holding their own locks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._fuse_seconds = 0.0
        self._last_fusion: dict[str, Any] = {}
        self._last_fallback: dict[str, Any] = {}

    def add(self, **counts: int) -> None:
        with self._lock:
            self._counters.update(counts)

    def record_fusion(self, seconds: float, counts: dict[str, int], summary: dict[str, Any]) -> None:
        """One fusion written: its counters, its engine time and its summary (``last_fusion``)."""
        with self._lock:
            self._fuse_seconds += seconds
            self._counters.update(counts)
            self._last_fusion = dict(summary)

    def record_fallback(self, request_id: str, fallback: FuseFallback) -> None:
        with self._lock:
            self._last_fallback = {"request_id": request_id, "reason": fallback.reason, "detail": str(fallback)}

    @property
    def last_fallback(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._last_fallback)

    def snapshot(self) -> dict[str, Any]:
        """Every counter, ``fuse_seconds``, ``last_fusion`` and ``last_fallback`` (copies)."""
        with self._lock:
            return {**dict(self._counters), "fuse_seconds": round(self._fuse_seconds, 3),
                    "last_fusion": dict(self._last_fusion), "last_fallback": dict(self._last_fallback)}


class FuseCollector:
    """A prometheus_client collector over a :class:`FuseStats` and the module's queue and index
    sizes (read at scrape time; see the module docstring for the names)."""

    def __init__(self, stats: FuseStats, indexed: Callable[[], int], pending: Callable[[], int]) -> None:
        self._stats, self._indexed, self._pending = stats, indexed, pending

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snapshot = self._stats.snapshot()
        fallbacks = CounterMetricFamily("kvshrink_fuse_fallbacks", "Fusion jobs that fell back to the stock "
                                        "lookup, by reason", labels=["reason"])
        for name in COUNTERS:
            if name.startswith("fallback_"):
                fallbacks.add_metric([name[len("fallback_"):]], snapshot[name])
            else:
                yield CounterMetricFamily(f"kvshrink_fuse_{name}", f"KV Fuse {name}", value=snapshot[name])
        yield fallbacks
        yield CounterMetricFamily("kvshrink_fuse_engine_seconds", "Seconds the fusion engine ran",
                                  value=snapshot["fuse_seconds"])
        yield GaugeMetricFamily("kvshrink_fuse_indexed_chunks", "Stored chunks indexed as fusion sources",
                                value=self._indexed())
        yield GaugeMetricFamily("kvshrink_fuse_pending_jobs", "Fusion jobs queued or running", value=self._pending())
