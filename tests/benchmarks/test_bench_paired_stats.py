"""The paired-ratio interval: right median, an interval that narrows with more pairs, clear refusals."""

from __future__ import annotations

import numpy as np
import pytest
from kvshrink.benchmarks.paired_stats import paired_ratio


def noisy_pairs(n: int, true_ratio: float, seed: int) -> tuple[list[float], list[float]]:
    """Stock times with +-40 % swings; ours = stock x true ratio x its own +-20 % noise."""
    rng = np.random.default_rng(seed)
    stock = 0.6 * rng.lognormal(0.0, 0.4, n)
    ours = stock * true_ratio * rng.lognormal(0.0, 0.2, n)
    return ours.tolist(), stock.tolist()


def test_median_of_ratios_not_ratio_of_medians() -> None:
    result = paired_ratio([1.0, 4.0, 9.0], [1.0, 2.0, 3.0])  # ratios 1, 2, 3
    assert result.median == 2.0 and result.pairs == 3
    assert 1.0 <= result.low <= result.median <= result.high <= 3.0


def test_interval_holds_the_true_ratio_and_narrows_with_more_pairs() -> None:
    widths = []
    for n in (11, 41, 161):
        result = paired_ratio(*noisy_pairs(n, 1.03, seed=n))
        assert result.low <= 1.03 <= result.high, result
        widths.append(result.high - result.low)
    assert widths[0] > widths[1] > widths[2]


def test_same_pairs_same_interval() -> None:
    ours, stock = noisy_pairs(31, 1.0, seed=5)
    assert paired_ratio(ours, stock) == paired_ratio(ours, stock)
    assert paired_ratio(ours, stock, confidence=0.5).high < paired_ratio(ours, stock, confidence=0.99).high


@pytest.mark.parametrize("ours, stock, message", [
    ([1.0], [1.0, 2.0], "1 of ours but 2 of stock"),
    ([], [], "no pairs"),
    ([1.0], [0.0], "positive"),
])
def test_bad_input_is_refused(ours: list[float], stock: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        paired_ratio(ours, stock)
