"""vLLM plugin: LMCache's in-process connector on vLLM CPU, patched in when LMCache loads.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), possibly
more than once. It must not import LMCache: LMCache's import pulls in modules that vLLM CPU's
worker start-up then trips over (``register_triton_kernel_overrides`` scans loaded modules). So it
installs an import hook, which acts when LMCache's modules are first imported:

- ``lmcache.v1.gpu_connector``: on a CPU device, its ``CreateGPUConnector`` is replaced by one that
  returns :class:`~kvshrink.plugins.cpu_connector.VLLMPagedMemCPUConnector` for vLLM and defers
  to LMCache's own function for every other engine. LMCache's vLLM integration looks the function
  up on that module when it creates its engine, so the replacement is all it takes. If the module
  no longer looks like the one this was written for, the import fails with
  :class:`LMCacheCompatibilityError` naming the LMCache version instead of running half-patched.
- ``lmcache.integration.vllm.vllm_v1_adapter`` (imported when an in-process LMCache connector is
  created in this process, on any device): refuse an unseeded hash. :func:`register` also seeds
  the processes vLLM starts when ``LMCACHE_CONFIG_FILE`` is set; see :mod:`kvshrink.plugins.hash_seed`.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from kvshrink.errors import KVShrinkError
from kvshrink.plugins.hash_seed import check_process_hash_seed, process_hash_is_seeded, seed_children

logger = logging.getLogger(__name__)

GPU_CONNECTOR_MODULE = "lmcache.v1.gpu_connector"
IN_PROCESS_ADAPTER_MODULE = "lmcache.integration.vllm.vllm_v1_adapter"
TESTED_LMCACHE_VERSION = "0.5.6"
CREATE_PARAMS = ("config", "metadata", "engine", "layout_hints")
_PATCH_MARK = "__kvshrink_cpu_connector__"


class LMCacheCompatibilityError(KVShrinkError, RuntimeError):
    """LMCache's internals that the CPU connector patch relies on are not what it was written for."""


def register() -> None:
    """``vllm.general_plugins`` entry point. Idempotent; imports neither LMCache nor torch."""
    _log_through_vllm()
    seed_children()
    install_import_hook()


# --------------------------------------------------------------------------------------- import hook

def install_import_hook() -> None:
    """Act on LMCache's modules now if they are loaded, else when each is first imported."""
    for name, action in _ON_IMPORT.items():
        module = sys.modules.get(name)
        if module is not None:
            action(module)
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the watched LMCache modules with the other finders and wraps their loaders."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None):
        action = _ON_IMPORT.get(fullname)
        if action is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, action)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then acts on the freshly executed module."""

    def __init__(self, loader: importlib.abc.Loader, action: Callable[[ModuleType], object]) -> None:
        self._loader = loader
        self._action = action

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._action(module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self._loader, name)


def _lmcache_version() -> str:
    lmcache = sys.modules.get("lmcache")
    return str(getattr(lmcache, "__version__", "unknown"))


def _incompatible(what: str) -> LMCacheCompatibilityError:
    return LMCacheCompatibilityError(
        f"cannot install KVShrink's CPU connector into LMCache {_lmcache_version()} (written against "
        f"{TESTED_LMCACHE_VERSION}): {what}. Upgrade kvshrink, pin lmcache=={TESTED_LMCACHE_VERSION}, or "
        "leave 'kvshrink' out of VLLM_PLUGINS")


def patch_gpu_connector_module(module: ModuleType) -> bool:
    """Replace ``module.CreateGPUConnector`` for CPU devices; True if patched now or before."""
    device_type = getattr(module, "torch_device_type", None)
    if device_type != "cpu":
        logger.debug("LMCache runs on %r: its own connectors apply, nothing patched", device_type)
        return False
    original = getattr(module, "CreateGPUConnector", None)
    if original is None:
        raise _incompatible(f"{GPU_CONNECTOR_MODULE}.CreateGPUConnector is missing")
    if getattr(original, _PATCH_MARK, False):
        return True
    params = tuple(inspect.signature(original).parameters)
    if params != CREATE_PARAMS:
        raise _incompatible(f"CreateGPUConnector{params} no longer takes {CREATE_PARAMS}")
    engine_type = getattr(module, "EngineType", None)
    if engine_type is None or not hasattr(engine_type, "VLLM"):
        raise _incompatible(f"{GPU_CONNECTOR_MODULE}.EngineType.VLLM is missing")
    if _lmcache_version() != TESTED_LMCACHE_VERSION:
        logger.warning("LMCache %s: KVShrink's CPU connector was tested with %s", _lmcache_version(),
                       TESTED_LMCACHE_VERSION)
    module.CreateGPUConnector = _cpu_aware(original, module)
    logger.info("KVShrink CPU connector installed into LMCache %s (pid %d)", _lmcache_version(), os.getpid())
    return True


def _cpu_aware(original: Callable[..., Any], module: ModuleType) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_gpu_connector(config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> Any:
        if module.torch_device_type != "cpu" or engine != module.EngineType.VLLM:
            return original(config, metadata, engine, layout_hints)
        from kvshrink.plugins.cpu_connector import create_cpu_connector

        return create_cpu_connector(config, metadata, layout_hints)

    setattr(create_gpu_connector, _PATCH_MARK, True)
    return create_gpu_connector


def guard_hash_seed(adapter_module: ModuleType) -> None:
    """An in-process LMCache connector is being created here: its chunk keys must be reproducible."""
    if process_hash_is_seeded():
        return
    utils = sys.modules.get("lmcache.integration.vllm.utils")
    get_config = getattr(utils, "lmcache_get_or_create_config", None)
    algorithm = getattr(get_config(), "pre_caching_hash_algorithm", "builtin") if get_config else "builtin"
    check_process_hash_seed(algorithm)


_ON_IMPORT: dict[str, Callable[[ModuleType], object]] = {
    GPU_CONNECTOR_MODULE: patch_gpu_connector_module,
    IN_PROCESS_ADAPTER_MODULE: guard_hash_seed,
}


def _log_through_vllm() -> None:
    """Send our log lines to vLLM's handlers so they land in the server log next to LMCache's."""
    ours = logging.getLogger("kvshrink")
    vllm_logger = logging.getLogger("vllm")
    if ours.handlers or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False
