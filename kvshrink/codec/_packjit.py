"""Compiled loops of the packed coding (numba): the ``fast`` method's streams that code pairs do not take.

Same results as the numpy reference in ``packed`` (the tests compare them byte for byte). The
loops work a chunk (``CHUNK`` elements) at a time on a small scratch array in L1, over chunk-sized
slices (indexing with an offset makes numba emit negative-index checks that stop LLVM from
vectorising: 30x slower), eight codes per uint64 word for the bit planes. Escapes are found 64
codes at a time, then patched one by one, so their cost is per escape, not per element.

Threads: every kernel is ``nogil`` and shares no state, so worker
threads run them in parallel. Buffers: kernels write only the output arrays they are given
(scratch is allocated per call).
Errors: no bounds checking here (numba does none): callers validate every size first
(``packed.check_payload``); the only data-dependent index, the exception cursor, is checked here
and reported as a negative status.
Importing this module raises ImportError when numba is missing.
"""

from __future__ import annotations

import numba
import numpy as np

CHUNK = 4096  # elements per chunk; a chunk's codes live in bit planes of CHUNK // 8 bytes
ERR_EXCEPTIONS = -1  # more escape codes than exception bytes
ERR_COUNT = -2  # fewer escape codes than exception bytes
_LSB = np.uint64(0x0101010101010101)
_LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_HIGH = np.uint64(0x8080808080808080)
_ONE = np.uint64(1)
_BYTE_MAGIC = np.uint64(0x0001020304050607)


