"""Condensations cached by what determines them, so a document shared by many requests is condensed
once.

The key is a digest of (condenser fingerprint: version, model and output settings; document text;
the question when the condensation depends on it, else a marker that it does not; ratio). Entries
live in a bounded in-memory LRU and, when a :class:`~kvshrink.store.tiered.TieredStore` is given,
also in that store as a ``uint8`` array of the entry's bytes (a small JSON document), so they
outlive the process and spill to SSD / Redis like KV chunks do. The store is written in the
background (its put Future is never waited for; a failure is logged) and read on an LRU miss.

Threads: any method from any thread (one lock around the LRU; the store is thread-safe). Errors:
an unreadable stored entry is a miss (counted as ``corrupt`` by the caller's metrics through
:attr:`CondensationCache.corrupt`), never an exception.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import asdict
from typing import Any, NamedTuple

import numpy as np

from kvshrink.cascade.condenser import Condensation

log = logging.getLogger(__name__)

KEY_PREFIX = b"kvshrink-cascade/1/"
_FORMAT = 1


def condensation_key(fingerprint: str, document: str, question: str | None, ratio: float) -> bytes:
    """The cache key; ``question`` None marks a question-independent condensation."""
    digest = hashlib.sha256()
    for part in (fingerprint, "q" if question is not None else "-", question or "", f"{ratio:.4f}", document):
        data = part.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little") + data)
    return KEY_PREFIX + digest.hexdigest().encode()


def encode(condensation: Condensation) -> bytes:
    return json.dumps({"format": _FORMAT, **asdict(condensation)}, ensure_ascii=False).encode()


def decode(data: bytes) -> Condensation:
    """The entry back; ValueError (or KeyError / TypeError) for bytes that are not one."""
    fields = json.loads(data.decode())
    if fields.pop("format", None) != _FORMAT:
        raise ValueError("not a cascade cache entry of this format")
    return Condensation(**fields)


class Hit(NamedTuple):
    condensation: Condensation
    source: str  # "memory" or "store"


class CondensationCache:
    """In-memory LRU of at most ``max_bytes`` of entries, optionally backed by a TieredStore."""

    def __init__(self, max_bytes: int = 64 << 20, store: Any = None) -> None:
        self.max_bytes = max_bytes
        self.store = store
        self.corrupt = 0
        self._entries: OrderedDict[bytes, tuple[Condensation, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: bytes) -> Hit | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return Hit(entry[0], "memory")
        if self.store is None:
            return None
        array = self.store.get(key)
        if array is None:
            return None
        try:
            condensation = decode(np.asarray(array, dtype=np.uint8).tobytes())
        except (ValueError, KeyError, TypeError):
            log.warning("cascade cache: unreadable entry %s in the store, treated as a miss", key.decode())
            with self._lock:
                self.corrupt += 1
            return None
        self._remember(key, condensation, len(np.asarray(array)))
        return Hit(condensation, "store")

    def put(self, key: bytes, condensation: Condensation) -> None:
        data = encode(condensation)
        self._remember(key, condensation, len(data))
        if self.store is not None:
            future: Future = self.store.put(key, np.frombuffer(data, dtype=np.uint8))
            future.add_done_callback(lambda f: f.exception() and log.warning(
                "cascade cache: store put of %s failed: %s", key.decode(), f.exception()))

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _remember(self, key: bytes, condensation: Condensation, size: int) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            self._bytes -= old[1] if old else 0
            if size > self.max_bytes:
                return
            self._entries[key] = (condensation, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped
