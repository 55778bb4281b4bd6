"""The e2e section as the suite reports it, from a stored paired result (no vLLM).

``paired_result_for_rendering.json`` is the output of one small ``e2e_paired`` calibration run
(2026-12-01, an fp32 engine setting since rejected) with its restart figures set by hand and most
per-request samples cut: input for rendering only, never figures to quote. The test checks that
rows are made by ``compare`` with both tier policies, that a verdict appears only as the run's
intervals allow, and that the table, plot and README section render.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvshrink.benchmarks import e2e_paired as ep
from kvshrink.benchmarks import report
from kvshrink.benchmarks.suite_sections import e2e_section

STORED = Path(__file__).with_name("paired_result_for_rendering.json")


@pytest.fixture()
def result() -> ep.PairedResult:
    return ep.PairedResult(**json.loads(STORED.read_text()))


def test_rows_targets_and_notes_come_from_the_run(result: ep.PairedResult) -> None:
    section = e2e_section(result)
    by_section = {}
    for row in section.comparisons:
        by_section.setdefault(row.section, []).append(row)
        assert row.stock_policy["name"] and row.ours_policy["name"]
    assert {r.metric for r in by_section["e2e agent replay"]} == {"hit_rate", "prefill_s", "ttft_p50_s", "ttft_p90_s",
                                                                  "held_chunks"}
    hot = {r.metric: r for r in by_section["e2e hot path"]}
    assert set(hot) == {"warm_l1_ttft_s", "warm_l2_ttft_s", "after_restart_ttft_s", "after_restart_over_cold"}
    entry = result.replay[0]
    best = entry["stock_best"]
    replay_rows = {r.metric: r for r in by_section["e2e agent replay"]}
    assert replay_rows["hit_rate"].stock == entry["figures"][best]["hit_rate"]
    assert best in replay_rows["hit_rate"].stock_policy["name"]
    held = replay_rows["held_chunks"]  # KV kept in the same budget: more is better
    assert held.higher_is_better and held.ours == entry["figures"]["ours"]["held_chunks"]
    replay_targets = [t for name, t in section.targets.items() if name.startswith("agent replay at")]
    assert len(replay_targets) == 1 and not replay_targets[0]["pass"]  # the stored run was inconclusive
    assert "inconclusive" in replay_targets[0]["detail"]
    three = section.targets["agent replay: at least three budgets where stock at its best hits 40-85 %"]
    assert not three["pass"] and three["detail"] == "1 of 1 budgets"
    assert any("stock at its best" in note for note in section.notes)


def test_table_plot_and_readme_render(result: ep.PairedResult, tmp_path: Path) -> None:
    section = e2e_section(result)
    run = {"status": "ok", "errors": [], "mode": "quick", "machine": {"cpus": 2, "cpu_flags": ["avx2"]},
           "sections": {"e2e": {"status": "ok", "comparisons": [r.to_dict() for r in section.comparisons],
                                "figures": section.figures, "targets": section.targets, "notes": section.notes,
                                "store_config": section.store_config}}}
    table = report.terminal_table(run)
    assert "e2e agent replay" in table and "hit_rate" in table
    run["plots"] = report.write_plots(run, tmp_path)
    assert (tmp_path / run["plots"]["e2e"]).stat().st_size > 10_000
    readme = report.readme_section(run)
    assert "](agent_replay_e2e.png)" in readme and "e2e agent replay" in readme


def test_a_run_without_agent_replay_sets_no_replay_target(result: ep.PairedResult) -> None:
    result.replay = []  # what --quick runs
    section = e2e_section(result)
    assert not [r for r in section.comparisons if r.section == "e2e agent replay"]
    assert not [name for name in section.targets if name.startswith("agent replay")]
    assert any(note.startswith("no agent replay in this mode") for note in section.notes)
    assert {r.metric for r in section.comparisons} >= {"warm_l1_ttft_s", "warm_l2_ttft_s"}  # the hot path stays
