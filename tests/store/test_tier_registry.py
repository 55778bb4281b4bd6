"""Tier kinds come from the registry (kvshrink/store/tier_registry.py): a new kind is one class and
one registration line, built from YAML by a real store; unknown kinds and keys name what to fix."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import pytest

from kvshrink.errors import ConfigError
from kvshrink.store import tier_registry
from kvshrink.store.config import StoreConfig, TierConfig
from kvshrink.store.tier_base import Tier, Victim
from kvshrink.store.tier_registry import build_tier, register_tier, registered_kinds, tier_class
from kvshrink.store.tiered import TieredStore

MiB = 2**20


class DictTier(Tier):
    """A tier in a dict of frames: unbounded, no eviction, common config keys only."""

    kind = "dict"

    def __init__(self, config: TierConfig, is_pinned: Any = None) -> None:
        super().__init__(config, is_pinned)
        self.frames: dict[bytes, bytes] = {}
        self._lock = threading.Lock()

    def write_frame(self, key: bytes, frame: Any, keep_victims: Any = False, evict_first: Any = ()) -> list[Victim]:
        with self._lock:
            self.frames[key] = bytes(frame)
        self.counters.add("puts")
        return []

    @contextmanager
    def _open_frame(self, key: bytes, touch: bool = True) -> Iterator[bytes | None]:
        with self._lock:
            frame = self.frames.get(key)
        yield frame

    def _discard_corrupt(self, key: bytes, reason: str) -> None:
        self.delete(key)

    def delete(self, key: bytes) -> bool:
        with self._lock:
            return self.frames.pop(key, None) is not None

    def contains(self, key: bytes) -> bool:
        return key in self.frames

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self.frames)

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return sum(map(len, self.frames.values())), len(self.frames)


register_tier("dict", DictTier)


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made in the test are undone after it."""
    monkeypatch.setattr(tier_registry, "_kinds", dict(tier_registry._kinds))


def test_a_kind_registered_in_one_line_is_built_from_yaml_and_serves_chunks(tmp_path, small_chunks):
    path = tmp_path / "store.yaml"
    path.write_text("tiers:\n  - kind: dict\n    capacity: 64MiB\n    codec: fast\n")
    with TieredStore.from_config(path) as store:
        (tier,) = store.tiers
        assert type(tier) is DictTier and type(tier.config) is TierConfig and tier.config.method == "fast"
        for i, chunk in enumerate(small_chunks[:4]):
            assert store.put(b"k%d" % i, chunk).result(timeout=60) is True
        for i, chunk in enumerate(small_chunks[:4]):
            assert np.array_equal(store.get(b"k%d" % i), chunk)
        assert store.header(b"k0").method == "fast"
        assert store.get(b"absent") is None
        assert store.delete(b"k0") is True and store.get(b"k0") is None


def test_the_new_kind_takes_demotions_below_a_dram_tier(shm_name, small_chunks):
    """The store treats the new kind like any local tier: DRAM evictions land in it, reads find them."""
    config = {"tiers": [{"kind": "dram", "capacity": 3 * MiB, "shm_name": shm_name},
                        {"kind": "dict", "name": "below", "capacity": "1GiB", "codec": "dense"}],
              "promote_on_hit": False}
    with TieredStore.from_config(config) as store:
        for i, chunk in enumerate(small_chunks[:6]):
            assert store.put(b"k%d" % i, chunk).result(timeout=60) is True
        store.flush(timeout=60)
        below = store.tiers[1]
        assert below.frames, "nothing was demoted to the new tier"
        for key in below.frames:
            assert np.array_equal(store.get(key), small_chunks[int(key[1:])])
        assert all(np.array_equal(store.get(b"k%d" % i), c) for i, c in enumerate(small_chunks[:6]))


def test_tier_config_builds_the_config_class_of_its_kind(tmp_path):
    from kvshrink.store.ssd import SsdTier, SsdTierConfig

    plain = TierConfig(kind="dict", name="d", capacity=MiB, compressed=False)
    assert type(plain) is TierConfig
    ssd = TierConfig(kind="ssd", name="s", capacity=MiB, compressed=True, path=str(tmp_path / "s"), fsync=False)
    assert type(ssd) is SsdTierConfig and ssd.path == str(tmp_path / "s") and not ssd.fsync
    tier = build_tier(ssd, lambda key: False)
    try:
        assert type(tier) is SsdTier and tier_class("ssd") is SsdTier
    finally:
        tier.close()


