"""Prefetch hints and idle demotion on a real store (DRAM arena in /dev/shm + SSD files).

Timing is made deterministic by holding the first tier's write lock (``store._write_locks[0]``):
a prefetch move that holds a running slot then waits inside the store's real write path, exactly
where a slow move would be, so the tests can see what a read or a hint does meanwhile."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvshrink.errors import ConfigError
from kvshrink.store import StoreConfig, TieredStore


def tiers(tmp_path, shm_name, dram_chunks: int = 16) -> list[dict]:
    return [{"kind": "dram", "capacity": int((dram_chunks + 0.5) * 1.5 * 2**20), "shm_name": shm_name, "codec": "raw"},
            {"kind": "ssd", "capacity": "256MiB", "path": str(tmp_path / "ssd"), "fsync": False}]


def on_ssd(tmp_path, chunks, keys) -> None:
    """Write ``keys`` straight to the SSD directory (an SSD-only store), as an earlier process
    whose DRAM chunks were demoted would have left them."""
    with TieredStore.from_config({"tiers": [tiers(tmp_path, "unused")[1]]}) as ssd_only:
        for key, chunk in zip(keys, chunks):
            assert ssd_only.put(key, chunk).result(timeout=60) is True


def open_store(tmp_path, shm_name, dram_chunks: int = 16, **sections) -> TieredStore:
    return TieredStore.from_config({"promote_on_hit": False, "tiers": tiers(tmp_path, shm_name, dram_chunks),
                                    **sections})


def engine(store: TieredStore) -> dict:
    return store.stats()["engine"]


@pytest.fixture
def keys():
    return [b"chunk-%02d" % i for i in range(6)]


def test_prefetch_moves_ssd_chunks_up_and_the_read_that_follows_reads_dram_only(tmp_path, shm_name, small_chunks,
                                                                               keys):
    on_ssd(tmp_path, small_chunks, keys)
    with open_store(tmp_path, shm_name) as store:
        assert [store.where(k) for k in keys] == ["ssd"] * 6
        result = store.prefetch(keys).wait(timeout=60)
        assert (result.requested, result.queued, result.moved) == (6, 6, 6)
        assert [store.where(k) for k in keys] == ["dram"] * 6
        assert store.keys("ssd") == []  # moved, not copied: the SSD is exclusive
        got = store.get_many(keys)
        assert all(np.array_equal(g, c) for g, c in zip(got, small_chunks))
        stats = store.stats()
        assert stats["tiers"]["ssd"]["hits"] == 0 and stats["tiers"]["dram"]["hits"] == 6
        e = stats["engine"]
        assert (e["prefetch_issued"], e["prefetch_moved"], e["prefetch_useful"], e["prefetch_wasted"]) == (6, 6, 6, 0)


def test_a_hint_for_a_prefix_not_cached_or_partly_cached_ends_cleanly(tmp_path, shm_name, small_chunks, keys):
    on_ssd(tmp_path, small_chunks[:2], keys[:2])
    with open_store(tmp_path, shm_name) as store:
        assert store.put(keys[2], small_chunks[2]).result(timeout=60) is True  # already in DRAM
        result = store.prefetch(keys).wait(timeout=60)  # 2 on SSD, 1 in DRAM, 3 nowhere
        assert (result.moved, result.skipped, result.missing, result.queued) == (2, 1, 3, 5)
        assert store.prefetch([b"never-%d" % i for i in range(4)]).wait(timeout=60).missing == 4
        assert store.prefetch([]).wait(timeout=1).requested == 0
        e = engine(store)
        assert e["prefetch_missing"] == 7 and e["prefetch_errors"] == 0 and e["prefetch_pending"] == 0


def test_a_chunk_evicted_before_its_move_ran_is_missing_and_one_evicted_unread_is_wasted(tmp_path, shm_name,
                                                                                       small_chunks, keys):
    on_ssd(tmp_path, small_chunks, keys)
    with open_store(tmp_path, shm_name, dram_chunks=8, prefetch={"max_in_flight": 1}) as store:  # a hint: ~5
        with store._write_locks[0]:  # the first move waits in the write path; the rest stay queued
            handle = store.prefetch(keys[:4])
            assert store.delete(keys[3])  # gone from the SSD before its move ran
        result = handle.wait(timeout=60)
        assert (result.moved, result.missing) == (3, 1)
        for i, chunk in enumerate(small_chunks[6:]):  # ten new puts evict the three moved chunks
            assert store.put(b"fresh-%d" % i, chunk).result(timeout=60) is True
        store.flush(timeout=60)
        assert [store.where(k) for k in keys[:3]] == ["ssd"] * 3  # demoted, not lost
        e = engine(store)
        assert (e["prefetch_wasted"], e["prefetch_useful"]) == (3, 0)


def test_a_read_waits_for_a_running_move_and_takes_over_queued_ones(tmp_path, shm_name, small_chunks, keys):
    on_ssd(tmp_path, small_chunks, keys)
    with open_store(tmp_path, shm_name, prefetch={"max_in_flight": 1}) as store:
        got: list = []
        with store._write_locks[0]:
            handle = store.prefetch(keys[:4])  # keys[0] moving (held at the lock), keys[1:4] queued
            reader = threading.Thread(target=lambda: got.append(store.get(keys[0])))
            reader.start()
            reader.join(0.5)
            assert reader.is_alive(), "the read of a chunk being moved must wait for that move"
            taken = store.get_many(keys[1:4])  # queued: the reader reads them itself, once
            assert all(np.array_equal(g, c) for g, c in zip(taken, small_chunks[1:4]))
        reader.join(60)
        assert np.array_equal(got[0], small_chunks[0])
        result = handle.wait(timeout=60)
        assert (result.moved, result.cancelled) == (1, 3)
        stats = store.stats()
        # every chunk read once: keys[0] from DRAM after its move, keys[1:4] from the SSD
        assert stats["tiers"]["ssd"]["hits"] == 3 and stats["tiers"]["dram"]["hits"] == 1
        assert stats["engine"]["prefetch_moved"] == 1 and stats["engine"]["prefetch_useful"] == 1
        assert [store.where(k) for k in keys[:4]] == ["dram", "ssd", "ssd", "ssd"]


def test_ten_thousand_hints_at_once_are_bounded_dropped_and_counted(tmp_path, shm_name, small_chunks, keys):
    on_ssd(tmp_path, small_chunks, keys[:2])
    with open_store(tmp_path, shm_name, prefetch={"max_in_flight": 2, "max_pending": 64, "depth": 8}) as store:
        with store._write_locks[0]:  # two real moves hold both running slots
            handles = [store.prefetch([k]) for k in keys[:2]]
            handles += [store.prefetch([b"session-%05d" % i]) for i in range(9998)]
            e = engine(store)
            assert (e["prefetch_running"], e["prefetch_pending"]) == (2, 64)
            assert (e["prefetch_issued"], e["prefetch_dropped"]) == (66, 9998 - 64)
            assert sum(h.done() for h in handles) == 9998 - 64  # dropped hints are settled at once
            wide = store.prefetch([b"wide-%d" % i for i in range(20)])  # beyond depth 8
            assert wide.result.dropped == 20
        assert all(h.wait(timeout=60) for h in handles)
        assert engine(store)["prefetch_pending"] == 0


def test_cancel_takes_a_hints_queued_chunks_off_the_queue(tmp_path, shm_name, small_chunks, keys):
    on_ssd(tmp_path, small_chunks, keys)
    with open_store(tmp_path, shm_name, prefetch={"max_in_flight": 1}) as store:
        with store._write_locks[0]:
            handle = store.prefetch(keys)
            assert handle.cancel() == 5
        result = handle.wait(timeout=60)
        assert (result.moved, result.cancelled) == (1, 5)
        assert store.keys("dram") == [keys[0]] and engine(store)["prefetch_cancelled"] == 5


def test_idle_chunks_move_down_compressed_but_never_a_pinned_one(tmp_path, shm_name, small_chunks, keys):
    idle = {"after_s": 0.4, "scan_interval_s": 0.1}
    with open_store(tmp_path, shm_name, idle_demotion=idle) as store:
        for key, chunk in zip(keys[:4], small_chunks):
            assert store.put(key, chunk).result(timeout=60) is True
        assert store.lock([keys[0]]) == [True]  # a lookup in progress
        deadline = time.monotonic() + 30
        while engine(store)["idle_demotions"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [store.where(k) for k in keys[:4]] == ["dram", "ssd", "ssd", "ssd"]
        e = engine(store)
        assert e["idle_demotions"] == 3 and e["idle_skipped_pinned"] >= 1
        assert store.stats()["tiers"]["dram"]["demotions"] == 3
        ssd = store.stats()["tiers"]["ssd"]
        assert ssd["bytes_stored"] < 3 * small_chunks[0].nbytes  # compressed on the way down
        store.unlock([keys[0]])
        while store.where(keys[0]) != "ssd" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.where(keys[0]) == "ssd"
        # the session resumes: a hint brings it back, a read finds every chunk intact
        assert store.prefetch(keys[:4]).wait(timeout=60).moved == 4
        got = store.get_many(keys[:4])
        assert all(np.array_equal(g, c) for g, c in zip(got, small_chunks))


def test_a_chunk_read_often_is_not_idle(tmp_path, shm_name, small_chunks, keys):
    idle = {"after_s": 0.5, "scan_interval_s": 0.1}
    with open_store(tmp_path, shm_name, idle_demotion=idle) as store:
        for key, chunk in zip(keys[:2], small_chunks):
            assert store.put(key, chunk).result(timeout=60) is True
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            assert store.get(keys[0]) is not None
            time.sleep(0.1)
        assert store.where(keys[0]) == "dram" and store.where(keys[1]) == "ssd"


@pytest.mark.parametrize(("section", "key"), [
    ({"prefetch": {"max_in_flight": 0}}, "prefetch.max_in_flight"),
    ({"prefetch": {"depth": -1}}, "prefetch.depth"),
    ({"prefetch": {"bound": 3}}, "prefetch.bound"),
    ({"idle_demotion": {"after_s": "5"}}, "idle_demotion.after_s"),
    ({"idle_demotion": {"scan_interval_s": 0}}, "idle_demotion.scan_interval_s"),
])
def test_bad_settings_name_their_key(tmp_path, shm_name, section, key):
    with pytest.raises(ConfigError) as info:
        StoreConfig.load({"tiers": tiers(tmp_path, shm_name), **section})
    assert info.value.key == key


def test_idle_demotion_needs_a_tier_below(tmp_path, shm_name):
    with pytest.raises(ConfigError) as info:
        StoreConfig.load({"tiers": tiers(tmp_path, shm_name)[:1], "idle_demotion": {"after_s": 5}})
    assert info.value.key == "idle_demotion.after_s"


def test_prefetch_and_idle_counters_reach_prometheus_as_counters(tmp_path, shm_name):
    from prometheus_client import CollectorRegistry, generate_latest

    from kvshrink.store import StoreCollector

    with open_store(tmp_path, shm_name, idle_demotion={"after_s": 60}) as store:
        store.prefetch([b"absent"]).wait(timeout=60)
        registry = CollectorRegistry()
        registry.register(StoreCollector(store.stats))
        text = generate_latest(registry).decode()
    assert "# TYPE kvshrink_store_engine_prefetch_missing_total counter" in text
    assert "kvshrink_store_engine_prefetch_missing_total 1.0" in text
    assert "# TYPE kvshrink_store_engine_idle_demotions_total counter" in text
    assert "# TYPE kvshrink_store_engine_prefetch_pending gauge" in text


def test_idle_chunks_go_down_to_redis_and_a_hint_brings_them_back(tmp_path, shm_name, small_chunks, keys,
                                                                  redis_server):
    cfg = {"promote_on_hit": False, "idle_demotion": {"after_s": 0.3, "scan_interval_s": 0.1},
           "tiers": [tiers(tmp_path, shm_name)[0],
                     {"kind": "redis", "url": redis_server.url, "namespace": f"t{shm_name[-8:]}"}]}
    with TieredStore.from_config(cfg) as store:
        for key, chunk in zip(keys[:3], small_chunks):
            assert store.put(key, chunk).result(timeout=60) is True
        deadline = time.monotonic() + 30
        while engine(store)["idle_demotions"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        store.flush(timeout=60)  # parked chunks land in Redis
        assert [store.where(k) for k in keys[:3]] == ["redis"] * 3 and store.keys("dram") == []
        result = store.prefetch(keys[:4]).wait(timeout=60)  # keys[3] was never stored
        assert (result.moved, result.missing) == (3, 1)
        assert [store.where(k) for k in keys[:3]] == ["dram"] * 3  # the Redis copies are hidden: moved
        got = store.get_many(keys[:3])
        assert all(np.array_equal(g, c) for g, c in zip(got, small_chunks))
        assert store.stats()["tiers"]["redis"]["hits"] == 0 and engine(store)["prefetch_useful"] == 3


def test_hints_reads_puts_and_idle_demotion_at_once_lose_nothing(tmp_path, shm_name, small_chunks):
    """Hints, reads under lookups (pins) and re-puts of the same content race with idle demotion
    on a DRAM tier that holds 8 of 16 chunks: no read misses, every chunk stays held and
    bit-exact, and none ends in both tiers (a planned eviction victim pinned between the plan
    and the eviction, or a re-put of a chunk on the SSD: test_store_races.py forces each)."""
    import random

    keys = [b"race-%02d" % i for i in range(16)]
    chunk_of = dict(zip(keys, small_chunks))
    on_ssd(tmp_path, small_chunks, keys)
    idle = {"after_s": 0.05, "scan_interval_s": 0.02}
    with open_store(tmp_path, shm_name, dram_chunks=8, idle_demotion=idle, prefetch={"max_in_flight": 2}) as store:
        stop = time.monotonic() + 3.0
        errors: list[str] = []

        def hinter(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < stop:
                start = rng.randrange(12)
                store.prefetch(keys[start:start + rng.randrange(1, 5)])
                time.sleep(rng.random() * 0.02)

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < stop:
                batch = rng.sample(keys, 2)  # two readers pin 4 chunks at most: DRAM always has room
                found = store.lock(batch)
                try:
                    for key, got in zip(batch, store.get_many(batch)):
                        if got is None or not np.array_equal(got, chunk_of[key]):
                            errors.append(f"{key!r} read {'nothing' if got is None else 'wrong data'}")
                finally:
                    store.unlock([k for k, hit in zip(batch, found) if hit])

        def re_putter(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < stop:
                key = rng.choice(keys)
                if store.put(key, chunk_of[key]).result(timeout=60) is not True:
                    errors.append(f"a re-put of {key!r} was dropped")
                time.sleep(rng.random() * 0.02)

        threads = [threading.Thread(target=hinter, args=(i,)) for i in range(2)]
        threads += [threading.Thread(target=reader, args=(10 + i,)) for i in range(2)]
        threads.append(threading.Thread(target=re_putter, args=(20,)))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        store.flush(timeout=60)
        assert errors == []
        assert [store.where(k) is not None for k in keys] == [True] * 16  # (idle demotion still runs)
        with store._write_locks[0]:  # holds idle demotion and prefetch moves, which copy before they remove
            both = set(store.keys("dram")) & set(store.keys("ssd"))
        assert both == set(), f"{sorted(both)} are in both tiers"
        assert all(np.array_equal(g, chunk_of[k]) for k, g in zip(keys, store.get_many(keys)))
        e = engine(store)
        assert e["prefetch_errors"] == 0 and e["background_errors"] == 0 and e["keys_dropped"] == 0
        assert e["prefetch_moved"] > 0 and e["idle_demotions"] > 0


def test_flush_waits_for_prefetch_moves(tmp_path, shm_name, small_chunks, keys):
    on_ssd(tmp_path, small_chunks, keys)
    with open_store(tmp_path, shm_name, prefetch={"max_in_flight": 1}) as store:
        handle = store.prefetch(keys)
        store.flush(timeout=60)
        assert handle.done() and store.keys("ssd") == []


def test_a_hint_bigger_than_the_first_tier_moves_only_what_it_holds_and_wastes_none(tmp_path, shm_name,
                                                                                    small_chunks, keys):
    on_ssd(tmp_path, small_chunks, keys)
    with open_store(tmp_path, shm_name, dram_chunks=2) as store:  # room for ~2 of the 6 (~1.5 MiB raw each)
        result = store.prefetch(keys).wait(timeout=60)
        assert 1 <= result.moved <= 2 and result.dropped == 6 - result.queued, result  # the head of the prefix
        assert [store.where(k) for k in keys[:result.moved]] == ["dram"] * result.moved
        got = store.get_many(keys)  # the rest is read from the SSD where it stayed
        assert all(np.array_equal(g, c) for g, c in zip(got, small_chunks))
        e = engine(store)
        assert e["prefetch_wasted"] == 0 and e["prefetch_useful"] == result.moved, e
