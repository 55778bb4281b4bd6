"""The routing logic against a real index service, a silent server and a closed port.

production-stack's router is not installable from the package registries CI uses, so these tests
call the logic exactly as ``vllm_router`` does (``await route_request(endpoints, engine_stats,
request_stats, request, request_json)``, verified on its source) with objects carrying the same
attributes as its ``EndpointInfo`` / ``RequestStats`` / ``EngineStats`` and a real Starlette request.
``test_index_vllm_e2e.py::test_production_stack_router_routes_by_index`` runs the real router where
it is installed (``KVSHRINK_ROUTER_PYTHON``).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass, field

import pytest
from starlette.requests import Request

from index_helpers import MODEL, make_config
from kvshrink.index.hashing import prefix_hashes
from kvshrink.testing.launch import free_port
from kvshrink.plugins.router.router_logic import KVShrinkRoutingLogic, backend_loads, lookup_body, rendezvous

URLS = ["http://127.0.0.1:18001", "http://127.0.0.1:18002", "http://127.0.0.1:18003"]
PROMPT = list(range(300, 300 + 512))


@dataclass
class Endpoint:  # the attributes vllm_router's EndpointInfo has and the logic reads
    url: str
    model_names: list[str] = field(default_factory=lambda: [MODEL])


@dataclass
class RequestStats:
    in_prefill_requests: int = 0
    in_decoding_requests: int = 0
    qps: float = 0.0


@dataclass
class EngineStats:
    num_running_requests: int = 0
    num_queuing_requests: int = 0


def make_request(headers: dict[str, str] | None = None) -> Request:
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    return Request(scope)


def route(logic, body, endpoints=None, request=None, request_stats=None, engine_stats=None):
    endpoints = [Endpoint(u) for u in URLS] if endpoints is None else endpoints
    return asyncio.run(logic.route_request(endpoints, engine_stats or {}, request_stats or {},
                                           request or make_request(), body))


@pytest.fixture
def index_with_cache(start_index):
    cfg = make_config(zmq=False, instances=[{"id": f"i{k}", "url": u, "models": [MODEL]} for k, u in enumerate(URLS)])
    server = start_index(cfg)
    state = server.state
    with state.lock:
        hashes = prefix_hashes(PROMPT, MODEL, 16)
        state.index.store(state.feed(state.registry.get("i1"), "t"), hashes, hashes, 0)  # i1 holds all of it
        state.index.store(state.feed(state.registry.get("i2"), "t"), hashes[:8], hashes[:8], 0)
        state.note_block_size(MODEL, 16)
    return server


def test_index_answer_wins(index_with_cache):
    logic = KVShrinkRoutingLogic(index_with_cache.url, timeout_s=2.0, session_key="x-session-id")
    assert route(logic, {"model": MODEL, "prompt": PROMPT}) == URLS[1]
    # the router's own load view reaches the index: i1 swamped -> the next best (i2) wins
    stats = {URLS[0]: RequestStats(1, 1), URLS[1]: RequestStats(10, 10), URLS[2]: RequestStats(1, 0)}
    assert route(logic, {"model": MODEL, "prompt": PROMPT}, request_stats=stats) == URLS[2]
    # failover: the router calls again without the backend that failed
    assert route(logic, {"model": MODEL, "prompt": PROMPT}, endpoints=[Endpoint(URLS[0]), Endpoint(URLS[2])]) \
        == URLS[2]
    assert logic.decisions["index"] == 3 and not logic.index_failures


class SilentServer:
    """Accepts TCP connections and never answers: an index that hangs."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self._stop = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                continue

    def close(self) -> None:
        self._stop = True
        self.thread.join()
        for c in self.conns:
            c.close()
        self.sock.close()


