"""One round-trip harness shared by every codec test (the numcodecs ``tests/common.py`` idea).

``check_roundtrip`` encodes, proves the caller's buffer was not touched, checks the header, decodes
three ways (fresh array, ``out=`` numpy/torch buffer, as_numpy) and compares bytes, so NaN payloads
and -0.0 count as different from anything but themselves.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from kvshrink.codec import Codec, CodecError, decode, encode, fast_frames, nibbles, read_header
from kvshrink.codec.dtypes import ArrayKind
from kvshrink.codec.frame import pack_header, parse_header


def encode_packed_fast(x: Any, **settings: Any) -> bytes:
    """A fast frame of ``x`` whose fused exponent streams are packed planes, as every fast frame
    was before code pairs (format version 2): the block path with code pairs turned off."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(nibbles, "PAIRS_WIDTH", -1)
        patch.setattr(fast_frames, "kernels", lambda: None)
        with Codec(method="fast", **settings) as codec:
            return codec.encode(x)


def seal(header_without_checksum: bytes) -> bytes:
    return header_without_checksum + struct.pack("<Q", xxhash.xxh3_64_intdigest(header_without_checksum))


def reseal(blob: bytes, offset: int, value: bytes) -> bytes:
    """``blob`` with bytes at ``offset`` replaced and the header checksum recomputed."""
    header = read_header(blob)
    body = bytearray(blob[:header.header_size - 8])
    body[offset:offset + len(value)] = value
    return seal(bytes(body)) + blob[header.header_size:]


def raw_bytes(x: Any) -> bytes:
    """The bytes of a numpy array or torch tensor, in C order."""
    if isinstance(x, torch.Tensor):
        if x.numel() == 0:
            return b""
        return x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


def assert_identical(got: Any, want: Any) -> None:
    """Same container, dtype, shape and bytes."""
    same_kind = type(got) is type(want) or (isinstance(got, np.ndarray) and isinstance(want, np.ndarray))
    assert same_kind, (type(got), type(want))
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert tuple(got.shape) == tuple(want.shape), (got.shape, want.shape)
    assert raw_bytes(got) == raw_bytes(want)


def check_roundtrip(x: Any, codec: Codec | None = None, method: str = "zstd", level: int | None = None) -> bytes:
    """Encode ``x`` and check everything a caller relies on; returns the frame."""
    before = raw_bytes(x)
    expected = np.asarray(x) if isinstance(x, np.generic) else x
    if codec is None:
        blob = encode(x, method=method, level=1 if level is None else level)
        dec = decode
    else:
        blob = codec.encode(x, method=method, level=level)
        dec = codec.decode
    assert isinstance(blob, bytes)
    assert raw_bytes(x) == before, "encode modified the caller's buffer"

    header = read_header(blob)
    assert header.shape == tuple(x.shape)
    assert header.method == method
    assert header.raw_size == len(before)
    assert header.frame_size == len(blob)
    assert header.container == ("torch" if isinstance(x, torch.Tensor) else "numpy")

    for form in (blob, bytearray(blob), memoryview(blob), np.frombuffer(blob, dtype=np.uint8)):
        assert_identical(dec(form), expected)

    out = torch.empty_like(x, memory_format=torch.contiguous_format) if isinstance(x, torch.Tensor) \
        else np.empty(x.shape, dtype=x.dtype)
    assert dec(blob, out=out) is out
    assert_identical(out, np.array(expected, order="C") if isinstance(x, (np.ndarray, np.generic)) else x)

    as_np = dec(blob, as_numpy=True)
    assert isinstance(as_np, np.ndarray)
    assert as_np.tobytes() == before
    return blob


def rebuild(blob: bytes, block: int, stream: int, payload: bytes, codings: list[list[int]] | None = None) -> bytes:
    """``blob`` with one stream's payload replaced (and its codings, when given), header (sizes,
    checksum) rewritten to match."""
    h, table = parse_header(memoryview(blob))
    kind = ArrayKind(h.container, h.dtype, h.shape, h.itemsize)
    payloads = [[bytes(blob[o:o + s]) for o, s in zip(offs, sizes)]
                for offs, sizes in zip(table.offsets.tolist(), table.sizes.tolist())]
    payloads[block][stream] = payload
    header = pack_header(kind, h.method, h.transform, h.streams_per_block, h.block_elems, table.checksums.tolist(),
                         table.codings.tolist() if codings is None else codings,
                         [[len(p) for p in row] for row in payloads])
    return header + b"".join(p for row in payloads for p in row)


def check_truncations_and_flips(blob: bytes) -> None:
    """Every truncation of ``blob`` raises CodecError, and :func:`check_single_byte_flips`."""
    for cut in range(len(blob)):
        with pytest.raises(CodecError):
            decode(blob[:cut])
    check_single_byte_flips(blob)


def check_single_byte_flips(blob: bytes) -> int:
    """Every single-byte flip (xor 0x5A) of ``blob`` raises CodecError or decodes to exactly the
    original (a bit no decoder reads, e.g. padding), never inside the header; how many did not raise."""
    original = decode(blob)
    header_size = read_header(blob).header_size
    harmless = 0
    for i in range(len(blob)):
        damaged = bytearray(blob)
        damaged[i] ^= 0x5A
        try:
            got = decode(damaged)
        except CodecError:
            continue
        harmless += 1
        assert got.tobytes() == original.tobytes(), i
        assert i >= header_size, f"a header flip at {i} went unnoticed"
    return harmless
