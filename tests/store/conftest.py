"""Fixtures for the store tests: real KV chunks, unique shared-memory names, real redis-server."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from kvshrink.store.dram import SHM_DIR


@pytest.fixture(scope="session")
def small_chunks() -> list[np.ndarray]:
    """16 real SmolLM2 KV chunks of 64 tokens ([2, 30, 64, 192] bf16 as uint16, 1.4 MiB each)."""
    from kvshrink.fixtures.real_kv import real_kv

    chunks = []
    for corpus in ("code", "prose"):
        kv = real_kv(corpus, 512)
        chunks += [np.ascontiguousarray(kv[:, :, i * 64 : (i + 1) * 64]) for i in range(8)]
    return chunks


@pytest.fixture(scope="session")
def real_chunks() -> list[np.ndarray]:
    """8 real 256-token chunks ([2, 30, 256, 192], 5.9 MB each), LMCache's default chunk size."""
    from kvshrink.fixtures.real_kv import real_kv_chunks

    return real_kv_chunks(8, 256)


@pytest.fixture
def shm_name() -> Iterator[str]:
    """A fresh /dev/shm name; every arena named after it (``<name>``, ``<name>-<suffix>``) is
    removed after the test, whatever the test did."""
    name = f"kvshrink-test-{uuid.uuid4().hex[:12]}"
    yield name
    for path in SHM_DIR.glob(f"{name}*"):
        path.unlink(missing_ok=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """A real redis-server on a random loopback port, with an append-only file fsync'ed on every
    write, so ``kill9()`` + ``start()`` behaves like a crashed and restarted production server."""

    def __init__(self, workdir: Path) -> None:
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed (scripts/setup.sh installs it)")
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
             "--appendfsync", "always", "--dir", str(self.workdir), "--maxmemory", "512mb",
             "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.kill9()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the server accepts connections but never answers (a hung Redis)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    """A private redis-server for one test (it may kill and restart it)."""
    server = RedisProcess(tmp_path)
    yield server
    server.kill9()


@pytest.fixture(scope="module")
def shared_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """One redis-server for a module of tests that do not disturb it (each uses its own namespace)."""
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    yield server
    server.kill9()
