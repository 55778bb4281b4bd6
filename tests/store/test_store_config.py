"""Store configuration: examples in configs/ load; every mistake names the key to fix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvshrink.errors import ConfigError
from kvshrink.store.config import StoreConfig, parse_size

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def base(**tier_changes):
    return {"tiers": [{"kind": "dram", "capacity": "64MiB", **tier_changes},
                      {"kind": "ssd", "capacity": "1GiB", "path": "/tmp/x", "write_back": True}]}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("store-*.yaml")), ids=lambda p: p.name)
def test_example_configs_load(path):
    config = StoreConfig.load(path)
    assert config.tiers and config.tiers[0].put


def test_example_configs_exist():
    assert len(list(CONFIGS.glob("store-*.yaml"))) >= 2


def test_defaults_and_sizes():
    config = StoreConfig.load(base())
    dram, ssd = config.tiers
    assert dram.capacity == 64 * 2**20 and dram.put and dram.codec == "fast" and dram.eviction == "lru"
    assert ssd.codec == "dense" and ssd.write_back and not ssd.put and not ssd.fsync
    assert not config.promote_on_hit and config.persist_on_close  # as configs/store-default.yaml
    assert parse_size("1.5 GB", "k") == 1_500_000_000 and parse_size(4096, "k") == 4096
    assert parse_size("2kib", "k") == 2048


@pytest.mark.parametrize(("data", "key"), [
    ({"tiers": []}, "tiers"),
    ({}, "tiers"),
    ({"tiers": [{"kind": "tape", "capacity": 1}]}, "tiers[0].kind"),
    ({"tiers": [{"kind": "dram"}]}, "tiers[0].capacity"),
    ({"tiers": [{"kind": "dram", "capacity": "lots"}]}, "tiers[0].capacity"),
    ({"tiers": [{"kind": "dram", "capacity": -5}]}, "tiers[0].capacity"),
    ({"tiers": [{"kind": "dram", "capacity": 0}]}, "tiers[0].capacity"),
    ({"tiers": [{"kind": "dram", "capacity": 10, "eviction": "random"}]}, "tiers[0].eviction"),
    ({"tiers": [{"kind": "dram", "capacity": 10, "compressed": "yes"}]}, "tiers[0].compressed"),
    ({"tiers": [{"kind": "dram", "capacity": 10, "capcity": 10}]}, "tiers[0].capcity"),
    ({"tiers": [{"kind": "dram", "capacity": 10, "path": "/x"}]}, "tiers[0].path"),
    ({"tiers": [{"kind": "dram", "capacity": 10, "shm_name": "../etc"}]}, "tiers[0].shm_name"),
    ({"tiers": [{"kind": "dram", "capacity": 10, "write_back": True}]}, "tiers[0].write_back"),
    ({"tiers": [{"kind": "dram", "capacity": 10}, {"kind": "ssd", "capacity": 10}]}, "tiers[1].path"),
    ({"tiers": [{"kind": "dram", "capacity": 10}, {"kind": "dram", "capacity": 10}]}, "tiers[1].name"),
    ({"tiers": [{"kind": "dram", "capacity": 10, "method": "lzma"}]}, "tiers[0].method"),
    ({"tiers": [{"kind": "dram", "capacity": 10, "method": "raw"}]}, "tiers[0].method"),
    ({"tiers": [{"kind": "dram", "capacity": 10, "method": "fast"}]}, "tiers[0].method"),  # codec: fast says it
    ({"tiers": [{"kind": "dram", "capacity": 10, "codec": "lz4"}]}, "tiers[0].codec"),
    ({"tiers": [{"kind": "dram", "capacity": 10, "codec": True}]}, "tiers[0].codec"),
    ({"tiers": [{"kind": "dram", "capacity": 10, "codec": "fast", "method": "zstd"}]}, "tiers[0].method"),
    ({"tiers": [{"kind": "dram", "capacity": 10, "method": "zstd"}]}, "tiers[0].method"),  # dram's default: fast
    ({"tiers": [{"kind": "dram", "capacity": 10, "compressed": False, "method": "qat"}]}, "tiers[0].method"),
    ({"tiers": [{"kind": "dram", "capacity": 10, "codec": "raw", "compressed": True}]}, "tiers[0].compressed"),
    ({"tiers": [{"kind": "dram", "capacity": 10, "codec": "dense", "compressed": False}]}, "tiers[0].compressed"),
    ({"tiers": [{"kind": "dram", "capacity": 10, "codec": "dense", "level": 30}]}, "tiers[0].level"),
    ({"tiers": [{"kind": "redis", "url": "http://x"}]}, "tiers[0].url"),
    ({"tiers": [{"kind": "redis", "url": "redis://x", "timeout_s": 0}]}, "tiers[0].timeout_s"),
    ({"tiers": [{"kind": "redis", "url": "redis://x", "retries": -1}]}, "tiers[0].retries"),
    ({"tiers": [{"kind": "dram", "capacity": 10}], "engine": {"put_queue": 0}}, "engine.put_queue"),
    ({"tiers": [{"kind": "dram", "capacity": 10}], "engine": {"threads": 3}}, "engine.threads"),
    ({"tiers": [{"kind": "dram", "capacity": 10}], "promote_on_hit": 1}, "promote_on_hit"),
    ({"tiers": [{"kind": "dram", "capacity": 10}], "tier": []}, "tier"),
    ([1, 2], "<root>"),
])
def test_errors_name_the_key(data, key):
    with pytest.raises(ConfigError) as info:
        StoreConfig.load(data)
    assert info.value.key == key
    assert repr(key) in str(info.value)


def test_bad_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("tiers: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        StoreConfig.load(path)
    with pytest.raises(ConfigError, match="cannot read"):
        StoreConfig.load(tmp_path / "missing.yaml")


def test_bad_yaml_names_the_file_and_line(tmp_path):
    path = tmp_path / "store.yaml"
    path.write_text("tiers:\n  - kind: dram\n    capacity: 64MiB\n   put: true\n")  # line 4 mis-indented
    with pytest.raises(ConfigError) as info:
        StoreConfig.load(path)
    assert info.value.key is None  # the file itself: the caller names the setting that holds its path
    assert info.value.reason.startswith(f"{path} is not valid YAML at line 4, column 4: ")
    assert str(info.value) == info.value.reason


# -- structured errors: key and reason, never parsed back out of the message ------------------------
@pytest.mark.parametrize(("data", "key", "reason"), [
    ({"tiers": [{"kind": "dram", "capacity": 10}], "enigne": {}}, "enigne",
     "unknown key; expected one of ['engine', 'idle_demotion', 'persist_on_close', 'prefetch', 'promote_on_hit', "
     "'tiers']"),
    ({"tiers": [{"kind": "dram", "capacity": 10}], "engine": {"put_workers": "2"}}, "engine.put_workers",
     "expected an integer >= 1, got '2'"),
    ({"tiers": [{"kind": "dram", "capacity": 10}], "engine": {"read_workers": 1.5}}, "engine.read_workers",
     "expected an integer >= 1, got 1.5"),
    ({"tiers": [{"kind": "redis", "url": "redis://x", "retries": True}]}, "tiers[0].retries",
     "expected an integer >= 0, got True"),
    ({"tiers": [{"kind": "ssd", "capacity": 10, "path": "/x", "level": 0}]}, "tiers[0].level",
     "zstd level must be in 1..22, got 0 (levels <= 0 store zstd literals uncompressed and lose most of the gain)"),
    ({"tiers": [{"kind": "ssd", "capacity": 10, "path": "/x", "method": "qat", "level": 12}]}, "tiers[0].level",
     "qat level must be in 1..9, got 12"),
    ({"tiers": [{"kind": "dram", "capacity": 10, "mlock": "no"}]}, "tiers[0].mlock",
     "expected true or false, got 'no'"),
])
def test_config_errors_carry_key_and_reason(data, key, reason):
    with pytest.raises(ConfigError) as info:
        StoreConfig.load(data)
    assert (info.value.key, info.value.reason) == (key, reason)
    assert str(info.value) == f"config key {key!r}: {reason}"


def test_a_store_inside_another_file_is_rekeyed_from_the_fields(tmp_path):
    from kvshrink.storage_backends.store_setup import load_store_config

    with pytest.raises(ConfigError) as info:
        load_store_config({"tiers": [{"kind": "ssd", "capacity": 10, "path": "/x", "method": "qat", "level": 0}]},
                          "adapter_params.store.", "adapter_params.store")
    assert info.value.key == "adapter_params.store.tiers[0].level"
    assert info.value.reason == "qat level must be in 1..9, got 0"
    bad = tmp_path / "s.yaml"
    bad.write_text("tiers: [\n")
    with pytest.raises(ConfigError) as info:
        load_store_config(bad, f"{bad}:", "kvshrink.config")
    assert info.value.key == "kvshrink.config" and info.value.reason.startswith(f"{bad} is not valid YAML at line 2")


# -- values another module owns: codec levels, Redis URLs -------------------------------------------
def _ssd(tmp_path, **changes):
    return {"tiers": [{"kind": "ssd", "capacity": "64MiB", "path": str(tmp_path / "ssd"), **changes}]}


@pytest.mark.parametrize(("method", "level"), [("zstd", 100), ("zstd", 0), ("zstd", -7), ("zstd", 23),
                                               ("qat", 0), ("qat", 12), ("qat", 10), ("zstd", True), ("zstd", "3")])
def test_a_level_the_codec_refuses_is_a_config_error(tmp_path, method, level):
    with pytest.raises(ConfigError) as info:
        StoreConfig.load(_ssd(tmp_path, method=method, level=level))
    assert info.value.key == "tiers[0].level"
    if not isinstance(level, (bool, str)):
        assert ("1..22" if method == "zstd" else "1..9") in str(info.value)


def test_a_level_without_a_method_is_checked_against_the_default_method(tmp_path):
    with pytest.raises(ConfigError, match="zstd level must be in 1..22, got 40"):
        StoreConfig.load(_ssd(tmp_path, level=40))
    assert StoreConfig.load(_ssd(tmp_path, level=12)).tiers[0].level == 12  # fine for zstd, not for qat
    with pytest.raises(ConfigError, match="qat level must be in 1..9, got 12"):
        StoreConfig.load(_ssd(tmp_path, level=12, method="qat"))


def test_config_accepts_exactly_the_levels_the_codec_encodes_with(tmp_path):
    """Not a copy of the ranges: for every level near them, loading succeeds iff encode does."""
    from kvshrink.codec import CodecArgumentError, encode

    chunk = np.arange(256, dtype=np.uint16)
    for method in ("zstd", "qat"):
        for level in range(-2, 25):
            try:
                encode(chunk, method=method, level=level)
                encodes = True
            except CodecArgumentError:  # the caller's argument; the config names its own key
                encodes = False
            try:
                StoreConfig.load(_ssd(tmp_path, method=method, level=level))
                loads = True
            except ConfigError:
                loads = False
            assert loads == encodes, (method, level)


@pytest.mark.parametrize(("tier", "codec", "method"), [
    ({}, "fast", "fast"), ({"compressed": False}, "raw", "zstd"), ({"compressed": True}, "dense", "zstd"),
    ({"codec": "raw"}, "raw", "zstd"),
    ({"codec": "fast"}, "fast", "fast"), ({"codec": "dense"}, "dense", "zstd"),
    ({"codec": "dense", "method": "qat", "level": 6}, "dense", "qat"), ({"codec": "fast", "compressed": True}, "fast", "fast"),
])
def test_a_tiers_codec_is_raw_fast_or_dense(tier, codec, method):
    config = StoreConfig.load(base(**tier)).tiers[0]
    assert (config.codec, config.compressed, config.method) == (codec, codec != "raw", method)


@pytest.mark.parametrize("codec", ["raw", "fast", "dense"])
def test_each_tier_codec_stores_frames_of_its_method_and_reads_them_back(tmp_path, small_chunks, codec):
    from kvshrink.store.tiered import TieredStore

    config = {"tiers": [{"kind": "ssd", "capacity": "64MiB", "path": str(tmp_path / "ssd"), "codec": codec,
                         "fsync": False}]}
    with TieredStore.from_config(config) as store:
        for i, chunk in enumerate(small_chunks):
            assert store.put(f"k{i}".encode(), chunk).result(timeout=60) is True
        for i, chunk in enumerate(small_chunks):
            assert np.array_equal(store.get(f"k{i}".encode()), chunk)
            assert store.header(f"k{i}".encode()).method == {"raw": "raw", "fast": "fast", "dense": "zstd"}[codec]


@pytest.mark.parametrize(("method", "level"), [("zstd", 19), ("qat", 9), ("qat", 1)])
def test_accepted_levels_really_store(tmp_path, small_chunks, method, level):
    from kvshrink.store.tiered import TieredStore

    with TieredStore.from_config(_ssd(tmp_path, method=method, level=level, fsync=False)) as store:
        assert store.put(b"k", small_chunks[0]).result(timeout=60) is True
        assert np.array_equal(store.get(b"k"), small_chunks[0])


def _with_redis(url):
    return {"tiers": [{"kind": "dram", "capacity": "64MiB"}, {"kind": "ssd", "capacity": "1GiB", "path": "/tmp/x"},
                      {"kind": "redis", "url": url}]}


@pytest.mark.parametrize("url", ["redis://[::1/0", "redis://user:s3cret@[::1/0", "redis://host:port/0",
                                 "redis://host:99999", "redis://host?socket_timeout=soon", "redis://host?colour=blue"])
def test_a_bad_redis_url_is_a_config_error_naming_the_key(url):
    from kvshrink.store.tiered import TieredStore

    for load in (StoreConfig.load, TieredStore.from_config):
        with pytest.raises(ConfigError) as info:
            load(_with_redis(url))
        assert info.value.key == "tiers[2].url"
        assert "s3cret" not in str(info.value)  # a password in the URL never reaches a log


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://u:p@cache.example:6380/2",
                                 "unix:///run/redis.sock", "unix:///run/redis.sock?db=3", "redis://[::1]:6379/1",
                                 "redis://h?client_name=kv&health_check_interval=5"])
def test_good_redis_urls_load(url):
    assert StoreConfig.load(_with_redis(url)).tiers[2].url == url


def test_a_url_with_connection_options_reaches_a_real_redis(redis_url, shm_name, small_chunks):
    from kvshrink.store.tiered import TieredStore

    url = f"{redis_url}?client_name=kvshrink-config-test"
    config = {"tiers": [{"kind": "redis", "url": url, "namespace": shm_name, "put": True}]}
    with TieredStore.from_config(config) as store:
        assert store.put(b"k", small_chunks[0]).result(timeout=30) is True
        assert np.array_equal(store.get(b"k"), small_chunks[0])
        names = [c["name"] for c in store.tiers[0]._client.client_list()]
        assert "kvshrink-config-test" in names


def test_a_cluster_true_redis_tier_stores_across_a_real_redis_cluster(shared_redis_cluster, tmp_path, small_chunks):
    """``cluster: true`` from a YAML file reaches redis-py's cluster client: a store round trip
    through a 3-master cluster, with keys on every master, batch reads and listing included."""
    from kvshrink.store.tiered import TieredStore

    path = tmp_path / "store.yaml"
    path.write_text(f"tiers:\n  - kind: redis\n    url: {shared_redis_cluster.url}\n    cluster: true\n"
                    f"    namespace: store-cluster\n    put: true\n")
    keys = [b"s%d" % i for i in range(9)]
    with TieredStore.from_config(path) as store:
        (tier,) = store.tiers
        assert tier.config.cluster and type(tier._client).__name__ == "RedisCluster"
        assert len({shared_redis_cluster.node_for(tier._k(k)).port for k in keys}) == 3
        for i, key in enumerate(keys):
            assert store.put(key, small_chunks[i]).result(timeout=30) is True
        assert np.array_equal(store.get(keys[0]), small_chunks[0])
        got = store.get_many(keys)
        assert all(np.array_equal(g, small_chunks[i]) for i, g in enumerate(got))
        assert store.contains_many(keys + [b"absent"]) == [True] * len(keys) + [False]
        assert sorted(store.keys()) == sorted(keys)
        assert store.delete(keys[0]) is True and store.get(keys[0]) is None
        assert store.stats()["tiers"]["redis"]["errors"] == 0
