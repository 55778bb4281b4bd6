"""Write the stored example frames that pin the on-disk format (run by hand, then commit the files).

    python tests/codec/frames/make_frames.py            # writes only the examples not stored yet
    python tests/codec/frames/make_frames.py --rewrite  # every example (never for a released version)

Each ``NAME.kvs`` is a frame; ``NAME.npy`` holds the array it must decode to (torch frames: the raw
bits as the unsigned dtype of the same width); ``manifest.json`` the header fields, read back from
the stored frames. Existing frames must never be rewritten for a released format version: add new
ones instead, so that a reader change that breaks old frames fails ``test_codec_frames.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from kvshrink.codec import FORMAT_VERSION, Codec, read_header
from kvshrink.testing.fixtures.real_kv import real_kv_chunks

HERE = Path(__file__).resolve().parent


def examples() -> dict[str, tuple[object, dict]]:
    kv = np.ascontiguousarray(real_kv_chunks(4, 256)[0][:, :2, :16])
    specials = np.array([np.nan, -np.inf, np.inf, -0.0, 1e-45, 3.4e38, 1.0, -2.5], dtype=np.float32)
    return {
        "kv_bf16_zstd": (kv, {"method": "zstd", "block_size": 4096}),
        "kv_bf16_qat": (kv, {"method": "qat", "block_size": 4096}),
        "kv_bf16_raw": (kv, {"method": "raw", "level": 0, "block_size": 8192}),
        "kv_bf16_torch": (torch.from_numpy(kv.copy()).view(torch.bfloat16), {"method": "zstd"}),
        "f32_specials": (np.tile(specials, 300).reshape(60, 40), {"method": "zstd", "block_size": 1024}),
        "i64_ramp": (np.arange(-300, 2700, dtype=np.int64) * 7, {"method": "zstd", "transform": "none"}),
        "fp8_torch": (torch.linspace(-3, 3, 999).to(torch.float8_e4m3fn), {"method": "zstd"}),
        "bool_mask": (np.arange(1000) % 3 == 0, {"method": "zstd"}),
        "scalar_f64": (np.array(-1.5e-300), {"method": "zstd"}),
        "empty_f16": (np.empty((0, 5), dtype=np.float16), {"method": "zstd"}),
        "c16_small": (np.exp(1j * np.linspace(0, 6, 257)), {"method": "zstd", "block_size": 1024}),
        # format version 2: the fast method's packed streams (fused 2-byte path, and the per-stream path)
        "kv_bf16_fast": (kv, {"method": "fast", "block_size": 4096}),
        "kv_f32_fast": (_bf16_to_f32(kv[:, :1]), {"method": "fast", "block_size": 8192}),
        # format version 4: the fast method's exponents as 4-bit code pairs (kv_bf16_fast, written before
        # version 4 with the same settings, keeps the packed planes written then)
        "kv_bf16_fast_pairs": (kv, {"method": "fast", "block_size": 4096}),
        # format version 3: zstd frames whose exponent streams are nibble-coded (2-byte elements)
        "kv_bf16_dense": (kv, {"method": "zstd", "block_size": 4096}),
        "kv_bf16_dense_torch": (torch.from_numpy(kv.copy()).view(torch.bfloat16), {"method": "zstd"}),
    }


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def raw_bits(x: object) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        width = x.element_size()
        flat = x.reshape(-1).view(torch.uint8).numpy() if x.numel() else np.empty(0, np.uint8)
        return flat.view(f"<u{width}").reshape(tuple(x.shape))
    return np.asarray(x)


def main(rewrite: bool = False) -> None:
    manifest = {"format_version": FORMAT_VERSION, "frames": {}}
    for name, (x, settings) in examples().items():
        path = HERE / f"{name}.kvs"
        if rewrite or not path.exists():
            settings = dict(settings)
            method, level = settings.pop("method"), settings.pop("level", 1)
            with Codec(method=method, level=level, threads=1, **settings) as codec:
                path.write_bytes(codec.encode(x))
            np.save(HERE / f"{name}.npy", raw_bits(x))
        h = read_header(path.read_bytes())
        manifest["frames"][name] = {"format_version": h.format_version, "container": h.container, "dtype": h.dtype,
                                    "shape": list(h.shape),
                                    "method": h.method, "transform": h.transform, "nblocks": h.nblocks,
                                    "raw_size": h.raw_size, "frame_size": h.frame_size}
    (HERE / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main(rewrite="--rewrite" in sys.argv[1:])
