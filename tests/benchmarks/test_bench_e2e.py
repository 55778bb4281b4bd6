"""The end-to-end driver against real vLLM CPU and real ``lmcache server`` processes (slow).

Checks the harness, not speed: each scenario is served from where it claims (LMCache's own hit
counters), both sides ran the same prompts, and greedy outputs agree.
"""

from __future__ import annotations

import pytest
from kvshrink.benchmarks import e2e_ttft
from kvshrink.benchmarks.comparison import Metric, compare

pytestmark = pytest.mark.e2e


def test_one_vllm_serves_both_sides_and_every_warm_request_hits(tmp_path) -> None:
    from kvshrink.fixtures.smollm2 import ensure_checkpoint

    settings = e2e_ttft.E2ESettings(lengths=(768,), warm_repeats=1, agent_sessions=0)
    stock, ours = e2e_ttft.run(ensure_checkpoint(), settings, log_dir=tmp_path)
    for run in (stock, ours):
        record = run.details["records"]["lengths"][768]
        assert record["cold_hits"]["hit_tokens"] == 0
        assert record["warm_dram_hits"]["l1_hit_tokens"] == 768
        assert record["warm_l2_hits"]["l2_hit_tokens"] == 768 and record["warm_l2_hits"]["l1_hit_tokens"] == 0
        assert record["warm_ssd_hits"]["l2_hit_tokens"] == 768
    assert stock.details["output_mismatches"] == []
    assert stock.details["cold_vs_warm_differs"] == []  # whole chunks: warm answers equal cold ones
    rows = compare("e2e", "768", stock.scoped("768."), ours.scoped("768."), [Metric("cold_ttft_s", "s", False)])
    assert rows[0].stock > 0 and rows[0].ours > 0
