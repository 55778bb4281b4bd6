"""Which stored chunks may be fusion sources: a content index per model and tenant.

Only exact KV is a source. Chunks a request stores on top of a fused prefix are approximations
themselves, so requests that loaded fused KV are remembered and their later stores are not indexed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Hashable, Sequence

from kvshrink.fuse.index import ContentIndex, Match

from .outcomes import FuseStats

FUSED_REQUESTS_KEPT = 4096  # request ids remembered as fused (their later stores are not indexed)
FUSED_KEYS_KEPT = 65536  # keys fused KV was written under (a prefix holding one is not exact)


class StoredChunkIndex:
    """One :class:`~kvshrink.fuse.index.ContentIndex` per (model, tenant), holding at most
    ``max_chunks`` keys over all of them (the oldest indexed is forgotten first).

    Keys are LMCache ``ObjectKey`` values (hashable, borrowed; nothing here reads the chunks).
    Thread-safe: LMCache's handler threads add, the fusion thread matches and forgets; one lock
    guards every table (taken before the leaf lock of ``stats``)."""

    def __init__(self, anchor: int, max_chunks: int, stats: FuseStats) -> None:
        self._anchor = anchor
        self._max_chunks = max_chunks
        self._stats = stats
        self._lock = threading.Lock()
        self._indexes: dict[tuple[str, str], ContentIndex] = {}
        self._indexed: OrderedDict[Hashable, ContentIndex] = OrderedDict()  # every indexed key, oldest first
        self._fused_requests: OrderedDict[str, None] = OrderedDict()
        self._fused_keys: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._indexed)

    def add_stored(self, model: str, tenant: str, request_id: str, obj_keys: Sequence[Hashable],
                   tokens: Sequence[int], first_chunk: int, chunk_size: int) -> None:
        """Index the full chunks ``obj_keys`` a request stored, the first being chunk ``first_chunk``
        of ``tokens``; nothing when the request loaded fused KV."""
        with self._lock:
            if request_id in self._fused_requests:
                return  # computed over a fused prefix: not exact, never a source
            index = self._indexes.get((model, tenant))
            if index is None:
                index = self._indexes[(model, tenant)] = ContentIndex(self._anchor)
            added = dropped = 0
            for i, obj_key in enumerate(obj_keys):
                start = (first_chunk + i) * chunk_size
                if start + chunk_size > len(tokens):
                    break
                if index.add(obj_key, tokens[start:start + chunk_size], start):
                    self._indexed[obj_key] = index
                    self._indexed.move_to_end(obj_key)
                    added += 1
            while len(self._indexed) > self._max_chunks:
                old, owner = self._indexed.popitem(last=False)
                owner.remove(old)
                dropped += 1
            self._stats.add(indexed_chunks_added=added, indexed_chunks_dropped=dropped)

    def match(self, model: str, tenant: str, tokens: Sequence[int], start: int) -> list[Match]:
        """The tenant's stored runs found in ``tokens[start:]`` (see ``ContentIndex.match``)."""
        with self._lock:
            index = self._indexes.get((model, tenant))
            return index.match(tokens, start=start) if index is not None else []

    def forget(self, obj_keys: Sequence[Hashable]) -> None:
        """Drop sources found gone or damaged; unknown keys are ignored."""
        with self._lock:
            dropped = 0
            for obj_key in obj_keys:
                owner = self._indexed.pop(obj_key, None)
                if owner is not None:
                    owner.remove(obj_key)
                    dropped += 1
            self._stats.add(indexed_chunks_dropped=dropped)

    def note_fused(self, request_id: str, obj_keys: Sequence[Hashable] = ()) -> None:
        """``request_id`` loads fused KV (its later stores are not sources); ``obj_keys`` now hold
        fused KV. Both memories are bounded, oldest forgotten first."""
        with self._lock:
            self._fused_requests[request_id] = None
            while len(self._fused_requests) > FUSED_REQUESTS_KEPT:
                self._fused_requests.popitem(last=False)
            for obj_key in obj_keys:
                self._fused_keys[obj_key] = None
            while len(self._fused_keys) > FUSED_KEYS_KEPT:
                self._fused_keys.popitem(last=False)

    def holds_fused(self, obj_keys: Sequence[Hashable]) -> bool:
        """Whether fused KV was written under any of ``obj_keys``."""
        with self._lock:
            return any(k in self._fused_keys for k in obj_keys)

    def end_request(self, request_id: str) -> None:
        """The request's session ended: it stores nothing more."""
        with self._lock:
            self._fused_requests.pop(request_id, None)

