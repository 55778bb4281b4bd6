"""HTTP API of the index service (FastAPI).

==============================  =====================================================================
``POST /lookup``                ``{"model", "token_ids" | "token_bytes" | "prompt" | "messages", "loads"?,
                                "instances"?}`` (``token_bytes``: the ids as little-endian uint32, the
                                cheapest form for long prompts)
                                → ``{"model", "prompt_tokens", "block_sizes", "elapsed_ms", "instances":
                                [{"instance_id", "url", "matched_tokens", "tiers": {"gpu", "dram", "ssd",
                                "remote"}, "weighted_tokens", "load", "score", "overloaded"}]}`` best first.
                                ``loads`` maps instance id or URL → queue length + running requests and
                                overrides scraped loads; ``instances`` restricts the answer to those ids/URLs.
``POST /events``                tier events from LMCache / our adapter (schema in ``tier_events``).
``POST /instances``             register ``{"id", "url"?, "models"?, "replay_endpoint"?, "events_endpoint"?,
                                "aliases"?}``; LMCache's registrar shape (``instance_id``, ``ip``,
                                ``http_port``) is accepted too, so an ``lmcache server --coordinator-url``
                                pointing here registers, heartbeats and reports its cache events.
``POST|PUT /instances/{id}/heartbeat``  ``{"load"?: float}`` or empty: keeps it alive, sets its load.
``DELETE /instances/{id}``      forget an instance and its blocks.
``GET /instances``, ``/stats``  what the index holds.
``GET /metrics``                Prometheus exposition.   ``GET /healthz`` liveness (never authenticated).
==============================  =====================================================================

Request bodies are JSON, or msgpack with ``Content-Type: application/msgpack`` (same fields).
With a bearer token configured, every endpoint but ``/healthz`` (and ``/metrics`` if
``metrics_require_auth`` is false) needs ``Authorization: Bearer <token>``. Bodies above
``max_body_bytes`` or prompts above ``max_request_tokens`` are refused (413). Bad requests get a
4xx with a message and are counted in ``kvshrink_index_http_rejected``; they change nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvshrink.errors import ConfigError, CorruptDataError, KVShrinkError
from kvshrink.index import scraper, tier_events
from kvshrink.index.config import IndexConfig
from kvshrink.index.registry import RegistryFullError
from kvshrink.index.scoring import lookup
from kvshrink.index.state import IndexState
from kvshrink.index.subscriber import KVEventSubscriber
from kvshrink.index.tokenize import Tokenizers

logger = logging.getLogger(__name__)


class LookupRequest(msgspec.Struct):
    model: str
    token_ids: list[int] | None = None
    token_bytes: bytes | None = None  # the ids as little-endian uint32: base64 in JSON, bin in msgpack
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    loads: dict[str, float] | None = None
    instances: list[str] | None = None


class RegisterRequest(msgspec.Struct):
    id: str = ""
    instance_id: str = ""  # LMCache's registrar (``--coordinator-url``) sends this, with ip / http_port
    ip: str | None = None
    http_port: int | None = None
    url: str | None = None
    models: list[str] = []
    replay_endpoint: str | None = None
    events_endpoint: str | None = None
    aliases: list[str] = []


class HeartbeatRequest(msgspec.Struct):
    load: float | None = None


class HTTPRefusal(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


def _json(data: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(data), status_code=status, media_type="application/json")


def create_app(config: IndexConfig, *, start_subscriber: bool = True) -> FastAPI:
    """The service; ``app.state.index`` is its :class:`IndexState`, ``app.state.subscriber`` its ZMQ side."""
    state = IndexState(config)
    token = config.resolved_token()
    tokenizers = Tokenizers(config.tokenizers)
    subscriber = None
    if start_subscriber and (config.zmq.bind or config.zmq.connect or any(i.events_endpoint for i in config.instances)):
        connects = list(config.zmq.connect) + [i.events_endpoint for i in config.instances if i.events_endpoint]
        subscriber = KVEventSubscriber(state, config.zmq.bind, connects, config.zmq.replay_timeout_s, config.zmq.rcvhwm)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks = [asyncio.create_task(_housekeeping(state))]
        for model in config.tokenizers:  # load configured tokenizers now, not on the first lookup
            tasks.append(asyncio.create_task(asyncio.to_thread(tokenizers.get, model)))
        if config.scrape_interval_s > 0:
            tasks.append(asyncio.create_task(
                scraper.scrape_forever(state, config.scrape_interval_s, config.scrape_timeout_s)))
        if subscriber is not None:
            subscriber.start()
            state.on_new_events_endpoint = subscriber.connect
            logger.info("KV events: bound %s", subscriber.bound)
        freeze_gc()
        try:
            yield
        finally:
            gc.unfreeze()  # at exit, the interpreter's last collections see everything again
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if subscriber is not None:
                subscriber.stop()

    app = FastAPI(title="kvshrink index", lifespan=lifespan)
    app.state.index = state
    app.state.subscriber = subscriber
    metrics = state.metrics

    async def read(request: Request, endpoint: str, struct: type | None = None) -> Any:
        if token is not None and (endpoint != "metrics" or config.metrics_require_auth):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                raise HTTPRefusal(401, "unauthorized", "missing or wrong bearer token")
        if struct is None:
            return None
        body = await _read_capped(request, config.max_body_bytes)
        msgpack = "msgpack" in request.headers.get("content-type", "")
        try:
            return (msgspec.msgpack if msgpack else msgspec.json).decode(body, type=struct)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise HTTPRefusal(400, "bad_request", f"invalid body: {exc}") from exc

    @app.exception_handler(HTTPRefusal)
    async def _refused(request: Request, exc: HTTPRefusal) -> Response:
        metrics.rejected.labels(request.url.path.split("/")[1] or "root", exc.reason).inc()
        return _json({"error": exc.message}, exc.status)

    @app.post("/lookup")
    async def post_lookup(request: Request) -> Response:
        # The lookup runs inline on the event loop: it is ~1 ms of GIL-bound work, which a worker
        # thread would not parallelise, and the hop (to_thread) would add two thread switches.
        req: LookupRequest = await read(request, "lookup", LookupRequest)
        forms = ("token_ids", "token_bytes", "prompt", "messages")
        given = [name for name in forms if getattr(req, name) is not None]
        if len(given) != 1:
            raise HTTPRefusal(400, "bad_request", "give exactly one of token_ids, token_bytes, prompt, messages")
        token_ids = req.token_ids if req.token_bytes is None else req.token_bytes
        if req.token_bytes is not None and len(req.token_bytes) % 4:
            raise HTTPRefusal(400, "bad_request", "token_bytes length is not a multiple of 4")
        try:
            if req.prompt is not None:
                token_ids = await asyncio.to_thread(tokenizers.encode_prompt, req.model, req.prompt)
            elif req.messages is not None:
                token_ids = await asyncio.to_thread(tokenizers.encode_messages, req.model, req.messages)
        except ConfigError as exc:
            raise HTTPRefusal(422, "no_tokenizer", str(exc)) from exc
        except (TypeError, ValueError, KeyError) as exc:
            raise HTTPRefusal(400, "bad_request", f"cannot tokenize: {exc}") from exc
        n_tokens = len(token_ids) // 4 if isinstance(token_ids, bytes) else len(token_ids)
        if n_tokens > config.max_request_tokens:
            raise HTTPRefusal(413, "too_many_tokens", f"{n_tokens} tokens > max_request_tokens "
                                                      f"{config.max_request_tokens}")
        try:
            result = lookup(state, req.model, token_ids, req.loads, req.instances)
        except CorruptDataError as exc:
            raise HTTPRefusal(400, "bad_request", str(exc)) from exc
        return _json(result)

    @app.post("/events")
    async def post_events(request: Request) -> Response:
        await read(request, "events")
        body = await _read_capped(request, config.max_body_bytes)
        try:
            parsed = tier_events.decode_request(body, request.headers.get("content-type"))
        except CorruptDataError as exc:
            raise HTTPRefusal(400, "bad_request", str(exc)) from exc
        result = tier_events.apply_request(state, parsed)
        return _json({"applied": result.applied, "entries": result.entries, "dropped": result.dropped})

    @app.post("/instances")
    async def post_instance(request: Request) -> Response:
        req: RegisterRequest = await read(request, "instances", RegisterRequest)
        instance_id = req.id or req.instance_id or (f"{req.ip}:{req.http_port}" if req.ip and req.http_port else "")
        if not instance_id or "@" in instance_id:
            raise HTTPRefusal(400, "bad_request", "instance id must be non-empty and without '@'")
        with state.lock:
            known = state.registry.get(instance_id)
        try:
            inst = state.register(instance_id, url=req.url, models=set(req.models),
                                  replay_endpoint=req.replay_endpoint, events_endpoint=req.events_endpoint,
                                  aliases=set(req.aliases))
        except RegistryFullError as exc:
            raise HTTPRefusal(507, "registry_full", str(exc)) from exc
        return _json({**inst.describe(), "instance_id": instance_id, "re_registered": known is not None})

    @app.api_route("/instances/{instance_id}/heartbeat", methods=["POST", "PUT"])
    async def post_heartbeat(instance_id: str, request: Request) -> Response:
        await read(request, "instances")
        body = await _read_capped(request, config.max_body_bytes)
        try:  # LMCache's registrar PUTs an empty body
            req = msgspec.json.decode(body, type=HeartbeatRequest) if body.strip() else HeartbeatRequest()
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise HTTPRefusal(400, "bad_request", f"invalid body: {exc}") from exc
        inst = state.heartbeat(instance_id, req.load)
        if inst is None:
            raise HTTPRefusal(404, "unknown_instance", f"no instance {instance_id!r}")
        return _json({"id": inst.instance_id, "instance_id": instance_id, "load": inst.load})

    @app.delete("/instances/{instance_id}")
    async def delete_instance(instance_id: str, request: Request) -> Response:
        await read(request, "instances")
        with state.lock:
            inst = state.registry.get(instance_id)
            if inst is None:
                raise HTTPRefusal(404, "unknown_instance", f"no instance {instance_id!r}")
            inst.static = False
            state.remove_instance(inst, "deregistered")
        return _json({"removed": instance_id})

    @app.get("/instances")
    async def get_instances(request: Request) -> Response:
        await read(request, "instances")
        return _json(state.snapshot()["instances"])

    @app.get("/stats")
    async def get_stats(request: Request) -> Response:
        await read(request, "stats")
        return _json(state.snapshot())

    @app.get("/metrics")
    async def get_metrics(request: Request) -> Response:
        await read(request, "metrics")
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json({"ok": True})

    return app


def freeze_gc() -> None:
    """Take everything alive at start-up, the block index included, out of the collector's sight.

    The block index is one ``OrderedDict`` of up to ``max_blocks`` ints: the ints are not tracked,
    but the dict is, and each collection of its generation traverses every entry — ~60 ms per
    million blocks, on whichever lookup or event batch triggers it (measured: 60 ms gen-0 pauses
    during lookups on a 500k-block index). ``gc.freeze`` moves every object alive now to a
    generation that is never collected; objects created later are collected as usual. The
    lifespan unfreezes at shutdown; until then, in a process that runs more than the service
    (tests), what existed at start-up is not collected as cyclic garbage.
    """
    gc.collect()
    gc.freeze()


async def _read_capped(request: Request, cap: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise HTTPRefusal(413, "body_too_large", f"body of {declared} bytes > max_body_bytes {cap}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise HTTPRefusal(413, "body_too_large", f"body > max_body_bytes {cap}")
        chunks.append(chunk)
    return b"".join(chunks)


async def _housekeeping(state: IndexState) -> None:
    while True:
        await asyncio.sleep(1.0)
        try:
            state.expire_silent()
        except KVShrinkError:
            logger.exception("housekeeping failed")
