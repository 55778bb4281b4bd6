"""TieredStore end to end on real tiers: puts, batched reads, demotion, write-back, promotion,
backpressure, pinning, stats."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from kvshrink.errors import StoreUnavailableError
from kvshrink.store import StoreCollector, TieredStore

MiB = 2**20


def config(tmp_path, shm_name, *, dram=64 * MiB, ssd=512 * MiB, write_back=True, engine=None, promote=True):
    return {"promote_on_hit": promote, "engine": engine or {},
            "tiers": [{"kind": "dram", "capacity": dram, "shm_name": shm_name, "codec": "raw"},
                      {"kind": "ssd", "capacity": ssd, "path": str(tmp_path / "ssd"), "write_back": write_back}]}


@pytest.fixture
def make_store(tmp_path, shm_name):
    stores = []

    def make(**kwargs):
        store = TieredStore.from_config(config(tmp_path, shm_name, **kwargs))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def test_put_get_round_trip_and_where(make_store, real_chunks):
    store = make_store()
    futures = [store.put(b"k%d" % i, c) for i, c in enumerate(real_chunks[:4])]
    assert all(f.result(timeout=60) is True for f in futures)
    for i, chunk in enumerate(real_chunks[:4]):
        assert np.array_equal(store.get(b"k%d" % i), chunk)
        assert store.contains(b"k%d" % i) and store.where(b"k%d" % i) == "dram"
    assert store.get(b"missing") is None and not store.contains(b"missing")


def test_put_copies_the_caller_buffer_and_never_modifies_it(make_store, real_chunks):
    store = make_store()
    mine = real_chunks[0].copy()
    future = store.put(b"k", mine)
    assert np.array_equal(mine, real_chunks[0])
    mine[:] = 0  # the caller reuses its buffer at once
    assert future.result(timeout=60)
    assert np.array_equal(store.get(b"k"), real_chunks[0])


def test_write_back_reaches_the_ssd_in_the_background(make_store, real_chunks):
    store = make_store()
    store.put(b"k", real_chunks[0]).result(timeout=60)
    store.flush(timeout=60)
    ssd = store.tiers[1]
    assert ssd.contains(b"k")
    assert np.array_equal(ssd.get(b"k"), real_chunks[0])
    assert ssd.stats()["put_bytes"] < real_chunks[0].nbytes / 1.4  # compressed on SSD


def test_eviction_demotes_instead_of_losing(make_store, real_chunks):
    chunk_bytes = real_chunks[0].nbytes
    store = make_store(dram=int(chunk_bytes * 2.5), write_back=False)
    for i, chunk in enumerate(real_chunks[:6]):
        assert store.put(b"k%d" % i, chunk).result(timeout=60)
    store.flush(timeout=60)
    stats = store.stats()["tiers"]
    assert stats["dram"]["chunks"] == 2 and stats["ssd"]["chunks"] == 4
    assert stats["dram"]["demotions"] == 4
    for i, chunk in enumerate(real_chunks[:6]):
        assert np.array_equal(store.get(b"k%d" % i), chunk), i


def test_readers_never_find_a_chunk_in_no_tier_while_chunks_move(make_store, small_chunks):
    """Promotions evict from DRAM and demote to SSD all the time here; a chunk is copied below
    before it leaves DRAM, so concurrent readers always find it somewhere."""
    import threading

    store = make_store(dram=int(small_chunks[0].nbytes * 2.5), write_back=False)
    keys = [b"k%d" % i for i in range(6)]
    for key, chunk in zip(keys, small_chunks):
        store.put(key, chunk).result(timeout=60)
    misses: list[bytes] = []

    def reader(offset: int) -> None:
        for round_ in range(6):
            for i in range(len(keys)):
                key = keys[(i + offset) % len(keys)]
                got = store.get(key)
                if got is None or not np.array_equal(got, small_chunks[keys.index(key)]):
                    misses.append(key)

    threads = [threading.Thread(target=reader, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.flush(timeout=60)
    assert misses == []
    assert store.stats()["engine"]["promotions"] > 0 and store.stats()["tiers"]["dram"]["demotions"] > 0


def test_hit_below_is_promoted(make_store, real_chunks):
    store = make_store(dram=int(real_chunks[0].nbytes * 2.5), write_back=False)
    for i, chunk in enumerate(real_chunks[:3]):
        store.put(b"k%d" % i, chunk).result(timeout=60)
    store.flush(timeout=60)
    assert store.where(b"k0") == "ssd"
    assert np.array_equal(store.get(b"k0"), real_chunks[0])
    store.flush(timeout=60)
    assert store.where(b"k0") == "dram"
    assert store.stats()["engine"]["promotions"] == 1


def test_get_many_mixes_tiers_misses_and_caller_buffers(make_store, real_chunks):
    store = make_store(dram=int(real_chunks[0].nbytes * 3.5), write_back=False, promote=False)
    for i, chunk in enumerate(real_chunks[:8]):
        store.put(b"k%d" % i, chunk).result(timeout=60)
    store.flush(timeout=60)
    keys = [b"k%d" % i for i in range(8)] + [b"nope"]
    assert {store.where(k) for k in keys[:8]} == {"dram", "ssd"}
    outs = [np.empty_like(real_chunks[0]) for _ in keys]
    got = store.get_many(keys, outs)
    for i in range(8):
        assert got[i] is outs[i] and np.array_equal(outs[i], real_chunks[i])
    assert got[8] is None
    plain = store.get_many(keys[:3])
    assert all(np.array_equal(plain[i], real_chunks[i]) for i in range(3))
    with pytest.raises(ValueError, match="output buffers"):
        store.get_many(keys, outs[:2])


def test_header_then_get_into(make_store, real_chunks):
    store = make_store()
    store.put(b"k", real_chunks[1]).result(timeout=60)
    header = store.header(b"k")
    assert tuple(header.shape) == real_chunks[1].shape
    out = np.empty(header.shape, dtype=np.dtype(header.dtype))
    assert store.get_into(b"k", out) and np.array_equal(out, real_chunks[1])
    assert store.header(b"nope") is None and store.get_into(b"nope", out) is False


def test_torch_tensor_round_trip(make_store, real_chunks):
    torch = pytest.importorskip("torch")
    store = make_store()
    tensor = torch.from_numpy(real_chunks[0].copy()).view(torch.bfloat16)
    store.put(b"t", tensor).result(timeout=60)
    store.flush(timeout=60)
    for tier in store.tiers:
        got = tier.get(b"t")
        assert isinstance(got, torch.Tensor) and torch.equal(got.view(torch.uint16), tensor.view(torch.uint16))
    out = torch.empty_like(tensor)
    assert store.get_into(b"t", out) and torch.equal(out.view(torch.uint16), tensor.view(torch.uint16))


def test_full_queue_drops_and_the_caller_never_waits(make_store, real_chunks):
    store = make_store(engine={"put_workers": 1, "put_queue": 2, "staging_bytes": "1GiB"}, write_back=False)
    call_times, futures = [], []
    for i in range(24):
        start = time.perf_counter()
        futures.append(store.put(b"k%d" % i, real_chunks[i % 8]))
        call_times.append(time.perf_counter() - start)
    results = [f.result(timeout=120) for f in futures]
    dropped = results.count(False)
    stats = store.stats()["engine"]
    assert dropped > 0 and stats["dropped_queue_full"] == dropped
    mean_call = sum(call_times) / len(call_times)
    assert max(call_times) < 0.25, f"a put blocked the caller for {max(call_times):.3f} s"
    assert mean_call < 0.05
    for i, ok in enumerate(results):
        got = store.get(b"k%d" % i)
        assert (got is not None and np.array_equal(got, real_chunks[i % 8])) if ok else got is None


def test_staging_budget_drops_when_spent(make_store, real_chunks):
    store = make_store(engine={"staging_bytes": int(real_chunks[0].nbytes * 1.5), "put_workers": 1})
    futures = [store.put(b"k%d" % i, real_chunks[i]) for i in range(4)]
    results = [f.result(timeout=60) for f in futures]
    assert results[0] is True and False in results
    assert store.stats()["engine"]["dropped_staging_full"] == results.count(False)


def test_same_key_in_flight_shares_one_future(make_store, real_chunks):
    store = make_store()
    first = store.put(b"k", real_chunks[0])
    second = store.put(b"k", real_chunks[0])
    assert second is first or first.done()
    assert first.result(timeout=60) and second.result(timeout=60)


def test_locked_chunks_stay_in_dram(make_store, real_chunks):
    store = make_store(dram=int(real_chunks[0].nbytes * 2.5), write_back=False, promote=False)
    store.put(b"keep", real_chunks[0]).result(timeout=60)
    assert store.lock([b"keep", b"absent"]) == [True, False]
    for i, chunk in enumerate(real_chunks[1:5]):
        store.put(b"k%d" % i, chunk).result(timeout=60)
    assert store.where(b"keep") == "dram"
    store.unlock([b"keep", b"absent", b"never-locked"])
    for i, chunk in enumerate(real_chunks[5:8]):
        store.put(b"j%d" % i, chunk).result(timeout=60)
    store.flush(timeout=60)
    assert store.where(b"keep") == "ssd"


def test_delete_removes_from_every_tier(make_store, real_chunks):
    store = make_store()
    store.put(b"k", real_chunks[0]).result(timeout=60)
    store.flush(timeout=60)
    assert store.tiers[1].contains(b"k")
    assert store.delete(b"k") is True and store.delete(b"k") is False
    assert store.get(b"k") is None and store.keys() == []


def test_tier_refusal_fails_the_future_and_is_counted(make_store, real_chunks):
    store = make_store(dram=MiB)  # smaller than one chunk
    future = store.put(b"big", real_chunks[0])
    with pytest.raises(StoreUnavailableError):
        future.result(timeout=60)
    stats = store.stats()
    assert stats["engine"]["put_errors"] == 1 and stats["tiers"]["dram"]["errors"] == 1


def test_bad_input_is_rejected_and_nothing_is_stored(make_store, real_chunks):
    store = make_store()
    with pytest.raises(TypeError):
        store.put("text-key", real_chunks[0])
    with pytest.raises(TypeError):
        store.put(b"k", [1, 2, 3])
    with pytest.raises(ValueError):
        store.put(b"", real_chunks[0])
    assert store.keys() == [] and store.stats()["engine"]["staging_bytes_in_use"] == 0


def test_stats_are_exported_to_prometheus(make_store, real_chunks):
    from prometheus_client import CollectorRegistry, generate_latest

    store = make_store()
    store.put(b"k", real_chunks[0]).result(timeout=60)
    store.get(b"k")
    store.get(b"nope")
    registry = CollectorRegistry()
    registry.register(StoreCollector(store.stats))
    text = generate_latest(registry).decode()
    assert 'kvshrink_store_tier_hits_total{tier="dram"} 1.0' in text
    assert 'kvshrink_store_tier_misses_total{tier="ssd"} 1.0' in text
    assert "kvshrink_store_engine_dropped_queue_full_total 0.0" in text
    assert 'kvshrink_store_tier_bytes_stored{tier="dram"}' in text


def test_reopen_after_close_keeps_both_tiers(tmp_path, shm_name, real_chunks):
    cfg = config(tmp_path, shm_name)
    with TieredStore.from_config(cfg) as store:
        store.put(b"k", real_chunks[0]).result(timeout=60)
    with TieredStore.from_config(cfg) as store:
        assert store.tiers[0].contains(b"k") and store.tiers[1].contains(b"k")
        assert np.array_equal(store.get(b"k"), real_chunks[0])


@pytest.mark.parametrize("persist", [True, False])
def test_exclusive_tiers_keep_dram_only_chunks_on_ssd_after_a_clean_close(tmp_path, shm_name, real_chunks, persist):
    """No write-back: chunks live in DRAM only until evicted. ``persist_on_close`` copies them to
    the SSD on close, so they survive losing /dev/shm (a reboot); without it they do not."""
    cfg = {**config(tmp_path, shm_name, dram=24 * MiB, ssd=18 * MiB, write_back=False), "persist_on_close": persist}
    keys = [b"k%d" % i for i in range(6)]
    with TieredStore.from_config(cfg) as store:
        for key, chunk in zip(keys, real_chunks):  # DRAM holds 4 raw chunks: k0 and k1 are demoted to SSD
            store.put(key, chunk).result(timeout=60)
        store.flush(timeout=60)
        assert store.tiers[0].keys() == keys[2:] and store.tiers[1].keys() == keys[:2]
    (Path("/dev/shm") / shm_name).unlink()  # the DRAM tier is gone
    with TieredStore.from_config(cfg) as store:
        if persist:  # the SSD has room for 4 compressed chunks: the newest, which only DRAM held, win
            assert store.tiers[1].keys() == keys[2:]
            for key in keys[2:]:
                assert np.array_equal(store.get(key), real_chunks[int(key[1:])])
        else:
            assert store.tiers[1].keys() == keys[:2]


def test_from_yaml_file(tmp_path, shm_name, real_chunks):
    import yaml

    path = tmp_path / "store.yaml"
    path.write_text(yaml.safe_dump(config(tmp_path, shm_name)))
    with TieredStore.from_config(path) as store:
        assert store.put(b"k", real_chunks[0]).result(timeout=60)
        assert [t.name for t in store.tiers] == ["dram", "ssd"]
