"""The condenser behind a cache, single flight and one batching worker thread.

Requests arrive concurrently and each carries a few documents; running the model once per
document would waste the batched forward pass. ``submit`` answers from the cache at once when it
can; otherwise the document joins a queue that one worker thread drains *whole* each time it is
free (every document pending then, up to ``max_batch_documents``), so documents of concurrent
requests share forward passes without a timer adding latency to a lone request. A document whose
condensation is already queued or running waits for that one instead of being condensed twice.

Threads: ``submit`` from any thread; results are ``concurrent.futures.Future`` (wrap them with
``asyncio.wrap_future`` on an event loop). Errors: a failed batch fails the Futures of its
documents with the condenser's exception; ``submit`` after ``close`` raises StoreClosedError.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future

from kvshrink.cascade.cache import CondensationCache, condensation_key
from kvshrink.cascade.condenser import Condensation, Condenser
from kvshrink.cascade.metrics import CascadeMetrics
from kvshrink.errors import StoreClosedError

log = logging.getLogger(__name__)


class CondenseService:
    def __init__(self, condenser: Condenser, cache: CondensationCache | None = None,
                 metrics: CascadeMetrics | None = None, max_batch_documents: int = 32) -> None:
        self.condenser = condenser
        self.cache = cache if cache is not None else CondensationCache()
        self.metrics = metrics if metrics is not None else CascadeMetrics()
        self.max_batch_documents = max_batch_documents
        self._queue: deque[tuple[bytes, str, str | None, float]] = deque()
        self._running: dict[bytes, Future] = {}
        self._wake = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="kvshrink-cascade-condense", daemon=True)
        self._worker.start()

    def submit(self, document: str, question: str | None = None, ratio: float | None = None) -> Future:
        """A Future of the :class:`Condensation` of ``document`` (conditioned on ``question``
        unless None) at ``ratio`` (the condenser's default when None)."""
        ratio = self.condenser.config.ratio if ratio is None else ratio
        key = condensation_key(self.condenser.fingerprint, document, question, ratio)
        hit = self.cache.get(key)
        if hit is not None:
            self.metrics.cache_hits.labels(hit.source).inc()
            self._count(hit.condensation)
            return _done(hit.condensation)
        with self._wake:
            if self._closed:
                raise StoreClosedError("cascade condense service: submit after close")
            running = self._running.get(key)
            if running is not None:
                self.metrics.shared.inc()
                return running
            self.metrics.cache_misses.inc()
            future: Future = Future()
            self._running[key] = future
            self._queue.append((key, document, question, ratio))
            self._wake.notify()
        return future

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking documents; the worker finishes what is queued, then exits."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._worker.join(timeout)

    def _count(self, condensation: Condensation) -> None:
        self.metrics.tokens_in.observe(condensation.tokens_in)
        self.metrics.tokens_out.observe(condensation.tokens_out)

    def _work(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), self.max_batch_documents))]
            started = time.perf_counter()
            try:
                results = self.condenser.condense_many([(doc, question, ratio) for _, doc, question, ratio in batch])
            except Exception as exc:  # handed to every waiter; the worker keeps serving
                log.exception("cascade: condensing a batch of %d documents failed", len(batch))
                results = [exc] * len(batch)
            self.metrics.condense_seconds.observe(time.perf_counter() - started)
            self.metrics.batch_documents.observe(len(batch))
            for (key, *_), result in zip(batch, results):
                if isinstance(result, Condensation):
                    self.cache.put(key, result)
                    self._count(result)
                with self._wake:
                    future = self._running.pop(key)
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)


def _done(value: Condensation) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
