"""Compiled loops of the nibble coding (numba): what makes the dense method's exponent stream cheap.

Same results as the numpy reference in ``nibbles`` (the tests compare them byte for byte). Like
``_packjit``, the loops work a chunk (``CHUNK`` elements) at a time on a scratch array in L1, in
loops without branches that vectorise; escapes are found 64 codes at a time, then patched one by
one, so their cost is per escape, not per element.

Threads: every kernel is ``nogil`` and shares no state. Buffers: kernels write only the output
arrays they are given (scratch is allocated per call). Errors: no bounds checking here (numba does
none): callers validate every size first (``nibbles.check_payload``); the exception cursor, the
only data-dependent index, is checked here and reported as a negative status.
Importing this module raises ImportError when numba is missing.
"""

from __future__ import annotations

import numba
import numpy as np

from kvshrink.codec._packjit import (
    _LSB,
    _coded_byte,
    _escape_positions,
    _mark_escapes,
    _merge_codes,
    _split_codes,
    _word,
)

CHUNK = 4096  # elements per chunk (even: a chunk starts on a whole pair)
ESCAPE = 15
ERR_EXCEPTIONS = -1  # more escape codes than exception bytes
ERR_COUNT = -2  # fewer escape codes than exception bytes


@numba.njit(nogil=True, cache=True)
def encode(src, rotate, base, pairs, exc, low):
    """Code ``src`` into ``pairs`` (uint8[ceil(n/2)]) and ``exc`` (uint8[n]): the high bytes of
    uint16[n] words (rotated left by one bit first if ``rotate``), whose low bytes go to ``low``
    (uint8[n]), or uint8[n] bytes as they are (``low`` empty). Returns the number of exception bytes."""
    n = src.size
    words = low.size > 0
    b8 = np.uint8(base)
    esc = np.uint8(ESCAPE)
    pattern = np.uint64(ESCAPE) * _LSB
    codes64, groups = np.empty(CHUNK // 8, np.uint64), np.empty(CHUNK // 64, np.bool_)
    positions = np.empty(CHUNK, np.int64)  # of the escapes in a chunk
    codes = codes64.view(np.uint8)
    ne = 0
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        k = (m + 63) // 64
        s = src[start:start + m]
        c8 = codes[:m]
        _split_codes(s, words, rotate, b8, esc, low[start:start + m], c8)
        codes[m:64 * k] = 0
        half = (m + 1) // 2
        p = pairs[start // 2:start // 2 + half]
        for j in range(m // 2):
            p[j] = np.uint8(c8[2 * j] | (c8[2 * j + 1] << 4))
        if m % 2:
            p[half - 1] = c8[m - 1]
        if not _mark_escapes(codes, esc, groups[:k]):
            continue
        for e in range(_escape_positions(codes64, groups[:k], m, pattern, positions)):
            exc[ne] = _coded_byte(s[positions[e]], words, rotate)
            ne += 1
    return ne


@numba.njit(nogil=True, cache=True)
def decode(pairs, base, exc, low, out, rotate):
    """Rebuild ``out`` (uint16[n]) from the code pairs (uint8[ceil(n/2)]), the exception bytes
    and the stored low bytes ``low`` (uint8[n]). Returns 0 or ERR_*."""
    n = out.size
    pattern = np.uint64(ESCAPE) * _LSB
    codes64, groups = np.empty(CHUNK // 8, np.uint64), np.empty(CHUNK // 64, np.bool_)
    positions = np.empty(CHUNK, np.int64)  # of the escapes in a chunk
    codes = codes64.view(np.uint8)
    ei = 0
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        k = (m + 63) // 64
        half = (m + 1) // 2
        p = pairs[start // 2:start // 2 + half]
        for j in range(m // 2):
            codes[2 * j] = p[j] & 15
            codes[2 * j + 1] = p[j] >> 4
        if m % 2:
            codes[m - 1] = p[half - 1] & 15
        codes[m:64 * k] = 0
        c8 = codes[:m]
        dst = out[start:start + m]
        lo = low[start:start + m]
        _merge_codes(c8, base, lo, dst, rotate)
        if not _mark_escapes(codes, np.uint8(ESCAPE), groups[:k]):
            continue
        count = _escape_positions(codes64, groups[:k], m, pattern, positions)
        if ei + count > exc.size:
            return ERR_EXCEPTIONS
        for e in range(count):
            dst[positions[e]] = _word(exc[ei], lo[positions[e]], rotate)
            ei += 1
    return 0 if ei == exc.size else ERR_COUNT
