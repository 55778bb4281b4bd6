"""Two real vLLM CPU instances (SmolLM2) publish KV events over ZMQ to a running index.

A and B run with *different* ``PYTHONHASHSEED`` values, so their own block hashes differ; the
index must still agree on prefixes (it rehashes token ids). Checked: after a request served by
A, a lookup ranks A first with the right matched length; after A's prefix cache is reset
(``AllBlocksCleared``) and after A restarts, it no longer does. Where production-stack's router
is installed (``.venv-router/``, built by ``scripts/setup-router.sh`` from the vendored source, or
``KVSHRINK_ROUTER_PYTHON`` = a Python ≥ 3.12 with ``vllm_router`` and this project), the real router
with our logic is run in front of both: requests go where the index says, still get served when
the index is down, and follow the tiers that cache servers report: a prompt whose chunks both hold
goes to the one holding them in DRAM rather than on SSD, and to the other once A's copy is demoted.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from index_helpers import make_config, wait_for
from kvshrink.index.server import IndexServer
from kvshrink.testing.launch import VLLMServer
from kvshrink.testing.processes import LOOPBACK, ManagedProcess, free_port, log_tail

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]
MODEL = "smollm2"
REPO = Path(__file__).resolve().parents[2]
# production-stack's router: KVSHRINK_ROUTER_PYTHON, else the venv scripts/setup-router.sh builds
ROUTER_PYTHON = os.environ.get("KVSHRINK_ROUTER_PYTHON") or str(REPO / ".venv-router" / "bin" / "python")
needs_router = pytest.mark.skipif(
    not os.access(ROUTER_PYTHON, os.X_OK),
    reason=f"production-stack's router is not installed ({ROUTER_PYTHON} missing): scripts/setup-router.sh "
           "(run by make setup) builds .venv-router/ from tests/vendor/ when it finds a Python >= 3.12; "
           "or set KVSHRINK_ROUTER_PYTHON to a Python >= 3.12 with vllm_router and kvshrink installed")
CHUNK = 256  # LMCache's chunk size, the index's default lmcache_chunk_size


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


@contextlib.contextmanager
def _router(cluster, log_path: Path):
    """The real vllm-router with our logic in front of the cluster's A and B; yields its URL."""
    a, b = cluster["a"], cluster["b"]
    port = free_port()
    router = ManagedProcess([ROUTER_PYTHON, "-m", "kvshrink.plugins.router.router_launcher",
                             "--index-url", cluster["index"].url, "--index-timeout-ms", "2000", "--",
                             "--host", LOOPBACK, "--port", str(port), "--service-discovery", "static",
                             "--static-backends", f"{a.url},{b.url}", "--static-models", f"{MODEL},{MODEL}",
                             "--engine-stats-interval", "5", "--max-instance-failover-reroute-attempts", "1"],
                            log_path=log_path, cwd=REPO)
    router.start()
    try:
        router.wait_until(lambda: _ok(f"http://{LOOPBACK}:{port}/v1/models"), 120, "serving")
        assert "KVShrink routing logic installed" in log_tail(router.log_path, 200)
        yield f"http://{LOOPBACK}:{port}"
    finally:
        router.stop()


@needs_router
def test_production_stack_router_routes_by_index(cluster, tmp_path):
    index, a, b, tok = cluster["index"], cluster["a"], cluster["b"], cluster["tok"]
    with _router(cluster, tmp_path / "router.log") as url:
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


def _restart_index(cluster) -> IndexServer:
    """A fresh, empty index on the same ports; the engines' PUB sockets reconnect by themselves."""
    cluster["index"].stop()
    cluster["index"] = IndexServer(cluster["index"].config).start()
    return cluster["index"]


