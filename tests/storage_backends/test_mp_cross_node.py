"""Cross-node pooling, end to end: two cache servers ("nodes": own processes, own DRAM and SSD
tiers) share one Redis, each serves its own vLLM CPU. A prompt prefilled through node A is served on
node B from the shared tier: LMCache's own lookup counters on B count the hit, our store on B read
it from Redis, and B's greedy output equals A's cold one.

Both nodes run ``configs/store-dram-ssd-redis.yaml`` (the default store plus the shared Redis
tier, written back in the background), moved to private paths and sized down.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from l2_harness import SHM_DIR, greedy, plugin_json

from kvshrink.testing.mp_observe import adapter_status, cache_counters, connector_config_with_heartbeat, wait_for_engine

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

CHUNK = 256
PROMPT_TOKENS = 1100  # 4 whole chunks (LMCache keeps whole chunks only) + a tail
CACHED = PROMPT_TOKENS // CHUNK * CHUNK


def node_adapter(workdir: Path, shm_name: str, redis_url: str) -> dict:
    from kvshrink.configs import shipped_path
    from kvshrink.testing.derived_stores import derive_store

    store = derive_store(shipped_path("store-dram-ssd-redis.yaml"), paths={"ssd": workdir / "ssd"},
                         shm_names={"dram": shm_name}, capacities={"dram": "256MiB", "ssd": "1GiB"})
    for tier in store["tiers"]:
        if tier["kind"] == "redis":
            tier.update(url=redis_url, namespace="kvshrink-xnode")
    return plugin_json({"store": store})


def _redis_chunks(url: str) -> int:
    import redis

    return sum(1 for _ in redis.Redis.from_url(url).scan_iter(match=b"kvshrink-xnode:*"))


def test_a_prompt_prefilled_on_node_a_is_served_on_node_b_from_the_shared_redis(tmp_path, redis_server, model) -> None:
    from kvshrink.testing.inprocess import prompt_token_ids
    from kvshrink.testing.launch import LMCacheServer, VLLMServer
    from kvshrink.testing.polling import poll_until

    prompt = prompt_token_ids(PROMPT_TOKENS)
    nodes, shms = {}, []
    try:
        for name in ("a", "b"):
            shms.append(f"kvshrink-xnode-{uuid.uuid4().hex[:10]}")
            cache = LMCacheServer(l1_size_gb=0.5, l2_adapters=[node_adapter(tmp_path / name, shms[-1], redis_server.url)],
                                  log_path=tmp_path / f"lmcache-{name}.log").start()
            vllm = VLLMServer(model, kv_transfer_config=connector_config_with_heartbeat(cache),
                              log_path=tmp_path / f"vllm-{name}.log").launch()
            nodes[name] = (cache, vllm)
        for cache, vllm in nodes.values():  # both vLLMs start at once
            vllm.wait_serving()
            wait_for_engine(cache.http_url)
        (cache_a, vllm_a), (cache_b, vllm_b) = nodes["a"], nodes["b"]

        before_a = cache_counters(cache_a.http_url)
        cold = greedy(vllm_a, prompt)
        assert (cache_counters(cache_a.http_url) - before_a).hit_tokens == 0  # a cold run on A
        poll_until(lambda: _redis_chunks(redis_server.url) >= CACHED // CHUNK, 60,
                   what="node A's chunks to reach the shared Redis")
        assert adapter_status(cache_b.http_url)["store"]["tiers"]["dram"]["chunks"] == 0  # nothing local on B

        before_b = cache_counters(cache_b.http_url)
        redis_hits_before = adapter_status(cache_b.http_url)["store"]["tiers"]["redis"]["hits"]
        started = time.monotonic()
        on_b = greedy(vllm_b, prompt)
        took = time.monotonic() - started
        delta = cache_counters(cache_b.http_url) - before_b
        assert delta.hit_tokens == CACHED, delta  # LMCache's own counters on B
        assert adapter_status(cache_b.http_url)["store"]["tiers"]["redis"]["hits"] - redis_hits_before >= CACHED // CHUNK
        assert on_b == cold
        print(f"node B served {CACHED} of {PROMPT_TOKENS} tokens from the shared Redis in {took:.2f} s")
    finally:
        for cache, vllm in nodes.values():
            vllm.stop()
            cache.stop()
        for shm in shms:
            (SHM_DIR / shm).unlink(missing_ok=True)
