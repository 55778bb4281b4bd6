"""Prefetch hints over HTTP, inside ``lmcache server``: "session S resumes with these token ids".

An agent framework calls this when a tool finishes (or the router when it has chosen the
instance); the chunks of that prefix then move from SSD / Redis up to the store's DRAM tier
(:meth:`TieredStore.prefetch <kvshrink.store.tiered.TieredStore.prefetch>`) before vLLM looks the
request up, so the load that follows reads DRAM. Loaded as a server module::

    lmcache server ... --l2-adapter '{"type": "plugin", ... KVShrinkL2Adapter ...}'
        --server-module '{"module_path": "kvshrink.storage_backends.prefetch_hints",
                          "config": {"port": 8210}}'

(``kvshrink cache serve`` adds that flag from the ``hints`` section of its YAML).

Why a server module and not a listener of the adapter: the chunk keys must be exactly LMCache's,
and only the server holds what makes them — its ``token_hasher`` (chunk size, hash algorithm and
seed given on its command line) and the layouts engines registered (object groups, world size).
A server module is handed that context by LMCache's documented ``--server-module`` hook, is
closed by the server before the L2 adapters (so no hint reaches a closed store), and needs no
patch. LMCache's own admin HTTP app (``/cache/prefetches``) has no authentication and warms L1
only once an engine registered a layout; this endpoint works before that and honours our token
model. Its RPC envelope is ZMQ, not HTTP, so the module runs its own small HTTP listener.

HTTP API (JSON; errors are ``{"error": code, "field": name-or-null, "detail": text}``):

``POST /v1/prefetch``  ``{"token_ids": [int, ...], "session_id"?: str, "model_name"?: str,
                        "world_size"?: int (1), "cache_salt"?: str ("")}``
                       → 202 ``{"session_id", "chunks", "keys", "queued", "skipped", "dropped"}``.
                       ``model_name`` (the engine's ``--served-model-name`` / model path, as LMCache
                       keys name it) may be left out when the module's ``model_name`` is set.
                       Fire and forget: the reply
                       comes once the chunks are queued, not moved. 400 names the bad field,
                       401 without the bearer token, 413 over ``max_body_bytes`` /
                       ``max_tokens``, 503 when the server has no KVShrink L2 adapter (or is
                       closing it).
``GET /v1/prefetch/stats``  the hint counters and the store's ``prefetch_*`` counters.
                       The hint counters are also on the server's ``/metrics``
                       (``kvshrink_prefetch_<counter>_total``, e.g. ``kvshrink_prefetch_hints_total``),
                       the store's as ``kvshrink_store_engine_prefetch_*``.
``GET /healthz``       liveness (never authenticated).

Auth, as the KVShrink index (:mod:`kvshrink.index.app`): bound to loopback by default; with
``auth_token`` (or ``auth_token_env``) set, every endpoint but ``/healthz`` needs
``Authorization: Bearer <token>`` (constant-time compare). A ``host`` that is not loopback without
a token is refused at start (ConfigError naming ``auth_token``).

Bounds: one listener thread handles requests one at a time (socket timeout
:data:`SOCKET_TIMEOUT_S`, listen backlog :data:`BACKLOG`), so hints never queue in this process;
each hint's chunks go to the store's bounded prefetch queue, which drops (and counts) what does
not fit — 10,000 hints at once cost 10,000 short requests, never an unbounded queue.

Threads: the listener thread (``kvshrink-hints``) only hashes and enqueues; moves run on the
store's prefetch threads. Errors: configuration problems are :class:`~kvshrink.errors.ConfigError`
at start (the server does not start); a failing hint is logged and counted (``hint_errors``) and
answered 500, never raised into LMCache.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import TYPE_CHECKING, Any, Mapping

from kvshrink.config_checks import int_value, mapping_value, port_value
from kvshrink.errors import ConfigError, KVShrinkError, StoreClosedError
from kvshrink.store.metrics_export import SnapshotCollector, register, unregister

if TYPE_CHECKING:
    from lmcache.v1.multiprocess.ext_server_module import ExtServerModuleBuildContext

log = logging.getLogger(__name__)

SOCKET_TIMEOUT_S = 2.0
BACKLOG = 128
MAX_SESSION_ID = 256
_WHERE = "server_module.config"
HINT_COUNTERS = ("hints", "hint_chunks", "hints_rejected", "hints_unauthorized", "hint_errors")


@dataclass(frozen=True)
class HintSettings:
    host: str = "127.0.0.1"
    port: int = 8210
    auth_token: str | None = None
    model_name: str | None = None
    max_body_bytes: int = 8 * 2**20
    max_tokens: int = 1_048_576

    @classmethod
    def from_config(cls, data: Mapping[str, Any], where: str = _WHERE) -> "HintSettings":
        """Validate the module's ``config``; ConfigError names ``<where>.<key>``."""
        data = mapping_value(data, where, {"host", "port", "auth_token", "auth_token_env", "model_name",
                                           "max_body_bytes", "max_tokens"})
        d = cls()
        host = data.get("host", d.host)
        if not isinstance(host, str) or not host:
            raise ConfigError(f"{where}.host", f"expected a bind address, got {host!r}")
        port = 0 if data.get("port") == 0 else port_value(data.get("port", d.port), f"{where}.port")
        token = data.get("auth_token")
        if "auth_token_env" in data:
            name = data["auth_token_env"]
            token = os.environ.get(str(name)) or None
            if token is None:
                raise ConfigError(f"{where}.auth_token_env", f"environment variable {name} is not set")
        if token is not None and (not isinstance(token, str) or not token):
            raise ConfigError(f"{where}.auth_token", "expected a non-empty string")
        if token is None and not _loopback(host):
            raise ConfigError(f"{where}.auth_token", f"required when host is not loopback (host {host!r}): "
                                                     "hints move data and cost I/O")
        model = data.get("model_name")
        if model is not None and (not isinstance(model, str) or not model):
            raise ConfigError(f"{where}.model_name", f"expected a model name, got {model!r}")
        return cls(host=host, port=port, auth_token=token, model_name=model,
                   max_body_bytes=int_value(data.get("max_body_bytes", d.max_body_bytes), f"{where}.max_body_bytes",
                                            minimum=1),
                   max_tokens=int_value(data.get("max_tokens", d.max_tokens), f"{where}.max_tokens", minimum=1))


