"""LMCache in-process storage plugin backed by the KVShrink tiered store.

Select it from an LMCache YAML (``LMCACHE_CONFIG_FILE``)::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 2            # > 0: read buffers are allocated from LocalCPUBackend
    storage_plugins: [kvshrink]
    extra_config:
      storage_plugin.kvshrink.module_path: kvshrink.storage_backends.inprocess_plugin
      storage_plugin.kvshrink.class_name: KVShrinkStoragePlugin
      kvshrink.config: store-default.yaml    # relative to this YAML's folder; or kvshrink.store: {tiers: [...]}

LMCache only logs a plugin whose constructor raises, and goes on without it; so a bad setting is
logged here at ERROR with the key to fix *and* raised, and ``Created dynamic backend: kvshrink``
in the log is the sign that it loaded.

Metrics: as LMCache's in-process engine does with its own ``lmcache:*`` metrics, the store's
(``kvshrink_store_*``, :mod:`kvshrink.store.metrics`) and the plugin's counters
(``kvshrink_plugin_<counter>_total``) go into prometheus_client's default registry of the process
the plugin runs in (vLLM's engine process). vLLM's ``/metrics`` shows them with LMCache's when
``PROMETHEUS_MULTIPROC_DIR`` is set for every vLLM process (LMCache's default folder is
``/tmp/lmcache_prometheus``; clear it between runs): the plugin then copies the scrape-time values
into that folder every :data:`MIRROR_INTERVAL_S` seconds. Without it, LMCache's internal API server
(``internal_api_server_enabled: true``; port ``internal_api_server_port_start`` + 1 + worker id)
serves them on its ``/metrics``. Names: ``docs/observability.md``.

Buffers and references: ``StorageManager.batched_put`` drops its reference to each object right
after ``batched_submit_put_task`` returns, so every object is ``ref_count_up``'d before the call
returns and released once the store has staged its copy. Objects returned by the get methods are
allocated from ``LocalCPUBackend`` and owned by the caller (one reference).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence

from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from kvshrink.errors import ConfigError, KVShrinkError
from kvshrink.storage_backends.keys import encode_engine_key
from kvshrink.storage_backends.memory_objs import chunk_tensor
from kvshrink.storage_backends.plugin_settings import PluginSettings
from kvshrink.storage_backends.store_setup import open_store, warm_codec
from kvshrink.store.metrics_export import MultiprocessMirror, SnapshotCollector, multiprocess_mode, register, unregister

if TYPE_CHECKING:
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryObj

log = logging.getLogger(__name__)

PLUGIN_COUNTERS = ("puts_submitted", "puts_skipped_format", "puts_failed", "allocation_failures", "get_errors")
MIRROR_INTERVAL_S = 5.0  # multiprocess mode: how often the scrape-time metrics are copied to files


class KVShrinkStoragePlugin(StoragePluginInterface):
    """``StoragePluginInterface`` over :class:`kvshrink.store.TieredStore`."""

    def __init__(self, config: Any = None, metadata: Any = None, local_cpu_backend: Any = None,
                 loop: Optional[asyncio.AbstractEventLoop] = None, dst_device: str = "cpu") -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        try:
            self._settings = PluginSettings.from_engine(config, metadata, local_cpu_backend)
            self._store = open_store(self._settings.store_source, self._settings.key_prefix,
                                     self._settings.source_key)
        except ConfigError as exc:  # LMCache would only log a one-liner and drop the plugin
            log.error("kvshrink storage plugin not created: %s", exc)
            raise
        try:
            warm_codec(self._store.config)
        except BaseException:
            self._store.close()
            raise
        # staging copies run here, off the engine's save path; one thread keeps puts in order
        self._submitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvshrink-put-submit")
        self._readers = ThreadPoolExecutor(max_workers=self._settings.read_workers,
                                           thread_name_prefix="kvshrink-get")
        self._submitting: set[bytes] = set()
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(PLUGIN_COUNTERS, 0)
        self._warned: set[str] = set()
        self._closed = False
        counters = SnapshotCollector("kvshrink_plugin", self._counts, PLUGIN_COUNTERS, what="in-process plugin")
        self._exported = [c for c in (self._store.metrics, counters) if register(c)]
        self._mirror = None
        if multiprocess_mode():  # collectors are not read there: copy their values into files
            self._mirror = MultiprocessMirror(lambda: [*self._store.metrics.collect_snapshot(), *counters.collect()],
                                              MIRROR_INTERVAL_S)
        log.info("kvshrink storage plugin ready: store %s, memory format %s",
                 self._settings.store_source, self._settings.memory_format.name)

    def __str__(self) -> str:
        return "KVShrinkStoragePlugin"

    # -- lookups ----------------------------------------------------------------------------------
    def contains(self, key: "CacheEngineKey", pin: bool = False) -> bool:
        store_key = encode_engine_key(key)
        if pin:
            return self._store.lock([store_key])[0]
        return self._store.contains(store_key)

    def batched_contains(self, keys: List["CacheEngineKey"], pin: bool = False) -> int:
        """Length of the prefix of ``keys`` the store holds (pinned when ``pin``)."""
        hits = 0
        for key in keys:
            if not self.contains(key, pin):
                break
            hits += 1
        return hits

    async def batched_async_contains(self, lookup_id: str, keys: List["CacheEngineKey"], pin: bool = False) -> int:
        # a Redis tier answers over the network: keep the storage manager's event loop free
        return await asyncio.get_running_loop().run_in_executor(self._readers, self.batched_contains, keys, pin)

    def exists_in_put_tasks(self, key: "CacheEngineKey") -> bool:
        store_key = encode_engine_key(key)
        with self._lock:
            if store_key in self._submitting:
                return True
        return self._store.in_flight(store_key)

    def pin(self, key: "CacheEngineKey") -> bool:
        return self._store.lock([encode_engine_key(key)])[0]

    def unpin(self, key: "CacheEngineKey") -> bool:
        self._store.unlock([encode_engine_key(key)])
        return True

    # -- puts -------------------------------------------------------------------------------------
    def batched_submit_put_task(self, keys: Sequence["CacheEngineKey"], objs: List["MemoryObj"],
                                transfer_spec: Any = None,
                                on_complete_callback: Optional[Callable[["CacheEngineKey"], None]] = None) -> None:
        """Queue the chunks for the store and return at once (LMCache releases its references
        right after this returns, so each object gets its own reference first)."""
        for key, obj in zip(keys, objs, strict=True):
            if not self._storable(obj):
                continue
            store_key = encode_engine_key(key)
            with self._lock:
                if store_key in self._submitting:
                    continue
                self._submitting.add(store_key)
            obj.ref_count_up()
            try:
                self._submitter.submit(self._put_one, key, store_key, obj, on_complete_callback)
            except RuntimeError:  # closed: undo what we took
                obj.ref_count_down()
                with self._lock:
                    self._submitting.discard(store_key)

    def _put_one(self, key: "CacheEngineKey", store_key: bytes, obj: "MemoryObj",
                 on_complete: Optional[Callable[["CacheEngineKey"], None]]) -> None:
        try:
            if self._store.contains(store_key):
                future = None
            else:
                future = self._store.put(store_key, chunk_tensor(obj))  # copies into staging
                self._count("puts_submitted")
        except Exception:  # noqa: BLE001 - LMCache boundary: log, count, carry on
            self._count("puts_failed")
            log.exception("kvshrink: put of %s failed", key)
            future = None
        finally:
            obj.ref_count_down()  # the store holds its own staged copy now
            with self._lock:
                self._submitting.discard(store_key)
        if on_complete is None:
            return
        if future is None:
            _call_quietly(on_complete, key)
        else:
            future.add_done_callback(lambda _f: _call_quietly(on_complete, key))

    def _storable(self, obj: "MemoryObj") -> bool:
        """Only single-layout objects in the configured memory format round-trip through a frame."""
        meta = obj.metadata
        expected = self._settings.memory_format
        if meta.fmt != expected or (meta.shapes is not None and len(meta.shapes) > 1):
            self._count("puts_skipped_format")
            self._warn_once("format", "kvshrink: skipping chunks in memory format %s with %d layout group(s); "
                            "this plugin stores %s", meta.fmt, len(meta.shapes or [1]), expected)
            return False
        return True

    # -- gets -------------------------------------------------------------------------------------
    def get_blocking(self, key: "CacheEngineKey") -> Optional["MemoryObj"]:
        return self._get_many([key])[0]

    def batched_get_blocking(self, keys: List["CacheEngineKey"]) -> List[Optional["MemoryObj"]]:
        return self._get_many(keys)

    async def batched_get_non_blocking(self, lookup_id: str, keys: list["CacheEngineKey"],
                                       transfer_spec: Any = None) -> list["MemoryObj"]:
        """The loaded prefix of ``keys``; objects after the first miss are released, not returned."""
        objs = await asyncio.get_running_loop().run_in_executor(self._readers, self._get_many, keys)
        prefix: list["MemoryObj"] = []
        for obj in objs:
            if obj is None:
                break
            prefix.append(obj)
        for obj in objs[len(prefix):]:
            if obj is not None:
                obj.ref_count_down()
        return prefix

    def _get_many(self, keys: Sequence["CacheEngineKey"]) -> list[Optional["MemoryObj"]]:
        """Allocate LocalCPUBackend buffers from the stored headers, decode into them in parallel."""
        store_keys = [encode_engine_key(k) for k in keys]
        objs: list[Optional["MemoryObj"]] = [self._allocate_for(k, sk) for k, sk in zip(keys, store_keys)]
        wanted = [i for i, obj in enumerate(objs) if obj is not None]
        if not wanted:
            return objs
        try:
            chunks = self._store.get_many([store_keys[i] for i in wanted], [chunk_tensor(objs[i]) for i in wanted])
        except (ValueError, TypeError, KVShrinkError) as exc:
            self._count("get_errors")
            log.warning("kvshrink: batch read of %d chunks failed: %s", len(wanted), exc)
            chunks = [None] * len(wanted)
        for i, chunk in zip(wanted, chunks):
            if chunk is None:
                objs[i].ref_count_down()
                objs[i] = None
        return objs

    def _allocate_for(self, key: "CacheEngineKey", store_key: bytes) -> Optional["MemoryObj"]:
        header = self._store.header(store_key)
        if header is None:
            return None
        layout = _layout_of(header, key)
        if layout is None:
            self._count("get_errors")
            self._warn_once("layout", "kvshrink: stored chunk %s has dtype %s, key says %s; treated as a miss",
                            store_key[:80], header.dtype, key.dtype)
            return None
        shape, dtype = layout
        obj = self.local_cpu_backend.allocate(shape, dtype, self._settings.memory_format, busy_loop=False)
        if obj is None:
            self._count("allocation_failures")
            self._warn_once("alloc", "kvshrink: LocalCPUBackend has no room for a %s chunk; served as a miss "
                            "(raise max_local_cpu_size)", list(shape))
        return obj

    # -- removal and lifecycle --------------------------------------------------------------------
    def remove(self, key: "CacheEngineKey", force: bool = True) -> bool:
        return self._store.delete(encode_engine_key(key))

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def stats(self) -> dict[str, Any]:
        """Plugin counters plus the store's (tier hits, puts, quarantines...)."""
        return {**self._counts(), "store": self._store.stats()}

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every submitted put has been staged and written (tests, benchmarks)."""
        self._submitter.submit(lambda: None).result(timeout)
        self._store.flush(timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._submitter.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        if self._mirror is not None:
            self._mirror.close()
        for collector in self._exported:
            unregister(collector)
        self._store.close()
        log.info("kvshrink storage plugin closed")

    # -- helpers ----------------------------------------------------------------------------------
    def _count(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1

    def _counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def _warn_once(self, topic: str, message: str, *args: Any) -> None:
        with self._lock:
            if topic in self._warned:
                return
            self._warned.add(topic)
        log.warning(message, *args)


def _layout_of(header: Any, key: "CacheEngineKey") -> "tuple[torch.Size, torch.dtype] | None":
    """Shape and dtype to allocate for a stored chunk; None when they contradict the key."""
    import torch

    dtype = getattr(torch, header.dtype, None) if header.container == "torch" else None
    if not isinstance(dtype, torch.dtype) or dtype != key.dtype:
        return None
    return torch.Size(header.shape), dtype


def _call_quietly(callback: Callable[[Any], None], key: Any) -> None:
    try:
        callback(key)
    except Exception:  # noqa: BLE001 - a caller's callback must not kill our worker
        log.exception("kvshrink: on_complete callback for %s raised", key)
