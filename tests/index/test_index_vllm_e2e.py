"""Two real vLLM CPU instances (SmolLM2) publish KV events over ZMQ to a running index.

A and B run with *different* ``PYTHONHASHSEED`` values, so their own block hashes differ; the
index must still agree on prefixes (it rehashes token ids). Checked: after a request served by
A, a lookup ranks A first with the right matched length; after A's prefix cache is reset
(``AllBlocksCleared``) and after A restarts, it no longer does. Where production-stack's router
is installed (``KVSHRINK_ROUTER_PYTHON`` = a Python ≥ 3.12 with ``vllm_router`` and this project),
the real router with our logic is run in front of both: requests go where the index says, and
still get served when the index is down.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from index_helpers import make_config, wait_for
from kvshrink.index.server import IndexServer
from kvshrink.testing.launch import LOOPBACK, ManagedProcess, VLLMServer, free_port, log_tail

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]
MODEL = "smollm2"
REPO = Path(__file__).resolve().parents[2]


def _vllm(ckpt, index: IndexServer, name: str, seed: str, port: int | None = None,
          replay_port: int | None = None) -> VLLMServer:
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": index.subscriber.bound[0],
              "replay_endpoint": f"tcp://{LOOPBACK}:{replay_port}", "topic": f"kv@{name}@{MODEL}"}
    # vLLM's own prefix cache publishes the KV events; vllm:* Prometheus metrics (load for the index's
    # scraper and the router, requests served) need stats; dev mode enables /reset_prefix_cache.
    return VLLMServer(ckpt, port=port, served_model_name=MODEL, kv_events_config=events, kv_cache_space_gb=1,
                      prefix_caching=True, log_stats=True, env={"PYTHONHASHSEED": seed, "VLLM_SERVER_DEV_MODE": "1"})


def _start_together(*servers: VLLMServer, timeout: float = 900) -> None:
    for s in servers:
        ManagedProcess.start(s)
    for s in servers:
        s.wait_until(lambda s=s: _ok(f"{s.url}/v1/models"), timeout, "serving")


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _complete(url: str, prompt, max_tokens: int = 4) -> dict:
    resp = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0.0}, timeout=600)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _ranked(index: IndexServer, tokens) -> list[dict]:
    return httpx.post(f"{index.url}/lookup", json={"model": MODEL, "token_ids": tokens}, timeout=10).json()["instances"]


def _matched(index: IndexServer, tokens) -> dict[str, int]:
    return {i["instance_id"]: i["matched_tokens"] for i in _ranked(index, tokens)}


def _served(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "vllm:request_success"
               for s in f.samples if s.name == "vllm:request_success_total")


@pytest.fixture(scope="module")
def cluster():
    from transformers import AutoTokenizer

    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    ckpt = ensure_checkpoint()
    ports = {n: (free_port(), free_port()) for n in "AB"}
    cfg = make_config(scrape_interval_s=1.0, heartbeat_timeout_s=120, tokenizers={MODEL: str(ckpt)},
                      instances=[{"id": n, "url": f"http://{LOOPBACK}:{p}", "models": [MODEL],
                                  "replay_endpoint": f"tcp://{LOOPBACK}:{r}"} for n, (p, r) in ports.items()])
    index = IndexServer(cfg).start()
    a = _vllm(ckpt, index, "A", "1", *ports["A"])
    b = _vllm(ckpt, index, "B", "2", *ports["B"])
    c = {"index": index, "a": a, "b": b, "ckpt": ckpt, "ports": ports}
    try:
        _start_together(a, b)
        c["tok"] = AutoTokenizer.from_pretrained(str(ckpt))
        yield c
    finally:  # tests may replace the index or A: stop whatever is current, and the originals
        for s in {id(x): x for x in (c["a"], c["b"], a, b)}.values():
            s.stop()
        for idx in {id(x): x for x in (c["index"], index)}.values():
            idx.stop()


def _prompt(tok, topic: str) -> list[int]:
    return tok.encode(f"A report about {topic}. " + f"The {topic} has a long and varied history. " * 55)


def test_request_on_a_ranks_a_first_with_the_right_length(cluster):
    index, a, b, tok = cluster["index"], cluster["a"], cluster["b"], cluster["tok"]
    prompt = _prompt(tok, "harbour")
    _complete(a.url, prompt)
    block = wait_for(lambda: index.state.lookup_block_sizes(MODEL), what="block size learned")[0]
    expected = len(prompt) // block * block
    assert expected >= 2 * block
    wait_for(lambda: _matched(index, prompt).get("A") == expected, timeout=30, what="A's blocks indexed")
    ranked = _ranked(index, prompt)
    assert ranked[0]["instance_id"] == "A" and ranked[0]["tiers"]["gpu"] == expected
    assert _matched(index, prompt)["B"] == 0
    # the same prompt as text, tokenized by the index like vLLM does
    by_text = httpx.post(f"{index.url}/lookup", json={"model": MODEL, "prompt": tok.decode(prompt,
                                                      skip_special_tokens=True)}, timeout=30).json()
    assert by_text["instances"][0]["instance_id"] == "A"
    # B hashes its blocks with another PYTHONHASHSEED; our prefixes still agree
    _complete(b.url, prompt)
    wait_for(lambda: _matched(index, prompt).get("B") == expected, timeout=30, what="B's blocks indexed")
    cluster["shared_prompt"] = prompt


def test_all_blocks_cleared_removes_a(cluster):
    index, a, tok = cluster["index"], cluster["a"], cluster["tok"]
    prompt = _prompt(tok, "lighthouse")
    _complete(a.url, prompt)
    wait_for(lambda: _matched(index, prompt).get("A", 0) > 0, timeout=30, what="indexed")
    assert httpx.post(f"{a.url}/reset_prefix_cache", timeout=60).status_code == 200
    # vLLM publishes events from its scheduler loop: an idle engine sends AllBlocksCleared with its next step
    _complete(a.url, [11, 12, 13], max_tokens=1)
    wait_for(lambda: _matched(index, prompt).get("A") == 0, timeout=30, what="AllBlocksCleared applied")
    assert _ranked(index, prompt)[0]["instance_id"] != "A" or _ranked(index, prompt)[0]["matched_tokens"] == 0


@pytest.mark.skipif(not os.environ.get("KVSHRINK_ROUTER_PYTHON"),
                    reason="production-stack's router is not on PyPI; set KVSHRINK_ROUTER_PYTHON to a Python >= 3.12 "
                           "with vllm_router and kvshrink installed (see plugins/router/router_launcher.py)")
def test_production_stack_router_routes_by_index(cluster, tmp_path):
    index, a, b, tok = cluster["index"], cluster["a"], cluster["b"], cluster["tok"]
    port = free_port()
    router = ManagedProcess([os.environ["KVSHRINK_ROUTER_PYTHON"], "-m", "kvshrink.plugins.router.router_launcher",
                             "--index-url", index.url, "--index-timeout-ms", "2000", "--",
                             "--host", LOOPBACK, "--port", str(port), "--service-discovery", "static",
                             "--static-backends", f"{a.url},{b.url}", "--static-models", f"{MODEL},{MODEL}",
                             "--engine-stats-interval", "5", "--max-instance-failover-reroute-attempts", "1"],
                            log_path=tmp_path / "router.log", cwd=REPO)
    router.start()
    try:
        router.wait_until(lambda: _ok(f"http://{LOOPBACK}:{port}/v1/models"), 120, "serving")
        assert "KVShrink routing logic installed" in log_tail(router.log_path, 200)
        url = f"http://{LOOPBACK}:{port}"
        prompt = _prompt(tok, "orchard")
        _complete(url, prompt)  # cold: the index picks one (least loaded / prompt hash)
        owner = wait_for(lambda: next((i for i, m in _matched(index, prompt).items() if m > 0), None), timeout=30,
                         what="first request indexed")
        owner_url = {"A": a.url, "B": b.url}[owner]
        other_url = b.url if owner == "A" else a.url
        before = {u: _served(u) for u in (owner_url, other_url)}
        for turn in range(3):  # a growing conversation: every turn extends the cached prefix
            _complete(url, prompt + tok.encode(f" Turn {turn} asks a follow-up question."))
        assert _served(owner_url) - before[owner_url] == 3
        assert _served(other_url) == before[other_url]
        # the index goes away: requests still get served (session / least-loaded fallback)
        index.stop()
        try:
            _complete(url, prompt)
        finally:
            _restart_index(cluster)
    finally:
        router.stop()


def _restart_index(cluster) -> IndexServer:
    """A fresh, empty index on the same ports; the engines' PUB sockets reconnect by themselves."""
    cluster["index"].stop()
    cluster["index"] = IndexServer(cluster["index"].config).start()
    return cluster["index"]


