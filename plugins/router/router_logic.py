"""Tier-aware routing logic for vLLM production-stack's router, backed by the KVShrink index.

production-stack's router (``vllm_router``, source-only) calls a routing logic with the backends
that serve the requested model and returns the URL to forward to. Verified on its source
(commit a6c01db, ``services/request_service/request.py``): instances of ``SessionRouter`` /
``PrefixAwareRouter`` / ``KvawareRouter`` are awaited as
``route_request(endpoints, engine_stats, request_stats, request, request_json)``; any other class is
called synchronously with the first four arguments, inside the event loop. Failover calls it
again with the endpoints that are left (``max_instance_failover_reroute_attempts``), and the router
reads ``extract_session_id(request, request_json)`` for its logs.

:class:`KVShrinkRoutingLogic` has that async five-argument shape and never imports ``vllm_router``;
``router_launcher`` wraps it in a ``SessionRouter`` subclass (so the router awaits it) and injects
it. Per request it:

1. asks the index ``POST /lookup`` (msgpack) with the prompt (completions ``prompt`` as text or
   token ids — the ids sent as ``token_bytes``, see :func:`token_bytes_le` — or chat ``messages``), the
   router's own live load per backend (in-flight requests from ``request_stats``, else queued +
   running from ``engine_stats``) and the candidate URLs, under a tight deadline (default 50 ms);
   the index answers best first, cache tiers and load included;
2. if the index is slow, down or answers nothing usable: session affinity (rendezvous hash of the
   session id over the candidate URLs) when the request carries a session id (header or body key
   ``session_key``), else the least-loaded backend. After a failure the index is skipped for
   ``backoff_s`` so that an outage does not add the deadline to every request.
3. with ``hints`` set (a :class:`~kvshrink.plugins.router.hints.HintSender`), tells the chosen
   instance's cache server which prefix is coming (fire and forget, bounded; see that module).

Dependencies: ``httpx``, ``msgspec`` and the standard library only, so it installs into the
router's own environment (Python ≥ 3.12) with ``pip install --no-deps`` of this project plus those two.
"""

from __future__ import annotations

import array
import asyncio
import hashlib
import logging
import sys
import time
from collections import Counter
from typing import Any, Mapping, Sequence

import msgspec

import httpx

logger = logging.getLogger(__name__)


def rendezvous(key: str, urls: Sequence[str]) -> str:
    """Highest-random-weight hashing: stable per key, moves only 1/n of keys when a URL comes or goes."""
    return max(urls, key=lambda url: hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest())


def backend_loads(urls: Sequence[str], engine_stats: Mapping[str, Any] | None,
                  request_stats: Mapping[str, Any] | None) -> dict[str, float]:
    """The router's view of each backend's load: in-flight requests it tracks itself, else the
    engine's scraped running + waiting counts (refreshed only every ``--engine-stats-interval``)."""
    loads = {}
    for url in urls:
        rs = (request_stats or {}).get(url)
        es = (engine_stats or {}).get(url)
        if rs is not None and hasattr(rs, "in_prefill_requests"):
            loads[url] = float(rs.in_prefill_requests + rs.in_decoding_requests)
        elif es is not None and hasattr(es, "num_running_requests"):
            loads[url] = float(es.num_running_requests + es.num_queuing_requests)
        else:
            loads[url] = 0.0
    return loads


def lookup_body(request_json: Mapping[str, Any], model: str) -> dict[str, Any] | None:
    """The index query for an OpenAI request body, or ``None`` if it has no single prompt."""
    if isinstance(request_json.get("messages"), list):
        return {"model": model, "messages": request_json["messages"]}
    prompt = request_json.get("prompt")
    if isinstance(prompt, str):
        return {"model": model, "prompt": prompt}
    if isinstance(prompt, list) and prompt:
        packed = token_bytes_le(prompt)
        if packed is not None:
            return {"model": model, "token_bytes": packed}
    return None  # batched prompts, embeddings inputs, ids outside uint32...: nothing to match


def token_bytes_le(token_ids: list[Any]) -> bytes | None:
    """Token ids as little-endian uint32 bytes — the index's ``token_bytes`` form, sent as a msgpack
    binary; ``None`` if one is not an integer in [0, 2**32).

    Why not a JSON list: the index decodes 32K JSON integers into 32K Python ints in ~1.3 ms (and
    ``json.dumps`` here takes longer still). Why not base64 in JSON, as before: decoding its 175 KB
    cost the index 0.3 ms per lookup (profiled); a msgpack binary is one copy.
    """
    try:
        ids = array.array("I", token_ids)
    except (OverflowError, TypeError):
        return None
    if sys.byteorder == "big":  # pragma: no cover - no big-endian machine here
        ids.byteswap()
    return ids.tobytes()


