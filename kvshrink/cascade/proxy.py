"""The cascade proxy: an OpenAI-compatible HTTP front of vLLM that condenses marked documents.

``POST /v1/chat/completions`` and ``POST /v1/completions``: the documents the marking convention
names (:mod:`kvshrink.cascade.marking`) are condensed by the small model and the request, re-encoded
as compact JSON, goes upstream; a request with nothing marked, or with ``x-kvshrink-cascade: off``,
goes upstream byte for byte as received. ``x-kvshrink-cascade-ratio: 0.3`` sets one request's
ratio. The answer is relayed as it comes (status, headers, body; an SSE stream chunk by chunk),
with ``x-kvshrink-cascade-documents`` / ``-tokens-in`` / ``-tokens-out`` added when documents were
condensed. ``GET /metrics`` is the proxy's own (vLLM's stays on vLLM's port); every other path is
relayed unchanged.

Why the small model runs in this process (torch on the CPU) instead of behind a second server:
there is no second server to start, health-check and version in step with the proxy, and the
proxy decides the batching itself: documents of concurrent requests share forward passes
(:mod:`kvshrink.cascade.service`), and a document several requests carry is condensed once.

Errors: a body the proxy cannot read is a 400 in OpenAI's error shape whose ``param`` names the
field; an upstream that cannot be reached is a 502; an upstream error status is relayed with its
body. Threads: the app runs on one event loop; the model runs on the service's worker thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from kvshrink.cascade.errors import MalformedRequestError, UpstreamUnavailableError
from kvshrink.cascade.marking import CHAT, COMPLETIONS, DEFAULT_MARKERS, find_documents
from kvshrink.cascade.service import CondenseService
from kvshrink.errors import KVShrinkError

log = logging.getLogger(__name__)

OPT_OUT_HEADER = "x-kvshrink-cascade"
RATIO_HEADER = "x-kvshrink-cascade-ratio"
_OFF = {"off", "0", "false", "no"}
# not relayed in either direction: per-connection (RFC 9110 7.6.1), or recomputed by the HTTP stack
_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
        b"transfer-encoding", b"upgrade", b"host", b"content-length"}


@dataclass(frozen=True)
class ProxyConfig:
    upstream: str  # base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:8000
    markers: tuple[str, str] = DEFAULT_MARKERS
    tool_messages: bool = True  # role "tool" contents are documents
    question_aware: bool = False  # condition on the question (better recall, but no sharing across questions)
    connect_timeout_s: float = 10.0
    read_timeout_s: float | None = 600.0  # between two chunks of the answer


def create_app(config: ProxyConfig, service: CondenseService) -> FastAPI:
    """The proxy app; ``service`` is the caller's (closed by it, after the app stops)."""
    metrics = service.metrics
    upstream = config.upstream.rstrip("/")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(config.connect_timeout_s, read=config.read_timeout_s)
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
            app.state.client = client
            yield

    app = FastAPI(title="kvshrink cascade", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(KVShrinkError)
    async def family(request: Request, exc: KVShrinkError) -> JSONResponse:
        status = getattr(exc, "status", 500)
        field = getattr(exc, "field", None)
        kind = "invalid_request_error" if status < 500 else "upstream_error" if status == 502 else "server_error"
        if status >= 500:
            log.error("cascade: %s %s: %s", request.method, request.url.path, exc)
        return JSONResponse({"error": {"message": str(exc), "type": kind, "param": field, "code": status}}, status)

    async def relay(request: Request, content: bytes, added: Sequence[tuple[bytes, bytes]] = ()) -> Response:
        headers = [(k, v) for k, v in request.headers.raw
                   if k.lower() not in _HOP and not k.lower().startswith(OPT_OUT_HEADER.encode())]
        query = f"?{request.url.query}" if request.url.query else ""
        client: httpx.AsyncClient = request.app.state.client
        outgoing = client.build_request(request.method, f"{upstream}{request.url.path}{query}", headers=headers,
                                        content=content)
        try:
            answer = await client.send(outgoing, stream=True)
        except httpx.HTTPError as exc:
            metrics.upstream_errors.labels("502").inc()
            raise UpstreamUnavailableError(f"upstream {upstream} did not answer: {type(exc).__name__}: {exc}") from exc
        if answer.status_code >= 400:
            metrics.upstream_errors.labels(str(answer.status_code)).inc()
        response = StreamingResponse(_chunks(answer), status_code=answer.status_code,
                                     background=BackgroundTask(answer.aclose))
        response.raw_headers = [(k, v) for k, v in answer.headers.raw if k.lower() not in _HOP] + list(added)
        return response

    async def condense(request: Request, endpoint: str) -> Response:
        raw = await request.body()
        if request.headers.get(OPT_OUT_HEADER, "").strip().lower() in _OFF:
            metrics.requests.labels(endpoint, "opted_out").inc()
            return await relay(request, raw)
        try:
            ratio = _ratio(request.headers.get(RATIO_HEADER))
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                raise MalformedRequestError("body", f"is not valid JSON: {exc}") from exc
            marked = find_documents(endpoint, body, config.markers, config.tool_messages)
        except MalformedRequestError:
            metrics.requests.labels(endpoint, "rejected").inc()
            raise
        if not marked.documents:
            metrics.requests.labels(endpoint, "passthrough").inc()
            return await relay(request, raw)
        futures = [service.submit(doc, question if config.question_aware else None, ratio)
                   for doc, question in zip(marked.documents, marked.questions)]
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        content = json.dumps(marked.rewrite([r.text for r in results]), ensure_ascii=False,
                             separators=(",", ":")).encode()
        metrics.requests.labels(endpoint, "condensed").inc()
        added = [(b"x-kvshrink-cascade-documents", str(len(results)).encode()),
                 (b"x-kvshrink-cascade-tokens-in", str(sum(r.tokens_in for r in results)).encode()),
                 (b"x-kvshrink-cascade-tokens-out", str(sum(r.tokens_out for r in results)).encode())]
        return await relay(request, content, added)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.post(CHAT)
    async def chat(request: Request) -> Response:
        return await condense(request, CHAT)

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await condense(request, COMPLETIONS)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def other(request: Request, path: str) -> Response:
        metrics.requests.labels("other", "relayed").inc()
        return await relay(request, await request.body())

    return app


async def _chunks(answer: httpx.Response) -> AsyncIterator[bytes]:
    """The upstream body as it arrives (undecoded: content-encoding is relayed as is)."""
    try:
        async for chunk in answer.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:  # the client sees a cut answer; say why here
        log.warning("cascade: upstream stream broke off: %s: %s", type(exc).__name__, exc)


def _ratio(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        ratio = float(value)
    except ValueError:
        ratio = float("nan")
    if not 0 < ratio <= 1:
        raise MalformedRequestError(f"{RATIO_HEADER} header", f"must be a number in (0, 1], got {value!r}")
    return ratio
