"""benchmarks/infinity_replay.py's verdicts and report from its committed run (no vLLM):
``docs/bench/infinity-replay.json`` (2026-12-02, the README's figures)."""

from __future__ import annotations

import json
from pathlib import Path

from kvshrink.benchmarks import infinity_replay as ir

RUN = Path(__file__).parents[2] / "docs" / "bench" / "infinity-replay.json"


def test_the_committed_run_meets_its_targets_with_both_stacks_on_the_same_trace() -> None:
    result = json.loads(RUN.read_text())
    full, half = result["samples"]["full"], result["samples"]["half"]
    assert len(full) == len(half) == result["requests"]
    assert [x["prompt_tokens"] for x in full] == [x["prompt_tokens"] for x in half]  # the same requests, paired
    assert result["settings"]["ssd_mib"] >= result["distinct_kv_mib"]  # the SSD tier holds the whole trace
    assert "idle_demotion.after_s" in result["policies"]["half"]["name"]
    p, h, w = result["prefill_ratio"], result["hit_rate_points"], result["waste"]
    assert p["verdict"] == "met" and p["high"] <= ir.PREFILL_TARGET
    assert h["verdict"] == "met" and h["low"] >= 0
    assert w["verdict"] == "met" and w["value"] <= ir.WASTE_TARGET
    store = result["prefetch"]["store"]
    assert store["prefetch_moved"] > 0 and store["prefetch_wasted"] == 0
    assert result["engine"]["half"]["idle_demotions"] > 0  # idle demotion did run


def test_the_report_names_every_target() -> None:
    lines = "\n".join(ir.report_lines(json.loads(RUN.read_text())))
    assert "(target >= 0) met" in lines and "(target <= 1.05) met" in lines and "(target <= 10%) met" in lines
