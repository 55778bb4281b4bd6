"""TTFT by context length without vLLM: the sizing, the figures, the verdicts, the plot and the
phase's order of requests, on synthetic samples and stand-in stacks.

The stand-in stacks answer like LMCache would (a prompt seen before hits, from L1 unless L1 was
cleared, and our L1 and DRAM tier are empty after a restart), so the tests check that the phase
asks the right questions in the right order: a fresh prompt per cold pair, the warm prompt
prefilled last, every L1 pair before the L2 pairs, the SSD pairs after the restart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvshrink.benchmarks import context_ttft as ct
from kvshrink.benchmarks import e2e_paired as ep
from kvshrink.benchmarks.comparison import OURS, STOCK

STORED = Path(__file__).with_name("paired_result_for_rendering.json")
SETTINGS = ct.ContextSettings(lengths=(1024, 8192), budget_s=600.0, chunk_tokens=128)


def _sample(ttft: float, tokens: int, source: str) -> dict[str, Any]:
    cached = tokens // 128 * 128
    hit = 0 if source == "cold" else cached
    return {"ttft_s": ttft, "prompt_tokens": tokens, "hit_tokens": hit,
            "l1_hit_tokens": hit if source == "warm_l1" else 0,
            "l2_hit_tokens": hit if source in ("warm_l2", "warm_ssd") else 0, "text": "x", "neighbour_wait_s": 0.0}


def _entry(tokens: int, ttft: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """A length's samples from ``ttft[source][side]`` (side: stock / ours)."""
    n = ct.prompt_tokens_for(tokens)
    keys = {STOCK: "l1-all-dram", OURS: "ours"}
    return {"tokens": tokens, "prompt_tokens": n, "chunk_tokens": 128, "stock": keys[STOCK], "ours": keys[OURS],
            "cold_pairs": len(ttft["cold"][STOCK]), "warm_pairs": len(ttft["warm_l2"][STOCK]),
            "prompt_digest": f"d{tokens}", "cold_estimate_s": max(ttft["cold"][STOCK] + ttft["cold"][OURS]),
            "samples": {src: {keys[side]: [_sample(t, n, src) for t in ts] for side, ts in by.items()}
                        for src, by in ttft.items()}}


def _run(slow_ours: float = 1.0, spread: float = 0.0) -> dict[str, Any]:
    """A synthetic phase: cold grows ~quadratically, warm loads ~linearly; ours' warm_l2 is
    ``slow_ours`` x stock's, give or take ``spread`` per pair."""
    by_length = []
    for tokens in (1024, 2048, 4096, 8192):
        k = tokens / 1024
        cold = 0.2 * k * k + 0.3
        warm = 0.05 * k + 0.1
        jitter = [1.0, 1 + spread, 1 - spread, 1 + spread / 2, 1 - spread / 2, 1.0]
        by_length.append(_entry(tokens, {
            "cold": {STOCK: [cold, cold * 1.01], OURS: [cold * 1.005, cold]},
            "warm_l1": {STOCK: [warm * 0.8] * 6, OURS: [warm * 0.8] * 6},
            "warm_l2": {STOCK: [warm] * 6, OURS: [warm * slow_ours * j for j in jitter]},
            "warm_ssd": {STOCK: [warm * 1.1] * 6, OURS: [warm * 1.2] * 6}}))
    context = {"stock": "l1-all-dram", "ours": "ours", "by_length": by_length, "seconds": 42.0,
               "settings": {"budget_s": 600.0},
               "policies": {"l1-all-dram": {"name": "stock: L1 + fs_native", "tiers": "inclusive", "l1_mib": 512,
                                            "promotion": True},
                            "ours": {"name": "KVShrink: L1 + shipped default", "tiers": "inclusive", "l1_mib": 512,
                                     "promotion": True}},
               "ours_tiers_before_restart": {"dram": 100.0, "ssd": 0.0}}
    context.update(ct.summarize(by_length))
    return context