class KVShrinkRoutingLogic:
    """Ask the index, fall back to session affinity, then to least loaded. Safe to share across requests."""

    def __init__(self, index_url: str, *, timeout_s: float = 0.05, session_key: str | None = None,
                 token: str | None = None, backoff_s: float = 1.0,
                 max_instance_failover_reroute_attempts: int = 0, hints: Any = None) -> None:
        self.index_url = index_url.rstrip("/")
        self.timeout_s = timeout_s
        self.session_key = session_key
        self.backoff_s = backoff_s
        self.max_instance_failover_reroute_attempts = max_instance_failover_reroute_attempts
        self.hints = hints  # a HintSender, or None: no prefetch hints
        self._headers = {"content-type": "application/msgpack"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._skip_index_until = 0.0
        self.decisions: Counter[str] = Counter()  # index / session / least_loaded
        self.index_failures: Counter[str] = Counter()  # timeout / unreachable / bad_answer / http_<status>

    # -- the router's interface ---------------------------------------------------------------

    def extract_session_id(self, request: Any, request_json: Mapping[str, Any] | None) -> str | None:
        if self.session_key is None:
            return None
        headers = getattr(request, "headers", None)
        value = headers.get(self.session_key) if headers is not None else None
        if value is None and request_json:
            value = request_json.get(self.session_key)
        return None if value is None else str(value)

    async def route_request(self, endpoints: Sequence[Any], engine_stats: Mapping[str, Any] | None,
                            request_stats: Mapping[str, Any] | None, request: Any,
                            request_json: Mapping[str, Any] | None = None) -> str:
        if not endpoints:
            raise ValueError("no backend serves this request")
        urls = [e.url for e in endpoints]
        loads = backend_loads(urls, engine_stats, request_stats)
        request_json = request_json or {}
        model = request_json.get("model") or (endpoints[0].model_names[0] if endpoints[0].model_names else "")
        body = lookup_body(request_json, model)
        chosen = None
        if body is not None and time.monotonic() >= self._skip_index_until:
            chosen = await self._ask_index(body, urls, loads)
            if chosen is not None:
                self.decisions["index"] += 1
        session_id = self.extract_session_id(request, request_json)
        if chosen is None and session_id is not None:
            self.decisions["session"] += 1
            chosen = rendezvous(session_id, urls)
        if chosen is None:
            self.decisions["least_loaded"] += 1
            chosen = min(urls, key=lambda url: (loads[url], urls.index(url)))
        if self.hints is not None:
            self.hints.send(chosen, request_json, session_id)
        return chosen

    # -- the index ------------------------------------------------------------------------------

    async def _ask_index(self, body: dict[str, Any], urls: list[str], loads: dict[str, float]) -> str | None:
        content = msgspec.msgpack.encode({**body, "loads": loads, "instances": urls})
        try:
            resp = await asyncio.wait_for(self._http().post(f"{self.index_url}/lookup", content=content,
                                                            headers=self._headers), self.timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            return self._failed("timeout")
        except httpx.HTTPError as exc:
            logger.debug("index unreachable: %s", exc)
            return self._failed("unreachable")
        if resp.status_code != 200:
            logger.warning("index answered %d: %s", resp.status_code, resp.text[:200])
            return self._failed(f"http_{resp.status_code}")
        try:
            ranked = msgspec.json.decode(resp.content)["instances"]
            by_url = {url.rstrip("/"): url for url in urls}
            for entry in ranked:
                url = by_url.get((entry.get("url") or "").rstrip("/"))
                if url is not None:
                    return url
        except (msgspec.DecodeError, ValueError, KeyError, TypeError, AttributeError):
            return self._failed("bad_answer")
        self.index_failures["no_known_backend"] += 1  # the index does not know these backends (yet)
        return None

    def _failed(self, reason: str) -> None:
        self.index_failures[reason] += 1
        self._skip_index_until = time.monotonic() + self.backoff_s
        return None

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            # no httpx timeout of its own: the deadline is the wait_for around each lookup
            self._client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_keepalive_connections=32))
            self._client_loop = loop
        return self._client

    async def aclose(self) -> None:
        if self.hints is not None:
            await self.hints.aclose()
        if self._client is not None:
            await self._client.aclose()
            self._client = None
