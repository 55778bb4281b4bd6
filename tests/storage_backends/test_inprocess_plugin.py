"""The in-process storage plugin, loaded by LMCache's own StorageManager from an LMCache YAML (the
shipped one, with private paths), fed real CPU MemoryObjs allocated by LMCache's LocalCPUBackend."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from l2_harness import SHM_DIR

from kvshrink.testing.derived_stores import derive_store
from kvshrink.testing.launch import free_port
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend import CreateStorageBackends
from lmcache.v1.storage_backend.storage_manager import StorageManager

from kvshrink.errors import ConfigError
from kvshrink.storage_backends.inprocess_plugin import KVShrinkStoragePlugin

REPO = Path(__file__).resolve().parents[2]
SHIPPED_YAML = REPO / "configs" / "lmcache-inprocess-dram-ssd.yaml"
MODEL = "smollm2"


def metadata() -> LMCacheMetadata:
    return LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.bfloat16, kv_shape=(30, 2, 256, 3, 64))


def engine_key(i: int) -> CacheEngineKey:
    return CacheEngineKey(MODEL, 1, 0, 0xC0FFEE00 + i, torch.bfloat16)


def private_yaml(tmp_path: Path, shm: str, edit=None) -> Path:
    """The shipped in-process YAML with a private shm arena and SSD directory."""
    data = yaml.safe_load(SHIPPED_YAML.read_text())
    data["max_local_cpu_size"] = 0.3
    del data["extra_config"]["kvshrink.config"]
    data["extra_config"]["kvshrink.store"] = derive_store(paths={"ssd": tmp_path / "ssd"}, shm_names={"dram": shm},
                                                          capacities={"dram": "64MiB", "ssd": "1GiB"})
    if edit is not None:
        edit(data)
    path = tmp_path / f"lmcache-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def managers(tmp_path):
    """Build StorageManagers from YAML files; close them and remove their arenas afterwards."""
    made, arenas = [], []

    def build(shm: str | None = None, edit=None) -> StorageManager:
        shm = shm or f"kvshrink-sbtest-{uuid.uuid4().hex[:12]}"
        arenas.append(shm)
        config = LMCacheEngineConfig.from_file(str(private_yaml(tmp_path, shm, edit)))
        manager = StorageManager(config, metadata(), EventManager())
        made.append(manager)
        return manager

    yield build
    for manager in made:
        manager.close()
    for shm in arenas:
        (SHM_DIR / shm).unlink(missing_ok=True)


def put_chunks(manager: StorageManager, chunks, first: int = 0, location: str | None = None):
    keys, objs = [], []
    for i, chunk in enumerate(chunks):
        obj = manager.allocate(torch.Size(chunk.shape), torch.bfloat16)
        obj.tensor.copy_(torch.from_numpy(chunk).view(torch.bfloat16))
        keys.append(engine_key(first + i))
        objs.append(obj)
    manager.batched_put(keys, objs, location=location)
    return keys, objs


def plugin_of(manager: StorageManager) -> KVShrinkStoragePlugin:
    plugin = manager.storage_backends["kvshrink"]
    assert isinstance(plugin, KVShrinkStoragePlugin)
    return plugin


def active_allocations(manager: StorageManager) -> int:
    return manager.storage_backends["LocalCPUBackend"].get_memory_allocator().pin_allocator.num_active_allocations


def same(obj, chunk: np.ndarray) -> bool:
    return bool((obj.tensor.view(torch.uint16).numpy() == chunk).all())


# -- loading and configuration ----------------------------------------------------------------------
def test_shipped_yaml_loads_the_plugin_through_lmcache(managers):
    manager = managers()
    assert list(manager.storage_backends) == ["LocalCPUBackend", "kvshrink"]
    assert plugin_of(manager).get_allocator_backend() is manager.storage_backends["LocalCPUBackend"]


def test_store_config_from_a_file_relative_to_the_lmcache_yaml(tmp_path, monkeypatch, small_chunks):
    shm = f"kvshrink-sbtest-{uuid.uuid4().hex[:12]}"
    store_file = tmp_path / "conf" / "store.yaml"
    store_file.parent.mkdir()
    store_file.write_text(yaml.safe_dump({"tiers": [{"kind": "dram", "capacity": "32MiB", "shm_name": shm}]}))
    data = yaml.safe_load(SHIPPED_YAML.read_text())
    data["extra_config"]["kvshrink.config"] = "store.yaml"
    data["max_local_cpu_size"] = 0.2
    lmcache_file = tmp_path / "conf" / "lmcache.yaml"
    lmcache_file.write_text(yaml.safe_dump(data))
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(lmcache_file))
    monkeypatch.chdir(REPO)
    manager = StorageManager(LMCacheEngineConfig.from_file(str(lmcache_file)), metadata(), EventManager())
    try:
        assert "kvshrink" in manager.storage_backends
    finally:
        manager.close()
        (SHM_DIR / shm).unlink(missing_ok=True)


def _direct(tmp_path, extra: dict, max_local_cpu_size: float = 0.2):
    """Construct the plugin the way LMCache's launcher does, but without its try/except."""
    config = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=True, max_local_cpu_size=max_local_cpu_size)
    config.storage_plugins = ["kvshrink"]
    config.extra_config = {"storage_plugin.kvshrink.module_path": "kvshrink.storage_backends.inprocess_plugin",
                           "storage_plugin.kvshrink.class_name": "KVShrinkStoragePlugin", **extra}
    loop = asyncio.new_event_loop()
    try:
        backends = CreateStorageBackends(config, metadata(), loop, dst_device="cpu")
        local_cpu = backends.get("LocalCPUBackend")
        try:
            return KVShrinkStoragePlugin(config=config, metadata=metadata(), local_cpu_backend=local_cpu, loop=loop,
                                         dst_device="cpu")
        finally:
            for backend in backends.values():
                backend.close()
    finally:
        loop.close()


