"""LMCache multiprocess-mode L2 adapter backed by the KVShrink tiered store.

Load it into ``lmcache server``::

    --l2-adapter '{"type": "plugin", "module_path": "kvshrink.storage_backends.mp_l2_adapter",
                   "class_name": "KVShrinkL2Adapter",
                   "adapter_params": {"config": "configs/store-default.yaml"}}'

(or ``kvshrink cache serve --config ...``, which builds that line from one YAML file).
``adapter_params``: ``config`` (path to a store YAML) or ``store`` (the same mapping inline), and
optionally ``workers`` (threads that run submitted tasks, default 4). Reporting to the KVShrink
index where each chunk lives (off by default; see :mod:`~kvshrink.storage_backends.tier_reporter`):
``index_url`` (the index's base URL, ``http://host:8200``), ``index_instance_id`` (required with it:
the instance id or alias the index knows this server's engine by), ``index_flush_interval``
(seconds between reports, default 0.5) and ``index_max_pending`` (chunks waiting to be looked at,
default 65536). LMCache finds :class:`KVShrinkL2AdapterConfig` by name and validates the
parameters before the server starts.

Contract with LMCache (``l2_adapters/base.py``), and how it is kept:

* ``submit_*`` return a task id at once; the work (index lookups, compression, reads and
  decompression) runs on :class:`~kvshrink.storage_backends.task_channels.L2TaskRunner` threads
  and the store's own workers. Each result is posted once on its own eventfd.
* Store: the task completes when each chunk is durable on the store's ``put`` tiers, and LMCache
  holds each object's L1 read lock until then, so the store encodes the chunks straight from
  LMCache's buffers (``put(..., lend=True)``: no staging copy; a non-contiguous one is staged).
  A task that fails midway reports only once the puts it started are done with those buffers.
  Keys already stored are skipped. Any chunk refused or dropped fails the task (LMCache reports
  store errors per task); the chunks that did land are still reported.
* Lookup-and-lock pins hits in the store's local tiers until ``submit_unlock``; unlock is a
  counter decrement that cannot fail.
* Load decodes straight into the caller's L1 buffers; a missing, corrupt or mismatched chunk is a
  0 bit in the result (LMCache then recomputes that chunk), never an exception.
* Stored / accessed / deleted keys go through ``_notify_keys_*`` so LMCache's events, usage and
  metrics see them. LMCache only knows what this process told it, so the adapter keeps the set
  of keys it announced as stored (:mod:`~kvshrink.storage_backends.announced_keys`) and tells
  LMCache ``deleted`` exactly once per announcement, whichever way the chunk went: ``delete()``,
  the store's own eviction or quarantine (its drop listener), or a lookup / load that finds an
  announced key missing (e.g. Redis evicted it). Both announcements re-check the store under one lock, so racing stores,
  evictions and deletes never leave LMCache believing the opposite of the store. A store of a
  key the store already holds (left by an earlier server process) announces it without
  rewriting it. Notifiers run on whichever thread saw the change (LMCache's caller, a task
  thread, a store worker); LMCache's listeners and event bus are thread-safe.
* The store's metrics (``store.metrics``, :mod:`kvshrink.store.metrics`: bytes in and resident
  per tier, raw and stored, latency histograms, losses, and the ``stats()`` counters) and the tier
  reporter's are registered with ``prometheus_client``'s default registry, which LMCache's
  ``/metrics`` (HTTP port) serves, as ``kvshrink_store_*`` and ``kvshrink_tier_reporter_*``
  (docs/observability.md); a second adapter in one process is not registered (logged).
* ``prefetch(keys)`` (the prefetch-hint server module's entry, :mod:`~kvshrink.storage_backends.prefetch_hints`)
  queues store prefetches of ObjectKeys and returns at once; :func:`live_adapters` lists the
  adapters open in this process (weakly held) for that module to find.
* With ``index_url`` set, a :class:`~kvshrink.storage_backends.tier_reporter.TierReporter` hears
  the store's placement notices (and, for keys the store already held, the store task's) and
  LMCache's token bindings, and reports each chunk's medium to the index from its own thread:
  nothing on LMCache's threads waits for the index. Its counters are the ``index_reporter``
  section of ``report_status``.
"""

from __future__ import annotations

import logging
import weakref
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Mapping

from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId

