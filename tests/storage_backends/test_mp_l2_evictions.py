"""LMCache's view of our L2 adapter stays right when chunks leave the store on their own: every
chunk the tiered store evicts for good (or Redis evicts behind its back) is reported through
``_notify_keys_deleted`` exactly once, and LMCache's byte accounting equals what is stored."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest
from l2_harness import L2Driver, RecordingListener, memory_obj, object_key

from kvshrink.testing.polling import poll_until
from kvshrink.storage_backends.keys import encode_object_key


def small_store(shm_name: str, ssd_path, chunk_bytes: int, *, write_back: bool = True) -> dict:
    """DRAM of 2 raw chunks + SSD of ~4 compressed ones: 16 chunks overflow both."""
    return {"tiers": [{"kind": "dram", "capacity": int(chunk_bytes * 2.5), "shm_name": shm_name, "codec": "raw"},
                      {"kind": "ssd", "capacity": int(chunk_bytes * 3), "path": str(ssd_path),
                       "write_back": write_back}]}




def wait_quiet(adapter, timeout: float = 60.0) -> None:
    """Wait until the store has no put or background job queued or running."""
    def quiet() -> bool:
        engine = adapter.store_stats()["engine"]
        return engine["put_queue_depth"] == 0 and engine["background_queue_depth"] == 0

    poll_until(quiet, timeout, interval=0.02, what="the store to go quiet",
               error=lambda message: AssertionError(f"{message}: {adapter.store_stats()['engine']}"))


def listed(adapter) -> set:
    """The keys the adapter lists (read from the store's tiers; this reconciles nothing)."""
    keys, cursor = set(), None
    while True:
        page = adapter.list_l2_keys(cursor=cursor)
        keys |= {e.key.to_object_key() for e in page.entries}
        if page.next_page_token is None:
            return keys
        cursor = page.next_page_token


def by_hash(keys) -> list:
    return sorted(keys, key=lambda k: k.chunk_hash)


@pytest.mark.parametrize("write_back", [True, False], ids=["write-back", "demote-on-evict"])
def test_overfilled_store_reports_exactly_the_chunks_it_dropped(open_adapter, tmp_path, shm_name, small_chunks,
                                                                write_back):
    chunk_bytes = small_chunks[0].nbytes
    adapter = open_adapter({"store": small_store(shm_name, tmp_path / "ssd", chunk_bytes, write_back=write_back)})
    listener = RecordingListener()
    adapter.register_listener(listener)
    driver = L2Driver(adapter)
    keys = [object_key(i) for i in range(len(small_chunks))]
    for start in range(0, len(keys), 2):
        batch = slice(start, start + 2)
        assert driver.store(keys[batch], [memory_obj(c) for c in small_chunks[batch]]).is_successful()
        wait_quiet(adapter)

    present = listed(adapter)
    gone = [k for k in keys if k not in present]
    assert len(gone) >= 6, f"the store should be overfull; only {len(gone)} chunks left it"
    assert by_hash(listener.deleted) == by_hash(gone), "each dropped chunk is reported once, and only those"
    assert by_hash(k for k, _ in listener.stored) == keys
    usage = adapter.get_usage()
    assert usage.total_bytes_used == len(present) * chunk_bytes, "LMCache's accounting equals what is stored"
    assert adapter.store_stats()["engine"]["keys_dropped"] == len(gone)

    # LMCache deleting a chunk already reported gone hears nothing new; a present one, once
    survivor = next(iter(present))
    adapter.delete([gone[0], survivor])
    assert listener.deleted[len(gone):] == [survivor]
    assert adapter.get_usage().total_bytes_used == (len(present) - 1) * chunk_bytes
    assert adapter.report_status()["store"]["engine"]["drop_listener_errors"] == 0


def test_racing_stores_loads_deletes_and_evictions_leave_lmcache_in_step(open_adapter, tmp_path, shm_name,
                                                                          small_chunks):
    """LMCache's store controller, prefetch controller and eviction controller at once, on a store
    that evicts all the time: at rest, the keys LMCache was told are stored (stored minus deleted
    notifications) are exactly the keys the store holds, and no key was reported gone twice."""
    chunk_bytes = small_chunks[0].nbytes
    adapter = open_adapter({"store": small_store(shm_name, tmp_path / "ssd", chunk_bytes)})
    listener = RecordingListener()
    adapter.register_listener(listener)
    keys = [object_key(i) for i in range(24)]
    chunk_of = {k: small_chunks[i % len(small_chunks)] for i, k in enumerate(keys)}
    failures: list[BaseException] = []

    def store_controller(rng: random.Random) -> None:
        driver = L2Driver(adapter)  # one per adapter: it pops every finished store result
        for _ in range(24):
            batch = rng.sample(keys, 2)
            driver.store(batch, [memory_obj(chunk_of[k]) for k in batch])

    def prefetch_controller(rng: random.Random) -> None:
        driver = L2Driver(adapter)
        for _ in range(24):
            batch = rng.sample(keys, 3)
            hits = [batch[i] for i in driver.lookup(batch)]
            driver.load(hits, [memory_obj(chunk_of[k]) for k in hits])
            adapter.submit_unlock(batch)

    def eviction_controller(rng: random.Random) -> None:
        for _ in range(24):
            adapter.delete(rng.sample(keys, 1))
            time.sleep(0.01)

    def guarded(fn, seed: int) -> None:
        try:
            fn(random.Random(seed))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=guarded, args=(fn, seed))
               for seed, fn in enumerate((store_controller, prefetch_controller, eviction_controller))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert failures == [] and not any(t.is_alive() for t in threads)
    wait_quiet(adapter)

    net = Counter(k for k, _ in listener.stored)
    net.subtract(listener.deleted)
    assert set(net.values()) <= {0, 1}, f"a key was reported deleted more often than stored: {net}"
    announced = {k for k, n in net.items() if n == 1}
    assert by_hash(announced) == by_hash(listed(adapter))
    assert adapter.get_usage().total_bytes_used == len(announced) * chunk_bytes
    assert adapter.store_stats()["engine"]["keys_dropped"] > 0 and listener.deleted
    assert adapter.report_status()["boundary_errors"] == {}


