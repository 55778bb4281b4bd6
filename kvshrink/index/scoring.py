"""Lookup: per instance, the cached prefix of a prompt by tier, and a score that weighs it against load.

For every block size the model's instances use (vLLM blocks, LMCache chunks) the prompt's chained
block hashes are looked up in the index; an instance's matched prefix is the longest run of
consecutive blocks it holds from the start, each block counted on the fastest tier holding it.
When several block sizes cover the same instance the per-token best tier wins.

Cost (a 32K-token prompt, 64 instances): hashing 2048 blocks is a dozen numpy operations over the
tokens (``hashing.chain_hashes``, no per-block Python loop); lookups and run detection run in C
(``BlockIndex.prefix_runs``), and everything per instance — holders, tiers, scores, ranking — is a
handful of numpy operations over a ``[runs, instances]`` matrix, not Python loops over instances ×
blocks.

Score of instance ``i`` for a prompt of ``N`` tokens (weights from ``scoring`` in the YAML)::

    hit_i   = matched_tokens_i / N                                  (0..1)
    speed_i = sum_t tier_weight[t] * tokens_i[t] / N                 (0..1; GPU 1.0, DRAM 0.8, ...)
    rel_i   = (load_i - mean_load) / max(1, mean_load)               (production-stack's loadaware form)
    score_i = hit_length_weight * hit_i + media_speed_weight * speed_i - load_weight * rel_i

``load`` is queue length + running requests (given by the caller or scraped). An instance with
``load_i > overload_factor * mean_load + 1`` is *overloaded* and ranks after every other one, so a
popular prefix spreads instead of piling up on its first holder (production-stack's kvaware
failure mode). Ties go to the lower load, then to a hash of (prompt start, instance) so identical
cold prompts land together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Sequence

import msgspec
import numpy as np
import xxhash

from kvshrink.index.block_index import TIERS, BlockIndex
from kvshrink.index.config import ScoringConfig
from kvshrink.index.hashing import chain_hashes, fmix64, root_hash, token_bytes
from kvshrink.index.state import IndexState

Run = tuple[int, int, int]  # (start token, end token, tier index)


class InstanceScore(msgspec.Struct):
    """One instance's answer to a lookup; a msgspec struct, so the service encodes a whole result
    in one call instead of building a dict per instance."""

    instance_id: str
    url: str | None
    matched_tokens: int
    tiers: dict[str, int]  # tokens of the matched prefix on each tier, fastest tier per token
    weighted_tokens: float
    load: float
    score: float = 0.0
    overloaded: bool = False

    @property
    def tier_tokens(self) -> list[int]:
        return [self.tiers[t] for t in TIERS]


class LookupResult(msgspec.Struct):
    model: str
    prompt_tokens: int
    block_sizes: list[int]
    elapsed_ms: float = 0.0
    instances: list[InstanceScore] = msgspec.field(default_factory=list)


@dataclass
class Coverage:
    """What one block size says about a prompt, per candidate instance ``k``: the fastest tier holding
    each run of blocks along its consecutive cached prefix (``tier[r, k]``, -1 once that prefix ended)."""

    lengths: np.ndarray  # [runs] tokens in each run
    tier: np.ndarray  # [runs, candidates]

    def tier_tokens(self) -> np.ndarray:
        """``[candidates, 4]``: tokens of each one's prefix on each tier (their sum: its matched length)."""
        candidates = self.tier.shape[1]
        slot = (self.tier + 1) + 5 * np.arange(candidates)  # 5 slots per candidate: none, gpu, dram, ssd, remote
        counts = np.bincount(slot.ravel(), weights=np.repeat(self.lengths, candidates), minlength=5 * candidates)
        return counts.reshape(candidates, 5)[:, 1:].astype(np.int64)

    def runs(self, k: int) -> list[Run]:
        """Candidate ``k``'s prefix as (start, end, tier) runs: what ``merge_runs`` combines."""
        runs: list[Run] = []
        start = 0
        for end, tier in zip(np.cumsum(self.lengths).tolist(), self.tier[:, k].tolist()):
            if tier < 0:
                break
            if runs and runs[-1][2] == tier:
                runs[-1] = (runs[-1][0], end, tier)
            else:
                runs.append((start, end, tier))
            start = end
        return runs


def cover(index: BlockIndex, block_hashes: Sequence[int], bits: Sequence[int], block_size: int) -> Coverage | None:
    """The :class:`Coverage` of a prompt's ``block_hashes`` for the instances with these ``bits``;
    ``None`` if nobody holds its first block. Caller holds the state lock."""
    packed, blocks = index.prefix_runs(block_hashes)
    if not packed:
        return None
    fastest = index.fastest_tiers(packed, bits)  # [runs, candidates]
    alive = np.logical_and.accumulate(fastest >= 0, axis=0)  # still on its consecutive prefix
    return Coverage(np.multiply(blocks, block_size), np.where(alive, fastest, -1))


def merge_runs(run_lists: Sequence[Sequence[Run]]) -> list[Run]:
    """Union of several consecutive-from-0 coverages; each token keeps the fastest tier offered."""
    if len(run_lists) == 1:
        return list(run_lists[0])
    cuts = sorted({p for runs in run_lists for start, end, _ in runs for p in (start, end)})
    merged: list[Run] = []
    for a, b in zip(cuts, cuts[1:]):
        best = min((tier for runs in run_lists for start, end, tier in runs if start <= a and b <= end), default=None)
        if best is None:
            break
        if merged and merged[-1][1] == a and merged[-1][2] == best:
            merged[-1] = (merged[-1][0], b, best)
        else:
            merged.append((a, b, best))
    return merged


