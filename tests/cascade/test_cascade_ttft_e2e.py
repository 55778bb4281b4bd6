"""cascade_ttft at a tiny size against a real vLLM CPU server and the real ``kvshrink cascade serve``:
the proxy's side reaches vLLM with fewer prompt tokens (vLLM's own usage count), the cached
requests are cache hits in the proxy's /metrics, every request streamed an answer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvshrink.benchmarks import cascade_ttft as ct
from kvshrink.testing.launch import VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
TINY = ct.CascadeTTFTSettings(documents=2, doc_tokens=100, pairs=1, max_tokens=4, warmup=False)  # no timing judged


@pytest.fixture(scope="module")
def result(checkpoint: Path, vllm: VLLMServer, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return ct.CascadeTTFT(checkpoint, TINY, tmp_path_factory.mktemp("cascade-ttft"), progress=lambda _: None,
                          upstream=vllm).run()


def test_the_proxy_side_prefills_fewer_tokens_and_cached_runs_hit(result: dict) -> None:
    by = {(x["step"], x["side"]): x for x in result["samples"]}
    assert len(by) == 3 * TINY.pairs
    for step in range(TINY.pairs):
        direct, uncached, cached = (by[step, side] for side in (ct.DIRECT, ct.UNCACHED, ct.CACHED))
        for proxied in (uncached, cached):
            assert proxied["prompt_tokens"] < direct["prompt_tokens"]
            saved = proxied["proxy"]["tokens_in"] - proxied["proxy"]["tokens_out"]  # what the proxy says it cut
            assert abs(direct["prompt_tokens"] - proxied["prompt_tokens"] - saved) <= 4 * TINY.documents
        assert cached["proxy"]["hits"] == TINY.documents and cached["proxy"]["misses"] == 0
        assert uncached["proxy"]["misses"] == TINY.documents and uncached["proxy"]["condense_s"] > 0
        assert direct["proxy"]["requests"] == 0  # the direct request never passed the proxy


def test_every_request_streamed_an_answer(result: dict) -> None:
    for x in result["samples"]:
        assert x["chunks"] >= 1 and x["text"].strip() and x["completion_tokens"] >= 1
        assert 0 < x["ttft_s"] <= x["total_s"]


def test_the_report_has_every_figure(result: dict) -> None:
    f = result["figures"]
    assert f["kv_bytes_saved_per_request"] > 0 and 0 < f["tokens_saved_fraction"] < 1
    assert math.isfinite(f["cached_over_direct"]["median"]) and f["cached_over_direct"]["target"] == ct.TTFT_TARGET
    assert f["break_even"]["small_s_per_document_token"] > 0
    assert "cpu_flags" in result["machine"]
    assert "| proxy, condensations cached |" in ct.markdown_table(result)
