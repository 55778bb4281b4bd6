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