from kvshrink.errors import ConfigError, CorruptDataError, KVShrinkError
from kvshrink.storage_backends.announced_keys import AnnouncedKeys
from kvshrink.storage_backends.keys import decode_object_key, encode_object_key, is_object_key
from kvshrink.storage_backends.memory_objs import chunk_tensor
from kvshrink.storage_backends.mp_adapter_config import DEFAULT_WORKERS, PARAMS_PREFIX, KVShrinkL2AdapterConfig
from kvshrink.storage_backends.store_setup import file_key_prefix, open_store, warm_codec
from kvshrink.storage_backends.task_channels import L2TaskRunner, when_all_done
from kvshrink.storage_backends.tier_reporter import TierReporter, media_of, subscribe_tokens
from kvshrink.store.metrics_export import register, unregister

if TYPE_CHECKING:
    from lmcache.lmcache_native import Bitmap
    from lmcache.v1.distributed.api import KeyListPage, MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.internal_api import L2StoreResult
    from lmcache.v1.memory_management import MemoryObj

__all__ = ["DEFAULT_WORKERS", "KVShrinkL2Adapter", "KVShrinkL2AdapterConfig", "live_adapters"]
log = logging.getLogger(__name__)

_LIVE: "weakref.WeakSet[KVShrinkL2Adapter]" = weakref.WeakSet()


def live_adapters() -> list["KVShrinkL2Adapter"]:
    """The adapters of this process that are open (for the prefetch-hint server module)."""
    return [a for a in list(_LIVE) if not a._closed]


