"""Our MP L2 adapter beyond the shared contract: loud construction errors, persistence across a
cache-server restart, corrupt or truncated chunk files, compression on SSD, a shared Redis tier,
pinning, key listing, and LMCache's own ``lmcache bench l2`` driving it with verification."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from kvshrink.testing.launch import free_port
from l2_harness import (SHM_DIR, L2Driver, RecordingListener, build_from_json, contents, dram_ssd_store,
                        empty_like_obj, memory_obj, object_key, plugin_json)

from kvshrink.errors import ConfigError

SSD_ONLY = lambda path: {"tiers": [{"kind": "ssd", "path": str(path), "capacity": "1GiB"}]}  # noqa: E731


def chunk_files(ssd: Path) -> list[Path]:
    return sorted((ssd / "chunks").rglob("*.kvc"))




# -- construction errors name the key to fix -------------------------------------------------------
@pytest.mark.parametrize("params, key", [
    ({}, "adapter_params.config"),
    ({"config": "/nonexistent/store.yaml"}, "adapter_params.config"),
    ({"store": {"tiers": [{"kind": "ssd", "path": "/tmp/x", "capacity": "-5GiB"}]}}, "adapter_params.store.tiers[0].capacity"),
    ({"store": {"tiers": [{"kind": "ssd", "path": "/tmp/x", "capacity": "lots"}]}}, "adapter_params.store.tiers[0].capacity"),
    ({"store": {"tiers": [{"kind": "dram", "capacity": "1GiB"}], "typo": 1}}, "adapter_params.store.typo"),
    ({"store": {"tiers": []}, "workers": 2}, "adapter_params.store.tiers"),
    ({"store": {"tiers": [{"kind": "ssd", "path": "/tmp/x", "capacity": "1GiB"}]}, "workers": 0}, "adapter_params.workers"),
    ({"store": {"tiers": [{"kind": "ssd", "path": "/tmp/x", "capacity": "1GiB"}]}, "extra": True}, "adapter_params.extra"),
])
def test_bad_adapter_params_fail_before_the_adapter_is_built(params, key):
    with pytest.raises(ConfigError) as info:
        build_from_json(plugin_json(params))
    assert info.value.key == key, str(info.value)


def test_store_yaml_errors_name_the_file_and_key(tmp_path):
    path = tmp_path / "store.yaml"
    path.write_text("tiers:\n  - kind: ssd\n    path: /tmp/x\n    capacity: 0\n")
    with pytest.raises(ConfigError) as info:
        build_from_json(plugin_json({"config": str(path)}))
    assert info.value.key == f"{path}:tiers[0].capacity"
    path.write_text("tiers: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        build_from_json(plugin_json({"config": str(path)}))
    assert info.value.key == "adapter_params.config" and "YAML" in str(info.value)


def test_unusable_ssd_directory_is_reported_with_its_key(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the SSD directory should be")
    with pytest.raises(ConfigError) as info:
        build_from_json(plugin_json({"store": SSD_ONLY(blocker / "ssd")}))
    assert info.value.key == "adapter_params.store.tiers[0].path"


def test_ssd_directory_owned_by_a_live_store_is_reported(open_adapter, tmp_path):
    open_adapter({"store": SSD_ONLY(tmp_path / "ssd")})
    with pytest.raises(ConfigError) as info:
        build_from_json(plugin_json({"store": SSD_ONLY(tmp_path / "ssd")}))
    assert info.value.key == "adapter_params.store.tiers[0]" and "another live process" in str(info.value)


def test_dram_tier_larger_than_dev_shm_is_refused(shm_name, tmp_path):
    too_big = int(os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize * 2) + 2**30
    store = {"tiers": [{"kind": "dram", "capacity": too_big, "shm_name": shm_name}]}
    with pytest.raises(ConfigError) as info:
        build_from_json(plugin_json({"store": store}))
    assert info.value.key == "adapter_params.store.tiers[0].capacity" and "/dev/shm" in str(info.value)
    assert not (SHM_DIR / shm_name).exists()


def test_ssd_tier_larger_than_its_disk_is_refused(shm_name, tmp_path):
    """Capacity beyond the disk's free space: refused at start-up naming the key, nothing created;
    two SSD tiers on one disk count together, and a tier that fits starts."""
    vfs = os.statvfs(tmp_path)
    free = vfs.f_bavail * vfs.f_frsize
    too_big = {"tiers": [{"kind": "ssd", "path": str(tmp_path / "ssd"), "capacity": free + 2**30}]}
    with pytest.raises(ConfigError) as info:
        build_from_json(plugin_json({"store": too_big}))
    assert info.value.key == "adapter_params.store.tiers[0].capacity" and "free" in str(info.value)
    assert not (tmp_path / "ssd").exists()
    two = {"tiers": [{"kind": "ssd", "name": "a", "path": str(tmp_path / "a"), "capacity": free * 3 // 5},
                     {"kind": "ssd", "name": "b", "path": str(tmp_path / "b"), "capacity": free * 3 // 5}]}
    with pytest.raises(ConfigError) as info:
        build_from_json(plugin_json({"store": two}))
    assert info.value.key == "adapter_params.store.tiers[1].capacity" and "SSD tiers before it" in str(info.value)
    fits = {"tiers": [{"kind": "ssd", "path": str(tmp_path / "ssd"), "capacity": "64MiB"}]}
    build_from_json(plugin_json({"store": fits})).close()


def test_unreachable_redis_at_start_up_is_refused(tmp_path):
    store = {"tiers": [{"kind": "ssd", "path": str(tmp_path / "ssd"), "capacity": "1GiB"},
                       {"kind": "redis", "url": f"redis://127.0.0.1:{free_port()}/0", "capacity": 0}]}
    with pytest.raises(ConfigError) as info:
        build_from_json(plugin_json({"store": store}))
    assert info.value.key == "adapter_params.store.tiers[1].url" and "cannot reach Redis" in str(info.value)


# -- persistence ------------------------------------------------------------------------------------
def test_chunks_survive_a_restart_on_the_ssd_tier(open_adapter, tmp_path, small_chunks):
    ssd = tmp_path / "ssd"
    keys = [object_key(i) for i in range(6)]
    first_shm = f"kvshrink-sbtest-{uuid.uuid4().hex[:12]}"
    try:
        first = open_adapter({"store": dram_ssd_store(first_shm, ssd)})
        assert L2Driver(first).store(keys, [memory_obj(c) for c in small_chunks[:6]]).is_successful()
        first.close()  # a cache-server shutdown: queued write-backs finish first
    finally:
        (SHM_DIR / first_shm).unlink(missing_ok=True)  # lose the DRAM tier: only the SSD is left
    second_shm = f"kvshrink-sbtest-{uuid.uuid4().hex[:12]}"
    try:
        second = open_adapter({"store": dram_ssd_store(second_shm, ssd)})
        driver = L2Driver(second)
        assert driver.lookup(keys) == list(range(6))
        outs = [empty_like_obj(c) for c in small_chunks[:6]]
        assert driver.load(keys, outs) == list(range(6))
        assert all((contents(o) == c).all() for o, c in zip(outs, small_chunks))
        second.submit_unlock(keys)
        assert second.store_stats()["tiers"]["ssd"]["hits"] == 6
    finally:
        (SHM_DIR / second_shm).unlink(missing_ok=True)


def test_the_dram_tier_survives_a_restart_too(open_adapter, tmp_path, shm_name, small_chunks):
    keys = [object_key(i) for i in range(3)]
    first = open_adapter({"store": dram_ssd_store(shm_name, tmp_path / "ssd")})
    L2Driver(first).store(keys, [memory_obj(c) for c in small_chunks[:3]])
    first.close()
    second = open_adapter({"store": dram_ssd_store(shm_name, tmp_path / "ssd")})
    outs = [empty_like_obj(c) for c in small_chunks[:3]]
    assert L2Driver(second).load(keys, outs) == [0, 1, 2]
    assert second.store_stats()["tiers"]["dram"]["hits"] == 3


# -- damaged SSD contents ---------------------------------------------------------------------------
def _store_then_reopen_from_ssd(open_adapter, tmp_path, chunks):
    ssd = tmp_path / "ssd"
    keys = [object_key(i) for i in range(len(chunks))]
    writer = open_adapter({"store": SSD_ONLY(ssd)})
    assert L2Driver(writer).store(keys, [memory_obj(c) for c in chunks]).is_successful()
    writer.close()
    return ssd, keys


@pytest.mark.parametrize("damage", ["flip_bytes", "truncate", "empty"])
def test_damaged_chunk_files_are_misses_not_errors(open_adapter, tmp_path, small_chunks, damage):
    chunks = small_chunks[:4]
    ssd, keys = _store_then_reopen_from_ssd(open_adapter, tmp_path, chunks)
    files = chunk_files(ssd)
    assert len(files) == 4
    victim = files[0]
    data = bytearray(victim.read_bytes())
    if damage == "flip_bytes":
        for offset in range(len(data) // 2, len(data) // 2 + 64):
            data[offset] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 3]
    else:
        data = bytearray()
    victim.write_bytes(bytes(data))

    reader = open_adapter({"store": SSD_ONLY(ssd)})
    driver = L2Driver(reader)
    outs = [empty_like_obj(c) for c in chunks]
    loaded = driver.load(keys, outs)
    assert len(loaded) == 3, "exactly the damaged chunk is a miss"
    for i in loaded:
        assert (contents(outs[i]) == chunks[i]).all()
    assert reader.report_status()["boundary_errors"] == {}
    assert reader.store_stats()["tiers"]["ssd"]["quarantined"] >= 1
    # the damaged chunk is gone for good, and the key can be stored again
    missing = next(i for i in range(4) if i not in loaded)
    assert driver.lookup([keys[missing]]) == []
    assert driver.store([keys[missing]], [memory_obj(chunks[missing])]).is_successful()
    again = empty_like_obj(chunks[missing])
    assert driver.load([keys[missing]], [again]) == [0] and (contents(again) == chunks[missing]).all()


def test_garbage_files_in_the_ssd_directory_do_not_stop_the_adapter(open_adapter, tmp_path, small_chunks):
    ssd, keys = _store_then_reopen_from_ssd(open_adapter, tmp_path, small_chunks[:2])
    (ssd / "chunks" / "zz").mkdir()
    (ssd / "chunks" / "zz" / "garbage.kvc").write_bytes(os.urandom(5000))
    (ssd / "chunks" / "notes.txt").write_text("hello")
    (ssd / "index.log").open("ab").write(os.urandom(333))  # a torn index tail
    reader = open_adapter({"store": SSD_ONLY(ssd)})
    outs = [empty_like_obj(c) for c in small_chunks[:2]]
    assert L2Driver(reader).load(keys, outs) == [0, 1]
    assert all((contents(o) == c).all() for o, c in zip(outs, small_chunks[:2]))


def test_a_load_buffer_of_the_wrong_size_fails_only_that_key(open_adapter, tmp_path, small_chunks):
    adapter = open_adapter({"store": SSD_ONLY(tmp_path / "ssd")})
    driver = L2Driver(adapter)
    keys = [object_key(0), object_key(1)]
    driver.store(keys, [memory_obj(small_chunks[0]), memory_obj(small_chunks[1])])
    outs = [empty_like_obj(small_chunks[0][:, :, :32]), empty_like_obj(small_chunks[1])]
    assert driver.load(keys, outs) == [1]
    assert (contents(outs[1]) == small_chunks[1]).all()


# -- what is stored where ---------------------------------------------------------------------------
def test_ssd_holds_compressed_real_kv(open_adapter, tmp_path, small_chunks):
    ssd = tmp_path / "ssd"
    adapter = open_adapter({"store": SSD_ONLY(ssd)})
    L2Driver(adapter).store([object_key(i) for i in range(len(small_chunks))], [memory_obj(c) for c in small_chunks])
    on_disk = sum(f.stat().st_size for f in chunk_files(ssd))
    raw = sum(c.nbytes for c in small_chunks)
    assert raw / on_disk > 1.3, f"ratio {raw / on_disk:.3f}: real bf16 KV must compress"


def test_a_shared_redis_tier_serves_another_cache_server(open_adapter, tmp_path, redis_url, small_chunks):
    def store_with_redis(name: str) -> dict:
        return {"tiers": [{"kind": "ssd", "path": str(tmp_path / name), "capacity": "1GiB", "put": True},
                          {"kind": "redis", "url": redis_url, "capacity": 0, "put": True}]}

    keys = [object_key(i) for i in range(3)]
    first = open_adapter({"store": store_with_redis("ssd-a")})
    assert L2Driver(first).store(keys, [memory_obj(c) for c in small_chunks[:3]]).is_successful()
    second = open_adapter({"store": store_with_redis("ssd-b")})  # another server: empty SSD, same Redis
    outs = [empty_like_obj(c) for c in small_chunks[:3]]
    assert L2Driver(second).load(keys, outs) == [0, 1, 2]
    assert all((contents(o) == c).all() for o, c in zip(outs, small_chunks))
    assert second.store_stats()["tiers"]["redis"]["hits"] == 3


def test_lookup_pins_until_unlock(open_adapter, tmp_path, small_chunks):
    adapter = open_adapter({"store": SSD_ONLY(tmp_path / "ssd")})
    driver = L2Driver(adapter)
    keys = [object_key(0), object_key(1)]
    driver.store(keys, [memory_obj(small_chunks[0]), memory_obj(small_chunks[1])])
    driver.lookup(keys + [object_key(7)])
    driver.lookup(keys[:1])
    assert adapter.store_stats()["engine"]["pinned"] == 2
    adapter.submit_unlock(keys + [object_key(7)])
    assert adapter.store_stats()["engine"]["pinned"] == 1  # key 0 was locked twice
    adapter.submit_unlock(keys[:1])
    assert adapter.store_stats()["engine"]["pinned"] == 0


def test_list_l2_keys_pages_and_filters(open_adapter, tmp_path, small_chunks):
    adapter = open_adapter({"store": SSD_ONLY(tmp_path / "ssd")})
    keys = [object_key(i) for i in range(5)] + [object_key(9, model="other/model", salt="u1")]
    L2Driver(adapter).store(keys, [memory_obj(small_chunks[i]) for i in range(6)])
    seen, cursor = [], None
    while True:
        page = adapter.list_l2_keys(model_name=keys[0].model_name, page_size=2, cursor=cursor)
        assert len(page.entries) <= 2
        seen += [e.key.to_object_key() for e in page.entries]
        assert all(e.size_bytes == small_chunks[0].nbytes for e in page.entries)
        if page.next_page_token is None:
            break
        cursor = page.next_page_token
    assert sorted(seen, key=lambda k: k.chunk_hash) == keys[:5]
    other = adapter.list_l2_keys(model_name="other/model")
    assert [e.key.to_object_key() for e in other.entries] == [keys[5]]
    with pytest.raises(ValueError):
        adapter.list_l2_keys(cursor="nope")
    with pytest.raises(ValueError):
        adapter.list_l2_keys(page_size=0)


def test_repeat_store_of_a_stored_key_is_skipped(open_adapter, tmp_path, small_chunks):
    adapter = open_adapter({"store": SSD_ONLY(tmp_path / "ssd")})
    listener = RecordingListener()
    adapter.register_listener(listener)
    driver = L2Driver(adapter)
    driver.store([object_key(0)], [memory_obj(small_chunks[0])])
    result = driver.store([object_key(0)], [memory_obj(small_chunks[0])])
    assert result.is_successful() and result.bytes_transferred() == 0
    assert len(listener.stored) == 1
    assert adapter.store_stats()["tiers"]["ssd"]["puts"] == 1


# -- LMCache's own benchmark tool, with round-trip verification --------------------------------------
def test_lmcache_bench_l2_verifies_our_adapter(tmp_path, shm_name):
    spec = json.dumps(plugin_json({"store": dram_ssd_store(shm_name, tmp_path / "ssd", dram="128MiB")}))
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "lmcache.cli.main", "bench", "l2", "--l2-adapter", spec,
                           "--data-size-kb", "1440", "--num-keys", "8", "--rounds", "2", "--no-skip-verify",
                           "--lookup-max-hit-rate", "1.0", "--format", "json", "--output", str(out), "-q"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads(out.read_text())["metrics"]
    ops = {v["operation"]: v for k, v in metrics.items() if k.startswith("op_")}
    for name in ("Store", "Lookup", "Load"):
        assert ops[name]["total_success"] == ops[name]["total_keys"] > 0, ops[name]


# -- stores read LMCache's buffers in place -----------------------------------------------------------
def test_stores_read_lmcache_buffers_in_place_until_the_task_reports(open_adapter, tmp_path, small_chunks):
    adapter = open_adapter({"store": SSD_ONLY(tmp_path / "ssd")})
    driver = L2Driver(adapter)
    keys = [object_key(i) for i in range(4)]
    objs = [memory_obj(c) for c in small_chunks[:4]]
    assert driver.store(keys, objs).is_successful()
    assert adapter._store.engine.staging._allocated == 0  # lent, never staged
    for obj in objs:  # LMCache reuses its L1 buffers once the task reported
        obj.raw_data.zero_()
    outs = [empty_like_obj(c) for c in small_chunks[:4]]
    assert driver.load(keys, outs) == [0, 1, 2, 3]
    assert all((contents(o) == c).all() for o, c in zip(outs, small_chunks))


class _NoTensorView:
    """A MemoryObj without a tensor view (a layout we cannot read): chunk_tensor refuses it."""

    tensor = raw_tensor = None

    def get_size(self) -> int:
        return 4096


def test_a_store_task_failing_midway_reports_only_after_its_started_puts(open_adapter, tmp_path, small_chunks):
    adapter = open_adapter({"store": SSD_ONLY(tmp_path / "ssd")})
    keys = [object_key(0), object_key(1)]
    result = L2Driver(adapter).store(keys, [memory_obj(small_chunks[0]), _NoTensorView()])
    assert not result.is_successful()
    # the first chunk was being read from LMCache's buffer: done before the failure was posted
    store_key = adapter._store.keys()[0] if adapter._store.keys() else None
    assert store_key is not None and not adapter._store.in_flight(store_key)
    assert adapter.report_status()["boundary_errors"]
