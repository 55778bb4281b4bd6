"""The capacity replay on LMCache's real in-process storage stack, stock and ours, on a tiny trace.

Not timed: checks that replays are deterministic, that the two sides compare only on the same
trace / model / budget, that wrong bytes from a backend are an error, and that a plugin LMCache
silently dropped is caught.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kvshrink.benchmarks import capacity_replay as cr
from kvshrink.benchmarks.agent_trace import TraceConfig, generate
from kvshrink.benchmarks.comparison import OURS, STOCK, IncomparableError, Metric, compare
from kvshrink.errors import CorruptDataError, KVShrinkError

TINY = dict(sessions=4, turns=3, concurrency=2, system_tokens=600, tokens_per_turn=300, output_tokens=40)
BUDGET = cr.Budget(dram_mib=96, ssd_mib=32)  # below the trace's ~25 chunks: eviction happens
SETTINGS = cr.ReplaySettings(pool_chunks=4, retrieve_batch=4, full_verify=True)
METRICS = [Metric("chunk_hit_rate", "fraction"), Metric("tokens_held_per_gb", "tokens/GB")]


@pytest.fixture(scope="module")
def requests():
    return generate(TraceConfig(seed=0, **TINY))


@pytest.fixture(scope="module")
def pool():
    return cr.chunk_pool(SETTINGS.pool_chunks)


@pytest.fixture(scope="module")
def stock_run(requests, pool):
    return cr.run_side(STOCK, BUDGET, requests, pool, SETTINGS)


@pytest.fixture(scope="module")
def ours_run(requests, pool):
    return cr.run_side(OURS, BUDGET, requests, pool, SETTINGS)


def _without_time(figures: dict) -> dict:
    return {k: v for k, v in figures.items() if k != "replay_seconds"}


def test_stock_replay_is_deterministic(stock_run, requests, pool) -> None:
    again = cr.run_side(STOCK, BUDGET, requests, pool, SETTINGS)
    assert _without_time(again.figures) == _without_time(stock_run.figures)
    assert again.workload == stock_run.workload
    stats = stock_run.details["stats"]
    assert 0 < stats["chunks_hit"] <= stats["ideal_hits"] < stats["chunks_looked_up"]
    assert stats["chunks_held_end"] < stats["distinct_keys"]  # the budget really was too small


def test_our_replay_is_deterministic(ours_run, requests, pool) -> None:
    again = cr.run_side(OURS, BUDGET, requests, pool, SETTINGS)
    assert _without_time(again.figures) == _without_time(ours_run.figures)


def test_both_sides_compare_on_the_same_workload(stock_run, ours_run) -> None:
    assert ours_run.details["backends"].keys() == {"LocalCPUBackend", "kvshrink"}
    assert stock_run.details["backends"].keys() == {"LocalCPUBackend", "LocalDiskBackend"}
    rows = compare("capacity", "tiny", stock_run, ours_run, METRICS)
    assert rows[0].stock_fingerprint == rows[0].ours_fingerprint
    assert stock_run.workload.budget == ours_run.workload.budget == {**vars(BUDGET), "total_mib_built": 128,
                                                                      "store_batch": 8, "chunk_tokens": 256}
    assert stock_run.policy.tiers == "inclusive" and stock_run.policy.l1_mib == BUDGET.dram_mib
    assert ours_run.policy.tiers == "exclusive" and rows[0].ours_policy["name"].startswith("KVShrink")
    assert ours_run.figures["ideal_hit_rate"] == stock_run.figures["ideal_hit_rate"]


def test_stock_runs_each_sensible_arrangement_and_the_best_is_compared(stock_run, requests, pool) -> None:
    """The staging arrangement gives stock's whole budget but the staging pool to its disk tier
    (one copy of each chunk instead of two); which arrangement holds more depends on the budget
    (here the 64 MiB pool is half the DRAM budget), so both run and the better one is compared."""
    staging = cr.run_side(STOCK, BUDGET, requests, pool, SETTINGS, variant=cr.STOCK_STAGING)
    assert staging.details["built"] == {"dram_mib": SETTINGS.staging_mib,
                                        "ssd_mib": BUDGET.ssd_mib + BUDGET.dram_mib - SETTINGS.staging_mib}
    assert staging.workload == stock_run.workload  # same budget, same trace: comparable
    assert staging.policy.tiers == "single" and staging.policy.l1_mib == 0
    assert staging.figures["tokens_held"] != stock_run.figures["tokens_held"]
    best = cr.best_stock([stock_run, staging])
    assert best.figures["chunk_hit_rate"] == max(stock_run.figures["chunk_hit_rate"], staging.figures["chunk_hit_rate"])
    assert [(t.side, t.variant) for t in cr.tasks_for([BUDGET])] == [
        (STOCK, cr.STOCK_L1_ALL_DRAM), (STOCK, cr.STOCK_STAGING), (OURS, cr.STOCK_L1_ALL_DRAM)]


def test_a_side_without_a_recorded_tier_policy_is_refused(stock_run, ours_run) -> None:
    import dataclasses

    with pytest.raises(IncomparableError, match="no tier policy recorded for KVShrink"):
        compare("capacity", "tiny", stock_run, dataclasses.replace(ours_run, policy=None), METRICS)


def test_other_budget_or_trace_is_refused(stock_run, requests, pool) -> None:
    bigger = cr.run_side(OURS, cr.Budget(dram_mib=128, ssd_mib=256), requests, pool, SETTINGS)
    with pytest.raises(IncomparableError, match="budget"):
        compare("capacity", "tiny", stock_run, bigger, METRICS)
    other_trace = generate(TraceConfig(seed=1, **TINY))
    other = cr.run_side(OURS, BUDGET, other_trace, pool, SETTINGS)
    with pytest.raises(IncomparableError, match="trace"):
        compare("capacity", "tiny", stock_run, other, METRICS)


def test_wrong_bytes_from_a_backend_are_an_error(requests, pool, tmp_path: Path) -> None:
    config = cr.stock_engine_config(cr.Budget(dram_mib=128, ssd_mib=512), tmp_path)
    keys = cr.request_keys(requests, config)
    with cr.storage_manager(config, expect_plugin=False) as manager:
        cr.replay(manager, requests, keys, pool, SETTINGS)
        manager.clear(locations=["LocalCPUBackend"])  # the next hits come from the disk files
        files = sorted((tmp_path / "lmcache-disk").rglob("*.pt"))
        assert files
        for path in files:  # swap every file's contents for another chunk's bytes (same size)
            data = path.read_bytes()
            path.write_bytes(data[len(data) // 2:] + data[:len(data) // 2])
        with pytest.raises(CorruptDataError, match="wrong bytes"):
            cr.replay(manager, requests, keys, pool, SETTINGS)


def test_a_plugin_lmcache_dropped_is_caught(tmp_path: Path) -> None:
    store = cr.ours_store_mapping(BUDGET, SETTINGS, tmp_path, None, "dropped")
    config = cr.ours_engine_config(store, SETTINGS)
    config.extra_config[f"storage_plugin.{cr.PLUGIN_NAME}.module_path"] = "kvshrink.no_such_module"
    with pytest.raises(KVShrinkError, match="did not create"):
        with cr.storage_manager(config, expect_plugin=True):
            pass


def test_missing_store_config_names_the_option(tmp_path: Path) -> None:
    from kvshrink.errors import ConfigError

    with pytest.raises(ConfigError, match="--store-config"):
        cr.ours_store_mapping(BUDGET, SETTINGS, tmp_path, tmp_path / "nope.yaml", "x")


def test_hit_rate_plot_from_real_runs(stock_run, ours_run, tmp_path: Path) -> None:
    from kvshrink.benchmarks import report

    point = {"budget_gib": BUDGET.total_gib, STOCK: stock_run.figures, OURS: ours_run.figures}
    report._plot_hit_rate({"sweep": [point]}, tmp_path / "hit.png")
    assert (tmp_path / "hit.png").read_bytes()[:4] == b"\x89PNG"
