"""Idle demotion: chunks of the first tier nobody read or wrote for a while move one tier down.

A long agent session waits for tools between turns; its KV should leave the fast tier meanwhile
(and come back with a prefetch hint when the session resumes, see :mod:`kvshrink.store.prefetch`).
With ``idle_demotion.after_s`` > 0 the store keeps an :class:`IdleTracker` (the last read or write
of every first-tier key, oldest first) and an :class:`IdleDemoter` thread (``kvshrink-idle``) that
every ``scan_interval_s`` asks for at most ``max_per_scan`` keys idle longer than ``after_s`` and
hands each to the store's ``demote(key)``. The store demotes it like an eviction would —
copied into the tier below first (re-encoded for it: compressed there), only then removed from
the first tier, under the first tier's write lock — so a reader always finds it in one tier or the
other. A chunk pinned by a lookup in progress (``TieredStore.lock``) or with a prefetch queued or
running is never demoted: it is looked at again one idle period later (counted
``idle_skipped_pinned``); one pinned while its copy was made keeps its first-tier copy too.
Counted: ``idle_demotions`` (and the first tier's ``demotions``), ``idle_demote_failed`` (the
tier below refused: the chunk stays), ``idle_scans``.

Threads: the tracker's lock is a leaf (held only for dict updates, never across a store call);
``touch`` is called on read and write paths, so it costs one lock and two dict operations per key.
The demoter thread is the only caller of ``demote``; ``close`` stops it (waits for the current
demotion). Errors: a KVShrinkError from a demotion is counted and logged, the scan goes on;
anything else is a bug, logged with its traceback, and the thread goes on too.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from kvshrink.errors import KVShrinkError
from kvshrink.store.config import IdleDemotionConfig
from kvshrink.store.stats import IDLE_COUNTERS, Counters

log = logging.getLogger(__name__)


class IdleTracker:
    """First-tier key -> monotonic time of its last read or write, oldest first. Thread-safe."""

    def __init__(self, keys: Sequence[bytes] = ()) -> None:
        now = time.monotonic()
        self._seen: dict[bytes, float] = dict.fromkeys(keys, now)  # a restart: every chunk counts as fresh
        self._lock = threading.Lock()

    def touch(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        now = time.monotonic()
        with self._lock:
            for key in keys:
                self._seen.pop(key, None)
                self._seen[key] = now

    def forget(self, key: bytes) -> None:
        with self._lock:
            self._seen.pop(key, None)

    def idle(self, older_than_s: float, limit: int) -> list[bytes]:
        """At most ``limit`` keys untouched for ``older_than_s`` seconds, oldest first."""
        cutoff = time.monotonic() - older_than_s
        found: list[bytes] = []
        with self._lock:
            for key, seen in self._seen.items():
                if seen > cutoff or len(found) >= limit:
                    break
                found.append(key)
        return found

    def __len__(self) -> int:
        return len(self._seen)


class IdleDemoter:
    """The scanning thread. ``demote(key)`` (the store's) returns ``"demoted"``, ``"pinned"``,
    ``"gone"`` (no longer in the first tier) or ``"failed"``."""

    def __init__(self, config: IdleDemotionConfig, tracker: IdleTracker, demote: Callable[[bytes], str]) -> None:
        self.config = config
        self.tracker = tracker
        self._demote = demote
        self.counters = Counters(IDLE_COUNTERS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvshrink-idle", daemon=True)
        self._thread.start()

    def scan(self) -> int:
        """One pass; returns the chunks demoted. (The thread calls it; tests may too.)"""
        self.counters.add("idle_scans")
        demoted = 0
        for key in self.tracker.idle(self.config.after_s, self.config.max_per_scan):
            if self._stop.is_set():
                break
            try:
                outcome = self._demote(key)
            except KVShrinkError as exc:
                log.warning("idle demotion of %s failed: %s", key.hex()[:32], exc)
                outcome = "failed"
            if outcome == "demoted":
                demoted += 1
                self.tracker.forget(key)
            elif outcome == "gone":
                self.tracker.forget(key)
            elif outcome == "pinned":
                self.counters.add("idle_skipped_pinned")
                self.tracker.touch([key])  # in use: look again one idle period later
            else:
                self.counters.add("idle_demote_failed")
                self.tracker.touch([key])
        self.counters.add("idle_demotions", demoted)
        return demoted

    def stats(self) -> dict[str, int]:
        return {**self.counters.snapshot(), "idle_tracked": len(self.tracker)}

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.config.scan_interval_s):
            try:
                self.scan()
            except Exception:  # a bug must not end idle demotion silently for the process's life
                log.exception("idle demotion scan failed")
