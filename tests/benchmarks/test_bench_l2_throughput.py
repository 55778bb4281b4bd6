"""The L2 adapter benchmark drives real adapters with real KV and checks what it loads back."""

from __future__ import annotations

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
