"""Stored example frames (tests/codec/frames) decode to their stored arrays: the format is pinned.

A reader change that breaks frames already written fails here. To add examples, extend
``frames/make_frames.py`` and run it; never regenerate frames of a released format version.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvshrink.codec import FORMAT_VERSION, decode, read_header

FRAMES = Path(__file__).resolve().parent / "frames"
MANIFEST = json.loads((FRAMES / "manifest.json").read_text())


def test_manifest_matches_this_format_version():
    assert MANIFEST["format_version"] == FORMAT_VERSION


def test_the_pinned_set_covers_every_method_and_container():
    frames = MANIFEST["frames"].values()
    assert {f["method"] for f in frames} == {"zstd", "qat", "raw", "fast"}
    assert {f["format_version"] for f in frames} == {1, 2, 3, 4}
    assert {f["container"] for f in frames} == {"numpy", "torch"}
    assert {f["transform"] for f in frames} == {"none", "rotl1"}
    assert any(f["nblocks"] > 1 for f in frames) and any(f["raw_size"] == 0 for f in frames)


@pytest.mark.parametrize("name", sorted(MANIFEST["frames"]))
def test_stored_frame_decodes_to_stored_array(name):
    meta = MANIFEST["frames"][name]
    blob = (FRAMES / f"{name}.kvs").read_bytes()
    expected = np.load(FRAMES / f"{name}.npy")

    header = read_header(blob)
    for key in ("container", "dtype", "method", "transform", "nblocks", "raw_size", "frame_size"):
        assert getattr(header, key) == meta[key], key
    assert list(header.shape) == meta["shape"]
    assert header.format_version == meta["format_version"]  # a frame's version is what it was written as

    got = decode(blob)
    if meta["container"] == "torch":
        assert isinstance(got, torch.Tensor) and str(got.dtype) == f"torch.{meta['dtype']}"
        bits = got.reshape(-1).view(getattr(torch, f"uint{8 * got.element_size()}")).numpy() if got.numel() else \
            np.empty(0, expected.dtype)
        assert bits.reshape(tuple(got.shape)).tobytes() == expected.tobytes()
    else:
        assert isinstance(got, np.ndarray) and got.dtype == expected.dtype and got.shape == expected.shape
        assert got.tobytes() == expected.tobytes()
    assert decode(blob, as_numpy=True).tobytes() == expected.tobytes()
