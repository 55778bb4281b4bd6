"""KV Fuse's ``lmcache server --server-module``: the RPC handlers that fuse on lookup.

Loaded by ``kvshrink cache serve`` from the ``fuse`` section of its YAML, or by hand::

    lmcache server ... --supported-transfer-mode auto --l2-adapter '{... KVShrinkL2Adapter ...}'
        --server-module '{"module_path": "kvshrink.storage_backends.kv_fuse.server_module",
                          "config": {"enabled": true, "model_path": "<checkpoint vLLM serves>"}}'

(``config`` takes the keys of :class:`~.settings.FuseModuleSettings`). Its RPC handlers register
after LMCache's built-ins and replace the same-named ones; each delegates to the built-in it
replaces, with the same name, types and scheduling:

* ``commit_store`` (the engine-driven store path vLLM CPU uses): after the built-in stored the
  chunks, each stored full chunk joins the tenant's index of fusion sources (:mod:`.stored_chunks`).
* ``lookup``: a request opts into fusion by its ``cache_salt``: a client that wants fusion sends
  :func:`~kvshrink.fuse.keys.fused_salt` ``(settings, own_salt)`` (``kvfuse1-r0150-c1`` for the
  defaults and no salt of its own). Every other lookup is the built-in, untouched. For a fused salt
  the lookup is acknowledged at once and a fusion job is queued (:mod:`.job_queue`, :mod:`.fusion`);
  the job then calls the built-in lookup, which finds a prefix hit that vLLM loads.
* ``register_kv_cache_engine_driven_context``: the built-in, remembering vLLM's paged block size
  (:mod:`.chunk_layouts`). Reading vLLM CPU's chunks needs vLLM CPU importable in the cache
  server's process and the server on vLLM's host (the same ISA).
* ``query_prefetch_status`` / ``wait_prefetch_status`` answer "still running" while a request's
  fusion job runs (vLLM's scheduler polls without blocking and retries), then delegate;
  ``end_session`` of a request whose job still runs makes the job skip its built-in lookup.

Switching: ``enabled: false`` (the default) makes the factory return no module: every handler is
LMCache's own, byte for byte. Enabled, requests without a fused salt are stock too, and fused
chunks live only under fused salts (:mod:`kvshrink.fuse.keys`), so they can be counted and evicted
on their own. Only ``world_size`` 1 and one object group are fused (others fall back).

Threads: LMCache's worker threads run the handlers; fusion jobs run one at a time on the module's
thread. Errors: a failed job is logged and counted (``/status``, ``kvshrink_fuse``; ``/metrics``,
``kvshrink_fuse_*``: :mod:`.outcomes`), never raised into LMCache; the built-in lookup still runs.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from lmcache.v1.multiprocess.custom_types import (IPCCacheServerKey, RegisterEngineDrivenContextPayload,
                                                  RegisterEngineDrivenContextResponse)
from lmcache.v1.multiprocess.request_handler import HandlerType, request_handler

from kvshrink.errors import ConfigError
from kvshrink.fuse.keys import base_salt_of, fused_salt, is_fused_salt

from .chunk_io import ChunkIO
from .chunk_layouts import ChunkLayouts
from .fusion import Fusion
from .job_queue import FusionJobQueue
from .outcomes import FuseCollector, FuseStats
from .settings import FuseModuleSettings
from .stored_chunks import StoredChunkIndex

if TYPE_CHECKING:
    from lmcache.v1.multiprocess.ext_server_module import ExtServerModuleBuildContext

    from kvshrink.fuse.engine import FuseEngine

log = logging.getLogger(__name__)


class KVFuseModule:
    """The server module. ``lookup_module`` / ``transfer_module`` are LMCache's built-in
    ``LookupModule`` and ``EngineDrivenTransferModule`` (borrowed, owned by the server); ``engine``
    is owned here and used by the fusion thread only. Handlers may run on any LMCache thread."""

    def __init__(self, ctx: Any, lookup_module: Any, transfer_module: Any, settings: FuseModuleSettings,
                 engine: "FuseEngine") -> None:
        self._ctx = ctx
        self._lookup = lookup_module
        self._transfer = transfer_module
        self.settings = settings
        self.engine = engine
        self.stats = FuseStats()
        self.layouts = ChunkLayouts(engine, ctx)
        self.sources = StoredChunkIndex(settings.anchor, settings.max_indexed_chunks, self.stats)
        fusion = Fusion(ctx, engine, settings, self.layouts, self.sources, ChunkIO(ctx), self.stats)
        self.jobs = FusionJobQueue(fusion.run, lookup_module, self.stats, settings.max_pending, settings.timeout_s)
        self._salt_tag = fused_salt(settings.fuse)
        self._collector = _export(FuseCollector(self.stats, lambda: len(self.sources), lambda: len(self.jobs)))

    # -- EngineModule -------------------------------------------------------------------------------
    @property
    def context(self) -> Any:
        return self._ctx

    @property
    def last_fallback(self) -> dict[str, Any]:
        """Why the last request fell back (request id, reason, detail)."""
        return self.stats.last_fallback

    def report_status(self) -> dict:
        return {"kvshrink_fuse": {"salt": self._salt_tag, "ratio": self.settings.ratio,
                                  "check_layer": self.settings.check_layer, **self.stats.snapshot(),
                                  "indexed_chunks": len(self.sources), "pending": len(self.jobs),
                                  "layouts": self.layouts.names()}}

    def close(self) -> None:
        if self._collector is not None:
            from prometheus_client import REGISTRY

            REGISTRY.unregister(self._collector)
            self._collector = None
        self.jobs.close()

    # -- handlers (same names, types and scheduling as the built-ins they replace) ------------------
    @request_handler()
    def register_kv_cache_engine_driven_context(
            self, payload: RegisterEngineDrivenContextPayload) -> RegisterEngineDrivenContextResponse:
        """The built-in registration; the engine's paged block size is remembered (vLLM CPU's chunk
        layout depends on it)."""
        self.layouts.register_block_size(payload.model_name, payload.world_size, payload.block_size)
        return self._transfer.register_kv_cache_engine_driven_context(payload)

    @request_handler(HandlerType.BLOCKING, requires_client_affinity=True)
    def commit_store(self, key: IPCCacheServerKey, instance_id: int, cpu_data: bytes) -> bool:
        """The built-in store, then the stored chunks join the content index."""
        stored = self._transfer.commit_store(key, instance_id, cpu_data)
        if stored and key.world_size == 1:
            size = self._ctx.chunk_size
            try:
                self.sources.add_stored(key.model_name, base_salt_of(key.cache_salt), key.request_id,
                                        self._ctx.resolve_obj_keys(key, [0])[0], key.token_ids, key.start // size, size)
            except Exception:  # noqa: BLE001 - indexing is an optimization; the store succeeded
                log.exception("KV Fuse: indexing the chunks of %s failed", key.request_id)
        return stored

    @request_handler(HandlerType.BLOCKING)
    def lookup(self, key: IPCCacheServerKey, tp_size: int) -> None:
        """Stock for every salt but the fused one; for that, queue a fusion job and return."""
        salt = key.cache_salt
        if not is_fused_salt(salt):
            return self._lookup.lookup(key, tp_size)
        self.stats.add(fused_salt_lookups=1)
        if salt != fused_salt(self.settings.fuse, base_salt_of(salt)):
            self.stats.add(foreign_salt=1)  # made with other settings: never answered with ours
            return self._lookup.lookup(key, tp_size)
        started = self.jobs.start(key, tp_size)
        if started == "busy":
            self.stats.add(fallback_busy=1)
            return self._lookup.lookup(key, tp_size)
        return None  # "started" / "pending": the job calls the built-in lookup itself

    @request_handler(HandlerType.BLOCKING)
    def query_prefetch_status(self, request_id: str) -> int | None:
        if self.jobs.running(request_id):
            return None  # still fusing: the scheduler polls again
        return self._lookup.query_prefetch_status(request_id)

    @request_handler(HandlerType.BLOCKING)
    def wait_prefetch_status(self, request_id: str, timeout: float) -> int | None:
        start = time.monotonic()
        if not self.jobs.wait(request_id, timeout):
            return None
        return self._lookup.wait_prefetch_status(request_id, max(0.0, timeout - (time.monotonic() - start)))

    @request_handler(HandlerType.BLOCKING)
    def end_session(self, request_id: str) -> None:
        self.jobs.cancel(request_id)
        self.sources.end_request(request_id)
        return self._lookup.end_session(request_id)


def _export(collector: FuseCollector) -> FuseCollector | None:
    """``collector`` registered in prometheus_client's default registry (served on ``/metrics``),
    or None when another KV Fuse module of this process holds the names (logged)."""
    from prometheus_client import REGISTRY

    try:
        REGISTRY.register(collector)
    except ValueError as exc:
        log.info("KV Fuse: counters not exported to Prometheus: %s", exc)
        return None
    return collector


def build_server_modules(build: "ExtServerModuleBuildContext") -> KVFuseModule | None:
    """The ``--server-module`` factory LMCache calls. Disabled: no module, every handler stock."""
    settings = FuseModuleSettings.from_config(build.config)
    if not settings.enabled:
        log.info("KV Fuse is disabled (fuse.enabled: false): no handler replaced")
        return None
    from lmcache.v1.multiprocess.modules.engine_driven_transfer import EngineDrivenTransferModule
    from lmcache.v1.multiprocess.modules.lookup import LookupModule

    lookup = next((m for m in build.modules if isinstance(m, LookupModule)), None)
    transfer = next((m for m in build.modules if isinstance(m, EngineDrivenTransferModule)), None)
    if lookup is None or transfer is None:
        raise ConfigError("fuse.enabled", "needs LMCache's lookup and engine-driven transfer modules "
                                          "(lmcache server --supported-transfer-mode engine_driven or auto)")
    import torch

    from kvshrink.fuse.engine import FuseEngine

    if settings.threads:
        torch.set_num_threads(settings.threads)
    assert settings.model_path is not None  # from_config requires it when enabled
    engine = FuseEngine.from_pretrained(settings.model_path)
    log.info("KV Fuse enabled: requests with cache_salt %s are fused (ratio %.3f, check layer %d)",
             fused_salt(settings.fuse), settings.ratio, settings.check_layer)
    return KVFuseModule(build.server_context, lookup, transfer, settings, engine)
