"""Fixtures of the cascade tests: the real SmolLM2 condenser (loaded once per session), the vLLM
stand-in and the proxy, both served over loopback HTTP, and one real vLLM for the e2e tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvshrink.cascade.cache import CondensationCache
from kvshrink.cascade.condenser import Condenser, CondenserConfig
from kvshrink.cascade.proxy import ProxyConfig, create_app
from kvshrink.cascade.service import CondenseService
from kvshrink.benchmarks.e2e_paired import ENGINE_ARGS
from kvshrink.testing.launch import VLLMServer

from cascade_servers import Upstream, serving, upstream_app

MODEL = "smollm2"


@pytest.fixture(scope="session")
def checkpoint() -> Path:
    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    return ensure_checkpoint()


@pytest.fixture(scope="session")
def vllm(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """One real vLLM CPU server for every e2e test of the cascade (a start costs minutes on 2 cores),
    serving the checkpoint as MODEL with the benchmarks' engine arguments."""
    server = VLLMServer(checkpoint, served_model_name=MODEL, max_model_len=4096, kv_cache_space_gb=1,
                        extra_args=ENGINE_ARGS, log_path=tmp_path_factory.mktemp("vllm") / "vllm.log")
    try:
        yield server.start(timeout=600)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def condenser(checkpoint: Path) -> Condenser:
    """Small windows, so that a few hundred tokens already make several windows."""
    return Condenser(CondenserConfig(model_path=str(checkpoint), window_tokens=256, overlap_tokens=32,
                                     min_document_tokens=16, max_batch_tokens=2048))


@pytest.fixture
def service(condenser: Condenser) -> Iterator[CondenseService]:
    service = CondenseService(condenser, CondensationCache())
    yield service
    service.close()


@pytest.fixture
def upstream() -> Iterator[tuple[Upstream, str]]:
    state = Upstream()
    with serving(upstream_app(state)) as url:
        yield state, url
    for event in state.release:  # never leave the stand-in's stream waiting
        event.set()


@pytest.fixture
def proxy(upstream: tuple[Upstream, str], service: CondenseService) -> Iterator[Callable[..., str]]:
    """Start the proxy in front of the stand-in (ProxyConfig keywords as given); its URL."""
    stack: list = []

    def start(upstream_url: str = upstream[1], **overrides: object) -> str:
        context = serving(create_app(ProxyConfig(upstream_url, **overrides), service))
        stack.append(context)
        return context.__enter__()

    yield start
    for context in reversed(stack):
        context.__exit__(None, None, None)
