"""End to end, in-process mode: vLLM CPU + KVShrink's LMCache connector (LMCache's in-process
connector with our CPU connector, loaded by kv_connector_module_path) + our storage plugin selected
from the shipped LMCache YAML, real SmolLM2.

The prompt is sent twice (stored, then retrieved: LMCache's own log lines say so) and the greedy
tokens equal plain vLLM's. Then vLLM is restarted with our DRAM arena removed: LMCache's
LocalCPUBackend starts empty, so the retrieval must come from our plugin's SSD tier.
"""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path

import pytest
import yaml
from l2_harness import SHM_DIR, greedy

from kvshrink.testing.derived_stores import derive_store
from kvshrink.testing.polling import poll_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
SHIPPED_YAML = REPO / "configs" / "lmcache-inprocess-dram-ssd.yaml"
WHOLE_CHUNK_TOKENS = 2200 // 256 * 256


def private_config(tmp_path: Path, shm: str) -> Path:
    data = yaml.safe_load(SHIPPED_YAML.read_text())
    data["max_local_cpu_size"] = 1.0
    del data["extra_config"]["kvshrink.config"]
    store = derive_store(paths={"ssd": tmp_path / "ssd"}, shm_names={"dram": shm},
                         capacities={"dram": "256MiB", "ssd": "2GiB"})
    # a test-only change to the default: vLLM CPU's shutdown does not close LMCache's storage
    # plugins, so the default's persist_on_close never runs there; write-back puts every chunk on
    # the SSD as it is stored, which is what this restart-from-SSD test needs
    store["tiers"][1]["write_back"] = True
    data["extra_config"]["kvshrink.store"] = store
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def wait_for_files(directory: Path, count: int, timeout: float = 120.0) -> int:
    """The number of chunk files under ``directory`` once there are ``count``, or at the timeout."""
    def found() -> int:
        return sum(1 for _ in directory.rglob("*.kvc"))

    with contextlib.suppress(TimeoutError):
        poll_until(lambda: found() >= count, timeout, interval=0.5)
    return found()


def test_two_requests_then_a_restart_served_by_our_storage_plugin(model, prompt, plain_tokens, tmp_path):
    from kvshrink.testing.inprocess import LMCacheActivity, in_process_server

    shm = f"kvshrink-e2e-{uuid.uuid4().hex[:10]}"
    config = private_config(tmp_path, shm)
    try:
        server = in_process_server(model, config, log_path=tmp_path / "vllm-1.log")
        with server:
            server.start()
            first = greedy(server, prompt)
            second = greedy(server, prompt)
            assert wait_for_files(tmp_path / "ssd", WHOLE_CHUNK_TOKENS // 256) == WHOLE_CHUNK_TOKENS // 256
        log = server.log_path.read_text(errors="replace")
        assert "Created dynamic backend: kvshrink" in log
        assert "engine uses the KVShrink CPU connector" in log
        activity = LMCacheActivity.from_log(log)
        assert activity.stored_tokens[:1] == [WHOLE_CHUNK_TOKENS]
        assert activity.retrieved_tokens == [WHOLE_CHUNK_TOKENS]
        assert [first, second] == [plain_tokens, plain_tokens]

        (SHM_DIR / shm).unlink(missing_ok=True)  # the next engine finds only the SSD tier
        restarted = in_process_server(model, config, log_path=tmp_path / "vllm-2.log")
        with restarted:
            restarted.start()
            after = greedy(restarted, prompt)
        activity = LMCacheActivity.from_log(restarted.log_path.read_text(errors="replace"))
        assert activity.hit_tokens[-1:] == [WHOLE_CHUNK_TOKENS]
        assert activity.retrieved_tokens == [WHOLE_CHUNK_TOKENS]
        assert after == plain_tokens
    finally:
        (SHM_DIR / shm).unlink(missing_ok=True)
