"""Selective recompute (CacheBlend) with the real model: the limits (ratio 1 = full prefill, ratio 0
= re-rotation only), what is selected, and that the result serves as an ordinary prefix."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from kvshrink.errors import ConfigError
from kvshrink.fuse.engine import FuseEngine, ReusedSegment


@pytest.fixture(scope="module")
def rag(prose_ids: list[int]) -> dict:
    """A header, two documents and a question tail, each document's KV computed earlier, alone after
    the header (so at other positions than in the prompt, in the other order)."""
    header, doc_a, doc_b, sep, tail = (prose_ids[:12], prose_ids[500:620], prose_ids[1200:1290],
                                       prose_ids[2000:2003], prose_ids[2500:2520])
    prompt = header + sep + doc_b + sep + doc_a + sep + tail
    starts = {"b": len(header) + len(sep), "a": len(header) + 2 * len(sep) + len(doc_b)}
    return {"header": header, "docs": {"a": doc_a, "b": doc_b}, "sep": sep, "prompt": prompt, "starts": starts}


def _segments(engine: FuseEngine, rag: dict) -> list[ReusedSegment]:
    segments = []
    for name, doc in rag["docs"].items():
        earlier = rag["header"] + rag["sep"] + doc  # what an earlier request computed
        kv = engine.prefill(earlier).kv[:, :, -len(doc):]
        segments.append(ReusedSegment(rag["starts"][name], len(earlier) - len(doc), kv))
    return segments


def test_prefill_is_an_ordinary_forward(engine32: FuseEngine, hf_kv: Any, model: Any, rag: dict) -> None:
    ids = rag["prompt"]
    ours = engine32.prefill(ids, logits_at=[-1])
    want = hf_kv(ids)
    assert ours.kv.dtype == torch.float32 and ours.kv.shape == want.shape == (2, 30, len(ids), 192)
    assert torch.allclose(ours.kv, want, atol=1e-4, rtol=1e-4)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(ours.logits[0], logits, atol=1e-3)
    assert ours.exact and ours.computed_tokens == len(ids) and ours.token_layers == 30 * len(ids)


def test_ratio_one_is_full_prefill(engine32: FuseEngine, engine: FuseEngine, hf_kv: Any, rag: dict) -> None:
    ids, header = rag["prompt"], rag["header"]
    for eng, want in ((engine32, hf_kv(ids)), (engine, engine.prefill(ids).kv)):
        prefix = eng.prefill(header).kv
        fused = eng.fuse(ids, _segments(eng, rag), ratio=1.0, prefix_kv=prefix)
        assert fused.exact and fused.recomputed_tokens == fused.reused_tokens == 210
        assert fused.computed_tokens == len(ids) - len(header)
        if eng is engine32:
            assert torch.allclose(fused.kv, want, atol=1e-4, rtol=1e-4)
        else:  # bf16 KV: the prefix is computed alone, so an element may round the other way
            assert fused.kv.dtype == torch.bfloat16
            diff = (fused.kv.float() - want.float()).abs()
            assert float(diff.max()) <= 2 ** -6 * float(want.float().abs().max()), float(diff.max())


def test_ratio_zero_only_rerotates_and_computes_the_gaps(engine: FuseEngine, rag: dict) -> None:
    ids = rag["prompt"]
    segments = _segments(engine, rag)
    fused = engine.fuse(ids, segments, ratio=0.0, prefix_kv=engine.prefill(rag["header"]).kv)
    gaps = len(ids) - len(rag["header"]) - 210
    assert (fused.computed_tokens, fused.recomputed_tokens, fused.reused_tokens) == (gaps, 0, 210)
    assert not fused.exact and fused.token_layers == 30 * gaps
    from kvshrink.fuse.rope import rerotate

    for seg in segments:  # reused KV kept exactly as re-rotated, in every layer
        n = seg.kv.shape[2]
        assert torch.equal(fused.kv[1, :, seg.start:seg.start + n], seg.kv[1])
        assert torch.equal(fused.kv[0, :, seg.start:seg.start + n], rerotate(seg.kv[0], seg.start - seg.source_start,
                                                                              engine.rope))


def test_ratio_zero_on_an_exact_prefix_is_byte_identical(engine: FuseEngine, prose_ids: list[int]) -> None:
    """A segment that *is* the exact KV at its own positions stays byte for byte what it was."""
    ids = prose_ids[:160]
    exact = engine.prefill(ids).kv
    fused = engine.fuse(ids, [ReusedSegment(0, 0, exact[:, :, :128])], ratio=0.0)
    assert torch.equal(fused.kv[:, :, :128], exact[:, :, :128])
    assert (fused.kv[:, :, 128:].float() - exact[:, :, 128:].float()).abs().max() <= 2 ** -5 * exact.float().abs().max()


def test_selective_recompute_picks_the_gaps_and_the_top_ratio(engine: FuseEngine, rag: dict) -> None:
    ids = rag["prompt"]
    segments = _segments(engine, rag)
    prefix = engine.prefill(rag["header"]).kv
    gaps = len(ids) - len(rag["header"]) - 210
    full = engine.prefill(ids, logits_at=[-1])
    kls = []
    for ratio in (0.0, 0.15, 0.3):
        fused = engine.fuse(ids, segments, ratio=ratio, prefix_kv=prefix, logits_at=[-1])
        picked = math.ceil(ratio * 210)
        assert (fused.recomputed_tokens, fused.computed_tokens) == (picked, gaps + picked)
        # layer 0 computes every non-prefix token, later ones the gaps and the picked tokens
        assert fused.token_layers == (30 * (gaps + picked) + (210 - picked) if ratio else 30 * gaps)
        assert set(range(len(ids) - len(rag["sep"]) - 20, len(ids))) <= set(fused.selected)  # the gaps
        p, q = torch.log_softmax(full.logits[0], -1), torch.log_softmax(fused.logits[0], -1)
        kls.append(float((p.exp() * (p - q)).sum()))
    assert kls[2] < kls[0], kls  # recomputing brings the next-token distribution closer to full prefill


def test_a_caller_priority_picks_the_recomputed_tokens(engine: FuseEngine, rag: dict) -> None:
    ids = rag["prompt"]
    segments = _segments(engine, rag)
    prefix = engine.prefill(rag["header"]).kv
    wanted = list(range(rag["starts"]["a"] + 40, rag["starts"]["a"] + 72))  # 32 of document a's tokens
    priority = torch.zeros(len(ids))
    priority[wanted] = 1.0
    fused = engine.fuse(ids, segments, ratio=32 / 210, prefix_kv=prefix, priority=priority)
    reused = {p for s in segments for p in range(s.start, s.start + s.kv.shape[2])}
    assert fused.recomputed_tokens == 32
    assert sorted(set(fused.selected) & reused) == wanted
    deviation = engine.fuse(ids, segments, ratio=32 / 210, prefix_kv=prefix)
    assert sorted(set(deviation.selected) & reused) != wanted  # the check layer's own pick differs
    with pytest.raises(ValueError, match="priority has shape"):
        engine.fuse(ids, segments, ratio=0.15, priority=torch.zeros(3))


def test_a_fused_kv_serves_as_an_ordinary_prefix(engine: FuseEngine, rag: dict) -> None:
    ids, tail = rag["prompt"], [13, 284, 260]
    fused = engine.fuse(ids, _segments(engine, rag), ratio=1.0, prefix_kv=engine.prefill(rag["header"]).kv)
    later = engine.extend(fused.kv, tail)
    whole = engine.prefill(ids + tail, logits_at=[-3, -2, -1])
    assert later.kv.shape[2] == len(ids) + 3
    assert torch.allclose(later.logits, whole.logits, atol=0.1)
    assert torch.equal(later.logits.argmax(-1), whole.logits.argmax(-1))


def test_bad_arguments_are_refused(engine: FuseEngine, rag: dict) -> None:
    ids = rag["prompt"]
    with pytest.raises(ConfigError, match="ratio"):
        engine.fuse(ids, [], ratio=1.5)
    with pytest.raises(ConfigError, match="check_layer"):
        engine.fuse(ids, [], ratio=0.5, check_layer=0)
    seg = ReusedSegment(5, 5, engine.empty_kv(10))
    with pytest.raises(ValueError, match="overlaps"):
        engine.fuse(ids, [seg, ReusedSegment(10, 10, engine.empty_kv(10))], ratio=0.0)
    with pytest.raises(ValueError, match="overlaps"):
        engine.fuse(ids, [seg], ratio=0.0, prefix_kv=engine.empty_kv(8))
