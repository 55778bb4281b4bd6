"""Router-side prefetch hints: once the routing logic has chosen an instance, tell that instance's
cache server which prefix is coming (``POST /v1/prefetch``, see
:mod:`kvshrink.storage_backends.prefetch_hints`), so its chunks move up to DRAM while the request
travels to vLLM and waits in its queue.

Contract:

* **Fire and forget.** :meth:`HintSender.send` is called from the router's event loop (inside
  ``route_request``), schedules the POST as a task on that loop and returns at once; the request is
  never delayed and never fails because of a hint. Each POST has its own deadline (``timeout_s``).
* **Bounded.** At most ``max_in_flight`` hints are in flight; beyond that a hint is dropped and
  counted (``dropped_busy``), never queued.
* **What is sent.** ``{"token_ids", "session_id"}`` (and ``model_name`` when the sender has one):
  only for requests whose ``prompt`` is a list of token ids, because the cache server keys chunks
  by token ids and the router has no tokenizer; text prompts and chat ``messages`` are counted
  ``no_token_ids`` and skipped. ``targets`` maps a backend URL (as the router names it) to its
  cache server's hint base URL (``http://cache-a:8210``); a backend without one is counted
  ``no_target``.
* **Counters** (``counters``, a Counter): ``sent`` (answered 2xx), ``dropped_busy``, ``no_target``,
  ``no_token_ids``, ``failed`` (timeout / unreachable), ``http_<status>``.

Threads: the event loop's only; the sender is not thread-safe and needs no lock. Errors: none
escape ``send`` or the task (``httpx.HTTPError`` and timeouts are counted). Dependencies: httpx and
the standard library, like the routing logic.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any, Mapping

import httpx

logger = logging.getLogger(__name__)


def prompt_token_ids(request_json: Mapping[str, Any]) -> list[int] | None:
    """The token ids of a completions request's single prompt, else None."""
    prompt = request_json.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < 2**32 for t in prompt):
        return prompt
    return None


class HintSender:
    """Sends bounded, fire-and-forget prefetch hints from the router's event loop."""

    def __init__(self, targets: Mapping[str, str], *, token: str | None = None, timeout_s: float = 1.0,
                 max_in_flight: int = 32, model_name: str | None = None) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.targets = {url.rstrip("/"): hint.rstrip("/") for url, hint in targets.items()}
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self.model_name = model_name
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._tasks: set[asyncio.Task] = set()
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self.counters: Counter[str] = Counter()

    def send(self, backend_url: str, request_json: Mapping[str, Any] | None, session_id: str | None) -> bool:
        """Schedule a hint for the request just routed to ``backend_url``; True if one was
        scheduled. Call from the event loop; returns at once."""
        target = self.targets.get(backend_url.rstrip("/"))
        if target is None:
            self.counters["no_target"] += 1
            return False
        token_ids = prompt_token_ids(request_json or {})
        if token_ids is None:
            self.counters["no_token_ids"] += 1
            return False
        if len(self._tasks) >= self.max_in_flight:
            self.counters["dropped_busy"] += 1
            return False
        body: dict[str, Any] = {"token_ids": token_ids, "session_id": session_id or ""}
        if self.model_name:
            body["model_name"] = self.model_name
        task = asyncio.get_running_loop().create_task(self._post(f"{target}/v1/prefetch", body))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def in_flight(self) -> int:
        return len(self._tasks)

    async def _post(self, url: str, body: dict[str, Any]) -> None:
        try:
            reply = await asyncio.wait_for(self._http().post(url, json=body, headers=self._headers), self.timeout_s)
        except (asyncio.TimeoutError, httpx.HTTPError) as exc:
            logger.debug("prefetch hint to %s failed: %s", url, exc)
            self.counters["failed"] += 1
            return
        if 200 <= reply.status_code < 300:
            self.counters["sent"] += 1
        else:
            logger.warning("prefetch hint to %s answered %d: %s", url, reply.status_code, reply.text[:200])
            self.counters[f"http_{reply.status_code}"] += 1

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=self.max_in_flight))
            self._client_loop = loop
        return self._client

    async def aclose(self) -> None:
        """Wait for the hints in flight (each bounded by its deadline), then close the client."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
