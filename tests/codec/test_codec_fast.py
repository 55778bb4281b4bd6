"""The ``fast`` method: exponent bytes as 4-bit code pairs (format version 4) or packed planes
(version 2, still read and still written where another width fits), bit-exact, hostile-proof, pinned.

Speed is measured by codec-bench, not here; these tests check what must hold on any machine: the
bytes, the ratio on real KV, the frame layout, the numpy fallback and CodecError on bad frames.
"""

from __future__ import annotations

import sys
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from codec_harness import check_roundtrip, check_truncations_and_flips, encode_packed_fast, rebuild, reseal

from kvshrink.codec import Codec, CodecArgumentError, CodecError, decode, encode, fast_frames, frame, in_place, nibbles, \
    packed, read_header
from kvshrink.codec.dtypes import TORCH_DTYPE_WIDTHS
from kvshrink.codec.frame import PACKED, PAIRS, STORED, parse_header

NUMPY_DTYPES = ["bool", "int8", "uint8", "<u2", "<f2", "<f4", "<i8", "<f8", "<c8", "<c16", ">u2", ">f4"]


@pytest.fixture()
def fast_blocks() -> Codec:
    with Codec(method="fast", block_size=4096, threads=2) as codec:
        yield codec


def test_real_kv_ratio_and_fused_layout(real_chunks):
    for chunk in real_chunks:
        blob = encode(chunk, method="fast")
        header, table = parse_header(memoryview(blob))
        assert (header.method, header.format_version, header.transform) == ("fast", 4, "rotl1")
        assert chunk.nbytes / len(blob) >= 1.33
        assert (table.codings[:, 1] == STORED).all()  # mantissas stored, exponents paired (a few blocks packed
        paired = table.codings[:, 0] == PAIRS  # at width 3, a narrower window)
        assert paired.sum() >= header.nblocks - 1
        assert all(pairs_frame_width(blob, table, b) == 3 for b in np.nonzero(~paired)[0])
        assert decode(blob).tobytes() == chunk.tobytes()
        packed_planes = encode_packed_fast(chunk)  # what version 2 wrote: the same size, still read
        header, table = parse_header(memoryview(packed_planes))
        assert header.format_version == 2 and (table.codings == [PACKED, STORED]).all()
        assert len(packed_planes) == pytest.approx(len(blob), rel=0.002)
        assert decode(packed_planes).tobytes() == chunk.tobytes()


def pairs_frame_width(blob: bytes, table, block: int) -> int:
    """The width byte of a packed high stream."""
    return blob[int(table.offsets[block, 0])]


def test_exponents_off_the_15_value_window_stay_packed():
    """Exponents in a window of 7 values: packed at width 3 (a code pair would spend 4 bits), and
    the frame stays version 2; one spread wider: width 5."""
    rng = np.random.default_rng(3)
    for spread, width in ((7, 3), (31, 5)):
        x = ((rng.integers(100, 100 + spread, 200_000).astype(np.uint16) << 8) | rng.integers(0, 256, 200_000))
        x = x.astype(np.uint16)
        blob = check_roundtrip(x, codec=Codec(method="fast", transform="none", threads=1), method="fast")
        header, table = parse_header(memoryview(blob))
        assert header.format_version == 2 and set(table.codings[:, 0].tolist()) == {PACKED}
        assert bytes(blob[table.offsets[0, 0]:table.offsets[0, 0] + 1]) == bytes([width])


def test_real_kv_as_torch_and_float_widths(real_chunks):
    kv = np.ascontiguousarray(real_chunks[1][:, :2])
    bf16 = torch.from_numpy(kv).view(torch.bfloat16)
    for x in (bf16, bf16.float(), bf16.half(), bf16.float().numpy(), bf16.half().numpy()):
        check_roundtrip(x, method="fast")
    assert read_header(encode(bf16.float(), method="fast")).ratio > 2.0  # bf16 in fp32: two zero bytes


def test_every_dtype_and_odd_size(fast_blocks):
    for dtype in NUMPY_DTYPES:
        dt = np.dtype(dtype)
        for size in (0, 1, 3, 4097, 33333):
            x = np.random.default_rng(size).integers(0, 256, size * dt.itemsize, dtype=np.uint8).view(dt)
            check_roundtrip(x, codec=fast_blocks, method="fast")


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_every_torch_dtype(fast_blocks):
    for name, width in sorted(TORCH_DTYPE_WIDTHS.items()):
        raw = torch.from_numpy(np.random.default_rng(width).integers(0, 256, (2, 513, width), dtype=np.uint8))
        check_roundtrip(raw.view(getattr(torch, name)).reshape(2, 513), codec=fast_blocks, method="fast")


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 5), (1,), (1, 1, 1, 1), (7, 11, 13), (4097,)])
def test_shapes(shape):
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) * np.float32(0.37)
    check_roundtrip(x, method="fast")
    check_roundtrip(torch.from_numpy(np.array(x)).to(torch.bfloat16), method="fast")