def test_a_chunk_redis_evicted_is_reported_when_a_lookup_misses_it(open_adapter, redis_url, small_chunks):
    import redis

    adapter = open_adapter({"store": {"tiers": [{"kind": "redis", "url": redis_url, "capacity": 0, "put": True}]}})
    listener = RecordingListener()
    adapter.register_listener(listener)
    driver = L2Driver(adapter)
    keys = [object_key(0), object_key(1)]
    assert driver.store(keys, [memory_obj(c) for c in small_chunks[:2]]).is_successful()
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.delete(b"kvshrink:" + encode_object_key(keys[0])) == 1  # what maxmemory eviction does
    finally:
        client.close()
    assert driver.lookup(keys) == [1]
    adapter.submit_unlock(keys)
    assert listener.deleted == [keys[0]]
    assert driver.lookup(keys) == [1]  # a second miss is not a second report
    adapter.submit_unlock(keys)
    assert listener.deleted == [keys[0]]
    assert adapter.get_usage().total_bytes_used == small_chunks[1].nbytes


def test_a_chunk_left_by_an_earlier_server_is_announced_when_lmcache_stores_it(open_adapter, tmp_path, small_chunks):
    ssd = {"store": {"tiers": [{"kind": "ssd", "path": str(tmp_path / "ssd"), "capacity": "1GiB"}]}}
    keys = [object_key(0), object_key(1)]
    first = open_adapter(ssd)
    assert L2Driver(first).store(keys, [memory_obj(c) for c in small_chunks[:2]]).is_successful()
    first.close()

    second = open_adapter(ssd)
    listener = RecordingListener()
    second.register_listener(listener)
    result = L2Driver(second).store(keys[:1], [memory_obj(small_chunks[0])])
    assert result.is_successful() and result.bytes_transferred() == 0
    assert second.store_stats()["tiers"]["ssd"]["puts"] == 0, "held already: not rewritten"
    assert listener.stored == [(keys[0], small_chunks[0].nbytes)]
    # LMCache was never told about keys[1] in this process: deleting it tells it nothing
    second.delete(keys)
    assert listener.deleted == [keys[0]] and second.get_usage().total_bytes_used == 0
    assert listed(second) == set()

