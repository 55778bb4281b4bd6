"""decode(out=...): into numpy and torch buffers, views of bigger buffers, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from codec_harness import assert_identical

from kvshrink.codec import Codec, OutputMismatchError, decode, encode


def test_into_numpy_buffer(real_chunks):
    kv = real_chunks[0]
    out = np.zeros_like(kv)
    assert decode(encode(kv), out=out) is out
    assert_identical(out, kv)


def test_into_view_of_bigger_numpy_buffer(real_chunks):
    """Like an LMCache MemoryObj: a slice of a large flat arena, viewed with the chunk's dtype/shape."""
    kv = real_chunks[1]
    arena = np.full(kv.nbytes * 3, 0xAB, dtype=np.uint8)
    start = kv.nbytes + 64
    view = arena[start:start + kv.nbytes].view(np.uint16).reshape(kv.shape)
    assert decode(encode(kv), out=view) is view
    assert_identical(view, kv)
    assert (arena[:start] == 0xAB).all() and (arena[start + kv.nbytes:] == 0xAB).all(), "wrote outside the view"


def test_into_view_of_bigger_torch_buffer(real_chunks):
    kv = torch.from_numpy(real_chunks[2]).view(torch.bfloat16)
    arena = torch.full((kv.numel() * 2 + 100,), 7.0, dtype=torch.bfloat16)
    view = arena[50:50 + kv.numel()].view(kv.shape)
    assert decode(encode(kv), out=view) is view
    assert torch.equal(view.view(torch.int16), kv.view(torch.int16))
    assert (arena[:50] == 7.0).all() and (arena[50 + kv.numel():] == 7.0).all()


def test_raw_bits_views_are_accepted(real_chunks):
    """bf16 frames land in uint16 buffers and the other way round, and anything in plain bytes."""
    kv = torch.from_numpy(real_chunks[3]).view(torch.bfloat16)
    blob = encode(kv)
    as_u16 = np.empty(kv.shape, dtype=np.uint16)
    decode(blob, out=as_u16)
    assert as_u16.tobytes() == real_chunks[3].tobytes()
    flat = np.empty(kv.numel() * 2, dtype=np.uint8)
    decode(blob, out=flat)
    assert flat.tobytes() == real_chunks[3].tobytes()
    as_bf16 = torch.empty(kv.shape, dtype=torch.bfloat16)
    decode(encode(real_chunks[3]), out=as_bf16)  # numpy uint16 frame into a bf16 tensor
    assert torch.equal(as_bf16.view(torch.int16), kv.view(torch.int16))
    with pytest.raises(OutputMismatchError):
        decode(blob, out=torch.empty(kv.shape, dtype=torch.float16))  # bf16 is not fp16


def test_non_contiguous_out_is_filled_by_copy(kv_slice):
    blob = encode(kv_slice)
    big = np.zeros(kv_slice.shape[:-1] + (kv_slice.shape[-1] * 2,), dtype=np.uint16)
    strided = big[..., ::2]
    decode(blob, out=strided)
    assert_identical(np.ascontiguousarray(strided), kv_slice)
    assert (big[..., 1::2] == 0).all()
    t = torch.zeros(kv_slice.shape[::-1], dtype=torch.int16).transpose(0, 3).transpose(1, 2)
    assert not t.is_contiguous()
    decode(encode(torch.from_numpy(kv_slice.view(np.int16))), out=t)
    assert t.contiguous().numpy().tobytes() == kv_slice.tobytes()


def test_multithreaded_decode_into_out(real_chunks):
    kv = real_chunks[0]
    with Codec(threads=2, block_size=64 << 10) as codec:
        out = torch.empty(kv.shape, dtype=torch.uint16)
        codec.decode(codec.encode(kv), out=out)
    assert out.numpy().tobytes() == kv.tobytes()


@pytest.mark.parametrize("bad", [
    np.empty((2, 4, 32, 191), dtype=np.uint16),  # one column short
    np.empty((2, 4, 32, 96), dtype=np.uint32),  # same bytes, other width
    np.empty(2 * 4 * 32 * 192 * 2 + 1, dtype=np.uint8),  # one byte too many
    torch.empty((2, 4, 32, 192), dtype=torch.float32),
    torch.empty((2, 4, 32, 96), dtype=torch.int32),
    [0] * 10,
])
def test_wrong_out_is_refused_before_writing(kv_slice, bad):
    blob = encode(kv_slice)
    snapshot = bad.copy() if hasattr(bad, "copy") else None
    with pytest.raises(OutputMismatchError, match="output|out must"):
        decode(blob, out=bad)
    if isinstance(bad, np.ndarray):
        assert bad.tobytes() == snapshot.tobytes()


def test_other_dtype_of_same_width_is_refused():
    blob = encode(np.linspace(-1, 1, 1000, dtype=np.float32))
    for bad in (np.empty(1000, np.int32), torch.empty(1000, dtype=torch.int32), np.empty(1000, np.float16)):
        with pytest.raises(OutputMismatchError):
            decode(blob, out=bad)
    decode(blob, out=np.empty(1000, np.uint32))  # its raw bits are fine


def test_read_only_out_is_refused(kv_slice):
    out = np.empty_like(kv_slice)
    out.flags.writeable = False
    with pytest.raises(OutputMismatchError, match="read-only"):
        decode(encode(kv_slice), out=out)


def test_empty_frame_into_empty_out():
    out = np.empty((0, 3), dtype=np.float32)
    assert decode(encode(np.empty((0, 3), np.float32)), out=out) is out


def test_byte_order_must_match():
    x = np.linspace(-2, 2, 500).astype(">f4")
    blob = encode(x)
    with pytest.raises(OutputMismatchError):
        decode(blob, out=np.empty(500, "<f4"))  # same name, other byte order: would read garbage
    out = np.empty(500, ">f4")
    decode(blob, out=out)
    assert np.array_equal(out, x)
