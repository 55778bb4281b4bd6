"""Store configuration: examples in configs/ load; every mistake names the key to fix."""

from __future__ import annotations

from pathlib import Path

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
    assert dram.capacity == 64 * 2**20 and dram.put and not dram.compressed and dram.eviction == "lru"
    assert ssd.compressed and ssd.write_back and not ssd.put and ssd.fsync
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