class HintRefused(KVShrinkError):
    """A hint answered with an HTTP error: ``status``, ``code``, the ``field`` at fault."""

    def __init__(self, status: int, code: str, detail: str, field: str | None = None) -> None:
        super().__init__(detail)
        self.status, self.code, self.field, self.detail = status, code, field, detail


@dataclass(frozen=True)
class Hint:
    token_ids: list[int]
    session_id: str
    model_name: str | None
    world_size: int
    cache_salt: str


def parse_hint(body: bytes, max_tokens: int) -> Hint:
    """A validated hint body; :class:`HintRefused` (400 / 413) naming the field otherwise."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise HintRefused(400, "bad_request", f"body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise HintRefused(400, "bad_request", "body must be a JSON object")
    unknown = sorted(set(data) - {"token_ids", "session_id", "model_name", "world_size", "cache_salt"})
    if unknown:
        raise HintRefused(400, "bad_request", f"unknown field {unknown[0]!r}", unknown[0])
    tokens = data.get("token_ids")
    if not isinstance(tokens, list) or not tokens:
        raise HintRefused(400, "bad_request", "required: a non-empty list of token ids", "token_ids")
    if len(tokens) > max_tokens:
        raise HintRefused(413, "too_many_tokens", f"{len(tokens)} token ids > max_tokens {max_tokens}", "token_ids")
    if not all(type(t) is int and 0 <= t < 2**32 for t in tokens):
        raise HintRefused(400, "bad_request", "every token id must be an integer in [0, 2**32)", "token_ids")
    session = data.get("session_id", "")
    if not isinstance(session, str) or len(session) > MAX_SESSION_ID:
        raise HintRefused(400, "bad_request", f"expected a string of at most {MAX_SESSION_ID} characters",
                          "session_id")
    model = data.get("model_name")
    if model is not None and (not isinstance(model, str) or not model or "@" in model):
        raise HintRefused(400, "bad_request", "expected a model name without '@'", "model_name")
    world = data.get("world_size", 1)
    if type(world) is not int or not 1 <= world <= 4096:
        raise HintRefused(400, "bad_request", "expected an integer in 1..4096", "world_size")
    salt = data.get("cache_salt", "")
    if not isinstance(salt, str) or "@" in salt:
        raise HintRefused(400, "bad_request", "expected a string without '@'", "cache_salt")
    return Hint(tokens, session, model, world, salt)


class PrefetchHintModule:
    """The server module: an HTTP listener turning hints into store prefetches."""

    def __init__(self, ctx: Any, settings: HintSettings) -> None:
        self._ctx = ctx
        self.settings = settings
        self.counters: Counter[str] = Counter(dict.fromkeys(HINT_COUNTERS, 0))
        self._lock = threading.Lock()
        self._server = _Listener((settings.host, settings.port), _handler_for(self))
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvshrink-hints", daemon=True)
        self._thread.start()
        self._collector = SnapshotCollector("kvshrink_prefetch", self._counts, HINT_COUNTERS, what="prefetch hint")
        register(self._collector)
        log.info("prefetch hints listening on http://%s:%d/v1/prefetch%s", settings.host, self.port,
                 " (bearer token required)" if settings.auth_token else "")

    # -- EngineModule -------------------------------------------------------------------------------
    @property
    def context(self) -> Any:
        return self._ctx

    def report_status(self) -> dict:
        return {"kvshrink_prefetch_hints": {"url": f"http://{self.settings.host}:{self.port}/v1/prefetch",
                                            **self._counts()}}

    def close(self) -> None:
        unregister(self._collector)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    # -- requests -----------------------------------------------------------------------------------
    def hint(self, hint: Hint) -> dict[str, Any]:
        """Queue the prefetch of ``hint``'s chunks on every KVShrink adapter of this server."""
        from kvshrink.storage_backends.mp_l2_adapter import live_adapters

        adapters = live_adapters()
        if not adapters:
            raise HintRefused(503, "no_store", "this server has no KVShrink L2 adapter")
        model = self._model(hint)
        keys, chunks = self._object_keys(hint, model)
        totals = Counter()
        for adapter in adapters:
            try:
                result = adapter.prefetch(keys).result
            except StoreClosedError as exc:  # the server is shutting down
                raise HintRefused(503, "store_closed", str(exc)) from None
            totals.update(queued=result.queued, skipped=result.skipped, dropped=result.dropped)
        self._count(hints=1, hint_chunks=chunks)
        return {"session_id": hint.session_id, "model_name": model, "chunks": chunks, "keys": len(keys),
                "queued": totals["queued"], "skipped": totals["skipped"], "dropped": totals["dropped"]}

    def stats(self) -> dict[str, Any]:
        from kvshrink.storage_backends.mp_l2_adapter import live_adapters

        store: Counter[str] = Counter()
        for adapter in live_adapters():
            store.update({k: v for k, v in adapter.store_stats()["engine"].items() if k.startswith("prefetch_")})
        return {**self._counts(), "store": dict(store)}

    def _model(self, hint: Hint) -> str:
        if hint.model_name is not None:
            return hint.model_name
        if self.settings.model_name is not None:
            return self.settings.model_name
        raise HintRefused(400, "bad_request", "required (the hint module has no default model_name)", "model_name")

    def _object_keys(self, hint: Hint, model: str) -> tuple[list[Any], int]:
        """LMCache's ObjectKeys for the hint's full chunks, prefix order (chunk by chunk: every
        object group the model registered, else group 0; every kv rank)."""
        from lmcache.v1.distributed.api import ipc_key_to_object_keys
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        hashes = self._ctx.token_hasher.compute_chunk_hashes(hint.token_ids)
        if not hashes:
            return [], 0
        groups = self._ctx.layout_desc_registry.find_group_layout_descs(model, hint.world_size) or {0: None}
        ipc_key = IPCCacheServerKey(model_name=model, world_size=hint.world_size, worker_id=None,
                                    token_ids=(), start=0, end=0, request_id="", cache_salt=hint.cache_salt)
        try:
            per_group = ipc_key_to_object_keys(ipc_key, hashes, sorted(groups))
        except ValueError as exc:
            raise HintRefused(400, "bad_request", str(exc), "cache_salt") from None
        ranks = len(per_group[0]) // len(hashes)
        keys = [k for i in range(len(hashes)) for group in per_group for k in group[i * ranks:(i + 1) * ranks]]
        return keys, len(hashes)

    def _count(self, **amounts: int) -> None:
        with self._lock:
            self.counters.update(amounts)

    def _counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)


