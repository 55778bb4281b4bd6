"""Serving instances known to the index: identity, bit position, URL, models, load, liveness.

An instance is *alive* while something vouches for it: a KV event, a tier-event batch, a heartbeat
POST or a successful scrape of its ``/metrics``. One that stays silent longer than the heartbeat
timeout has its blocks dropped (an instance from the YAML file keeps its registration, an
auto-registered one is forgotten). Each instance owns one bit in the block index's masks; bits
are reused after removal (only once every bit was used) and capped by ``max_instances``, which
bounds memory and lookup cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvshrink.errors import KVShrinkError
from kvshrink.index.block_index import Feed


class RegistryFullError(KVShrinkError):
    """``max_instances`` instances are registered already."""


@dataclass(eq=False)
class Instance:
    instance_id: str
    bit: int
    url: str | None = None
    models: set[str] = field(default_factory=set)
    replay_endpoint: str | None = None
    events_endpoint: str | None = None
    aliases: set[str] = field(default_factory=set)
    static: bool = False  # from the config file: never forgotten, only emptied
    load: float = 0.0
    last_seen: float = field(default_factory=time.monotonic)
    process_start: float | None = None  # vLLM's process_start_time_seconds, to detect restarts
    feeds: dict[str, Feed] = field(default_factory=dict)  # stream name -> feed

    def describe(self) -> dict:
        return {"id": self.instance_id, "url": self.url, "models": sorted(self.models), "load": self.load,
                "replay_endpoint": self.replay_endpoint, "aliases": sorted(self.aliases), "static": self.static,
                "idle_s": round(time.monotonic() - self.last_seen, 3),
                "blocks": {name: len(feed.key_map) for name, feed in self.feeds.items()}}


class InstanceRegistry:
    def __init__(self, max_instances: int) -> None:
        self.max_instances = max_instances
        self._by_id: dict[str, Instance] = {}
        self._by_bit: dict[int, Instance] = {}
        self._alias: dict[str, str] = {}
        self._ever_used: set[int] = set()

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self):
        return iter(list(self._by_id.values()))

    def get(self, instance_id: str) -> Instance | None:
        inst = self._by_id.get(instance_id)
        if inst is None and instance_id in self._alias:
            inst = self._by_id.get(self._alias[instance_id])
        return inst

    def add(self, instance_id: str, *, url: str | None = None, models: set[str] | None = None,
            replay_endpoint: str | None = None, events_endpoint: str | None = None,
            aliases: set[str] | None = None, static: bool = False) -> Instance:
        """Register (or update) an instance; allocates the lowest free bit."""
        inst = self._by_id.get(instance_id)
        if inst is None:
            if len(self._by_id) >= self.max_instances:
                raise RegistryFullError(f"cannot register {instance_id!r}: max_instances={self.max_instances} reached")
            # never-used bits first: a reused bit could meet blocks whose removal was never reported
            fresh = len(self._ever_used)
            bit = fresh if fresh < self.max_instances else next(b for b in range(self.max_instances)
                                                                   if b not in self._by_bit)
            self._ever_used.add(bit)
            inst = Instance(instance_id, bit)
            self._by_id[instance_id] = inst
            self._by_bit[bit] = inst
        if url is not None:
            inst.url = url.rstrip("/")
        if models:
            inst.models |= models
        if replay_endpoint is not None:
            inst.replay_endpoint = replay_endpoint
        if events_endpoint is not None:
            inst.events_endpoint = events_endpoint
        for alias in aliases or ():
            inst.aliases.add(alias)
            self._alias[alias] = instance_id
        inst.static = inst.static or static
        inst.last_seen = time.monotonic()
        return inst

    def remove(self, inst: Instance) -> None:
        self._by_id.pop(inst.instance_id, None)
        self._by_bit.pop(inst.bit, None)
        for alias in inst.aliases:
            if self._alias.get(alias) == inst.instance_id:
                del self._alias[alias]

    def seen(self, inst: Instance) -> None:
        inst.last_seen = time.monotonic()

    def silent(self, timeout_s: float, now: float | None = None) -> list[Instance]:
        """Instances with nothing heard for longer than ``timeout_s`` (0 disables)."""
        if timeout_s <= 0:
            return []
        now = time.monotonic() if now is None else now
        return [inst for inst in self._by_id.values() if now - inst.last_seen > timeout_s]

    def candidates(self, model: str, only: list[str] | None = None) -> list[Instance]:
        """Instances serving ``model`` (an instance with no known model serves any), optionally
        restricted to ids / URLs / aliases listed in ``only``."""
        found = [inst for inst in self._by_id.values() if not inst.models or model in inst.models]
        if only is not None:
            wanted = {name.rstrip("/") for name in only}
            found = [inst for inst in found
                     if inst.instance_id in wanted or (inst.url and inst.url in wanted) or inst.aliases & wanted]
        return found
