"""vLLM KV connector: LMCache's in-process connector, with KVShrink's CPU connector on vLLM CPU.

vLLM loads it by module path (``KVConnectorFactory``: ``kv_connector`` names the class,
``kv_connector_module_path`` the module)::

    --kv-transfer-config '{"kv_connector": "KVShrinkLMCacheConnector",
                           "kv_connector_module_path": "kvshrink.plugins.vllm.lmcache_cpu_connector",
                           "kv_role": "kv_both"}'

:class:`KVShrinkLMCacheConnector` *is* vLLM's ``LMCacheConnectorV1`` (a subclass; every scheduler-
and worker-side method is vLLM's), which runs LMCache's in-process engine. It adds two things:

- On a CPU device, LMCache's worker engine gets
  :class:`~kvshrink.plugins.vllm.cpu_connector.VLLMPagedMemCPUConnector` (LMCache ships none for CPU).
  On every other device LMCache's own connectors apply and this class adds nothing but the check below.
- In every role: a process whose ``hash()`` is unseeded is refused (:mod:`kvshrink.plugins.vllm.hash_seed`).

How the CPU connector gets in, and why this way. LMCache builds the engine deep inside the base
constructor: ``LMCacheConnectorV1.__init__`` → ``LMCacheConnectorV1Impl.__init__`` → a
``VllmServiceFactory`` (a module global of ``vllm_v1_adapter``) → ``LMCacheManager`` →
``VllmServiceFactory.get_or_create_lmcache_engine``, which imports ``CreateGPUConnector`` from
``lmcache.v1.gpu_connector`` *when it runs* and calls it. No object in that chain is ours to
subclass, and ``CreateGPUConnector`` is LMCache's per-device dispatch, the very thing a new device
extends. So, in a worker on CPU and only while ``super().__init__()`` runs in this thread, that one
module attribute is replaced by a function that answers ``EngineType.VLLM`` with our connector and
hands every other call to LMCache's; it is restored in ``finally``. The result is then checked, not
assumed: if the engine LMCache built does not hold our connector (LMCache changed how it picks one,
or gave up and went to its "degraded mode"), construction fails with :class:`LMCacheCompatibilityError`
— or with our connector's own error (e.g. :class:`~kvshrink.errors.ConfigError` for
``use_layerwise``), which LMCache's manager would otherwise only log. Rejected: registering a
pre-built engine under LMCache's engine name (its factory reuses one) — that copies LMCache's
config, extra-config, metadata and broadcast steps, which could drift from LMCache's silently.

LMCache (and torch) are imported only in ``__init__``, as vLLM's own ``LMCacheConnectorV1`` does:
vLLM resolves the connector class early (e.g. ``get_kv_connector_cache_layout``), and vLLM CPU's
workers trip over LMCache modules loaded before their start-up.

Threads: construction is one call on the thread vLLM builds connectors on; the substitution is
held under a process-wide lock, so two connectors built at once in one process serialize. Errors:
:class:`LMCacheCompatibilityError` (a :class:`~kvshrink.errors.KVShrinkError`),
:class:`~kvshrink.plugins.vllm.hash_seed.HashSeedError`, :class:`~kvshrink.errors.ConfigError` and
:class:`~kvshrink.plugins.vllm.cpu_kv_layout.KVLayoutError`, all raised from the constructor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

from kvshrink.errors import ConfigError, KVShrinkError
from kvshrink.plugins.vllm.hash_seed import check_process_hash_seed, process_hash_is_seeded
from kvshrink.plugins.vllm.vllm_plugin import log_through_vllm

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

GPU_CONNECTOR_MODULE = "lmcache.v1.gpu_connector"

_SUBSTITUTION_LOCK = threading.Lock()


class LMCacheCompatibilityError(KVShrinkError, RuntimeError):
    """LMCache did not build its engine the way this connector relies on (its internals changed)."""


class KVShrinkLMCacheConnector(LMCacheConnectorV1):
    """vLLM's ``LMCacheConnectorV1`` whose LMCache engine, on CPU, moves KV with our CPU connector."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        import lmcache
        from lmcache.integration.vllm.utils import lmcache_get_or_create_config

        log_through_vllm()  # also when VLLM_PLUGINS leaves our plugin out
        if not process_hash_is_seeded():
            check_process_hash_seed(getattr(lmcache_get_or_create_config(), "pre_caching_hash_algorithm", "builtin"))
        device_type = getattr(lmcache, "torch_device_type", None)
        if role != KVConnectorRole.WORKER or device_type != "cpu":
            super().__init__(vllm_config, role, kv_cache_config)
            return
        if vllm_config.kv_transfer_config.get_from_extra_config("use_native", False):
            raise ConfigError("kv_connector_extra_config.use_native",
                              "vLLM's bundled LMCache integration has no CPU connector; leave it unset")
        with _cpu_connector_for_vllm() as failures:
            super().__init__(vllm_config, role, kv_cache_config)
        self._check_engine(failures)

    def _check_engine(self, failures: list[BaseException]) -> None:
        """Raise unless the engine LMCache built holds our CPU connector."""
        from kvshrink.plugins.vllm.cpu_connector import VLLMPagedMemCPUConnector

        engine = getattr(self._lmcache_engine, "lmcache_engine", None)
        connector = getattr(engine, "gpu_connector", None)
        if isinstance(connector, VLLMPagedMemCPUConnector):
            logger.info("LMCache %s's engine uses the KVShrink CPU connector (pid %d)", _lmcache_version(), os.getpid())
            return
        if failures:
            raise failures[0]
        raise LMCacheCompatibilityError(
            f"LMCache {_lmcache_version()} built its vLLM engine with {type(connector).__name__ if engine else 'no engine'}"
            f" instead of KVShrink's CPU connector ({GPU_CONNECTOR_MODULE}.CreateGPUConnector was "
            "not called as expected, or LMCache logged why it failed above); kvshrink is tested with "
            "lmcache==0.5.6")


