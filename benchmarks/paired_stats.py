"""How sure a paired A/B timing is: the median of per-pair ratios with a bootstrap confidence interval.

TTFT on a shared CPU machine swings by tens of percent from one request to the next, for both sides
alike. Pairing each of our requests with a stock request made in the same moment removes drift; the
interval then says whether the pairs we took are enough to call a target met, rather than letting
one lucky (or unlucky) median decide.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class PairedRatio:
    """Median of ``ours[i] / stock[i]`` and its percentile-bootstrap interval."""

    median: float
    low: float
    high: float
    pairs: int
    confidence: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def paired_ratio(ours: Sequence[float], stock: Sequence[float], *, confidence: float = 0.95,
                 resamples: int = 10_000, seed: int = 0) -> PairedRatio:
    """Median of the per-pair ratios, with a ``confidence`` interval from ``resamples`` bootstrap
    resamples of the pairs (seeded: the same pairs always give the same interval)."""
    if len(ours) != len(stock):
        raise ValueError(f"paired_ratio: {len(ours)} of ours but {len(stock)} of stock")
    if not ours:
        raise ValueError("paired_ratio: no pairs")
    if not 0 < confidence < 1:
        raise ValueError(f"paired_ratio: confidence must be in (0, 1), got {confidence}")
    stock_arr = np.asarray(stock, dtype=np.float64)
    if np.any(stock_arr <= 0):
        raise ValueError("paired_ratio: stock times must be positive")
    ratios = np.asarray(ours, dtype=np.float64) / stock_arr
    picks = _resample(ratios.size, resamples, seed)
    medians = np.median(ratios[picks], axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    return PairedRatio(float(np.median(ratios)), float(low), float(high), int(ratios.size), confidence)


def ratio_of_sums(ours: Sequence[float], stock: Sequence[float], resamples: int = 10_000,
                  seed: int = 0) -> dict[str, float]:
    """sum(ours) / sum(stock) over paired requests, with a 95 % percentile-bootstrap interval
    (requests resampled with their pairs). A resample whose ``stock`` sum is 0 has no ratio and is
    left out (counts, e.g. correct answers, can sum to 0; times cannot)."""
    o, s = np.asarray(ours, dtype=np.float64), np.asarray(stock, dtype=np.float64)
    picks = _resample(o.size, resamples, seed)
    den = s[picks].sum(axis=1)
    boots = o[picks].sum(axis=1)[den > 0] / den[den > 0]
    low, high = np.percentile(boots, [2.5, 97.5])
    return {"value": float(o.sum() / s.sum()), "low": float(low), "high": float(high), "pairs": int(o.size)}


def difference_of_rates(ours_hits: Sequence[float], stock_hits: Sequence[float], prompt: Sequence[float],
                        resamples: int = 10_000, seed: int = 1) -> dict[str, float]:
    """hit rate (hit tokens / prompt tokens) of ours minus stock's, with a 95 % bootstrap interval."""
    o, s, p = (np.asarray(x, dtype=np.float64) for x in (ours_hits, stock_hits, prompt))
    picks = _resample(o.size, resamples, seed)
    boots = (o[picks].sum(axis=1) - s[picks].sum(axis=1)) / p[picks].sum(axis=1)
    low, high = np.percentile(boots, [2.5, 97.5])
    return {"value": float((o.sum() - s.sum()) / p.sum()), "low": float(low), "high": float(high), "pairs": int(o.size)}


def verdict(interval: dict[str, float], target: float, higher_is_better: bool = False) -> str:
    """``met`` / ``not met`` only where the whole interval lies on one side of ``target``."""
    low, high = interval["low"], interval["high"]
    if higher_is_better:
        return "met" if low >= target else "not met" if high < target else "inconclusive"
    return "met" if high <= target else "not met" if low > target else "inconclusive"


def _resample(pairs: int, resamples: int, seed: int) -> np.ndarray:
    """``resamples`` bootstrap draws of ``pairs`` pair indices (seeded: same pairs, same interval)."""
    return np.random.default_rng(seed).integers(0, pairs, size=(resamples, pairs))
