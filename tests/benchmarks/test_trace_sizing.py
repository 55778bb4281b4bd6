"""The e2e replay's trace: sessions that grow to the model's context, sized to a time budget from
fixed (as if measured) speeds, and recorded in the report as requested. No vLLM."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from kvshrink.benchmarks import e2e_paired as ep
from kvshrink.benchmarks import trace_sizing as ts
from kvshrink.benchmarks.agent_trace import TraceConfig, generate, generate_sessions
from kvshrink.benchmarks.comparison import trace_fingerprint

# about what a 2-core AMX Xeon measures: cold 1K ~0.6 s, 4K ~3 s (attention makes 8K ~9 s); a
# warm request ~0.15 s; each request waits ~1 s for the other stacks' engines to stop spinning
AMX = ts.Speeds(cold=((1024, 0.6), (4096, 3.0)), fixed_s=0.15, load_s_per_token=2e-5, store_s_per_token=2e-5,
                overhead_s=1.0, per_budget_s=30.0)
SHAPE = ep.PairedSettings().trace
STACKS, BUDGETS = len(ep.STOCK_VARIANTS) + 1, len(ep.PairedSettings().fractions)
SMALL = dict(sessions=(2, 8), turns=(3, 8))  # a narrower search: the same logic, fewer shapes to try


def test_sessions_grow_to_exactly_the_context_and_never_past_it() -> None:
    cfg = TraceConfig(**{**SHAPE, "sessions": 6, "turns": 5, "concurrency": 6})
    for turns in generate_sessions(cfg):
        assert len(turns) >= 2
        first = turns[0]
        assert 0.5 * 1024 <= first.prompt_tokens <= 1.5 * 1024  # ~1K: system prompt + first user message
        for prev, cur in zip(turns, turns[1:]):
            assert np.array_equal(cur.token_ids[:prev.prompt_tokens], prev.token_ids)  # context only grows
            assert cur.reply_tokens == prev.max_tokens
        assert all(t.prompt_tokens + t.max_tokens <= cfg.context_tokens for t in turns)
        assert turns[-1].prompt_tokens + turns[-1].max_tokens == cfg.context_tokens


def test_a_trace_without_a_context_length_is_the_one_it_always_was() -> None:
    """The capacity section and earlier reports fingerprint traces: the default path is unchanged."""
    cfg = TraceConfig(sessions=8, turns=6, concurrency=8, system_tokens=128, first_user_tokens=256,
                      tokens_per_turn=32, output_tokens=16, agents=1, think_s=20.0, seed=0)
    assert trace_fingerprint(generate(cfg)) == "50req-a08e096182c243c9"


def test_speeds_fit_a_prefill_that_grows_faster_than_its_tokens() -> None:
    b, c = 3e-4, 5e-8
    speeds = ts.Speeds(cold=tuple((n, 0.2 + b * n + c * n * n) for n in (1024, 2048, 4096)), fixed_s=0.2)
    assert speeds.prefill_coefficients() == pytest.approx((b, c), rel=1e-6)
    assert speeds.cold_s(8192) == pytest.approx(0.2 + b * 8192 + c * 8192 ** 2)
    linear = ts.Speeds(cold=((1024, 1.2),), fixed_s=0.2)  # one length: a straight line through it
    assert linear.prefill_coefficients() == pytest.approx((1.0 / 1024, 0.0))
    # a hit saves the prefill of its tokens but attention still runs over the whole prompt
    assert speeds.request_s(4096, 2048) < speeds.request_s(4096, 0)
    assert speeds.request_s(4096, 2048) > speeds.request_s(2048, 0) - speeds.fixed_s


def test_the_sizing_fits_the_budget_and_shrinks_with_it() -> None:
    roomy = ts.size_trace(SHAPE, AMX, STACKS, BUDGETS, 40 * 60, 256, **SMALL)
    tight = ts.size_trace(SHAPE, AMX, STACKS, BUDGETS, 12 * 60, 256, **SMALL)
    for choice in (roomy, tight):
        assert choice.fits and choice.predicted_s <= choice.budget_s
        requests = generate(TraceConfig(**choice.trace))
        assert len(requests) == choice.requests
        assert ts.predicted_s(requests, AMX, STACKS, BUDGETS, 256) == pytest.approx(choice.predicted_s)
        assert choice.trace["context_tokens"] == SHAPE["context_tokens"] and choice.why
    assert tight.requests < roomy.requests
    assert roomy.requests >= ts.MIN_DECISIVE_REQUESTS and not roomy.warnings
    assert any("an interval needs" in w for w in tight.warnings)


def test_a_budget_that_buys_nothing_says_so() -> None:
    slow = ts.Speeds(cold=((1024, 30.0), (4096, 140.0)), fixed_s=0.5, overhead_s=1.0)  # AVX2 alone
    choice = ts.size_trace(SHAPE, slow, STACKS, BUDGETS, 5 * 60, 256, **SMALL)
    assert not choice.fits
    assert any("buys no replay" in w for w in choice.warnings)
    assert any("contexts shortened" in w for w in choice.warnings)


def test_the_default_search_picks_a_decisive_trace_given_time() -> None:
    choice = ts.size_trace(SHAPE, AMX, STACKS, BUDGETS, 60 * 60, 256)
    assert choice.fits and choice.requests >= ts.MIN_DECISIVE_REQUESTS
    assert ts.PREFERRED_MIN_SESSIONS <= choice.trace["sessions"] <= ts.SESSIONS[1]


def test_a_users_trace_is_only_checked() -> None:
    requests = generate(TraceConfig(**{**SHAPE, "sessions": 4, "turns": 4, "concurrency": 4}))
    choice = ts.check_trace(requests, AMX, STACKS, BUDGETS, 60.0, 256)
    assert choice.requests == len(requests) and not choice.fits
    assert any("over the" in w for w in choice.warnings)


def test_the_report_records_the_contexts_and_working_set_that_were_requested() -> None:
    choice = ts.size_trace(SHAPE, AMX, STACKS, BUDGETS, 25 * 60, 256, **SMALL)
    requests = generate(TraceConfig(**choice.trace))
    settings = ep.PairedSettings()
    distinct = ep.distinct_chunks(requests, settings.chunk_tokens)
    budgets = ep.budgets_for(distinct, settings.chunk_tokens, settings.fractions, settings.dram_share)
    record = ep.trace_record(requests, settings.chunk_tokens, budgets, choice.trace)
    context = record["context"]
    assert context["requested"] == {"first_prompt_tokens": 1024, "context_tokens": 8192,
                                    "sessions": choice.trace["sessions"], "turns": choice.trace["turns"]}
    assert record["sessions"] == choice.trace["sessions"] and record["requests"] == choice.requests
    assert context["session_final_positions"] == [8192] * choice.trace["sessions"]
    prompts = [len(r.token_ids) for r in requests]
    assert (context["prompt_tokens_min"], context["prompt_tokens_max"]) == (min(prompts), max(prompts))
    assert context["prompt_tokens_median"] == pytest.approx(np.median(prompts))
    assert context["prompt_tokens_max"] < 8192
    assert record["working_set_bytes"] == distinct * 256 * ep.BYTES_PER_TOKEN
    assert 2.0 <= record["working_set_over_largest_budget"] <= 4.0
    assert record["working_set_over_largest_budget"] == pytest.approx(1 / max(settings.fractions), rel=0.01)


def test_the_replay_trace_is_chunked_as_lmcache_does_by_default() -> None:
    assert ep.PairedSettings().chunk_tokens == 256


def test_phase_samples_turn_the_hot_path_into_speeds() -> None:
    def x(tokens: int, ttft: float, wait: float = 0.0) -> dict:
        return {"prompt_tokens": tokens, "ttft_s": ttft, "neighbour_wait_s": wait}

    hot = {"samples": {"cold": {"a": [x(1024, 0.7)], "b": [x(1024, 0.5)]},
                       "warm_l1": {"a": [x(1024, 0.1, 0.9)], "b": [x(1024, 0.1, 1.1)]},
                       "warm_l2": {"a": [x(1024, 0.2, 1.0)], "b": [x(1024, 0.2, 1.0)]}}}
    context = {"by_length": [{"samples": {"cold": {"a": [x(4096, 3.0)], "b": [x(4096, 3.2)]}}}]}
    got = ep.phase_samples(ep.PairedResult(settings={}, workload={}, hot=hot, context=context))
    assert got["cold"] == [(1024, pytest.approx(0.6)), (4096, pytest.approx(3.1))]
    assert got["fixed_s"] == pytest.approx(0.1)
    assert got["load_s_per_token"] == pytest.approx(0.1 / 1024)
    assert got["wait_s"] == pytest.approx(1.1)  # the mean wait, plus the harness's own polls


def test_the_replay_gets_what_the_run_has_left_less_the_tiers_section(tmp_path: Path) -> None:
    from kvshrink.benchmarks.suite_sections import PRESETS, Context

    ctx = Context(mode="full", out_dir=tmp_path, store_template=tmp_path, threads=2, bar=None,
                  deadline=time.monotonic() + 3600, sections=("e2e", "tiers"))
    alone = Context(mode="full", out_dir=tmp_path, store_template=tmp_path, threads=2, bar=None,
                    deadline=time.monotonic() + 3600, sections=("e2e",))
    allowance = ts.tiers_allowance_s(AMX, **PRESETS["full"]["tiers"])
    assert alone.replay_time_left(AMX) == pytest.approx(3600, abs=5)
    assert ctx.replay_time_left(AMX) == pytest.approx(3600 - allowance, abs=5)
    assert ts.default_time_budget_min(["avx2", "avx512f", "amx_bf16"]) == 25
    assert ts.default_time_budget_min(["avx2"]) == 40


def test_the_tiers_allowance_covers_what_a_full_run_measured() -> None:
    """The speeds a full run measured on the 2-core AVX-512 EPYC (`make bench`, 2026-12-06), whose
    tiers section then took 666 s: the allowance the replay's sizing subtracts is within 10 % of it,
    so the replay is not handed minutes the tiers section then spends past the run's budget."""
    from kvshrink.benchmarks.suite_sections import PRESETS

    epyc = ts.Speeds(cold=((1024, 2.02), (2048, 4.97), (4096, 12.92), (8184, 41.10)), fixed_s=0.151,
                     load_s_per_token=9.39e-05, overhead_s=0.668, per_budget_s=24.6)
    assert ts.tiers_allowance_s(epyc, **PRESETS["full"]["tiers"]) == pytest.approx(666, rel=0.1)


