"""The packed coding of one byte stream: fixed-width codes plus in-order exceptions (``fast``).

Why: the exponent byte of bf16 KV (its high byte after ``rotl1``) has ~2.9 bits of entropy and
almost all values in a narrow window. Coding each byte as ``w``-bit ``(byte - base) mod 256``, with
the top code ``2**w - 1`` an escape whose byte comes next from an exception list, gets within ~0.5
bit of that entropy, and decodes with no data-dependent branches except at escapes: several GB/s
per core where a Huffman or zstd decoder manages ~2.

Payload of a packed stream of ``n`` bytes::

    0   1   width w (0..7; 0: every byte equals base, no codes)
    1   1   base
    2   2   reserved, 0
    4   P   bit planes, chunk by chunk (``CHUNK`` bytes a chunk, the last one shorter): a chunk of
            m bytes has k = 8 * ceil(m / 64) bytes per plane and w planes; bit t of byte j of plane
            p is bit p of the code of the chunk's byte t*k + j (codes past m are padding, ignored)
    4+P ..  exceptions: the bytes whose code is the escape, in stream order (none when w = 0)

``P = planes_size(n, w)``; the exception count is what remains of the payload. The encoder picks
``w`` and ``base`` per stream from a sample (``choose``); a stream whose payload would not be smaller
is stored instead by the caller.

Buffers: encoders return arrays from ``alloc`` (``np.empty`` unless the caller lends pooled ones:
the payload is a view of a buffer of ``encode_buffer_size(n)`` bytes, the low bytes one of ``n``),
which the caller owns; decoders write only into the ``out`` they are given and read the payload
where it lies. Threads: no shared state; the numba kernels run without the GIL, so block workers
run them in parallel. Errors: a payload that does not fit its stream raises CodecError before any
kernel runs (numba does no bounds checks); the kernels check the one data-dependent index, the
exception cursor, themselves. Without numba (or with ``KVSHRINK_CODEC_JIT=0``) the numpy reference
below runs: the same bytes, ~50x slower (0.1 GB/s).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kvshrink.codec.errors import CodecError
from kvshrink.codec.lazy_kernels import LazyKernels

CHUNK = 4096  # == _packjit.CHUNK (kept here too: this module must import without numba)
HEADER = 4
MAX_WIDTH = 7
# What an escape costs when choosing a width, in bits: 8 of size plus its decode time (a scalar
# patch, ~5 ns with the mispredicted branch). Measured on SmolLM2 KV blocks: width 3 (5 % escapes,
# 1.40x) decodes at ~60 % of width 4's speed (0.1 % escapes, 1.333x); 32 keeps KV on width 4, i.e.
# the fast method buys speed with ratio. 8 would choose by size alone.
ESCAPE_COST_BITS = 32
SAMPLE_RUNS, SAMPLE_RUN = 32, 256  # the width is chosen from this many runs of this many bytes

_kernels = LazyKernels("kvshrink.codec._packjit")


def planes_size(n: int, w: int) -> int:
    """Bytes of the bit planes of an ``n``-byte stream at width ``w``."""
    full, rest = divmod(n, CHUNK)
    return w * 8 * (full * (CHUNK // 64) + -(-rest // 64))


def encode_buffer_size(n: int) -> int:
    """Bytes of the buffer an encoder takes for the payload of an ``n``-byte stream (any width)."""
    return HEADER + planes_size(n, MAX_WIDTH) + n


def choose(hist: np.ndarray, n: int) -> tuple[int, int, float]:
    """(width, base, estimated payload bytes) minimising size plus escape cost for a stream of ``n``
    bytes whose sampled byte counts are ``hist`` (int64[256])."""
    total = int(hist.sum())
    if total == 0:
        return 1, 0, float(n)
    jit = _jit()
    if jit is not None:
        w, base, size = jit.choose(hist, n, ESCAPE_COST_BITS, HEADER, MAX_WIDTH)
        return int(w), int(base), float(size)
    windows = np.empty((MAX_WIDTH + 1, 2), np.int64)
    doubled = np.concatenate([[0], np.cumsum(np.concatenate([hist, hist]))])
    for w in range(MAX_WIDTH + 1):
        span = (1 << w) - 1 if w else 1
        counts = doubled[span:span + 256] - doubled[:256]  # bytes in [base, base + span) mod 256
        windows[w] = int(np.argmax(counts)), int(counts.max())
    best, best_cost = (0, 0, float(n)), float("inf")
    for w, (base, count) in enumerate(windows.tolist()):
        escapes = (total - count) / total * n
        if w == 0 and escapes:
            continue
        cost = HEADER + planes_size(n, w) + escapes * ESCAPE_COST_BITS / 8
        if cost < best_cost:
            best, best_cost = (w, base, HEADER + planes_size(n, w) + escapes), cost
    return best


Alloc = Callable[[int], np.ndarray]  # n -> uint8[n], uninitialised


def _empty(n: int) -> np.ndarray:
    return np.empty(n, np.uint8)


def encode_stream(stream: np.ndarray, max_size: int, alloc: Alloc = _empty) -> np.ndarray | None:
    """The packed payload of ``stream`` (uint8[n]), or None when it would not be below ``max_size``."""
    hist = _histogram(stream, False)
    w, base, estimate = choose(hist, stream.size)
    if estimate >= max_size:
        return None
    return _encode(stream, np.empty(0, np.uint8), False, w, base, max_size, alloc)


def choose_words(words: np.ndarray, rotate: bool) -> tuple[int, int, float]:
    """``choose`` for the high bytes of 2-byte elements (uint16[n]; rotl1 first if ``rotate``),
    from a sample of them."""
    return choose(_histogram(words, rotate), words.size)


def encode_words(words: np.ndarray, rotate: bool, max_size: int,
                 alloc: Alloc = _empty) -> tuple[np.ndarray | None, np.ndarray]:
    """Fused split of 2-byte elements (uint16[n]): (packed payload of the high bytes or None when
    not below ``max_size``, the low bytes as uint8[n]). ``rotate`` applies rotl1 first."""
    low = alloc(words.size)
    w, base, estimate = choose_words(words, rotate)
    if estimate >= max_size:
        return None, _low_bytes(words, rotate, low)
    return _encode(words, low, rotate, w, base, max_size, alloc), low


def decode_stream(payload: memoryview, out: np.ndarray) -> None:
    """Decode a packed payload into ``out`` (uint8[n], n its stream length); CodecError if corrupt."""
    w, base, planes, exc = check_payload(payload, out.size)
    _decode(planes, w, base, exc, np.empty(0, np.uint8), out, False)


def decode_words(payload: memoryview, low: np.ndarray, words: np.ndarray, rotate: bool) -> None:
    """Rebuild 2-byte elements into ``words`` (uint16[n]) from the packed high bytes and the stored
    low bytes ``low`` (uint8[n]); CodecError if corrupt."""
    if low.size != words.size:
        raise CodecError(f"low-byte stream holds {low.size} bytes, its block {words.size}")
    w, base, planes, exc = check_payload(payload, words.size)
    _decode(planes, w, base, exc, low, words, rotate)


def check_payload(payload: memoryview, n: int) -> tuple[int, int, np.ndarray, np.ndarray]:
    """(width, base, planes as uint64, exceptions as uint8) of a payload for an ``n``-byte
    stream, every size checked against ``n``; CodecError otherwise."""
    size = len(payload)
    if size < HEADER:
        raise CodecError(f"packed stream of {size} bytes is shorter than its {HEADER}-byte header")
    w, base, r0, r1 = payload[0], payload[1], payload[2], payload[3]
    if w > MAX_WIDTH or r0 or r1:
        raise CodecError(f"packed stream header is invalid (width {w}, reserved {r0}, {r1})")
    planes = planes_size(n, w)
    exceptions = size - HEADER - planes
    if exceptions < 0 or exceptions > n or (w == 0 and exceptions):
        raise CodecError(f"packed stream of {size} bytes does not fit {n} bytes at width {w}")
    data = np.frombuffer(payload, dtype=np.uint8)
    return w, base, data[HEADER:HEADER + planes].view(np.uint64), data[HEADER + planes:]


# -- kernels: numba when importable, else the numpy reference ---------------------------------------
def _encode(src: np.ndarray, low: np.ndarray, rotate: bool, w: int, base: int, max_size: int,
            alloc: Alloc = _empty) -> np.ndarray | None:
    n = src.size
    planes = planes_size(n, w)
    out = alloc(encode_buffer_size(n))
    out[:HEADER] = (w, base, 0, 0)
    jit = _jit()
    if jit is not None:
        ne = jit.encode(src, rotate, w, base, out[HEADER:HEADER + planes].view(np.uint64), out[HEADER + planes:], low)
    else:
        ne = _np_encode(src, low, rotate, w, base, out[HEADER:])
    if ne < 0:  # width 0 but not constant: the sample missed a value
        return _encode(src, low, rotate, 1, base, max_size, lambda size: out)
    size = HEADER + planes + ne
    return out[:size] if size < max_size else None


def _decode(planes: np.ndarray, w: int, base: int, exc: np.ndarray, low: np.ndarray, out: np.ndarray,
            rotate: bool) -> None:
    jit = _jit()
    if jit is not None:
        status = jit.decode(planes, w, base, exc, low, out, rotate)
    else:
        status = _np_decode(planes.view(np.uint8), w, base, exc, low, out, rotate)
    if status:
        raise kernel_error(status)


def kernel_error(status: int) -> CodecError:
    """The CodecError for a decode kernel's negative status (-1: more escape codes than exception
    bytes, -2: fewer)."""
    return CodecError("packed stream has " + ("more escape codes than exceptions" if status == -1
                                              else "more exceptions than escape codes"))


def _histogram(src: np.ndarray, rotate: bool) -> np.ndarray:
    hist = np.zeros(256, np.int64)
    jit = _jit()
    if jit is not None:
        jit.histogram(src, rotate, SAMPLE_RUNS, SAMPLE_RUN, hist)
        return hist
    step = max(SAMPLE_RUN, src.size // SAMPLE_RUNS)
    runs = src[: step * (src.size // step)].reshape(-1, step)[:, :SAMPLE_RUN] if src.size >= step else src
    return np.bincount(_high_bytes(runs.reshape(-1), rotate) if src.itemsize == 2 else runs.reshape(-1),
                       minlength=256).astype(np.int64)


def _high_bytes(words: np.ndarray, rotate: bool) -> np.ndarray:
    a = words.astype(np.uint32)
    if rotate:
        a = ((a << 1) | (a >> 15)) & 0xFFFF
    return (a >> 8).astype(np.uint8)


def _low_bytes(words: np.ndarray, rotate: bool, low: np.ndarray) -> np.ndarray:
    a = words.astype(np.uint32)
    if rotate:
        a = (a << 1) | (a >> 15)
    low[:] = a & 0xFF
    return low


def _segments(n: int) -> list[tuple[int, int, int]]:
    """(start, chunks, bytes per chunk) of the runs of equal chunks of an ``n``-byte stream: the
    full chunks, then the shorter last one."""
    full, rest = divmod(n, CHUNK)
    return [seg for seg in ((0, full, CHUNK), (full * CHUNK, 1 if rest else 0, rest)) if seg[1]]


def _np_encode(src: np.ndarray, low: np.ndarray, rotate: bool, w: int, base: int, out: np.ndarray) -> int:
    """numpy reference of the encode kernel: planes then exceptions into ``out``; -1 if w=0 fails."""
    values = src if src.itemsize == 1 else _high_bytes(src, rotate)
    if src.itemsize == 2:
        _low_bytes(src, rotate, low)
    codes = (values - np.uint8(base)).astype(np.uint8)
    if w == 0:
        return -1 if codes.any() else 0
    esc = (1 << w) - 1
    escaped = codes >= esc
    codes[escaped] = esc
    pos = 0
    for start, count, m in _segments(src.size):
        k = 8 * -(-m // 64)
        chunks = np.zeros((count, 8 * k), np.uint8)  # codes past m stay 0 (padding)
        chunks[:, :m] = codes[start:start + count * m].reshape(count, m)
        by_t = chunks.reshape(count, 8, k)  # [chunk, t, j]: the code that goes to bit t of byte j
        planes = np.zeros((count, w, k), np.uint8)
        for p in range(w):
            for t in range(8):
                planes[:, p] |= ((by_t[:, t] >> p) & 1) << t
        out[pos:pos + planes.size] = planes.reshape(-1)
        pos += planes.size
    ne = int(escaped.sum())
    out[pos:pos + ne] = values[escaped]
    return ne


def _np_decode(planes: np.ndarray, w: int, base: int, exc: np.ndarray, low: np.ndarray, out: np.ndarray,
               rotate: bool) -> int:
    """numpy reference of the decode kernel; 0, or -1/-2 when escapes and exceptions disagree."""
    n = out.size
    codes = np.zeros(n, np.uint8)
    pos = 0
    for start, count, m in _segments(n):
        k = 8 * -(-m // 64)
        if w:
            stored = planes[pos:pos + count * w * k].reshape(count, w, k)
            chunks = np.zeros((count, 8, k), np.uint8)  # [chunk, t, j]
            for p in range(w):
                for t in range(8):
                    chunks[:, t] |= ((stored[:, p] >> t) & 1) << p
            codes[start:start + count * m] = chunks.reshape(count, 8 * k)[:, :m].reshape(-1)
        pos += count * w * k
    values = (codes + np.uint8(base)).astype(np.uint8)
    if w:
        escaped = codes == (1 << w) - 1
        count = int(escaped.sum())
        if count != exc.size:
            return -1 if count > exc.size else -2
        values[escaped] = exc
    if low.size:
        hi, lo = values.astype(np.uint16), low.astype(np.uint16)
        out[:] = ((hi << 7) | (lo >> 1) | ((lo & 1) << 15)) if rotate else ((hi << 8) | lo)
    else:
        out[:] = values
    return 0


def kernels():
    """The compiled kernels module (for whole-frame callers), None when the numpy reference runs."""
    return _jit()


def _jit():
    """The compiled kernels, importing numba on first use; None when unavailable or disabled
    (``KVSHRINK_CODEC_JIT=0``), and then the numpy reference runs."""
    return _kernels.get()
