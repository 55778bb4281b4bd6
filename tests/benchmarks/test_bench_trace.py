"""Trace determinism: the fingerprint the harness checks follows the token ids, nothing else."""

from __future__ import annotations

import numpy as np
from kvshrink.benchmarks.agent_trace import TraceConfig, generate
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