def test_an_unknown_kind_lists_the_registered_ones():
    with pytest.raises(ConfigError) as info:
        StoreConfig.load({"tiers": [{"kind": "tape", "capacity": 1}]})
    assert info.value.key == "tiers[0].kind"
    assert info.value.reason == f"expected one of {list(registered_kinds())}, got 'tape'"
    assert {"dict", "dram", "ssd", "redis"} <= set(registered_kinds())
    with pytest.raises(ConfigError) as info:
        TierConfig(kind="tape", name="t", capacity=1, compressed=False)
    assert info.value.key == "kind"


@pytest.mark.parametrize(("tier", "key", "allowed"), [
    ({"kind": "dict", "capacity": 1, "shm_name": "x"}, "tiers[0].shm_name", set()),
    ({"kind": "dram", "capacity": 1, "path": "/x"}, "tiers[0].path", {"shm_name", "hugepages", "mlock", "prefault"}),
    ({"kind": "ssd", "capacity": 1, "path": "/x", "url": "redis://h"}, "tiers[0].url", {"path", "fsync"}),
    ({"kind": "redis", "url": "redis://h", "fsync": False}, "tiers[0].fsync",
     {"url", "cluster", "ttl_s", "timeout_s", "retries", "namespace"}),
])
def test_a_key_of_another_kind_is_unknown_and_the_message_lists_this_kinds_keys(tier, key, allowed):
    with pytest.raises(ConfigError) as info:
        StoreConfig.load({"tiers": [tier]})
    common = {"kind", "name", "capacity", "compressed", "codec", "eviction", "put", "write_back", "method", "level"}
    assert (info.value.key, info.value.reason) == (key, f"unknown key; expected one of {sorted(common | allowed)}")


def test_a_kind_with_its_own_config_class_gets_its_keys_checked_by_type(scratch_registry):
    @dataclass(frozen=True)
    class SlottedConfig(TierConfig):
        slots: int = 8
        label: str = ""

    class SlottedTier(DictTier):
        kind = "slotted"
        config_class = SlottedConfig

    register_tier("slotted", SlottedTier)
    config = StoreConfig.load({"tiers": [{"kind": "slotted", "capacity": "1MiB", "slots": 3, "label": 7}]})
    assert type(config.tiers[0]) is SlottedConfig and (config.tiers[0].slots, config.tiers[0].label) == (3, "7")
    for bad in ("many", -1, True, 1.5):
        with pytest.raises(ConfigError) as info:
            StoreConfig.load({"tiers": [{"kind": "slotted", "capacity": "1MiB", "slots": bad}]})
        assert (info.value.key, info.value.reason) == ("tiers[0].slots", f"expected an integer >= 0, got {bad!r}")


def test_a_kind_key_of_a_type_without_a_generic_check_must_be_checked_by_its_kind(scratch_registry):
    @dataclass(frozen=True)
    class WeightedConfig(TierConfig):
        weights: tuple = ()

    class WeightedTier(DictTier):
        config_class = WeightedConfig

    register_tier("weighted", WeightedTier)
    assert StoreConfig.load({"tiers": [{"kind": "weighted", "capacity": 1}]}).tiers[0].weights == ()
    with pytest.raises(TypeError, match="WeightedConfig.weights: no generic check for type tuple"):
        StoreConfig.load({"tiers": [{"kind": "weighted", "capacity": 1, "weights": [1, 2]}]})


def test_registration_is_idempotent_and_never_silently_replaces(scratch_registry):
    register_tier("dict", DictTier)  # a plugin loaded twice
    with pytest.raises(ValueError, match="'dict' is registered already"):
        register_tier("dict", type("Other", (DictTier,), {}))
    with pytest.raises(ValueError, match="'ssd' is registered already"):
        register_tier("ssd", DictTier)
    register_tier("ssd", DictTier, clobber=True)
    assert tier_class("ssd") is DictTier


def test_a_registered_path_that_cannot_load_is_a_config_error_naming_the_key(scratch_registry):
    register_tier("missing", "kvshrink.store.no_such_tier:NoTier")
    with pytest.raises(ConfigError) as info:
        StoreConfig.load({"tiers": [{"kind": "missing", "capacity": 1}]})
    assert info.value.key == "tiers[0].kind"
    assert "kvshrink.store.no_such_tier:NoTier, which cannot be loaded" in info.value.reason


def test_is_remote_names_the_network_tier_and_batch_reads_stays_an_alias():
    from kvshrink.store.redis_tier import RedisTier

    remote = RedisTier(TierConfig(kind="redis", name="r", capacity=0, compressed=True, url="redis://127.0.0.1:1"))
    local = DictTier(TierConfig(kind="dict", name="d", capacity=1, compressed=False))
    try:
        assert (remote.is_remote, remote.batch_reads) == (True, True)
        assert (local.is_remote, local.batch_reads) == (False, False)
    finally:
        remote.close()
