"""Drop notices: who hears about keys that left the store without a ``delete()`` call.

:class:`DropListeners` keeps the listeners of a :class:`~kvshrink.store.tiered.TieredStore`,
remembers the last :data:`RECENT_DROPS` reported keys so a key is reported once per drop, and
counts ``keys_dropped`` / ``drop_listener_errors``. Contract (see the class docstring): listeners
run on the thread that removed the keys (a store worker, a reader or a background worker), after
the store released its locks; one ``threading.Lock`` guards the listeners and the recent keys and
is never held while a listener runs. ``fire`` never raises: a listener's exception is logged and
counted. Keys are ``bytes`` the caller keeps; nothing here holds a buffer.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from kvshrink.store.stats import Counters

log = logging.getLogger(__name__)

DropListener = Callable[[list[bytes]], None]
DROP_COUNTERS = ("keys_dropped", "drop_listener_errors")
RECENT_DROPS = 4096  # keys remembered as reported, so racing removals of one key report it once


class DropListeners:
    """Who hears about keys that left the store without a ``delete()`` call.

    A key is *dropped* when a tier removed it on its own and afterwards no tier holds it: evicted
    from the last tier, evicted from a tier whose demotion below failed or had nothing to move,
    quarantined (corrupt, or its file vanished) during a read, or given up while parked on its
    way to Redis (the parking budget spent, or the store closed while Redis refused it; what Redis
    may hold under the key is hidden from then on). A demotion is not a drop, and neither is an
    eviction of a key that another tier (a write-back copy, Redis) still holds.

    A notice means the chunk is gone. Local tiers are asked at once; a remote tier (Redis) is
    never asked on a put's path: a key this process wrote there is taken as held (evictions Redis
    makes on its own, by maxmemory or TTL, are invisible to the store and never reported), and a
    key it may hold for another reason (written by an earlier process, or by a write that timed
    out) is checked in the background and reported only if Redis *answered* that it lacks it. An
    unreachable or hung Redis therefore never causes a notice: such a key goes unreported, and
    its owner learns it is gone from a later lookup that misses it. A key whose Redis copy the
    store hides as an older value (see :class:`~kvshrink.store.ledger.CopyLedger`) counts as not held there.

    ``delete()`` never fires listeners: its caller learns the outcome from its return value.
    Every removal is checked after it happens, so whoever removes a key's last copy reports it,
    and a key is reported once per drop: the last :data:`RECENT_DROPS` reported keys are
    remembered (until a tier takes the key again), so two racing removals (an eviction and a
    read that found the chunk gone) do not report it twice. What the check cannot rule out: a
    key removed by ``delete()`` at the same instant as an eviction may be reported too, and a
    key re-``put`` between the check and the report is reported although it is back. An owner
    that mirrors the store's contents therefore keeps its own set of announced keys and
    re-checks ``contains`` under its own lock before it reports (as the LMCache MP adapter does).

    Listeners get the keys (no sizes: a tier does not keep a victim's size) on the thread that
    removed them (a store worker or a reader) or on a background worker (keys checked with
    Redis), after the store released its locks; they must be quick and must not call
    ``put``/``flush``/``close`` of this store. An exception in a listener is logged and counted
    (``drop_listener_errors``), never raised into the store.
    """

    def __init__(self) -> None:
        self._listeners: list[DropListener] = []
        self._recent: dict[bytes, None] = {}  # reported keys, oldest first
        self._lock = threading.Lock()
        self.counters = Counters(DROP_COUNTERS)

    def add(self, listener: DropListener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove(self, listener: DropListener) -> None:
        """Stop calling ``listener``; unknown listeners are ignored."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def stored(self, key: bytes) -> None:
        """A tier took ``key`` (a put, a demotion): its next drop is news again."""
        with self._lock:
            self._recent.pop(key, None)

    def fire(self, keys: list[bytes]) -> None:
        """Count the ``keys`` not reported yet as dropped and tell every listener; never raises."""
        with self._lock:
            keys = [k for k in keys if k not in self._recent]
            self._recent.update(dict.fromkeys(keys))
            while len(self._recent) > RECENT_DROPS:
                del self._recent[next(iter(self._recent))]
            listeners = list(self._listeners)
        if not keys:
            return
        self.counters.add("keys_dropped", len(keys))
        for listener in listeners:
            try:
                listener(keys)
            except Exception:  # a listener bug must not kill a store worker or fail a put
                self.counters.add("drop_listener_errors")
                log.exception("drop listener %r failed on %d keys", listener, len(keys))
