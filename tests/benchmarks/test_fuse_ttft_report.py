"""fuse_ttft's plan, figures, verdict and rendering from made-up samples (no vLLM, no model)."""

from __future__ import annotations

import pytest

from kvshrink.benchmarks import fuse_ttft as ft
from kvshrink.benchmarks.e2e_paired import E2EError


def _sample(pair: int, side: str, ttft: float, text: str = "4719", fused: bool = True) -> dict:
    fuse = {"fusions": 1, "reused_chunks": 6, "recomputed_tokens": 230, "gap_tokens": 29} if side == ft.OURS and fused \
        else {"fallback_missing": 1} if side == ft.OURS else {}
    return {"pair": pair, "side": side, "ttft_s": ttft, "total_s": ttft + 1, "prompt_tokens": 1821,
            "hit_tokens": 1792 if side == ft.OURS and fused else 256, "text": text, "expected": "4719",
            "match": text == "4719", "fuse": fuse}


def _run(ours: list[float], stock_ttft: float = 60.0, texts: list[str] | None = None) -> dict:
    texts = texts or ["4719"] * len(ours)
    samples = [x for i, (o, t) in enumerate(zip(ours, texts))
               for x in (_sample(i, ft.STOCK, stock_ttft), _sample(i, ft.OURS, o, t))]
    seeds = [{**_sample(0, side, 60.0), "seed": 0} for side in ft.SIDES]
    result = {"settings": {"pool": 12, "per_request": 3, "doc_tokens": 512}, "engine": "test engine",
              "machine": {"cpus": 2, "cpu_model": "test CPU", "cpu_flags": ["avx2"], "loadavg_before": [1.0],
                          "loadavg_after": [2.0]},
              "samples": samples, "seeds": seeds, "figures": ft.figures(samples, seeds, 6), "wall_s": 100.0}
    return result


def test_verdict_only_where_the_interval_clears_the_target() -> None:
    met = _run([10.0, 11.0, 9.5, 10.5, 12.0, 10.0])["figures"]["ours_over_stock"]
    assert met["verdict"] == "met" and met["high"] < ft.TTFT_TARGET and met["pairs"] == 6
    assert met["median"] == pytest.approx(10.25 / 60)
    not_met = _run([30.0, 31.0, 29.0, 30.5, 32.0, 30.0])["figures"]["ours_over_stock"]
    assert not_met["verdict"] == "not met"
    mixed = _run([10.0, 40.0, 12.0, 38.0, 11.0, 39.0])["figures"]["ours_over_stock"]
    assert mixed["verdict"] == "inconclusive" and mixed["low"] <= ft.TTFT_TARGET < mixed["high"]


def test_figures_count_reuse_answers_and_hits() -> None:
    texts = ["4719", "4719", "1234", "4719"]
    f = _run([10.0, 11.0, 12.0, 13.0], texts=texts)["figures"]
    assert f["answers_agree"] == 3 and f["answers_agree_fraction"] == 0.75
    assert f["matches"] == {ft.STOCK: 4, ft.OURS: 3}
    assert f["fused_requests"] == 4 and f["reused_chunks"] == 24 and f["reusable_chunks"] == 24
    assert f["hit_tokens"] == {ft.STOCK: 256, ft.OURS: 1792}
    assert f["seed_answers_agree"] == 1 and f["seed_pairs"] == 1
    assert f["ttft_s"][ft.OURS]["per_pair"] == [10.0, 11.0, 12.0, 13.0]


def test_a_fallback_is_counted_not_hidden() -> None:
    samples = [_sample(0, ft.STOCK, 60.0), _sample(0, ft.OURS, 61.0, fused=False)]
    f = ft.figures(samples, [], 6)
    assert f["fused_requests"] == 0 and f["fallbacks"] == 1 and f["reused_chunks"] == 0


def test_incomplete_pairs_are_refused() -> None:
    with pytest.raises(E2EError):
        ft.figures([_sample(0, ft.STOCK, 60.0)], [], 6)


def test_plan_puts_a_never_first_document_first() -> None:
    for settings in (ft.FuseTTFTSettings(), ft.FuseTTFTSettings().quick()):
        settings.check()
        seeds, measured = ft.plan(settings)
        assert sorted(d for s in seeds for d in s) == list(range(settings.pool))
        firsts = [docs[0] for docs, _ in measured]
        assert len(set(firsts)) == len(firsts) == settings.pairs
        assert not set(firsts) & {s[0] for s in seeds}
        assert all(asked in docs and len(set(docs)) == settings.per_request for docs, asked in measured)
    with pytest.raises(ValueError):
        ft.FuseTTFTSettings(pairs=9).check()  # only 8 documents are never first in a seed
    with pytest.raises(ValueError):
        ft.FuseTTFTSettings(doc_tokens=500).check()


def test_rendering() -> None:
    result = _run([10.0, 11.0, 9.5, 10.5, 12.0, 10.0])
    lines = ft.report_lines(result)
    assert "met" in lines[1] and "<= 0.4" in lines[1]
    assert "load [1.0] -> [2.0]" in lines[-1]
    table = ft.markdown_table(result)
    assert "| KV Fuse" in table and "6/6" in table and "36/36" in table
