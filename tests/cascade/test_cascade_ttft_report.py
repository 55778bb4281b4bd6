"""cascade_ttft's figures, verdicts and rendering from made-up samples, and the two couplings it
relies on: the proxy's metric names, and a direct prompt that is what the proxy sends at ratio 1."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvshrink.benchmarks import cascade_ttft as ct
from kvshrink.benchmarks.e2e_paired import BYTES_PER_TOKEN, E2EError


def _sample(step: int, side: str, ttft: float, tokens: int, condense_s: float = 0.0, tokens_in: float = 0.0,
            match: bool = True) -> dict:
    hits, misses = {ct.DIRECT: (0, 0), ct.UNCACHED: (0, 2), ct.CACHED: (2, 0)}[side]
    return {"step": step, "side": side, "ttft_s": ttft, "total_s": ttft + 0.5, "chunks": 4, "prompt_tokens": tokens,
            "completion_tokens": 4, "text": "4719", "expected": "4719", "match": match,
            "proxy": {"hits": hits, "misses": misses, "tokens_in": tokens_in, "tokens_out": tokens_in / 2,
                      "condense_s": condense_s, "requests": 0 if side == ct.DIRECT else 1}}


def _run(cached_ttfts: list[float], ratio: float = 0.5) -> dict:
    """Steps of 1000 direct prompt tokens (10 ms each), 600 through the proxy (800 document tokens
    condensed to 400), the small model at 2 ms per document token."""
    samples = []
    for step, cached in enumerate(cached_ttfts):
        samples += [_sample(step, ct.DIRECT, 10.0, 1000),
                    _sample(step, ct.UNCACHED, cached + 1.6, 600, condense_s=1.6, tokens_in=800),
                    _sample(step, ct.CACHED, cached, 600, tokens_in=800, match=step > 0)]
    return {"settings": {"documents": 2, "doc_tokens": 400, "pairs": len(cached_ttfts), "ratio": ratio,
                         "max_tokens": 4, "proxy_threads": 1, "warmup": True},
            "machine": {"cpus": 2, "cpu_model": "test CPU", "cpu_flags": ["avx2"], "loadavg_before": [1.0],
                        "loadavg_after": [1.0]},
            "engine": "test engine", "target": ct.TTFT_TARGET, "samples": samples,
            "figures": ct.figures(samples, ratio), "wall_s": 60.0}


def test_verdict_only_where_the_interval_clears_the_target() -> None:
    met = _run([5.0, 5.2, 4.8, 5.1, 4.9, 5.0])["figures"]
    assert met["cached_over_direct"]["verdict"] == "met" and met["cached_over_direct"]["high"] <= ct.TTFT_TARGET
    assert met["uncached_over_direct"]["verdict"] is None  # no target for uncached
    assert _run([5.0, 7.0, 4.5, 6.5, 5.5, 7.5])["figures"]["cached_over_direct"]["verdict"] == "inconclusive"
    assert _run([7.0, 7.2, 6.8, 7.1, 6.9, 7.0])["figures"]["cached_over_direct"]["verdict"] == "not met"
    assert _run([5.0, 5.0], ratio=0.3)["figures"]["cached_over_direct"]["verdict"] is None  # target is for 0.5


def test_tokens_bytes_and_break_even_from_measured_costs() -> None:
    f = _run([6.0, 6.0, 6.0])["figures"]
    assert f["prompt_tokens"] == {ct.DIRECT: 1000, ct.UNCACHED: 600, ct.CACHED: 600}
    assert f["tokens_saved_fraction"] == pytest.approx(0.4)
    assert f["kv_bytes_saved_per_request"] == 400 * BYTES_PER_TOKEN
    b = f["break_even"]
    assert b["small_s_per_document_token"] == pytest.approx(0.002)
    assert b["main_prefill_s_per_token"] == pytest.approx(0.01)  # 10 s / 1000 tokens
    assert b["main_prefill_s_per_token_slope"] == pytest.approx(0.01)  # (10 - 6) s / (1000 - 600) tokens
    # k* = s * D / (m * S) = 0.002 * 800 / (0.01 * 400)
    assert b["size_ratio"] == pytest.approx(0.4) and b["uncached_overhead_s"] == pytest.approx(1.6)
    assert f["matches"] == {ct.DIRECT: 3, ct.UNCACHED: 3, ct.CACHED: 2}


def test_rendering_shows_ratio_interval_verdict_tokens_and_flags() -> None:
    result = _run([5.0, 5.2, 4.8, 5.1, 4.9, 5.0])
    table = ct.markdown_table(result)
    r = result["figures"]["cached_over_direct"]
    assert f"{r['median']:.3f} ({r['low']:.3f}-{r['high']:.3f})" in table and "| met |" in table
    assert "| 1000 |" in table and "| 600 |" in table and "(avx2)" in table
    lines = "\n".join(ct.report_lines(result))
    assert "(target <= 0.6) met" in lines and "40.0% saved" in lines and "break-even" in lines
    assert "flags avx2" in lines
    assert math.isfinite(result["figures"]["break_even"]["size_ratio"])


def test_a_run_stops_when_the_proxy_did_not_do_what_the_side_says() -> None:
    ct._check(_sample(0, ct.CACHED, 1.0, 10), documents=2)
    with pytest.raises(E2EError, match="cache hits"):
        ct._check(_sample(0, ct.UNCACHED, 1.0, 10), documents=3)
    cached_but_missed = _sample(0, ct.CACHED, 1.0, 10)
    cached_but_missed["proxy"].update(hits=0, misses=2)
    with pytest.raises(E2EError):
        ct._check(cached_but_missed, documents=2)


def test_counters_are_read_from_the_proxys_own_metrics() -> None:
    from kvshrink.cascade.metrics import CascadeMetrics

    m = CascadeMetrics()
    m.cache_hits.labels("memory").inc(2)
    m.cache_hits.labels("store").inc()
    m.cache_misses.inc(4)
    m.tokens_in.observe(300)
    m.tokens_out.observe(150)
    m.condense_seconds.observe(1.25)
    m.requests.labels("/v1/completions", "condensed").inc()
    m.requests.labels("/v1/completions", "passthrough").inc(5)  # not a condensed request
    assert ct.proxy_counters(m.exposition().decode()) == {"hits": 3, "misses": 4, "tokens_in": 300,
                                                           "tokens_out": 150, "condense_s": 1.25, "requests": 1}


def test_the_direct_prompt_is_what_the_proxy_sends_at_ratio_one(checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    from kvshrink.cascade.marking import COMPLETIONS, find_documents

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    steps = ct.steps_of(tokenizer, ct.CascadeTTFTSettings(documents=2, doc_tokens=100), groups=3)
    assert len({doc for docs, _ in steps for doc in docs}) == 6  # fresh documents every step
    for docs, question in steps:
        assert any(question.answer in doc for doc in docs)  # each step asks about its own documents
        marked = find_documents(COMPLETIONS, {"prompt": ct.prompt_text(tokenizer, docs, question.text, ct.MARKERS)})
        assert marked.documents == docs
        assert marked.rewrite(docs)["prompt"] == ct.prompt_text(tokenizer, docs, question.text, None)
