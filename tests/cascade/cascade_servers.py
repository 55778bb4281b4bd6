"""Real HTTP servers for the cascade tests: any ASGI app under uvicorn on a loopback port in a
thread, and a stand-in for vLLM's OpenAI server that records the exact bytes it received.

The stand-in is a test double of vLLM (a real HTTP server, no mocks in the proxy): it answers
``/v1/chat/completions`` and ``/v1/completions`` with a JSON completion, or with an SSE stream of
``STREAM_CHUNKS`` chunks when the body asks ``"stream": true`` (each next chunk only once the test
releases the one before, or after 10 s), and with the status and body a request's
``x-stub-status`` / ``x-stub-body`` headers ask for.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from kvshrink.testing.launch import LOOPBACK, free_port
from kvshrink.testing.polling import poll_until

STREAM_CHUNKS = 3
RELEASE_WAIT_S = 10.0


@contextmanager
def serving(app: object) -> Iterator[str]:
    """``app`` served on a free loopback port until the block ends; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=LOOPBACK, port=port, log_level="warning", access_log=False,
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, name=f"test-uvicorn-{port}", daemon=True)
    thread.start()
    poll_until(lambda: server.started or not thread.is_alive(), 30, interval=0.02, what=f"uvicorn on {port}")
    assert server.started, f"uvicorn on port {port} did not start"
    try:
        yield f"http://{LOOPBACK}:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Upstream:
    """What the stand-in received, and the switches of its SSE stream."""

    received: list[Received] = field(default_factory=list)
    sent_chunks: int = 0
    release: list[threading.Event] = field(default_factory=lambda: [threading.Event() for _ in range(STREAM_CHUNKS)])

    def last_json(self) -> dict:
        return json.loads(self.received[-1].body)


def upstream_app(state: Upstream) -> FastAPI:
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def answer(request: Request, path: str) -> Response:
        body = await request.body()
        state.received.append(Received(request.method, request.url.path, dict(request.headers), body))
        if "x-stub-status" in request.headers:
            return Response(request.headers.get("x-stub-body", "").encode(),
                            status_code=int(request.headers["x-stub-status"]), media_type="application/json")
        if request.method == "GET":
            return Response(json.dumps({"object": "list", "data": [{"id": "stub"}]}), media_type="application/json")
        if json.loads(body).get("stream"):
            return StreamingResponse(_sse(state), media_type="text/event-stream")
        return Response(json.dumps({"id": "cmpl-1", "choices": [{"index": 0, "text": "ok"}]}),
                        media_type="application/json")

    return app


def sse_chunk(i: int) -> bytes:
    return f"data: {json.dumps({'id': 'cmpl-1', 'choices': [{'index': 0, 'text': f'tok{i}'}]})}\n\n".encode()


async def _sse(state: Upstream) -> AsyncIterator[bytes]:
    for i in range(STREAM_CHUNKS):
        state.sent_chunks = i + 1
        yield sse_chunk(i)
        await asyncio.to_thread(state.release[i].wait, RELEASE_WAIT_S)
    yield b"data: [DONE]\n\n"
