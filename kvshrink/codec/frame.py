"""The self-describing frame: layout, writing, and strict validation on reading.

Frame format versions 1 to 4 (all integers little-endian); each frame is written as the oldest
version that can hold it, so an older reader says a frame it cannot read was written by a newer
kvshrink: version 4 for a ``fast`` frame with a code-pair stream, version 2 for other ``fast``
frames (packed streams only), version 3 for a zstd frame with a nibble-coded stream
(:mod:`kvshrink.codec.nibbles`), version 1 for every other frame::

    offset  size  field
    0       4     magic b"KVSZ"
    4       1     format version (1; 2 or 4 for fast frames; 3 for zstd frames with a nibble stream)
    5       1     method: 0 raw, 1 zstd (versions 1, 3), 2 qat, 3 fast (versions 2, 4); each stream
                         names its coding
    6       1     container: 0 numpy, 1 torch
    7       1     transform: 0 none, 1 rotl1 (each element rotated left by one bit before the split)
    8       1     element width w in bytes (1..16)
    9       1     streams per block s: 1 (bytes kept together) or w (byte-split)
    10      1     ndim (0..32)
    11      1     dtype name length L (1..32)
    12      8     block_elems: elements per block (the last block may be shorter)
    20      4     reserved, 0
    24      L     dtype name, ASCII: numpy ``dtype.str`` ("<u2") or torch name ("bfloat16")
    ..      8*ndim       shape
    ..      8*nblocks    xxh3-64 of each block's raw (decoded) bytes
    ..      nblocks*s    stream coding: 0 stored, 1 zstd frame, 2 gzip members (deflate),
                         3 packed (fixed-width codes + exceptions, :mod:`kvshrink.codec.packed`),
                         4 nibble (4-bit codes, zstd, exceptions; version 3, the high stream of a
                         2-byte element whose low stream is stored), 5 pairs (the nibble coding's
                         4-bit codes stored, no zstd; version 4, fast frames, placed like nibble)
    ..      4*nblocks*s  stream payload sizes
    ..      8     xxh3-64 of every header byte above
    payload: the streams, block by block; within a block, most significant byte first

``nblocks = ceil(elements / block_elems)``. Block checksums cover the *decoded* bytes, so a codec
bug, a bit flip in a stored stream or a foreign stream that happens to decompress all fail the
check. Reading validates every field against the blob's real length and against caps before
anything is allocated.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from kvshrink.codec.dtypes import CONTAINERS, ArrayKind, dtype_width
from kvshrink.codec.errors import CodecError

MAGIC = b"KVSZ"
FORMAT_VERSION = 4  # the newest version this reader knows
FAST_VERSION = 2  # fast frames of packed and stored streams only
NIBBLE_VERSION = 3  # zstd frames with a nibble-coded stream; every other frame is version 1
PAIRS_VERSION = 4  # fast frames with a code-pair stream
METHODS = ("raw", "zstd", "qat", "fast")
TRANSFORMS = ("none", "rotl1")

STORED, ZSTD, GZIP, PACKED, NIBBLE, PAIRS = 0, 1, 2, 3, 4, 5
CODINGS = {"raw": frozenset({STORED}), "zstd": frozenset({STORED, ZSTD, NIBBLE}), "qat": frozenset({STORED, GZIP}),
           "fast": frozenset({STORED, PACKED, PAIRS})}
_HIGH_ONLY = {NIBBLE: NIBBLE_VERSION, PAIRS: PAIRS_VERSION}  # codings of a 2-byte element's high stream only
_CODINGS = PAIRS + 1
_ALLOWED = {m: np.isin(np.arange(256), sorted(c)) for m, c in CODINGS.items()}  # coding byte -> allowed?

MAX_NDIM = 32
MAX_DTYPE_NAME = 32
MAX_DIM = 1 << 48
MAX_BLOCKS = 1 << 24
DEFAULT_MAX_FRAME_BYTES = 4 << 30  # decode refuses frames that claim more raw bytes than this

_FIXED = struct.Struct("<4sBBBBBBBBQI")
FIXED_SIZE = _FIXED.size  # 24
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class FrameHeader:
    """Everything a reader learns from a frame without decompressing it."""

    format_version: int
    method: str
    container: str
    dtype: str
    shape: tuple[int, ...]
    itemsize: int
    transform: str
    streams_per_block: int
    block_elems: int
    nblocks: int
    header_size: int
    frame_size: int

    @property
    def raw_size(self) -> int:
        """Bytes of the decoded array (what ``decode`` allocates or writes into ``out``)."""
        return math.prod(self.shape) * self.itemsize

    @property
    def kind(self) -> ArrayKind:
        return ArrayKind(self.container, self.dtype, self.shape, self.itemsize)

    @property
    def ratio(self) -> float:
        return self.raw_size / self.frame_size if self.frame_size else 1.0


@dataclass(frozen=True)
class StreamTable:
    """Per-block checksums and per-stream coding, size and payload offset (arrays, one row per block)."""

    checksums: np.ndarray  # uint64[nblocks]
    codings: np.ndarray  # uint8[nblocks, s]
    sizes: np.ndarray  # int64[nblocks, s]
    offsets: np.ndarray  # int64[nblocks, s], absolute offsets into the frame


def block_count(elements: int, block_elems: int) -> int:
    return -(-elements // block_elems) if elements else 0


def pack_header(kind: ArrayKind, method: str, transform: str, streams_per_block: int, block_elems: int,
                checksums: list[int], codings: list[list[int]], sizes: list[list[int]]) -> bytes:
    """Header bytes (up to and including the header checksum) for blocks already encoded."""
    name = kind.dtype.encode("ascii")
    fixed = _FIXED.pack(MAGIC, version_for(method, codings), METHODS.index(method), CONTAINERS.index(kind.container),
                        TRANSFORMS.index(transform), kind.itemsize, streams_per_block, len(kind.shape),
                        len(name), block_elems, 0)
    parts = [fixed, name,
             np.asarray(kind.shape, dtype="<u8").tobytes(),
             np.asarray(checksums, dtype="<u8").tobytes(),
             np.asarray(codings, dtype="u1").tobytes(),
             np.asarray(sizes, dtype="<u4").tobytes()]
    body = b"".join(parts)
    return body + _U64.pack(xxhash.xxh3_64_intdigest(body))


def header_size(kind: ArrayKind, streams_per_block: int, nblocks: int) -> int:
    """Bytes of the header :func:`pack_header` writes for ``nblocks`` blocks of ``kind``."""
    return _FIXED.size + len(kind.dtype) + 8 * len(kind.shape) + _table_bytes(nblocks, streams_per_block) + _U64.size


def _table_bytes(nblocks: int, streams_per_block: int) -> int:
    """Bytes of the stream table: a checksum per block, a coding and a size per stream."""
    nstreams = nblocks * streams_per_block
    return 8 * nblocks + nstreams + 4 * nstreams


def version_for(method: str, codings: list[list[int]] | None = None) -> int:
    """The format version a frame of ``method`` whose streams have ``codings`` is written as:
    the oldest that can hold it."""
    def holds(coding: int) -> bool:
        return codings is not None and any(coding in row for row in codings)

    if method == "fast":
        return PAIRS_VERSION if holds(PAIRS) else FAST_VERSION
    return NIBBLE_VERSION if method == "zstd" and holds(NIBBLE) else 1


def parse_header(blob: memoryview, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> tuple[FrameHeader, StreamTable]:
    """Validate the header and stream table of ``blob`` (a byte memoryview); raise CodecError."""
    n = len(blob)
    if n < FIXED_SIZE:
        if n >= 4 and bytes(blob[:4]) != MAGIC:
            raise CodecError("not a KV Shrink frame (wrong magic)")
        raise CodecError(f"truncated frame: {n} bytes, a header needs at least {FIXED_SIZE}")
    magic, version, method_id, container_id, transform_id, width, streams, ndim, name_len, block_elems, reserved = \
        _FIXED.unpack_from(blob, 0)
    if magic != MAGIC:
        raise CodecError(f"not a KV Shrink frame (magic {magic!r}, expected {MAGIC!r})")
    if not 1 <= version <= FORMAT_VERSION:
        newer = " (written by a newer kvshrink; upgrade to read it)" if version > FORMAT_VERSION else ""
        raise CodecError(f"unsupported frame format version {version}{newer}; this reader knows 1..{FORMAT_VERSION}")
    _check(method_id < len(METHODS), f"unknown method id {method_id}")
    allowed = {"zstd": (1, NIBBLE_VERSION), "fast": (FAST_VERSION, PAIRS_VERSION)}.get(
        METHODS[method_id], (version_for(METHODS[method_id]),))
    _check(version in allowed, f"a {METHODS[method_id]} frame must be format version "
                               f"{' or '.join(map(str, allowed))}, not {version}")
    _check(container_id < len(CONTAINERS), f"unknown container id {container_id}")
    _check(transform_id < len(TRANSFORMS), f"unknown transform id {transform_id}")
    _check(reserved == 0, "reserved header field is not zero")
    _check(1 <= width <= 16, f"element width {width} out of range")
    _check(streams in (1, width), f"{streams} streams per block for {width}-byte elements")
    _check(transform_id == 0 or (streams == width and width > 1), "rotl1 transform needs a byte-split frame")
    _check(ndim <= MAX_NDIM, f"ndim {ndim} above the limit {MAX_NDIM}")
    _check(1 <= name_len <= MAX_DTYPE_NAME, f"dtype name length {name_len} out of range")
    pos = FIXED_SIZE + name_len + 8 * ndim
    if n < pos:
        raise CodecError(f"truncated frame: header needs {pos} bytes, got {n}")
    try:
        dtype = bytes(blob[FIXED_SIZE:FIXED_SIZE + name_len]).decode("ascii")
    except UnicodeDecodeError:
        raise CodecError("dtype name is not ASCII") from None
    container = CONTAINERS[container_id]
    if dtype_width(container, dtype) != width:
        raise CodecError(f"dtype {dtype!r} is not a supported {container} dtype of width {width}")
    shape = struct.unpack_from(f"<{ndim}Q", blob, FIXED_SIZE + name_len)
    if ndim and max(shape) > MAX_DIM:
        raise CodecError(f"absurd shape {shape}")
    elements = math.prod(shape)
    raw_size = elements * width
    if raw_size > max_frame_bytes:
        raise CodecError(f"frame claims {raw_size} decoded bytes, above the limit of {max_frame_bytes}")
    _check(block_elems >= 1, "block size of zero elements")
    nblocks = block_count(elements, block_elems)
    _check(nblocks <= MAX_BLOCKS, f"{nblocks} blocks, above the limit {MAX_BLOCKS}")
    nstreams = nblocks * streams
    end = pos + _table_bytes(nblocks, streams)
    if n < end + 8:
        raise CodecError(f"truncated frame: header and stream table need {end + 8} bytes, got {n}")
    if xxhash.xxh3_64_intdigest(blob[:end]) != _U64.unpack_from(blob, end)[0]:
        raise CodecError("header checksum mismatch (corrupt header)")
    checksums = np.frombuffer(blob, dtype="<u8", count=nblocks, offset=pos)
    codings = np.frombuffer(blob, dtype="u1", count=nstreams, offset=pos + 8 * nblocks).reshape(nblocks, streams)
    sizes = np.frombuffer(blob, dtype="<u4", count=nstreams, offset=pos + 8 * nblocks + nstreams).astype(np.int64)
    sizes = sizes.reshape(nblocks, streams)
    header_size = end + 8
    method = METHODS[method_id]
    _validate_streams(method, version, codings, sizes, elements, block_elems, width)
    payload = int(sizes.sum())
    if header_size + payload != n:
        what = "truncated" if header_size + payload > n else "has trailing bytes"
        raise CodecError(f"frame {what}: header says {header_size + payload} bytes, got {n}")
    offsets = (header_size + np.cumsum(sizes.reshape(-1)) - sizes.reshape(-1)).reshape(nblocks, streams)
    header = FrameHeader(version, method, container, dtype, shape, width, TRANSFORMS[transform_id],
                         streams, block_elems, nblocks, header_size, n)
    return header, StreamTable(checksums, codings, sizes, offsets)


def block_bounds(header: FrameHeader, block: int) -> tuple[int, int]:
    """[start, stop) element range of ``block``."""
    start = block * header.block_elems
    return start, min(start + header.block_elems, math.prod(header.shape))


def stream_length(header: FrameHeader, elements: int) -> int:
    """Decoded bytes of one stream of a block of ``elements`` elements."""
    return elements * (header.itemsize // header.streams_per_block)


def _validate_streams(method: str, version: int, codings: np.ndarray, sizes: np.ndarray, elements: int,
                      block_elems: int, width: int) -> None:
    """Codings allowed for the method (nibble-coded and code-pair streams only where the format
    puts them); stored streams exactly as long as their decoded bytes."""
    if not codings.size:
        return
    if not _ALLOWED[method][codings].all():
        raise CodecError(f"a stream coding not allowed in a {method} frame: {sorted(set(codings.ravel().tolist()))}")
    counts = np.bincount(codings.reshape(-1), minlength=_CODINGS).tolist()  # allowed: all below _CODINGS
    for coding, needs in _HIGH_ONLY.items():
        if counts[coding]:
            name = "nibble-coded" if coding == NIBBLE else "code-pair"
            _check(version == needs, f"a {name} stream in a format version {version} frame")
            rows = codings[:, 0] == coding
            _check(width == 2 and codings.shape[1] == 2 and int(rows.sum()) == counts[coding]
                   and bool((codings[rows, 1] == STORED).all()),
                   f"a {name} stream must be the high stream of a 2-byte element whose low stream is stored")
    if method == "fast" and version == PAIRS_VERSION:
        _check(counts[PAIRS] > 0, "a format version 4 fast frame without a code-pair stream")
    stream_width = width // codings.shape[1]
    stored = codings == STORED
    full = block_elems * stream_width
    last = (elements - block_elems * (codings.shape[0] - 1)) * stream_width
    if (stored[:-1] & (sizes[:-1] != full)).any() or (stored[-1] & (sizes[-1] != last)).any():
        raise CodecError("a stored stream's size does not match its block")
    if (~stored & (sizes == 0)).any():
        raise CodecError("empty compressed stream")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise CodecError(message)
