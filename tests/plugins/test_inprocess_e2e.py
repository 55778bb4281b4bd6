"""End to end: vLLM CPU + KVShrink's LMCache connector (kv_connector_module_path), real SmolLM2, real LMCache.

A ~2K-token prompt (tests/conftest.py) is sent twice; LMCache's own log lines must show the first
request stored and the second retrieved whole chunks, and the greedy tokens must equal plain
vLLM's, token for token.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import yaml

from kvshrink.testing.inprocess import (
    DEFAULT_CONFIG,
    LMCacheActivity,
    greedy_token_ids,
    in_process_server,
)
from kvshrink.testing.polling import poll_until

pytestmark = pytest.mark.e2e

CHUNK = 256


def _serve_twice(server, prompt: list[int]) -> tuple[list[list[int]], list[LMCacheActivity]]:
    outputs, activity = [], []
    with server:
        server.start()
        for _ in range(2):
            outputs.append(greedy_token_ids(server.url, server.served_model_name, prompt))
            activity.append(LMCacheActivity.from_log(server.log_path.read_text(errors="replace")))
    return outputs, activity


def _assert_stored_then_retrieved(activity: list[LMCacheActivity], whole_chunk_tokens: int) -> None:
    first, second = activity
    assert first.hit_tokens == [0] and first.retrieved_tokens == []
    assert first.stored_tokens == [whole_chunk_tokens]
    assert second.hit_tokens == [0, whole_chunk_tokens]
    assert second.retrieved_tokens == [whole_chunk_tokens]


def _chunk_files(directory: Path, count: int, timeout: float = 60.0) -> list[Path]:
    """LMCache's chunk files under ``directory`` once there are ``count``, or those there at the timeout."""
    def files() -> list[Path]:
        return sorted(directory.rglob("*.pt"))

    with contextlib.suppress(TimeoutError):
        poll_until(lambda: len(files()) >= count, timeout, interval=0.5)
    return files()


def test_second_request_is_served_from_lmcache_and_stores_the_models_kv(model, prompt, plain_tokens, tmp_path) -> None:
    """The second request is served from LMCache and both equal plain vLLM's output, with
    PYTHONHASHSEED unset (the plugin seeds vLLM's processes; the seeded path is the storage plugin's
    e2e test). LMCache's disk copy is checked against the K and V that Hugging Face transformers
    computes for the same tokens (the real-KV fixture): only a connector that reads vLLM CPU's
    packed pages correctly stores the model's KV."""
    from kvshrink.testing.fixtures.real_kv import real_kv

    disk = tmp_path / "lmcache-disk"
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config.update({"local_disk": f"file://{disk}/", "max_local_disk_size": 1.0})
    config_file = tmp_path / "lmcache.yaml"
    config_file.write_text(yaml.safe_dump(config))

    server = in_process_server(model, config_file, seed=None, log_path=tmp_path / "vllm.log")
    assert "PYTHONHASHSEED" not in server.env
    outputs, activity = _serve_twice(server, prompt)
    log = server.log_path.read_text(errors="replace")
    assert "engine uses the KVShrink CPU connector" in log
    assert "CPU connector bound to 30 KV layers" in log
    assert "PYTHONHASHSEED was unset" in log
    whole = len(prompt) // CHUNK * CHUNK  # LMCache keeps whole chunks only
    _assert_stored_then_retrieved(activity, whole)
    assert outputs == [plain_tokens, plain_tokens]

    reference = real_kv("code", whole).view(np.uint16)  # [2, 30, whole, 192] bf16 bits
    chunks = [reference[:, :, i:i + CHUNK] for i in range(0, whole, CHUNK)]
    files = _chunk_files(disk, len(chunks))
    assert len(files) == len(chunks)
    matched = []
    for path in files:
        stored = np.fromfile(path, dtype=np.uint16)
        assert stored.size == chunks[0].size, f"{path.name}: {stored.size} values"
        errors = [_relative_error(stored.reshape(chunks[0].shape), chunk) for chunk in chunks]
        best = int(np.argmin(errors))
        print(f"{path.name[-24:]}: chunk {best}, relative L2 error vs transformers {errors[best]:.4f}")
        assert errors[best] < 0.05
        matched.append(best)
    assert sorted(matched) == list(range(len(chunks)))


def _relative_error(bf16_bits: np.ndarray, reference_bits: np.ndarray) -> float:
    def as_float(bits: np.ndarray) -> np.ndarray:
        return (bits.astype(np.uint32) << 16).view(np.float32)

    a, b = as_float(bf16_bits), as_float(reference_bits)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
