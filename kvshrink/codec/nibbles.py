"""The nibble coding of a high-byte stream (``dense`` frames, format version 3): 4-bit codes, paired, zstd.

Why: zstd's cost on the exponent stream of bf16 KV is its Huffman stage, paid per symbol. Nearly
every exponent byte lies in a window of 15 values (~2.9 bits of entropy), so coding each as
``(byte - base) mod 256`` in 4 bits, two codes to a byte, halves the symbols zstd sees while
keeping what it can learn: measured on SmolLM2 KV at zstd level 1, the same ratio as zstd on the
plain stream (1.484x), its zstd stage ~3x faster to encode and ~2.5x to decode; the whole dense codec
went from 0.89 to 1.28 GB/s encoding and 1.41 to 1.81 GB/s decoding on one core (Xeon with AMX,
best of five interleaved runs). The low (mantissa) byte is stored.
Used for 2-byte elements whose high stream alone is worth compressing (bf16 / fp16 KV); a block
whose exponents do not fit the window (more than ``MAX_ESCAPE_SHARE`` escape) takes plain zstd.

Payload of a nibble-coded stream of ``n`` bytes::

    0   1   base
    1   3   reserved, 0
    4   4   Z: bytes of the zstd frame (uint32, little-endian)
    8   Z   one zstd frame of ceil(n / 2) bytes: byte j holds the code of stream byte 2j in its
            low nibble and of byte 2j+1 in its high one (0 past the end); code 15 is the escape
    8+Z ..  exceptions: the bytes whose code is the escape, in stream order

The same codes stored without zstd are the ``fast`` method's code-pair streams (format version 4,
coding ``pairs``), where the sample picks packing's 4-bit width: the same size as packed bit
planes, but no bit transposition. Measured on 8 real SmolLM2 KV chunks, one core of a Xeon with
AMX, runs alternated: kernels decode 4.1-4.8 GB/s (planes 3.1-3.3) and encode 3.2-3.4 (2.7); a
whole fast frame decodes at 3.35-3.4 GB/s (2.9-3.0), and a fast tier demoting a chunk to a dense
one only runs zstd over the pair bytes (:mod:`kvshrink.codec.transcode`): 1.2-1.3 GB/s (0.6-0.9).
Payload of a code-pair stream of ``n`` bytes::

    0   1   base
    1   3   reserved, 0
    4   P   the ceil(n / 2) code pairs, as above
    4+P ..  exceptions, in stream order

Buffers: the encoder returns a new ``bytes`` payload and writes the low bytes into a buffer from
``alloc``, which the caller owns; the decoder writes only into the ``out`` it is given, reading the
payload where it lies. Threads: no shared state (zstd contexts are per thread); the numba kernels
run without the GIL. Errors: a payload that does not fit its stream raises CodecError before any
kernel runs; the kernels report an exception count that disagrees with the escapes. Without numba
(or with ``KVSHRINK_CODEC_JIT=0``) the numpy reference below writes the same bytes, slower.
"""

from __future__ import annotations

import struct
from typing import Callable

import numpy as np

from kvshrink.codec import backends, packed
from kvshrink.codec.errors import CodecError
from kvshrink.codec.lazy_kernels import LazyKernels

HEADER = struct.Struct("<B3xI")  # base, reserved, zstd frame length
PAIRS_HEADER = 4  # a code-pair stream's: base, 3 reserved bytes
ESCAPE = 15
WINDOW = 15  # byte values a code names without an escape: base .. base + 14
PAIRS_WIDTH = 4  # the packed width whose window is WINDOW (2**4 - 1): there the fast method stores code pairs
MAX_ESCAPE_SHARE = 1 / 64  # beyond this share of escapes a block takes plain zstd (real KV: ~0.1 %)

_kernels = LazyKernels("kvshrink.codec._nibblejit")

Alloc = Callable[[int], np.ndarray]  # n -> uint8[n], uninitialised


def choose_base(hist: np.ndarray) -> tuple[int, float]:
    """(base, share of the sampled bytes outside ``base .. base + 14``) for a sample's byte counts."""
    total = int(hist.sum())
    if not total:
        return 0, 0.0
    kernels = packed.kernels()
    if kernels is not None:  # the packed coding's window search (a window of 2**4 - 1 values): 2 us, not 30
        windows = np.empty((5, 2), np.int64)
        kernels.best_windows(hist, windows)
        base, inside = windows[4].tolist()
        return base, 1.0 - inside / total
    doubled = np.concatenate([[0], np.cumsum(np.concatenate([hist, hist]))])
    counts = doubled[WINDOW:WINDOW + 256] - doubled[:256]
    base = int(np.argmax(counts))
    return base, 1.0 - int(counts[base]) / total


def encode_words(words: np.ndarray, rotate: bool, level: int, alloc: Alloc) -> tuple[bytes, np.ndarray] | None:
    """(payload of the high bytes, their low bytes as uint8[n] from ``alloc``) of 2-byte elements
    (uint16[n]; ``rotate`` applies rotl1 first), or None when the high bytes do not suit the
    coding (too many escapes, or a payload no smaller than the stream)."""
    low = alloc(words.size)
    payload = _encode(words, rotate, level, alloc, low)
    return None if payload is None else (payload, low)


