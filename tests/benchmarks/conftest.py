"""Benchmark tests run LMCache in this process: keep its per-chunk log lines quiet, and restore the
environment afterwards (``kvshrink bench`` sets LMCACHE_LOG_LEVEL for itself; servers started by later
tests must not inherit it)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def quiet_lmcache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_LOG_LEVEL", "ERROR")