# -- sizing -----------------------------------------------------------------------------------------
def test_a_slow_machine_gets_one_cold_pair_and_the_fewest_warm_pairs_at_8k() -> None:
    # ~300 s a cold 8K prefill (2 AVX2 cores), 5 s a warm load, 225 s left for the length
    assert ct.plan_cold_pairs(300.0, 225.0, SETTINGS) == 1
    assert ct.plan_warm_pairs(5.0, 225.0 - 600.0, 3, SETTINGS) == SETTINGS.min_warm_pairs


def test_a_fast_machine_gets_the_most_pairs() -> None:
    assert ct.plan_cold_pairs(2.0, 225.0, SETTINGS) == SETTINGS.max_cold_pairs
    assert ct.plan_warm_pairs(0.4, 200.0, 3, SETTINGS) == SETTINGS.max_warm_pairs


def test_warm_pairs_fill_what_is_left_between_the_bounds() -> None:
    # a pair of each of three sources is 2 x 3 x 2 s = 12 s: 60 s buys 5
    assert ct.plan_warm_pairs(2.0, 60.0, 3, SETTINGS) == 5
    assert ct.plan_cold_pairs(10.0, 60.0, SETTINGS) == 1  # a third of 60 s is one 20-s pair
    assert ct.plan_cold_pairs(10.0, 120.0, SETTINGS) == 2


def test_the_longest_prompt_fits_the_model_with_its_answer() -> None:
    assert ct.prompt_tokens_for(1024) == 1024
    assert ct.prompt_tokens_for(8192) + ct.MAX_TOKENS <= ct.MODEL_POSITIONS
    assert ct.max_model_len_for((1024, 2048)) == 4096  # the harness's default: nothing changes
    assert ct.max_model_len_for(ct.CONTEXT_LENGTHS) == ct.MODEL_POSITIONS


def test_prompt_slices_are_disjoint_and_run_out_loudly() -> None:
    slices = ct.PromptSlices(list(range(1000)))
    a, b = slices.take(400), slices.take(400)
    assert len(a) == len(b) == 400 and not set(a) & set(b)
    with pytest.raises(ValueError, match="1000 tokens"):
        slices.take(400)


# -- figures and verdicts ---------------------------------------------------------------------------
def test_ratio_of_medians_and_its_interval() -> None:
    r = ct.ratio_of_medians([1.0, 1.0, 1.0], [4.0, 4.0])
    assert r["value"] == r["low"] == r["high"] == 0.25
    r = ct.ratio_of_medians([0.9, 1.0, 1.1, 1.0, 0.95], [4.0])  # one cold sample: the warm spread only
    assert r["low"] < 0.25 < r["high"] and r["cold_samples"] == 1


def test_figures_per_length_and_source() -> None:
    context = _run()
    e8 = context["by_length"][-1]
    assert set(e8["figures"]) == set(ct.SOURCES)
    warm = e8["figures"]["warm_l2"]
    assert warm["ours_median_s"] == pytest.approx(0.05 * 8 + 0.1)
    assert warm["ratio"]["median"] == pytest.approx(1.0) and warm["ratio"]["pairs"] == 6
    assert set(warm["over_cold"]) == {STOCK, OURS}
    assert "over_cold" not in e8["figures"]["cold"]
    assert all(e8["hits_as_expected"].values())


def test_both_targets_met_where_the_intervals_clear_them() -> None:
    targets = _run(slow_ours=0.9)["targets"]
    assert set(targets) == {"dram_over_cold", "dram_over_stock_l2"}
    assert targets["dram_over_cold"]["verdict"] == "met" and targets["dram_over_cold"]["pass"]
    assert targets["dram_over_stock_l2"]["verdict"] == "met" and targets["dram_over_stock_l2"]["high"] <= 1.05


