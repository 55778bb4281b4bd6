"""Routing policies compared by ``routing_sim``: production-stack's rules re-stated, and ours.

Each policy sees the request, the live in-flight count of every instance (what a router tracks),
and whatever its real counterpart would know about caches:

* ``roundrobin`` — production-stack ``RoundRobinRouter``.
* ``session`` — ``SessionRouter``: consistent hashing of the session id (rendezvous hashing here;
  uhashring's ring balances the same way on average).
* ``prefixaware`` — ``PrefixAwareRouter``: a trie of the prompts *it routed* (128-character chunks
  there, 32-token chunks here), never evicted; longest match wins, random among ties.
* ``kvaware`` — ``KvawareRouter`` over the LMCache controller: walks 256-token chunks, each chunk
  answered by its first registered holder; takes the *first* instance of the answer and routes there
  only if the unmatched rest is at most ``kv_aware_threshold`` (2000) tokens, else session hashing.
  Sees LMCache's tiers (DRAM, SSD), not the engine's GPU cache, and no load.
* ``ours`` — ``kvshrink.index.scoring.lookup`` on a real :class:`IndexState` fed with every tier
  change of the simulated caches, with the live in-flight counts as loads.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import xxhash

from kvshrink.index.block_index import TIER_INDEX
from kvshrink.index.config import config_from_dict
from kvshrink.index.hashing import prefix_hashes
from kvshrink.index.scoring import lookup
from kvshrink.index.state import IndexState

MODEL = "sim-model"


def rendezvous(key: str, n: int) -> int:
    return max(range(n), key=lambda i: xxhash.xxh3_64_intdigest(f"{key}|{i}".encode()))


class Policy:
    name = "policy"

    def __init__(self, n_instances: int, seed: int) -> None:
        self.n = n_instances
        self.rng = random.Random(seed)

    def choose(self, req, loads: list[int]) -> int:
        raise NotImplementedError

    def on_tier_change(self, instance: int, tier: str, stored: list[int], removed: list[int]) -> None:
        """A simulated cache stored / evicted these block hashes (block-size units of the sim)."""


class RoundRobin(Policy):
    name = "roundrobin"

    def __init__(self, n_instances: int, seed: int) -> None:
        super().__init__(n_instances, seed)
        self.next = 0

    def choose(self, req, loads):
        self.next += 1
        return (self.next - 1) % self.n


class SessionAffinity(Policy):
    name = "session"

    def choose(self, req, loads):
        return rendezvous(str(req.session_id), self.n)


class PrefixAware(Policy):
    name = "prefixaware"
    chunk = 32

    def __init__(self, n_instances: int, seed: int) -> None:
        super().__init__(n_instances, seed)
        self.seen: dict[int, set[int]] = {}  # chunk-prefix hash -> instances it was routed to

    def choose(self, req, loads):
        hashes = prefix_hashes(req.token_ids.tolist(), "trie", self.chunk)
        best: set[int] = set(range(self.n))
        for h in hashes:
            holders = self.seen.get(h)
            if not holders:
                break
            best = holders
        choice = self.rng.choice(sorted(best))
        for h in hashes:
            self.seen.setdefault(h, set()).add(choice)
        return choice


class KvAware(Policy):
    name = "kvaware"
    chunk = 256
    threshold = 2000

    def __init__(self, n_instances: int, seed: int, sim_block: int) -> None:
        super().__init__(n_instances, seed)
        if self.chunk % sim_block:
            raise ValueError("the simulator block size must divide LMCache's 256-token chunk")
        self.per_chunk = self.chunk // sim_block
        self.holders: dict[int, OrderedDict[int, None]] = {}  # block hash -> instances, admit order
        self.lmcache_tiers = {"dram", "ssd"}
        self.copies: dict[tuple[int, int], int] = {}  # (block, instance) -> tiers holding it

    def on_tier_change(self, instance, tier, stored, removed):
        if tier not in self.lmcache_tiers:
            return
        for h in stored:
            key = (h, instance)
            self.copies[key] = self.copies.get(key, 0) + 1
            self.holders.setdefault(h, OrderedDict())[instance] = None
        for h in removed:
            key = (h, instance)
            left = self.copies.get(key, 0) - 1
            if left > 0:
                self.copies[key] = left
                continue
            self.copies.pop(key, None)
            owners = self.holders.get(h)
            if owners is not None:
                owners.pop(instance, None)
                if not owners:
                    del self.holders[h]

    def choose(self, req, loads):
        block_hashes = req.block_hashes  # the sim's blocks; a chunk is per_chunk of them
        layout: dict[int, int] = {}
        for c in range(len(block_hashes) // self.per_chunk):
            owners = self.holders.get(block_hashes[(c + 1) * self.per_chunk - 1])
            if not owners:
                break
            layout[next(iter(owners))] = (c + 1) * self.chunk
        if layout:
            first = next(iter(layout))
            if layout[first] >= max(req.prompt_tokens - self.threshold, 0):
                return first
        return rendezvous(str(req.session_id), self.n)


class Ours(Policy):
    name = "ours"

    def __init__(self, n_instances: int, seed: int, sim_block: int, scoring: dict | None = None) -> None:
        super().__init__(n_instances, seed)
        cfg = config_from_dict({"max_blocks": 10_000_000, "lookup_block_sizes": [sim_block], "zmq": {"bind": []},
                                "scoring": scoring or {},
                                "instances": [{"id": f"i{k}", "models": [MODEL]} for k in range(n_instances)]})
        self.state = IndexState(cfg)
        self.insts = [self.state.registry.get(f"i{k}") for k in range(n_instances)]
        self.feeds = [self.state.feed(inst, "sim") for inst in self.insts]
        self.ids = {f"i{k}": k for k in range(n_instances)}
        self.lookup_ms: list[float] = []

    def on_tier_change(self, instance, tier, stored, removed):
        feed, t = self.feeds[instance], TIER_INDEX[tier]
        if stored:
            self.state.index.store(feed, stored, stored, t)
        if removed:
            self.state.index.remove(feed, removed, t)

    def choose(self, req, loads):
        result = lookup(self.state, MODEL, req.token_ids.tolist(), {f"i{k}": v for k, v in enumerate(loads)})
        self.lookup_ms.append(result.elapsed_ms)
        return self.ids[result.instances[0].instance_id]


def make_policies(names: list[str], n_instances: int, seed: int, sim_block: int, scoring: dict | None):
    table = {"roundrobin": lambda: RoundRobin(n_instances, seed), "session": lambda: SessionAffinity(n_instances, seed),
             "prefixaware": lambda: PrefixAware(n_instances, seed),
             "kvaware": lambda: KvAware(n_instances, seed, sim_block),
             "ours": lambda: Ours(n_instances, seed, sim_block, scoring)}
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r} (known: {', '.join(table)})")
    return [table[n]() for n in names]

