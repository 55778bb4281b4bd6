"""Fixtures of the index tests: real index services on free loopback ports, stopped at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from kvshrink.index.config import IndexConfig
from kvshrink.index.server import IndexServer


@pytest.fixture
def start_index() -> Iterator[Callable[[IndexConfig], IndexServer]]:
    servers: list[IndexServer] = []

    def start(config: IndexConfig) -> IndexServer:
        server = IndexServer(config).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10.0) as client:
        yield client
