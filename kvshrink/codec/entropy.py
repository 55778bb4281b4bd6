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
