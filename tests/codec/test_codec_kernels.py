"""Byte planes: compiled kernels agree with the numpy reference; transform and stream decisions."""

from __future__ import annotations

import numpy as np
import pytest

from kvshrink.codec import byteplanes
from kvshrink.codec.entropy import entropy_bits, order0_bound


def reference_split(rows: np.ndarray, rotate: bool) -> np.ndarray:
    """Straight from the definition: rotate the little-endian integer, then take bytes high to low."""
    width = rows.shape[1]
    values = [int.from_bytes(r.tobytes(), "little") for r in rows]
    bits = 8 * width
    if rotate:
        values = [((v << 1) | (v >> (bits - 1))) & ((1 << bits) - 1) for v in values]
    return np.array([[(v >> (8 * (width - 1 - k))) & 0xFF for v in values] for k in range(width)], dtype=np.uint8)


@pytest.mark.parametrize("width", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("rotate", [False, True])
def test_split_matches_definition_and_merge_inverts(width, rotate, monkeypatch):
    if width == 1 and rotate:
        pytest.skip("1-byte elements are never split")
    rows = np.random.default_rng(width).integers(0, 256, (777, width), dtype=np.uint8)
    want = reference_split(rows, rotate)
    paths = ["numpy"] + (["jit"] if byteplanes._jit() is not None else [])
    for path in paths:
        if path == "numpy":
            monkeypatch.setattr(byteplanes, "_jit", lambda: None)
        got = byteplanes.split(rows, rotate, width)
        assert np.array_equal(got, want), path
        back = np.empty_like(rows)
        byteplanes.merge(tuple(got), rotate, back)
        assert np.array_equal(back, rows), path
        monkeypatch.undo()


def test_jit_is_used_when_numba_is_installed():
    pytest.importorskip("numba")
    rows = np.zeros((10_000, 2), dtype=np.uint8)
    byteplanes.split(rows, True, 2)
    assert byteplanes.jit_status() == "on"


def test_rotation_is_chosen_for_bf16_kv_only(real_chunks):
    kv_rows = real_chunks[0].reshape(-1).view(np.uint8).reshape(-1, 2)
    rotate, bits = byteplanes.analyze(kv_rows, "auto")
    assert rotate
    assert bits[0] < 3.5 and bits[1] > 7.8  # exponent stream vs sign+mantissa stream
    ints = np.random.default_rng(0).integers(-1000, 1000, 100_000).astype(np.int32)
    assert not byteplanes.analyze(ints.view(np.uint8).reshape(-1, 4), "auto")[0]
    assert byteplanes.analyze(kv_rows, "none")[0] is False
    assert byteplanes.analyze(ints.view(np.uint8).reshape(-1, 4), "rotl1")[0] is True


def test_entropy_and_bounds(real_chunks):
    assert entropy_bits(np.zeros(100, np.uint8)) == 0.0
    assert entropy_bits(np.arange(256, dtype=np.uint8)) == pytest.approx(8.0)
    rows = real_chunks[0].reshape(-1).view(np.uint8).reshape(-1, 2)
    plain, rotated = order0_bound(rows), order0_bound(rows, rotate=True)
    assert 1.40 < plain < rotated < 1.55
