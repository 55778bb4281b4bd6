"""Fixtures shared by every test area: real KV chunks, private shared-memory names, redis-server
(standalone and a Redis Cluster), and the end-to-end prompt with plain vLLM's answer to it."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Iterator, TypeVar

import numpy as np
import pytest

from kvshrink.testing.launch import RedisClusterServer, RedisServer
from kvshrink.store.dram import SHM_DIR


@pytest.fixture(scope="session")
def small_chunks() -> list[np.ndarray]:
    """16 real SmolLM2 KV chunks of 64 tokens ([2, 30, 64, 192] bf16 as uint16, 1.4 MiB each):
    8 of source code, then 8 of prose."""
    from kvshrink.testing.fixtures.real_kv import real_kv

    chunks = []
    for corpus in ("code", "prose"):
        kv = real_kv(corpus, 512)
        chunks += [np.ascontiguousarray(kv[:, :, i * 64 : (i + 1) * 64]) for i in range(8)]
    return chunks


@pytest.fixture(scope="session")
def real_chunks() -> list[np.ndarray]:
    """8 real 256-token chunks ([2, 30, 256, 192], 5.9 MB each), LMCache's default chunk size."""
    from kvshrink.testing.fixtures.real_kv import real_kv_chunks

    return real_kv_chunks(8, 256)


@pytest.fixture
def shm_name() -> Iterator[str]:
    """A fresh /dev/shm name; every arena named after it (``<name>``, ``<name>-<suffix>``) is
    removed after the test, whatever the test did."""
    name = f"kvshrink-test-{uuid.uuid4().hex[:12]}"
    yield name
    for path in SHM_DIR.glob(f"{name}*"):
        path.unlink(missing_ok=True)


Redis = TypeVar("Redis", RedisServer, RedisClusterServer)


def _running(server: Redis, *programs: str) -> Iterator[Redis]:
    """``server`` started, then killed at teardown; the test is skipped when ``programs`` are not
    installed."""
    missing = [p for p in programs if shutil.which(p) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (scripts/setup.sh installs the redis-server and "
                    "redis-tools packages)")
    yield server.start()
    server.kill()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server for one test (it may kill, pause and restart it)."""
    yield from _running(RedisServer(tmp_path), "redis-server")


@pytest.fixture(scope="module")
def shared_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for a module of tests that do not disturb it (each uses its own namespace)."""
    yield from _running(RedisServer(tmp_path_factory.mktemp("redis")), "redis-server")


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterServer]:
    """A private 3-master Redis Cluster on loopback for one test (it may kill, pause and restart
    masters)."""
    yield from _running(RedisClusterServer(tmp_path), "redis-server", "redis-cli")


@pytest.fixture(scope="module")
def shared_redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServer]:
    """One 3-master Redis Cluster for a module of tests that do not disturb it."""
    yield from _running(RedisClusterServer(tmp_path_factory.mktemp("redis-cluster")), "redis-server", "redis-cli")


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


# -- end-to-end fixtures (real vLLM CPU), shared by the e2e modules -----------------------------------
E2E_PROMPT_TOKENS = 2200  # 8 whole 256-token chunks + a tail; over vLLM CPU's 2048-token prefill step


@pytest.fixture(scope="session")
def model() -> Path:
    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    return ensure_checkpoint()


@pytest.fixture(scope="session")
def prompt() -> list[int]:
    """~2K token ids of real text, the "code" corpus of the real-KV fixture."""
    from kvshrink.testing.inprocess import prompt_token_ids

    return prompt_token_ids(E2E_PROMPT_TOKENS)


@pytest.fixture(scope="session")
def plain_tokens(model: Path, prompt: list[int]) -> list[int]:
    """Greedy output of vLLM without any KV connector: the reference every cached run must equal.
    One plain vLLM for the whole session (a start and a cold prefill: minutes on CI)."""
    from kvshrink.testing.inprocess import greedy_token_ids
    from kvshrink.testing.launch import VLLMServer

    with VLLMServer(model) as server:
        server.start()
        return greedy_token_ids(server.url, server.served_model_name, prompt)
