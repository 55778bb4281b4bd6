"""The prefetch-hint endpoint: a real ``lmcache server`` with our adapter and the hint server module.

The chunks of a 4-chunk prefix are written to the store's SSD directory first (as an earlier
server process whose DRAM chunks were demoted would have left them), under the keys LMCache's
own hasher gives those token ids; a hint with the token ids then moves them into the DRAM tier,
seen in the server's ``/status``."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from l2_harness import plugin_json

from kvshrink.errors import ConfigError
from kvshrink.store import TieredStore
from kvshrink.storage_backends.prefetch_hints import HintRefused, HintSettings, parse_hint

CHUNK = 256
MODEL = "smollm2-test"
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def object_keys(token_ids: list[int]) -> list[bytes]:
    """The store keys of ``token_ids``' full chunks, computed as LMCache's server does (blake3
    chain, world size 1, object group 0) and encoded as our adapter does."""
    from lmcache.v1.distributed.api import ipc_key_to_object_keys
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    from kvshrink.storage_backends.keys import encode_object_key

    hashes = TokenHasher(chunk_size=CHUNK, hash_algorithm="blake3").compute_chunk_hashes(token_ids)
    ipc = IPCCacheServerKey(model_name=MODEL, world_size=1, worker_id=None, token_ids=(), start=0, end=0,
                            request_id="", cache_salt="")
    return [encode_object_key(k) for k in ipc_key_to_object_keys(ipc, hashes, [0])[0]]


def store_mapping(tmp_path, shm_name) -> dict:
    return {"promote_on_hit": False, "prefetch": {"max_pending": 64},
            "tiers": [{"kind": "dram", "capacity": "64MiB", "shm_name": shm_name, "compressed": True},
                      {"kind": "ssd", "capacity": "256MiB", "path": str(tmp_path / "ssd"), "fsync": False}]}


@pytest.fixture
def server(tmp_path, shm_name, small_chunks):
    from kvshrink.testing.launch import LMCacheServer, free_port

    tokens = [(7919 * i) % 49152 for i in range(4 * CHUNK + 100)]  # 4 full chunks and a tail
    keys = object_keys(tokens)
    mapping = store_mapping(tmp_path, shm_name)
    with TieredStore.from_config({"tiers": [mapping["tiers"][1]]}) as ssd_only:
        for key, chunk in zip(keys, small_chunks):
            assert ssd_only.put(key, chunk).result(timeout=60) is True
    port = free_port()
    module = {"module_path": "kvshrink.storage_backends.prefetch_hints",
              "config": {"port": port, "auth_token": TOKEN, "model_name": MODEL}}
    cache = LMCacheServer(l1_size_gb=0.05, l2_adapters=[plugin_json({"store": mapping})], chunk_size=CHUNK,
                          extra_args=["--server-module", json.dumps(module)], log_path=tmp_path / "lmcache.log")
    with cache:
        cache.start()
        yield cache, f"http://127.0.0.1:{port}", tokens


def tiers_of(status: dict) -> dict:
    """{tier: chunks} from LMCache's /status, wherever it nests our adapter's report."""
    found: list[dict] = []

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "KVShrinkL2Adapter" and "store" in node:
                found.append(node["store"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(status)
    assert len(found) == 1, f"our adapter's report not found once in /status: {status}"
    return found[0]


def test_a_hint_moves_the_sessions_chunks_from_ssd_to_dram(server):
    cache, url, tokens = server
    before = tiers_of(cache.status())["tiers"]
    assert (before["dram"]["chunks"], before["ssd"]["chunks"]) == (0, 4)
    reply = httpx.post(f"{url}/v1/prefetch", json={"token_ids": tokens, "session_id": "agent-7"}, headers=AUTH,
                       timeout=10)
    assert reply.status_code == 202, reply.text
    body = reply.json()
    assert (body["session_id"], body["chunks"], body["keys"], body["queued"]) == ("agent-7", 4, 4, 4)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        store = tiers_of(cache.status())
        if store["engine"]["prefetch_moved"] == 4:
            break
        time.sleep(0.2)
    assert (store["tiers"]["dram"]["chunks"], store["tiers"]["ssd"]["chunks"]) == (4, 0)
    assert store["engine"]["prefetch_missing"] == 0
    # the same hint again: everything is in DRAM already
    again = httpx.post(f"{url}/v1/prefetch", json={"token_ids": tokens}, headers=AUTH, timeout=10).json()
    assert (again["queued"], again["skipped"]) == (0, 4)
    # a longer prefix, only partly cached: the 4 known chunks are in DRAM, 2 more are nowhere
    longer = httpx.post(f"{url}/v1/prefetch", json={"token_ids": tokens[:4 * CHUNK] + [5] * (2 * CHUNK)},
                        headers=AUTH, timeout=10).json()
    assert (longer["chunks"], longer["queued"], longer["skipped"]) == (6, 2, 4)
    short = httpx.post(f"{url}/v1/prefetch", json={"token_ids": tokens[:CHUNK - 1]}, headers=AUTH, timeout=10)
    assert short.status_code == 202 and short.json()["chunks"] == 0  # no full chunk: nothing to move
    two_ranks = httpx.post(f"{url}/v1/prefetch", json={"token_ids": tokens, "world_size": 2}, headers=AUTH,
                           timeout=10).json()
    assert (two_ranks["chunks"], two_ranks["keys"]) == (4, 8)  # one key per chunk and kv rank
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = httpx.get(f"{url}/v1/prefetch/stats", headers=AUTH, timeout=10).json()
        if stats["store"]["prefetch_pending"] == stats["store"]["prefetch_running"] == 0:
            break
        time.sleep(0.2)
    assert stats["hints"] == 5 and stats["store"]["prefetch_moved"] == 4
    assert stats["store"]["prefetch_missing"] == 2 + 8  # the 2 uncached chunks; no chunk stored for 2 ranks
    assert "kvshrink_prefetch_hints" in json.dumps(cache.status())
    metrics = httpx.get(f"{cache.http_url}/metrics", timeout=10).text
    assert "kvshrink_store_engine_prefetch_moved_total 4.0" in metrics, metrics[-2000:]


@pytest.mark.parametrize(("body", "status", "field"), [
    (b"not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"session_id": "s"}', 400, "token_ids"),
    (b'{"token_ids": []}', 400, "token_ids"),
    (b'{"token_ids": [1, "2"]}', 400, "token_ids"),
    (b'{"token_ids": [1, -1]}', 400, "token_ids"),
    (b'{"token_ids": [1], "session_id": 5}', 400, "session_id"),
    (b'{"token_ids": [1], "world_size": 0}', 400, "world_size"),
    (b'{"token_ids": [1], "tokens": [1]}', 400, "tokens"),
])
def test_malformed_hints_are_refused_naming_the_field(body, status, field):
    with pytest.raises(HintRefused) as info:
        parse_hint(body, max_tokens=1000)
    assert (info.value.status, info.value.field) == (status, field)


def test_too_many_tokens_is_413():
    with pytest.raises(HintRefused) as info:
        parse_hint(json.dumps({"token_ids": list(range(11))}).encode(), max_tokens=10)
    assert (info.value.status, info.value.field) == (413, "token_ids")


def test_the_server_refuses_bad_requests_and_requests_without_the_token(server):
    cache, url, tokens = server
    assert httpx.post(f"{url}/v1/prefetch", json={"token_ids": tokens}, timeout=10).status_code == 401
    wrong = httpx.post(f"{url}/v1/prefetch", json={"token_ids": tokens}, headers={"Authorization": "Bearer x"},
                       timeout=10)
    assert wrong.status_code == 401 and wrong.json()["error"] == "unauthorized"
    assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200  # never authenticated
    bad = httpx.post(f"{url}/v1/prefetch", content=b'{"token_ids": "1 2 3"}', headers=AUTH, timeout=10)
    assert bad.status_code == 400 and bad.json()["field"] == "token_ids"
    assert httpx.get(f"{url}/v1/prefetch", headers=AUTH, timeout=10).status_code == 405
    assert httpx.post(f"{url}/v1/elsewhere", json={}, headers=AUTH, timeout=10).status_code == 404
    huge = httpx.post(f"{url}/v1/prefetch", content=b" " * (8 * 2**20 + 1), headers=AUTH, timeout=30)
    assert huge.status_code == 413
    stats = httpx.get(f"{url}/v1/prefetch/stats", headers=AUTH, timeout=10).json()
    assert stats["hints_unauthorized"] == 2 and stats["hints_rejected"] >= 4 and stats["hints"] == 0


def test_a_burst_of_hints_is_bounded_and_every_one_answered(server):
    """Many sessions hinting at once: each hint is answered; chunks beyond the store's pending
    bound (64 here) are dropped and counted, never queued."""
    cache, url, tokens = server
    replies: list[dict] = []
    lock = threading.Lock()

    def client(first: int) -> None:
        with httpx.Client(timeout=30) as http:
            for n in range(first, first + 50):
                body = {"token_ids": [n] * (3 * CHUNK), "session_id": f"s{n}"}  # 3 chunks nobody stored
                reply = http.post(f"{url}/v1/prefetch", json=body, headers=AUTH)
                assert reply.status_code == 202, reply.text
                with lock:
                    replies.append(reply.json())

    threads = [threading.Thread(target=client, args=(i * 50,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(replies) == 300
    assert all(r["queued"] + r["skipped"] + r["dropped"] == 3 for r in replies)
    stats = httpx.get(f"{url}/v1/prefetch/stats", headers=AUTH, timeout=10).json()
    assert stats["hints"] == 300
    store = stats["store"]
    assert store["prefetch_issued"] + store["prefetch_dropped"] + store["prefetch_skipped"] == 900
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and stats["store"]["prefetch_pending"]:
        time.sleep(0.2)
        stats = httpx.get(f"{url}/v1/prefetch/stats", headers=AUTH, timeout=10).json()
    assert stats["store"]["prefetch_pending"] == 0 and stats["store"]["prefetch_missing"] == store["prefetch_issued"]


def test_settings_refuse_a_public_bind_without_a_token():
    with pytest.raises(ConfigError) as info:
        HintSettings.from_config({"host": "0.0.0.0"})
    assert info.value.key == "server_module.config.auth_token"
    assert HintSettings.from_config({"host": "0.0.0.0", "auth_token": "t"}).auth_token == "t"
    assert HintSettings.from_config({}).host == "127.0.0.1"
    with pytest.raises(ConfigError) as info:
        HintSettings.from_config({"prot": 1})
    assert info.value.key == "server_module.config.prot"


def test_serve_cache_hints_section_adds_the_server_module(tmp_path, shm_name, monkeypatch):
    import yaml

    from kvshrink.storage_backends.serve_cache import HINTS_MODULE, load_serve_config

    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"store": store_mapping(tmp_path, shm_name),
                                    "hints": {"port": 8999, "auth_token_env": "HINT_TOKEN"}}))
    with pytest.raises(ConfigError) as info:  # the token's variable must be set where the server starts
        load_serve_config(path, check_services=False)
    assert info.value.key == "hints.auth_token_env"
    monkeypatch.setenv("HINT_TOKEN", "t")
    argv = load_serve_config(path, check_services=False).argv()
    module = json.loads(argv[argv.index("--server-module") + 1])
    assert module == {"module_path": HINTS_MODULE, "config": {"port": 8999, "auth_token_env": "HINT_TOKEN"}}
    path.write_text(yaml.safe_dump({"store": store_mapping(tmp_path, shm_name), "hints": {"host": "0.0.0.0"}}))
    with pytest.raises(ConfigError) as info:
        load_serve_config(path, check_services=False)
    assert info.value.key == "hints.auth_token"
    path.write_text(yaml.safe_dump({"store": store_mapping(tmp_path, shm_name)}))
    assert "--server-module" not in load_serve_config(path, check_services=False).argv()


def test_the_router_hints_the_chosen_instances_cache_server(server):
    """production-stack routing logic (called as vllm_router calls it; the index is down, so it
    falls back to least loaded), with a hint target for the backend: the routed request's prefix
    moves to DRAM on that backend's cache server."""
    import asyncio
    from types import SimpleNamespace

    from kvshrink.plugins.router.hints import HintSender
    from kvshrink.plugins.router.router_logic import KVShrinkRoutingLogic
    from kvshrink.testing.launch import free_port

    cache, url, tokens = server
    backend = "http://127.0.0.1:18001"
    hints = HintSender({backend: url}, token=TOKEN)
    logic = KVShrinkRoutingLogic(f"http://127.0.0.1:{free_port()}", hints=hints)

    async def route() -> str:
        chosen = await logic.route_request([SimpleNamespace(url=backend, model_names=[MODEL])], {}, {}, None,
                                           {"model": MODEL, "prompt": tokens, "max_tokens": 8})
        await logic.aclose()  # waits for the hint in flight
        return chosen

    assert asyncio.run(route()) == backend
    assert hints.counters == {"sent": 1}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and tiers_of(cache.status())["engine"]["prefetch_moved"] < 4:
        time.sleep(0.2)
    assert tiers_of(cache.status())["tiers"]["dram"]["chunks"] == 4


