"""The L2 adapter conformance suite, run on our adapter and on LMCache's reference MockL2Adapter.

Both are built by LMCache's own factory (``create_l2_adapter_from_registry``), exactly as
``lmcache server --l2-adapter JSON`` builds them.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from l2_contract import L2AdapterContract
from l2_harness import SHM_DIR, build_from_json, dram_ssd_store, plugin_json

from kvshrink.storage_backends.mp_l2_adapter import KVShrinkL2Adapter

class TestKVShrinkAdapterContract(L2AdapterContract):
    """Our adapter over DRAM + SSD tiers, so every tier codec runs the suite: as the harness
    configures them (raw DRAM, dense SSD), and with both tiers ``codec: fast``."""

    @pytest.fixture(params=[None, "fast"])
    def make_adapter(self, tmp_path: Path, request: pytest.FixtureRequest):
        made, shm_names = [], []

        def make():
            shm = f"kvshrink-sbtest-{uuid.uuid4().hex[:12]}"
            shm_names.append(shm)
            store = dram_ssd_store(shm, tmp_path / f"ssd-{len(made)}", codec=request.param)
            adapter = build_from_json(plugin_json({"store": store}))
            assert isinstance(adapter, KVShrinkL2Adapter)
            assert [t.codec for t in adapter._config.store_config.tiers] == (
                ["raw", "dense"] if request.param is None else [request.param] * 2)
            made.append(adapter)
            return adapter

        yield make
        for adapter in made:
            adapter.close()
        for shm in shm_names:
            (SHM_DIR / shm).unlink(missing_ok=True)


class TestMockAdapterContract(L2AdapterContract):
    """LMCache's reference adapter passes the same suite: the suite tests the contract."""

    @pytest.fixture
    def make_adapter(self):
        made = []

        def make():
            adapter = build_from_json({"type": "mock", "max_size_gb": 0.5, "mock_bandwidth_gb": 50.0})
            made.append(adapter)
            return adapter

        yield make
        for adapter in made:
            adapter.close()

