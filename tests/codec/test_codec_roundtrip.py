"""Bit-exact round trips: real KV, every dtype, edge-case shapes and payloads, odd memory layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from codec_harness import assert_identical, check_roundtrip

from kvshrink.codec import Codec, decode, encode, read_header
from kvshrink.codec.dtypes import TORCH_DTYPE_WIDTHS

NUMPY_DTYPES = ["bool", "int8", "uint8", "<i2", "<u2", "<f2", "<i4", "<u4", "<f4", "<i8", "<u8", "<f8",
                "<c8", "<c16", ">u2", ">f4", ">f8", ">i8"]


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("method", ["zstd", "qat", "raw", "fast"])
def test_real_kv_roundtrip(real_chunks, method):
    for chunk in real_chunks:
        check_roundtrip(chunk, method=method, level=0 if method == "raw" else 1)


def test_real_kv_as_torch_bf16(real_chunks):
    tensor = torch.from_numpy(real_chunks[1]).view(torch.bfloat16)
    blob = check_roundtrip(tensor)
    assert read_header(blob).dtype == "bfloat16"
    assert read_header(blob).transform == "rotl1"


def test_real_kv_ratio(real_chunks):
    """The acceptance ratio is deterministic, so it is checked here; speed lives in codec-bench."""
    for chunk in real_chunks:
        assert chunk.nbytes / len(encode(chunk)) >= 1.45
        assert chunk.nbytes / len(encode(chunk, method="qat")) >= 1.35
        assert chunk.nbytes / len(encode(chunk, method="fast")) >= 1.33


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("size", [0, 1, 3, 4097, 33333])
def test_every_numpy_dtype_and_odd_sizes(dtype, size, small_blocks):
    dt = np.dtype(dtype)
    x = random_bytes(size * dt.itemsize, seed=size).view(dt)
    check_roundtrip(x, codec=small_blocks)
    check_roundtrip(x)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("name", sorted(TORCH_DTYPE_WIDTHS))
def test_every_torch_dtype(name, small_blocks):
    width = TORCH_DTYPE_WIDTHS[name]
    raw = torch.from_numpy(random_bytes(2 * 513 * width, seed=width).reshape(2, 513, width))
    x = raw.view(getattr(torch, name)).reshape(2, 513)
    check_roundtrip(x, codec=small_blocks)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 5), (1,), (1, 1, 1, 1), (7, 11, 13)])
def test_shapes(shape):
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) * np.float32(0.37)
    check_roundtrip(x)
    check_roundtrip(torch.from_numpy(np.array(x)).to(torch.bfloat16))


def test_zero_dim_tensor():
    check_roundtrip(torch.tensor(3.5, dtype=torch.bfloat16))
    check_roundtrip(np.float64(-0.0))  # numpy scalar: encoded as a 0-d array


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_special_float_payloads(dtype):
    info = np.finfo(dtype)
    uint = np.dtype(f"u{np.dtype(dtype).itemsize}")
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, info.tiny, info.tiny / 4, -info.tiny / 8,
                         info.max, info.min, info.eps], dtype=dtype)
    # NaNs with distinct payloads (quiet, signalling-looking, sign set) must survive bit for bit
    nan_bits = specials[:2].view(uint).copy()
    nan_bits[0] |= uint.type(1)
    nan_bits[1] ^= uint.type(3)
    payloads = np.concatenate([specials, nan_bits.view(dtype)])
    x = np.tile(payloads, 700)
    check_roundtrip(x)
    check_roundtrip(torch.from_numpy(x))


def test_bf16_nan_inf_denormal_payloads():
    bits = np.array([0x7FC0, 0xFFC1, 0x7F81, 0x7F80, 0xFF80, 0x0001, 0x8001, 0x007F, 0x8000, 0x0000], dtype=np.uint16)
    x = np.tile(bits, 1000)
    check_roundtrip(x)
    check_roundtrip(torch.from_numpy(x).view(torch.bfloat16))


def test_non_contiguous_numpy(real_chunks, small_blocks):
    kv = real_chunks[0]
    for view in (kv[:, ::2], kv[..., ::-1], kv.transpose(0, 2, 1, 3), kv[1, 3:7, 5:200:3, 17:100]):
        assert not view.flags.c_contiguous
        blob = check_roundtrip(view, codec=small_blocks)
        assert_identical(decode(blob), np.array(view, order="C"))


def test_non_contiguous_torch(real_chunks, small_blocks):
    kv = torch.from_numpy(real_chunks[2]).view(torch.bfloat16)
    for view in (kv[:, ::2], kv.transpose(1, 2), kv[0, 3, 1:200:7], kv.flip(-1)):
        check_roundtrip(view, codec=small_blocks)


def test_read_only_and_grad_inputs():
    x = np.arange(1000, dtype=np.float32)
    x.flags.writeable = False
    check_roundtrip(x)
    t = torch.randn(64, 33, requires_grad=True)
    blob = encode(t)
    assert torch.equal(decode(blob), t.detach())


@pytest.mark.parametrize("transform", ["auto", "none", "rotl1"])
@pytest.mark.parametrize("block_size", [2, 1000, 1 << 20])
def test_settings_do_not_change_results(real_chunks, transform, block_size):
    kv = real_chunks[3][:, :1, :4] if block_size < 64 else real_chunks[3][:, :6]
    with Codec(transform=transform, block_size=block_size, threads=2, min_saving=0.0, hash_log=None) as codec:
        check_roundtrip(kv, codec=codec)


def test_levels(kv_slice):
    for level in (1, 3, 9, 19):
        check_roundtrip(kv_slice, level=level)
    for level in (1, 6, 9):
        check_roundtrip(kv_slice, method="qat", level=level)


def test_constant_and_structured_data(small_blocks):
    for x in (np.zeros(100_000, np.uint16), np.full(50_001, 7, np.int64)):
        assert len(check_roundtrip(x, codec=small_blocks)) < x.nbytes / 20
    ramp = np.arange(100_000, dtype=np.int32)
    assert len(check_roundtrip(ramp, codec=small_blocks)) < ramp.nbytes / 2