def test_chunks_stored_by_the_server_idle_down_and_a_hint_brings_them_back(tmp_path, shm_name):
    """The whole session story on the server's own paths: LMCache's bench client stores three
    chunks (its store path: L1, then our adapter); idle demotion moves them to the SSD; a hint with
    one request's token ids (keys made by the server, not by this test) moves that chunk back."""
    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig

    from kvshrink.testing.launch import LMCacheServer, free_port

    mapping = {"promote_on_hit": False, "idle_demotion": {"after_s": 1.0, "scan_interval_s": 0.1},
               "tiers": [{"kind": "dram", "capacity": "16MiB", "shm_name": shm_name},
                         {"kind": "ssd", "capacity": "64MiB", "path": str(tmp_path / "ssd"), "fsync": False}]}
    port = free_port()
    module = {"module_path": "kvshrink.storage_backends.prefetch_hints", "config": {"port": port}}
    cache = LMCacheServer(l1_size_gb=0.05, l2_adapters=[plugin_json({"store": mapping})], chunk_size=CHUNK,
                          extra_args=["--server-module", json.dumps(module)], log_path=tmp_path / "lmcache.log")
    with cache:
        cache.start()
        client = ServerBenchClient(BenchConfig(rpc_url=f"tcp://localhost:{cache.port}", http_url=cache.http_url,
                                               mode="cpu", transfer_mode="lmcache_driven", tp_size=1, use_mla=False,
                                               num_tokens=CHUNK - 1, kvcache_shape_spec="(2,64,16,1,64):float16:2",
                                               num_blocks=64, block_size=16), log=lambda _: None)
        client.start()
        try:
            requests = [client.create_request(i, f"req-{i}", "store") for i in range(3)]
            for request in requests:
                result = client.store(request, 0, CHUNK)
                assert result is not None and result.succeeded
        finally:
            client.close()

        def tiers() -> dict:
            return {name: t["chunks"] for name, t in tiers_of(cache.status())["tiers"].items()}

        deadline = time.monotonic() + 60
        while tiers() != {"dram": 0, "ssd": 3} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tiers() == {"dram": 0, "ssd": 3}
        assert tiers_of(cache.status())["engine"]["idle_demotions"] == 3
        hint = {"token_ids": list(requests[1].token_ids), "session_id": "req-1", "model_name": "test-model"}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/prefetch", json=hint, timeout=10)  # loopback: no token
        assert reply.status_code == 202 and reply.json()["queued"] == 1, reply.text
        while tiers_of(cache.status())["engine"]["prefetch_moved"] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        engine = tiers_of(cache.status())["engine"]
        assert (engine["prefetch_moved"], engine["prefetch_missing"]) == (1, 0)
        # (idle demotion may take it down again a second later; the move itself is what is checked)
