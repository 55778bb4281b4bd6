"""Stream coders: how one byte stream of one block is stored, compressed and decompressed.

* stored: the bytes as they are (streams an entropy coder cannot shrink, e.g. mantissa bytes);
* zstd: one zstd frame, no content size, no checksum (the frame header and block checksums cover
  that). ``hash_log`` shrinks zstd's match finder: on noisy exponent streams LZ matches cost more
  bits than the Huffman-coded literals they replace, and a 64-entry table keeps matches to the
  cheap local ones (measured on SmolLM2 KV: high stream 2.92 -> 2.78 bits/byte, compression 2-3x
  faster);
* gzip: deflate members (RFC 1952), what QAT hardware writes; software path via ISA-L or zlib;
* packed: fixed-width codes plus exceptions (the ``fast`` method, :mod:`kvshrink.codec.packed`).

zstd compressor objects are not thread-safe: each thread keeps its own, created once and reused.
Every decoder is bounded by the stream's known decoded size, so no input can make it allocate or
loop beyond that; ``decompress_into`` writes zstd streams straight into the caller's buffer.
"""

from __future__ import annotations

import threading
import zlib
from typing import Callable

import numpy as np
import zstandard

from kvshrink.codec import packed, qat
from kvshrink.codec.errors import CodecError
from kvshrink.codec.frame import GZIP, PACKED, STORED, ZSTD

ZSTD_LEVELS = range(1, 23)
GZIP_LEVELS = range(1, 10)

_local = threading.local()

try:
    from isal import isal_zlib as _deflate_lib

    _DEFLATE_ERRORS: tuple[type[Exception], ...] = (zlib.error, _deflate_lib.IsalError)
    _ISAL_MAX_LEVEL = 3
except ImportError:  # isal is optional; zlib writes the same format, slower
    _deflate_lib = zlib  # type: ignore[assignment]
    _DEFLATE_ERRORS = (zlib.error,)
    _ISAL_MAX_LEVEL = 9


def zstd_compressor(level: int, hash_log: int | None) -> zstandard.ZstdCompressor:
    """This thread's compressor for (level, hash_log)."""
    cache = _thread_cache("zstd_c")
    key = (level, hash_log)
    cctx = cache.get(key)
    if cctx is None:
        overrides = {} if hash_log is None else {"hash_log": hash_log}
        params = zstandard.ZstdCompressionParameters.from_level(
            level, write_content_size=False, write_checksum=False, write_dict_id=False, **overrides)
        cctx = cache[key] = zstandard.ZstdCompressor(compression_params=params)
    return cctx


def zstd_compress(stream: np.ndarray, level: int, hash_log: int | None) -> bytes:
    return zstd_compressor(level, hash_log).compress(stream)


