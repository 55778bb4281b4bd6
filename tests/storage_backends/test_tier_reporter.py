"""The router sees our tiers: the tier reporter tells a real index where each chunk of our store
lives, so a lookup's tier split follows a chunk through store, demotion, promotion and drop; a
dead index never holds up the store; and a real ``lmcache server`` with our adapter reports a
demotion the same way."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from l2_harness import build_from_json, plugin_json

from kvshrink.errors import ConfigError
from kvshrink.index.config import config_from_dict
from kvshrink.index.server import IndexServer
from kvshrink.storage_backends.keys import encode_object_key
from kvshrink.storage_backends.tier_reporter import (CLOSE_TIMEOUT_S, POST_TIMEOUT_S, ReporterSettings, TierReporter,
                                                     media_of)
from kvshrink.store import StoreConfig, TieredStore
from kvshrink.testing.launch import free_port
from kvshrink.testing.polling import poll_until

MODEL = "test-model"  # also the model of LMCache's server bench client
INSTANCE = "cache-a"
CHUNK_TOKENS = 256  # LMCache's chunk size, and the index's lmcache_chunk_size
CHUNK_BYTES = 64 * 1024


@pytest.fixture
def index() -> Iterator[IndexServer]:
    """A real index service that knows our cache server's engine as ``cache-a``."""
    config = config_from_dict({"port": free_port(), "scrape_interval_s": 0, "heartbeat_timeout_s": 0,
                               "zmq": {"bind": []}, "instances": [{"id": INSTANCE, "models": [MODEL]}]})
    with IndexServer(config) as server:
        yield server


def split(index_url: str, tokens: list[int]) -> dict[str, int]:
    """The tier split (tokens per tier, only the non-zero ones) the index gives ``cache-a`` for a
    prompt: what the router scores."""
    answer = httpx.post(f"{index_url}/lookup", json={"model": MODEL, "token_ids": list(tokens)}, timeout=10).json()
    mine = [i for i in answer["instances"] if i["instance_id"] == INSTANCE]
    return {tier: n for tier, n in mine[0]["tiers"].items() if n} if mine else {}


def wait_split(index_url: str, tokens: list[int], expected: dict[str, int], timeout: float = 20.0) -> None:
    last: list[dict[str, int]] = [{}]

    def reached() -> bool:
        last[0] = split(index_url, tokens)
        return last[0] == expected

    poll_until(reached, timeout, interval=0.05, what=f"the index to say {expected}",
               error=lambda message: AssertionError(f"{message}; it says {last[0]}"))


def prompt(i: int) -> list[int]:
    return list(range(i * CHUNK_TOKENS, (i + 1) * CHUNK_TOKENS))


def chunk_key(i: int) -> tuple[Any, bytes]:
    from lmcache.v1.distributed.api import ObjectKey

    key = ObjectKey(chunk_hash=(i + 1).to_bytes(4, "big") * 8, model_name=MODEL, kv_rank=0)
    return key, encode_object_key(key)