@numba.njit(nogil=True, cache=True, inline="always")
def planes_bytes(n, w):
    """Bytes of the bit planes of an ``n``-byte stream at width ``w`` (``packed.planes_size``)."""
    return w * 8 * ((n // CHUNK) * (CHUNK // 64) + (n % CHUNK + 63) // 64)


@numba.njit(nogil=True, cache=True, inline="always")
def _codes_from_planes(planes, w, codes):
    """codes[t*k + j] gets bit t of byte j of plane p as its bit p (``planes`` holds w planes of
    k bytes), eight bytes at a time: ``planes`` and ``codes`` are uint64 views."""
    k = codes.size // 8
    if w == 4 or w == 3:  # the widths real KV gets: unrolled, one pass per t (2.3x the generic loop)
        p0, p1, p2 = planes[0:k], planes[k:2 * k], planes[2 * k:3 * k]
        p3 = planes[3 * k:4 * k] if w == 4 else planes[0:k]
        top = _LSB if w == 4 else np.uint64(0)
        for t in range(8):
            dst = codes[t * k:(t + 1) * k]
            sh = np.uint64(t)
            for j in range(k):
                dst[j] = ((p0[j] >> sh) & _LSB) | (((p1[j] >> sh) & _LSB) << np.uint64(1)) | \
                    (((p2[j] >> sh) & _LSB) << np.uint64(2)) | (((p3[j] >> sh) & top) << np.uint64(3))
        return
    codes[:] = 0
    for p in range(w):
        plane = planes[p * k:(p + 1) * k]
        for t in range(8):
            dst = codes[t * k:(t + 1) * k]
            for j in range(k):
                dst[j] |= ((plane[j] >> np.uint64(t)) & _LSB) << np.uint64(p)


@numba.njit(nogil=True, cache=True, inline="always")
def _planes_from_codes(codes, w, planes):
    """Inverse of ``_codes_from_planes``."""
    k = codes.size // 8
    for p in range(w):
        plane = planes[p * k:(p + 1) * k]
        shift = np.uint64(p)
        for j in range(k):
            acc = np.uint64(0)
            for t in range(8):  # unrolled; the j loop vectorises (3x faster than a pass per t)
                acc |= ((codes[t * k + j] >> shift) & _LSB) << np.uint64(t)
            plane[j] = acc


@numba.njit(nogil=True, cache=True, inline="always")
def _escapes(word, pattern):
    """0x80 in each byte of ``word`` equal to the escape code (``pattern`` = escape * _LSB), exact."""
    x = word ^ pattern
    y = ((x & _LOW7) + _LOW7) | x
    return ~y & _HIGH


@numba.njit(nogil=True, cache=True, inline="always")
def _mark_escapes(codes, esc, groups):
    """groups[g] = whether codes[64g:64g+64] (uint8, padding included) hold the escape code;
    returns whether any group does. Byte compares that vectorise; the patch pass then visits only
    the groups with escapes (scanning every word cost more than decoding, even at one escape per
    thousand bytes)."""
    found = False
    for g in range(groups.size):
        seg = codes[64 * g:64 * g + 64]
        hit = np.uint8(0)
        for b in range(64):  # max of uint8 flags: 10x faster than or-ing bools, which do not vectorise
            hit = max(hit, np.uint8(seg[b] == esc))
        groups[g] = hit != 0
        found |= hit != 0
    return found


@numba.njit(nogil=True, cache=True, inline="always")
def _byte_index(bit):
    """b for ``bit`` = 1 << (8*b + 7): a multiply moves byte (7-b) of the magic to the top."""
    return np.int64(((bit >> np.uint64(7)) * _BYTE_MAGIC) >> np.uint64(56))


@numba.njit(nogil=True, cache=True, inline="always")
def _escape_positions(codes64, groups, m, pattern, positions):
    """Write into ``positions`` the indices below ``m`` of the chunk's codes (``codes64``, uint64
    words of 8 codes) equal to the escape (``pattern`` = escape * _LSB), in order, visiting only
    the 64-code groups ``_mark_escapes`` flagged; returns how many. A code past ``m`` is padding
    (hostile planes may set it): skipped."""
    count = 0
    for g in range(groups.size):
        if not groups[g]:
            continue
        for j in range(8 * g, 8 * g + 8):
            hit = _escapes(codes64[j], pattern)
            while hit:
                bit = hit & (~hit + _ONE)  # lowest escape of the word
                hit ^= bit
                i = 8 * j + _byte_index(bit)
                if i < m:
                    positions[count] = i
                    count += 1
    return count


@numba.njit(nogil=True, cache=True, inline="always")
def _split_codes(s, words, rotate, base, esc, lo, codes):
    """Codes ``min((value - base) mod 256, esc)`` into ``codes``: of the bytes ``s``, or, with
    ``words``, of the high bytes of 2-byte elements ``s`` (rotated left by one bit first if
    ``rotate``), whose low bytes go into ``lo``. One loop per case, no reduction in it: each
    vectorises."""
    if not words:
        for i in range(s.size):
            codes[i] = min(np.uint8(s[i] - base), esc)
    elif rotate:
        for i in range(s.size):
            a = np.uint16((s[i] << 1) | (s[i] >> 15))
            lo[i] = np.uint8(a & 0xFF)
            codes[i] = min(np.uint8(np.uint8(a >> 8) - base), esc)
    else:
        for i in range(s.size):
            lo[i] = np.uint8(s[i] & 0xFF)
            codes[i] = min(np.uint8(np.uint8(s[i] >> 8) - base), esc)


@numba.njit(nogil=True, cache=True, inline="always")
def _coded_byte(value, words, rotate):
    """The byte ``_split_codes`` codes for element ``value`` (an escape's exception byte)."""
    a = np.uint32(value)
    if words:
        if rotate:
            a = ((a << 1) | (a >> 15)) & 0xFFFF
        a >>= 8
    return np.uint8(a)


@numba.njit(nogil=True, cache=True, inline="always")
def _merge_codes(codes, base, lo, dst, rotate):
    """``dst[i]``: the 2-byte element of high byte ``codes[i] + base`` and low byte ``lo[i]``
    (rotated back if ``rotate``); an escape's element is patched afterwards. A loop per case: each
    vectorises."""
    if rotate:
        for i in range(codes.size):
            dst[i] = _word(np.uint8(codes[i] + base), lo[i], True)
    else:
        for i in range(codes.size):
            dst[i] = _word(np.uint8(codes[i] + base), lo[i], False)


@numba.njit(nogil=True, cache=True, inline="always")
def _word(high, low, rotate):
    """The 2-byte element whose (rotated, if ``rotate``) high and low bytes are given."""
    h = np.uint16(high)
    r = np.uint16(low)
    if rotate:
        return np.uint16((h << 7) | (r >> 1) | ((r & 1) << 15))
    return np.uint16((h << 8) | r)


@numba.njit(nogil=True, cache=True)
def decode(planes, w, base, exc, low, out, rotate):
    """Decode a packed stream into ``out``: uint8[n] when ``low`` is empty, else uint16[n] words
    fused with the stored low-byte stream ``low`` (uint8[n]). Returns 0 or ERR_*."""
    n = out.size
    fused = low.size > 0
    pattern = np.uint64((1 << w) - 1) * _LSB
    codes64, groups = np.empty(CHUNK // 8, np.uint64), np.empty(CHUNK // 64, np.bool_)
    positions = np.empty(CHUNK, np.int64)  # of the escapes in a chunk
    codes = codes64.view(np.uint8)
    ei = 0
    pos = 0
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        k = (m + 63) // 64
        c64 = codes64[:8 * k]
        _codes_from_planes(planes[pos:pos + w * k], w, c64)
        pos += w * k
        c8 = codes[:m]
        dst = out[start:start + m]
        if fused:
            _merge_codes(c8, base, low[start:start + m], dst, rotate)
        else:
            for i in range(m):
                dst[i] = np.uint8(c8[i] + base)
        if w == 0 or not _mark_escapes(codes, np.uint8((1 << w) - 1), groups[:k]):
            continue
        count = _escape_positions(c64, groups[:k], m, pattern, positions)
        if ei + count > exc.size:
            return ERR_EXCEPTIONS
        for e in range(count):
            i = positions[e]
            dst[i] = _word(exc[ei], low[start + i], rotate) if fused else exc[ei]
            ei += 1
    return 0 if ei == exc.size else ERR_COUNT


@numba.njit(nogil=True, cache=True)
def encode(src, rotate, w, base, planes, exc, low):
    """Pack ``src`` (uint8[n] bytes, or uint16[n] words whose low bytes go to ``low``, uint8[n],
    and high bytes are packed) into ``planes`` and ``exc`` (>= n bytes). Returns the number of
    exception bytes, or -1 when ``w`` is 0 and not every byte equals ``base``."""
    n = src.size
    words = low.size > 0
    esc = np.uint8((1 << w) - 1 if w else 255)  # width 0: no clamp, any non-zero code fails
    b8 = np.uint8(base)
    pattern = np.uint64(esc) * _LSB
    codes64, groups = np.empty(CHUNK // 8, np.uint64), np.empty(CHUNK // 64, np.bool_)
    positions = np.empty(CHUNK, np.int64)  # of the escapes in a chunk
    codes = codes64.view(np.uint8)
    ne = 0
    pos = 0
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        k = (m + 63) // 64
        c8 = codes[:m]
        s = src[start:start + m]
        _split_codes(s, words, rotate, b8, esc, low[start:start + m], c8)
        codes[m:64 * k] = 0
        c64 = codes64[:8 * k]
        if w == 0:
            any_code = np.uint64(0)
            for j in range(8 * k):
                any_code |= c64[j]
            if any_code:
                return -1
        elif _mark_escapes(codes, esc, groups[:k]):
            for e in range(_escape_positions(c64, groups[:k], m, pattern, positions)):
                exc[ne] = _coded_byte(s[positions[e]], words, rotate)
                ne += 1
        _planes_from_codes(codes64[:8 * k], w, planes[pos:pos + w * k])
        pos += w * k
    return ne


@numba.njit(nogil=True, cache=True)
def histogram(src, rotate, runs, run, hist):
    """Add to ``hist`` (int64[256]) the bytes (uint8 ``src``) or rotated high bytes (uint16
    ``src``) of ``runs`` evenly spaced runs of ``run`` elements."""
    n = src.size
    step = max(run, n // runs)
    for start in range(0, n, step):
        s = src[start:min(start + run, n)]
        for i in range(s.size):
            a = np.uint32(s[i])
            if src.itemsize == 2:
                if rotate:
                    a = ((a << 1) | (a >> 15)) & 0xFFFF
                a >>= 8
            hist[a] += 1


@numba.njit(nogil=True, cache=True)
def best_windows(hist, out):
    """out[w] = (base, count): the start and byte count of the fullest circular window of
    ``2**w - 1`` byte values (1 for w = 0) in ``hist`` (int64[256]), for w = 0..out.shape[0]-1."""
    for w in range(out.shape[0]):
        span = (1 << w) - 1 if w else 1
        count = 0
        for v in range(span):
            count += hist[v]
        best, base = count, 0
        for b in range(1, 256):  # slide: drop b-1, add b+span-1
            count += hist[(b + span - 1) & 0xFF] - hist[b - 1]
            if count > best:
                best, base = count, b
        out[w, 0] = base
        out[w, 1] = best


@numba.njit(nogil=True, cache=True)
def choose(hist, n, escape_cost_bits, header, max_width):
    """(width, base, estimated payload bytes): see ``packed.choose``, which this mirrors."""
    total = 0
    for v in range(256):
        total += hist[v]
    windows = np.empty((max_width + 1, 2), np.int64)
    best_windows(hist, windows)
    best_w, best_base, best_size, best_cost = 0, 0, float(n), np.inf
    for w in range(max_width + 1):
        escapes = (total - windows[w, 1]) / total * n
        if w == 0 and escapes:
            continue
        planes = planes_bytes(n, w)
        cost = header + planes + escapes * escape_cost_bits / 8
        if cost < best_cost:
            best_w, best_base, best_size, best_cost = w, windows[w, 0], header + planes + escapes, cost
    return best_w, best_base, best_size
