"""The paired end-to-end harness's method, without vLLM: who goes first, the intervals and verdicts,
the budgets and every stack's arrangement of them (the shipped default store for ours)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from kvshrink.benchmarks import e2e_paired as ep
from kvshrink.benchmarks import paired_stats as ps
from kvshrink.benchmarks.agent_trace import TraceConfig, generate
from kvshrink.benchmarks.comparison import IncomparableError
from kvshrink.store.config import parse_store_config
from kvshrink.testing.derived_stores import load_store_mapping, unplaced


def test_the_order_rotates_so_every_stack_goes_first_equally_often() -> None:
    stacks = ["a", "b", "c"]
    firsts = [ep.rotated(stacks, step)[0] for step in range(9)]
    assert firsts == ["a", "b", "c"] * 3
    assert all(sorted(ep.rotated(stacks, step)) == stacks for step in range(9))


def test_ratio_of_sums_interval_covers_the_truth_and_narrows_with_pairs() -> None:
    rng = np.random.default_rng(3)
    stock = rng.uniform(1, 10, 400)
    ours = stock * 0.7 * rng.lognormal(0, 0.3, 400)  # ~0.7x with +-30 % noise per request
    wide, narrow = ps.ratio_of_sums(ours[:20], stock[:20]), ps.ratio_of_sums(ours, stock)
    assert narrow["low"] < 0.75 and narrow["high"] > 0.68 and narrow["pairs"] == 400
    assert narrow["high"] - narrow["low"] < wide["high"] - wide["low"]
    assert narrow["value"] == pytest.approx(ours.sum() / stock.sum())


def test_verdict_only_where_the_interval_clears_the_threshold() -> None:
    assert ps.verdict({"low": 0.6, "high": 0.8}, 0.85) == "met"
    assert ps.verdict({"low": 0.8, "high": 0.9}, 0.85) == "inconclusive"
    assert ps.verdict({"low": 0.9, "high": 1.1}, 0.85) == "not met"
    assert ps.verdict({"low": 0.12, "high": 0.2}, 0.10, higher_is_better=True) == "met"
    assert ps.verdict({"low": 0.05, "high": 0.2}, 0.10, higher_is_better=True) == "inconclusive"
    assert ps.verdict({"low": 0.01, "high": 0.05}, 0.10, higher_is_better=True) == "not met"


def test_hit_rate_difference_is_in_points_of_prompt_tokens() -> None:
    prompt = [1000, 1000, 1000, 1000]
    d = ps.difference_of_rates([800, 600, 900, 700], [500, 500, 500, 500], prompt)
    assert d["value"] == pytest.approx(0.25)
    assert d["low"] <= 0.25 <= d["high"]


def test_budgets_and_l1_follow_the_trace() -> None:
    requests = generate(TraceConfig(**ep.PairedSettings().trace))
    distinct = ep.distinct_chunks(requests, 128)
    assert distinct == len({tuple(r.token_ids[:(i + 1) * 128]) for r in requests
                            for i in range(len(r.token_ids) // 128)})
    budgets = ep.budgets_for(distinct, 128, (0.4, 0.5), 0.25)
    kv_mib = distinct * 128 * ep.BYTES_PER_TOKEN / ep.MIB
    assert [b.total_mib for b in budgets] == pytest.approx([0.4 * kv_mib, 0.5 * kv_mib], abs=0.2)
    assert all(b.dram_mib == pytest.approx(b.total_mib / 4, abs=0.1) for b in budgets)
    largest = max(len(r.token_ids) for r in requests) * ep.BYTES_PER_TOKEN / ep.MIB
    assert largest * 2 <= ep.l1_headroom_for(requests) < largest * 2 + 8


def test_the_reuse_ceiling_counts_whole_chunks_of_a_prefix_seen_before() -> None:
    """What an unbounded prefix cache hits, worked by hand on 4-token chunks: a repeat hits its
    whole chunks, a shared first chunk hits once the prefix diverges, a stranger hits nothing."""

    class Request:
        def __init__(self, token_ids: list[int]) -> None:
            self.token_ids = token_ids

    first = list(range(10))  # chunks [0..3], [4..7]; 2 tokens past the last whole chunk
    requests = [Request(first), Request(first),  # repeat: 8 of 10
                Request(first[:4] + [99] * 5),  # same first chunk only: 4 of 9
                Request([50] * 7)]  # nothing seen: 0 of 7
    assert ep.reuse_ceiling(requests, 4) == pytest.approx((0 + 8 + 4 + 0) / (10 + 10 + 9 + 7))
    assert ep.reuse_ceiling([], 4) == 0.0


def test_the_replay_trace_interleaves_sessions_at_random() -> None:
    """Round robin gives every session one reuse distance, so an LRU either holds every history or
    none (a cliff): the trace must spread the requests between a session's turns."""
    order = [r.session_id for r in generate(TraceConfig(**ep.PairedSettings().trace))]
    positions = {s: [i for i, x in enumerate(order) if x == s] for s in set(order)}
    gaps = [b - a for p in positions.values() for a, b in zip(p, p[1:])]
    spread = float(np.std(gaps) / np.mean(gaps))  # 0.38 with the default 2 s think time: near round robin
    assert spread >= 0.6, sorted(gaps)


