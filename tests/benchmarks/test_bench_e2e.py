"""The paired end-to-end harness against real vLLM CPU and real ``lmcache server`` processes (slow).

Checks the harness, not speed: every stack is served from where the phase claims (LMCache's own
hit counters), a budget bounds what each stack holds, and where ours and stock hit the same
tokens of the same prompt they answer alike.
"""

from __future__ import annotations

import pytest
from kvshrink.benchmarks import e2e_paired as ep
from kvshrink.benchmarks.comparison import Metric, compare

pytestmark = pytest.mark.e2e

# ~0.3-0.5K-token prompts in 128-token chunks (the harness's default is LMCache's 256): 7 distinct
# chunks, so a budget of half of them holds a few chunks on every stack and the test stays short
TINY_TRACE = dict(sessions=3, turns=2, concurrency=3, system_tokens=128, first_user_tokens=128, tokens_per_turn=64,
                  output_tokens=16, agents=1, seed=0)


def test_three_stacks_serve_each_phase_from_where_it_claims(tmp_path) -> None:
    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    settings = ep.PairedSettings(hot_prompt_tokens=512, hot_pairs=2, trace=TINY_TRACE, fractions=(0.5,),
                                 chunk_tokens=128,
                                 context_lengths=())  # TTFT by context length: test_context_ttft.py
    result = ep.PairedBench(ensure_checkpoint(), settings, log_dir=tmp_path).run()

    assert all(result.hot["hits_as_expected"].values()), result.hot["hits_as_expected"]
    for key, r in result.restart["sides"].items():  # after a restart, from disk (ours: the SSD tier)
        assert r["after_restart"]["l2_hit_tokens"] == 512 and r["over_cold"] < 1, (key, r)
    (entry,) = result.replay
    budget_bytes = (entry["budget"]["dram_mib"] + entry["budget"]["ssd_mib"]) * ep.MIB
    for key, figures in entry["figures"].items():
        assert figures["requests"] == result.workload["requests"] and figures["hit_tokens"] > 0, key
        assert figures["l1_allocation_failures"] == 0, key  # no store dropped for want of L1 room
    assert entry["figures"]["ours"]["held_bytes"] <= budget_bytes
    assert entry["figures"]["l2-all"]["held_bytes"] <= budget_bytes * 1.05  # LMCache evicts after a store lands
    assert entry["prefill_ratio"]["pairs"] == result.workload["requests"]
    agree = entry["same_text"]
    assert agree["same_hits"] >= 1 and agree["same_text"] == agree["same_hits"], agree
    (case, stock, ours), = ep.side_runs(result)
    rows = compare("e2e agent replay", case, stock, ours, [Metric("hit_rate", "fraction")])
    assert rows[0].stock_policy["name"].startswith("stock") and rows[0].ours_policy["tiers"] == "exclusive"
