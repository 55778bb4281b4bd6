"""``kvshrink cascade serve`` (the real command, its own process) in front of a real vLLM CPU server
(SmolLM2-135M-Instruct): the same chat request, opted out and condensed, both streamed; vLLM's own
usage count shows the tokens the condenser says it saved (same tokenizer family), both streams
carry tokens to ``[DONE]``, and the proxy's /metrics counted the document."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cascade_texts import prose, with_facts

from kvshrink.testing.launch import LOOPBACK, ManagedProcess, VLLMServer, _http_ok, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
MODEL = "smollm2"


@pytest.fixture
def cascade(vllm: VLLMServer, checkpoint: Path, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    proxy = ManagedProcess([sys.executable, "-m", "kvshrink.cli", "cascade", "serve", "--upstream", vllm.url,
                            "--port", str(port), "--model-path", str(checkpoint), "--ratio", "0.5",
                            "--log-level", "warning"], log_path=tmp_path / "cascade.log").start()
    url = f"http://{LOOPBACK}:{port}"
    try:
        proxy.wait_until(lambda: _http_ok(f"{url}/metrics"), 120, "serving")
        yield url
    finally:
        proxy.stop()


def _stream(client: httpx.Client, url: str, body: dict, headers: dict) -> tuple[list[dict], httpx.Headers]:
    events = []
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]) if line != "data: [DONE]" else {"done": True})
    return events, answer.headers


def test_vllm_sees_the_condensed_documents_and_streams(cascade: str) -> None:
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Which access code opens the vault of the Orion project?"},
                         {"role": "tool", "content": with_facts(prose(2))}]}
    with httpx.Client(timeout=300) as client:
        full, _ = _stream(client, cascade, body, {"x-kvshrink-cascade": "off"})
        condensed, headers = _stream(client, cascade, body, {})
        metrics = client.get(f"{cascade}/metrics").text
    for events in (full, condensed):
        assert events[-1] == {"done": True}
        assert any(e.get("choices") and e["choices"][0]["delta"].get("content") for e in events[:-1])
    prompt_full = full[-2]["usage"]["prompt_tokens"]
    prompt_condensed = condensed[-2]["usage"]["prompt_tokens"]
    tokens_in, tokens_out = (int(headers[f"x-kvshrink-cascade-tokens-{k}"]) for k in ("in", "out"))
    assert abs(tokens_out / tokens_in - 0.5) <= 0.05
    assert abs((prompt_full - prompt_condensed) - (tokens_in - tokens_out)) <= 4, (prompt_full, prompt_condensed)
    assert "kvshrink_cascade_cache_misses_total 1.0" in metrics
    assert f"kvshrink_cascade_document_tokens_in_sum {tokens_in}.0" in metrics