@contextlib.contextmanager
def _cpu_connector_for_vllm() -> Iterator[list[BaseException]]:
    """Within the block, LMCache's ``CreateGPUConnector`` answers vLLM with our CPU connector.

    Yields the list of errors our connector raised (LMCache's manager catches them and only logs).
    """
    import lmcache.v1.gpu_connector as module

    original = getattr(module, "CreateGPUConnector", None)
    engine_types = getattr(module, "EngineType", None)
    if original is None or not hasattr(engine_types, "VLLM"):
        raise LMCacheCompatibilityError(f"LMCache {_lmcache_version()}: {GPU_CONNECTOR_MODULE} has no "
                                        "CreateGPUConnector / EngineType.VLLM")
    failures: list[BaseException] = []
    with _SUBSTITUTION_LOCK:
        module.CreateGPUConnector = _for_vllm_on_cpu(original, engine_types.VLLM, failures)
        try:
            yield failures
        finally:
            module.CreateGPUConnector = original


def _for_vllm_on_cpu(original: Callable[..., Any], vllm_engine: Any,
                     failures: list[BaseException]) -> Callable[..., Any]:
    def create_gpu_connector(config: Any, metadata: Any, engine: Any, *args: Any, **kwargs: Any) -> Any:
        if engine != vllm_engine:
            return original(config, metadata, engine, *args, **kwargs)
        from kvshrink.plugins.vllm.cpu_connector import create_cpu_connector

        layout_hints = kwargs.get("layout_hints", args[0] if args else None)
        try:
            return create_cpu_connector(config, metadata, layout_hints)
        except Exception as exc:
            failures.append(exc)
            raise

    create_gpu_connector.__name__ = create_gpu_connector.__qualname__ = "CreateGPUConnector"
    return create_gpu_connector


def _lmcache_version() -> str:
    import lmcache

    return str(getattr(lmcache, "__version__", "unknown"))
