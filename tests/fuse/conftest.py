"""Fixtures of the KV Fuse tests: the real SmolLM2 model (loaded once per session) and real text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)  # the machine is shared; the tests time nothing


@pytest.fixture(scope="session")
def checkpoint() -> Path:
    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    return ensure_checkpoint()


@pytest.fixture(scope="session")
def model(checkpoint: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(checkpoint: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint))


@pytest.fixture(scope="session")
def prose_ids(tokenizer: Any) -> list[int]:
    """A few thousand tokens of real prose (the Python reference)."""
    from kvshrink.testing.fixtures.real_kv import corpus_text

    return tokenizer(corpus_text("prose")[:20000], add_special_tokens=False).input_ids


@pytest.fixture(scope="session")
def engine(model: Any) -> Any:
    from kvshrink.fuse.engine import FuseEngine

    return FuseEngine(model)  # bf16 KV, as served


@pytest.fixture(scope="session")
def engine32(model: Any) -> Any:
    from kvshrink.fuse.engine import FuseEngine

    return FuseEngine(model, kv_dtype=None)  # float32 KV: an ordinary float32 forward's math


@pytest.fixture(scope="session")
def hf_kv(model: Any) -> Any:
    """``hf_kv(ids)``: KV of an ordinary transformers forward (float32), LMCache's ``[2, L, T, H*D]``."""

    def compute(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            cache = model(torch.tensor([ids]), use_cache=True).past_key_values
        rows = [torch.stack([layer.keys[0].transpose(0, 1).reshape(len(ids), -1),
                             layer.values[0].transpose(0, 1).reshape(len(ids), -1)]) for layer in cache.layers]
        return torch.stack(rows, dim=1)

    return compute
