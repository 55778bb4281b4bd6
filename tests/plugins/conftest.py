"""Fixtures for the vLLM CPU connector tests: real SmolLM2 KV and LMCache memory objects."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from cpu_kv_helpers import DTYPE, HEAD_SIZE, NUM_KV_HEADS, NUM_LAYERS


@pytest.fixture(scope="session")
def real_kv_tensor() -> torch.Tensor:
    """Real SmolLM2 KV of 2048 tokens of Python source, LMCache layout [2, 30, 2048, 192], bf16."""
    from kvshrink.testing.fixtures.real_kv import real_kv

    return torch.from_numpy(np.ascontiguousarray(real_kv("code", 2048))).view(torch.bfloat16)


@pytest.fixture
def memory_objs() -> Iterator[Callable[..., object]]:
    """Factory of LMCache memory objects from LMCache's own host allocator; all released at the end."""
    from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
    from lmcache.v1.memory_management import MemoryFormat

    allocator = MixedMemoryAllocator(256 << 20)
    made = []

    def make(num_tokens: int, dtype: torch.dtype = DTYPE, fmt=MemoryFormat.KV_2LTD, layers: int = NUM_LAYERS):
        obj = allocator.allocate(torch.Size([2, layers, num_tokens, NUM_KV_HEADS * HEAD_SIZE]), dtype, fmt=fmt)
        assert obj is not None, "LMCache allocator is full"
        made.append(obj)
        return obj

    yield make
    for obj in made:
        obj.ref_count_down()
