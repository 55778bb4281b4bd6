"""Redis tier (Redis or Valkey, standalone or cluster): compressed frames under namespaced keys.

Why the failure handling looks the way it does: Redis is the shared, remote tier, so an outage is
normal operation. Every call has a socket timeout and a bounded redis-py ``Retry`` with jittered
exponential backoff; when that is spent, a read is a miss and a write raises
:class:`~kvshrink.errors.StoreUnavailableError`, both counted. The connection pool reconnects on
the next call once Redis is back; there is no reconnection code here.

Redis Cluster (``cluster: true``): each key lives on the master of its hash slot, so a batch
(``fetch_frames``, ``contains_many``) goes out one master at a time, and a dead master costs the
keys of its slots only, never the whole batch. The cluster client must reach a node to learn the
slot map; a cluster that is down when the tier opens is an outage like any other (misses until
it answers), not a failed start. Run a cache cluster with ``cluster-require-full-coverage no``:
by default, ``cluster-node-timeout`` after a master died, the others refuse every command too.

Capacity and eviction are Redis's own (``maxmemory`` + ``maxmemory-policy allkeys-lru``); the
configured ``capacity`` is reported, not enforced. Frames are stored whole, optionally with a TTL.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from kvshrink.errors import ConfigError, StoreUnavailableError
from kvshrink.extras import require
from kvshrink.store.config import TierConfig
from kvshrink.store.tier_base import Buffer, KeepVictims, Tier, Victim

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RedisTierConfig(TierConfig):
    """A Redis tier's own keys. ``capacity`` is optional here (Redis's ``maxmemory`` bounds it)."""

    url: str = ""
    cluster: bool = False
    ttl_s: float = 0.0
    timeout_s: float = 0.5
    retries: int = 1
    namespace: str = "kvshrink"

    bounded = False

    @classmethod
    def parse_kind_keys(cls, data: Mapping[str, Any], name: str, prefix: str) -> dict[str, Any]:
        out = super().parse_kind_keys(data, name, prefix)
        url = str(data.get("url") or "")
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"{prefix}.url", f"expected a redis:// or rediss:// URL, got {url!r}")
        out["url"] = _checked_url(url, f"{prefix}.url")
        if out.get("timeout_s", 1.0) <= 0:
            raise ConfigError(f"{prefix}.timeout_s", "must be > 0: a timeout is what turns an outage into a miss")
        return out


def _checked_url(url: str, key: str) -> str:
    """``url`` if redis-py can build a connection from it (parsed as ``Redis.from_url`` will);
    the message names what is wrong but never echoes the URL, which may hold a password."""
    import inspect

    require("redis.connection", "redis")  # not installed: MissingExtraError with the pip line
    from redis.connection import Connection, parse_url

    try:
        options = parse_url(url)
    except ValueError as exc:
        raise ConfigError(key, f"not a valid Redis URL: {exc}") from None
    connection_class = options.pop("connection_class", Connection)
    accepted: set[str] = set()
    for cls in connection_class.__mro__:
        if "__init__" in cls.__dict__:
            accepted |= set(inspect.signature(cls.__dict__["__init__"]).parameters)
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ConfigError(key, f"unknown connection option(s) {unknown} in the URL's query string")
    return url


def connect(config: RedisTierConfig) -> Any:
    """A redis-py client for ``config.url`` with timeouts and a bounded, backed-off retry; a URL
    redis-py cannot parse raises :class:`~kvshrink.errors.ConfigError` (config.py checks it at
    load, this covers a config built by hand)."""
    redis = require("redis", "redis")
    from redis.backoff import ExponentialWithJitterBackoff
    from redis.retry import Retry

    options: dict[str, Any] = {
        "socket_timeout": config.timeout_s,
        "socket_connect_timeout": config.timeout_s,
        "retry": Retry(ExponentialWithJitterBackoff(cap=config.timeout_s, base=0.01), config.retries),
    }
    try:
        if config.cluster:
            from redis.cluster import RedisCluster

            return RedisCluster.from_url(config.url, **options)
        return redis.Redis.from_url(config.url, **options)
    except ValueError as exc:  # urllib / parse_url: a malformed URL (never echoed: it may hold a password)
        raise ConfigError(f"{config.name}.url", f"not a valid Redis URL: {exc}") from exc


class RedisTier(Tier):
    kind = "redis"
    config_class = RedisTierConfig
    config: RedisTierConfig

    def __init__(self, config: RedisTierConfig, is_pinned: Callable[[bytes], bool] | None = None) -> None:
        super().__init__(config, is_pinned)
        require("redis.exceptions", "redis")
        from redis.exceptions import RedisClusterException, RedisError

        # RedisClusterException is no RedisError: the cluster client raises it when no node answers
        self._errors = (RedisError, RedisClusterException, OSError)
        self._prefix = config.namespace.encode() + b":"
        self._ttl = int(config.ttl_s * 1000) or None
        self._made: Any = None
        self._made_lock = threading.Lock()
        try:
            self._client  # a URL redis-py cannot parse fails here; a cluster client also reads the slot map
        except self._errors as exc:
            self.counters.add("errors")
            log.warning("tier %s: Redis unreachable (%s); its reads miss until it answers", self.name, exc)

    @property
    def _client(self) -> Any:
        """The redis-py client, made on first use that succeeds (see the module docstring)."""
        if self._made is None:
            with self._made_lock:
                if self._made is None:
                    self._made = connect(self.config)
        return self._made

    @property
    def is_remote(self) -> bool:
        return True

    def _k(self, key: bytes) -> bytes:
        return self._prefix + key

    def write_frame(self, key: bytes, frame: Buffer, keep_victims: KeepVictims = False,
                    evict_first: Sequence[bytes] = ()) -> list[Victim]:
        data = frame if isinstance(frame, bytes) else memoryview(frame).cast("B").tobytes()
        try:
            self._client.set(self._k(key), data, px=self._ttl)
        except self._errors as exc:
            raise self._count_write_error(key, exc) from exc
        self.counters.add("puts")
        self.counters.add("put_bytes", len(data))
        return []

    @contextmanager
    def _open_frame(self, key: bytes, touch: bool = True) -> Iterator[Buffer | None]:
        yield self._call("get", None, self._k(key))

    def fetch_frames(self, keys: list[bytes]) -> list[Buffer | None]:
        # mget_nonatomic: one MGET per hash slot, pipelined (a plain MGET must not span slots)
        method = "mget_nonatomic" if self.config.cluster else "mget"
        return self._batch(method, keys, lambda names: getattr(self._client, method)(names), None)

    def _discard_corrupt(self, key: bytes, reason: str) -> None:
        self._call("delete", 0, self._k(key))

    def delete(self, key: bytes) -> bool:
        return bool(self._call("delete", 0, self._k(key)))

    def contains(self, key: bytes) -> bool:
        return bool(self._call("exists", 0, self._k(key)))

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        def exists(names: list[bytes]) -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return [bool(n) for n in pipe.execute()]

        return self._batch("exists", keys, exists, False)

    def keys(self) -> list[bytes]:
        try:
            return [k[len(self._prefix) :] for k in self._client.scan_iter(match=self._prefix + b"*", count=1000)]
        except self._errors as exc:
            self.counters.add("errors")
            raise StoreUnavailableError(f"tier {self.name}: cannot list keys: {exc}") from exc

    def usage(self) -> tuple[int, int]:
        return -1, -1  # shared and self-evicting: only Redis knows (INFO memory), not this client

    def close(self) -> None:
        if self._made is not None:
            self._made.close()

    def _call(self, method: str, fallback: Any, *args: Any) -> Any:
        """Run one client call; an unreachable or slow Redis is counted and gives ``fallback``."""
        try:
            return getattr(self._client, method)(*args)
        except self._errors as exc:
            self._failed(method, exc)
            return fallback

    def _failed(self, what: str, exc: BaseException) -> None:
        self.counters.add("errors")
        log.debug("tier %s: %s failed: %s", self.name, what, exc)

    def _batch(self, what: str, keys: list[bytes], run: Callable[[list[bytes]], Sequence[Any]],
               fallback: Any) -> list[Any]:
        """``run`` over the keys' names, one master's keys at a time (standalone: all at once),
        answers in the order of ``keys``; a master that fails is counted and gives ``fallback``
        for its own keys only."""
        names = [self._k(k) for k in keys]
        out = [fallback] * len(keys)
        try:
            groups = self._by_master(names)
        except self._errors as exc:  # no slot map: the cluster has been unreachable since the tier opened
            self._failed(what, exc)
            return out
        for group in groups:
            try:
                for i, value in zip(group, run([names[i] for i in group])):
                    out[i] = value
            except self._errors as exc:
                self._failed(what, exc)
        return out

    def _by_master(self, names: list[bytes]) -> list[list[int]]:
        """Indexes of ``names`` grouped by the master that serves them, as the slot map says now."""
        if not names:
            return []
        if not self.config.cluster:
            return [list(range(len(names)))]
        client = self._client
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            groups.setdefault(client.get_node_from_key(name).name, []).append(i)
        return list(groups.values())
