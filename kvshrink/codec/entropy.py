"""Order-0 byte entropy: how the codec decides per stream, and the bound the benchmark reports.

Estimated from a sample of a few thousand elements, it is cheap and good enough to tell an
exponent stream (~3 bits/byte) from a mantissa stream (~8 bits/byte); the final word on a stream
is still whether its compressed form is smaller.
"""

from __future__ import annotations

import numpy as np


def entropy_bits(data: np.ndarray) -> float:
    """Order-0 entropy of the bytes in ``data`` (``uint8``), in bits per byte."""
    if data.size == 0:
        return 0.0
    counts = np.bincount(data.reshape(-1), minlength=256)
    p = counts[counts > 0] / data.size
    return float(-(p * np.log2(p)).sum())


def column_entropies(rows: np.ndarray) -> list[float]:
    """Order-0 entropy of each byte column of ``rows`` (``uint8[n, width]``), in bits per byte.

    The entropy itself is computed for all columns at once: the codec calls this on every chunk
    before its blocks can start in parallel, so numpy's per-call overhead counts.
    """
    n, width = rows.shape
    if n == 0:
        return [0.0] * width
    p = np.stack([np.bincount(rows[:, k], minlength=256) for k in range(width)]) / n
    logs = np.log2(p, out=np.zeros_like(p), where=p > 0)
    return (-(p * logs).sum(axis=1)).tolist()


def order0_bound(rows: np.ndarray, rotate: bool = False) -> float:
    """Compression ratio bound of coding each byte position with its own order-0 model.

    ``rows`` is ``uint8[elements, width]``; ``rotate`` applies the codec's rotl1 transform first.
    """
    from kvshrink.codec.byteplanes import split

    if rows.size == 0:
        return 1.0
    streams = split(rows, rotate=rotate, nstreams=rows.shape[1])
    bits = sum(entropy_bits(s) for s in streams)
    return 8.0 * rows.shape[1] / bits if bits else float("inf")
