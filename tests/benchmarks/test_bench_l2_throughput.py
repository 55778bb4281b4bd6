"""The L2 adapter benchmark drives real adapters with real KV and checks what it loads back."""

from __future__ import annotations

import os
import time

from kvshrink.benchmarks import l2_throughput as lt
from kvshrink.benchmarks.capacity_replay import chunk_pool
from kvshrink.benchmarks.comparison import OURS, STOCK, Metric, compare

SETTINGS = lt.ThroughputSettings(keys_per_submit=2, rounds=1, warmup_rounds=0)


def test_ssd_tier_both_sides_round_trip_and_ours_writes_fewer_bytes() -> None:
    pool = chunk_pool(4)
    stock = lt.run_side(STOCK, "ssd", 1, pool, SETTINGS)
    ours = lt.run_side(OURS, "ssd", 1, pool, SETTINGS)
    for run in (stock, ours):
        assert run.figures["verified_chunks"] == 2 and run.figures["store_gbps"] > 0 and run.figures["load_gbps"] > 0
        assert run.figures["store_cpu_s_per_gb"] > 0 and run.figures["load_cpu_s_per_gb"] > 0
        for op in ("store", "load"):  # process CPU over wall time: at most the cores this machine has, give or
            assert 0 < run.figures[f"{op}_cores_busy"] <= os.cpu_count() * 1.5, run.figures  # take a tiny run's jitter
    # ours encodes every chunk twice on its way to the SSD (fast into DRAM, dense when demoted);
    # stock copies raw bytes into a file
    assert ours.figures["store_cpu_s_per_gb"] > stock.figures["store_cpu_s_per_gb"]
    assert stock.figures["bytes_per_token_on_disk"] >= 2 * 30 * 192 * 2  # raw bf16 KV, at least
    # real KV compresses: fewer bytes on disk than LMCache's raw files
    assert ours.figures["bytes_per_token_on_disk"] < stock.figures["bytes_per_token_on_disk"] / 1.3
    rows = compare("L2", "ssd", stock, ours, [Metric("bytes_per_token_on_disk", "B", higher_is_better=False)])
    assert rows[0].ratio < 1


def test_dram_tier_and_thread_count_are_part_of_the_workload() -> None:
    pool = chunk_pool(4)
    one = lt.run_side(STOCK, "dram", 1, pool, SETTINGS)
    two = lt.run_side(OURS, "dram", 2, pool, SETTINGS)
    assert two.figures["verified_chunks"] == 4
    assert one.workload.differences(two.workload) == [f"budget {one.workload.budget} != {two.workload.budget}"]


def _burn(cpu_seconds: float) -> None:
    end = time.process_time() + cpu_seconds
    while time.process_time() < end:
        pass


def test_adapter_cpu_counts_the_run_and_leaves_out_the_harness() -> None:
    cpu = lt.AdapterCpu()
    fill = cpu.harness(lambda r: _burn(0.3))  # a round's objects, filled by the harness
    result, seconds, wall = cpu.of(lambda: (fill(0), _burn(0.1), time.sleep(0.2), "done")[-1])
    assert result == "done"
    assert 0.09 <= seconds < 0.2, seconds  # the 0.1 s of "adapter" work, not the 0.3 s of filling
    assert 0.29 <= wall < 0.6, wall  # burning and sleeping count as wall time, filling does not
    _, later, _ = cpu.of(lambda: _burn(0.05))  # harness time of an earlier run is not taken off a later one
    assert 0.045 <= later < 0.15, later
