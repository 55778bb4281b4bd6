"""Fixtures for the LMCache plugin tests: real KV chunks, private store locations, redis-server."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from l2_harness import SHM_DIR, dram_ssd_store, free_port


@pytest.fixture(scope="session")
def small_chunks() -> list[np.ndarray]:
    """12 real SmolLM2 KV chunks of 64 tokens ([2, 30, 64, 192] bf16 as uint16, 1.4 MiB each)."""
    from kvshrink.fixtures.real_kv import real_kv

    chunks = []
    for corpus in ("code", "prose"):
        kv = real_kv(corpus, 512)
        chunks += [np.ascontiguousarray(kv[:, :, i * 64 : (i + 1) * 64]) for i in range(6)]
    return chunks


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = f"kvshrink-sbtest-{uuid.uuid4().hex[:12]}"
    yield name
    (SHM_DIR / name).unlink(missing_ok=True)


@pytest.fixture
def store_config(shm_name: str, tmp_path: Path) -> dict:
    return dram_ssd_store(shm_name, tmp_path / "ssd")


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A private redis-server on a random loopback port."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (scripts/setup.sh installs it)")
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {port}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


# -- end-to-end fixtures (real vLLM CPU), shared by the e2e modules -----------------------------------
E2E_PROMPT_TOKENS = 2200


@pytest.fixture(scope="session")
def model() -> Path:
    from kvshrink.fixtures.smollm2 import ensure_checkpoint

    return ensure_checkpoint()


@pytest.fixture(scope="session")
def prompt() -> list[int]:
    """~2K token ids of real text (8 whole 256-token chunks + a tail)."""
    from kvshrink.benchmarks.inprocess_cpu import prompt_token_ids

    return prompt_token_ids(E2E_PROMPT_TOKENS)


@pytest.fixture(scope="session")
def plain_tokens(model, prompt) -> list[int]:
    """Greedy output of vLLM without any KV connector: the reference every cached run must equal."""
    from kvshrink.launch import VLLMServer

    from l2_harness import greedy

    with VLLMServer(model) as server:
        server.start()
        return greedy(server, prompt)
