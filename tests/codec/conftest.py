"""Shared fixtures for the codec tests: real SmolLM2 KV chunks and small codecs."""

from __future__ import annotations

import numpy as np
import pytest

from kvshrink.codec import Codec


@pytest.fixture(scope="session")
def real_chunks() -> list[np.ndarray]:
    """Four real KV chunks [2, 30, 256, 192] (bf16 as uint16), two per corpus."""
    from kvshrink.testing.fixtures.real_kv import real_kv_chunks

    return real_kv_chunks(4, 256)


@pytest.fixture(scope="session")
def kv_slice(real_chunks) -> np.ndarray:
    """A small real-KV slice [2, 4, 32, 192] for tests that loop many times."""
    return np.ascontiguousarray(real_chunks[0][:, :4, :32])


@pytest.fixture()
def small_blocks() -> Codec:
    """A codec with 4 KiB blocks and 2 threads, so small inputs still span many parallel blocks."""
    with Codec(block_size=4096, threads=2) as codec:
        yield codec
