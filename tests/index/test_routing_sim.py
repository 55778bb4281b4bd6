"""The agent trace generator and a small run of the routing simulation (figures: benchmarks/routing_sim)."""

from __future__ import annotations

import numpy as np

from kvshrink.benchmarks.agent_trace import TraceConfig, generate, generate_sessions, summarize
from kvshrink.benchmarks.routing_policies import make_policies
from kvshrink.benchmarks.routing_sim import SimConfig, check_target, simulate


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


def test_small_simulation_runs_every_policy():
    trace = TraceConfig(sessions=24, turns=4, tokens_per_turn=300, concurrency=8, seed=0, system_tokens=1024,
                        output_tokens=60)
    sim = SimConfig(instances=4, gpu_tokens=4096, dram_tokens=8192, ssd_tokens=16384)
    sessions = generate_sessions(trace)
    results = {p.name: simulate(p, sessions, trace, sim, progress=False)
               for p in make_policies(["roundrobin", "session", "kvaware", "ours"], sim.instances, 0, sim.block, None)}
    assert all(r.requests == sum(len(s) for s in sessions) for r in results.values())
    assert results["ours"].hit_rate > results["roundrobin"].hit_rate + 0.1
    assert results["ours"].load_balance < results["kvaware"].load_balance
    assert results["ours"].lookup_p99_ms is not None
    assert isinstance(check_target(list(results.values())), list)
