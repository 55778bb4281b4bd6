"""The contract every storage tier (DRAM arena, SSD directory, Redis) fulfils.

A tier stores *codec frames* (``kvshrink.codec.encode`` output) under opaque byte keys. The frame
carries dtype, shape and a checksum, so a tier needs no side metadata and every read is verified.

Contract, shared by all tiers and pinned by ``tests/store/tier_contract.py``:

* **Keys** are ``bytes`` of 1..:data:`MAX_KEY_BYTES`; they never become paths or commands verbatim.
  :func:`check_key` enforces it with :class:`~kvshrink.errors.InvalidKeyError`; tiers trust
  their callers (the store) to have called it.
* **Buffers**: ``write_frame`` copies what it keeps before it returns; the caller keeps ownership
  of ``frame``. ``get(key, out)`` writes only into ``out`` (or a fresh array) and returns it; the
  content of ``out`` is unspecified after a miss.
* **Errors**: reads never raise for a missing, corrupt or unreachable chunk: they count it and
  return ``None``; a corrupt chunk is quarantined (moved aside or deleted) so it is never served.
  ``write_frame`` raises :class:`~kvshrink.errors.StoreUnavailableError` when the medium refuses
  (full disk, Redis down) after counting it; what was stored before stays readable.
* **Idempotency**: writing an existing key replaces it; ``delete`` of a missing key returns False.
* **Threads**: every method may be called from several threads at once.
* **Eviction**: a bounded tier evicts by its policy to make room, skipping keys for which
  ``is_pinned`` is true, and returns the victims so the caller can demote them.
"""

from __future__ import annotations

import itertools
import logging
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Any, Callable, Iterator, NamedTuple, Sequence

from kvshrink.errors import InvalidKeyError, StoreUnavailableError
from kvshrink.store.config import TierConfig
from kvshrink.store.stats import TIER_COUNTERS, Counters

log = logging.getLogger(__name__)

MAX_KEY_BYTES = 1024
Buffer = Any  # bytes, memoryview or a uint8 numpy view: anything the codec reads
KeepVictims = bool | Callable[[bytes], bool]


def wants_frame(keep_victims: KeepVictims, key: bytes) -> bool:
    return keep_victims(key) if callable(keep_victims) else keep_victims


class Victim(NamedTuple):
    """A chunk a tier evicted; ``frame`` is set only when the caller asked to keep victims."""

    key: bytes
    frame: bytes | None


class TierFullError(StoreUnavailableError):
    """The chunk is larger than the tier could ever make room for (capacity or pinned chunks)."""


