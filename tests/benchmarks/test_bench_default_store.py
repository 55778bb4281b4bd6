"""Every benchmark measures the one shipped default store, changed only where it keeps its data
(SSD paths, shm names) and how much it may hold (capacities), and records the file it ran.

The store each section hands to our adapter / plugin is built here with small budgets by the very
functions the sections call, parsed, stripped of paths, shm names and capacities, and compared
with the shipped ``store-default.yaml`` stripped the same way. No vLLM, no server: two tiny real
runs (one L2 store + load, a capacity replay of no requests) show the record a section copies.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

import pytest
from kvshrink.benchmarks import capacity_replay as cr
from kvshrink.benchmarks import e2e_paired as ep
from kvshrink.benchmarks import l2_throughput as lt
from kvshrink.benchmarks.comparison import OURS, STOCK
from kvshrink.benchmarks.suite_sections import Section
from kvshrink.cli import main
from kvshrink.configs import default_store_path
from kvshrink.errors import ConfigError
from kvshrink.store.config import StoreConfig, parse_size, parse_store_config
from kvshrink.testing import derived_stores
from kvshrink.testing.derived_stores import SERIAL_ENGINE, derive_store, load_store_mapping, store_record

CHUNK_BYTES = 2 * 30 * 256 * 192 * 2  # one SmolLM2 chunk, bf16


def unplaced(store: Mapping[str, Any]) -> StoreConfig:
    """The store with every path, shm name and capacity blanked: what a benchmark may not change."""
    return derived_stores.unplaced(parse_store_config(store))


@pytest.fixture(scope="module")
def default() -> StoreConfig:
    return unplaced(load_store_mapping())


def placements(store: Mapping[str, Any]) -> dict[str, tuple[str, int]]:
    """tier name -> (where it keeps its data, capacity in bytes)."""
    config = parse_store_config(store)
    return {t.name: (getattr(t, "path", "") or getattr(t, "shm_name", ""), t.capacity) for t in config.tiers}


def test_the_default_is_the_documented_store() -> None:
    config = StoreConfig.load(default_store_path())
    assert [(t.kind, t.compressed, t.put, t.write_back) for t in config.tiers] == [
        ("dram", True, True, False), ("ssd", True, False, False)]  # exclusive: no write-back copy
    assert [(t.codec, t.method) for t in config.tiers] == [("fast", "fast"), ("dense", "zstd")]
    assert not config.promote_on_hit and config.persist_on_close
    assert default_store_path().parent.name == "configs" and default_store_path().name == "store-default.yaml"


def test_capacity_replay_runs_the_default_on_serial_lanes(default: StoreConfig, tmp_path: Path) -> None:
    budget, settings = cr.Budget(dram_mib=160, ssd_mib=256), cr.ReplaySettings(staging_mib=64)
    store = cr.ours_store_mapping(budget, settings, tmp_path, None, "t1")
    # one worker per lane, so the replay repeats exactly; nothing else differs
    assert unplaced(store) == replace(default, engine=replace(default.engine, **SERIAL_ENGINE))
    assert placements(store) == {"dram": ("kvshrink-bench-t1", 96 << 20),
                                 "ssd": (str(tmp_path / "kvshrink-ssd"), 256 << 20)}
    assert cr.ours_engine_config(store, settings).extra_config["kvshrink.store"] == store


@pytest.mark.parametrize("tier", lt.TIERS)
def test_l2_throughput_runs_the_default_sized_so_that_one_tier_serves(default: StoreConfig, tmp_path: Path,
                                                                     tier: str) -> None:
    spec = lt.ours_adapter_spec(tier, tmp_path, 2, 1 << 30, CHUNK_BYTES)
    store = spec["adapter_params"]["store"]
    assert unplaced(store) == default and spec["adapter_params"]["workers"] == 2
    dram = (1 << 30) if tier == "dram" else CHUNK_BYTES + lt.ONE_CHUNK_SLACK
    assert placements(store) == {"dram": (f"kvshrink-l2bench-{tmp_path.name}", dram),
                                 "ssd": (str(tmp_path / "kvshrink-ssd"), 1 << 30)}


def test_e2e_runs_the_default_in_every_phase(default: StoreConfig, tmp_path: Path) -> None:
    hot = ep.hot_arrangement(OURS, tmp_path, "kvshrink-t2", 256, None)
    replay = ep.replay_arrangement("ours", ep.Budget(dram_mib=12, ssd_mib=36), 32, tmp_path, "kvshrink-t3", None)
    for arrangement, shm, (dram, ssd) in ((hot, "kvshrink-t2", (1 << 30, 4 << 30)),
                                          (replay, "kvshrink-t3", (12 << 20, 36 << 20))):
        store = arrangement.adapter["adapter_params"]["store"]
        assert unplaced(store) == default
        assert placements(store) == {"dram": (shm, dram), "ssd": (str(tmp_path / "l2"), ssd)}
    assert ep.hot_arrangement(STOCK, tmp_path, "unused", 256, None).adapter["type"] == "fs_native"


def test_a_derived_store_never_uses_the_machines_default_placement(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs its own shm_name") as info:
        derive_store(paths={"ssd": tmp_path})
    assert info.value.key == "--store-config"
    with pytest.raises(ConfigError, match="needs its own path"):
        derive_store(shm_names={"dram": "x"})
    with pytest.raises(ConfigError, match="only ssd tiers have a path"):
        derive_store(paths={"dram": tmp_path, "ssd": tmp_path}, shm_names={"dram": "x"})
    with pytest.raises(ConfigError, match="no tier named 'nvme'"):
        derive_store(paths={"ssd": tmp_path}, shm_names={"dram": "x"}, capacities={"nvme": 1})
    with pytest.raises(ConfigError) as info:
        derive_store(paths={"ssd": tmp_path}, shm_names={"dram": "x"}, capacities={"ssd": "a lot"})
    assert info.value.key == f"{default_store_path().resolve()}:tiers[1].capacity"
    with pytest.raises(ConfigError, match="does not exist") as info:
        store_record(tmp_path / "nope.yaml")
    assert info.value.key == "--store-config"


def test_runs_record_the_shipped_default_and_a_section_keeps_it() -> None:
    expected = {"path": str(default_store_path().resolve()), "default": True,
                "sha256": hashlib.sha256(default_store_path().read_bytes()).hexdigest()}
    pool = cr.chunk_pool(2)
    l2 = lt.run_side(OURS, "ssd", 1, pool, lt.ThroughputSettings(keys_per_submit=1, rounds=1, warmup_rounds=0))
    # an empty trace: the plugin is built from the derived store and closed, nothing replayed
    replay = cr.run_side(OURS, cr.Budget(dram_mib=96, ssd_mib=64), [], pool, cr.ReplaySettings(pool_chunks=2))
    assert l2.details["store_config"] == replay.details["store_config"] == expected
    assert "store_config" not in lt.run_side(STOCK, "ssd", 1, pool, lt.ThroughputSettings(1, 1, 0)).details
    section = Section()
    section.record_store([l2, replay])
    assert section.store_config == expected
    other = replace(replay, details={**replay.details, "store_config": {**expected, "sha256": "0" * 64}})
    with pytest.raises(ValueError, match="did not all record one store config"):
        Section().record_store([l2, other])


def test_bench_help_names_the_installed_default(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert str(default_store_path()) in "".join(capsys.readouterr().out.split())  # argparse wraps long lines
