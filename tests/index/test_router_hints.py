"""Router-side prefetch hints: fire and forget, bounded, and never in the request's way.

The hint endpoint here is a real HTTP server that answers slowly (a cache server under load);
``tests/storage_backends/test_prefetch_hints.py`` sends a routed request's hint to a real
``lmcache server`` and sees the chunks move."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvshrink.plugins.router.hints import HintSender, prompt_token_ids
from kvshrink.plugins.router.router_logic import KVShrinkRoutingLogic
from kvshrink.testing.launch import free_port

BACKEND = "http://127.0.0.1:18001"


@dataclass
class Endpoint:
    url: str
    model_names: list[str] = field(default_factory=lambda: ["m"])


class SlowHints:
    """A hint endpoint that takes ``delay`` seconds per request and records the bodies."""

    def __init__(self, delay: float) -> None:
        self.bodies: list[dict] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                time.sleep(delay)
                owner.bodies.append({"path": self.path, "auth": self.headers.get("authorization"), **body})
                try:
                    self.send_response(202)
                    self.send_header("content-length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the sender gave up (its deadline): that is what one test checks

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def slow():
    server = SlowHints(delay=1.0)
    yield server
    server.close()


def logic_with(hints: HintSender) -> KVShrinkRoutingLogic:
    # the index is a closed port: the request falls back to least loaded at once
    return KVShrinkRoutingLogic(f"http://127.0.0.1:{free_port()}", hints=hints, session_key="x-session-id")


def test_hints_never_delay_routing_and_beyond_the_bound_are_dropped(slow):
    hints = HintSender({BACKEND: slow.url}, token="t", max_in_flight=3, timeout_s=5.0)
    logic = logic_with(hints)

    async def scenario() -> list[float]:
        took = []
        for n in range(10):
            started = time.monotonic()
            chosen = await logic.route_request([Endpoint(BACKEND)], {}, {}, None,
                                               {"model": "m", "prompt": [n] * 300, "x-session-id": f"s{n}"})
            took.append(time.monotonic() - started)
            assert chosen == BACKEND
        assert hints.in_flight() == 3
        await logic.aclose()
        return took

    took = asyncio.run(scenario())
    assert max(took) < 0.5, f"routing waited for a hint: {took}"  # the endpoint takes 1 s per hint
    assert hints.counters == {"sent": 3, "dropped_busy": 7}
    assert sorted(b["session_id"] for b in slow.bodies) == ["s0", "s1", "s2"]
    assert {b["path"] for b in slow.bodies} == {"/v1/prefetch"} and {b["auth"] for b in slow.bodies} == {"Bearer t"}
    assert slow.bodies[0]["token_ids"] == [slow.bodies[0]["token_ids"][0]] * 300


def test_a_hint_past_its_deadline_is_counted_failed(slow):
    hints = HintSender({BACKEND: slow.url}, timeout_s=0.2)

    async def scenario() -> None:
        assert hints.send(BACKEND, {"prompt": [1, 2, 3]}, None)
        await hints.aclose()

    asyncio.run(scenario())
    assert hints.counters == {"failed": 1}


def test_requests_without_token_ids_or_cache_server_send_nothing():
    hints = HintSender({BACKEND: "http://127.0.0.1:1"})

    async def scenario() -> None:
        assert not hints.send(BACKEND, {"prompt": "text"}, None)
        assert not hints.send(BACKEND, {"messages": [{"role": "user", "content": "hi"}]}, None)
        assert not hints.send("http://elsewhere:1", {"prompt": [1]}, None)

    asyncio.run(scenario())
    assert hints.counters == {"no_token_ids": 2, "no_target": 1}
    assert prompt_token_ids({"prompt": [1, -2]}) is None and prompt_token_ids({"prompt": [[1], [2]]}) is None
    with pytest.raises(ValueError):
        HintSender({}, max_in_flight=0)