def check_key(key: object) -> bytes:
    """The key as ``bytes``; :class:`~kvshrink.errors.InvalidKeyError` (a TypeError and a
    ValueError) naming what is wrong for a caller bug: not bytes-like, empty, or too long."""
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise InvalidKeyError(f"store keys are bytes, got {type(key).__name__}")
    key = bytes(key)
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise InvalidKeyError(f"store keys hold 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    return key


def _never_pinned(key: bytes) -> bool:
    return False


class Tier(ABC):
    """Base class: subclasses implement frame storage; decoding and quarantine live here. A kind
    sets ``kind`` and, when it has keys of its own, ``config_class``; one registration line makes
    store YAML reach it (:mod:`kvshrink.store.tier_registry`)."""

    kind: str = ""
    config_class: type[TierConfig] = TierConfig  # holds and checks this kind's own config keys
    device_reads = False  # True: a read waits for a device (SSD): reads beside decodes keep the cores busy
    codecs: Any = None  # the store's tier_codecs.StoreCodecs, set when a store opens the tier (None: process-wide)

    def __init__(self, config: TierConfig, is_pinned: Callable[[bytes], bool] | None = None) -> None:
        self.config = config
        self.name = config.name
        self.compressed = config.compressed
        self.capacity_bytes = config.capacity
        self.is_pinned = is_pinned or _never_pinned
        self.counters = Counters(TIER_COUNTERS)

    @property
    def is_remote(self) -> bool:
        """Whether the tier is shared over the network (Redis): every call is a round trip and
        may fail with an outage. The store reads such a tier key by key on purpose (each chunk
        decoded as it arrives), and parks chunks bound for it instead of writing them inline."""
        return False

    @property
    def batch_reads(self) -> bool:
        """Deprecated name of :attr:`is_remote`."""
        return self.is_remote

    # -- what a tier implements -------------------------------------------------------------------
    @abstractmethod
    def write_frame(self, key: bytes, frame: Buffer, keep_victims: KeepVictims = False,
                    evict_first: Sequence[bytes] = ()) -> list[Victim]:
        """Store ``frame`` under ``key``, evicting as needed (``evict_first``, the keys
        :meth:`plan_eviction` named, before any other); return the evicted chunks, with their
        frames for those ``keep_victims`` selects (True: all)."""

    @abstractmethod
    def _open_frame(self, key: bytes, touch: bool = True) -> AbstractContextManager[Buffer | None]:
        """Context manager yielding the stored frame (valid inside the block) or None;
        ``touch`` marks the chunk as recently used."""

    @abstractmethod
    def _discard_corrupt(self, key: bytes, reason: str) -> None:
        """Make sure a frame that failed verification is never served again."""

    @abstractmethod
    def delete(self, key: bytes) -> bool:
        """Remove ``key``; False when it was not there."""

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Cheap membership test (may be stale for a remote tier)."""

    @abstractmethod
    def keys(self) -> list[bytes]:
        """Every key the tier holds, oldest (first to evict) first where it knows an order."""

    @abstractmethod
    def usage(self) -> tuple[int, int]:
        """(bytes stored, chunks stored)."""

    def holds_frame(self, key: bytes, frame: Buffer) -> bool:
        """Whether the tier holds ``frame`` under ``key`` byte for byte, as far as it can tell
        cheaply: the store then refreshes the chunk instead of rewriting it (a rewrite may leave
        a moment with no readable copy). True marks the chunk as recently used. Tiers where a
        look costs I/O or a round trip say False: the write follows as usual."""
        return False

    def plan_eviction(self, key: bytes, frame_len: int) -> list[bytes]:
        """Keys that writing ``frame_len`` bytes under ``key`` would evict now, oldest first,
        without evicting them: the store copies them below *before* the write, so a crash
        between eviction and demotion cannot lose them. Unbounded tiers return []."""
        return []

    def close(self) -> None:
        """Release files, mappings and connections; the stored chunks stay where they are."""

    def extra_stats(self) -> dict[str, Any]:
        """Tier-specific facts worth reporting (huge pages in use, quarantine count, ...)."""
        return {}

    def _verified(self, key: bytes) -> bool:
        """Whether a failed decode means corruption (True) or a lost race with a writer that
        this process does not control (False: a miss, not a quarantine)."""
        return True

    # -- derived behaviour ------------------------------------------------------------------------
    def get(self, key: bytes, out: Any = None, *, serial: bool = False) -> Any:
        """The chunk decoded (into ``out`` when given), or None on a miss; ``serial``: see
        :meth:`decode_frame`."""
        with self._open_frame(key) as frame:
            if frame is None:
                self.counters.add("misses")
                return None
            return self.decode_frame(key, frame, out, serial=serial)

    def decode_frame(self, key: bytes, frame: Buffer, out: Any = None, *, serial: bool = False) -> Any:
        """Decode a frame this tier returned; a corrupt one is quarantined and becomes a miss.
        ``serial``: on the calling thread alone (the caller runs other chunks' decodes beside
        it, so block helpers would only queue for the same cores), else the codec's block
        parallelism within the process budget."""
        from kvshrink.codec import CodecError
        from kvshrink.store.tier_codecs import codecs_of

        try:
            chunk = codecs_of(self).decoder(serial).decode(frame, out)
        except CodecError as exc:
            self.counters.add("misses")
            if self._verified(key):
                self.quarantine(key, str(exc))
            return None
        self.counters.add("hits")
        return chunk

    def header(self, key: bytes) -> Any:
        """The frame header (dtype, shape, sizes) without decoding the chunk, or None."""
        from kvshrink.codec import CodecError, read_header

        with self._open_frame(key) as frame:
            if frame is None:
                return None
            try:
                return read_header(frame)
            except CodecError as exc:
                if self._verified(key):
                    self.quarantine(key, str(exc))
                return None

    def read_frame(self, key: bytes) -> bytes | None:
        """A private copy of the stored frame (for demotion and copies between tiers); does not
        count as a use of the chunk."""
        with self._open_frame(key, touch=False) as frame:
            return None if frame is None else bytes(frame)

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """``contains`` for many keys; a remote tier pipelines them (Redis: per master in a cluster)."""
        return [self.contains(k) for k in keys]

    def fetch_frames(self, keys: list[bytes]) -> list[Buffer | None]:
        """Raw frames of many keys, None for a miss; a remote tier asks for them in batches (Redis:
        one MGET, per master in a cluster). The store's reads pass one key at a time, so that
        each chunk decodes as it arrives (see :attr:`is_remote`)."""
        return [self.read_frame(k) for k in keys]

    def quarantine(self, key: bytes, reason: str) -> None:
        log.warning("tier %s: chunk %s failed verification (%s); quarantined", self.name, key.hex()[:32], reason)
        self.counters.add("quarantined")
        self._discard_corrupt(key, reason)

    def stats(self) -> dict[str, Any]:
        stored, chunks = self.usage()
        return {"kind": self.kind, **self.counters.snapshot(), "bytes_stored": stored, "chunks": chunks,
                "capacity_bytes": self.capacity_bytes, **self.extra_stats()}

    def _count_write_error(self, key: bytes, exc: BaseException) -> StoreUnavailableError:
        """Count a refused write and turn it into the error ``write_frame`` raises."""
        self.counters.add("errors")
        log.warning("tier %s: cannot store chunk %s: %s", self.name, key.hex()[:32], exc)
        if isinstance(exc, StoreUnavailableError):
            return exc
        return StoreUnavailableError(f"tier {self.name}: {exc}")


class LruIndex:
    """Key -> size in eviction order (a plain dict keeps insertion order and builds twice as
    fast as an OrderedDict after an index replay); ``touch`` re-inserts a key at the young end
    under LRU and does nothing under FIFO. Not thread-safe: tiers call it under their lock."""

    def __init__(self, policy: str) -> None:
        self._entries: dict[bytes, int] = {}
        self._touch_on_read = policy == "lru"
        self.total = 0

    def load(self, entries: dict[bytes, int]) -> None:
        """Take over ``entries`` (oldest first) as the whole index, e.g. after an index replay."""
        self._entries = entries
        self.total = sum(entries.values())

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> int | None:
        return self._entries.get(key)

    def add(self, key: bytes, size: int) -> None:
        self.total += size - self._entries.pop(key, 0)
        self._entries[key] = size

    def pop(self, key: bytes) -> int | None:
        size = self._entries.pop(key, None)
        if size is not None:
            self.total -= size
        return size

    def touch(self, key: bytes) -> None:
        if self._touch_on_read and key in self._entries:
            self._entries[key] = self._entries.pop(key)

    def oldest(self, is_pinned: Callable[[bytes], bool], exclude: bytes = b"",
               first: Sequence[bytes] = ()) -> Iterator[bytes]:
        """Eviction candidates: the keys in ``first`` (a plan made earlier, which reads may have
        reordered since), then the rest oldest first; pinned keys are skipped. The caller may pop
        the keys it is given while iterating. Looks at the oldest 256 before copying the whole
        index: copying 100k keys for every eviction would cost more than the eviction."""
        window = list(itertools.islice(self._entries, _OLDEST_BATCH))
        head = list(dict.fromkeys([k for k in first if k in self._entries] + window))
        for key in head:
            if key in self._entries and key != exclude and not is_pinned(key):
                yield key
        if len(window) == _OLDEST_BATCH:  # many pinned (or many victims): walk the rest
            seen = set(head)
            for key in list(self._entries):
                if key not in seen and key != exclude and not is_pinned(key):
                    yield key

    def keys(self) -> list[bytes]:
        return list(self._entries)

    def items(self) -> list[tuple[bytes, int]]:
        return list(self._entries.items())


_OLDEST_BATCH = 256