@pytest.mark.parametrize("extra, key", [
    ({}, "extra_config.kvshrink.config"),
    ({"kvshrink.config": "/x.yaml", "kvshrink.store": {}}, "extra_config.kvshrink.config"),
    ({"kvshrink.config": "/nonexistent/store.yaml"}, "extra_config.kvshrink.config"),
    ({"kvshrink.store": {"tiers": [{"kind": "ssd", "path": "/tmp/x", "capacity": "0"}]}},
     "extra_config.kvshrink.store.tiers[0].capacity"),
    ({"kvshrink.store": {"tiers": [{"kind": "dram", "capacity": "1GiB", "colour": "red"}]}},
     "extra_config.kvshrink.store.tiers[0].colour"),
    ({"kvshrink.store": {"tiers": [{"kind": "ssd", "path": "/tmp/x", "capacity": "1GiB"}]}, "kvshrink.levle": 3},
     "extra_config.kvshrink.levle"),
    ({"kvshrink.store": {"tiers": [{"kind": "ssd", "path": "/tmp/x", "capacity": "1GiB"}]}, "kvshrink.read_workers": 0},
     "extra_config.kvshrink.read_workers"),
])
def test_bad_settings_raise_naming_the_key(tmp_path, extra, key, caplog):
    with caplog.at_level(logging.ERROR, logger="kvshrink.storage_backends.inprocess_plugin"):
        with pytest.raises(ConfigError) as info:
            _direct(tmp_path, extra)
    assert info.value.key == key, str(info.value)
    assert key in caplog.text  # logged too: LMCache would only show its own one-liner


def test_unreachable_redis_and_unusable_paths_raise(tmp_path):
    redis_store = {"tiers": [{"kind": "ssd", "path": str(tmp_path / "ssd"), "capacity": "1GiB"},
                             {"kind": "redis", "url": f"redis://127.0.0.1:{free_port()}/0", "capacity": 0}]}
    with pytest.raises(ConfigError) as info:
        _direct(tmp_path, {"kvshrink.store": redis_store})
    assert info.value.key == "extra_config.kvshrink.store.tiers[1].url"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError) as info:
        _direct(tmp_path, {"kvshrink.store": {"tiers": [{"kind": "ssd", "path": str(tmp_path / "file" / "ssd"),
                                                         "capacity": "1GiB"}]}})
    assert info.value.key == "extra_config.kvshrink.store.tiers[0].path"


