"""Measure a request the way a user sees it: OpenAI API, streaming, TTFT = first streamed token.

Used by the end-to-end tests and the benchmarks, so both measure the same thing. Errors: a
non-200 answer or a stream without a token is a :class:`StreamedCompletionError`; transport
errors are httpx's own.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from kvshrink.errors import KVShrinkError


class StreamedCompletionError(KVShrinkError, RuntimeError):
    """The server answered with an error status or streamed no token. Also a RuntimeError, as
    it was before it was named."""


@dataclass
class StreamedCompletion:
    """One streamed completion: its text, and when the first and last pieces arrived."""

    text: str
    ttft_s: float
    total_s: float
    chunks: int
    usage: dict = field(default_factory=dict)


def stream_completion(base_url: str, model: str, prompt: str | list[int], *, max_tokens: int = 8,
                      timeout: float = 600.0, client: httpx.Client | None = None,
                      extra: dict | None = None) -> StreamedCompletion:
    """POST /v1/completions with ``stream=True`` and greedy decoding; time the first token.

    ``prompt`` may be token ids, which fixes the prompt length exactly; ``extra`` adds fields to
    the request body (e.g. vLLM's ``cache_salt``).
    """
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    own_client = client is None
    client = client or httpx.Client(timeout=timeout)
    pieces: list[str] = []
    usage: dict = {}
    ttft = None
    try:
        start = time.perf_counter()
        with client.stream("POST", f"{base_url}/v1/completions", json=body, timeout=timeout) as response:
            if response.status_code != 200:
                raise StreamedCompletionError(f"{base_url} answered {response.status_code}: {response.read().decode(errors='replace')}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                usage = event.get("usage") or usage
                for choice in event.get("choices", []):
                    if choice.get("text"):
                        if ttft is None:
                            ttft = time.perf_counter() - start
                        pieces.append(choice["text"])
        total = time.perf_counter() - start
    finally:
        if own_client:
            client.close()
    if ttft is None:
        raise StreamedCompletionError(f"{base_url} streamed no token")
    return StreamedCompletion(text="".join(pieces), ttft_s=ttft, total_s=total, chunks=len(pieces), usage=usage)
