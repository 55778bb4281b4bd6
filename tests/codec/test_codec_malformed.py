"""Every kind of bad frame gives CodecError: never a crash, a hang, a wrong result or a huge allocation.

Hostile frames are built with a valid header checksum (``seal``), so they get past the checksum and
exercise the field-by-field validation behind it.
"""

from __future__ import annotations

import gzip
import tracemalloc

import numpy as np
import pytest
import xxhash
import zstandard
from codec_harness import check_single_byte_flips, reseal, seal

from kvshrink.codec import Codec, CodecError, UnsupportedArrayError, decode, encode, read_header
from kvshrink.codec.dtypes import ArrayKind
from kvshrink.codec.frame import FIXED_SIZE, GZIP, PACKED, STORED, ZSTD, pack_header, parse_header
from kvshrink.errors import CorruptDataError


@pytest.fixture(scope="module")
def frame(real_chunks) -> bytes:
    """A small multi-block frame with nibble-coded (zstd inside) and stored streams."""
    kv = np.ascontiguousarray(real_chunks[0][:, :2, :16])
    with Codec(block_size=2048, threads=1) as codec:
        return codec.encode(kv)


def hostile(shape, payloads, codings, dtype="<u2", block_elems=None, method="zstd", checksums=None) -> bytes:
    """A frame with a correct header checksum around arbitrary streams (one stream per block)."""
    kind = ArrayKind("numpy", dtype, tuple(shape), np.dtype(dtype).itemsize)
    n = int(np.prod(shape))
    block_elems = block_elems or max(n, 1)
    header = pack_header(kind, method, "none", 1, block_elems, checksums or [0] * len(payloads),
                         [[c] for c in codings], [[len(p)] for p in payloads])
    return header + b"".join(payloads)


def test_codec_error_is_a_corrupt_data_error():
    assert issubclass(CodecError, CorruptDataError) and issubclass(CodecError, ValueError)


def test_truncated_at_every_length(frame):
    """Every proper prefix, header boundaries included, is refused."""
    for cut in range(len(frame)):
        with pytest.raises(CodecError):
            decode(frame[:cut])
    assert decode(frame).nbytes == read_header(frame).raw_size


def test_truncated_at_header_fields(frame):
    header = read_header(frame)
    for cut in (0, 3, 4, 5, 11, FIXED_SIZE - 1, FIXED_SIZE, FIXED_SIZE + 3, header.header_size - 8,
                header.header_size - 1, header.header_size, header.header_size + 1):
        with pytest.raises(CodecError, match="truncated|magic"):
            read_header(frame[:cut]) if cut < header.header_size else decode(frame[:cut])


def test_every_single_byte_flip_is_detected_or_harmless(frame):
    """A flip raises CodecError, except in the few zstd bits that do not change the output
    (e.g. a frame header's window size): then the decoded array is still exact."""
    assert check_single_byte_flips(frame) < len(frame) // 100


def test_trailing_bytes(frame):
    with pytest.raises(CodecError, match="trailing"):
        decode(frame + b"\0")


@pytest.mark.parametrize("blob,match", [
    (b"", "truncated"),
    (b"KVSZ", "truncated"),
    (b"\x28\xb5\x2f\xfd" + bytes(40), "magic"),  # a zstd frame is not ours
    (gzip.compress(b"x" * 100), "magic"),
    (b"GARBAGE!" * 10, "magic"),
    (bytes(100), "magic"),
])
def test_foreign_and_garbage(blob, match):
    with pytest.raises(CodecError, match=match):
        decode(blob)


def test_not_bytes_like():
    for thing in (None, 12345, "KVSZ", [1, 2, 3], np.zeros(3, np.float32)[::2]):
        with pytest.raises(CodecError):
            decode(thing)


def test_future_and_zero_version(frame):
    for version, match in ((5, "newer"), (255, "newer"), (0, "version 0"), (2, "must be format version 1 or 3"),
                           (1, "nibble-coded stream in a format version 1 frame")):
        with pytest.raises(CodecError, match=match):
            decode(reseal(frame, 4, bytes([version])))


@pytest.mark.parametrize("offset,value,match", [
    (5, b"\x09", "method"), (6, b"\x07", "container"), (7, b"\x05", "transform"), (8, b"\x00", "width"),
    (8, b"\x11", "width"), (9, b"\x03", "streams"), (10, b"\x21", "ndim"), (11, b"\x00", "dtype name length"),
    (11, b"\x40", "dtype name length"), (20, b"\x01", "reserved"), (12, bytes(8), "block size"),
])
def test_bad_header_fields(frame, offset, value, match):
    with pytest.raises(CodecError, match=match):
        decode(reseal(frame, offset, value))


@pytest.mark.parametrize("dtype", ["|O8", "<V2", "<U1", "float128", "<M8", "\xff\xfe", "<u3"])
def test_disallowed_dtype_names(frame, dtype):
    header = read_header(frame)
    name = dtype.encode("latin-1")[:len(header.dtype)].ljust(len(header.dtype), b"2")
    with pytest.raises(CodecError, match="dtype"):
        decode(reseal(frame, FIXED_SIZE, name))


def test_absurd_shapes_are_refused_before_allocating():
    tracemalloc.start()
    try:
        for shape in ([1 << 40, 1 << 20], [1 << 49], [1 << 62, 4], [3] * 40):
            with pytest.raises(CodecError, match="absurd|limit|ndim"):
                kind = ArrayKind("numpy", "<u2", tuple(shape[:32]), 2)
                blob = pack_header(kind, "zstd", "none", 1, 1 << 20, [], [], [])
                if len(shape) > 32:
                    blob = bytearray(blob)
                    blob[10] = len(shape)
                    blob = seal(bytes(blob[:-8]))
                decode(blob)
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()


