"""A user's own request trace (JSONL), replayed instead of the built-in agent-trace generator.

``kvshrink bench --trace FILE`` reads one request per line, in any order of arrival::

    {"arrival_s": 0.0, "session_id": "s1", "token_ids": [1, 9906, 11, 1917], "max_tokens": 64}
    {"arrival_s": 12.5, "session_id": "s1", "text": "...the whole prompt of turn 2...", "max_tokens": 64}

Fields (anything else on a line is an error, so a typo is never silently ignored):

* ``arrival_s`` (number >= 0, required): when the request arrives, seconds from the trace start.
* ``session_id`` (string or integer, required): requests of one session are its turns, in arrival
  order; each turn's prompt normally extends the previous one (what an agent resends).
* exactly one of ``token_ids`` (list of integers in ``[0, vocab_size)``) or ``text`` (string,
  tokenized with the benchmark model's tokenizer, no special tokens added): the *whole* prompt.
* ``max_tokens`` (integer >= 1, optional, default 64): tokens to generate.

Blank lines are skipped. Every problem is a :class:`TraceError` naming the file and line number.
Requests come back as :class:`~kvshrink.benchmarks.agent_trace.AgentRequest` in arrival order, so
every section that replays the built-in trace replays a user's trace unchanged.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from kvshrink.benchmarks.agent_trace import AgentRequest
from kvshrink.errors import KVShrinkError

FIELDS = frozenset({"arrival_s", "session_id", "token_ids", "text", "max_tokens"})
DEFAULT_MAX_TOKENS = 64
SMOLLM2_VOCAB = 49152

Tokenizer = Callable[[str], Sequence[int]]


class TraceError(KVShrinkError, ValueError):
    """A trace file that cannot be replayed; the message names the file and line."""


@dataclass(frozen=True, eq=False)
class _Line:
    lineno: int
    arrival_s: float
    session: str
    tokens: np.ndarray
    max_tokens: int


def load_trace(path: str | Path, vocab_size: int = SMOLLM2_VOCAB,
               tokenizer: Tokenizer | None = None) -> list[AgentRequest]:
    """Parse and validate ``path``; the requests in arrival order (ties keep file order).

    ``tokenizer`` turns a ``text`` line into token ids; by default the benchmark model's
    (SmolLM2) tokenizer, loaded only when a line has ``text``."""
    path = Path(path)
    try:
        raw_lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc}") from exc
    lines: list[_Line] = []
    for lineno, raw in enumerate(raw_lines, start=1):
        if raw.strip():
            if tokenizer is None and '"text"' in raw:
                tokenizer = model_tokenizer()
            lines.append(_parse_line(raw, f"{path}:{lineno}", lineno, vocab_size, tokenizer))
    if not lines:
        raise TraceError(f"{path}: the trace has no requests")
    return _as_requests(lines)


def _parse_line(raw: str, where: str, lineno: int, vocab_size: int, tokenizer: Tokenizer | None) -> _Line:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not a JSON object: {exc.msg} (column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - FIELDS)
    if unknown:
        raise TraceError(f"{where}: unknown field(s) {', '.join(unknown)} (allowed: {', '.join(sorted(FIELDS))})")
    for name in ("arrival_s", "session_id"):
        if name not in obj:
            raise TraceError(f"{where}: missing required field {name!r}")
    arrival = obj["arrival_s"]
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival) or arrival < 0:
        raise TraceError(f"{where}: arrival_s must be a finite number >= 0, got {arrival!r}")
    session = obj["session_id"]
    if isinstance(session, bool) or not isinstance(session, (str, int)):
        raise TraceError(f"{where}: session_id must be a string or an integer, got {session!r}")
    max_tokens = obj.get("max_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise TraceError(f"{where}: max_tokens must be an integer >= 1, got {max_tokens!r}")
    return _Line(lineno, float(arrival), str(session), _prompt_tokens(obj, where, vocab_size, tokenizer), max_tokens)


def _prompt_tokens(obj: dict[str, Any], where: str, vocab_size: int, tokenizer: Tokenizer | None) -> np.ndarray:
    if ("token_ids" in obj) == ("text" in obj):
        raise TraceError(f"{where}: give exactly one of token_ids or text")
    if "text" in obj:
        if not isinstance(obj["text"], str) or not obj["text"]:
            raise TraceError(f"{where}: text must be a non-empty string")
        assert tokenizer is not None  # load_trace provides one for text lines
        ids = list(tokenizer(obj["text"]))
    else:
        ids = obj["token_ids"]
        if not isinstance(ids, list) or not ids:
            raise TraceError(f"{where}: token_ids must be a non-empty list of integers")
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size), None)
        if bad is not None:
            raise TraceError(f"{where}: token id {bad!r} is not an integer in [0, {vocab_size})")
    return np.asarray(ids, dtype=np.int32)


def _as_requests(lines: list[_Line]) -> list[AgentRequest]:
    """Number sessions by first appearance and derive each turn's reuse from the previous turn."""
    ordered = sorted(lines, key=lambda line: (line.arrival_s, line.lineno))
    session_ids: dict[str, int] = {}
    turns: dict[int, list[_Line]] = {}
    for line in ordered:
        turns.setdefault(session_ids.setdefault(line.session, len(session_ids)), []).append(line)
    turn_of = {line.lineno: turn for history in turns.values() for turn, line in enumerate(history)}
    requests = []
    for line in ordered:
        sid = session_ids[line.session]
        history = turns[sid]
        turn = turn_of[line.lineno]
        previous = history[turn - 1] if turn else None
        common = _common_prefix(previous.tokens, line.tokens) if previous is not None else 0
        requests.append(AgentRequest(
            session_id=sid, turn=turn, agent=sid, token_ids=line.tokens, new_tokens=int(line.tokens.size - common),
            shared_tokens=0, reply_tokens=0, max_tokens=line.max_tokens, arrival_s=line.arrival_s,
            think_s=line.arrival_s - previous.arrival_s if previous is not None else 0.0,
            last_turn=turn == len(history) - 1))
    return requests


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def model_tokenizer() -> Tokenizer:
    """The benchmark model's tokenizer (SmolLM2, from the fixture checkpoint)."""
    from transformers import AutoTokenizer

    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    tok = AutoTokenizer.from_pretrained(str(ensure_checkpoint()))
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


def write_trace(path: str | Path, requests: Sequence[AgentRequest]) -> None:
    """Write ``requests`` in the format :func:`load_trace` reads (token ids), e.g. to edit a
    built-in trace by hand."""
    with Path(path).open("w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps({"arrival_s": r.arrival_s, "session_id": r.session_id,
                                "token_ids": r.token_ids.tolist(), "max_tokens": r.max_tokens}) + "\n")
