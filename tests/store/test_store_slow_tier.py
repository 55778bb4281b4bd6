"""A slow or hung Redis never holds up a put to DRAM, and never turns into drop notices for chunks
it may still hold: with write_back on Redis, DRAM puts (and the evictions they cause) stay local
while redis-server is stopped with SIGSTOP, and the store catches up once it runs again."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np

from kvshrink.store import TieredStore

PUT_DEADLINE_S = 0.3  # Redis timeout_s stays at its default 0.5: one Redis call would overrun this


def dram_redis(shm_name: str, url: str, chunk_bytes: int, *, write_back: bool) -> dict:
    return {"promote_on_hit": False, "persist_on_close": False,
            "tiers": [{"kind": "dram", "capacity": int(chunk_bytes * 2.5), "shm_name": shm_name, "codec": "raw"},
                      {"kind": "redis", "url": url, "write_back": write_back,
                       "namespace": f"slow-{uuid.uuid4().hex[:8]}"}]}


class Drops:
    """A drop listener that keeps the keys it hears."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self._lock = threading.Lock()

    def __call__(self, keys: list[bytes]) -> None:
        with self._lock:
            self.keys += keys


def redis_holds(server, namespace: str, keys: list[bytes]) -> list[bool]:
    """Asked of redis-server directly, not through the store."""
    import redis

    client = redis.Redis.from_url(server.url)
    try:
        return [bool(client.exists(namespace.encode() + b":" + k)) for k in keys]
    finally:
        client.close()


def test_dram_puts_stay_fast_and_send_no_false_drops_while_redis_hangs(redis_server, shm_name, small_chunks):
    cfg = dram_redis(shm_name, redis_server.url, small_chunks[0].nbytes, write_back=True)
    namespace = cfg["tiers"][1]["namespace"]
    before = [b"before%d" % i for i in range(4)]
    during = [b"during%d" % i for i in range(8)]
    chunk_of = dict(zip(before + during, small_chunks))
    drops = Drops()
    with TieredStore.from_config(cfg) as store:
        store.add_drop_listener(drops)
        for key in before:
            assert store.put(key, chunk_of[key]).result(timeout=60) is True
        store.flush(timeout=60)
        assert redis_holds(redis_server, namespace, before) == [True] * len(before)

        redis_server.pause()
        try:
            took = []
            for key in during:  # each put evicts from DRAM: written-back chunks, then unwritten ones
                start = time.perf_counter()
                assert store.put(key, chunk_of[key]).result(timeout=30) is True
                took.append(time.perf_counter() - start)
                got = store.get(key)  # from DRAM, with no Redis round trip
                assert got is not None and np.array_equal(got, chunk_of[key])
            # a chunk evicted before its write-back ran is still served, from memory, not Redis
            start = time.perf_counter()
            early = store.get_many(during[:4])
            read_s = time.perf_counter() - start
            time.sleep(1.2)  # let a write-back run into Redis's timeout
        finally:
            redis_server.resume()
        assert max(took) < PUT_DEADLINE_S, f"DRAM puts took {[round(t, 3) for t in took]} s while Redis hung"
        assert all(g is not None and np.array_equal(g, chunk_of[k]) for g, k in zip(early, during))
        assert read_s < PUT_DEADLINE_S, f"reading chunks waiting for Redis took {read_s:.3f} s"

        store.flush(timeout=120)
        stats = store.stats()
        assert stats["tiers"]["redis"]["errors"] > 0, "the test did not make a Redis call time out"
        reported = sorted(set(drops.keys))
        held = dict(zip(reported, redis_holds(redis_server, namespace, reported)))
        assert [k for k, h in held.items() if h] == [], "drop notices for chunks Redis still holds"
        # the store recovered: every chunk is in Redis again or still in DRAM, and reads back exact
        keys = before + during
        assert all(k in store.keys() for k in keys)
        assert all(np.array_equal(c, chunk_of[k]) for c, k in zip(store.get_many(keys), keys))
        assert store.put(b"after", small_chunks[12]).result(timeout=60) is True
        store.flush(timeout=60)
        assert redis_holds(redis_server, namespace, [b"after"]) == [True]
        assert drops.keys == []


