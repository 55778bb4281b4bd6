"""Prometheus metrics of one cascade proxy (own registry, so several can live in one process).

Per document: tokens before and after (histograms: ``_sum`` / ``_count`` give totals and the
saved fraction), how its condensation was found (cache hit by level, or a miss that ran the
model). Per batch: seconds in the model and documents in it. Per request: what the proxy did.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

_TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class CascadeMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.tokens_in = Histogram("kvshrink_cascade_document_tokens_in", "Tokens of a marked document",
                                   buckets=_TOKEN_BUCKETS, registry=r)
        self.tokens_out = Histogram("kvshrink_cascade_document_tokens_out", "Tokens of its condensation",
                                    buckets=_TOKEN_BUCKETS, registry=r)
        self.cache_hits = Counter("kvshrink_cascade_cache_hits", "Condensations found in the cache", ["source"],
                                  registry=r)
        self.cache_misses = Counter("kvshrink_cascade_cache_misses", "Condensations the model had to run for",
                                    registry=r)
        self.shared = Counter("kvshrink_cascade_inflight_shared",
                              "Documents that waited for the same condensation already running", registry=r)
        self.condense_seconds = Histogram("kvshrink_cascade_condense_seconds", "Seconds of one batched condensation",
                                          buckets=_SECONDS_BUCKETS, registry=r)
        self.batch_documents = Histogram("kvshrink_cascade_batch_documents", "Documents in one batched condensation",
                                         buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.requests = Counter("kvshrink_cascade_requests", "Requests by what the proxy did with them",
                                ["endpoint", "action"], registry=r)
        self.upstream_errors = Counter("kvshrink_cascade_upstream_errors", "Upstream answers with status >= 400, "
                                       "or no answer (status 502)", ["status"], registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
