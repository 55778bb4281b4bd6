"""Prometheus metrics of one index service (own registry, so several can live in one process).

Rates (events/s, lookups/s) come from ``rate()`` over the counters. Hot paths count into plain
integers per batch and add them here once, so metrics cost nothing per block.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
_TOKEN_BUCKETS = (0, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class IndexMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.events = Counter("kvshrink_index_events", "KV / tier events applied", ["source", "kind"], registry=r)
        self.block_ops = Counter("kvshrink_index_block_ops", "Per-block index operations applied",
                                 ["source", "op"], registry=r)
        self.dropped = Counter("kvshrink_index_dropped", "Events, entries or messages counted and dropped",
                               ["source", "reason"], registry=r)
        self.seq_gaps = Counter("kvshrink_index_sequence_gaps", "Sequence discontinuities and how they were handled",
                                ["source", "action"], registry=r)
        self.rejected = Counter("kvshrink_index_http_rejected", "HTTP requests refused", ["endpoint", "reason"],
                                registry=r)
        self.lookups = Counter("kvshrink_index_lookups", "Lookups answered", registry=r)
        self.lookup_seconds = Histogram("kvshrink_index_lookup_seconds", "Lookup latency inside the service",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.hit_tokens = Histogram("kvshrink_index_lookup_hit_tokens", "Best matched prefix per lookup (tokens)",
                                    buckets=_TOKEN_BUCKETS, registry=r)
        self.evictions = Counter("kvshrink_index_lru_evictions", "Blocks forgotten by the LRU cap", registry=r)
        self.instances_dropped = Counter("kvshrink_index_instances_dropped", "Instances emptied or removed",
                                         ["reason"], registry=r)
        self.blocks = Gauge("kvshrink_index_blocks", "Blocks in the index", registry=r)
        self.instances = Gauge("kvshrink_index_instances", "Registered instances", registry=r)

    def bind_sizes(self, blocks: Callable[[], float], instances: Callable[[], float]) -> None:
        self.blocks.set_function(blocks)
        self.instances.set_function(instances)

    def drop(self, source: str, reason: str, n: int = 1) -> None:
        if n:
            self.dropped.labels(source, reason).inc(n)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
