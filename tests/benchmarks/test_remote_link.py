"""The shaped link of benchmarks/remote_link.py: it limits what crosses it, leaves nothing behind,
and our compressed Redis tier moves fewer bytes through it than stock LMCache's RESP adapter."""

from __future__ import annotations

import subprocess

import pytest
from kvshrink.benchmarks import remote_link as rl
from kvshrink.benchmarks.capacity_replay import chunk_pool
from kvshrink.benchmarks.comparison import OURS, STOCK
from kvshrink.benchmarks.l2_throughput import ThroughputSettings


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def link_or_skip():
    try:
        with rl.limited_link(200) as link:
            yield link
    except rl.LinkUnavailable as exc:
        pytest.skip(f"no shaped link on this machine: {exc}")


def test_the_link_is_shaped_and_ours_moves_two_thirds_of_the_bytes(link_or_skip) -> None:
    pool = chunk_pool(4)
    settings = ThroughputSettings(keys_per_submit=2, rounds=2, warmup_rounds=0)
    stock = rl.run_side(STOCK, link_or_skip, pool, 2, settings).figures
    ours = rl.run_side(OURS, link_or_skip, pool, 2, settings).figures
    line_rate = 200e6 / 8 / 1e9  # GB/s
    assert 0.5 * line_rate < stock["load_gbps"] <= 1.05 * line_rate, stock  # raw bytes: the link is the limit
    assert stock["store_gbps"] <= 1.05 * line_rate, stock
    assert ours["bytes_in_redis_per_token"] <= 0.69 * stock["bytes_in_redis_per_token"], (ours, stock)
    assert ours["load_gbps"] > 1.15 * stock["load_gbps"], (ours, stock)  # fewer bytes through the same link
    assert ours["verified_chunks"] == stock["verified_chunks"] == 4  # every load checked bit-exact


def test_the_link_leaves_nothing_behind_also_after_an_error() -> None:
    try:
        with rl.limited_link(100) as link:
            assert link.netns in _namespaces()
            raise RuntimeError("a benchmark failing inside the link")
    except rl.LinkUnavailable as exc:
        pytest.skip(f"no shaped link on this machine: {exc}")
    except RuntimeError:
        pass
    assert link.netns not in _namespaces()
    devices = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"kvs{link.netns.rsplit('-', 1)[1]}a" not in devices


def test_stored_bytes_counts_the_keys_not_the_writers_query_buffer(redis_server) -> None:
    """What three stored values hold, read right after the writes: Redis's ``used_memory`` would
    then also count the writer's query buffer (~the last value, on redis-server 7.0), above the bound."""
    import redis

    before = rl.stored_bytes(redis_server)
    client = redis.Redis(host=redis_server.host, port=redis_server.port)
    try:
        for i in range(3):
            client.set(f"chunk-{i}", bytes([i]) * 4_000_000)
    finally:
        client.close()
    grown, keys = rl.stored_bytes(redis_server)
    assert before == (0, 0) and keys == 3
    assert 12_000_000 <= grown <= 1.1 * 12_000_000, grown  # three values, their keys, jemalloc size classes
