"""The store benchmark's measuring functions, at toy sizes (its speed figures are not asserted)."""

from __future__ import annotations

from kvshrink.benchmarks import store_bench


def test_bytes_per_token_on_real_kv_meets_the_ratio(tmp_path, real_chunks):
    report = store_bench.measure_bytes_per_token(real_chunks[:2], tmp_path, lambda n: None)
    assert report["stored"] == 2 and report["bit_exact"]
    assert report["ratio"] >= store_bench.BYTES_PER_TOKEN_TARGET
    assert report["raw_bytes_per_token"] == 2 * 30 * 192 * 2


def test_batched_reads_spread_over_both_tiers(tmp_path, small_chunks):
    report = store_bench.measure_batched_reads(small_chunks[:6], tmp_path, rounds=1, drop=False, progress=lambda n: None)
    assert report["in_dram"] + report["on_ssd"] == 6 and report["in_dram"] >= 3 and report["on_ssd"] >= 2
    assert report["get_many_s"] > 0 and report["one_by_one_s"] > 0


def test_reopen_finds_every_chunk_clean_and_after_a_kill(tmp_path):
    report = store_bench.measure_reopen(300, tmp_path, repeats=1, drop=False, progress=lambda n: None)
    assert report["chunks_known_after_reopen"] == 300 and report["clean_start"] and report["sample_bit_exact"]
    crash = report["after_crash"]
    assert crash["chunks_known_after_reopen"] == crash["chunks_expected"] == 300 + 74
    assert crash["chunks_after_reconcile"] == crash["chunks_expected"]