class KVShrinkL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter over :class:`kvshrink.store.TieredStore` (compressed DRAM / SSD / Redis)."""

    def __init__(self, config: "KVShrinkL2AdapterConfig | Mapping[str, Any]", **_: Any) -> None:
        # LMCache passes l1_memory_desc=...; the store needs nothing from it.
        if not isinstance(config, KVShrinkL2AdapterConfig):
            config = KVShrinkL2AdapterConfig.from_dict(config)
        # 0: the store evicts by its own tier policies; LMCache's global L2 eviction stays off.
        super().__init__(max_capacity_bytes=0)
        self._config = config
        source = config.store_source
        prefix = file_key_prefix(source) if isinstance(source, str) else f"{PARAMS_PREFIX}store."
        try:
            self._store = open_store(config.store_config, prefix)
        except ConfigError:
            log.error("KVShrinkL2Adapter: cannot open the store from %r", config.store_source)
            raise
        self._reporter: TierReporter | None = None
        try:
            warm_codec(config.store_config)
            if config.reporter is not None:
                self._reporter = TierReporter(config.reporter, self._store.where, media_of(config.store_config))
                subscribe_tokens(self._event_bus, self._reporter)
            self._runner = L2TaskRunner("kvshrink-l2", config.workers)
        except BaseException:
            if self._reporter is not None:
                self._reporter.close(0.0)
            self._store.close()  # release the SSD directory lock and the arena for the next attempt
            raise
        self._announced = AnnouncedKeys(self._store, self._notify_keys_stored, self._notify_keys_deleted)
        self._closed = False
        self._store.add_drop_listener(self._announced.gone)
        if self._reporter is not None:
            self._store.add_placement_listener(self._reporter.notify)
        collectors = [self._store.metrics] + ([self._reporter.collector()] if self._reporter is not None else [])
        self._exported = [c for c in collectors if register(c)]
        _LIVE.add(self)
        log.info("KVShrinkL2Adapter ready: tiers %s", [t.name for t in config.store_config.tiers])

    # -- event fds ------------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._runner.store.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._runner.lookup.fileno()

    def get_load_event_fd(self) -> int:
        return self._runner.load.fileno()

    # -- store ------------------------------------------------------------------------------------
    def submit_store_task(self, keys: list["ObjectKey"], objects: list["MemoryObj"]) -> L2TaskId:
        if len(keys) != len(objects):
            raise ValueError(f"submit_store_task: {len(keys)} keys but {len(objects)} objects")
        return self._runner.submit(self._runner.store, lambda: self._store_batch(keys, objects), _failed_store)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, "L2StoreResult"]:
        return self._runner.store.take_all()

    def _store_batch(self, keys: list["ObjectKey"], objects: list["MemoryObj"]) -> "Future[L2StoreResult]":
        from lmcache.v1.distributed.internal_api import L2StoreResult

        started: list[tuple["ObjectKey", bytes, int, Future]] = []
        present: list[tuple["ObjectKey", bytes, int]] = []
        try:
            for key, obj in zip(keys, objects, strict=True):
                store_key = encode_object_key(key)
                if self._store.contains(store_key):
                    present.append((key, store_key, obj.get_size()))  # not rewritten (as LMCache's fs adapter)
                    continue
                # lent, not staged: LMCache holds obj's read lock until this task reports (see the docstring)
                started.append((key, store_key, obj.get_size(),
                                self._store.put(store_key, chunk_tensor(obj), lend=True)))
        except BaseException as exc:
            # the task fails, but not before the puts already reading LMCache's buffers are done:
            # LMCache may reuse them once it hears the result
            def fail(_: Any, error: BaseException = exc) -> "L2StoreResult":  # bound now: exc is unset after except
                raise error

            return _then(when_all_done([f for *_, f in started]), fail)

        if present and self._reporter is not None:  # held already (an earlier process): no placement notice
            self._reporter.notify([skey for _, skey, _ in present])

        def settle(_: Any) -> L2StoreResult:
            stored = [(key, skey, size) for key, skey, size, fut in started if _put_succeeded(fut)]
            new = self._announced.stored(stored + present)
            written = {skey for _, skey, _ in stored}
            return L2StoreResult(len(stored) == len(started), sum(s for _, k, s in new if k in written))

        return _then(when_all_done([f for *_, f in started]), settle)

    # -- lookup and lock -----------------------------------------------------------------------
    def submit_lookup_and_lock_task(self, keys: list["ObjectKey"],
                                    group_layout_descs: dict[int, "MemoryLayoutDesc"]) -> L2TaskId:
        count = len(keys)
        return self._runner.submit(self._runner.lookup, lambda: self._lookup_and_lock(keys),
                                   lambda exc: _bitmap(count, []))

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> "Bitmap | None":
        return self._runner.lookup.take(task_id)

    def _lookup_and_lock(self, keys: list["ObjectKey"]) -> "Bitmap":
        store_keys = [encode_object_key(k) for k in keys]
        found = self._store.lock(store_keys)
        self._announced.missing([k for k, hit in zip(store_keys, found) if not hit], "lookup")  # e.g. Redis evicted it
        return _bitmap(len(keys), [i for i, hit in enumerate(found) if hit])

    def submit_unlock(self, keys: list["ObjectKey"]) -> None:
        store_keys = [encode_object_key(k) for k in keys]
        try:
            self._store.unlock(store_keys)
        except Exception:  # unlock must eventually succeed: retry once off the caller's thread
            log.exception("KVShrinkL2Adapter: unlock of %d keys failed; retrying in the background", len(keys))
            self._runner.run_in_background(lambda: self._store.unlock(store_keys), "unlock")

    # -- load -------------------------------------------------------------------------------------
    def submit_load_task(self, keys: list["ObjectKey"], objects: list["MemoryObj"]) -> L2TaskId:
        if len(keys) != len(objects):
            raise ValueError(f"submit_load_task: {len(keys)} keys but {len(objects)} objects")
        count = len(keys)
        return self._runner.submit(self._runner.load, lambda: self._load_batch(keys, objects),
                                   lambda exc: _bitmap(count, []))

    def query_load_result(self, task_id: L2TaskId) -> "Bitmap | None":
        return self._runner.load.take(task_id)

    def _load_batch(self, keys: list["ObjectKey"], objects: list["MemoryObj"]) -> "Bitmap":
        store_keys = [encode_object_key(k) for k in keys]
        outs = [chunk_tensor(o) for o in objects]
        try:
            chunks = self._store.get_many(store_keys, outs)
        except (ValueError, TypeError, KVShrinkError) as exc:
            # one mismatched buffer must not fail the whole batch: retry key by key
            log.warning("KVShrinkL2Adapter: batch load failed (%s); loading key by key", exc)
            chunks = [self._load_one(k, o) for k, o in zip(store_keys, outs)]
        hits = [i for i, chunk in enumerate(chunks) if chunk is not None]
        if hits:
            self._notify_keys_accessed([keys[i] for i in hits])
        if len(hits) < len(keys):
            self._announced.missing([k for k, chunk in zip(store_keys, chunks) if chunk is None], "load")
        return _bitmap(len(keys), hits)

    def _load_one(self, store_key: bytes, out: Any) -> Any:
        try:
            return self._store.get(store_key, out)
        except (ValueError, TypeError, KVShrinkError) as exc:
            log.warning("KVShrinkL2Adapter: chunk %s not loaded: %s", store_key[:80], exc)
            return None

    # -- prefetch hints -------------------------------------------------------------------------
    def prefetch(self, keys: list["ObjectKey"]) -> Any:
        """Queue the store's prefetch of ``keys`` (prefix order) up to its first tier; returns the
        store's :class:`~kvshrink.store.prefetch.PrefetchHandle` at once (bounded, counted there)."""
        return self._store.prefetch([encode_object_key(k) for k in keys])

    # -- eviction, listing, status -------------------------------------------------------------
    def delete(self, keys: list["ObjectKey"]) -> None:
        """Remove the chunks; LMCache hears ``deleted`` for those it had been told are stored
        (a chunk the store had evicted already was reported then, not again)."""
        store_keys = [encode_object_key(k) for k in keys]
        for store_key in store_keys:
            try:
                self._store.delete(store_key)
            except KVShrinkError as exc:
                log.warning("KVShrinkL2Adapter: delete of %s failed: %s", store_key[:80], exc)
        self._announced.gone(store_keys)

    def list_l2_keys(self, model_name: str | None = None, page_size: int = 500,
                     cursor: str | None = None) -> "KeyListPage":
        from lmcache.v1.distributed.api import KeyEntry, KeyListPage

        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        try:
            start = int(cursor) if cursor is not None else 0
        except ValueError as exc:
            raise ValueError(f"malformed cursor {cursor!r}") from exc
        if start < 0:
            raise ValueError(f"malformed cursor {cursor!r}")
        keys = sorted(k for k in self._store.keys() if is_object_key(k))
        entries: list[KeyEntry] = []
        position = start
        while position < len(keys) and len(entries) < page_size:
            store_key = keys[position]
            position += 1
            try:
                key = decode_object_key(store_key)
            except CorruptDataError:
                continue
            if model_name is not None and key.model_name != model_name:
                continue
            entries.append(KeyEntry(key=key.to_encoded_object_key(), size_bytes=self._size_of(store_key)))
        next_token = str(position) if position < len(keys) else None
        return KeyListPage(entries=tuple(entries), next_page_token=next_token)

    def _size_of(self, store_key: bytes) -> int:
        announced = self._announced.size_of(store_key)
        if announced is not None:
            return announced
        header = self._store.header(store_key)
        return int(getattr(header, "raw_size", 0)) if header is not None else 0

    def report_status(self) -> dict:
        healthy = not self._closed
        report_errors = self._announced.errors()
        status: dict[str, Any] = {"is_healthy": healthy, "type": type(self).__name__,
                                  "tiers": [t.name for t in self._config.store_config.tiers],
                                  "in_flight_tasks": self._runner.in_flight(),
                                  "boundary_errors": {**self._runner.errors(), **report_errors}}
        if healthy:
            status["store"] = self._store.stats()
        if self._reporter is not None:
            status["index_reporter"] = self._reporter.stats()
        if any(t.compressed and t.method == "qat" for t in self._config.store_config.tiers):
            from kvshrink.codec import qat_status

            status["qat"] = qat_status()
        return status

    def store_stats(self) -> dict[str, Any]:
        """The store's counters (tier hits, puts, quarantines...), for tests and benchmarks."""
        return self._store.stats()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        for collector in self._exported:
            unregister(collector)
        try:
            self._runner.close()
            if self._reporter is not None:
                self._reporter.close()  # before the store closes: the reporter thread reads it
        finally:
            self._store.close()
        log.info("KVShrinkL2Adapter closed")


def _put_succeeded(future: Future) -> bool:
    """A store put is durable when its Future says True; False (dropped) or an error is not."""
    if future.cancelled():
        return False
    exc = future.exception()
    if exc is not None:
        log.warning("KVShrinkL2Adapter: a chunk was not stored: %s", exc)
        return False
    return future.result() is True


def _failed_store(exc: BaseException) -> "L2StoreResult":
    from lmcache.v1.distributed.internal_api import L2StoreResult

    return L2StoreResult(False, 0)


def _bitmap(size: int, set_indices: list[int]) -> "Bitmap":
    from lmcache.lmcache_native import Bitmap

    bitmap = Bitmap(size)
    for index in set_indices:
        bitmap.set(index)
    return bitmap


def _then(future: Future, fn: Any) -> Future:
    """``fn(future.result())`` as a new Future, run in whichever thread completes ``future``."""
    out: Future = Future()

    def chain(done: Future) -> None:
        try:
            out.set_result(fn(done.result()))
        except BaseException as exc:  # noqa: BLE001 - delivered to the runner, which logs and counts it
            out.set_exception(exc)

    future.add_done_callback(chain)
    return out
