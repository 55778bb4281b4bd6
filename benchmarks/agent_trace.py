"""Synthetic agent trace: many interleaved multi-turn sessions whose context keeps growing.

Shape (token ids, not text; deterministic for a seed)::

    turn 1 prompt = system prompt + tool definitions (shared by every session using that agent)
                    + first user message
    turn k prompt = turn k-1 prompt + turn k-1 assistant output + tool output + user message

so every prompt extends the previous prompt of its session, and all sessions of an agent share the
same opening ``system_tokens`` tokens. ``concurrency`` sessions are in flight at once: each slot
runs sessions back to back, and turns of different slots interleave by their arrival time
(previous turn's nominal duration + a think / tool time). Consumers may replay ``arrival_s``
open-loop, or use ``think_s`` to issue a session's next turn after its previous one finished
(closed loop).

    from kvshrink.benchmarks.agent_trace import TraceConfig, generate
    for req in generate(TraceConfig(sessions=64, turns=8, seed=1)):
        req.token_ids, req.max_tokens, req.session_id, req.turn
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class TraceConfig:
    sessions: int = 256
    turns: int = 12  # mean turns per session (each session draws 0.5x..1.5x)
    tokens_per_turn: int = 600  # mean tool output + user message tokens appended per turn
    concurrency: int = 64  # sessions in flight at once
    seed: int = 0
    system_tokens: int = 3000  # shared system prompt + tool definitions per agent
    agents: int = 2  # distinct system prompts; a session uses one
    output_tokens: int = 150  # mean assistant tokens per turn (appended to the next prompt)
    first_user_tokens: int = 300
    vocab_size: int = 49152
    think_s: float = 2.0  # mean tool / user time between a reply and the next turn
    nominal_turn_s: float = 3.0  # assumed turn duration, only to lay out arrival_s
    # when set, every session grows to exactly this many positions: its last prompt + that turn's
    # max_tokens fills the model's context (tokens_per_turn is then unused; each session spreads
    # the growth over its own turns, at least two)
    context_tokens: int = 0


@dataclass(frozen=True)
class AgentRequest:
    session_id: int
    turn: int  # 0-based
    agent: int
    token_ids: np.ndarray = field(repr=False)  # int32, the whole prompt
    new_tokens: int  # tokens appended since the previous turn's prompt (whole prompt on turn 0)
    shared_tokens: int  # leading tokens shared with every session of the same agent
    reply_tokens: int  # how many of the new tokens are the previous turn's assistant reply (0 on turn 0)
    max_tokens: int  # assistant tokens to generate (the trace appends its own to the next prompt)
    arrival_s: float  # open-loop arrival time
    think_s: float  # wait after the previous turn of this session completed (closed loop)
    last_turn: bool

    @property
    def prompt_tokens(self) -> int:
        return int(self.token_ids.size)


def _jitter(rng: np.random.Generator, mean: float, spread: float = 0.5) -> int:
    return max(1, int(round(mean * rng.uniform(1 - spread, 1 + spread))))


class _Tokens:
    """Where fresh tokens come from: uniform random ids, or consecutive slices of a tokenized text
    (``text``), so that a model sees real language and its KV is what real prompts make."""

    def __init__(self, rng: np.random.Generator, vocab_size: int, text: np.ndarray | None) -> None:
        self.rng, self.vocab_size = rng, vocab_size
        self.text = None if text is None else np.asarray(text, dtype=np.int32)
        if self.text is not None and self.text.size < 1024:
            raise ValueError(f"text_tokens holds {self.text.size} tokens; a trace needs at least 1024")
        self.cursor = 0

    def draw(self, n: int) -> np.ndarray:
        ids = self.rng.integers(0, self.vocab_size, n, dtype=np.int32)  # drawn either way: same shape, same times
        if self.text is None:
            return ids
        out = np.take(self.text, np.arange(self.cursor, self.cursor + n), mode="wrap")
        self.cursor = (self.cursor + n) % self.text.size
        return out


def _growth(rng: np.random.Generator, cfg: TraceConfig, n_turns: int, first: int) -> tuple[list[int], list[int]]:
    """Assistant tokens per turn and tool-output tokens appended after each turn but the last, so
    that the last prompt plus its assistant tokens is exactly ``cfg.context_tokens``: agents run
    until their context is full, however many turns that takes."""
    outs = [_jitter(rng, cfg.output_tokens) for _ in range(n_turns)]
    room = cfg.context_tokens - outs[-1] - first - sum(outs[:-1])
    if room < n_turns - 1:
        raise ValueError(f"context_tokens={cfg.context_tokens} leaves no room to grow a {first}-token first prompt "
                         f"over {n_turns} turns")
    weights = rng.uniform(0.5, 1.5, n_turns - 1)
    tools = [max(1, int(room * w / weights.sum())) for w in weights]
    tools[-1] += room - sum(tools)
    if tools[-1] < 1:
        raise ValueError(f"context_tokens={cfg.context_tokens} is too short for {n_turns} turns")
    return outs, tools + [0]


def generate_sessions(cfg: TraceConfig, text_tokens: np.ndarray | None = None) -> list[list[AgentRequest]]:
    """Every session's turns in order (arrival times laid out by slot). With ``text_tokens`` every
    fresh run of tokens is the next slice of that text instead of random ids (same shape, same
    arrival times)."""
    if min(cfg.sessions, cfg.turns, cfg.concurrency, cfg.agents) < 1:
        raise ValueError("sessions, turns, concurrency and agents must be >= 1")
    rng = np.random.default_rng(cfg.seed)
    tokens = _Tokens(rng, cfg.vocab_size, text_tokens)
    systems = [tokens.draw(cfg.system_tokens) for _ in range(cfg.agents)]
    slot_clock = [float(rng.uniform(0, cfg.nominal_turn_s)) for _ in range(cfg.concurrency)]
    sessions: list[list[AgentRequest]] = []
    for sid in range(cfg.sessions):
        slot = sid % cfg.concurrency
        agent = int(rng.integers(cfg.agents))
        n_turns = _jitter(rng, cfg.turns)
        prompt = np.concatenate([systems[agent], tokens.draw(_jitter(rng, cfg.first_user_tokens))])
        sizes = None
        if cfg.context_tokens:
            n_turns = max(2, n_turns)
            sizes = _growth(rng, cfg, n_turns, prompt.size)
        new, reply = prompt.size, 0
        turns = []
        for turn in range(n_turns):
            think = float(rng.exponential(cfg.think_s)) if turn else 0.0
            slot_clock[slot] += think
            out = sizes[0][turn] if sizes else _jitter(rng, cfg.output_tokens)
            turns.append(AgentRequest(sid, turn, agent, prompt, new, cfg.system_tokens, reply, out, slot_clock[slot],
                                      think, turn == n_turns - 1))
            slot_clock[slot] += cfg.nominal_turn_s
            if sizes and turn == n_turns - 1:
                break  # (the random-size path draws one more append, unused, as it always has)
            reply_ids = tokens.draw(out)  # before the tool output's size: the random-size path's draw order
            appended = np.concatenate([reply_ids, tokens.draw(sizes[1][turn] if sizes else
                                                              _jitter(rng, cfg.tokens_per_turn))])
            new, reply = appended.size, out
            prompt = np.concatenate([prompt, appended])
        sessions.append(turns)
    return sessions


def generate(cfg: TraceConfig, text_tokens: np.ndarray | None = None) -> list[AgentRequest]:
    """All requests, interleaved by arrival time (``text_tokens``: see :func:`generate_sessions`)."""
    return sorted((r for s in generate_sessions(cfg, text_tokens) for r in s),
                  key=lambda r: (r.arrival_s, r.session_id))


def summarize(requests: list[AgentRequest]) -> dict:
    prompt = np.array([r.prompt_tokens for r in requests])
    # tokens no cache can serve: what each turn appends besides the previous reply (whose KV the
    # engine computed while decoding), the private part of first turns, and each agent's shared
    # prefix the first time it is seen
    fresh = sum(r.new_tokens - r.reply_tokens - (r.shared_tokens if r.turn == 0 else 0) for r in requests)
    fresh += sum(r.shared_tokens for r in {r.agent: r for r in requests if r.turn == 0}.values())
    return {"requests": len(requests), "sessions": len({r.session_id for r in requests}),
            "prompt_tokens_total": int(prompt.sum()), "prompt_tokens_mean": float(prompt.mean()),
            "prompt_tokens_max": int(prompt.max()),
            "reusable_fraction": float(1 - fresh / prompt.sum())}  # hit rate of an ideal infinite cache
