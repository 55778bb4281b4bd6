"""What LMCache has been told is stored, so that it hears ``deleted`` exactly once per chunk.

LMCache only knows what the adapter's process told it. The store may lose a chunk in several ways
(``delete()``, its own eviction or quarantine, Redis evicting it behind our back), and stores,
evictions and deletes race; every announcement therefore re-checks the store under one lock.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey

log = logging.getLogger(__name__)

Entry = tuple["ObjectKey", bytes, int]  # (LMCache key, store key, raw bytes)
Notifier = Callable[[list["ObjectKey"], list[int]], None]


class AnnouncedKeys:
    """Store key -> (LMCache key, raw bytes) of every chunk LMCache was told is stored and not yet
    told is deleted. ``notify_stored`` / ``notify_deleted`` are the adapter's ``_notify_keys_*``
    (LMCache's listeners, thread-safe). Thread-safe: one re-entrant lock guards the table and orders
    the notifications; it is held while asking ``store`` (``contains_many``), never the reverse.
    Notifier failures propagate, except from :meth:`missing` (logged and counted)."""

    def __init__(self, store: Any, notify_stored: Notifier, notify_deleted: Notifier) -> None:
        self._store = store
        self._notify_stored = notify_stored
        self._notify_deleted = notify_deleted
        self._announced: dict[bytes, tuple["ObjectKey", int]] = {}
        self._lock = threading.RLock()
        self._errors: Counter[str] = Counter()  # notifier failures on the lookup / load paths

    def stored(self, entries: list[Entry]) -> list[Entry]:
        """Tell LMCache about the chunks in ``entries`` it has not been told about and the store
        still holds (one evicted before we got here is not announced); return those."""
        with self._lock:  # a key stored by two racing tasks is announced once
            fresh = list({skey: (key, skey, size) for key, skey, size in entries
                          if skey not in self._announced}.values())
            if not fresh:
                return []
            fresh = [e for e, held in zip(fresh, self._store.contains_many([e[1] for e in fresh])) if held]
            self._announced.update((skey, (key, size)) for key, skey, size in fresh)
            if fresh:
                self._notify_stored([k for k, _, _ in fresh], [s for _, _, s in fresh])
            return fresh

    def gone(self, store_keys: list[bytes]) -> None:
        """Tell LMCache ``deleted`` for the announced keys among ``store_keys`` that the store no
        longer holds, once each. Also the store's drop listener (runs on a store thread)."""
        if not any(k in self._announced for k in store_keys):
            return  # the common case, without the lock: stale answers are re-checked below
        with self._lock:
            known = [k for k in dict.fromkeys(store_keys) if k in self._announced]
            if not known:
                return
            gone = [k for k, held in zip(known, self._store.contains_many(known)) if not held]
            entries = [self._announced.pop(k) for k in gone]
            if entries:
                self._notify_deleted([key for key, _ in entries], [size for _, size in entries])

    def missing(self, store_keys: list[bytes], what: str) -> None:
        """:meth:`gone` for the misses of a lookup or load, whose result must not depend on
        LMCache's listeners: a failure is logged and counted, not raised."""
        try:
            self.gone(store_keys)
        except Exception:
            with self._lock:
                self._errors[f"notify_deleted.{what}"] += 1
            log.exception("KVShrinkL2Adapter: reporting %d missing chunks after a %s failed", len(store_keys), what)

    def size_of(self, store_key: bytes) -> int | None:
        """The raw size announced for ``store_key`` (None: not announced)."""
        with self._lock:
            announced = self._announced.get(store_key)
        return announced[1] if announced is not None else None

    def errors(self) -> dict[str, int]:
        with self._lock:
            return dict(self._errors)