def encode_stream(stream: np.ndarray, level: int, alloc: Alloc) -> bytes | None:
    """The payload of a high-byte ``stream`` (uint8[n]) already split out (a fast frame's packed
    exponents, decoded), or None when it does not suit the coding."""
    return _encode(stream, False, level, alloc, np.empty(0, np.uint8))


def _encode(src: np.ndarray, rotate: bool, level: int, alloc: Alloc, low: np.ndarray) -> bytes | None:
    n = src.size
    base, outside = choose_base(packed._histogram(src, rotate))
    if outside > MAX_ESCAPE_SHARE:
        return None
    pairs, exc = alloc((n + 1) // 2), alloc(n)
    ne = _code(src, rotate, base, pairs, exc, low)
    if ne > n * MAX_ESCAPE_SHARE:
        return None
    compressed = backends.zstd_compress(pairs, level, None)  # zstd's own match finder: see module docstring
    if HEADER.size + len(compressed) + ne >= n:
        return None
    return b"".join([HEADER.pack(base, len(compressed)), compressed, exc[:ne]])


def encode_pair_words(words: np.ndarray, rotate: bool, base: int,
                      alloc: Alloc) -> tuple[np.ndarray, np.ndarray] | None:
    """(code-pair payload from ``alloc``, low bytes as uint8[n] from ``alloc``) of 2-byte elements
    (uint16[n]; ``rotate`` applies rotl1 first) coded from ``base`` (the sample's best window:
    ``choose_base``), or None when more than ``MAX_ESCAPE_SHARE`` of them escape or the payload
    would not be smaller than the high bytes."""
    n = words.size
    low = alloc(n)
    out = alloc(PAIRS_HEADER + (n + 1) // 2 + n)
    out[:PAIRS_HEADER] = (base, 0, 0, 0)
    pairs = out[PAIRS_HEADER:PAIRS_HEADER + (n + 1) // 2]
    exc = out[PAIRS_HEADER + pairs.size:]
    ne = _code(words, rotate, base, pairs, exc, low)
    size = PAIRS_HEADER + pairs.size + ne
    if ne > n * MAX_ESCAPE_SHARE or size >= n:
        return None
    return out[:size], low


def decode_pair_words(payload: memoryview, low: np.ndarray, words: np.ndarray, rotate: bool) -> None:
    """Rebuild 2-byte elements into ``words`` (uint16[n]) from a code-pair payload and the stored
    low bytes ``low`` (uint8[n]); CodecError if corrupt."""
    n = words.size
    if low.size != n:
        raise CodecError(f"low-byte stream holds {low.size} bytes, its block {n}")
    base, pairs, exc = check_pairs_payload(payload, n)
    _rebuild(pairs, base, exc, low, words, rotate)


def check_pairs_payload(payload: memoryview, n: int) -> tuple[int, np.ndarray, np.ndarray]:
    """(base, the code pairs, the exceptions), both uint8, of a code-pair payload for an ``n``-byte
    stream, every size checked against ``n``; CodecError otherwise."""
    size, pairs = len(payload), (n + 1) // 2
    if size < PAIRS_HEADER + pairs or size - PAIRS_HEADER - pairs > n:
        raise CodecError(f"code-pair stream of {size} bytes does not fit {n} bytes")
    data = np.frombuffer(payload, dtype=np.uint8)
    if data[1:PAIRS_HEADER].any():
        raise CodecError("code-pair stream header is invalid (reserved bytes are not zero)")
    return int(data[0]), data[PAIRS_HEADER:PAIRS_HEADER + pairs], data[PAIRS_HEADER + pairs:]


def dense_from_pairs(payload: memoryview, n: int, level: int) -> bytes | None:
    """The nibble payload of the stream a code-pair ``payload`` holds (its pairs through zstd, the
    same base and exceptions: no code is decoded), or None where nibble coding would not take
    that stream (too many escapes, or no smaller than ``n``). CodecError if the payload does not
    fit ``n`` bytes."""
    base, pairs, exc = check_pairs_payload(payload, n)
    if exc.size > n * MAX_ESCAPE_SHARE:
        return None
    compressed = backends.zstd_compress(pairs, level, None)
    if HEADER.size + len(compressed) + exc.size >= n:
        return None
    return b"".join([HEADER.pack(base, len(compressed)), compressed, exc])


def decode_words(payload: memoryview, low: np.ndarray, words: np.ndarray, rotate: bool,
                 scratch: np.ndarray) -> None:
    """Rebuild 2-byte elements into ``words`` (uint16[n]) from a nibble payload and the stored low
    bytes ``low`` (uint8[n]); ``scratch`` (uint8, at least ceil(n/2) bytes) takes the code pairs.
    CodecError if corrupt."""
    n = words.size
    if low.size != n:
        raise CodecError(f"low-byte stream holds {low.size} bytes, its block {n}")
    base, frame, exc = check_payload(payload, n)
    pairs = backends.zstd_decompress_into(frame, scratch[:(n + 1) // 2])
    _rebuild(pairs, base, exc, low, words, rotate)


def check_payload(payload: memoryview, n: int) -> tuple[int, memoryview, np.ndarray]:
    """(base, the zstd frame, the exceptions as uint8) of a payload for an ``n``-byte stream,
    every size checked against ``n``; CodecError otherwise."""
    size = len(payload)
    if size < HEADER.size:
        raise CodecError(f"nibble stream of {size} bytes is shorter than its {HEADER.size}-byte header")
    base, zlen = HEADER.unpack_from(payload, 0)
    if bytes(payload[1:4]) != b"\0\0\0":
        raise CodecError("nibble stream header is invalid (reserved bytes are not zero)")
    exceptions = size - HEADER.size - zlen
    if zlen == 0 or exceptions < 0 or exceptions > n:
        raise CodecError(f"nibble stream of {size} bytes does not fit its {zlen}-byte zstd frame "
                         f"and {n} bytes")
    end = HEADER.size + zlen
    return base, payload[HEADER.size:end], np.frombuffer(payload, dtype=np.uint8)[end:]


def decode_pair_stream(payload: memoryview, out: np.ndarray) -> None:
    """The high bytes a code-pair payload holds, into ``out`` (uint8[n]); CodecError if corrupt.
    numpy only: read where a demotion's transcode cannot hand the pairs to zstd (tiny blocks)."""
    base, pairs, exc = check_pairs_payload(payload, out.size)
    values = _np_high_bytes(pairs, base, exc, out.size)
    if isinstance(values, int):
        raise packed.kernel_error(values)
    out[:] = values


# -- kernels: numba when importable, else the numpy reference ---------------------------------------
def _code(src: np.ndarray, rotate: bool, base: int, pairs: np.ndarray, exc: np.ndarray, low: np.ndarray) -> int:
    """The encode kernel (see ``_np_encode``): the number of exception bytes."""
    jit = _jit()
    return jit.encode(src, rotate, base, pairs, exc, low) if jit is not None else \
        _np_encode(src, rotate, base, pairs, exc, low)


def _rebuild(pairs: np.ndarray, base: int, exc: np.ndarray, low: np.ndarray, words: np.ndarray,
             rotate: bool) -> None:
    """The decode kernel (see ``_np_decode``); CodecError when escapes and exceptions disagree."""
    jit = _jit()
    status = jit.decode(pairs, base, exc, low, words, rotate) if jit is not None else \
        _np_decode(pairs, base, exc, low, words, rotate)
    if status:
        raise packed.kernel_error(status)


def _np_encode(src: np.ndarray, rotate: bool, base: int, pairs: np.ndarray, exc: np.ndarray,
               low: np.ndarray) -> int:
    """numpy reference of the encode kernel (uint16 words with ``low``, or uint8 bytes)."""
    a = src.astype(np.uint32)
    if src.itemsize == 2:
        if rotate:
            a = ((a << 1) | (a >> 15)) & 0xFFFF
        low[:] = a & 0xFF
        a >>= 8
    high = a.astype(np.uint8)
    codes = np.minimum((high - np.uint8(base)).astype(np.uint8), ESCAPE).astype(np.uint8)
    padded = np.zeros(2 * pairs.size, np.uint8)
    padded[:codes.size] = codes
    pairs[:] = padded[0::2] | (padded[1::2] << 4)
    escaped = codes == ESCAPE
    ne = int(escaped.sum())
    exc[:ne] = high[escaped]
    return ne


def _np_decode(pairs: np.ndarray, base: int, exc: np.ndarray, low: np.ndarray, words: np.ndarray,
               rotate: bool) -> int:
    """numpy reference of the decode kernel; 0, or -1/-2 when escapes and exceptions disagree."""
    values = _np_high_bytes(pairs, base, exc, words.size)
    if isinstance(values, int):
        return values
    hi, lo = values.astype(np.uint16), low.astype(np.uint16)
    words[:] = ((hi << 7) | (lo >> 1) | ((lo & 1) << 15)) if rotate else ((hi << 8) | lo)
    return 0


def _np_high_bytes(pairs: np.ndarray, base: int, exc: np.ndarray, n: int) -> np.ndarray | int:
    """The ``n`` bytes the code pairs and exceptions hold (uint8), or -1/-2 when escapes and
    exceptions disagree."""
    codes = np.empty(2 * pairs.size, np.uint8)
    codes[0::2], codes[1::2] = pairs & 15, pairs >> 4
    codes = codes[:n]
    values = (codes + np.uint8(base)).astype(np.uint8)
    escaped = codes == ESCAPE
    count = int(escaped.sum())
    if count != exc.size:
        return -1 if count > exc.size else -2
    values[escaped] = exc
    return values


def _jit():
    """The compiled kernels (None: the numpy reference runs); see ``packed._jit``."""
    return _kernels.get()