def zstd_decompress(payload: memoryview, size: int) -> bytes:
    """Exactly ``size`` bytes from one zstd frame, or CodecError."""
    try:
        claimed = zstandard.frame_content_size(payload)
        if claimed not in (-1, size):  # -1: not recorded (our frames); anything else must agree
            raise CodecError(f"zstd stream claims {claimed} bytes, its block holds {size}")
        data = _zstd_dctx().decompress(payload, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CodecError(f"corrupt zstd stream: {exc}") from None
    if len(data) != size:
        raise CodecError(f"zstd stream decodes to {len(data)} bytes, its block holds {size}")
    return data


def zstd_decompress_into(payload: memoryview, out: np.ndarray) -> np.ndarray:
    """Decompress one zstd frame straight into ``out`` (uint8, exactly its decoded size), which
    is returned; CodecError when the frame decodes to fewer or more bytes. No ``bytes`` is built."""
    size = out.nbytes
    try:
        claimed = zstandard.frame_content_size(payload)
        if claimed not in (-1, size):
            raise CodecError(f"zstd stream claims {claimed} bytes, its block holds {size}")
        reader = _zstd_dctx().stream_reader(payload, read_across_frames=False)
        got = 0
        while got < size:
            n = reader.readinto(out[got:])
            if n == 0:
                break
            got += n
        extra = reader.read(1) if got == size else b""
    except zstandard.ZstdError as exc:
        raise CodecError(f"corrupt zstd stream: {exc}") from None
    if got != size or extra:
        raise CodecError(f"zstd stream decodes to {'more than ' if extra else ''}{got} bytes, its block holds {size}")
    return out


def gzip_compress(stream: np.ndarray, level: int) -> bytes:
    """gzip members of ``stream``: QAT hardware when libqatzip is loaded, else software deflate."""
    if qat.library() is not None:
        try:
            return qat.compress(stream)
        except qat.QatUnavailable as exc:
            qat.note_path(f"software ({exc})")
    else:
        qat.note_path(f"software deflate ({qat.software_deflate_name()})")
    return _deflate_lib.compress(stream, min(level, _ISAL_MAX_LEVEL), wbits=31)


def gzip_decompress(payload: memoryview, size: int) -> bytes:
    """Exactly ``size`` bytes from one or more concatenated gzip members, or CodecError."""
    parts: list[bytes] = []
    total = 0
    data: bytes | memoryview = payload
    try:
        while len(data):
            member = _deflate_lib.decompressobj(wbits=31)
            chunk = member.decompress(data, size - total + 1)
            total += len(chunk)
            parts.append(chunk)
            if total > size:
                raise CodecError(f"deflate stream decodes to more than its block's {size} bytes")
            if not member.eof:
                raise CodecError("truncated deflate stream")
            data = member.unused_data
    except _DEFLATE_ERRORS as exc:
        raise CodecError(f"corrupt deflate stream: {exc}") from None
    if total != size:
        raise CodecError(f"deflate stream decodes to {total} bytes, its block holds {size}")
    return parts[0] if len(parts) == 1 else b"".join(parts)


def compressor_for(method: str, level: int, hash_log: int | None) -> tuple[int, Callable[[np.ndarray], bytes]]:
    """(coding id, function compressing one stream) for a frame method."""
    if method == "zstd":
        return ZSTD, lambda s: zstd_compress(s, level, hash_log)
    if method == "qat":
        return GZIP, lambda s: gzip_compress(s, level)
    return STORED, bytes


def decompress(coding: int, payload: memoryview, size: int) -> bytes | memoryview:
    """Decoded bytes of one stream (stored streams come back as the payload view itself)."""
    if coding == STORED:
        return payload
    if coding == ZSTD:
        return zstd_decompress(payload, size)
    if coding == PACKED:
        out = np.empty(size, np.uint8)
        packed.decode_stream(payload, out)
        return out
    return gzip_decompress(payload, size)


def decompress_into(coding: int, payload: memoryview, out: np.ndarray) -> np.ndarray | memoryview:
    """One stream decoded into ``out`` (uint8 of the stream's decoded size) and returned; a
    stored stream comes back as the payload view itself (``out`` untouched), a deflate stream is
    inflated then copied (zlib / ISA-L cannot inflate into a caller's buffer)."""
    if coding == STORED:
        if len(payload) != out.nbytes:
            raise CodecError(f"stored stream holds {len(payload)} bytes, its block holds {out.nbytes}")
        return payload
    if coding == ZSTD:
        return zstd_decompress_into(payload, out)
    if coding == PACKED:
        packed.decode_stream(payload, out)
        return out
    out[:] = np.frombuffer(gzip_decompress(payload, out.nbytes), dtype=np.uint8)
    return out


def validate_level(method: str, level: int) -> int:
    """``level`` if the method accepts it; ValueError naming the valid range otherwise."""
    if method in ("raw", "fast"):  # no levels: ``fast`` has one setting, chosen per block from the data
        return 0
    valid = ZSTD_LEVELS if method == "zstd" else GZIP_LEVELS
    if not isinstance(level, int) or level not in valid:
        hint = " (levels <= 0 store zstd literals uncompressed and lose most of the gain)" if method == "zstd" else ""
        raise ValueError(f"{method} level must be in {valid.start}..{valid.stop - 1}, got {level!r}{hint}")
    return level


def _zstd_dctx() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor (not thread-safe; created once per thread)."""
    cache = _thread_cache("zstd_d")
    dctx = cache.get("d")
    if dctx is None:
        dctx = cache["d"] = zstandard.ZstdDecompressor()
    return dctx


def _thread_cache(name: str) -> dict:
    cache = getattr(_local, name, None)
    if cache is None:
        cache = {}
        setattr(_local, name, cache)
    return cache