def test_without_local_cpu_memory_the_plugin_refuses(tmp_path):
    with pytest.raises(ConfigError) as info:
        _direct(tmp_path, {"kvshrink.store": {"tiers": [{"kind": "ssd", "path": str(tmp_path / "s"),
                                                         "capacity": "1GiB"}]}}, max_local_cpu_size=0)
    assert info.value.key == "max_local_cpu_size"


def test_lmcache_swallows_a_broken_plugin_but_our_error_is_in_the_log(tmp_path, caplog):
    config = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=True, max_local_cpu_size=0.2)
    config.storage_plugins = ["kvshrink"]
    config.extra_config = {"storage_plugin.kvshrink.module_path": "kvshrink.storage_backends.inprocess_plugin",
                           "storage_plugin.kvshrink.class_name": "KVShrinkStoragePlugin",
                           "kvshrink.config": str(tmp_path / "missing.yaml")}
    with caplog.at_level(logging.ERROR):
        manager = StorageManager(config, metadata(), EventManager())
    try:
        assert "kvshrink" not in manager.storage_backends
        assert "extra_config.kvshrink.config" in caplog.text and "missing.yaml" in caplog.text
    finally:
        manager.close()


# -- puts -------------------------------------------------------------------------------------------
def test_put_keeps_its_own_reference_after_lmcache_drops_one(managers, small_chunks):
    manager = managers()
    plugin = plugin_of(manager)
    gate = threading.Event()
    plugin._submitter.submit(gate.wait)  # hold the put worker: the puts stay queued
    baseline = active_allocations(manager)
    keys, objs = put_chunks(manager, small_chunks[:3], location="kvshrink")  # LocalCPU takes no reference
    # StorageManager has dropped its reference; only ours keeps the buffers alive
    assert [o.get_ref_count() for o in objs] == [1, 1, 1]
    assert all(plugin.exists_in_put_tasks(k) for k in keys)
    gate.set()
    plugin.flush()
    assert [o.get_ref_count() for o in objs] == [0, 0, 0]
    assert active_allocations(manager) == baseline  # every buffer went back to LMCache's allocator
    for key, chunk in zip(keys, small_chunks):
        got = plugin.get_blocking(key)
        assert same(got, chunk)
        got.ref_count_down()


def test_chunks_in_another_memory_format_are_skipped_and_counted(managers, small_chunks):
    manager = managers()
    plugin = plugin_of(manager)
    obj = manager.allocate(torch.Size(small_chunks[0].shape), torch.bfloat16, fmt=MemoryFormat.KV_T2D)
    manager.batched_put([engine_key(0)], [obj], location="kvshrink")
    plugin.flush()
    assert plugin.stats()["puts_skipped_format"] == 1
    assert not plugin.contains(engine_key(0))


def test_on_complete_callback_fires_once_per_key(managers, small_chunks):
    manager = managers()
    plugin = plugin_of(manager)
    done = []
    keys = [engine_key(i) for i in range(2)]
    objs = []
    for chunk in small_chunks[:2]:
        obj = manager.allocate(torch.Size(chunk.shape), torch.bfloat16)
        obj.tensor.copy_(torch.from_numpy(chunk).view(torch.bfloat16))
        objs.append(obj)
    plugin.batched_submit_put_task(keys, objs, on_complete_callback=done.append)
    for obj in objs:
        obj.ref_count_down()
    plugin.flush()
    assert sorted(k.chunk_hash for k in done) == sorted(k.chunk_hash for k in keys)


# -- gets ---------------------------------------------------------------------------------------------
def test_storage_manager_serves_from_the_plugin_after_local_cpu_is_cleared(managers, small_chunks):
    manager = managers()
    keys, _ = put_chunks(manager, small_chunks[:4])
    plugin_of(manager).flush()
    manager.clear(locations=["LocalCPUBackend"])
    hits, mapping = manager.batched_contains(keys)
    assert hits == 4 and list(mapping) == ["kvshrink"]
    objs = manager.batched_get(keys, location="kvshrink")
    assert all(same(o, c) for o, c in zip(objs, small_chunks))
    assert all(o.get_memory_format() == MemoryFormat.KV_2LTD for o in objs)
    for obj in objs:
        obj.ref_count_down()


