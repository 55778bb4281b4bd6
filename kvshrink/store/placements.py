"""Placement notices: which keys may have changed tier, for an owner that mirrors where chunks live
(the LMCache MP adapter's index reporter).

A notice is a hint, not a fact: it names keys to look at again (``TieredStore.where``), never what
changed; one change may be noticed twice, and a notice may turn out to change nothing. That keeps
every call site one line and lets the owner do the work later on its own thread. The store sends
one after every write into a tier (the key written and the victims the write evicted: a put, a
demotion, a promotion, a write-back, a parked chunk landing in Redis), after ``delete()``, and for
every key that may have left the store (the drop candidates: last-tier evictions, quarantined or
vanished chunks, parked chunks given up). Not noticed: what Redis evicts on its own (maxmemory,
TTL), which the store never learns either.

Threads: listeners run on the store thread that made the change (a put or background worker, a
reader, the caller of ``delete``), possibly while it holds a tier's write lock, so a listener must
return at once (enqueue the keys), never block and never call the store. An exception is logged and
counted (``placement_listener_errors``), never raised into the store. The key list is the
listener's to keep; no buffers are handed over.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from kvshrink.store.stats import Counters

log = logging.getLogger(__name__)

PlacementListener = Callable[[list[bytes]], None]
PLACEMENT_COUNTERS = ("placement_listener_errors",)


class PlacementListeners:
    """The store's placement listeners; ``notify`` costs one attribute read when there are none."""

    def __init__(self) -> None:
        self._listeners: tuple[PlacementListener, ...] = ()  # replaced, never mutated: read without the lock
        self._lock = threading.Lock()
        self.counters = Counters(PLACEMENT_COUNTERS)

    def add(self, listener: PlacementListener) -> None:
        with self._lock:
            self._listeners += (listener,)

    def remove(self, listener: PlacementListener) -> None:
        """Stop calling ``listener``; unknown listeners are ignored."""
        with self._lock:
            self._listeners = tuple(known for known in self._listeners if known != listener)

    def notify(self, keys: list[bytes]) -> None:
        """Tell every listener that ``keys`` may have moved; never raises."""
        listeners = self._listeners
        if not listeners or not keys:
            return
        for listener in listeners:
            try:
                listener(list(keys))
            except Exception:  # a listener bug must not fail a put or kill a store worker
                self.counters.add("placement_listener_errors")
                log.exception("placement listener %r failed on %d keys", listener, len(keys))