def test_a_target_the_interval_straddles_is_inconclusive_and_not_passed() -> None:
    t = _run(slow_ours=1.04, spread=0.3)["targets"]["dram_over_stock_l2"]
    assert t["low"] < ct.DRAM_OVER_STOCK_TARGET < t["high"]
    assert t["verdict"] == "inconclusive" and not t["pass"]


def test_a_slower_load_is_not_met() -> None:
    t = _run(slow_ours=1.3)["targets"]["dram_over_stock_l2"]
    assert t["verdict"] == "not met" and not t["pass"]


def test_requests_that_did_not_hit_as_claimed_fail_the_target() -> None:
    context = _run(slow_ours=0.9)
    e8 = context["by_length"][-1]
    for x in e8["samples"]["warm_l2"]["ours"]:
        x["l2_hit_tokens"] = 0  # loaded from somewhere else (or recomputed): not our DRAM tier
    context.update(ct.summarize(context["by_length"]))
    t = context["targets"]["dram_over_cold"]
    assert t["verdict"] == "met" and not t["hits_as_expected"] and not t["pass"]


def test_no_target_without_8k() -> None:
    context = _run()
    context["by_length"] = context["by_length"][:2]
    assert ct.summarize(context["by_length"])["targets"] == {}


def test_crossover_is_the_shortest_length_from_which_loading_wins() -> None:
    context = _run()
    # cold 0.5 s at 1K against a 0.15 s warm load: loading wins at every length, for every source
    assert context["crossover"][OURS]["warm_l2"] == 1024
    e1 = context["by_length"][0]
    for side in ("l1-all-dram", "ours"):
        e1["samples"]["warm_l2"][side] = [_sample(2.0, 1024, "warm_l2")] * 6  # at 1K, loading loses
    context.update(ct.summarize(context["by_length"]))
    assert context["crossover"][OURS]["warm_l2"] == 2048 and context["crossover"][STOCK]["warm_l1"] == 1024


# -- the section, the plot, the report --------------------------------------------------------------
def _paired_result(context: dict[str, Any]) -> ep.PairedResult:
    result = ep.PairedResult(**json.loads(STORED.read_text()))
    result.context = context
    return result


def test_the_e2e_section_has_rows_targets_and_notes() -> None:
    from kvshrink.benchmarks.suite_sections import e2e_section

    section = e2e_section(_paired_result(_run(slow_ours=0.9)))
    rows = [r for r in section.comparisons if r.section == ct.ROW_SECTION]
    assert {r.case.split()[0] for r in rows} == {"1024", "2048", "4096", "8192"}
    assert {r.metric for r in rows} == {f"{s}_ttft_s" for s in ct.SOURCES} | {f"{s}_over_cold" for s in ct.WARM}
    named = [n for n in section.targets if n.startswith(f"TTFT at {ct.TARGET_TOKENS} tokens")]
    assert len(named) == 2 and all(section.targets[n]["pass"] for n in named)
    assert any("loading beats recomputing" in n for n in section.notes)
    assert section.figures["context"]["targets"]


def test_a_phase_over_its_budget_says_what_a_cold_prefill_cost() -> None:
    from kvshrink.benchmarks.suite_sections import e2e_section

    context = _run()
    context["seconds"] = 1500.0
    notes = e2e_section(_paired_result(context)).notes
    over = [n for n in notes if "over its 600 s budget" in n]
    assert len(over) == 1 and "8192: 13.2 s" in over[0]


def test_a_run_without_the_phase_renders_as_before() -> None:
    from kvshrink.benchmarks.suite_sections import e2e_section

    section = e2e_section(_paired_result({}))
    assert not [r for r in section.comparisons if r.section == ct.ROW_SECTION]
    assert not [n for n in section.targets if "context" in n or "tokens, ours" in n]


