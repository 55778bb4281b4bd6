"""The tiers section as the suite reports it, from a stored ``tier_ttft`` result (no vLLM).

``tier_ttft_result_for_rendering.json`` is the output of one small run (768 tokens, 2 pairs a row,
2026-12-01, on a machine loaded by other work): input for rendering only, never figures to quote.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvshrink.benchmarks import report
from kvshrink.benchmarks.suite_sections import tiers_section

STORED = Path(__file__).with_name("tier_ttft_result_for_rendering.json")


@pytest.fixture()
def result() -> dict:
    return json.loads(STORED.read_text())


def test_rows_carry_both_policies_and_targets_follow_the_intervals(result: dict) -> None:
    section = tiers_section(result)
    rows = {c.case.split(":")[0]: c for c in section.comparisons}
    assert set(rows) == {"ssd, page cache", "ssd, device", "ssd, 500 MB/s device", "remote"}
    assert all(c.metric == "ttft_s" and not c.higher_is_better for c in rows.values())
    for name in ("ssd, device", "ssd, 500 MB/s device"):  # the row names stock's better setting, as it ran
        odirect = "stock at its best: fs_native O_DIRECT" in rows[name].case
        assert odirect or "stock at its best: fs_native buffered" in rows[name].case
        assert ("O_DIRECT" in rows[name].stock_policy["name"]) == odirect
    targets = section.targets
    device = targets["ssd, device: warm TTFT ours / stock <= 1.0 at 768 tokens"]
    assert not device["pass"] and "inconclusive" in device["detail"]  # 0.663-1.362 straddles 1.0
    slow = targets["ssd, 500 MB/s device: warm TTFT ours / stock <= 0.8 at 768 tokens"]
    assert not slow["pass"] and "not met" in slow["detail"]
    resume = targets["resume, hint: TTFT resumed from SSD with a hint / KV in DRAM <= 1.15 at 768 tokens"]
    assert resume["pass"]
    assert any(note.startswith("resume, no hint: TTFT / KV in DRAM") for note in section.notes)
    cross = targets["cross-node: node B's TTFT from the shared tier <= 0.35x cold at 768 tokens"]
    assert cross["pass"] and "first request" in cross["detail"]
    assert any("0.668x" in note for note in section.notes)  # bytes in Redis, ours / stock


def test_the_table_and_readme_render(result: dict) -> None:
    section = tiers_section(result)
    run = {"status": "ok", "errors": [], "mode": "full", "machine": {"cpus": 2, "cpu_flags": ["avx2"]},
           "sections": {"tiers": {"status": "ok", "comparisons": [r.to_dict() for r in section.comparisons],
                                  "figures": section.figures, "targets": section.targets, "notes": section.notes,
                                  "store_config": section.store_config}}}
    assert "TTFT by tier" in report.terminal_table(run)
    assert "ssd, device" in report.readme_section(run)
