"""Fixtures for the LMCache plugin tests (the shared ones are in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from l2_harness import build_from_json, dram_ssd_store, plugin_json


@pytest.fixture
def store_config(shm_name: str, tmp_path: Path) -> dict:
    return dram_ssd_store(shm_name, tmp_path / "ssd")


@pytest.fixture
def open_adapter():
    """Build adapters from adapter_params; close them (and their shm arenas) afterwards."""
    made = []

    def build(params: dict):
        adapter = build_from_json(plugin_json(params))
        made.append(adapter)
        return adapter

    yield build
    for adapter in made:
        adapter.close()


# -- end-to-end fixtures (real vLLM CPU), shared by the e2e modules -----------------------------------
E2E_PROMPT_TOKENS = 2200


@pytest.fixture(scope="session")
def model() -> Path:
    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    return ensure_checkpoint()


@pytest.fixture(scope="session")
def prompt() -> list[int]:
    """~2K token ids of real text (8 whole 256-token chunks + a tail)."""
    from kvshrink.testing.inprocess import prompt_token_ids

    return prompt_token_ids(E2E_PROMPT_TOKENS)


@pytest.fixture(scope="session")
def plain_tokens(model, prompt) -> list[int]:
    """Greedy output of vLLM without any KV connector: the reference every cached run must equal."""
    from kvshrink.testing.launch import VLLMServer

    from l2_harness import greedy

    with VLLMServer(model) as server:
        server.start()
        return greedy(server, prompt)
