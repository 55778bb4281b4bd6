"""Compiled split/merge loops (numba), used by ``byteplanes`` when numba is importable.

Same results as the numpy reference in ``byteplanes`` (the tests compare them), but one pass over
memory instead of several, and ``nogil`` so that worker threads split and merge in parallel. The
loops read and write whole words (uint16/32/64): indexing a ``[n, width]`` byte array instead runs
about 5x slower. Importing this module raises ImportError when numba is missing.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def _split16(words, s0, s1, rotate):
    for i in range(words.size):
        a = np.int64(words[i])
        if rotate:
            a = (a << 1) | (a >> 15)
        s0[i] = (a >> 8) & 0xFF
        s1[i] = a & 0xFF


@numba.njit(nogil=True, cache=True)
def _split32(words, s0, s1, s2, s3, rotate):
    for i in range(words.size):
        a = np.int64(words[i])
        if rotate:
            a = ((a << 1) | (a >> 31)) & 0xFFFFFFFF
        s0[i] = (a >> 24) & 0xFF
        s1[i] = (a >> 16) & 0xFF
        s2[i] = (a >> 8) & 0xFF
        s3[i] = a & 0xFF


@numba.njit(nogil=True, cache=True)
def _split64(words, out, rotate):
    one = np.uint64(1)
    top = np.uint64(63)
    ff = np.uint64(0xFF)
    for i in range(words.size):
        a = words[i]
        if rotate:
            a = (a << one) | (a >> top)
        for k in range(8):
            out[k, i] = (a >> np.uint64(8 * (7 - k))) & ff


@numba.njit(nogil=True, cache=True)
def _merge16(s0, s1, words, rotate):
    for i in range(words.size):
        a = (np.int64(s0[i]) << 8) | np.int64(s1[i])
        if rotate:
            a = (a >> 1) | ((a & 1) << 15)
        words[i] = a


@numba.njit(nogil=True, cache=True)
def _merge32(s0, s1, s2, s3, words, rotate):
    for i in range(words.size):
        a = (np.int64(s0[i]) << 24) | (np.int64(s1[i]) << 16) | (np.int64(s2[i]) << 8) | np.int64(s3[i])
        if rotate:
            a = (a >> 1) | ((a & 1) << 31)
        words[i] = a


@numba.njit(nogil=True, cache=True)
def _merge64(planes, words, rotate):
    one = np.uint64(1)
    top = np.uint64(63)
    for i in range(words.size):
        a = np.uint64(0)
        for k in range(8):
            a = (a << np.uint64(8)) | np.uint64(planes[k, i])
        if rotate:
            a = (a >> one) | ((a & one) << top)
        words[i] = a


def split(rows: np.ndarray, out: np.ndarray, rotate: bool) -> None:
    """Fill ``out`` (``uint8[width, n]``) from ``rows`` (``uint8[n, width]``, C-contiguous)."""
    width = rows.shape[1]
    words = rows.reshape(-1).view(f"<u{width}")
    if width == 2:
        _split16(words, out[0], out[1], rotate)
    elif width == 4:
        _split32(words, out[0], out[1], out[2], out[3], rotate)
    else:
        _split64(words, out, rotate)


def merge(streams: tuple[np.ndarray, ...], rows: np.ndarray, rotate: bool) -> None:
    """Fill ``rows`` (``uint8[n, width]``, C-contiguous) from its ``width`` streams."""
    width = rows.shape[1]
    words = rows.reshape(-1).view(f"<u{width}")
    if width == 2:
        _merge16(streams[0], streams[1], words, rotate)
    elif width == 4:
        _merge32(streams[0], streams[1], streams[2], streams[3], words, rotate)
    else:
        _merge64(np.stack(streams), words, rotate)


def self_test() -> None:
    """Compile every kernel for the argument types the codec passes (read-only inputs) and check
    a round trip; raises if numba cannot compile them here."""
    rng = np.random.default_rng(0)
    for width in (2, 4, 8):
        rows = rng.integers(0, 256, (257, width), dtype=np.uint8)
        rows.flags.writeable = False
        for rotate in (False, True):
            planes = np.empty((width, rows.shape[0]), dtype=np.uint8)
            split(rows, planes, rotate)
            streams = []
            for plane in planes:
                s = np.frombuffer(plane.tobytes(), dtype=np.uint8)  # read-only, like decoded streams
                streams.append(s)
            back = np.empty_like(rows)
            merge(tuple(streams), back, rotate)
            if not np.array_equal(back, rows):
                raise RuntimeError(f"compiled split/merge round trip failed for width {width}")


@numba.njit(nogil=True, cache=True)
def sample_entropies(rows, runs, run, hist, bits):
    """``bits[t, k]``: order-0 entropy (bits per byte) of column k of the sample, stored (t = 0)
    or rotated (t = 1), from ``hist`` (int64[2, width, 256], zeroed) filled with the byte counts
    of each column of ``rows`` (uint8[n, width]) over ``runs`` runs of ``run``
    rows, ``n // runs`` rows apart (every row when ``runs`` is 0): ``hist[0, k]`` as stored,
    ``hist[1, k]`` after rotl1 of each element (``byteplanes._rotl1``: the top bit of byte
    k-1 enters byte k, the top byte's wraps to byte 0)."""
    n, width = rows.shape
    spacing = n // runs if runs else n
    for r in range(runs if runs else 1):
        start = r * spacing
        stop = start + run if runs else n
        for i in range(start, stop):
            prev = rows[i, width - 1] >> 7
            for k in range(width):
                b = rows[i, k]
                hist[0, k, b] += 1
                hist[1, k, ((b << 1) | prev) & 0xFF] += 1
                prev = b >> 7
    total = (runs * run if runs else n)
    for t in range(2):
        for k in range(width):
            acc = 0.0
            for v in range(256):
                if hist[t, k, v]:
                    p = hist[t, k, v] / total
                    acc -= p * np.log2(p)
            bits[t, k] = acc


@numba.njit(nogil=True, cache=True)
def copy_bytes(src, dst):
    """dst[:] = src (uint8, same size) without the GIL."""
    for i in range(src.size):
        dst[i] = src[i]
