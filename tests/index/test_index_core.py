"""Block index, scoring and sequence tracking, on real objects (no service, no sockets)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from index_helpers import MODEL, make_config
from kvshrink.index import vllm_ingest
from kvshrink.index.block_index import TIER_INDEX, BlockIndex
from kvshrink.index.config import ScoringConfig
from kvshrink.index.events import DecodedBatch, decode_batch
from kvshrink.index.hashing import prefix_hashes
from kvshrink.index.scoring import lookup, merge_runs, rank
from kvshrink.index.sequence import SequenceTracker, Verdict
from kvshrink.index.state import IndexState
from index_helpers import vllm_cleared, vllm_payload, vllm_removed, vllm_stored

GPU, DRAM, SSD, REMOTE = (TIER_INDEX[t] for t in ("gpu", "dram", "ssd", "remote"))
PROMPT = list(range(1000, 1000 + 256))


def _state(**overrides) -> IndexState:
    cfg = make_config(zmq=False, instances=[{"id": f"i{k}", "models": [MODEL]} for k in range(4)], **overrides)
    return IndexState(cfg)


def _store(state: IndexState, inst_id: str, tokens, block_size=16, tier=GPU, feed="f"):
    inst = state.registry.get(inst_id)
    hashes = prefix_hashes(tokens, MODEL, block_size)
    state.index.store(state.feed(inst, feed), hashes, hashes, tier)
    state.note_block_size(MODEL, block_size)
    return hashes


def _by_id(result):
    return {s.instance_id: s for s in result.instances}


def test_lookup_longest_consecutive_prefix_per_tier():
    state = _state()
    _store(state, "i0", PROMPT[:64])
    _store(state, "i1", PROMPT[:160], tier=DRAM)
    hashes = _store(state, "i2", PROMPT)
    state.index.remove(state.feed(state.registry.get("i2"), "f"), [hashes[3]], GPU)  # a hole at block 3
    res = _by_id(lookup(state, MODEL, PROMPT))
    assert res["i0"].matched_tokens == 64 and res["i0"].tier_tokens == [64, 0, 0, 0]
    assert res["i1"].matched_tokens == 160 and res["i1"].tier_tokens == [0, 160, 0, 0]
    assert res["i2"].matched_tokens == 48  # consecutive prefix stops at the hole
    assert res["i3"].matched_tokens == 0
    assert lookup(state, MODEL, PROMPT).instances[0].instance_id == "i1"


def test_fastest_tier_counts_and_tier_weights_rank():
    state = _state()
    _store(state, "i0", PROMPT, tier=SSD)
    _store(state, "i0", PROMPT[:128], tier=GPU)
    _store(state, "i1", PROMPT, tier=DRAM)
    res = lookup(state, MODEL, PROMPT)
    by = _by_id(res)
    assert by["i0"].tier_tokens == [128, 0, 128, 0] and by["i0"].matched_tokens == 256
    assert by["i0"].weighted_tokens == pytest.approx(128 * 1.0 + 128 * 0.5)
    assert by["i1"].weighted_tokens == pytest.approx(256 * 0.8)
    assert res.instances[0].instance_id == "i1"  # same length, faster media on average


def test_load_spreads_a_popular_prefix():
    state = _state()
    for k in range(4):
        _store(state, f"i{k}", PROMPT[:128])
    _store(state, "i0", PROMPT)  # i0 has the longest prefix ...
    best = lookup(state, MODEL, PROMPT).instances[0].instance_id
    assert best == "i0"
    loaded = lookup(state, MODEL, PROMPT, loads={"i0": 12, "i1": 2, "i2": 2, "i3": 3})
    by = _by_id(loaded)
    assert by["i0"].overloaded and not by["i1"].overloaded
    assert loaded.instances[0].instance_id in ("i1", "i2")  # ... but is overloaded: the next best wins
    assert loaded.instances[-1].instance_id == "i0"


def _rank(prompt_tokens: int, tier_tokens: dict[str, list[int]], loads: dict[str, float], cfg: ScoringConfig,
          seed: int = 0):
    """``rank`` of candidates given by name: tokens per tier and load each."""
    ids = list(tier_tokens)
    return rank(prompt_tokens, ids, [None] * len(ids), np.array([tier_tokens[i] for i in ids], dtype=np.int64),
                np.array([loads[i] for i in ids], dtype=np.float64), cfg, seed)


def test_score_formula_and_ties():
    cfg = ScoringConfig(hit_length_weight=1.0, media_speed_weight=0.0, load_weight=1.0, overload_factor=100)
    ranked = _rank(1000, {"a": [500, 0, 0, 0], "b": [0, 500, 0, 0]}, {"a": 4, "b": 0}, cfg)
    # hit 0.5 each; mean load 2: a's relative load +1, b's -1
    assert [c.instance_id for c in ranked] == ["b", "a"]
    assert ranked[0].score == pytest.approx(0.5 + 1.0) and ranked[1].score == pytest.approx(0.5 - 1.0)
    cold, idle = {n: [0, 0, 0, 0] for n in "abcd"}, {n: 1 for n in "abcd"}
    first = [_rank(100, cold, idle, cfg, s)[0].instance_id for s in (1, 2, 3, 4, 5, 6, 7, 8)]
    assert len(set(first)) > 1  # cold ties spread by prompt, deterministically per prompt
    assert _rank(100, cold, idle, cfg, 7)[0].instance_id == _rank(100, cold, idle, cfg, 7)[0].instance_id


def test_merge_runs_across_block_sizes():
    assert merge_runs([[(0, 512, GPU)], [(0, 256, DRAM), (256, 1024, SSD)]]) == [(0, 512, GPU), (512, 1024, SSD)]
    assert merge_runs([[(0, 128, SSD)], [(0, 256, DRAM)]]) == [(0, 256, DRAM)]


def test_gpu_blocks_and_lmcache_chunks_combine():
    state = _state()
    _store(state, "i0", PROMPT[:128], block_size=16, tier=GPU)
    _store(state, "i0", PROMPT[:256], block_size=256, tier=DRAM)
    by = _by_id(lookup(state, MODEL, PROMPT))
    assert by["i0"].matched_tokens == 256 and by["i0"].tier_tokens == [128, 128, 0, 0]


def _reference_tokens(state: IndexState, inst_id: str, tokens, sizes) -> tuple[int, list[int]]:
    """Matched tokens and tokens per tier the slow, obvious way: block by block, token by token."""
    bit = state.registry.get(inst_id).bit
    offered: dict[int, list[int]] = {}  # token position -> fastest tier per block size covering it
    for bs in sizes:
        for i, block_hash in enumerate(prefix_hashes(tokens, MODEL, bs)):
            masks = state.index.masks_of(block_hash)
            tier = next((t for t, m in enumerate(masks or ()) if m >> bit & 1), None)
            if tier is None:
                break  # its consecutive prefix at this block size ends here
            for pos in range(i * bs, (i + 1) * bs):
                offered.setdefault(pos, []).append(tier)
    per_tier, pos = [0, 0, 0, 0], 0
    while pos in offered:
        per_tier[min(offered[pos])] += 1
        pos += 1
    return pos, per_tier


@pytest.mark.parametrize("seed", range(12))
def test_lookup_matches_a_block_by_block_reference(seed):
    rnd = random.Random(seed)
    state = _state()
    tokens = [rnd.randrange(49152) for _ in range(rnd.randrange(64, 700))]
    sizes = rnd.sample([16, 32, 64], rnd.randint(1, 2))
    for _ in range(rnd.randrange(4, 16)):  # prefixes and holes on random instances and tiers
        inst = state.registry.get(f"i{rnd.randrange(4)}")
        bs = rnd.choice(sizes)
        hashes = prefix_hashes(tokens, MODEL, bs)
        end = rnd.randint(1, len(hashes))
        start = 0 if rnd.random() < 0.7 else rnd.randrange(end)
        feed = state.feed(inst, f"f{bs}")
        if rnd.random() < 0.8:
            state.index.store(feed, hashes[start:end], hashes[start:end], rnd.randrange(4))
        else:
            state.index.remove(feed, hashes[start:end], rnd.choice([None, rnd.randrange(4)]))
        state.note_block_size(MODEL, bs)
    for inst in lookup(state, MODEL, tokens).instances:
        assert (inst.matched_tokens, inst.tier_tokens) == _reference_tokens(state, inst.instance_id, tokens, sizes)


def test_lru_cap_bounds_memory():
    index = BlockIndex(max_blocks=100, width=8)
    feed = index.open_feed(0, "f")
    index.store(feed, range(150), range(150), GPU)
    assert len(index) == 100 and index.evictions == 50
    assert index.masks_of(0) is None and index.masks_of(149) is not None
    assert len(feed.key_map) == 100
    index.touch(feed, [50])  # refreshed: survives the next eviction round
    index.store(feed, range(150, 160), range(150, 160), GPU)
    assert index.masks_of(50) is not None and index.masks_of(51) is None


def test_clear_feed_only_clears_that_feeds_tiers_and_instance():
    index = BlockIndex(max_blocks=1000, width=8)
    gpu_feed, lm_feed, other = index.open_feed(0, "vllm"), index.open_feed(0, "lmcache"), index.open_feed(1, "vllm")
    index.store(gpu_feed, [1, 2], [10, 20], GPU)
    index.store(lm_feed, ["a", "b"], [10, 20], DRAM)
    index.store(other, [1], [10], GPU)
    index.clear_feed(gpu_feed)
    assert index.masks_of(10) == (0b10, 0b01, 0, 0) and index.masks_of(20) == (0, 0b01, 0, 0)
    removed, unknown = index.remove(lm_feed, ["a", "zzz"], None)
    assert (removed, unknown) == (1, 1) and index.masks_of(10) == (0b10, 0, 0, 0)


def test_vllm_events_parent_chain_conflicts_and_skips():
    state = _state()
    inst = state.registry.get("i0")
    apply = lambda evs: vllm_ingest.apply_batch(state, inst, MODEL, decode_batch(vllm_payload(evs)))  # noqa: E731
    counts = apply([vllm_stored([1, 2], PROMPT[:32], 16), vllm_stored([3], PROMPT[32:48], 16, parent=2)])
    assert counts.stored_blocks == 3 and not counts.dropped
    assert _by_id(lookup(state, MODEL, PROMPT))["i0"].matched_tokens == 48
    counts = apply([vllm_stored([9], PROMPT[48:64], 16, parent=12345),  # parent never seen
                    vllm_stored([4], PROMPT[:15], 16),  # token count does not match
                    vllm_stored([5], PROMPT[:16], 16, medium="NVME"),  # medium we cannot place
                    vllm_stored([6], PROMPT[:16], 16, extra_keys=[("salt",)])])
    assert counts.dropped == {"unknown_parent": 1, "token_count_mismatch": 1, "unknown_medium": 1, "extra_keys": 1}
    apply([vllm_removed([3])])
    assert _by_id(lookup(state, MODEL, PROMPT))["i0"].matched_tokens == 32
    counts = apply([vllm_stored([1], PROMPT[100:116], 16)])  # engine hash 1 re-stored with other tokens
    assert counts.dropped == {"hash_conflict": 1}
    assert _by_id(lookup(state, MODEL, PROMPT))["i0"].matched_tokens == 0  # what hash 1 meant is not trusted
    apply([vllm_cleared()])
    assert _by_id(lookup(state, MODEL, PROMPT))["i0"].matched_tokens == 0
    assert len(state.index) == 0


def test_sequence_tracker_verdicts():
    t = SequenceTracker(first_seq=0)
    assert t.observe("s", 5).verdict is Verdict.FIRST and t.observe("s", 5).missing_from == 0
    t.applied("s", 5)
    assert t.observe("s", 6).verdict is Verdict.APPLY
    obs = t.observe("s", 9)
    assert obs.verdict is Verdict.GAP and obs.missing_from == 6
    t.replayed("s", 6, 8)
    t.applied("s", 9)
    assert t.observe("s", 7).verdict is Verdict.DUPLICATE  # inside the replayed window
    assert t.observe("s", 0).verdict is Verdict.RESTART
    assert t.observe("s", 10).verdict is Verdict.APPLY


def test_numbering_from_the_start_again_is_a_restart_even_inside_a_replayed_window():
    """An engine whose first live batch was lost had 0.. replayed; once restarted it publishes 0 again."""
    t = SequenceTracker(first_seq=0)
    assert t.observe("s", 3).verdict is Verdict.FIRST
    t.replayed("s", 0, 2)
    t.applied("s", 3)
    assert t.observe("s", 1).verdict is Verdict.DUPLICATE
    assert t.observe("s", 0).verdict is Verdict.RESTART


def test_unused_batch_type_is_harmless():
    state = _state()
    counts = vllm_ingest.apply_batch(state, state.registry.get("i0"), MODEL, DecodedBatch(ts=0.0, events=[]))
    assert counts.stored_blocks == 0 and not counts.dropped