def test_the_harness_measures_sizes_and_records_the_trace_before_its_replay(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    """``PairedBench.choose_trace`` with a stand-in stack: the 4K cold request the hot path lacks is
    measured, the trace is sized to the time left and recorded with the sizing, its why is said."""

    class Sample:
        def __init__(self, tokens: int) -> None:
            self.ttft_s, self.neighbour_wait_s = AMX.cold_s(tokens), 0.0

    def x(tokens: int, ttft: float, wait: float = 0.0) -> dict:
        return {"prompt_tokens": tokens, "ttft_s": ttft, "neighbour_wait_s": wait}

    bench = ep.PairedBench(tmp_path / "model", ep.PairedSettings(context_lengths=()), log_dir=tmp_path)
    sent: list[int] = []
    monkeypatch.setattr(bench.ours, "request", lambda prompt, max_tokens=4: sent.append(len(prompt)) or
                        Sample(len(prompt)))
    monkeypatch.setattr(bench.ours, "wait_idle", lambda: None)
    monkeypatch.setattr(ep, "trace_requests", lambda settings, model, trace=None: generate(TraceConfig(**trace)))
    said: list[str] = []
    bench.say, bench.time_left = said.append, lambda speeds: 20 * 60.0
    hot = {"samples": {"cold": {"a": [x(1024, AMX.cold_s(1024))]}, "warm_l1": {"a": [x(1024, 0.15, 0.9)]},
                       "warm_l2": {"a": [x(1024, 0.17, 0.9)]}}}
    result = ep.PairedResult(settings={}, workload={}, hot=hot)
    try:
        requests, budgets = bench.choose_trace(result)
    finally:
        bench.stop()
        shutil.rmtree(bench.root, ignore_errors=True)
    assert sent == [4096]  # 1024 came from the hot path
    sizing = result.workload["sizing"]
    assert sizing["fits"] and sizing["requests"] == len(requests) == result.workload["requests"]
    assert [n for n, _ in sizing["speeds"]["cold"]] == [1024, 4096]
    assert len(budgets) == 3 and result.workload["context"]["session_final_positions"] == [8192] * sizing["trace"][
        "sessions"]
    assert said and said[0].startswith("e2e agent replay: cold prefill measured")
