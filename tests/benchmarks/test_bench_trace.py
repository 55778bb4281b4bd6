"""Trace determinism: the fingerprint the harness checks follows the token ids, nothing else."""

from __future__ import annotations

import numpy as np
from kvshrink.benchmarks.agent_trace import TraceConfig, generate, generate_sessions, summarize
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


def test_trace_shape_and_determinism():
    cfg = TraceConfig(sessions=12, turns=5, tokens_per_turn=200, concurrency=4, seed=3, system_tokens=500, agents=2)
    sessions = generate_sessions(cfg)
    again = generate_sessions(cfg)
    assert all(np.array_equal(a.token_ids, b.token_ids) for s, t in zip(sessions, again) for a, b in zip(s, t))
    other = generate_sessions(TraceConfig(**{**cfg.__dict__, "seed": 4}))
    assert not np.array_equal(sessions[0][0].token_ids, other[0][0].token_ids)
    for turns in sessions:
        for prev, cur in zip(turns, turns[1:]):
            n = prev.prompt_tokens
            assert np.array_equal(cur.token_ids[:n], prev.token_ids)  # context only grows
            assert cur.new_tokens == cur.prompt_tokens - n and cur.reply_tokens == prev.max_tokens
            assert cur.arrival_s > prev.arrival_s
        assert turns[-1].last_turn and not any(t.last_turn for t in turns[:-1])
    by_agent: dict[int, list] = {}
    for turns in sessions:
        by_agent.setdefault(turns[0].agent, []).append(turns[0].token_ids[:cfg.system_tokens])
    for prefixes in by_agent.values():  # sessions of one agent share its system prompt + tools
        assert all(np.array_equal(p, prefixes[0]) for p in prefixes)
    requests = generate(cfg)
    first_sessions = [r.session_id for r in requests[:8]]
    assert len(set(first_sessions)) > 2  # sessions interleave
    summary = summarize(requests)
    assert summary["requests"] == sum(len(s) for s in sessions) and 0.5 < summary["reusable_fraction"] < 1


def test_text_tokens_make_every_fresh_run_real_text_and_keep_the_shape() -> None:
    text = np.arange(100_000, 160_000, dtype=np.int32)  # stands for a tokenized corpus: every id distinct
    cfg = TraceConfig(sessions=5, turns=3, concurrency=2, system_tokens=300, tokens_per_turn=100, seed=2)
    random, real = generate(cfg), generate(cfg, text_tokens=text)
    assert [(r.session_id, r.turn, r.prompt_tokens) for r in random] == [(r.session_id, r.turn, r.prompt_tokens)
                                                                         for r in real]
    ids = np.concatenate([r.token_ids for r in real])
    assert ids.min() >= 100_000 and ids.max() < 160_000  # nothing drawn from the vocabulary
    first = real[0].token_ids
    assert np.all(np.diff(first) == 1)  # a fresh run is a consecutive slice of the text
    sessions = {r.session_id: r for r in real if r.turn == 0}
    private = [r.token_ids[cfg.system_tokens:] for r in sessions.values()]
    assert len({p[:10].tobytes() for p in private}) == len(private)  # sessions read different text
