"""Trace determinism: the fingerprint the harness checks follows the token ids, nothing else."""

from __future__ import annotations

import numpy as np
from kvshrink.benchmarks.agent_trace import RagConfig, TraceConfig, generate, generate_rag
from kvshrink.benchmarks.comparison import trace_fingerprint

SMALL = dict(sessions=4, turns=3, concurrency=2, system_tokens=600, tokens_per_turn=200)


def test_same_seed_same_trace_and_fingerprint() -> None:
    a, b = generate(TraceConfig(seed=3, **SMALL)), generate(TraceConfig(seed=3, **SMALL))
    assert trace_fingerprint(a) == trace_fingerprint(b)
    assert all(np.array_equal(x.token_ids, y.token_ids) for x, y in zip(a, b, strict=True))


def test_any_change_to_the_trace_changes_the_fingerprint() -> None:
    base = generate(TraceConfig(seed=3, **SMALL))
    assert trace_fingerprint(base) != trace_fingerprint(generate(TraceConfig(seed=4, **SMALL)))
    assert trace_fingerprint(base) != trace_fingerprint(base[::-1])  # order matters
    one_token = list(base)
    ids = one_token[-1].token_ids.copy()
    ids[-1] ^= 1
    one_token[-1] = type(base[-1])(**{**vars(base[-1]), "token_ids": ids})
    assert trace_fingerprint(base) != trace_fingerprint(one_token)


def test_rag_mode_is_deterministic_and_reorders_shared_documents() -> None:
    cfg = RagConfig(requests=24, documents=6, doc_tokens=300, docs_per_request=3, seed=1)
    a, b = generate_rag(cfg), generate_rag(cfg)
    assert trace_fingerprint(a) == trace_fingerprint(b)
    assert trace_fingerprint(a) != trace_fingerprint(generate_rag(RagConfig(**{**vars(cfg), "seed": 2})))
    positions: dict[int, set[int]] = {}
    texts: dict[int, bytes] = {}
    for req in a:
        assert len(set(req.doc_ids)) == cfg.docs_per_request
        for doc, (start, end) in zip(req.doc_ids, req.doc_spans, strict=True):
            chunk = req.token_ids[start:end].tobytes()
            assert texts.setdefault(doc, chunk) == chunk  # a document is the same tokens everywhere
            positions.setdefault(doc, set()).add(start)
    assert any(len(p) > 1 for p in positions.values())  # ... at different offsets: non-prefix reuse