def test_frame_size_cap_is_configurable(real_chunks):
    blob = encode(real_chunks[0])
    with Codec(max_frame_bytes=1 << 20) as small:
        with pytest.raises(CodecError, match="limit"):
            small.decode(blob)
        with pytest.raises(CodecError, match="limit"):
            small.read_header(blob)
        with pytest.raises(UnsupportedArrayError, match="max_frame_bytes"):
            small.encode(real_chunks[0])  # a frame its own reader would refuse is never written


def test_too_many_blocks_for_the_blob():
    kind = ArrayKind("numpy", "|u1", (1 << 30,), 1)
    blob = pack_header(kind, "zstd", "none", 1, 1, [], [], [])  # claims 2**30 one-byte blocks
    with pytest.raises(CodecError, match="blocks|truncated"):
        decode(blob)


def test_zstd_bomb_is_cut_at_the_block_size():
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(50 << 20))
    blob = hostile([1000], [bomb], [ZSTD], dtype="|u1")
    tracemalloc.start()
    try:
        with pytest.raises(CodecError, match="zstd"):
            decode(blob)
        assert tracemalloc.get_traced_memory()[1] < 16 << 20
    finally:
        tracemalloc.stop()


def test_zstd_stream_claiming_a_huge_content_size():
    cctx = zstandard.ZstdCompressor(write_content_size=True)
    lie = bytearray(cctx.compress(bytes(1000)))
    blob = hostile([1000], [bytes(lie)], [ZSTD], dtype="|u1")
    decode_ok = bytes(1000)
    assert zstandard.frame_content_size(bytes(lie)) == 1000
    big = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(1 << 24))
    with pytest.raises(CodecError, match="claims"):
        decode(hostile([1000], [big], [ZSTD], dtype="|u1"))
    with pytest.raises(CodecError, match="checksum"):  # right size, but block checksum 0 is wrong
        decode(blob)
    assert len(decode_ok) == 1000


def test_gzip_bomb_and_members():
    bomb = gzip.compress(bytes(50 << 20), compresslevel=9)
    tracemalloc.start()
    try:
        with pytest.raises(CodecError, match="deflate"):
            decode(hostile([1000], [bomb], [GZIP], dtype="|u1", method="qat"))
        assert tracemalloc.get_traced_memory()[1] < 16 << 20
    finally:
        tracemalloc.stop()
    many_empty = gzip.compress(b"") * 5000  # lots of members, no output: ends, no hang
    with pytest.raises(CodecError):
        decode(hostile([1000], [many_empty], [GZIP], dtype="|u1", method="qat"))
    with pytest.raises(CodecError, match="truncated"):
        decode(hostile([1000], [gzip.compress(bytes(1000))[:-9]], [GZIP], dtype="|u1", method="qat"))


def test_codings_must_match_the_method():
    data = bytes(range(256)) * 4
    for method, coding, payload in (("qat", ZSTD, zstandard.compress(data)), ("zstd", GZIP, gzip.compress(data)),
                                    ("raw", ZSTD, zstandard.compress(data)), ("zstd", 7, data),
                                    ("zstd", PACKED, b"\x08" + data), ("fast", ZSTD, zstandard.compress(data)),
                                    ("fast", GZIP, gzip.compress(data))):
        with pytest.raises(CodecError, match="not allowed"):
            decode(hostile([1024], [payload], [coding], dtype="|u1", method=method))


def test_stored_stream_of_the_wrong_size():
    with pytest.raises(CodecError, match="stored stream"):
        decode(hostile([1000], [bytes(999)], [STORED], dtype="|u1"))


def test_payload_checksum_catches_a_valid_looking_stream():
    data = np.arange(1000, dtype=np.uint8)
    good = hostile([1000], [data.tobytes()], [STORED], dtype="|u1", checksums=[xxhash.xxh3_64_intdigest(data)])
    assert decode(good).tobytes() == data.tobytes()
    with pytest.raises(CodecError, match="checksum mismatch in block 0"):
        decode(hostile([1000], [data[::-1].tobytes()], [STORED], dtype="|u1",
                       checksums=[xxhash.xxh3_64_intdigest(data)]))


def test_bounded_fuzz(real_chunks):
    """Random damage to real frames: CodecError, or (if the damage undid itself) the exact array."""
    kv = np.ascontiguousarray(real_chunks[1][:, :3, :24])
    rng = np.random.default_rng(20260)
    with Codec(block_size=4096, threads=2) as codec:
        frames = [codec.encode(kv, method=m, level=0 if m == "raw" else 1) for m in ("zstd", "qat", "raw", "fast")]
        for i in range(800):
            blob = bytearray(frames[i % 4])
            action = rng.integers(5)
            pos = int(rng.integers(len(blob)))
            if action == 0:
                blob[pos] ^= 1 << int(rng.integers(8))
            elif action == 1:
                del blob[pos:pos + int(rng.integers(1, 64))]
            elif action == 2:
                blob[pos:pos] = rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8).tobytes()
            elif action == 3:
                blob = blob[:pos]
            else:
                n = int(rng.integers(1, 32))
                blob[pos:pos + n] = rng.integers(0, 256, len(blob[pos:pos + n]), dtype=np.uint8).tobytes()
            try:
                got = codec.decode(bytes(blob))
            except CodecError:
                continue
            assert got.tobytes() == kv.tobytes() and got.shape == kv.shape


def test_parse_header_needs_the_whole_table(frame):
    header, table = parse_header(memoryview(frame))
    assert table.sizes.shape == (header.nblocks, header.streams_per_block)
    assert int(table.offsets[-1, -1] + table.sizes[-1, -1]) == len(frame)
