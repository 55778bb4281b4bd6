"""The refusal rule: a comparison exists only between two sides that ran the same workload."""

from __future__ import annotations

import math

import pytest
from kvshrink.benchmarks.comparison import (OURS, STOCK, IncomparableError, Metric, SideRun, TierPolicy, Workload,
                                            check_rows, compare)

WORKLOAD = Workload(trace="10req-aaaa", model="kv-bbbb", budget={"dram_mib": 256, "ssd_mib": 768})
METRICS = [Metric("hit_rate", "fraction"), Metric("ttft_s", "s", higher_is_better=False)]


POLICY = TierPolicy("test arrangement", "exclusive", 0.0, False)


def side(name: str, workload: Workload = WORKLOAD, policy: TierPolicy | None = POLICY, **figures: float) -> SideRun:
    return SideRun(name, workload, figures or {"hit_rate": 0.5, "ttft_s": 2.0}, policy=policy)


def test_same_workload_compares_and_keeps_both_fingerprints() -> None:
    rows = compare("capacity", "1 GiB", side(STOCK), side(OURS, hit_rate=0.8, ttft_s=1.0), METRICS)
    assert [r.metric for r in rows] == ["hit_rate", "ttft_s"]
    assert rows[0].ratio == pytest.approx(1.6) and rows[1].ratio == pytest.approx(0.5)
    assert rows[0].stock_fingerprint == rows[0].ours_fingerprint == WORKLOAD.fingerprint
    check_rows([r.to_dict() for r in rows])  # does not raise


@pytest.mark.parametrize("field, other", [
    ("trace", Workload("10req-cccc", "kv-bbbb", {"dram_mib": 256, "ssd_mib": 768})),
    ("model", Workload("10req-aaaa", "kv-dddd", {"dram_mib": 256, "ssd_mib": 768})),
    ("budget", Workload("10req-aaaa", "kv-bbbb", {"dram_mib": 256, "ssd_mib": 1024})),
])
def test_different_workloads_are_refused_naming_the_difference(field: str, other: Workload) -> None:
    with pytest.raises(IncomparableError, match=field):
        compare("capacity", "1 GiB", side(STOCK), side(OURS, other), METRICS)


def test_a_metric_one_side_did_not_measure_is_refused() -> None:
    with pytest.raises(IncomparableError, match="ttft_s.*KVShrink"):
        compare("e2e", "4K", side(STOCK), side(OURS, hit_rate=0.9), METRICS)


def test_sides_must_be_stock_then_ours() -> None:
    with pytest.raises(IncomparableError, match="expected sides"):
        compare("e2e", "4K", side(OURS), side(STOCK), METRICS)


def test_serialized_rows_are_checked_again() -> None:
    (row,) = [r.to_dict() for r in compare("c", "x", side(STOCK), side(OURS), METRICS[:1])]
    tampered = {**row, "ours_fingerprint": "0123456789abcdef"}
    with pytest.raises(IncomparableError, match="different workloads"):
        check_rows([row, tampered])
    with pytest.raises(IncomparableError):
        check_rows([{**row, "stock_fingerprint": None, "ours_fingerprint": None}])


def test_a_side_without_a_tier_policy_is_refused_and_rows_keep_both_policies() -> None:
    with pytest.raises(IncomparableError, match="no tier policy recorded for stock LMCache"):
        compare("capacity", "1 GiB", side(STOCK, policy=None), side(OURS), METRICS)
    (row,) = [r.to_dict() for r in compare("c", "x", side(STOCK), side(OURS), METRICS[:1])]
    assert row["stock_policy"] == row["ours_policy"] == POLICY.to_dict()
    with pytest.raises(IncomparableError, match="stock_policy is not recorded"):
        check_rows([{**row, "stock_policy": {}}])
    with pytest.raises(IncomparableError, match="tiers must be one of"):
        TierPolicy("x", "mostly", 0.0, False)


def test_ratio_of_zero_stock_is_explicit() -> None:
    rows = compare("c", "x", side(STOCK, hit_rate=0.0, ttft_s=0.0), side(OURS, hit_rate=0.5, ttft_s=0.0), METRICS)
    assert math.isinf(rows[0].ratio) and math.isnan(rows[1].ratio)
    assert rows[0].to_dict()["ratio"] == "inf"  # stays valid JSON