def chunk(i: int) -> np.ndarray:
    return np.full(CHUNK_BYTES // 2, i, dtype=np.uint16)


def two_tier_store(shm_name: str, tmp_path, dram_chunks: float, ssd_chunks: float, chunk_bytes: int) -> dict:
    """Raw DRAM, then an exclusive raw SSD tier (a chunk is on one of them: demoted on eviction from
    DRAM, moved back up on a hit, dropped on eviction from SSD); capacities in chunks."""
    return {"tiers": [{"kind": "dram", "capacity": int(chunk_bytes * dram_chunks), "shm_name": shm_name,
                       "codec": "raw"},
                      {"kind": "ssd", "capacity": int(chunk_bytes * ssd_chunks), "path": str(tmp_path / "ssd"),
                       "compressed": False}],
            "promote_on_hit": True}


def reporting_store(config: dict, url: str, **settings: Any) -> tuple[TieredStore, TierReporter]:
    store = TieredStore(StoreConfig.load(config))
    reporter = TierReporter(ReporterSettings(url, INSTANCE, **{"flush_interval": 0.05, **settings}), store.where,
                            media_of(store.config))
    store.add_placement_listener(reporter.notify)
    return store, reporter


def test_the_lookup_follows_a_chunk_through_store_demotion_promotion_and_drop(index, shm_name, tmp_path):
    store, reporter = reporting_store(two_tier_store(shm_name, tmp_path, 2.5, 3.5, CHUNK_BYTES), index.url)
    try:
        keys = [chunk_key(i) for i in range(6)]
        reporter.bind_tokens([k.chunk_hash for k, _ in keys], [prompt(i) for i in range(6)], [0] * 6)
        for i in (0, 1):
            assert store.put(keys[i][1], chunk(i)).result() is True
        wait_split(index.url, prompt(0), {"dram": 256})
        wait_split(index.url, prompt(1), {"dram": 256})

        assert store.put(keys[2][1], chunk(2)).result() is True  # DRAM holds two: chunk 0 goes to SSD
        store.flush()
        assert store.where(keys[0][1]) == "ssd"
        wait_split(index.url, prompt(0), {"ssd": 256})

        assert np.array_equal(store.get(keys[0][1]), chunk(0))  # an SSD hit moves it back up, evicting 1
        store.flush()
        assert (store.where(keys[0][1]), store.where(keys[1][1])) == ("dram", "ssd")
        wait_split(index.url, prompt(0), {"dram": 256})
        wait_split(index.url, prompt(1), {"ssd": 256})

        for i in (3, 4, 5):  # 2, 0 and 3 pushed down in turn; SSD holds three: 1, the oldest there, is dropped
            assert store.put(keys[i][1], chunk(i)).result() is True
            store.flush()
        assert store.where(keys[1][1]) is None and store.stats()["engine"]["keys_dropped"] >= 1
        wait_split(index.url, prompt(1), {})
        stats = reporter.stats()
        assert stats["entries_sent"] >= 6 and stats["send_errors"] == stats["notices_dropped"] == 0
        assert stats["unresolvable"] == 0 and stats["reported_chunks"] == 5
    finally:
        reporter.close()
        store.close()


def test_a_later_chunk_is_placed_once_the_router_looked_its_prompt_up(index, shm_name, tmp_path):
    """As with LMCache's own events: a chunk after the first resolves through the position the
    router's lookup of the prompt taught the index (lookups record positions once tier events flow)."""
    store, reporter = reporting_store(two_tier_store(shm_name, tmp_path, 8, 8, CHUNK_BYTES), index.url)
    try:
        keys = [chunk_key(i) for i in range(3)]
        two_chunks = prompt(1) + prompt(2)
        reporter.bind_tokens([k.chunk_hash for k, _ in keys], [prompt(0), prompt(1), prompt(2)], [0, 0, CHUNK_TOKENS])
        assert store.put(keys[0][1], chunk(0)).result() is True
        wait_split(index.url, prompt(0), {"dram": 256})  # tier events flow
        assert split(index.url, two_chunks) == {}  # the router asks before the engine stores
        for i in (1, 2):
            assert store.put(keys[i][1], chunk(i)).result() is True
        wait_split(index.url, two_chunks, {"dram": 512})
    finally:
        reporter.close()
        store.close()


@pytest.fixture
def dead_index() -> Iterator[str]:
    """An index that accepts connections and never answers (a hung host): the worst case for a post."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_a_dead_index_never_holds_up_the_store_and_overflowing_notices_are_counted(dead_index, shm_name, tmp_path):
    store, reporter = reporting_store(two_tier_store(shm_name, tmp_path, 64, 64, CHUNK_BYTES), dead_index,
                                      max_pending=8)
    try:
        keys = [chunk_key(i) for i in range(40)]
        reporter.bind_tokens([k.chunk_hash for k, _ in keys], [prompt(i) for i in range(40)], [0] * 40)
        assert store.put(keys[0][1], chunk(0)).result() is True
        poll_until(lambda: reporter.stats()["unsent_entries"] == 1, 10, interval=0.01,
                   what="the reporter to be stuck posting to the dead index")
        started = time.monotonic()
        for i in range(1, 40):
            assert store.put(keys[i][1], chunk(i)).result() is True
        store.flush()
        elapsed = time.monotonic() - started
        assert elapsed < POST_TIMEOUT_S / 2, f"39 puts took {elapsed:.2f} s while a post hung"
        stats = reporter.stats()
        assert stats["pending_keys"] == 8 and stats["notices_dropped"] == 31 and stats["entries_sent"] == 0
        started = time.monotonic()
        reporter.close()
        assert time.monotonic() - started < CLOSE_TIMEOUT_S + 0.5
        assert reporter.stats()["entries_sent"] == 0
    finally:
        reporter.close()
        store.close()


@pytest.mark.parametrize("params, key", [
    ({"index_url": "127.0.0.1:8200", "index_instance_id": "a"}, "adapter_params.index_url"),
    ({"index_url": "http://127.0.0.1:8200"}, "adapter_params.index_instance_id"),
    ({"index_url": "http://127.0.0.1:8200", "index_instance_id": "a@b"}, "adapter_params.index_instance_id"),
    ({"index_url": "http://i:1", "index_instance_id": "a", "index_flush_interval": 0},
     "adapter_params.index_flush_interval"),
    ({"index_url": "http://i:1", "index_instance_id": "a", "index_max_pending": 0}, "adapter_params.index_max_pending"),
    ({"index_instance_id": "a"}, "adapter_params.index_instance_id"),
])
def test_bad_index_settings_fail_before_the_adapter_is_built(tmp_path, params, key):
    store = {"tiers": [{"kind": "ssd", "path": str(tmp_path / "ssd"), "capacity": "1GiB"}]}
    with pytest.raises(ConfigError) as info:
        build_from_json(plugin_json({"store": store, **params}))
    assert info.value.key == key, str(info.value)


# -- a real lmcache server with our adapter -------------------------------------------------------------
KV_SPEC = "(2,64,16,1,64):float16:2"  # 2 layers, 1 head of 64: a 256-token chunk is 128 KiB
SERVER_CHUNK_BYTES = 2 * 2 * CHUNK_TOKENS * 64 * 2


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_lmcache_server_with_our_adapter_reports_store_demotion_and_drop(index, shm_name, tmp_path):
    """LMCache's server bench client stores one-chunk prompts through the lmcache-driven transfer
    (CPU, POSIX shm), as an engine would; the lookup's split says dram, then ssd once newer
    chunks pushed the first one down, then nothing once the SSD tier dropped it."""
    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig

    from kvshrink.testing.launch import LMCacheServer
    from kvshrink.testing.mp_observe import adapter_status

    params = {"store": two_tier_store(shm_name, tmp_path, 2.5, 3.5, SERVER_CHUNK_BYTES),
              "index_url": index.url, "index_instance_id": INSTANCE, "index_flush_interval": 0.1}
    server = LMCacheServer(l1_size_gb=0.05, l2_adapters=[plugin_json(params)], chunk_size=CHUNK_TOKENS,
                           log_path=tmp_path / "lmcache.log")
    with server:
        server.start()
        client = ServerBenchClient(BenchConfig(rpc_url=f"tcp://localhost:{server.port}", http_url=server.http_url,
                                               mode="cpu", transfer_mode="lmcache_driven", tp_size=1, use_mla=False,
                                               num_tokens=CHUNK_TOKENS - 1, kvcache_shape_spec=KV_SPEC,
                                               num_blocks=64, block_size=16), log=lambda _: None)
        client.start()
        try:
            requests = [client.create_request(i, f"req-{i}", "store") for i in range(6)]

            def store(i: int) -> None:
                result = client.store(requests[i], 0, CHUNK_TOKENS)
                assert result is not None and result.succeeded

            store(0)
            wait_split(index.url, requests[0].token_ids, {"dram": 256})
            store(1)
            store(2)  # DRAM holds two: the first chunk is demoted
            wait_split(index.url, requests[0].token_ids, {"ssd": 256})
            wait_split(index.url, requests[2].token_ids, {"dram": 256})
            for i in (3, 4, 5):  # the SSD tier's three slots overflow: the first chunk is dropped
                store(i)
            wait_split(index.url, requests[0].token_ids, {})
            status = adapter_status(server.http_url)["index_reporter"]
            assert status["entries_sent"] >= 8 and status["unresolvable"] == 0
            assert status["notices_dropped"] == status["send_errors"] == 0
        finally:
            client.close()
