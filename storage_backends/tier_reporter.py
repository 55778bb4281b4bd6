"""Tier reporter: tells the KVShrink index on which medium (dram / ssd / remote) each chunk of this
cache server lives, so the router scores a hit in our DRAM tier as DRAM, not as "some L2 adapter".

Wire: ``POST <index_url>/events`` (msgpack), the ``CacheEventBatch`` shape that
``kvshrink.index.tier_events`` ingests, one stream per process: ``instance_id`` =
``index_instance_id``, ``incarnation`` = the process's start time in ms (the index drops what an
earlier process of ours reported), ``seq`` 1, 2, ... per batch; ``tier: "l2"``, ``backend:
"kvshrink"``, ``medium`` always set. A chunk's medium is that of the fastest tier holding it
(``TieredStore.where``: dram tier -> dram, ssd -> ssd, redis -> remote, a chunk parked on its way
to Redis -> remote). When it changes, the body holds a ``store`` on the new medium *before* the
``delete`` on the old one (the index forgets a key once no tier of the instance holds it, so the
other order would lose it); a chunk no tier holds any more is a ``delete``. So a put, a demotion, a
promotion and a drop each show up in the index within about ``index_flush_interval`` seconds.

Off the request path: the store's placement notices (``TieredStore.add_placement_listener``, sent
on store threads) only add keys to a bounded set (``index_max_pending`` keys; a notice beyond it is
dropped and counted, ``notices_dropped``, and once the reporter caught up it looks at every chunk it
reported again). One daemon thread, every ``index_flush_interval`` seconds, asks the store where
each noticed key is, diffs that against what it told the index, and posts at most ``MAX_BATCH``
entries per request, waiting at most ``POST_TIMEOUT_S``. A post that fails is retried *as is*
(same ``seq``: the index skips a batch it applied already) with a growing pause, while new notices
wait in the set; an index that refuses a body (4xx) loses that body (``entries_unsent``, logged).

Resolving a chunk (what the index needs): the first ``store`` of a chunk carries its token ids
and position, which LMCache hands an L2 adapter only as an ``ObjectKey``; they come from LMCache's
``MP_TOKENS`` events (:func:`subscribe_tokens`), kept for the last ``TOKEN_BINDINGS`` chunks. Later
entries need only the key (the index knows it from our stream) but carry the tokens while they are
kept, so that an index that dropped the first report can still place the chunk. Covered: chunks LMCache stores
through its lmcache-driven transfer (which publishes ``MP_TOKENS``), first chunks of a prompt
always, later ones once the router's ``/lookup`` of the prompt taught the index their position
(as for LMCache's own events). Not covered, counted as ``unresolvable`` and not sent: chunks
stored through engine-driven transfer or with LMCache's event bus off (no ``MP_TOKENS``), salted
chunks (``cache_salt``: the index drops them), chunks left by an earlier process until LMCache
stores them again (the adapter re-notices those), what Redis evicts on its own, and an index that
restarted (it learns our chunks again only as they move).

Threads and errors: ``notify`` and ``bind_tokens`` may be called from any thread, take one small
lock and never block on the store or the network; they never raise. The reporter thread catches,
logs and counts everything (``send_errors``, ``store_errors``). ``close`` gives pending reports
``CLOSE_TIMEOUT_S`` to go out, and after it returns the thread never touches the store again.
Buffers: none; token lists from LMCache are held, not copied, and never modified. Counters: in
the adapter's ``/status`` (``index_reporter``) and, through :meth:`TierReporter.collector`
(registered by the adapter), on ``/metrics`` as ``kvshrink_tier_reporter_*``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple

import httpx
import msgspec

from kvshrink.config_checks import int_value, number_value
from kvshrink.errors import ConfigError, CorruptDataError, KVShrinkError
from kvshrink.storage_backends.keys import wire_object_key
from kvshrink.store.stats import Counters

if TYPE_CHECKING:
    from kvshrink.store import StoreConfig

log = logging.getLogger(__name__)

MEDIUM_OF_KIND = {"dram": "dram", "ssd": "ssd", "redis": "remote"}  # store tier kind -> index medium
BACKEND = "kvshrink"
MAX_BATCH = 4096  # keys looked at, and entries sent, per request
TOKEN_BINDINGS = 8192  # the chunks stored last whose token ids are kept, for their reports
POST_TIMEOUT_S = 2.0
CLOSE_TIMEOUT_S = 2.0
MAX_BACKOFF_S = 10.0
REPORTER_COUNTERS = ("batches_sent", "entries_sent", "send_errors", "notices_dropped", "unresolvable",
                     "store_errors", "entries_unsent")
REPORTER_GAUGES = ("pending_keys", "unsent_entries", "reported_chunks")

URL_KEY, INSTANCE_KEY = "index_url", "index_instance_id"
FLUSH_KEY, PENDING_KEY = "index_flush_interval", "index_max_pending"
REPORTER_KEYS = (URL_KEY, INSTANCE_KEY, FLUSH_KEY, PENDING_KEY)


@dataclass(frozen=True)
class ReporterSettings:
    """The ``index_*`` adapter parameters; reporting is off unless ``index_url`` is set."""

    url: str
    instance_id: str
    flush_interval: float = 0.5
    max_pending: int = 65536

    @classmethod
    def from_params(cls, params: Mapping[str, Any], prefix: str) -> "ReporterSettings | None":
        """Validate the ``index_*`` keys of ``params`` (errors name ``prefix + key``); None when
        ``index_url`` is unset."""
        url = params.get(URL_KEY)
        if url is None:
            stray = sorted(k for k in REPORTER_KEYS if k in params and k != URL_KEY)
            if stray:
                raise ConfigError(prefix + stray[0], f"only means something with {prefix}{URL_KEY}")
            return None
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(prefix + URL_KEY, f"expected the index's base URL (http://host:port), got {url!r}")
        instance = params.get(INSTANCE_KEY)
        if not isinstance(instance, str) or not instance or "@" in instance:
            raise ConfigError(prefix + INSTANCE_KEY, "required with index_url: the instance id (or alias) the index "
                                                     "knows this cache server's engine by, a non-empty string "
                                                     f"without '@'; got {instance!r}")
        flush = number_value(params.get(FLUSH_KEY, cls.flush_interval), prefix + FLUSH_KEY, above=True, maximum=60)
        pending = int_value(params.get(PENDING_KEY, cls.max_pending), prefix + PENDING_KEY, 1)
        return cls(url.rstrip("/"), instance, flush, pending)


class Body(NamedTuple):
    """One request: its msgpack bytes and what it holds, for the counters."""

    data: bytes
    entries: int
    batches: int


def media_of(store_config: "StoreConfig") -> dict[str, str]:
    """Tier name -> the index's medium for it."""
    return {tier.name: MEDIUM_OF_KIND[tier.kind] for tier in store_config.tiers}


