"""Byte planes: compiled kernels agree with the numpy reference; transform and stream decisions."""

from __future__ import annotations

import numpy as np
import pytest

from kvshrink.codec import byteplanes
from kvshrink.codec.entropy import column_entropies, entropy_bits, order0_bound


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


def test_sample_decides_alike_on_contiguous_and_strided_rows(real_chunks):
    """The sample is runs spread over the whole input, the same for a strided view of it."""
    kv_rows = real_chunks[0].reshape(-1).view(np.uint8).reshape(-1, 2)
    sample = byteplanes._sample(kv_rows)
    assert sample.shape == (byteplanes.TRANSFORM_SAMPLE_ELEMENTS, 2) and sample.flags.c_contiguous
    run = byteplanes.TRANSFORM_SAMPLE_ELEMENTS // byteplanes.SAMPLE_RUNS
    assert np.array_equal(sample[:run], kv_rows[:run])  # the first run starts at the first element
    assert np.array_equal(sample[-run:], kv_rows[kv_rows.shape[0] // byteplanes.SAMPLE_RUNS * (byteplanes.SAMPLE_RUNS - 1):][:run])
    strided = kv_rows[::2]
    assert not strided.flags.c_contiguous
    assert byteplanes._sample(strided).shape == (byteplanes.TRANSFORM_SAMPLE_ELEMENTS, 2)
    assert byteplanes.analyze(strided, "auto")[0] == byteplanes.analyze(kv_rows, "auto")[0]
    small = kv_rows[:100]
    assert np.array_equal(byteplanes._sample(small), small)


def test_column_entropies_equal_entropy_per_column():
    rows = np.random.default_rng(3).integers(0, 256, (5000, 4), dtype=np.uint8)
    rows[:, 0] = 7  # one constant column: 0 bits
    rows[:, 1] %= 4  # two bits
    want = [entropy_bits(np.ascontiguousarray(rows[:, k])) for k in range(4)]
    assert column_entropies(rows) == pytest.approx(want, abs=1e-12)
    assert column_entropies(rows)[0] == 0.0 and column_entropies(rows)[1] == pytest.approx(2.0, abs=0.01)
    assert column_entropies(np.empty((0, 3), np.uint8)) == [0.0, 0.0, 0.0]


def test_entropy_and_bounds(real_chunks):
    assert entropy_bits(np.zeros(100, np.uint8)) == 0.0
    assert entropy_bits(np.arange(256, dtype=np.uint8)) == pytest.approx(8.0)
    rows = real_chunks[0].reshape(-1).view(np.uint8).reshape(-1, 2)
    plain, rotated = order0_bound(rows), order0_bound(rows, rotate=True)
    assert 1.40 < plain < rotated < 1.55


def test_compiled_sample_entropies_equal_the_numpy_path(real_chunks):
    """The one-pass kernel samples the same rows and gives the same bits, stored and rotated."""
    jit = byteplanes._jit()
    if jit is None:
        pytest.skip("numba not installed: only the numpy path runs")
    rng = np.random.default_rng(5)
    cases = [real_chunks[0].reshape(-1).view(np.uint8).reshape(-1, 2), rng.integers(0, 256, (10000, 4), dtype=np.uint8),
             rng.integers(0, 256, (100, 2), dtype=np.uint8), rng.integers(0, 256, (123457, 8), dtype=np.uint8),
             rng.integers(0, 256, (5000, 1), dtype=np.uint8), np.zeros((0, 2), np.uint8)]
    for rows in cases:
        sample = byteplanes._sample(rows)
        plain, rotated = byteplanes._sampled_entropies(jit, rows)
        assert plain == pytest.approx(column_entropies(sample)[::-1], abs=1e-9)
        assert rotated == pytest.approx(column_entropies(byteplanes._rotl1(sample))[::-1], abs=1e-9)
