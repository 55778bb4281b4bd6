"""``kvshrink bench --trace FILE``: a user's JSONL trace is validated line by line and replayed
through the same capacity replay (real LMCache in-process storage stack) as the built-in trace."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from kvshrink.benchmarks import capacity_replay as cr
from kvshrink.benchmarks.agent_trace import TraceConfig, generate
from kvshrink.benchmarks.comparison import OURS, STOCK, trace_fingerprint
from kvshrink.benchmarks.user_trace import TraceError, load_trace, write_trace
from kvshrink.errors import KVShrinkError

GOOD = {"arrival_s": 0.0, "session_id": "a", "token_ids": [1, 2, 3]}


def _write(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not a JSON object"),
    ("[1, 2]", "expected a JSON object"),
    ({"session_id": "a", "token_ids": [1]}, "missing required field 'arrival_s'"),
    ({"arrival_s": 1.0, "token_ids": [1]}, "missing required field 'session_id'"),
    ({**GOOD, "arrival_s": -1}, "arrival_s must be a finite number >= 0"),
    ({**GOOD, "arrival_s": "soon"}, "arrival_s must be a finite number"),
    ({**GOOD, "session_id": [1]}, "session_id must be a string or an integer"),
    ({**GOOD, "token_ids": []}, "token_ids must be a non-empty list"),
    ({**GOOD, "token_ids": [1, "2"]}, "token id '2' is not an integer in \\[0, 49152\\)"),
    ({**GOOD, "token_ids": [49152]}, "token id 49152 is not an integer"),
    ({**GOOD, "text": "hello"}, "give exactly one of token_ids or text"),
    ({"arrival_s": 0, "session_id": "a"}, "give exactly one of token_ids or text"),
    ({**GOOD, "max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({**GOOD, "max_token": 5}, "unknown field\\(s\\) max_token"),
])
def test_a_malformed_line_is_rejected_with_its_line_number(tmp_path: Path, bad: object, message: str) -> None:
    path = _write(tmp_path, GOOD, "", GOOD, bad)  # the bad request is on line 4 (line 2 is blank)
    with pytest.raises(TraceError, match=f"trace.jsonl:4: {message}") as caught:
        load_trace(path)
    assert isinstance(caught.value, KVShrinkError)


def test_an_empty_or_missing_trace_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no requests"):
        load_trace(_write(tmp_path, ""))
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "absent.jsonl")


def test_turns_are_numbered_per_session_in_arrival_order(tmp_path: Path) -> None:
    path = _write(tmp_path,
                  {"arrival_s": 5.0, "session_id": "b", "token_ids": [7, 8, 9, 10], "max_tokens": 3},
                  {"arrival_s": 1.0, "session_id": "a", "token_ids": [1, 2, 3]},
                  {"arrival_s": 9.0, "session_id": "a", "token_ids": [1, 2, 3, 4, 5]},
                  {"arrival_s": 2.0, "session_id": 7, "token_ids": [4]})
    reqs = load_trace(path)
    assert [(r.session_id, r.turn, r.arrival_s) for r in reqs] == [(0, 0, 1.0), (1, 0, 2.0), (2, 0, 5.0), (0, 1, 9.0)]
    last = reqs[-1]
    assert last.new_tokens == 2 and last.think_s == 8.0 and last.last_turn and not reqs[0].last_turn
    assert reqs[2].max_tokens == 3 and reqs[0].max_tokens == 64
    assert reqs[0].token_ids.dtype == np.int32


def test_text_lines_are_tokenized_by_the_model_tokenizer(tmp_path: Path) -> None:
    path = _write(tmp_path, {"arrival_s": 0, "session_id": 1, "text": "The capital of France is"})
    tokens = load_trace(path, tokenizer=lambda text: [len(w) for w in text.split()])[0].token_ids
    assert tokens.tolist() == [3, 7, 2, 6, 2]
    real = load_trace(path)[0].token_ids  # SmolLM2's own tokenizer, from the fixture checkpoint
    assert 3 <= real.size <= 8 and real.max() < 49152


def test_a_small_valid_trace_replays_like_the_same_built_in_trace(tmp_path: Path) -> None:
    """Written out and read back, a built-in trace replays to the same figures on both sides."""
    built_in = generate(TraceConfig(sessions=3, turns=3, concurrency=2, system_tokens=600,
                                    tokens_per_turn=300, output_tokens=40, seed=2))
    path = tmp_path / "trace.jsonl"
    write_trace(path, built_in)
    loaded = load_trace(path)
    assert trace_fingerprint(loaded) == trace_fingerprint(built_in)
    settings = cr.ReplaySettings(pool_chunks=4, retrieve_batch=4, full_verify=True)
    pool = cr.chunk_pool(settings.pool_chunks)
    budget = cr.Budget(dram_mib=96, ssd_mib=32)
    for side in (STOCK, OURS):
        ran = cr.run_side(side, budget, loaded, pool, settings)
        again = cr.run_side(side, budget, built_in, pool, settings)
        assert ran.workload == again.workload
        assert ran.figures["chunk_hit_rate"] == again.figures["chunk_hit_rate"] > 0


def test_kvshrink_bench_trace_refuses_a_malformed_file_before_running(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = _write(tmp_path, GOOD, {**GOOD, "token_ids": "1 2 3"})
    done = subprocess.run([sys.executable, "-m", "kvshrink.cli", "bench", "--trace", str(path), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "trace.jsonl:2: token_ids must be a non-empty list of integers" in done.stderr
    assert not (tmp_path / "out").exists()  # nothing ran


def test_the_suite_sections_take_the_users_trace_instead_of_the_generator(tmp_path: Path) -> None:
    from kvshrink.benchmarks.suite_sections import PRESETS, Context

    path = _write(tmp_path, GOOD, {**GOOD, "arrival_s": 3.0, "token_ids": [1, 2, 3, 4]})
    ctx = Context(mode="quick", out_dir=tmp_path, store_template=tmp_path, threads=1, bar=None, trace=path)
    requests, figures = ctx.requests(PRESETS["quick"]["capacity"]["trace"])
    assert [r.token_ids.tolist() for r in requests] == [[1, 2, 3], [1, 2, 3, 4]]
    assert figures["file"] == str(path) and figures["requests"] == 2
    built_in, _ = Context(mode="quick", out_dir=tmp_path, store_template=tmp_path, threads=1, bar=None).requests(
        PRESETS["quick"]["capacity"]["trace"])
    assert len(built_in) > 2