def test_the_plot_is_written_and_the_readme_shows_it(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from kvshrink.benchmarks import report
    from kvshrink.benchmarks.suite_sections import e2e_section

    section = e2e_section(_paired_result(_run(slow_ours=0.9)))
    run = {"status": "ok", "errors": [], "mode": "full", "machine": {"cpus": 2, "cpu_flags": ["avx2"]},
           "sections": {"e2e": {"status": "ok", "comparisons": [r.to_dict() for r in section.comparisons],
                                "figures": section.figures, "targets": section.targets, "notes": section.notes,
                                "store_config": section.store_config}}}
    run["plots"] = report.write_plots(run, tmp_path)
    png = tmp_path / ct.PLOT_FILE
    assert run["plots"]["context"] == ct.PLOT_FILE == report.PLOT_FILES["context"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    readme = report.readme_section(run)
    assert f"]({ct.PLOT_FILE})" in readme and "TTFT by context length" in readme
    assert ct.ROW_SECTION in report.terminal_table(run)


# -- the phase's order of requests, on stand-in stacks ----------------------------------------------
class _Server:
    http_url = "http://stand-in"


class _FakeStack:
    """Answers like LMCache: a prompt stored before hits (L1 unless cleared; else the L2), a
    restart empties L1; TTFT from where it came."""

    def __init__(self, key: str, side: str, root: Path, log: list[tuple[str, str, int]]) -> None:
        self.key, self.side, self.workdir, self.shm_name = key, side, root / key, f"shm-{key}"
        self.server, self.arrangement, self.log = _Server(), None, log
        self.l1: set[tuple[int, ...]] = set()
        self.l2: set[tuple[int, ...]] = set()

    def request(self, prompt: list[int], max_tokens: int = 8) -> ep.Sample:
        key = tuple(prompt[:16])
        n, cached = len(prompt), len(prompt) // 128 * 128
        if key in self.l1:
            where, ttft, l1, l2 = "l1", 0.01, cached, 0
        elif key in self.l2:
            where, ttft, l1, l2 = "l2", 0.02, 0, cached
        else:
            where, ttft, l1, l2 = "cold", 1e-4 * n, 0, 0
        self.log.append((self.key, where, n))
        self.l1.add(key)
        self.l2.add(key)
        return ep.Sample(ttft, n, l1 + l2, l1, l2, "x")

    def wait_idle(self) -> None:
        pass

    def wait_l1_room(self, need_bytes: float) -> None:
        pass

    def clear_l1(self) -> None:
        self.l1.clear()


def test_the_phase_asks_each_tier_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[tuple[str, str, int]] = []
    stock, ours = _FakeStack("l1-all-dram", STOCK, tmp_path, log), _FakeStack("ours", OURS, tmp_path, log)
    restarts = []

    def reconfigure(stacks: list[Any], arrangements: list[Any], wipe: bool = True) -> None:
        restarts.append(wipe)
        for st, arrangement in zip(stacks, arrangements):
            st.arrangement = arrangement
            st.l1.clear()
            if wipe:
                st.l2.clear()

    monkeypatch.setattr(ep, "reconfigure", reconfigure)
    monkeypatch.setattr(ep, "corpus_tokens", lambda model, corpus: list(range(40_000)) if corpus == "code"
                        else list(range(40_000, 80_000)))
    monkeypatch.setattr(ct.ContextTTFT, "_ours_tiers", lambda self: {"dram": 1.0, "ssd": 0.0})
    settings = ct.ContextSettings(lengths=(2048, 1024), budget_s=60.0, chunk_tokens=128, max_cold_pairs=2,
                                  min_warm_pairs=2, max_warm_pairs=3)
    out = ct.ContextTTFT(stock, ours, tmp_path, settings).run()

    assert restarts == [True, False]  # wiped once at the start, one restart for the SSD pairs
    assert [e["tokens"] for e in out["by_length"]] == [1024, 2048]
    for e in out["by_length"]:
        assert e["cold_pairs"] == 2 and e["warm_pairs"] == 3  # fast stand-ins: the most pairs
        assert all(e["hits_as_expected"].values()), e["hits_as_expected"]
        assert set(e["figures"]) == set(ct.SOURCES)
        for side in (stock.key, ours.key):
            assert len(e["samples"]["cold"][side]) == 2 and len(e["samples"]["warm_ssd"][side]) == 3
    # per length: cold, cold, then L1 pairs, then L2 pairs; the SSD pairs of every length at the end
    wheres = [w for _, w, _ in log]
    assert wheres[:4] == ["cold"] * 4 and wheres[4:10] == ["l1"] * 6 and wheres[10:16] == ["l2"] * 6
    assert wheres[-12:] == ["l2"] * 12
    assert json.loads(json.dumps(out))["targets"] == {}  # JSON-able; no 8K, no target


def test_arrangements_hold_a_length_in_l1_and_the_whole_phase_in_dram(tmp_path: Path) -> None:
    log: list[tuple[str, str, int]] = []
    stock, ours = _FakeStack("l1-all-dram", STOCK, tmp_path, log), _FakeStack("ours", OURS, tmp_path, log)
    stock_arr, ours_arr = ct.ContextTTFT(stock, ours, tmp_path, ct.ContextSettings()).arrangements()
    longest = ct.prompt_tokens_for(8192) * ep.BYTES_PER_TOKEN / ep.MIB
    assert stock_arr.l1_mib == ours_arr.l1_mib >= ct.ContextSettings.max_cold_pairs * longest
    assert stock_arr.l1_headroom_mib == ours_arr.l1_headroom_mib >= longest  # one more prompt's stores
    assert "--eviction-trigger-watermark" in ours_arr.server_args()
    store = ours_arr.adapter["adapter_params"]["store"]
    assert stock_arr.adapter["type"] == "fs_native" and ours_arr.shm_name == ours.shm_name
    assert json.dumps(store)  # a derived store mapping, recorded as run


# -- end to end: real vLLM CPU + real lmcache servers, small lengths ----------------------------------
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_the_phase_on_real_stacks_hits_each_tier_it_claims(tmp_path: Path) -> None:
    import time

    from kvshrink.benchmarks.suite_sections import cpu_info
    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    started = time.monotonic()
    print(f"\ncpu: {cpu_info()}")
    model = ensure_checkpoint()
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    stock = ep.Stack("stock", STOCK, tmp_path, log_dir, chunk_tokens=128)
    ours = ep.Stack("ours", OURS, tmp_path, log_dir, chunk_tokens=128)
    settings = ct.ContextSettings(lengths=(512, 1024), budget_s=60.0, chunk_tokens=128, max_cold_pairs=2,
                                  min_warm_pairs=2, max_warm_pairs=3)
    try:
        for st in (stock, ours):
            st.launch_cache(ep.hot_arrangement(st.side, st.workdir, st.shm_name, l1_mib=64, template=None))
        for st in (stock, ours):
            st.server.wait_healthy()
        for st in (stock, ours):
            st.launch_vllm(model, max_model_len=ct.max_model_len_for(settings.lengths))
        for st in (stock, ours):
            st.wait_ready()
        out = ct.ContextTTFT(stock, ours, model, settings).run()
    finally:
        for st in (stock, ours):
            st.close()
    print(json.dumps([{e["tokens"]: e["figures"]} for e in out["by_length"]], indent=1))
    print(f"test ran {time.monotonic() - started:.0f} s; phase {out['seconds']:.0f} s")
    assert [e["tokens"] for e in out["by_length"]] == [512, 1024]
    for e in out["by_length"]:
        assert all(e["hits_as_expected"].values()), e["hits_as_expected"]
        assert set(e["figures"]) == set(ct.SOURCES)
    assert out["ours_tiers_before_restart"].get("ssd", 0) == 0 < out["ours_tiers_before_restart"]["dram"]
    json.dumps(out)
