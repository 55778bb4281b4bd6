"""Everything the index knows, behind one lock: instances, blocks, block sizes, position keys.

The ZMQ subscriber thread, the HTTP handlers and the housekeeping task all go through
:class:`IndexState`; each public method takes the lock once, so a lookup sees either all or none
of a batch. Event application lives in ``vllm_ingest`` / ``tier_events``, scoring in ``scoring``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Callable

from kvshrink.index.block_index import BlockIndex, Feed
from kvshrink.index.config import IndexConfig
from kvshrink.index.hashing import position_key
from kvshrink.index.metrics import IndexMetrics
from kvshrink.index.registry import Instance, InstanceRegistry, RegistryFullError
from kvshrink.index.sequence import SequenceTracker

logger = logging.getLogger(__name__)


class PositionMap:
    """LRU map position-key → chain hash, learned from lookups (see ``hashing.position_key``)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._map: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def learn(self, key: int, block_hash: int) -> None:
        self._map[key] = block_hash
        self._map.move_to_end(key)
        if len(self._map) > self.cap:
            self._map.popitem(last=False)

    def get(self, key: int) -> int | None:
        return self._map.get(key)


class IndexState:
    def __init__(self, config: IndexConfig, metrics: IndexMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or IndexMetrics()
        self.lock = threading.RLock()
        self.registry = InstanceRegistry(config.max_instances)
        self.index = BlockIndex(config.max_blocks, width=config.max_instances)
        self.positions = PositionMap(config.max_position_keys)
        self.vllm_seq = SequenceTracker(first_seq=0)
        self.tier_seq = SequenceTracker(first_seq=1)
        self.tier_incarnations: dict[str, int] = {}
        # model -> block sizes its instances publish (vLLM blocks) or store (LMCache chunks)
        self.block_sizes: dict[str, set[int]] = {}
        # once LMCache tier events arrive, lookups also record position keys at its chunk size
        self.tier_events_seen = False
        self.chunk_size = config.lmcache_chunk_size
        self._evictions_seen = 0
        # called (outside the lock) with an instance that needs its events endpoint connected
        self.on_new_events_endpoint: Callable[[str], None] | None = None
        self.metrics.bind_sizes(lambda: len(self.index), lambda: len(self.registry))
        for inst_cfg in config.instances:
            self.registry.add(inst_cfg.id, url=inst_cfg.url, models=set(inst_cfg.models),
                              replay_endpoint=inst_cfg.replay_endpoint, events_endpoint=inst_cfg.events_endpoint,
                              aliases=set(inst_cfg.aliases), static=True)

    # -- instances ------------------------------------------------------------------------------

    def resolve_instance(self, instance_id: str, model: str | None, source: str) -> Instance | None:
        """The instance an event names, auto-registering it if allowed; ``None`` → counted, dropped.

        Caller holds the lock.
        """
        inst = self.registry.get(instance_id)
        if inst is None:
            if not self.config.auto_register:
                self.metrics.drop(source, "unknown_instance")
                return None
            try:
                inst = self.registry.add(instance_id)
            except RegistryFullError as exc:
                logger.warning("%s", exc)
                self.metrics.drop(source, "registry_full")
                return None
            logger.info("auto-registered instance %r from %s events", instance_id, source)
        if model and model not in inst.models:
            inst.models.add(model)
        self.registry.seen(inst)
        return inst

    def feed(self, inst: Instance, name: str) -> Feed:
        """The feed ``name`` of ``inst``, opened on first use. Caller holds the lock."""
        feed = inst.feeds.get(name)
        if feed is None:
            feed = inst.feeds[name] = self.index.open_feed(inst.bit, f"{inst.instance_id}/{name}")
        return feed

    def reset_feed(self, inst: Instance, name: str, reason: str) -> int:
        """Drop what one stream of ``inst`` reported. Caller holds the lock."""
        feed = inst.feeds.get(name)
        if feed is None:
            return 0
        touched = self.index.clear_feed(feed)
        logger.info("reset %s/%s (%s): %d blocks", inst.instance_id, name, reason, touched)
        self.metrics.instances_dropped.labels(reason).inc()
        return touched

    def register(self, instance_id: str, **fields) -> Instance:
        with self.lock:
            known = self.registry.get(instance_id)
            if known is not None and known.instance_id != instance_id:  # an alias (e.g. its LMCache server)
                self.registry.seen(known)
                return known
            old_endpoint = known.events_endpoint if known else None
            inst = self.registry.add(instance_id, **fields)
        if inst.events_endpoint and inst.events_endpoint != old_endpoint and self.on_new_events_endpoint:
            self.on_new_events_endpoint(inst.events_endpoint)
        return inst

    def heartbeat(self, instance_id: str, load: float | None) -> Instance | None:
        with self.lock:
            inst = self.registry.get(instance_id)
            if inst is None:
                return None
            self.registry.seen(inst)
            if load is not None:
                inst.load = float(load)
            return inst

    def remove_instance(self, inst: Instance, reason: str, forget: bool = True) -> None:
        """Empty (and unless static or ``forget`` is false, forget) an instance. Caller holds the lock."""
        for feed in inst.feeds.values():
            self.index.clear_feed(feed)
        inst.feeds.clear()
        self.vllm_seq.forget_matching(lambda key: key[0] == inst.instance_id)
        self.tier_seq.forget_matching(lambda key: key[0] in inst.aliases | {inst.instance_id})
        self.metrics.instances_dropped.labels(reason).inc()
        if forget and not inst.static:
            self.registry.remove(inst)
        logger.info("instance %r %s (%s)", inst.instance_id, "removed" if forget and not inst.static else "emptied",
                    reason)

    def expire_silent(self) -> list[str]:
        """Drop instances that stopped vouching for themselves; returns their ids. With the timeout off
        it does not even take the lock: it runs on the event loop, which would wait for an ingest."""
        if self.config.heartbeat_timeout_s <= 0:
            return []
        with self.lock:
            dropped = []
            for inst in self.registry.silent(self.config.heartbeat_timeout_s):
                if inst.feeds or not inst.static:
                    self.remove_instance(inst, "heartbeat_timeout")
                    dropped.append(inst.instance_id)
            return dropped

    # -- block sizes ------------------------------------------------------------------------------

    def note_block_size(self, model: str, block_size: int) -> None:
        self.block_sizes.setdefault(model, set()).add(block_size)

    def learn_positions(self, data: bytes, block_size: int, root: int, block_hashes: list[int]) -> None:
        """Remember the position key of each block of a prefix known from its start. Caller holds the lock."""
        step = block_size * 4
        view = memoryview(data)
        learn = self.positions.learn
        for i, block_hash in enumerate(block_hashes):
            learn(position_key(view[i * step:(i + 1) * step], i * block_size, root), block_hash)

    def lookup_block_sizes(self, model: str) -> list[int]:
        sizes = set(self.block_sizes.get(model, ())) | set(self.config.lookup_block_sizes)
        return sorted(sizes)

    def sync_eviction_metric(self) -> None:
        """Move the index's eviction count into Prometheus. Caller holds the lock."""
        delta = self.index.evictions - self._evictions_seen
        if delta:
            self.metrics.evictions.inc(delta)
            self._evictions_seen = self.index.evictions

    def snapshot(self) -> dict:
        with self.lock:
            return {"blocks": len(self.index), "max_blocks": self.index.max_blocks,
                    "position_keys": len(self.positions), "evictions": self.index.evictions,
                    "block_sizes": {m: sorted(s) for m, s in self.block_sizes.items()},
                    "instances": [inst.describe() for inst in self.registry]}

    @staticmethod
    def now() -> float:
        return time.monotonic()
