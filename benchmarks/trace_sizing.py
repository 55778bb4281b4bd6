"""How many agent sessions and turns the e2e replay can afford on this machine, from its measured speeds.

The replay sends every request of the trace to every stack at every budget, so its cost is the
trace's cost times ``stacks x budgets``; what one request costs depends on the machine more than
on anything else (vLLM CPU prefills bf16 ~20x faster with AMX than on AVX2 alone). So the e2e
harness measures this machine first -- cold prefill at two or three prompt lengths, the fixed
cost of a request that prefills nothing, what a loaded token and a stored token add, the wait
between stacks -- and :func:`size_trace` picks the largest trace of the requested shape (every
session grows to the requested context length) whose predicted cost fits the time left.

The prediction needs how much of each request a cache serves. It models no eviction policy: a
request is assumed to hit ``hit_share`` of what an unbounded prefix cache would serve it
(:func:`e2e_paired.reusable_tokens`, exact for the trace) and to prefill the rest. The default
share (0.5) is a guess that errs towards misses: the replays so far, at budgets of 45-55 % of the
working set, hit 0.75-1.0 of the ceiling; these budgets are smaller (25-45 %).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

# a 50-request replay gave hit-rate intervals about +-7 points wide and prefill-ratio intervals
# about +-0.12 (docs/bench/notes.md): fewer requests cannot clear a +10-point / 0.80x target
MIN_DECISIVE_REQUESTS = 48
SESSIONS = (2, 16)  # the working set is sessions x context x 23 KB: 16 sessions of 8K tokens hold 3 GB of KV
TURNS = (3, 16)  # mean turns a session takes to reach its context length
PREFERRED_MIN_SESSIONS = 4  # below four sessions the requests of a replay are few sessions' worth


@dataclass(frozen=True)
class Speeds:
    """What one request costs on this machine (seconds), as measured on the e2e stacks."""

    cold: tuple[tuple[int, float], ...]  # (prompt tokens, TTFT with nothing cached)
    fixed_s: float  # TTFT of a request that prefills nothing (warm from LMCache's L1)
    load_s_per_token: float = 0.0  # TTFT added per token loaded from an L2 tier
    store_s_per_token: float = 0.0  # wall time after the answer until a prefilled token is stored
    overhead_s: float = 0.0  # wall time per request outside TTFT and stores (waits for other stacks' engines)
    per_budget_s: float = 30.0  # restarting every cache server for the next budget

    def prefill_coefficients(self) -> tuple[float, float]:
        """(b, c) of ``prefill(n) = b n + c n^2`` over the cold points minus the fixed cost: a
        least-squares fit, attention making the cost grow faster than the tokens; never negative."""
        n = np.array([p for p, _ in self.cold], dtype=float)
        t = np.array([max(0.0, s - self.fixed_s) for _, s in self.cold])
        if n.size == 0:
            raise ValueError("no cold prefill measured")
        if n.size >= 2:
            (b, c), *_ = np.linalg.lstsq(np.stack([n, n * n], axis=1), t, rcond=None)
            if b >= 0 and c >= 0:
                return float(b), float(c)
        b = float((n * t).sum() / (n * n).sum())  # one point, or a fit that bends the wrong way: linear
        return max(b, 0.0), 0.0

    def prefill_s(self, tokens: float) -> float:
        b, c = self.prefill_coefficients()
        return b * tokens + c * tokens * tokens

    def cold_s(self, tokens: float) -> float:
        return self.fixed_s + self.prefill_s(tokens)

    def request_s(self, prompt: int, hit: int) -> float:
        """Wall time of one request on one stack: TTFT (fixed + load of the hit + prefill of the
        rest, which attends over the whole prompt) + storing what it prefilled + the waits."""
        ttft = self.fixed_s + self.load_s_per_token * hit + self.prefill_s(prompt) - self.prefill_s(hit)
        return ttft + self.store_s_per_token * (prompt - hit) + self.overhead_s


@dataclass
class Choice:
    """The trace the replay runs, what it is predicted to cost, and why."""

    trace: dict[str, Any]
    requests: int
    prompt_tokens: int
    predicted_s: float
    budget_s: float
    stacks: int
    budgets: int
    hit_share: float
    speeds: dict[str, Any]
    why: str = ""
    warnings: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.predicted_s <= self.budget_s

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fits": self.fits}


def predicted_s(requests: Sequence[Any], speeds: Speeds, stacks: int, budgets: int, chunk_tokens: int,
                hit_share: float = 0.5) -> float:
    """Seconds a replay of ``requests`` takes on ``stacks`` stacks at ``budgets`` budgets."""
    from kvshrink.benchmarks.e2e_paired import reusable_tokens

    reusable = reusable_tokens(requests, chunk_tokens)
    one_pass = 0.0
    for r, can in zip(requests, reusable):
        hit = int(can * hit_share) // chunk_tokens * chunk_tokens
        one_pass += speeds.request_s(len(r.token_ids), hit)
    return budgets * (speeds.per_budget_s + stacks * one_pass)


def _shape(base: dict[str, Any], sessions: int, turns: int) -> dict[str, Any]:
    return {**base, "sessions": sessions, "turns": turns, "concurrency": sessions}  # every session in flight


def _cost(base: dict[str, Any], sessions: int, turns: int, speeds: Speeds, stacks: int, budgets: int,
          chunk_tokens: int, hit_share: float) -> tuple[float, list[Any]]:
    from kvshrink.benchmarks.agent_trace import TraceConfig, generate

    requests = generate(TraceConfig(**_shape(base, sessions, turns)))  # random ids: same shape as the real text
    return predicted_s(requests, speeds, stacks, budgets, chunk_tokens, hit_share), requests


def size_trace(base: dict[str, Any], speeds: Speeds, stacks: int, budgets: int, budget_s: float, chunk_tokens: int,
               hit_share: float = 0.5, sessions: tuple[int, int] = SESSIONS, turns: tuple[int, int] = TURNS,
               min_requests: int = MIN_DECISIVE_REQUESTS) -> Choice:
    """The trace of shape ``base`` (a :class:`agent_trace.TraceConfig` mapping whose sessions grow
    to ``context_tokens``) with the most requests whose predicted replay fits ``budget_s``; among
    equals, more sessions. Below :data:`PREFERRED_MIN_SESSIONS` sessions, or shorter contexts
    (halved, down to 2K), only when nothing else fits; none fitting at all, the cheapest, with a
    warning. A warning too when the choice has fewer than ``min_requests`` requests."""
    contexts = [base["context_tokens"]]
    while contexts[-1] // 2 >= 2048:
        contexts.append(contexts[-1] // 2)
    floors = sorted({max(sessions[0], PREFERRED_MIN_SESSIONS), sessions[0]}, reverse=True)
    tried, best, context = 0, None, contexts[0]
    for context in contexts:
        for floor in floors:
            for t in range(turns[0], turns[1] + 1):
                found = _most_sessions({**base, "context_tokens": context}, t, floor, sessions[1], speeds, stacks,
                                       budgets, budget_s, chunk_tokens, hit_share)
                tried += 1
                if found is not None:
                    cost, requests = found
                    key = (len(requests), len({r.session_id for r in requests}))
                    if best is None or key > best[0]:
                        best = (key, t, cost, requests)
            if best is not None:
                break
        if best is not None:
            break
    warnings: list[str] = []
    if best is None:  # nothing fits: the cheapest trace of the shortest context
        context = contexts[-1]
        shape = {**base, "context_tokens": context}
        cost, requests = _cost(shape, sessions[0], turns[0], speeds, stacks, budgets, chunk_tokens, hit_share)
        best = ((len(requests), len({r.session_id for r in requests})), turns[0], cost, requests)
        warnings.append(f"the time budget ({budget_s / 60:.1f} min) buys no replay of this shape: even the smallest "
                        f"({sessions[0]} sessions to {context} tokens) is predicted at {cost / 60:.1f} min")
    (_, n_sessions), n_turns, cost, requests = best
    if n_sessions < PREFERRED_MIN_SESSIONS:
        warnings.append(f"{n_sessions} sessions: fewer than {PREFERRED_MIN_SESSIONS} fit the time budget, so the "
                        "replay's requests are few sessions' worth")
    trace = _shape({**base, "context_tokens": context}, n_sessions, n_turns)
    if context < base["context_tokens"]:
        warnings.append(f"contexts shortened to {context} tokens (requested {base['context_tokens']}): no trace "
                        f"that reaches the requested length fits {budget_s / 60:.1f} min")
    if len(requests) < min_requests:
        warnings.append(f"{len(requests)} requests: fewer than the {min_requests} an interval needs to decide a "
                        f"+10-point / 0.80x target; give the run more time (--time-budget) for a replay that decides")
    b, c = speeds.prefill_coefficients()
    why = (f"cold prefill measured {', '.join(f'{n} tokens {s:.2f} s' for n, s in speeds.cold)}; fitted "
           f"{speeds.fixed_s:.2f} s + {b * 1e3:.3f} ms/token + {c * 1e6:.4f} us/token^2 (8K cold: "
           f"{speeds.cold_s(8192):.1f} s), {speeds.overhead_s:.2f} s of waits a request; assuming each request "
           f"hits {hit_share:.0%} of what an unbounded cache would serve it, {n_sessions} sessions of ~{n_turns} "
           f"turns growing to {context} tokens ({len(requests)} requests, "
           f"{sum(len(r.token_ids) for r in requests)} prompt tokens) x {stacks} stacks x {budgets} budgets are "
           f"predicted at {cost / 60:.1f} min of the {budget_s / 60:.1f} min left: the most requests "
           f"that fit ({tried} shapes tried)")
    return Choice(trace, len(requests), int(sum(len(r.token_ids) for r in requests)), cost, budget_s, stacks, budgets,
                  hit_share, {**asdict(speeds), "prefill_b_s_per_token": b, "prefill_c_s_per_token2": c}, why, warnings)


def _most_sessions(shape: dict[str, Any], turns: int, low: int, high: int, speeds: Speeds, stacks: int, budgets: int,
                   budget_s: float, chunk_tokens: int, hit_share: float) -> tuple[float, list[Any]] | None:
    """The most sessions in ``low..high`` whose replay fits (cost grows with sessions: bisect)."""
    found = None
    while low <= high:
        mid = (low + high) // 2
        cost, requests = _cost(shape, mid, turns, speeds, stacks, budgets, chunk_tokens, hit_share)
        if cost <= budget_s:
            found, low = (cost, requests), mid + 1
        else:
            high = mid - 1
    return found


def check_trace(requests: Sequence[Any], speeds: Speeds, stacks: int, budgets: int, budget_s: float,
                chunk_tokens: int, hit_share: float = 0.5) -> Choice:
    """A trace the user chose (``--trace``): not resized, only predicted, with a warning if it does not fit."""
    cost = predicted_s(requests, speeds, stacks, budgets, chunk_tokens, hit_share)
    choice = Choice({"trace_file": True}, len(requests), int(sum(len(r.token_ids) for r in requests)), cost,
                    budget_s, stacks, budgets, hit_share, asdict(speeds),
                    f"--trace given: replayed as it is; predicted at {cost / 60:.1f} min of the {budget_s / 60:.1f} "
                    "min left")
    if not choice.fits:
        choice.warnings.append(f"the given trace is predicted at {cost / 60:.1f} min, over the {budget_s / 60:.1f} "
                               "min left for the replay: the run will take longer than its time budget")
    if len(requests) < MIN_DECISIVE_REQUESTS:
        choice.warnings.append(f"{len(requests)} requests: fewer than the {MIN_DECISIVE_REQUESTS} an interval needs "
                               "to decide")
    return choice


def tiers_allowance_s(speeds: Speeds, prompt_tokens: int = 4096, pairs: int = 10, rows: int = 8,
                      startup_s: float = 450.0) -> float:
    """What the tiers section after e2e is expected to take: its stacks' start-up, three cold
    prefills of its prompt, and ``pairs`` warm requests per side for each of its ``rows``.

    ``startup_s`` (its stacks' starts, restarts and the device rows' page-cache drops, which no
    prefill speed predicts) is what full runs measured: the section took 666 s on the AVX-512
    EPYC, 434 s more than this model's prefills and warm requests at that run's speeds, and 672 s
    on the AMX Xeon; 240 s left the replay ~3.2 min that the run then spent over its budget."""
    warm = speeds.fixed_s + speeds.load_s_per_token * prompt_tokens + speeds.overhead_s
    return startup_s + 3 * speeds.cold_s(prompt_tokens) + rows * pairs * 2 * warm


def default_time_budget_min(cpu_flags: Sequence[str]) -> float:
    """The whole ``kvshrink bench``'s default time: 25 minutes where the CPU has AMX (fast bf16
    prefill), 40 where it has AVX2 alone (bf16 emulated, ~20x slower)."""
    return 25.0 if "amx_bf16" in cpu_flags else 40.0