def test_every_arrangement_spends_the_same_budget_and_ours_runs_the_shipped_default(tmp_path: Path) -> None:
    budget = ep.Budget(dram_mib=12, ssd_mib=36)
    by = {k: ep.replay_arrangement(k, budget, 32, tmp_path / k, "kvshrink-test-shm", None)
          for k in (*ep.STOCK_VARIANTS, "ours")}
    # L1 caches only what the budget gives it, and every L1 keeps the same 32 MiB free above that
    assert by["l1-all-dram"].l1_mib == 12 and by["l2-all"].l1_mib == by["ours"].l1_mib == 0
    assert {a.l1_size_mib - a.l1_mib for a in by.values()} == {32}
    assert by["l1-all-dram"].server_args() == ("--eviction-trigger-watermark", f"{12 / 44:.4f}", "--eviction-ratio", "0.2")
    assert by["ours"].server_args()[:2] == ("--eviction-trigger-watermark", "0.0000")
    assert by["l1-all-dram"].adapter["max_capacity_gb"] == pytest.approx(36 / 1024)
    assert by["l2-all"].adapter["max_capacity_gb"] == pytest.approx(48 / 1024)
    for key in ep.STOCK_VARIANTS:  # stock's L2 evicts by its own LRU, late and little
        assert by[key].adapter["type"] == "fs_native" and by[key].adapter["eviction"] == ep.STOCK_L2_EVICTION
    store = parse_store_config(by["ours"].adapter["adapter_params"]["store"])
    shipped = parse_store_config(load_store_mapping())
    assert [(t.name, t.capacity) for t in store.tiers] == [("dram", 12 << 20), ("ssd", 36 << 20)]
    assert unplaced(store) == unplaced(shipped)  # only placement and capacities differ
    assert len({by[k].policy.name for k in by}) == 3  # every stack's arrangement is named apart
    assert by["ours"].policy.tiers == "exclusive" and by["l1-all-dram"].policy.tiers == "inclusive"


def test_side_runs_refuse_a_replay_without_a_policy() -> None:
    entry = {"budget": {"dram_mib": 1.0, "ssd_mib": 3.0}, "label": "4 MiB", "l1_headroom_mib": 24.0, "stock_best": "l2-all",
             "figures": {"l2-all": {"hit_rate": 0.5}, "ours": {"hit_rate": 0.6}},
             "policies": {"l2-all": {"name": "x", "tiers": "inclusive", "l1_mib": 24.0, "promotion": True},
                          "ours": {"name": "y", "tiers": "bogus", "l1_mib": 24.0, "promotion": True}}}
    result = ep.PairedResult(settings={"chunk_tokens": 128}, workload={"trace": "t", "model": "m"}, replay=[entry])
    with pytest.raises(IncomparableError, match="tiers must be one of"):
        list(ep.side_runs(result))


def test_a_stack_is_idle_only_when_lmcache_and_our_store_have_nothing_in_flight() -> None:
    def status(pending=0, in_flight=0, tasks=0, puts=0, background=0) -> dict:
        return {"storage_manager": {
            "store_controller": {"pending_keys_count": pending, "in_flight_task_count": in_flight},
            "l2_adapters": [{"in_flight_tasks": tasks, "store": {"engine": {"put_queue_depth": puts,
                                                                            "background_queue_depth": background}}}]}}

    assert ep.stores_idle(status(), ours=True) and ep.stores_idle(status(), ours=False)
    assert not ep.stores_idle(status(pending=3), ours=False) and not ep.stores_idle(status(in_flight=1), ours=True)
    for busy in ({"tasks": 1}, {"puts": 2}, {"background": 1}):
        assert not ep.stores_idle(status(**busy), ours=True)
        assert ep.stores_idle(status(**busy), ours=False), "stock's status has no store of ours to wait for"


def test_settled_means_idle_twice_in_a_row() -> None:
    answers = iter([True, False, True, True, False])
    calls = []

    def idle() -> bool:
        calls.append(1)
        return next(answers)

    ep.wait_stores_settled(idle, timeout=5.0, name="ours")
    assert len(calls) == 4, "an idle answer after a busy one starts the count again"
    with pytest.raises(ep.E2EError, match="ours"):
        ep.wait_stores_settled(lambda: False, timeout=0.2, name="ours")
