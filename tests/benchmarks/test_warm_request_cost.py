"""The fixed cost of a warm request, against real vLLM CPU + a real ``lmcache server`` with our adapter.

Issue 28: every short TTFT of the paired benchmark was ~0.15-0.3 s or ~0.8-0.9 s, on every stack.
The ~0.6 s step was the benchmark's own doing: vLLM CPU's worker busy-polls its step queue for 1 s
after each step and every stack's worker is pinned to the same core, so a request sent within that
second of another stack's request shared the core with a spinning neighbour. The harness now waits
for its neighbours' engines to go idle (``Stack.wait_neighbours_quiet``, unit-tested below).

The end-to-end test pins what is left: one stack, the bench's own ``Stack`` harness, the same
512-token prompt again and again (from LMCache's L1, and from our adapter with L1 cleared),
interleaved with requests that hit nothing (16 fresh tokens: the engine's fixed cost of a
request). A warm request may cost more than one that hits nothing only by the load of its chunks:
the medians may differ by at most half the step, on any CPU, since both are measured in the same
run, interleaved, under the same load.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

import numpy as np
import pytest

from kvshrink.benchmarks import e2e_paired as ep

STEP_S = 0.6  # the step issue 28 found
MARGIN_S = STEP_S / 2  # warm median - miss median must stay under this
PROMPT_TOKENS = 512  # four 128-token chunks; ~1-2 s cold on 2 AVX2 cores, ~0.3 s with AMX
ROUNDS = 5


def _miss_prompt() -> list[int]:
    """16 never-seen tokens: under one chunk, so nothing is looked up, loaded or stored."""
    return np.random.default_rng(uuid.uuid4().int & 0xFFFFFFFF).integers(1000, 40000, 16).tolist()


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_warm_request_costs_little_more_than_one_that_hits_nothing(tmp_path) -> None:
    from kvshrink.benchmarks.suite_sections import cpu_info
    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    started = time.monotonic()
    print(f"\ncpu: {cpu_info()}")
    model = ensure_checkpoint()
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    stack = ep.Stack("ours", ep.OURS, tmp_path, log_dir, chunk_tokens=128)
    try:
        stack.launch_cache(ep.hot_arrangement(ep.OURS, stack.workdir, stack.shm_name, l1_mib=64, template=None))
        stack.server.wait_healthy()
        stack.launch_vllm(model)
        stack.wait_ready()
        prompt = ep.hot_prompt(model, PROMPT_TOKENS)
        cold = stack.request(prompt)
        stack.wait_idle()
        samples: dict[str, list[ep.Sample]] = {"miss": [], "warm_l1": [], "warm_ours": []}
        # L1 first: a chunk LMCache loads from an L2 is not kept in its L1 afterwards
        for label, clear_l1 in (("warm_l1", False), ("warm_ours", True)):
            for _ in range(ROUNDS):
                samples["miss"].append(stack.request(_miss_prompt()))
                stack.wait_idle()
                if clear_l1:
                    stack.clear_l1()  # then our adapter's DRAM tier serves it
                samples[label].append(stack.request(prompt))
                stack.wait_idle()
    finally:
        stack.close()

    medians = {k: statistics.median(x.ttft_s for x in xs) for k, xs in samples.items()}
    print(f"cold {cold.ttft_s:.3f} s; " + "; ".join(
        f"{k} median {medians[k]:.3f} s {[round(x.ttft_s, 3) for x in xs]}" for k, xs in samples.items()))
    print(f"test ran {time.monotonic() - started:.0f} s")
    cached = PROMPT_TOKENS // 128 * 128
    assert cold.hit_tokens == 0 and all(x.hit_tokens == 0 for x in samples["miss"])
    assert all(x.l1_hit_tokens >= cached - 128 for x in samples["warm_l1"]), samples["warm_l1"]
    assert all(x.l2_hit_tokens >= cached - 128 for x in samples["warm_ours"]), samples["warm_ours"]
    for label in ("warm_l1", "warm_ours"):
        extra = medians[label] - medians["miss"]
        assert extra < MARGIN_S, (f"{label}: a warm request costs {extra:.3f} s more than one that hits nothing "
                                  f"(median {medians[label]:.3f} vs {medians['miss']:.3f} s); bound {MARGIN_S} s")


# -- the harness's wait for idle neighbours, without any server ---------------------------------------
class _Engine:
    running = True
    proc = None


def _stack(tmp_path, key: str, cpu: list[float] | None = None) -> ep.Stack:
    """A Stack whose 'vLLM' is alive and whose engine CPU counter reads ``cpu`` one value per call."""
    stack = ep.Stack(key, ep.STOCK, tmp_path, tmp_path, 128)
    stack.vllm = _Engine()
    readings = iter(cpu or [])
    last = [0.0]

    def engine_cpu_s() -> float:
        last[0] = next(readings, last[0])
        return last[0]

    stack.engine_cpu_s = engine_cpu_s  # type: ignore[method-assign]
    ep.Stack._live.add(stack)
    return stack


@pytest.fixture
def live_stacks():
    made: list[Any] = []
    yield made
    for stack in made:
        ep.Stack._live.discard(stack)


def test_a_stack_waits_while_a_neighbour_engine_spins(tmp_path, live_stacks) -> None:
    me = _stack(tmp_path, "me")
    spinning = [0.1 * i for i in range(6)]  # a full core for five windows, then idle
    live_stacks += [me, _stack(tmp_path, "spinner", spinning)]
    waited = me.wait_neighbours_quiet()
    assert 5 * ep.QUIET_WINDOW_S <= waited < 5 * ep.QUIET_WINDOW_S + 1.0, waited


def test_a_stack_with_idle_or_no_neighbours_barely_waits(tmp_path, live_stacks) -> None:
    me = _stack(tmp_path, "me")
    live_stacks.append(me)
    assert me.wait_neighbours_quiet() == 0.0
    live_stacks.append(_stack(tmp_path, "idle", [5.0, 5.001]))
    assert me.wait_neighbours_quiet() < ep.QUIET_WINDOW_S + 0.5


def test_a_neighbour_that_never_idles_is_waited_for_only_until_the_timeout(tmp_path, live_stacks) -> None:
    me = _stack(tmp_path, "me")
    live_stacks += [me, _stack(tmp_path, "busy", [0.1 * i for i in range(1000)])]
    assert 0.5 <= me.wait_neighbours_quiet(timeout=0.5) < 1.5


def test_stopped_neighbours_are_not_waited_for(tmp_path, live_stacks) -> None:
    me = _stack(tmp_path, "me")
    gone = _stack(tmp_path, "gone", [0.1 * i for i in range(1000)])
    gone.vllm.running = False  # type: ignore[union-attr]
    live_stacks += [me, gone]
    assert me.wait_neighbours_quiet() == 0.0