class _Listener(HTTPServer):
    request_queue_size = BACKLOG
    allow_reuse_address = True

    def server_bind(self) -> None:
        if ":" in self.server_address[0]:
            import socket

            self.address_family = socket.AF_INET6
            self.socket = socket.socket(self.address_family, self.socket_type)
        super().server_bind()


def _handler_for(module: PrefetchHintModule) -> type[BaseHTTPRequestHandler]:
    settings = module.settings
    expected = f"Bearer {settings.auth_token}".encode() if settings.auth_token else None

    class Handler(BaseHTTPRequestHandler):
        timeout = SOCKET_TIMEOUT_S
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def _serve(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            try:
                if path == "/healthz" and method == "GET":
                    return self._reply(200, {"status": "ok"})
                if path not in ("/v1/prefetch", "/v1/prefetch/stats"):
                    raise HintRefused(404, "not_found", f"no endpoint {path}")
                if expected is not None and not hmac.compare_digest(
                        self.headers.get("authorization", "").encode(), expected):
                    module._count(hints_unauthorized=1)
                    raise HintRefused(401, "unauthorized", "missing or wrong bearer token")
                if path == "/v1/prefetch/stats":
                    if method != "GET":
                        raise HintRefused(405, "method_not_allowed", "use GET")
                    return self._reply(200, module.stats())
                if method != "POST":
                    raise HintRefused(405, "method_not_allowed", "use POST")
                return self._reply(202, module.hint(parse_hint(self._body(), settings.max_tokens)))
            except HintRefused as exc:
                if exc.status != 401:
                    module._count(hints_rejected=1)
                self._reply(exc.status, {"error": exc.code, "field": exc.field, "detail": exc.detail})
            except Exception as exc:  # noqa: BLE001 - answered and counted; LMCache's server must live on
                module._count(hint_errors=1)
                log.exception("prefetch hint failed")
                self._reply(500, {"error": "internal", "field": None, "detail": str(exc)})

        def _body(self) -> bytes:
            try:
                length = int(self.headers.get("content-length", ""))
            except ValueError:
                raise HintRefused(411, "length_required", "a Content-Length header is required") from None
            if length > settings.max_body_bytes:
                raise HintRefused(413, "body_too_large", f"{length} bytes > max_body_bytes {settings.max_body_bytes}")
            return self.rfile.read(length)

        def _reply(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            if status >= 400:
                self.send_header("connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            log.debug("hint %s", format % args)

    return Handler


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_server_modules(build: "ExtServerModuleBuildContext") -> PrefetchHintModule:
    """The ``--server-module`` factory LMCache calls (``factory_name`` default)."""
    return PrefetchHintModule(build.server_context, HintSettings.from_config(build.config))
