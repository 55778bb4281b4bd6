"""Lookup: per instance, the cached prefix of a prompt by tier, and a score that weighs it against load.

For every block size the model's instances use (vLLM blocks, LMCache chunks) the prompt's chained
block hashes are walked through the index; an instance's matched prefix is the longest run of
consecutive blocks it holds from the start, each block counted on the fastest tier holding it.
When several block sizes cover the same instance the per-token best tier wins.

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
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import xxhash

from kvshrink.index.block_index import TIERS, Segment
from kvshrink.index.config import ScoringConfig
from kvshrink.index.hashing import chain_hashes, root_hash, token_bytes
from kvshrink.index.state import IndexState

Run = tuple[int, int, int]  # (start token, end token, tier index)


@dataclass
class InstanceScore:
    instance_id: str
    url: str | None
    matched_tokens: int
    tier_tokens: list[int]
    weighted_tokens: float
    load: float
    score: float = 0.0
    overloaded: bool = False

    def as_dict(self) -> dict:
        return {"instance_id": self.instance_id, "url": self.url, "matched_tokens": self.matched_tokens,
                "tiers": dict(zip(TIERS, self.tier_tokens)), "weighted_tokens": round(self.weighted_tokens, 3),
                "load": self.load, "score": round(self.score, 6), "overloaded": self.overloaded}


@dataclass
class LookupResult:
    model: str
    prompt_tokens: int
    block_sizes: list[int]
    instances: list[InstanceScore] = field(default_factory=list)
    elapsed_s: float = 0.0

    def as_dict(self) -> dict:
        return {"model": self.model, "prompt_tokens": self.prompt_tokens, "block_sizes": self.block_sizes,
                "elapsed_ms": round(self.elapsed_s * 1e3, 3), "instances": [s.as_dict() for s in self.instances]}


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


def segment_counts(segments: Sequence[Segment], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per instance bit: matched blocks ``[width]`` and blocks per tier ``[4, width]``."""
    ends = np.fromiter((end for end, _ in segments), dtype=np.int64, count=len(segments))
    lengths = np.diff(ends, prepend=0)
    nbytes = (width + 7) // 8
    raw = b"".join(m.to_bytes(nbytes, "little") for _, masks in segments for m in masks)
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8).reshape(len(segments), 4, nbytes), axis=2,
                         bitorder="little")[:, :, :width]
    tiers = np.einsum("s,stw->tw", lengths, bits)
    matched = (ends[:, None] * bits.any(axis=1)).max(axis=0)
    return matched, tiers


def runs_of(segments: Sequence[Segment], bit: int, block_size: int) -> list[Run]:
    """One instance's coverage from the walk's segments, in tokens."""
    runs: list[Run] = []
    start = 0
    for end, masks in segments:
        tier = next((t for t, m in enumerate(masks) if m >> bit & 1), None)
        if tier is None:
            break
        if runs and runs[-1][2] == tier:
            runs[-1] = (runs[-1][0], end * block_size, tier)
        else:
            runs.append((start * block_size, end * block_size, tier))
        start = end
    return runs


def tokens_per_tier(runs: Sequence[Run]) -> list[int]:
    counts = [0, 0, 0, 0]
    for start, end, tier in runs:
        counts[tier] += end - start
    return counts


def score_instances(prompt_tokens: int, candidates: list[InstanceScore], cfg: ScoringConfig,
                    tiebreak_seed: int = 0) -> list[InstanceScore]:
    """Fill ``score`` / ``overloaded`` and return the candidates best first (see module doc)."""
    if not candidates:
        return []
    n = max(1, prompt_tokens)
    mean_load = sum(c.load for c in candidates) / len(candidates)
    weights = [cfg.tier_weights[t] for t in TIERS]
    for c in candidates:
        c.weighted_tokens = sum(w * k for w, k in zip(weights, c.tier_tokens))
        rel_load = (c.load - mean_load) / max(1.0, mean_load)
        c.score = (cfg.hit_length_weight * c.matched_tokens / n + cfg.media_speed_weight * c.weighted_tokens / n
                   - cfg.load_weight * rel_load)
        c.overloaded = c.load > cfg.overload_factor * mean_load + 1.0
    return sorted(candidates, key=lambda c: (c.overloaded, -c.score, c.load,
                                             xxhash.xxh3_64_intdigest(c.instance_id.encode(), tiebreak_seed)))


def lookup(state: IndexState, model: str, token_ids: Sequence[int] | bytes, loads: Mapping[str, float] | None = None,
           only: list[str] | None = None) -> LookupResult:
    """Rank the instances serving ``model`` for this prompt (token ids, or their little-endian uint32 bytes)."""
    started = time.perf_counter()
    data = bytes(token_ids) if isinstance(token_ids, (bytes, bytearray, memoryview)) else token_bytes(token_ids)
    n_tokens = len(data) // 4
    with state.lock:
        sizes = state.lookup_block_sizes(model)
        candidates = state.registry.candidates(model, only)
        mask = 0
        for inst in candidates:
            mask |= inst.mask
        width = max((inst.bit for inst in candidates), default=-1) + 1
        spaces: list[tuple[int, list[Segment], list[int], list[list[int]]]] = []
        seed = 0
        hashed_sizes = set(sizes) | ({state.chunk_size} if state.tier_events_seen else set())
        for bs in sorted(hashed_sizes):
            root = root_hash(model, bs)
            hashes = chain_hashes(data, bs, root)
            if hashes and not seed:
                seed = hashes[0]
            if bs == state.chunk_size:  # lets LMCache chunks of this prompt find their prefix later
                state.learn_positions(data, bs, root, hashes)
            if bs not in sizes or not mask or not hashes:
                continue
            segments = state.index.walk(hashes, mask)
            if segments:
                matched, tiers = segment_counts(segments, width)
                spaces.append((bs, segments, (matched * bs).tolist(), (tiers * bs).T.tolist()))
        scored = []
        for inst in candidates:
            b = inst.bit
            covering = [sp for sp in spaces if sp[2][b] > 0]
            if not covering:
                matched_tokens, tier_tokens = 0, [0, 0, 0, 0]
            elif len(covering) == 1:
                matched_tokens, tier_tokens = covering[0][2][b], covering[0][3][b]
            else:  # several block sizes cover it: per token, the fastest tier any of them offers
                runs = merge_runs([runs_of(segments, b, bs) for bs, segments, _, _ in covering])
                matched_tokens, tier_tokens = runs[-1][1], tokens_per_tier(runs)
            scored.append(InstanceScore(inst.instance_id, inst.url, matched_tokens, tier_tokens, 0.0,
                                        _load_for(inst, loads)))
    result = LookupResult(model, n_tokens, sizes, score_instances(n_tokens, scored, state.config.scoring, seed))
    result.elapsed_s = time.perf_counter() - started
    m = state.metrics
    m.lookups.inc()
    m.lookup_seconds.observe(result.elapsed_s)
    m.hit_tokens.observe(max((s.matched_tokens for s in result.instances), default=0))
    return result


def _load_for(inst, loads: Mapping[str, float] | None) -> float:
    if loads:
        for key in (inst.instance_id, inst.url, *inst.aliases):
            if key is not None and key in loads:
                return float(loads[key])
    return inst.load