def test_restarted_index_relearns_caches_by_replay(cluster):
    tok, b = cluster["tok"], cluster["b"]
    known = _prompt(tok, "harbour")  # cached on B by the first test (A's cache was reset since)
    index = _restart_index(cluster)
    assert _matched(index, known)["B"] == 0
    # B's next event is the first the new index sees from it: it asks B's replay endpoint for seq 0..
    _complete(b.url, _prompt(tok, "meadow"))
    wait_for(lambda: _matched(index, known)["B"] > 0, timeout=30, what="B's history replayed")
    assert index.state.metrics.registry.get_sample_value("kvshrink_index_dropped_total",
                                                         {"source": "vllm", "reason": "unknown_parent"}) is None


def test_restart_of_a_drops_its_blocks(cluster):
    index, a, b, tok = cluster["index"], cluster["a"], cluster["b"], cluster["tok"]
    prompt = _prompt(tok, "vineyard")  # new to both engines, so both publish its blocks
    _complete(a.url, prompt)
    _complete(b.url, prompt)
    wait_for(lambda: min(_matched(index, prompt).get(n, 0) for n in "AB") > 0, timeout=30, what="both indexed")
    port, replay = cluster["ports"]["A"]
    a.stop()
    a2 = _vllm(cluster["ckpt"], index, "A", "3", port, replay)
    cluster["a"] = a2  # the fixture stops it
    _start_together(a2)
    # the restart shows as a new process start time on /metrics, or as sequence numbers from 0
    _complete(a2.url, _prompt(tok, "something else entirely"))
    try:
        wait_for(lambda: _matched(index, prompt).get("A") == 0, timeout=60, what="A's old blocks dropped")
    except AssertionError as exc:  # say what the index saw of A's streams
        seen = [line for line in httpx.get(f"{index.url}/metrics", timeout=10).text.splitlines()
                if line.startswith(("kvshrink_index_sequence_gaps", "kvshrink_index_dropped"))]
        raise AssertionError(f"{exc}; index counters: {seen}") from None
    ranked = _ranked(index, prompt)
    assert ranked[0]["instance_id"] == "B" and ranked[0]["matched_tokens"] > 0