class TierReporter:
    """Mirrors where the store's chunks live into the index (see the module docstring)."""

    def __init__(self, settings: ReporterSettings, where: Callable[[bytes], str | None],
                 media: Mapping[str, str]) -> None:
        self.settings = settings
        self.incarnation = time.time_ns() // 1_000_000
        self.counters = Counters(REPORTER_COUNTERS)
        self._where = where
        self._media = dict(media)
        self._lock = threading.Lock()  # guards _dirty, _overflowed, _bindings; never held across I/O
        self._dirty: dict[bytes, None] = {}
        self._overflowed = False
        self._bindings: OrderedDict[bytes, tuple[list[int], int]] = OrderedDict()
        self._store_lock = threading.Lock()  # held while the thread asks the store; close() takes it to detach
        self._detached = False
        # the reporter thread's own state
        self._reported: dict[bytes, str] = {}  # store key -> medium the index was told
        self._recheck: list[bytes] = []  # reported keys to look at again after dropped notices
        self._unsent: Body | None = None  # a body to retry as is
        self._capped = False  # the last body stopped at MAX_BATCH keys
        self._seq = 0
        self._failing = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._close_deadline = 0.0
        self._client = httpx.Client(timeout=POST_TIMEOUT_S, headers={"content-type": "application/msgpack"})
        self._thread = threading.Thread(target=self._run, name="kvshrink-tier-reporter", daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------------------------
    def notify(self, keys: list[bytes]) -> None:
        """Placement listener: look at ``keys`` in the next round; beyond ``max_pending`` waiting
        keys a notice is dropped and counted."""
        if self._stop.is_set():
            return
        dropped = 0
        with self._lock:
            room = self.settings.max_pending - len(self._dirty)
            for key in keys:
                if key in self._dirty:
                    continue
                if room <= 0:
                    dropped += 1
                    continue
                self._dirty[key] = None
                room -= 1
            self._overflowed = self._overflowed or dropped > 0
        if dropped:
            self.counters.add("notices_dropped", dropped)

    def bind_tokens(self, chunk_hashes: list[bytes], token_chunks: list[list[int]], token_offsets: list[int]) -> None:
        """Remember each chunk's token ids and first token's position (an ``MP_TOKENS`` event) for
        its first ``store`` entry; the last ``TOKEN_BINDINGS`` chunks are kept."""
        if self._stop.is_set():
            return
        with self._lock:
            for chunk_hash, tokens, offset in zip(chunk_hashes, token_chunks, token_offsets):
                key = bytes(chunk_hash)
                self._bindings[key] = (tokens, offset)
                self._bindings.move_to_end(key)
            while len(self._bindings) > TOKEN_BINDINGS:
                self._bindings.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        """Counters and queue depths, for the adapter's ``/status`` section."""
        with self._lock:
            pending = len(self._dirty)
        unsent = self._unsent
        return {"index_url": self.settings.url, "instance_id": self.settings.instance_id,
                "incarnation": self.incarnation, **self.counters.snapshot(), "pending_keys": pending,
                "unsent_entries": unsent.entries if unsent else 0, "reported_chunks": len(self._reported)}

    def collector(self) -> Any:
        """A prometheus_client collector of :meth:`stats`: ``kvshrink_tier_reporter_<counter>_total``
        and the gauges ``kvshrink_tier_reporter_{pending_keys,unsent_entries,reported_chunks}``."""
        from kvshrink.store.metrics_export import SnapshotCollector

        return SnapshotCollector("kvshrink_tier_reporter", self.stats, REPORTER_COUNTERS, REPORTER_GAUGES,
                                 "tier reporter")

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Send what is pending for at most ``timeout`` seconds, then stop; from its return on the
        thread never calls the store (a post still running is abandoned with the thread)."""
        if self._stop.is_set():
            return
        self._close_deadline = time.monotonic() + timeout
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        with self._store_lock:
            self._detached = True
        if self._thread.is_alive():
            log.warning("tier reporter: index %s did not answer within %.1f s of close; pending reports dropped",
                        self.settings.url, timeout)

    # -- the reporter thread -------------------------------------------------------------------------
    def _run(self) -> None:
        pause = self.settings.flush_interval
        while True:
            stopping = self._stop.is_set()
            outcome = self._round()
            pause = min(pause * 2, MAX_BACKOFF_S) if outcome == "failed" else self.settings.flush_interval
            if stopping and (outcome != "more" or time.monotonic() > self._close_deadline):
                break
            if outcome != "more":
                self._wake.wait(pause)
                self._wake.clear()
        with self._lock:
            left = len(self._dirty)
        self.counters.add("entries_unsent", left + (self._unsent.entries if self._unsent else 0))
        self._client.close()

    def _round(self) -> str:
        """Send the unsent body, or build and send the next: ``idle``, ``more`` (keys left over
        after a full body) or ``failed``."""
        try:
            if self._unsent is None:
                self._unsent = self._next_body()
                if self._unsent is None:
                    return "more" if self._capped else "idle"
            if not self._post(self._unsent):
                return "failed"
            self._unsent = None
            return "more" if self._capped else "idle"
        except Exception:  # noqa: BLE001 - a bug here must not end the reporting: logged and counted
            self.counters.add("store_errors")
            log.exception("tier reporter: a round failed")
            return "failed"

    def _take_keys(self) -> list[bytes]:
        with self._lock:
            keys = list(itertools.islice(self._dirty, MAX_BATCH))
            for key in keys:
                del self._dirty[key]
            if self._overflowed:
                self._overflowed = False
                self._recheck = list(self._reported)
        room = MAX_BATCH - len(keys)
        keys += self._recheck[:room]
        del self._recheck[:room]
        self._capped = len(keys) == MAX_BATCH
        return keys

    def _next_body(self) -> Body | None:
        """Where the noticed keys are now, against what the index was told: one msgpack body."""
        stores: dict[str, list[dict]] = {}
        deletes: dict[str, list[dict]] = {}
        with self._store_lock:
            if self._detached:
                return None
            keys = self._take_keys()
            for done, key in enumerate(keys):
                if self._stop.is_set() and time.monotonic() > self._close_deadline:
                    self.counters.add("entries_unsent", len(keys) - done)
                    break
                try:
                    tier = self._where(key)
                except KVShrinkError as exc:
                    self.counters.add("store_errors")
                    log.warning("tier reporter: cannot tell where %s is: %s", key[:80], exc)
                    continue
                medium = self._media.get(tier) if tier is not None else None
                old = self._reported.get(key)
                if medium == old:
                    continue
                entry = self._entry(key, need_tokens=old is None)
                if entry is None:
                    continue
                if medium is not None:
                    stores.setdefault(medium, []).append(entry)
                    self._reported[key] = medium
                else:
                    del self._reported[key]
                if old is not None:
                    deletes.setdefault(old, []).append({"key": entry["key"]})
        batches = [self._batch(event, medium, entries)
                   for event, groups in (("store", stores), ("delete", deletes)) for medium, entries in groups.items()]
        if not batches:
            return None
        return Body(msgspec.msgpack.encode({"batches": batches}), sum(len(b["entries"]) for b in batches), len(batches))

    def _entry(self, key: bytes, need_tokens: bool) -> dict[str, Any] | None:
        """The event entry of store key ``key``, with its tokens while they are known (so that an
        index that dropped the first report can still place the chunk); None (counted
        ``unresolvable``) for a key the index could not place: not an LMCache ObjectKey, salted, or
        ``need_tokens`` (a first report) and its tokens unknown."""
        try:
            wire = wire_object_key(key)
        except CorruptDataError:
            wire = None
        if wire is None or wire["cache_salt"]:
            self.counters.add("unresolvable")
            return None
        with self._lock:
            binding = self._bindings.get(bytes.fromhex(wire["chunk_hash_hex"]))
        if binding is not None:
            return {"key": wire, "token_ids": binding[0], "token_offset": binding[1]}
        if need_tokens:
            self.counters.add("unresolvable")
            return None
        return {"key": wire}

    def _batch(self, event: str, medium: str, entries: list[dict]) -> dict[str, Any]:
        self._seq += 1
        return {"instance_id": self.settings.instance_id, "incarnation": self.incarnation, "seq": self._seq,
                "event_type": event, "tier": "l2", "backend": BACKEND, "medium": medium, "ts": time.time(),
                "entries": entries}

    def _post(self, body: Body) -> bool:
        """POST one body; True once it needs no retry (sent, or refused for good)."""
        try:
            response = self._client.post(f"{self.settings.url}/events", content=body.data)
        except httpx.HTTPError as exc:
            return self._failed(f"{type(exc).__name__}: {exc}")
        if response.status_code >= 500 or response.status_code in (408, 429):
            return self._failed(f"HTTP {response.status_code}")
        if response.status_code != 200:
            self.counters.add("entries_unsent", body.entries)
            log.error("tier reporter: index %s refused %d entries: HTTP %d %s", self.settings.url, body.entries,
                      response.status_code, response.text[:200])
            return True
        if self._failing:
            log.info("tier reporter: index %s answers again", self.settings.url)
            self._failing = False
        self.counters.add("batches_sent", body.batches)
        self.counters.add("entries_sent", body.entries)
        return True

    def _failed(self, why: str) -> bool:
        self.counters.add("send_errors")
        if not self._failing:  # once per outage, not once per retry
            log.warning("tier reporter: cannot post to index %s (%s); retrying, new reports wait",
                        self.settings.url, why)
            self._failing = True
        return False


def subscribe_tokens(bus: Any, reporter: TierReporter) -> bool:
    """Feed LMCache's ``MP_TOKENS`` events (published when a store is submitted through its
    lmcache-driven transfer, before the chunks reach L2) from event bus ``bus`` to ``reporter``;
    False when the bus is off (``--disable-observability``): chunks then stay unresolvable."""
    from lmcache.v1.mp_observability.event import EventType

    if not bus.enabled:
        log.warning("tier reporter: LMCache's event bus is off, so chunks come without token ids and the index "
                    "cannot place them")
        return False

    def on_tokens(event: Any) -> None:  # LMCache's bus drain thread
        meta = event.metadata
        reporter.bind_tokens(meta["chunk_hashes"], meta["token_chunks"], meta["token_offsets"])

    bus.subscribe(EventType.MP_TOKENS, on_tokens)
    return True
