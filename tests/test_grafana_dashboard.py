"""The Grafana dashboard (docs/grafana/kvshrink-dashboard.json) graphs what our processes export.

Every PromQL expression in it (panel targets and template variables) is tokenized and checked for
balanced brackets and known functions, and the metric names it selects are collected. Then real
processes are scraped over HTTP and must export every one of those names:

* ``lmcache server`` with our L2 adapter (a compressed DRAM tier over an SSD tier, a tier reporter
  pointed at an index that is down), the prefetch-hint module and KV Fuse (enabled, the SmolLM2
  checkpoint): its ``/metrics``, after a hint moved four chunks from SSD to DRAM; the DRAM tier's
  raw and stored byte counters moved, raw over stored above 1;
* the in-process plugin inside LMCache's own StorageManager, in a process with
  ``PROMETHEUS_MULTIPROC_DIR`` set as a vLLM user sets it: the folder, read by prometheus_client's
  MultiProcessCollector (what vLLM's ``/metrics`` does) and served over HTTP, has every store
  metric the dashboard selects, and its byte counters moved.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "docs" / "grafana" / "kvshrink-dashboard.json"
CHUNK = 256
MODEL = "smollm2-test"

FUNCTIONS = {"sum", "avg", "min", "max", "count", "rate", "irate", "increase", "delta", "histogram_quantile",
             "clamp_min", "clamp_max", "abs", "topk", "bottomk", "avg_over_time", "max_over_time", "vector",
             "label_values", "sum_over_time", "time"}
LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"and", "or", "unless", "bool", "offset"}
_TOKEN = re.compile(r"""\s*(?:(?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*')|(?P<range>\[[^\]]*\])"""
                    r"""|(?P<number>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)|(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)"""
                    r"""|(?P<op>==|!=|=~|!~|>=|<=|[-+*/%^=<>(){},]))""")


# -- the dashboard ----------------------------------------------------------------------------------
def expressions(node: Any = None) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets (rows included) and query variables."""
    if node is None:
        node = json.loads(DASHBOARD.read_text())
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                found.append(value)
            elif key == "query" and isinstance(value, dict) and isinstance(value.get("query"), str):
                found.append(value["query"])
            else:
                found += expressions(value)
    elif isinstance(node, list):
        for value in node:
            found += expressions(value)
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects; AssertionError on a token PromQL does not have, brackets
    that do not balance or an unknown function."""
    tokens: list[tuple[str, str]] = []
    position = 0
    expr = expr.rstrip()
    while position < len(expr):
        match = _TOKEN.match(expr, position)
        assert match is not None and match.end() > position, f"cannot tokenize {expr[position:]!r} in {expr!r}"
        kind = match.lastgroup
        tokens.append((kind, match.group(kind)))
        position = match.end()
    names: set[str] = set()
    depth: list[str] = []
    skip_list = False  # inside by (...) / without (...): label names
    for i, (kind, text) in enumerate(tokens):
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind == "op" and text in "({":
            depth.append(text)
        elif kind == "op" and text in ")}":
            assert depth and depth.pop() == {")": "(", "}": "{"}[text], f"unbalanced {text!r} in {expr!r}"
            skip_list = False
        elif kind == "ident":
            if depth and depth[-1] == "{" or skip_list:
                continue  # a label name
            if text in LABEL_LISTS:
                assert following == "(", f"{text} without a label list in {expr!r}"
                skip_list = True  # until its ")"
                continue
            if following == "(" or following in ("by", "without"):  # sum by (tier) (...)
                assert text in FUNCTIONS, f"unknown function {text}() in {expr!r}"
                if text == "label_values":  # Grafana: label_values(metric, label)
                    names.add(tokens[i + 2][1])
                    return names
            elif text not in KEYWORDS:
                names.add(text)
    assert not depth, f"unclosed {depth} in {expr!r}"
    return names


def dashboard_names() -> set[str]:
    return set().union(*(metric_names(e) for e in expressions()))


def test_the_dashboard_parses_and_covers_what_an_operator_graphs() -> None:
    data = json.loads(DASHBOARD.read_text())
    assert data["uid"] and data["panels"] and all("title" in p for p in data["panels"])
    exprs = expressions(data)
    assert len(exprs) > 30
    names = dashboard_names()
    assert all(n.startswith("kvshrink_") for n in names), names
    for wanted in ("kvshrink_store_tier_raw_bytes", "kvshrink_store_tier_stored_bytes",
                   "kvshrink_store_tier_raw_bytes_in_total", "kvshrink_store_tier_stored_bytes_in_total",
                   "kvshrink_store_get_chunks_total", "kvshrink_store_get_seconds_bucket",
                   "kvshrink_store_put_seconds_bucket", "kvshrink_store_tier_read_seconds_bucket",
                   "kvshrink_store_tier_dropped_total", "kvshrink_store_dropped_total", "kvshrink_fuse_fusions_total",
                   "kvshrink_prefetch_hints_total", "kvshrink_tier_reporter_entries_sent_total"):
        assert wanted in names, wanted
    ratio = [e for e in exprs if "kvshrink_store_tier_raw_bytes{" in e and "/" in e]
    assert ratio, "no live compression ratio panel"


def test_the_tokenizer_rejects_what_promql_would() -> None:
    assert metric_names('sum by (tier) (rate(a_total{x="y(", z=~"$v"}[$__rate_interval])) / b') == {"a_total", "b"}
    for bad in ("sum(rate(a[5m])", "rte(a[5m])", "sum by tier (a)", "a{x=\"1\""):
        with pytest.raises(AssertionError):
            metric_names(bad)


# -- real processes ------------------------------------------------------------------------------
def scrape(url: str) -> dict[str, list[Any]]:
    """Sample name -> samples, from a Prometheus text page fetched over HTTP."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=10).text
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list[Any]], name: str, **labels: str) -> float:
    return sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def hint_keys(token_ids: list[int]) -> list[bytes]:
    """Store keys of ``token_ids``' full chunks as LMCache's server makes them (see test_prefetch_hints)."""
    from lmcache.v1.distributed.api import ipc_key_to_object_keys
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    from kvshrink.storage_backends.keys import encode_object_key

    hashes = TokenHasher(chunk_size=CHUNK, hash_algorithm="blake3").compute_chunk_hashes(token_ids)
    ipc = IPCCacheServerKey(model_name=MODEL, world_size=1, worker_id=None, token_ids=(), start=0, end=0,
                            request_id="", cache_salt="")
    return [encode_object_key(k) for k in ipc_key_to_object_keys(ipc, hashes, [0])[0]]


@pytest.fixture
def mp_server(tmp_path, shm_name, small_chunks) -> Iterator[Any]:
    """A real ``lmcache server``: our adapter (+ tier reporter), prefetch hints and KV Fuse."""
    from kvshrink.store import TieredStore
    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint
    from kvshrink.testing.launch import LMCacheServer, free_port

    tokens = [(7919 * i) % 49152 for i in range(4 * CHUNK + 10)]
    store = {"promote_on_hit": False,
             "tiers": [{"kind": "dram", "capacity": "64MiB", "shm_name": shm_name, "codec": "fast"},
                       {"kind": "ssd", "capacity": "256MiB", "path": str(tmp_path / "ssd"), "fsync": False}]}
    with TieredStore.from_config({"tiers": [store["tiers"][1]]}) as ssd_only:  # left by an earlier process
        for key, chunk in zip(hint_keys(tokens), small_chunks):
            assert ssd_only.put(key, chunk).result(timeout=60) is True
    hint_port = free_port()
    params = {"store": store, "index_url": f"http://127.0.0.1:{free_port()}", "index_instance_id": "cache-a",
              "index_flush_interval": 0.1}
    adapter = {"type": "plugin", "module_path": "kvshrink.storage_backends.mp_l2_adapter",
               "class_name": "KVShrinkL2Adapter", "adapter_params": params}
    modules = [{"module_path": "kvshrink.storage_backends.prefetch_hints",
                "config": {"port": hint_port, "model_name": MODEL}},
               {"module_path": "kvshrink.storage_backends.kv_fuse.server_module",
                "config": {"enabled": True, "model_path": str(ensure_checkpoint()), "threads": 1}}]
    extra = [arg for module in modules for arg in ("--server-module", json.dumps(module))]
    server = LMCacheServer(l1_size_gb=0.05, l2_adapters=[adapter], chunk_size=CHUNK, extra_args=extra,
                           log_path=tmp_path / "lmcache.log")
    with server:
        server.start(timeout=300)
        yield server, f"http://127.0.0.1:{hint_port}", tokens


@pytest.mark.e2e
def test_lmcache_server_exports_every_name_the_dashboard_queries(mp_server) -> None:
    server, hints, tokens = mp_server
    reply = httpx.post(f"{hints}/v1/prefetch", json={"token_ids": tokens}, timeout=30)
    assert reply.status_code == 202 and reply.json()["queued"] == 4, reply.text
    deadline = time.monotonic() + 60
    while (samples := scrape(f"{server.http_url}/metrics")) and \
            value(samples, "kvshrink_store_engine_prefetch_moved_total") < 4:
        assert time.monotonic() < deadline, "the hinted chunks never moved"
        time.sleep(0.2)
    missing = sorted(dashboard_names() - set(samples))
    assert missing == [], f"the dashboard queries names the server does not export: {missing}"
    raw = value(samples, "kvshrink_store_tier_raw_bytes_in_total", tier="dram")
    stored = value(samples, "kvshrink_store_tier_stored_bytes_in_total", tier="dram")
    assert raw == 4 * 2 * 30 * 64 * 192 * 2 and 0 < stored < raw  # four 64-token chunks, compressed
    assert value(samples, "kvshrink_store_tier_raw_bytes", tier="dram") / \
        value(samples, "kvshrink_store_tier_stored_bytes", tier="dram") == pytest.approx(raw / stored)
    assert value(samples, "kvshrink_prefetch_hints_total") == 1
    assert value(samples, "kvshrink_prefetch_hint_chunks_total") == 4


INPROCESS = textwrap.dedent("""
    import sys, uuid
    import numpy as np, torch, yaml
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager
    from kvshrink.testing.derived_stores import derive_store
    from kvshrink.testing.fixtures.real_kv import real_kv

    repo, tmp, shm = sys.argv[1:4]
    data = yaml.safe_load(open(f"{repo}/configs/lmcache-inprocess-dram-ssd.yaml"))
    data["max_local_cpu_size"] = 0.3
    del data["extra_config"]["kvshrink.config"]
    data["extra_config"]["kvshrink.store"] = derive_store(paths={"ssd": f"{tmp}/ssd"}, shm_names={"dram": shm},
                                                          capacities={"dram": "64MiB", "ssd": "1GiB"})
    path = f"{tmp}/lmcache.yaml"
    open(path, "w").write(yaml.safe_dump(data))
    metadata = LMCacheMetadata(model_name="smollm2", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(30, 2, 256, 3, 64))
    manager = StorageManager(LMCacheEngineConfig.from_file(path), metadata, EventManager())
    plugin = manager.storage_backends["kvshrink"]
    kv = real_kv("code", 512)
    keys = []
    for i in range(4):
        chunk = np.ascontiguousarray(kv[:, :, i * 64:(i + 1) * 64])
        obj = manager.allocate(torch.Size(chunk.shape), torch.bfloat16)
        obj.tensor.copy_(torch.from_numpy(chunk).view(torch.bfloat16))
        key = CacheEngineKey("smollm2", 1, 0, 0xC0FFEE00 + i, torch.bfloat16)
        keys.append(key)
        manager.batched_put([key], [obj], location="kvshrink")
    plugin.flush(60)
    for obj in plugin.batched_get_blocking(keys):
        assert obj is not None
        obj.ref_count_down()
    manager.close()  # the plugin's close copies the scrape-time values into the folder once more
    print("done")
""")


@pytest.mark.e2e
def test_the_inprocess_plugin_exports_the_store_names_to_a_multiprocess_metrics_folder(tmp_path, shm_name) -> None:
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    from kvshrink.testing.launch import free_port

    folder = tmp_path / "prometheus"
    folder.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}
    done = subprocess.run([sys.executable, "-c", INPROCESS, str(REPO), str(tmp_path), shm_name], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-4000:]
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(folder))
    port = free_port()
    httpd, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        samples = scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        httpd.shutdown()
        thread.join(10)
    store_names = {n for n in dashboard_names() if n.startswith("kvshrink_store_")}
    missing = sorted(store_names - set(samples))
    assert missing == [], f"the in-process plugin does not export: {missing}"
    assert value(samples, "kvshrink_plugin_puts_submitted_total") == 4
    raw = value(samples, "kvshrink_store_tier_raw_bytes_in_total", tier="dram")
    stored = value(samples, "kvshrink_store_tier_stored_bytes_in_total", tier="dram")
    assert raw == 4 * 2 * 30 * 64 * 192 * 2 and 0 < stored < raw
    assert value(samples, "kvshrink_store_get_seconds_count") >= 1
