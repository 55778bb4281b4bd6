"""Fusion jobs: at most ``max_pending`` queued or running, one at a time on the module's thread.

A job is a request's lookup under the fused salt. Fusion takes seconds on CPU and LMCache's server
threads must keep serving, so the lookup handler only queues the job; the job fuses, then calls
LMCache's built-in lookup itself (which then finds the fused prefix), unless the request ended.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from .outcomes import FuseFallback, FuseStats

log = logging.getLogger(__name__)


@dataclass
class FusionJob:
    """One request's fusion. ``key`` is LMCache's ``IPCCacheServerKey`` of the lookup; ``done`` is
    set once the built-in lookup ran (or was skipped); ``cancelled`` is set under the queue's lock."""

    key: Any
    tp_size: int
    deadline: float  # time.monotonic() after which the job writes nothing
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False

    def check_time(self, timeout_s: float) -> None:
        """FuseFallback("cancelled") once the request ended, ("fallback_timeout") past the deadline."""
        if self.cancelled:
            raise FuseFallback("cancelled", "the request ended")
        if time.monotonic() > self.deadline:
            raise FuseFallback("fallback_timeout", f"past timeout_s {timeout_s}")


class FusionJobQueue:
    """The jobs of requests being fused, by request id, and the thread that runs them.

    ``fuse(job)`` returns the job's outcome counter or raises (FuseFallback: its reason; anything
    else: ``fallback_error``, logged); nothing is raised into LMCache. ``lookup`` is LMCache's
    built-in lookup module (borrowed). Thread-safe: one lock guards the job table; it is never held
    while fusing or calling LMCache."""

    def __init__(self, fuse: Callable[[FusionJob], str], lookup: Any, stats: FuseStats, max_pending: int,
                 timeout_s: float) -> None:
        self._fuse = fuse
        self._lookup = lookup
        self._stats = stats
        self._max_pending = max_pending
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._pending: dict[str, FusionJob] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvshrink-fuse")

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def start(self, key: Any, tp_size: int) -> str:
        """Queue a job for ``key``'s request: "started"; "pending" when one already runs for it
        (that one calls the built-in lookup); "busy" when ``max_pending`` jobs are queued (the
        caller serves the request stock)."""
        with self._lock:
            if key.request_id in self._pending:
                return "pending"
            if len(self._pending) >= self._max_pending:
                return "busy"
            job = self._pending[key.request_id] = FusionJob(key, tp_size, time.monotonic() + self._timeout_s)
        self._executor.submit(self._run, job)
        return "started"

    def running(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._pending

    def wait(self, request_id: str, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the request's job; True when none runs (any more)."""
        with self._lock:
            job = self._pending.get(request_id)
        return job is None or job.done.wait(timeout)

    def cancel(self, request_id: str) -> None:
        """The request ended: its job writes nothing more and skips its built-in lookup (which
        would take locks nobody releases)."""
        with self._lock:
            job = self._pending.get(request_id)
            if job is not None:
                job.cancelled = True

    def close(self) -> None:
        """Cancel every job and wait for the running one to finish."""
        with self._lock:
            for job in self._pending.values():
                job.cancelled = True
        self._executor.shutdown(wait=True, cancel_futures=False)

    def _run(self, job: FusionJob) -> None:
        key = job.key
        outcome = "fallback_error"
        started = time.monotonic()
        try:
            outcome = self._fuse(job)
        except FuseFallback as exc:
            outcome = exc.reason
            self._stats.record_fallback(key.request_id, exc)
            log.info("KV Fuse: %s falls back (%s): %s", key.request_id, exc.reason, exc)
        except Exception:  # noqa: BLE001 - never raised into LMCache; the request is served stock
            log.exception("KV Fuse: fusing %s failed; served without fusion", key.request_id)
        finally:
            with self._lock:
                cancelled = job.cancelled
            counts = Counter({outcome: 1})
            if cancelled:
                counts["cancelled"] += 1  # besides the outcome, which may itself be "cancelled"
            self._stats.add(**counts)
            try:
                if not cancelled:
                    self._lookup.lookup(key, job.tp_size)
            except Exception:  # noqa: BLE001
                log.exception("KV Fuse: the built-in lookup of %s failed", key.request_id)
            finally:
                with self._lock:
                    self._pending.pop(key.request_id, None)
                job.done.set()
            log.info("KV Fuse: %s -> %s in %.2f s", key.request_id, outcome, time.monotonic() - started)
