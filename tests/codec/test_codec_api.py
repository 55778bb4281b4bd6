"""The public surface: settings validation, unsupported inputs, headers, caller buffers untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvshrink.codec as codec_api
from kvshrink.codec import Codec, CodecArgumentError, FrameHeader, UnsupportedArrayError, decode, encode, read_header
from kvshrink.errors import ConfigError, KVShrinkError


@pytest.mark.parametrize("kwargs,key", [
    ({"method": "lzma"}, "method"), ({"level": 0}, "level"), ({"level": 23}, "level"), ({"level": -1}, "level"),
    ({"level": 1.5}, "level"), ({"block_size": 0}, "block_size"), ({"threads": 0}, "threads"),
    ({"hash_log": 3}, "hash_log"), ({"min_saving": 1.0}, "min_saving"), ({"transform": "rot"}, "transform"),
    ({"max_frame_bytes": -1}, "max_frame_bytes"), ({"threads": True}, "threads"),
])
def test_bad_settings_name_the_argument(kwargs, key):
    with pytest.raises(CodecArgumentError) as err:  # a caller's argument, not a config file's key
        Codec(**kwargs)
    assert err.value.argument == key and not isinstance(err.value, ConfigError)
    assert isinstance(err.value, KVShrinkError) and isinstance(err.value, ValueError)


def test_threads_from_environment(monkeypatch):
    monkeypatch.setenv("KVSHRINK_CODEC_THREADS", "3")
    assert Codec().threads == 3
    monkeypatch.setenv("KVSHRINK_CODEC_THREADS", "many")
    with pytest.raises(ConfigError, match="KVSHRINK_CODEC_THREADS"):
        Codec()


def test_raw_method_ignores_level_and_does_not_compress(kv_slice):
    blob = encode(kv_slice, method="raw", level=0)
    header = read_header(blob)
    assert header.method == "raw" and header.streams_per_block == 1 and header.transform == "none"
    assert len(blob) > kv_slice.nbytes
    assert decode(blob).tobytes() == kv_slice.tobytes()


@pytest.mark.parametrize("thing", [
    [1, 2, 3], b"bytes", 3.5, None,
    np.array(["a", "b"]), np.array([object()]), np.zeros(3, dtype=[("a", "<f4"), ("b", "<i2")]),
    np.zeros(2, dtype=np.float128) if hasattr(np, "float128") else np.zeros(2, dtype="<M8[s]"),
    torch.empty(4, dtype=torch.uint4), torch.empty(4, dtype=torch.bits16),
])
def test_unsupported_inputs(thing):
    with pytest.raises(UnsupportedArrayError):
        encode(thing)
    assert issubclass(UnsupportedArrayError, KVShrinkError) and issubclass(UnsupportedArrayError, TypeError)


def test_header_says_what_decode_will_allocate(real_chunks):
    kv = torch.from_numpy(real_chunks[0]).view(torch.bfloat16)
    blob = encode(kv)
    header = read_header(blob)
    assert isinstance(header, FrameHeader)
    assert (header.container, header.dtype, header.shape) == ("torch", "bfloat16", tuple(kv.shape))
    assert header.raw_size == kv.numel() * 2 and header.frame_size == len(blob)
    assert header.ratio == pytest.approx(kv.numel() * 2 / len(blob))
    assert header.format_version == 3  # nibble-coded exponents need version 3; fast code pairs version 4
    assert read_header(encode(real_chunks[0][:, :1], method="fast")).format_version == 4
    assert codec_api.FORMAT_VERSION == 4


def test_encode_never_touches_the_callers_memory(real_chunks):
    """ZipNN rewrites its input in place; we must not, for any input kind."""
    kv = real_chunks[0]
    snapshot = kv.tobytes()
    tensor = torch.from_numpy(kv.copy()).view(torch.bfloat16)
    t_snapshot = tensor.view(torch.int16).clone()
    for method in ("zstd", "qat", "raw", "fast"):
        encode(kv, method=method, level=0 if method == "raw" else 1)
        encode(tensor, method=method, level=0 if method == "raw" else 1)
        encode(kv[:, ::3], method=method, level=0 if method == "raw" else 1)
    assert kv.tobytes() == snapshot
    assert torch.equal(tensor.view(torch.int16), t_snapshot)


def test_decode_does_not_alias_the_blob(kv_slice):
    blob = bytearray(encode(kv_slice, method="raw", level=0))
    out = decode(blob)
    blob[-50:] = bytes(50)
    assert out.tobytes() == kv_slice.tobytes()


def test_status_helpers():
    assert codec_api.jit_status() in ("on", "untried") or codec_api.jit_status().startswith("off")
    assert "libqatzip" in codec_api.qat_status()
    assert codec_api.default_codec() is codec_api.default_codec()
    assert "Codec(method='zstd'" in repr(codec_api.default_codec())