def test_constant_and_random_bytes(fast_blocks):
    for x in (np.zeros(100_000, np.uint16), np.full(50_001, 7, np.int64), np.full(3000, -1.5, np.float32)):
        assert len(check_roundtrip(x, codec=fast_blocks, method="fast")) < x.nbytes / 10  # width 0: no codes
    noise = np.random.default_rng(1).integers(0, 1 << 16, 60_000, dtype=np.uint16)
    blob = check_roundtrip(noise, codec=fast_blocks, method="fast")
    assert len(blob) < noise.nbytes * 1.02  # incompressible: stored, a little framing
    assert set(parse_header(memoryview(blob))[1].codings.ravel().tolist()) == {STORED}


def test_blocks_whose_exponents_all_escape():
    """The sampled runs see one exponent, the rest of the block another: the width chosen from the
    sample fits almost nothing, so nearly every byte is an exception, and still round-trips."""
    n = 1 << 16
    x = np.full(n, 0x4000, np.uint16)  # rotl1 high byte 0x80
    step = max(packed.SAMPLE_RUN, n // packed.SAMPLE_RUNS)
    for start in range(0, n, step):
        x[start:start + packed.SAMPLE_RUN] = 0x3F80  # the sample sees only 0x7F
    with Codec(method="fast", threads=1, block_size=x.nbytes, transform="rotl1") as codec:
        blob = check_roundtrip(x, codec=codec, method="fast")
    assert parse_header(memoryview(blob))[1].codings[0, 0] == STORED  # packing the exponents would not pay
    for w in range(packed.MAX_WIDTH + 1):  # forced widths: every byte outside the window escapes
        stream = np.random.default_rng(w).integers(0, 256, 5000, dtype=np.uint8)
        payload = packed._encode(stream, np.empty(0, np.uint8), False, w, 0, 1 << 30)
        out = np.empty_like(stream)
        packed.decode_stream(memoryview(payload.tobytes()), out)
        assert out.tobytes() == stream.tobytes()


def test_kernels_match_numpy_reference(monkeypatch):
    """Same payload bytes from the numba kernels and the numpy reference, for every width."""
    if packed._jit() is None:
        pytest.skip("numba not installed: only the reference runs")
    assert packed._jit().CHUNK == packed.CHUNK
    rng = np.random.default_rng(7)
    streams = [rng.integers(100, 110, 9000).astype(np.uint8), rng.integers(0, 256, 4096).astype(np.uint8),
               np.full(63, 3, np.uint8), rng.normal(120, 3, 8193).astype(np.uint8)]
    for stream in streams:
        for w in range(packed.MAX_WIDTH + 1):
            base = int(stream[0]) - 1
            words = (stream.astype(np.uint16) << 8) | rng.integers(0, 256, stream.size).astype(np.uint16)
            jit = [packed._encode(stream, np.empty(0, np.uint8), False, w, base, 1 << 30)]
            low_jit = np.empty(stream.size, np.uint8)
            jit.append(packed._encode(words, low_jit, False, w, base, 1 << 30))
            with monkeypatch.context() as m:
                m.setattr(packed, "_jit", lambda: None)
                ref = [packed._encode(stream, np.empty(0, np.uint8), False, w, base, 1 << 30)]
                low_ref = np.empty(stream.size, np.uint8)
                ref.append(packed._encode(words, low_ref, False, w, base, 1 << 30))
                back = np.empty_like(words)
                packed.decode_words(memoryview(jit[1].tobytes()), low_jit, back, False)
                assert back.tobytes() == words.tobytes()
            assert [a.tobytes() for a in jit] == [b.tobytes() for b in ref], w
            assert low_jit.tobytes() == low_ref.tobytes()


@pytest.mark.parametrize("threads", [1, 2])
def test_without_numba_the_same_frames(monkeypatch, real_chunks, threads):
    """The compiled path (a group of blocks per kernel call) writes the reference's bytes, and
    reads them back; with 2 threads the groups split the frame differently."""
    kv = np.ascontiguousarray(real_chunks[0][:, :4])
    with Codec(method="fast", threads=threads, block_size=64 << 10) as codec:
        fast = codec.encode(kv)
        assert parse_header(memoryview(fast))[0].nblocks > 4
        back = np.empty_like(kv)
        codec.decode(fast, out=back)
        assert back.tobytes() == kv.tobytes()
        for module in (packed, nibbles):
            monkeypatch.setattr(module, "_jit", lambda: None)
        monkeypatch.setattr(fast_frames, "kernels", lambda: None)
        assert codec.encode(kv) == fast
        assert codec.decode(fast).tobytes() == kv.tobytes()


def test_encode_into_a_callers_buffer(real_chunks):
    """``into`` gets the frame's exact size once and receives the same bytes ``encode`` returns;
    a buffer of the wrong size or a read-only one is refused."""
    kv = real_chunks[1]
    with Codec(method="fast", threads=2) as codec:
        frame = codec.encode(kv)
        asked = []

        def into(size):
            asked.append(size)
            return np.empty(size, np.uint8)

        written = codec.encode(kv, into=into)
        assert asked == [len(frame)] and written.tobytes() == frame
        assert bytes(codec.encode(kv, method="zstd", into=bytearray)) == codec.encode(kv, method="zstd")
        with pytest.raises(CodecArgumentError, match="exactly"):
            codec.encode(kv, into=lambda size: bytearray(size + 1))
        with pytest.raises(CodecArgumentError, match="writable"):
            codec.encode(kv, into=lambda size: bytes(size))


@pytest.mark.parametrize("in_kernel", [True, False], ids=["hashed in the kernel", "hashed in Python"])
@pytest.mark.parametrize(("threads", "block_size"), [(1, 512 << 10), (2, 512 << 10), (4, 64 << 10)])
def test_frames_built_in_place_are_the_scratch_paths_bytes(monkeypatch, real_chunks, threads, block_size, in_kernel):
    """A fast frame written straight into its bytes (``in_place``: groups placed behind each
    other or at their worst-case offsets, then moved down, the object shrunk) is byte for byte
    the frame the scratch path joins, for whole and partial blocks, blocks the general path
    encodes (random bytes amid real KV), and concurrent groups; it is a plain ``bytes`` with no
    other reference, holding no more memory than its length. Both with a group's blocks coded,
    moved and hashed in one kernel call up to a block the general path takes, and block by block."""
    assert fast_frames.kernels().verify_in_kernel  # this machine's xxhash exports the symbol
    monkeypatch.setattr(fast_frames.kernels(), "verify_in_kernel", in_kernel)
    used = []
    monkeypatch.setattr(in_place, "encode_fast_frame", _counted(in_place.encode_fast_frame, used))
    mixed = np.ascontiguousarray(real_chunks[0]).reshape(-1).copy()
    mixed[300_000:700_000] = np.random.default_rng(7).integers(0, 1 << 16, 400_000, dtype=np.uint16)
    inputs = [real_chunks[1], np.ascontiguousarray(real_chunks[2][:, :3, :201]), mixed, mixed[:12_345]]
    with Codec(method="fast", threads=threads, block_size=block_size) as codec:
        for kv in inputs:
            codec.encode(kv)  # helper threads and their first allocations are not the frame's
            tracemalloc.start()
            try:
                frame = codec.encode(kv)
                held = tracemalloc.get_traced_memory()[0]
            finally:
                tracemalloc.stop()
            scratch = codec.encode(kv, into=lambda size: np.empty(size, np.uint8)).tobytes()
            assert type(frame) is bytes and frame == scratch
            assert sys.getrefcount(frame) == 2  # this name and the call's argument
            assert held < len(frame) + (64 << 10)  # shrunk in place: the worst-case size is gone
            assert codec.decode(frame).tobytes() == kv.tobytes()
    assert len(used) == 2 * len(inputs)
    codings = parse_header(memoryview(codec.encode(mixed)))[1].codings[:, 0]
    assert (codings == PAIRS).any() and (codings != PAIRS).any()  # both kinds of block were in it


def test_in_place_groups_are_moved_down_in_order():
    """Groups that finished out of order, some behind their predecessor and some at their
    worst-case offset, end up back to back after the header in group order."""
    layout = in_place._Layout(head=4, slot=10, groups=[(0, 1), (1, 2), (2, 3)])
    dest = np.zeros(40, np.uint8)
    first = layout.start(0)
    second = layout.start(1)  # group 0 still running: its own worst-case offset
    assert (first, second) == (4, 14)
    dest[second:second + 3] = 2
    layout.finished(1, second, 3)
    third = layout.start(2)  # right behind group 1, which is done
    assert third == 17
    dest[third:third + 5] = 3
    layout.finished(2, third, 5)
    dest[first:first + 7] = 1
    layout.finished(0, first, 7)
    assert layout.compact(dest) == 4 + 7 + 3 + 5
    assert dest[4:19].tolist() == [1] * 7 + [2] * 3 + [3] * 5


def _counted(fn, calls):
    def wrapper(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return wrapper


def test_decode_into_out_allocates_no_full_copy(real_chunks):
    kv = real_chunks[2]
    blob = encode(kv, method="fast")
    out = np.empty_like(kv)
    decode(blob, out=out)  # warm: kernels compiled, pools filled
    tracemalloc.start()
    try:
        decode(blob, out=out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.tobytes() == kv.tobytes()
    assert peak < kv.nbytes // 20


def test_older_readers_say_newer(monkeypatch, kv_slice):
    blob = encode(kv_slice, method="fast")
    monkeypatch.setattr(frame, "FORMAT_VERSION", 1)
    with pytest.raises(CodecError, match="newer"):
        decode(blob)
    monkeypatch.undo()
    with pytest.raises(CodecError, match="must be format version 2 or 4"):
        decode(blob[:4] + b"\x01" + blob[5:])  # header checksum aside, the version is checked first
    with pytest.raises(CodecError, match="code-pair stream in a format version 2 frame"):
        decode(reseal(blob, 4, b"\x02"))


@pytest.fixture(scope="module")
def fast_frame(real_chunks) -> bytes:
    """Blocks of 1024 elements whose exponents are packed planes (format version 2)."""
    return encode_packed_fast(np.ascontiguousarray(real_chunks[0][:, :2, :16]), block_size=2048, threads=1)


@pytest.fixture(scope="module")
def pairs_frame(real_chunks) -> bytes:
    """Blocks of 1024 elements whose exponents are code pairs (format version 4)."""
    with Codec(method="fast", block_size=2048, threads=1) as codec:
        blob = codec.encode(np.ascontiguousarray(real_chunks[0][:, :2, :16]))
    assert set(parse_header(memoryview(blob))[1].codings[:, 0].tolist()) == {PAIRS}
    return blob


@pytest.mark.parametrize("payload,match", [
    (b"", "empty compressed stream"), (b"\x04\x00\x00", "does not fit"), (b"\x04\x00\x01\x00" + bytes(512), "invalid"),
    (b"\x04\x00\x00\x00" + bytes(511), "does not fit"), (b"\x04\x00\x00\x00" + bytes(512 + 1025), "does not fit"),
    (b"\x04\x00\x00\x00" + b"\xff" * 512 + bytes(512), "more escape codes"),
    (b"\x04\x00\x00\x00" + b"\x0f" + bytes(511), "more escape codes"),
    (b"\x04\x00\x00\x00" + bytes(512) + b"\x01\x02", "more exceptions"),
    (b"\x04\x00\x00\x00" + bytes(512), "checksum"),
])
def test_hostile_pair_streams(pairs_frame, payload, match):
    """Block 0 holds 1024 elements: code pairs take 512 bytes. Each payload fails on the compiled
    path (checksums inside the kernel, and in Python where the xxhash symbol is missing) and on
    the block-by-block one."""
    blob = rebuild(pairs_frame, 0, 0, payload)
    with pytest.raises(CodecError, match=match):
        decode(blob)
    for kernels in (SimpleNamespace(**{**vars(fast_frames.kernels()), "verify_in_kernel": False}), None):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fast_frames, "kernels", lambda: kernels)
            with pytest.raises(CodecError, match=match):
                decode(blob)


def test_the_compiled_path_names_the_block_whose_checksum_fails(pairs_frame):
    """Block checksums are computed inside the decode kernel (this xxhash exports its SIMD xxh3),
    and a damaged block is named as the Python hash named it."""
    assert fast_frames.kernels().verify_in_kernel
    blocks = parse_header(memoryview(pairs_frame))[0].nblocks
    for block in (1, blocks - 1):
        blob = bytearray(pairs_frame)
        table = parse_header(memoryview(pairs_frame))[1]
        blob[int(table.offsets[block, 1])] ^= 0x40  # a low byte: still a valid payload
        with pytest.raises(CodecError, match=f"checksum mismatch in block {block} of {blocks} "):
            decode(bytes(blob))


def test_code_pairs_only_where_they_belong(pairs_frame):
    _, table = parse_header(memoryview(pairs_frame))
    codings = table.codings.tolist()
    low = bytes(pairs_frame[table.offsets[0, 1]:table.offsets[0, 1] + table.sizes[0, 1]])
    swapped = [row[:] for row in codings]
    swapped[0] = [STORED, PAIRS]
    with pytest.raises(CodecError, match="code-pair stream must be the high stream"):
        decode(rebuild(pairs_frame, 0, 1, low, swapped))
    with pytest.raises(CodecError, match="not allowed in a zstd frame"):
        decode(reseal(pairs_frame, 4, b"\x03\x01"))  # version 3, method zstd
    with pytest.raises(CodecError, match="version 4 fast frame without a code-pair stream"):
        decode(reseal(encode_packed_fast(np.ones(5000, np.uint16) + np.arange(5000, dtype=np.uint16) % 7), 4, b"\x04"))


@pytest.mark.parametrize("payload,match", [
    (b"", "empty compressed stream"), (b"\x04\x00\x00", "shorter than"), (b"\x08\x00\x00\x00" + bytes(2000), "invalid"),
    (b"\x04\x00\x01\x00" + bytes(1024), "invalid"), (b"\x04\x00\x00\x00" + bytes(100), "does not fit"),
    (b"\x01\x00\x00\x00" + bytes(128 + 1025), "does not fit"), (b"\x00\x00\x00\x00\x07", "does not fit"),
    (b"\x04\x00\x00\x00" + b"\xff" * 512 + bytes(512), "more escape codes"),
    (b"\x04\x00\x00\x00" + bytes(1024) + b"\x01\x02", "more exceptions"),
    (b"\x00\x7f\x00\x00", "checksum"),
])
def test_hostile_packed_streams(fast_frame, payload, match):
    """Block 0 holds 1024 elements: a width-4 stream needs 512 bytes of planes."""
    with pytest.raises(CodecError, match=match):
        decode(rebuild(fast_frame, 0, 0, payload))


def test_hostile_generic_path_and_stored_size(real_chunks):
    x = (np.ascontiguousarray(real_chunks[0][:, :1, :8]).astype(np.uint32) << 16).view(np.float32)
    blob = encode(x, method="fast")
    codings = parse_header(memoryview(blob))[1].codings
    assert PACKED in codings and codings.shape[1] == 4
    stream = int(np.nonzero(codings[0] == PACKED)[0][0])
    for payload in (b"\x09\x00\x00\x00", b"\x02\x00\x00\x00", b"\x03\x05\x00\x00" + bytes(1 << 14)):
        with pytest.raises(CodecError):
            decode(rebuild(blob, 0, stream, payload))
    with pytest.raises(CodecError, match="stored stream"):
        decode(rebuild(encode(real_chunks[0][:, :1, :8], method="fast"), 0, 1, b"\x00" * 7))


def test_truncations_and_byte_flips(real_chunks):
    with Codec(method="fast", block_size=2048, threads=1) as codec:  # blocks of 1024 and 488 elements
        small = codec.encode(np.ascontiguousarray(real_chunks[3][:, :1, :4, :189]))
    check_truncations_and_flips(small)  # only padding bits are free


@pytest.mark.parametrize("layout", ["fp32: packed per stream", "bf16: code pairs"])
def test_bounded_fuzz(real_chunks, layout):
    kv = np.ascontiguousarray(real_chunks[1][:, :1, :24])
    x = (kv.astype(np.uint32) << 16).view(np.float32) if layout.startswith("fp32") else kv
    rng = np.random.default_rng(27)
    with Codec(method="fast", block_size=4096, threads=2) as codec:
        blob0 = codec.encode(x)
        for _ in range(300):
            blob = bytearray(blob0)
            pos, n = int(rng.integers(len(blob))), int(rng.integers(1, 16))
            blob[pos:pos + n] = rng.integers(0, 256, len(blob[pos:pos + n]), dtype=np.uint8).tobytes()
            if rng.integers(4) == 0:
                blob = blob[:int(rng.integers(len(blob)))]
            try:
                got = codec.decode(bytes(blob))
            except CodecError:
                continue
            assert got.tobytes() == x.tobytes()