def test_batched_contains_counts_the_prefix_and_pins(managers, small_chunks):
    manager = managers()
    plugin = plugin_of(manager)
    put_chunks(manager, [small_chunks[0], small_chunks[1]], first=0, location="kvshrink")
    put_chunks(manager, [small_chunks[3]], first=3, location="kvshrink")
    plugin.flush()
    keys = [engine_key(i) for i in range(4)]
    assert plugin.batched_contains(keys) == 2
    assert plugin.batched_contains(keys, pin=True) == 2
    assert plugin.stats()["store"]["engine"]["pinned"] == 2
    for key in keys[:2]:
        plugin.unpin(key)
    assert plugin.stats()["store"]["engine"]["pinned"] == 0


def test_async_loading_returns_the_hit_prefix(managers, small_chunks):
    manager = managers()
    plugin = plugin_of(manager)
    put_chunks(manager, small_chunks[:2], first=0, location="kvshrink")
    put_chunks(manager, [small_chunks[3]], first=3, location="kvshrink")
    plugin.flush()
    keys = [engine_key(i) for i in range(4)]
    baseline = active_allocations(manager)

    def on_manager_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, manager.loop).result(30)

    assert on_manager_loop(plugin.batched_async_contains("req-1", keys)) == 2
    objs = on_manager_loop(plugin.batched_get_non_blocking("req-1", keys))
    assert len(objs) == 2 and same(objs[0], small_chunks[0]) and same(objs[1], small_chunks[1])
    assert active_allocations(manager) == baseline + 2  # the key-3 buffer (past the gap) was released
    for obj in objs:
        obj.ref_count_down()
    assert active_allocations(manager) == baseline


def test_restart_finds_chunks_on_ssd(managers, small_chunks):
    first = managers()
    keys, _ = put_chunks(first, small_chunks[:3], location="kvshrink")
    plugin_of(first).flush()
    first.close()
    second = managers()  # new arena name: the DRAM tier is gone, the SSD directory is the same
    plugin = plugin_of(second)
    assert plugin.batched_contains(keys) == 3
    objs = plugin.batched_get_blocking(keys)
    assert all(same(o, c) for o, c in zip(objs, small_chunks))
    assert plugin.stats()["store"]["tiers"]["ssd"]["hits"] == 3
    for obj in objs:
        obj.ref_count_down()


def test_a_corrupt_chunk_is_a_miss_and_its_buffer_is_returned(managers, tmp_path, small_chunks):
    first = managers()
    keys, _ = put_chunks(first, small_chunks[:2], location="kvshrink")
    plugin_of(first).flush()
    first.close()
    for path in sorted((tmp_path / "ssd" / "chunks").rglob("*.kvc")):
        data = bytearray(path.read_bytes())
        data[-100:] = bytes(100)
        path.write_bytes(bytes(data))
    second = managers()
    plugin = plugin_of(second)
    baseline = active_allocations(second)
    assert plugin.get_blocking(keys[0]) is None
    assert plugin.batched_get_blocking(keys) == [None, None]
    assert active_allocations(second) == baseline
    assert plugin.stats()["store"]["tiers"]["ssd"]["quarantined"] == 2


@pytest.mark.parametrize("name", ["lmcache-inprocess-dram-ssd.yaml"])
def test_shipped_lmcache_yamls_select_the_plugin_with_valid_store_settings(name, monkeypatch):
    from kvshrink.storage_backends.plugin_settings import resolve_config_path
    from kvshrink.storage_backends.store_setup import load_store_config

    path = REPO / "configs" / name
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))
    config = LMCacheEngineConfig.from_file(str(path))
    assert config.storage_plugins == ["kvshrink"] and config.max_local_cpu_size > 0
    extra = config.extra_config
    assert extra["storage_plugin.kvshrink.module_path"] == "kvshrink.storage_backends.inprocess_plugin"
    assert extra["storage_plugin.kvshrink.class_name"] == KVShrinkStoragePlugin.__name__
    source = extra.get("kvshrink.store") or resolve_config_path(extra["kvshrink.config"])
    assert load_store_config(source, "x.").tiers