def tokens_per_tier(runs: Sequence[Run]) -> list[int]:
    counts = [0, 0, 0, 0]
    for start, end, tier in runs:
        counts[tier] += end - start
    return counts


def combine(coverages: Sequence[Coverage], n_candidates: int) -> np.ndarray:
    """``[candidates, 4]``: per candidate, its matched tokens on each tier over every block size.

    An instance covered by one block size (the usual case) takes its numbers as they are; one
    covered by several gets the per-token fastest tier any of them offers (``merge_runs``).
    """
    if not coverages:
        return np.zeros((n_candidates, 4), dtype=np.int64)
    if len(coverages) == 1:
        return coverages[0].tier_tokens()
    tiers = np.stack([c.tier_tokens() for c in coverages])  # [sizes, candidates, 4]
    # one block size covers most candidates: summing over sizes picks that one (or zeros)
    covering = tiers.sum(axis=2) > 0
    tier_tokens = tiers.sum(axis=0)
    for k in np.flatnonzero(covering.sum(axis=0) > 1).tolist():
        runs = merge_runs([c.runs(k) for c, covers in zip(coverages, covering[:, k]) if covers])
        tier_tokens[k] = tokens_per_tier(runs)
    return tier_tokens


def rank(prompt_tokens: int, instance_ids: Sequence[str], urls: Sequence[str | None], tier_tokens: np.ndarray,
         load: np.ndarray, cfg: ScoringConfig, tiebreak_seed: int = 0) -> list[InstanceScore]:
    """Score every candidate (``tier_tokens`` ``[candidates, 4]``, ``load`` ``[candidates]``) as in the
    module doc, all at once over arrays, and return them best first."""
    if not len(instance_ids):
        return []
    n = max(1, prompt_tokens)
    matched = tier_tokens.sum(axis=1)
    weighted = tier_tokens @ np.array([cfg.tier_weights[t] for t in TIERS], dtype=np.float64)
    mean_load = float(load.mean())
    score = (cfg.hit_length_weight * matched / n + cfg.media_speed_weight * weighted / n
             - cfg.load_weight * (load - mean_load) / max(1.0, mean_load))
    overloaded = load > cfg.overload_factor * mean_load + 1.0
    tiebreak = fmix64(np.array([_id_hash(i) for i in instance_ids], dtype=np.uint64)
                       ^ np.array(tiebreak_seed, dtype=np.uint64))
    # lexsort's last key is its primary one: not overloaded first, then best score, lower load, tie-break hash
    order = np.lexsort((tiebreak, load, -score, overloaded))
    best_first = order.tolist()
    columns = zip([instance_ids[i] for i in best_first], [urls[i] for i in best_first], matched[order].tolist(),
                  tier_tokens[order].tolist(), np.round(weighted[order], 3).tolist(), load[order].tolist(),
                  np.round(score[order], 6).tolist(), overloaded[order].tolist())
    return [InstanceScore(i, u, m, dict(zip(TIERS, t)), w, ld, sc, o) for i, u, m, t, w, ld, sc, o in columns]


@lru_cache(maxsize=4096)
def _id_hash(instance_id: str) -> int:
    return xxhash.xxh3_64_intdigest(instance_id.encode())


def lookup(state: IndexState, model: str, token_ids: Sequence[int] | bytes, loads: Mapping[str, float] | None = None,
           only: list[str] | None = None) -> LookupResult:
    """Rank the instances serving ``model`` for this prompt (token ids, or their little-endian uint32 bytes)."""
    started = time.perf_counter()
    data = bytes(token_ids) if isinstance(token_ids, (bytes, bytearray, memoryview)) else token_bytes(token_ids)
    n_tokens = len(data) // 4
    with state.lock:
        sizes = state.lookup_block_sizes(model)
        candidates = state.registry.candidates(model, only)
        bits = [inst.bit for inst in candidates]
        coverages: list[Coverage] = []
        seed = 0
        hashed_sizes = set(sizes) | ({state.chunk_size} if state.tier_events_seen else set())
        for bs in sorted(hashed_sizes):
            root = root_hash(model, bs)
            hashes = chain_hashes(data, bs, root)
            if hashes and not seed:
                seed = hashes[0]
            if bs == state.chunk_size:  # lets LMCache chunks of this prompt find their prefix later
                state.learn_positions(data, bs, root, hashes)
            if bs in sizes and bits and hashes:
                coverage = cover(state.index, hashes, bits, bs)
                if coverage is not None:
                    coverages.append(coverage)
        tier_tokens = combine(coverages, len(candidates))
        ids, urls = [inst.instance_id for inst in candidates], [inst.url for inst in candidates]
        load = np.array([_load_for(inst, loads) for inst in candidates], dtype=np.float64)
    ranked = rank(n_tokens, ids, urls, tier_tokens, load, state.config.scoring, seed)
    elapsed_s = time.perf_counter() - started
    m = state.metrics
    m.lookups.inc()
    m.lookup_seconds.observe(elapsed_s)
    m.hit_tokens.observe(int(tier_tokens.sum(axis=1).max(initial=0)))
    return LookupResult(model, n_tokens, sizes, round(elapsed_s * 1e3, 3), ranked)


def _load_for(inst, loads: Mapping[str, float] | None) -> float:
    if loads:
        for key in (inst.instance_id, inst.url, *inst.aliases):
            if key is not None and key in loads:
                return float(loads[key])
    return inst.load