def test_slow_index_times_out_then_is_skipped_for_backoff():
    silent = SilentServer()
    try:
        logic = KVShrinkRoutingLogic(silent.url, timeout_s=0.05, session_key="x-session-id", backoff_s=30.0)
        body = {"model": MODEL, "prompt": PROMPT}
        req = make_request({"x-session-id": "user-42"})
        started = time.perf_counter()
        first = route(logic, body, request=req)
        first_s = time.perf_counter() - started
        assert first == rendezvous("user-42", URLS) and logic.decisions["session"] == 1
        assert logic.index_failures["timeout"] == 1 and first_s < 1.0
        started = time.perf_counter()
        assert route(logic, body, request=req) == first  # same session, same backend
        assert time.perf_counter() - started < 0.04  # backoff: the silent index is not asked again
        assert logic.index_failures["timeout"] == 1
    finally:
        silent.close()


def test_index_down_falls_back_to_session_then_least_loaded():
    logic = KVShrinkRoutingLogic(f"http://127.0.0.1:{free_port()}", timeout_s=0.5, session_key="session_id",
                                 backoff_s=0.0)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "session_id": "abc"}
    assert route(logic, body) == rendezvous("abc", URLS)  # session id from the body key
    stats = {URLS[0]: RequestStats(3, 1), URLS[1]: RequestStats(0, 1), URLS[2]: RequestStats(2, 2)}
    assert route(logic, {"model": MODEL, "prompt": "no session"}, request_stats=stats) == URLS[1]
    engine = {URLS[0]: EngineStats(0, 0), URLS[1]: EngineStats(5, 5), URLS[2]: EngineStats(1, 0)}
    assert route(logic, {"model": MODEL, "prompt": "no session"}, engine_stats=engine) == URLS[0]
    assert logic.index_failures["unreachable"] == 3
    assert logic.decisions == {"session": 1, "least_loaded": 2}


def test_index_errors_and_unknown_backends_fall_back(start_index):
    server = start_index(make_config(zmq=False))  # knows none of the router's backends
    logic = KVShrinkRoutingLogic(server.url, timeout_s=30.0, backoff_s=0.0)  # the 422 path imports transformers
    assert route(logic, {"model": MODEL, "prompt": [1, 2, 3]}) == URLS[0]
    assert logic.index_failures["no_known_backend"] == 1
    assert route(logic, {"model": MODEL, "prompt": "needs a tokenizer the index lacks"}) == URLS[0]
    assert logic.index_failures["http_422"] == 1
    # nothing to look up (batched prompts): straight to the fallback, the index is not asked
    assert route(logic, {"model": MODEL, "prompt": ["a", "b"]}) == URLS[0]
    assert sum(logic.index_failures.values()) == 2
    with pytest.raises(ValueError):
        route(logic, {"model": MODEL, "prompt": [1]}, endpoints=[])


def test_helpers():
    assert lookup_body({"prompt": "x"}, "m") == {"model": "m", "prompt": "x"}
    # token ids travel as little-endian uint32 bytes (a msgpack binary: one copy for the index)
    assert lookup_body({"prompt": [1, 2]}, "m") == {"model": "m", "token_bytes": b"\x01\0\0\0\x02\0\0\0"}
    assert lookup_body({"prompt": [[1], [2]]}, "m") is None
    assert lookup_body({"prompt": [1, -2]}, "m") is None and lookup_body({"prompt": [2**32]}, "m") is None
    assert lookup_body({"prompt": [1.5]}, "m") is None and lookup_body({"prompt": []}, "m") is None
    loads = backend_loads(URLS, {URLS[1]: EngineStats(2, 3)}, {URLS[0]: RequestStats(1, 1)})
    assert loads == {URLS[0]: 2.0, URLS[1]: 5.0, URLS[2]: 0.0}
    keys = [f"s{i}" for i in range(300)]
    before = {k: rendezvous(k, URLS) for k in keys}
    after = {k: rendezvous(k, URLS[:2]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == URLS[2] for k in moved)  # only the removed backend's sessions move
    assert 60 < len(moved) < 140
