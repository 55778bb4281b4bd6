"""The cascade proxy over real HTTP, between a real client and a recording stand-in for vLLM:
exact pass-through, condensed documents, SSE relayed chunk by chunk, upstream errors relayed,
malformed requests refused with the field named, metrics."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest
from cascade_servers import STREAM_CHUNKS, Upstream, sse_chunk
from cascade_texts import prose, with_facts

from kvshrink.testing.launch import LOOPBACK, free_port

Proxy = Callable[..., str]


def test_unmarked_requests_reach_upstream_byte_for_byte(proxy: Proxy, upstream: tuple[Upstream, str]) -> None:
    state, _ = upstream
    url = proxy()
    bodies = {"/v1/chat/completions": b'{"model":"m",  "messages":[{"role":"user","content":"caf\\u00e9 <b>"}],'
                                      b' "temperature": 1.0e0, "z": [ ]}',
              "/v1/completions": b'{ "prompt" : "plain text", "max_tokens":3 }'}
    with httpx.Client(timeout=30) as client:
        for path, body in bodies.items():
            answer = client.post(url + path, content=body, headers={"content-type": "application/json"})
            assert answer.status_code == 200 and "x-kvshrink-cascade-documents" not in answer.headers
            assert (state.received[-1].path, state.received[-1].body) == (path, body)
        marked = json.dumps({"messages": [{"role": "tool", "content": prose(1)}]}).encode()
        client.post(url + "/v1/chat/completions", content=marked, headers={"x-kvshrink-cascade": "off"})
        assert state.received[-1].body == marked and "x-kvshrink-cascade" not in state.received[-1].headers
        models = client.get(url + "/v1/models?x=1")
        assert models.json()["data"] == [{"id": "stub"}] and state.received[-1].method == "GET"


def test_marked_documents_are_condensed_before_upstream(proxy: Proxy, upstream: tuple[Upstream, str]) -> None:
    state, _ = upstream
    url = proxy()
    doc = with_facts(prose(2))
    body = {"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "Which access code opens the Orion vault?"},
        {"role": "tool", "tool_call_id": "c1", "content": doc}]}
    with httpx.Client(timeout=120) as client:
        answer = client.post(url + "/v1/chat/completions", json=body, headers={"x-kvshrink-cascade-ratio": "0.3"})
    assert answer.status_code == 200
    sent = state.last_json()
    condensed = sent["messages"][1]["content"]
    assert "4719." in condensed.split() and len(condensed) < len(doc)
    tokens_in, tokens_out = (int(answer.headers[f"x-kvshrink-cascade-tokens-{k}"]) for k in ("in", "out"))
    assert answer.headers["x-kvshrink-cascade-documents"] == "1" and abs(tokens_out / tokens_in - 0.3) <= 0.05
    assert sent["messages"][0] == body["messages"][0] and sent["max_tokens"] == 4
    assert "x-kvshrink-cascade-ratio" not in state.received[-1].headers


@pytest.mark.parametrize("marked", [False, True])
def test_a_stream_is_relayed_chunk_by_chunk(proxy: Proxy, upstream: tuple[Upstream, str], marked: bool) -> None:
    """The stand-in sends chunk i+1 only after the client has seen chunk i: a proxy that buffered
    would deliver nothing until the stand-in gave up waiting (10 s a chunk)."""
    state, _ = upstream
    url = proxy()
    prompt = f"<doc>{prose(1)}</doc> Question?" if marked else "plain"
    seen, buffer = [], b""
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url + "/v1/completions", json={"prompt": prompt, "stream": True}) as answer:
            assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
            for data in answer.iter_raw():
                buffer += data
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    seen.append(event + b"\n\n")
                    if len(seen) <= STREAM_CHUNKS:
                        assert state.sent_chunks == len(seen), "the proxy held chunks back"
                        state.release[len(seen) - 1].set()
    assert seen == [sse_chunk(i) for i in range(STREAM_CHUNKS)] + [b"data: [DONE]\n\n"]
    assert ("<doc>" in state.last_json()["prompt"]) is False


@pytest.mark.parametrize("status", [400, 404, 503])
def test_upstream_errors_are_relayed_with_status_and_body(proxy: Proxy, status: int) -> None:
    url = proxy()
    body = json.dumps({"error": {"message": f"stub says {status}"}})
    with httpx.Client(timeout=30) as client:
        answer = client.post(url + "/v1/completions", json={"prompt": "x"},
                             headers={"x-stub-status": str(status), "x-stub-body": body})
        metrics = client.get(url + "/metrics").text
    assert (answer.status_code, answer.text) == (status, body)
    assert f'kvshrink_cascade_upstream_errors_total{{status="{status}"}} 1.0' in metrics


def test_an_unreachable_upstream_is_a_502(proxy: Proxy) -> None:
    url = proxy(upstream_url=f"http://{LOOPBACK}:{free_port()}")
    with httpx.Client(timeout=30) as client:
        answer = client.post(url + "/v1/completions", json={"prompt": "x"})
    assert answer.status_code == 502 and answer.json()["error"]["type"] == "upstream_error"


@pytest.mark.parametrize(("body", "headers", "param"), [
    (b"{not json", {}, "body"),
    (b'{"messages": [{"role": "user", "content": "a <doc>b"}]}', {}, "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', {"x-kvshrink-cascade-ratio": "2"},
     "x-kvshrink-cascade-ratio header"),
])
def test_malformed_requests_get_a_400_naming_the_field(proxy: Proxy, upstream: tuple[Upstream, str], body: bytes,
                                                       headers: dict, param: str) -> None:
    url = proxy()
    with httpx.Client(timeout=30) as client:
        answer = client.post(url + "/v1/chat/completions", content=body, headers=headers)
    error = answer.json()["error"]
    assert (answer.status_code, error["param"], error["type"]) == (400, param, "invalid_request_error")
    assert error["message"].startswith(param) and upstream[0].received == []


def test_metrics_count_tokens_and_cache_hits(proxy: Proxy) -> None:
    url = proxy()
    body = {"model": "m", "messages": [{"role": "user", "content": f"<doc>{prose(1, start=3)}</doc> Why?"}]}
    with httpx.Client(timeout=120) as client:
        answers = [client.post(url + "/v1/chat/completions", json=body) for _ in range(2)]
        metrics = client.get(url + "/metrics").text
    assert [a.status_code for a in answers] == [200, 200]
    tokens_out = int(answers[0].headers["x-kvshrink-cascade-tokens-out"])
    for line in ("kvshrink_cascade_cache_misses_total 1.0", 'kvshrink_cascade_cache_hits_total{source="memory"} 1.0',
                 "kvshrink_cascade_document_tokens_in_count 2.0", f"kvshrink_cascade_document_tokens_out_sum "
                 f"{2 * tokens_out}.0", "kvshrink_cascade_condense_seconds_count 1.0",
                 'kvshrink_cascade_requests_total{action="condensed",endpoint="/v1/chat/completions"} 2.0'):
        assert line in metrics, line
