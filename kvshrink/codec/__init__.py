"""KV Shrink codec: lossless compression of KV-cache tensors (bf16 first) into self-describing frames.

Method: cut the input into independent blocks, split each block's elements into byte streams
(most significant byte first, optionally after a one-bit rotation that puts the bf16/fp32 exponent
in one byte), then per stream: zstd (or deflate for ``qat``, or fixed-width codes with an escape
list for ``fast``, built for decode speed: :mod:`kvshrink.codec.packed`) when the data says it
pays, stored otherwise. zstd codes the exponent stream of 2-byte elements as 4-bit codes, two to a
byte, so its entropy stage sees half the symbols (:mod:`kvshrink.codec.nibbles`). Blocks run in
parallel; every block carries a checksum of its decoded bytes.

    frame = encode(kv)                  # numpy (bf16 as uint16 view) or torch tensor
    kv2 = decode(frame)                 # same container, dtype, shape; bit-exact
    decode(frame, out=buffer)           # straight into a preallocated buffer
    read_header(frame).raw_size         # validate + size without decompressing

Threads: every call draws its block parallelism from one process-wide budget
(:mod:`kvshrink.codec.cpu_budget`; ``KVSHRINK_CODEC_THREADS`` or a store's ``engine.codec_threads``,
else the CPUs this process may use), so the threads busy encoding / decoding never exceed it.

``CodecError`` is the one exception for corrupt, truncated, foreign or hostile frames. The frame
layout is documented in :mod:`kvshrink.codec.frame`; stored frames under ``tests/codec/frames``
pin it.
"""

from __future__ import annotations

import threading
from typing import Any

from kvshrink.codec.byteplanes import jit_status
from kvshrink.codec.codec import Codec, default_threads
from kvshrink.codec.errors import CodecArgumentError, CodecError, OutputMismatchError, UnsupportedArrayError
from kvshrink.codec.frame import FORMAT_VERSION, METHODS, FrameHeader
from kvshrink.codec.qat import qat_status

__all__ = ["Codec", "CodecArgumentError", "CodecError", "FORMAT_VERSION", "FrameHeader", "METHODS", "OutputMismatchError",
           "UnsupportedArrayError", "decode", "default_codec", "default_threads", "encode", "jit_status",
           "qat_status", "read_header"]

_default: Codec | None = None
_default_lock = threading.Lock()


def default_codec() -> Codec:
    """The shared codec behind the module functions (default settings, ``default_threads()``)."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Codec()
    return _default


def encode(x: Any, *, method: str = "zstd", level: int = 1) -> bytes:
    """Compress ``x`` (numpy array or torch tensor) into a frame; ``x`` is not modified."""
    return default_codec().encode(x, method=method, level=level)


def decode(blob: Any, out: Any = None, *, as_numpy: bool = False) -> Any:
    """Decode a frame (bytes-like) bit-exact; into ``out`` when given. Raises CodecError on bad input."""
    return default_codec().decode(blob, out, as_numpy=as_numpy)


def read_header(blob: Any) -> FrameHeader:
    """Validate a frame's header and return it, without decompressing."""
    return default_codec().read_header(blob)