def test_a_chunk_gone_from_every_tier_is_reported_only_once_redis_can_say_so(redis_server, shm_name, small_chunks):
    """DRAM + exclusive Redis, reopened: the new process cannot know whether Redis holds the
    chunks the arena kept. A DRAM chunk that fails verification is gone unless Redis has a copy:
    while Redis hangs the store cannot tell, so it says nothing; once Redis answers that it lacks
    the key, the drop is reported."""
    cfg = dram_redis(shm_name, redis_server.url, small_chunks[0].nbytes, write_back=False)
    keys = [b"k0", b"k1", b"k2"]
    with TieredStore.from_config(cfg) as store:
        for key, chunk in zip(keys, small_chunks):
            assert store.put(key, chunk).result(timeout=60) is True
        store.flush(timeout=60)
        assert set(store.keys("dram")) == {b"k1", b"k2"}  # k0 was demoted to Redis
    drops = Drops()
    with TieredStore.from_config(cfg) as store:  # the arena survived: k1 and k2 are in DRAM only
        store.add_drop_listener(drops)
        dram = store.tiers[0]

        def scribble(key: bytes) -> None:  # another writer damaging the arena under the chunk
            block = dram._blocks[key]
            with open(dram.path, "r+b") as f:
                f.seek(block.payload_offset + block.frame_len // 2)
                f.write(bytes(64))

        scribble(b"k1")
        redis_server.pause()
        try:
            assert store.get(b"k1") is None  # DRAM quarantines it; Redis does not answer
            store.flush(timeout=60)
        finally:
            redis_server.resume()
        assert drops.keys == [], "reported while Redis could not say whether it holds the chunk"
        scribble(b"k2")
        assert store.get(b"k2") is None
        store.flush(timeout=60)
        assert drops.keys == [b"k2"]
        assert np.array_equal(store.get(b"k0"), small_chunks[0])
        assert store.stats()["tiers"]["dram"]["quarantined"] == 2


def test_evicted_chunks_wait_in_memory_while_redis_is_down_and_land_when_it_is_back(redis_server, shm_name,
                                                                                   small_chunks):
    """redis-server killed: every write to it is refused at once. Chunks DRAM evicts meanwhile
    stay readable from memory, are neither lost nor reported, and reach Redis once it restarts."""
    cfg = dram_redis(shm_name, redis_server.url, small_chunks[0].nbytes, write_back=True)
    namespace = cfg["tiers"][1]["namespace"]
    keys = [b"down%d" % i for i in range(6)]
    drops = Drops()
    with TieredStore.from_config(cfg) as store:
        store.add_drop_listener(drops)
        redis_server.kill()
        for key, chunk in zip(keys, small_chunks):
            assert store.put(key, chunk).result(timeout=30) is True
        store.flush(timeout=60)  # the write-backs and a try of the parked chunks are refused
        evicted = [k for k in keys if not store.tiers[0].contains(k)]
        assert len(evicted) >= 3 and store.stats()["tiers"]["redis"]["errors"] > 0
        assert [store.where(k) for k in evicted] == ["redis"] * len(evicted)  # parked, bound there
        got = store.get_many(keys)
        assert all(g is not None and np.array_equal(g, c) for g, c in zip(got, small_chunks))
        redis_server.start()
        store.flush(timeout=60)
        assert redis_holds(redis_server, namespace, evicted) == [True] * len(evicted)
        assert not store._ledger.parked and store._ledger._moves == {}  # all landed, nothing pending
        assert all(np.array_equal(g, c) for g, c in zip(store.get_many(keys), small_chunks))
        assert drops.keys == []


def test_beyond_the_parking_budget_the_oldest_chunks_are_given_up_and_reported(redis_server, shm_name,
                                                                               small_chunks):
    """Parked chunks live in memory, so they have a budget (engine.staging_bytes): beyond it the
    oldest are given up. Those are reported dropped, and the store never serves them again, even
    from a Redis that comes back."""
    cfg = dram_redis(shm_name, redis_server.url, small_chunks[0].nbytes, write_back=True)
    cfg["engine"] = {"staging_bytes": int(small_chunks[0].nbytes * 3.5)}  # ~3 parked raw chunks
    keys = [b"many%d" % i for i in range(8)]
    drops = Drops()
    with TieredStore.from_config(cfg) as store:
        store.add_drop_listener(drops)
        redis_server.kill()
        for key, chunk in zip(keys, small_chunks):
            assert store.put(key, chunk).result(timeout=30) is True
        store.flush(timeout=60)
        given_up = sorted(set(drops.keys))
        assert 1 <= len(given_up) <= 4, given_up
        held = [k for k in keys if k not in given_up]
        assert sorted(store.keys()) == sorted(held)
        redis_server.start()
        store.flush(timeout=60)
        for key, chunk in zip(keys, small_chunks):
            got = store.get(key)
            assert (got is None) if key in given_up else np.array_equal(got, chunk), key
        assert sorted(set(drops.keys)) == given_up