class _CacheServer:
    """What the tier reporter of instance ``name``'s cache server posts to the index's ``/events``
    (``kvshrink.storage_backends.tier_reporter``'s wire: ``tier: l2``, ``backend: kvshrink``,
    ``medium`` set; one stream per process, ``seq`` from 1)."""

    def __init__(self, index_url: str, name: str) -> None:
        self.index_url, self.name = index_url, name
        self.incarnation = time.time_ns() // 1_000_000
        self.seq = itertools.count(1)

    def post(self, event: str, medium: str, prompt: list[int], chunks) -> None:
        entries = [{"key": {"chunk_hash_hex": f"{hash(tuple(prompt[:(c + 1) * CHUNK])) & (2**64 - 1):016x}",
                            "model_name": MODEL},
                    "size_bytes": 5_898_240 if event == "store" else 0,
                    "token_ids": prompt[c * CHUNK:(c + 1) * CHUNK] if event == "store" else [],
                    "token_offset": c * CHUNK if event == "store" else -1} for c in chunks]
        batch = {"instance_id": self.name, "incarnation": self.incarnation, "seq": next(self.seq),
                 "event_type": event, "tier": "l2", "backend": "kvshrink", "medium": medium, "entries": entries}
        resp = httpx.post(f"{self.index_url}/events", json={"batches": [batch]}, timeout=10)
        assert resp.status_code == 200 and resp.json()["dropped"] == {}, resp.text


def _tiers(index: IndexServer, tokens) -> dict[str, dict[str, int]]:
    return {i["instance_id"]: {t: n for t, n in i["tiers"].items() if n} for i in _ranked(index, tokens)}


@needs_router
def test_production_stack_router_follows_the_tiers(cluster, tmp_path):
    """Both instances' cache servers hold the prompt's chunks, A's in DRAM, B's on SSD: the router
    sends it to A. Once A's copy is demoted to the remote tier, the same prompt goes to B."""
    index, a, b, tok = cluster["index"], cluster["a"], cluster["b"], cluster["tok"]
    prompt = _prompt(tok, "granary")[:2 * CHUNK]  # new to both engines: no GPU-tier blocks anywhere
    assert len(prompt) == 2 * CHUNK
    cache = {n: _CacheServer(index.url, n) for n in "AB"}
    for name, medium in (("A", "dram"), ("B", "ssd")):
        cache[name].post("store", medium, prompt, [0])  # a first chunk resolves from the root
    _ranked(index, prompt)  # the router's lookup teaches the index where later chunks sit
    for name, medium in (("A", "dram"), ("B", "ssd")):
        cache[name].post("store", medium, prompt, [1])
    assert _tiers(index, prompt) == {"A": {"dram": 2 * CHUNK}, "B": {"ssd": 2 * CHUNK}}
    ranked = _ranked(index, prompt)  # same length, same (idle) load: the tier decides
    assert [i["instance_id"] for i in ranked] == ["A", "B"] and ranked[0]["load"] == ranked[1]["load"], ranked
    with _router(cluster, tmp_path / "router.log") as url:
        before = {n: _served(s.url) for n, s in (("A", a), ("B", b))}
        _complete(url, prompt)
        assert (_served(a.url) - before["A"], _served(b.url) - before["B"]) == (1, 0), "expected A (DRAM)"
        # A's engine now holds the prompt on GPU too: clear that, so only the cache servers' tiers count
        assert httpx.post(f"{a.url}/reset_prefix_cache", timeout=60).status_code == 200
        _complete(a.url, [11, 12, 13], max_tokens=1)  # vLLM sends AllBlocksCleared with its next step
        wait_for(lambda: _tiers(index, prompt).get("A") == {"dram": 2 * CHUNK}, timeout=30,
                 what="A's GPU blocks cleared, its DRAM chunks kept")
        # A's cache server demotes the chunks to the remote tier: the store on the new medium comes
        # before the delete on the old one, as the tier reporter sends them
        cache["A"].post("store", "remote", prompt, [0, 1])
        cache["A"].post("delete", "dram", prompt, [0, 1])
        assert _tiers(index, prompt) == {"A": {"remote": 2 * CHUNK}, "B": {"ssd": 2 * CHUNK}}
        assert [i["instance_id"] for i in _ranked(index, prompt)] == ["B", "A"]
        before = {n: _served(s.url) for n, s in (("A", a), ("B", b))}
        _complete(url, prompt)
        assert (_served(a.url) - before["A"], _served(b.url) - before["B"]) == (0, 1), "expected B (SSD)"


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

