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
    three = section.targets["agent replay: at least three budgets where stock at its best hits at most the trace's "
                            "reuse ceiling - 10 points"]
    # the stored run recorded no reuse ceiling: 100 % is the ceiling then, and its 59 % counts
    assert not three["pass"] and three["detail"] == "1 of 1 budgets (stock at its best at most 90.0%)"
    assert any("stock at its best" in note for note in section.notes)


def test_a_budget_where_stock_hits_within_ten_points_of_the_reuse_ceiling_sets_no_target(
        result: ep.PairedResult) -> None:
    best = result.replay[0]["figures"][result.replay[0]["stock_best"]]["hit_rate"]  # 59.2 %
    result.workload["reuse_ceiling"] = best + 0.05  # no cache can gain 10 points over stock here
    section = e2e_section(result)
    assert not [name for name in section.targets if name.startswith("agent replay at")]
    assert any("no cache can gain 10 points" in note and "no target" in note for note in section.notes)
    result.workload["reuse_ceiling"] = best + 0.10
    assert [name for name in e2e_section(result).targets if name.startswith("agent replay at")]


def _replay_entry(ours: list[tuple[float, float]], stock: list[tuple[float, float]]) -> dict:
    """A replay budget whose requests had these (TTFT s, hit tokens) on each side."""
    return {"stock_best": "l2-all", "samples": {
        "ours": [{"ttft_s": t, "hit_tokens": h} for t, h in ours],
        "l2-all": [{"ttft_s": t, "hit_tokens": h} for t, h in stock]}}


def test_equal_hits_ttft_pairs_only_requests_whose_hits_are_equal_on_both_sides() -> None:
    # equal hits: ours 1 % faster on every such request; unequal hits (ours hit more, much faster) left out
    equal = [(0.99 * t, h) for t, h in [(1.0, 0), (2.0, 256), (3.0, 512)] * 10]
    ours = equal + [(0.2, 4096)] * 20
    stock = [(t / 0.99, h) for t, h in equal] + [(5.0, 0)] * 20
    same = ep.equal_hits_ttft([_replay_entry(ours[:40], stock[:40]), _replay_entry(ours[40:], stock[40:])])
    assert same["pairs"] == 30 and same["value"] == pytest.approx(0.99)
    assert same["high"] <= ep.EQUAL_HITS_TTFT_TARGET and same["verdict"] == "met"
    slower = ep.equal_hits_ttft([_replay_entry([(1.1 * t, h) for t, h in equal],
                                               [(t / 0.99, h) for t, h in equal])])
    assert slower["verdict"] == "not met"  # 10 % slower on every request with equal hits
    assert ep.equal_hits_ttft([_replay_entry([(1.0, 256)], [(1.0, 0)])]) is None


def test_the_equal_hits_target_is_reported_with_its_interval(result: ep.PairedResult) -> None:
    section = e2e_section(result)
    name = ("agent replay, requests whose hits are equal on both sides: TTFT ours / stock <= "
            f"{ep.EQUAL_HITS_TTFT_TARGET}")
    same = section.figures["equal_hits_ttft"]
    assert same["pairs"] >= 1 and section.targets[name]["pass"] == (same["verdict"] == "met")
    assert f"median of {same['pairs']} paired ratios" in section.targets[name]["detail"]


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


def test_the_replay_time_is_reported_next_to_the_sizings_prediction(result: ep.PairedResult) -> None:
    result.workload.update(sizing={"why": "sized", "warnings": [], "predicted_s": 3489.6, "replay_s": 2700.0},
                           context=None)
    notes = e2e_section(result).notes
    assert "trace sizing: the replay took 45.0 min, predicted 58.2 min" in notes
