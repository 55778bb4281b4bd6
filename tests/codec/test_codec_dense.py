"""The ``dense`` method's nibble-coded exponents (zstd frames, format version 3): bit-exact, hostile-proof.

Speed is measured by codec-bench, not here; these tests check what must hold on any machine: the
bytes, the ratio on real KV, the frame layout, the fallback to plain zstd, the numpy reference,
older frames and readers, and CodecError on bad payloads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard
from codec_harness import check_roundtrip, check_truncations_and_flips, encode_packed_fast, rebuild

from kvshrink.codec import Codec, CodecError, decode, encode, frame, nibbles, read_header
from kvshrink.codec.frame import NIBBLE, PAIRS, STORED, ZSTD, parse_header


def test_real_kv_ratio_and_layout(real_chunks):
    for chunk in real_chunks:
        blob = encode(chunk, method="zstd")
        header, table = parse_header(memoryview(blob))
        assert (header.method, header.format_version, header.transform) == ("zstd", 3, "rotl1")
        assert table.codings.tolist() == [[NIBBLE, STORED]] * header.nblocks  # exponents coded, mantissas stored
        assert chunk.nbytes / len(blob) >= 1.48
        assert decode(blob).tobytes() == chunk.tobytes()


def test_float_widths_and_torch(real_chunks):
    kv = np.ascontiguousarray(real_chunks[1][:, :2])
    bf16 = torch.from_numpy(kv).view(torch.bfloat16)
    for x in (bf16, bf16.half(), bf16.half().numpy(), bf16.float()):  # fp16's low byte compresses too: plain zstd
        check_roundtrip(x, method="zstd")
    assert NIBBLE in parse_header(memoryview(encode(bf16)))[1].codings
    assert NIBBLE not in parse_header(memoryview(encode(bf16.float())))[1].codings  # 4-byte elements: plain zstd


@pytest.mark.parametrize("size", [1, 2, 3, 63, 4095, 4097, 8193, 33333])
def test_odd_and_chunk_straddling_sizes(size):
    """Odd element counts leave a half-used last pair; sizes around the kernels' 4096-element chunk."""
    rng = np.random.default_rng(size)
    x = (rng.normal(0, 1, size).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    with Codec(threads=2, block_size=4096) as codec:
        blob = check_roundtrip(x, codec=codec)
    if size >= 4095:
        assert NIBBLE in parse_header(memoryview(blob))[1].codings


def test_constant_and_random_bytes():
    constant = np.full(100_000, 0x3F80, np.uint16)
    assert len(check_roundtrip(constant)) < constant.nbytes / 1.9  # exponents cost ~nothing, mantissas stored
    noise = np.random.default_rng(1).integers(0, 1 << 16, 60_000, dtype=np.uint16)
    blob = check_roundtrip(noise)
    assert NIBBLE not in parse_header(memoryview(blob))[1].codings


def test_blocks_whose_exponents_escape_take_plain_zstd():
    """The sample sees one exponent, the block another: nearly every code would escape, so the
    block takes plain zstd; a block with a few escapes keeps the coding, its exceptions in order."""
    n = 1 << 16
    low = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint16)  # mantissas: stored
    high = np.full(n, 0x40, np.uint16)
    step = max(256, n // 32)
    for start in range(0, n, step):
        high[start:start + 256] = 0x3F  # the sampled runs (packed.SAMPLE_RUNS of SAMPLE_RUN) see only 0x3F
    with Codec(threads=1, block_size=2 * n, transform="none") as codec:
        blob = check_roundtrip((high << 8) | low, codec=codec)
        assert parse_header(memoryview(blob))[1].codings.tolist() == [[ZSTD, STORED]]
        high[:] = 0x3F
        high[1::997] = 0x7F  # far outside the window: each one an escape
        blob = check_roundtrip((high << 8) | low, codec=codec)
        assert parse_header(memoryview(blob))[1].codings.tolist() == [[NIBBLE, STORED]]


def test_kernels_match_numpy_reference(monkeypatch):
    """Same payloads and low bytes from the numba kernels and the numpy reference, and each decodes
    the other's."""
    if nibbles._jit() is None:
        pytest.skip("numba not installed: only the reference runs")
    rng = np.random.default_rng(7)
    cases = [rng.normal(0x3C00, 600, 9001).astype(np.uint16), rng.integers(0, 1 << 16, 4096, dtype=np.uint16),
             np.full(63, 0x3F80, np.uint16), (rng.normal(0, 1, 8193).astype(np.float32).view(np.uint32) >> 16)
             .astype(np.uint16)]
    for words in cases:
        for rotate in (False, True):
            for base in (0, 0x3C, 0x7A, 250):
                out = {}
                for name in ("jit", "ref"):
                    pairs, exc, low = (np.zeros(n, np.uint8) for n in ((words.size + 1) // 2, words.size, words.size))
                    with monkeypatch.context() as m:
                        if name == "ref":
                            m.setattr(nibbles, "_jit", lambda: None)
                        kernel = nibbles._np_encode if name == "ref" else nibbles._jit().encode
                        ne = kernel(words, rotate, base, pairs, exc, low)
                    out[name] = (pairs.tobytes(), exc[:ne].tobytes(), low.tobytes())
                assert out["jit"] == out["ref"], (words.size, rotate, base)
                pairs, exc, low = (np.frombuffer(b, np.uint8) for b in out["jit"])
                for decoder in (nibbles._jit().decode, nibbles._np_decode):
                    back = np.empty_like(words)
                    assert decoder(pairs, base, exc, low, back, rotate) == 0
                    assert back.tobytes() == words.tobytes()


@pytest.mark.parametrize("threads", [1, 2])
def test_without_numba_the_same_frames(monkeypatch, real_chunks, threads):
    kv = np.ascontiguousarray(real_chunks[0][:, :4])
    with Codec(threads=threads, block_size=64 << 10) as codec:
        dense = codec.encode(kv)
        assert parse_header(memoryview(dense))[0].nblocks > 4
        monkeypatch.setattr(nibbles, "_jit", lambda: None)
        assert codec.encode(kv) == dense
        assert codec.decode(dense).tobytes() == kv.tobytes()


def test_version_1_frames_still_decode_and_older_readers_say_newer(monkeypatch, kv_slice):
    """What this version wrote before (plain zstd exponents, format version 1) still reads; a
    reader that knows only versions 1-2 refuses a version-3 frame as written by a newer kvshrink."""
    old = encode(np.ascontiguousarray(kv_slice[:, :, :, :1]).reshape(-1)[:40], method="zstd")  # too small to code
    assert read_header(old).format_version == 1
    blob = encode(kv_slice, method="zstd")
    assert read_header(blob).format_version == 3
    monkeypatch.setattr(frame, "FORMAT_VERSION", 2)
    with pytest.raises(CodecError, match="newer"):
        decode(blob)
    monkeypatch.undo()
    assert decode(blob).tobytes() == kv_slice.tobytes()
    with pytest.raises(CodecError, match="must be format version 1 or 3"):
        decode(blob[:4] + b"\x02" + blob[5:])
    h, table = parse_header(memoryview(blob))
    payload = bytes(memoryview(blob)[int(table.offsets[0, 0]):][:int(table.sizes[0, 0])])
    monkeypatch.setattr(frame, "version_for", lambda method, codings=None: 1)
    mislabelled = rebuild(blob, 0, 0, payload)
    monkeypatch.undo()
    with pytest.raises(CodecError, match="version 1 frame"):  # a v1 reader would not know the coding
        decode(mislabelled)


@pytest.fixture(scope="module")
def dense_frame(real_chunks) -> bytes:
    """Blocks of 1024 elements: block 0's code pairs take 512 bytes."""
    with Codec(block_size=2048, threads=1) as codec:
        blob = codec.encode(np.ascontiguousarray(real_chunks[0][:, :2, :16]))
    assert parse_header(memoryview(blob))[1].codings[0].tolist() == [NIBBLE, STORED]
    return blob


def _payload(base: int, pairs: bytes, exceptions: bytes = b"", reserved: bytes = b"\0\0\0") -> bytes:
    z = zstandard.ZstdCompressor(write_content_size=False).compress(pairs)
    return bytes([base]) + reserved + len(z).to_bytes(4, "little") + z + exceptions


@pytest.mark.parametrize("payload,match", [
    (b"", "empty compressed stream"),
    (b"\x00\x00\x00", "shorter than"),
    (_payload(0x70, bytes(512), reserved=b"\0\1\0"), "invalid"),
    (b"\x70\0\0\0\0\0\0\0" + bytes(40), "does not fit"),  # no zstd frame
    (b"\x70\0\0\0\xff\0\0\0" + bytes(40), "does not fit"),  # a frame longer than the payload
    (_payload(0x70, bytes(512), bytes(1025)), "does not fit"),  # more exceptions than bytes
    (_payload(0x70, bytes(100)), "decodes to"),
    (_payload(0x70, bytes(600)), "decodes to more"),
    (b"\x70\0\0\0\x10\0\0\0" + b"\x28\xb5\x2f\xfd" + bytes(12), "zstd stream"),
    (_payload(0x70, b"\xff" * 512), "more escape codes"),
    (_payload(0x70, bytes(512), b"\x01\x02"), "more exceptions"),
    (_payload(0x70, bytes(512)), "checksum"),
])
def test_hostile_nibble_streams(dense_frame, payload, match):
    with pytest.raises(CodecError, match=match):
        decode(rebuild(dense_frame, 0, 0, payload))


def test_nibble_coding_only_where_it_belongs(dense_frame, real_chunks):
    h, table = parse_header(memoryview(dense_frame))
    codings = table.codings.tolist()
    swapped = [row[:] for row in codings]
    swapped[0] = [STORED, NIBBLE]
    with pytest.raises(CodecError, match="high stream"):
        high = bytes(memoryview(dense_frame)[int(table.offsets[0, 0]):][:int(table.sizes[0, 0])])
        decode(rebuild(dense_frame, 0, 0, high, codings=swapped))
    both = [row[:] for row in codings]
    both[0] = [NIBBLE, ZSTD]
    with pytest.raises(CodecError, match="high stream"):
        decode(rebuild(dense_frame, 0, 1, zstandard.ZstdCompressor().compress(bytes(1024)), codings=both))
    x = (np.ascontiguousarray(real_chunks[0][:, :1, :8]).astype(np.uint32) << 16).view(np.float32)
    wide = encode(x, method="zstd")
    wide_codings = parse_header(memoryview(wide))[1].codings.tolist()
    wide_codings[0][0] = NIBBLE
    with pytest.raises(CodecError):
        decode(rebuild(wide, 0, 0, _payload(0, bytes(1024)), codings=wide_codings))
    qat = encode(real_chunks[0][:, :1, :8], method="qat")
    with pytest.raises(CodecError, match="not allowed"):
        decode(rebuild(qat, 0, 0, _payload(0, bytes(8)), codings=[[NIBBLE, STORED]] * read_header(qat).nblocks))


def test_truncations_and_byte_flips(real_chunks):
    with Codec(block_size=2048, threads=1) as codec:  # blocks of 1024 elements and a shorter one
        small = codec.encode(np.ascontiguousarray(real_chunks[3][:, :1, :8, :189]))
    assert NIBBLE in parse_header(memoryview(small))[1].codings
    check_truncations_and_flips(small)  # only bits no decoder reads are free (a zstd frame's unused bits)


def test_a_fast_frame_transcodes_to_dense_without_decoding(real_chunks):
    """A demotion's re-coding: the exponents re-coded (code pairs: only zstd over them; packed
    planes: decoded to bytes and nibble-coded), the low bytes and block checksums reused; the frame
    decodes to the same chunk and is as small as encoding it afresh."""
    with Codec(threads=2) as codec:
        for chunk, fast in [(c, codec.encode(c, method="fast")) for c in real_chunks] + \
                [(real_chunks[0], encode_packed_fast(real_chunks[0], threads=2))]:
            dense = codec.transcode(fast, method="zstd")
            header, table = parse_header(memoryview(dense))
            assert (header.method, header.format_version) == ("zstd", 3)
            assert table.codings.tolist() == [[NIBBLE, STORED]] * header.nblocks
            assert table.checksums.tolist() == parse_header(memoryview(fast))[1].checksums.tolist()
            assert decode(dense).tobytes() == chunk.tobytes()
            assert len(dense) <= len(codec.encode(chunk, method="zstd")) * 1.005
            assert codec.transcode(dense, method="zstd") is dense


def test_transcode_of_other_frames_decodes_and_encodes(real_chunks):
    kv = np.ascontiguousarray(real_chunks[2][:, :2])
    wide = (kv.astype(np.uint32) << 16).view(np.float32)  # 4 streams: no direct path
    noise = np.random.default_rng(5).integers(0, 1 << 16, 70_000, dtype=np.uint16)  # exponents stored
    with Codec(threads=1, block_size=64 << 10) as codec:
        for x in (wide, noise):
            for method in ("zstd", "raw", "qat"):
                frame_ = codec.transcode(codec.encode(x, method="fast"), method=method)
                assert read_header(frame_).method == method and decode(frame_).tobytes() == x.tobytes()
        assert codec.transcode(codec.encode(noise, method="fast"), method="zstd") == codec.encode(noise, method="zstd")


def test_small_code_pair_blocks_transcode_through_their_bytes():
    """A block of 20 elements in code pairs (14 bytes for 20 high bytes; our encoder leaves blocks
    this small stored, a frame may still hold one): zstd over its 10 pair bytes would not pay, so
    the transcode reads the high bytes and codes them the plain way."""
    rng = np.random.default_rng(11)
    x = ((rng.integers(100, 110, 400).astype(np.uint16) << 8) | rng.integers(0, 256, 400)).astype(np.uint16)
    with Codec(threads=1, block_size=40, transform="none") as codec:
        stored = codec.encode(x, method="fast")
        _, table = parse_header(memoryview(stored))
        payload, _ = nibbles.encode_pair_words(x[:20], False, 100, lambda n: np.empty(n, np.uint8))
        codings = table.codings.tolist()
        codings[0] = [PAIRS, STORED]
        fast = rebuild(stored, 0, 0, payload.tobytes(), codings)
        assert decode(fast).tobytes() == x.tobytes()
        dense = codec.transcode(fast, method="zstd")
        assert parse_header(memoryview(dense))[1].codings[0].tolist() == [STORED, STORED]
        assert decode(dense).tobytes() == x.tobytes()


def test_a_damaged_fast_frame_never_transcodes_to_wrong_bytes(real_chunks):
    """Damage in packed exponents may fail the transcode; damage in code pairs (handed to zstd
    unread) or in the reused low bytes passes it, and the dense frame then fails its checks when
    read (its reused checksum, or escapes and exceptions that disagree)."""
    kv = np.ascontiguousarray(real_chunks[0][:, :2, :64])
    with Codec(threads=1, block_size=8192) as codec:
        for fast in (codec.encode(kv, method="fast"), encode_packed_fast(kv, threads=1, block_size=8192)):
            _, table = parse_header(memoryview(fast))
            for stream, flip in ((0, 0x10), (0, 0x01), (1, 0x10)):
                damaged = bytearray(fast)
                damaged[int(table.offsets[1, stream]) + 40] ^= flip
                try:
                    dense = codec.transcode(bytes(damaged), method="zstd")
                except CodecError:
                    assert stream == 0
                    continue
                with pytest.raises(CodecError, match="checksum|escape|exceptions"):
                    decode(dense)
