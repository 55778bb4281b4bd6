"""Capacity -> hit rate: the agent trace replayed through LMCache's own in-process storage stack.

Both sides run LMCache's ``StorageManager`` with CPU tensors, the way ``LMCacheEngine`` drives it:
chunk keys from LMCache's ``ChunkedTokenDatabase`` (prefix-chained hashes of 256-token chunks),
``batched_contains(pin=True)`` + ``touch_cache`` for the lookup, ``get_block_mapping`` +
``batched_get`` per location for the retrieve (the bytes are checked against what was stored),
``allocate(busy_loop=False)`` + ``batched_put`` for the chunks that missed, then ``batched_unpin``.

* stock, at its best: each of its sensible arrangements of the same DRAM + SSD budget runs, and the
  report compares against the best (:data:`STOCK_VARIANTS`, named in every row):
  ``l1-all-dram``: ``LocalCPUBackend`` = the DRAM budget + ``LocalDiskBackend`` = the SSD budget
  (LMCache writes every chunk to both, so its DRAM duplicates its disk); ``staging``: the
  arrangement ours uses, ``local_cpu: false`` with the same staging pool, and the rest of the DRAM
  budget given to ``LocalDiskBackend`` on top of the SSD budget (same total bytes, one tier).
* ours: our in-process storage plugin over the shipped default store (``configs/store-default.yaml``,
  or ``--store-config``) with the same budgets, changed by
  :func:`kvshrink.testing.derived_stores.derive_store` only in paths, arena name, capacities and
  serial engine lanes. LMCache still needs a ``LocalCPUBackend`` to allocate read buffers; it runs
  with ``local_cpu: false`` (a staging pool that caches nothing) and its size is taken out of our
  DRAM tier, so total DRAM is equal on both sides. Our runs record the store file they used
  (path, sha256) in their details.

The KV bytes are real SmolLM2 KV (a pool of chunks; the n-th distinct key gets chunk n mod pool),
so compressibility is real. Replays are deterministic: every put is waited for before the next
request, and disk writes / store workers run one at a time so that chunks age in submit order
(this measures capacity, not speed): the same trace gives the same hits.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from kvshrink.benchmarks.comparison import (OURS, STOCK, Budget, SideRun, TierPolicy, Workload, digest,
                                            trace_fingerprint)
from kvshrink.errors import ConfigError, CorruptDataError, KVShrinkError
from kvshrink.testing.derived_stores import derive_store, store_record
from kvshrink.testing.polling import poll_until

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MIB = 2**20
MIN_SSD_MIB = 64
CHUNK_TOKENS = 256
PLUGIN_NAME = "kvshrink"
PLUGIN_MODULE = "kvshrink.storage_backends.inprocess_plugin"
PLUGIN_CLASS = "KVShrinkStoragePlugin"
# SmolLM2-135M: 30 layers, 3 KV heads of 64 -> chunks of [2, 30, 256, 192] bf16
KV_SHAPE = (30, 2, CHUNK_TOKENS, 3, 64)


@dataclass(frozen=True)
class ReplaySettings:
    """How chunks move: ``store_batch`` chunks per put (one prefill step's worth) and per read,
    ``staging_mib`` of LocalCPUBackend buffer on our side (caches nothing)."""

    store_batch: int = 8
    retrieve_batch: int = 8
    staging_mib: int = 64
    pool_chunks: int = 16
    put_timeout_s: float = 120.0
    full_verify: bool = False  # compare every byte of every hit, not three 64 KiB slices of it


@dataclass
class ReplayStats:
    requests: int = 0
    prompt_tokens: int = 0
    chunks_looked_up: int = 0
    chunks_hit: int = 0
    chunks_stored: int = 0
    chunks_store_skipped: int = 0  # LocalCPUBackend had no room for the put (LMCache skips the rest)
    distinct_keys: int = 0
    ideal_hits: int = 0  # hits of an infinite cache: keys seen before in the trace
    chunks_held_end: int = 0
    seconds: float = 0.0
    backend_stats: dict[str, Any] = field(default_factory=dict)

    def figures(self, budget: Budget, chunk_bytes: int) -> dict[str, float]:
        held_bytes = self.chunks_held_end * chunk_bytes
        budget_gb = (budget.dram_mib + budget.ssd_mib) * MIB / 1e9
        return {
            "chunk_hit_rate": self.chunks_hit / max(1, self.chunks_looked_up),
            "ideal_hit_rate": self.ideal_hits / max(1, self.chunks_looked_up),
            "prefill_tokens_avoided": float(self.chunks_hit * CHUNK_TOKENS),
            "prefill_tokens_avoided_fraction": self.chunks_hit * CHUNK_TOKENS / max(1, self.prompt_tokens),
            "tokens_held": float(self.chunks_held_end * CHUNK_TOKENS),
            "tokens_held_per_gb": self.chunks_held_end * CHUNK_TOKENS / budget_gb,
            "kv_bytes_held_per_gb": held_bytes / budget_gb,  # raw KV bytes per GB of budget
            "chunks_stored": float(self.chunks_stored),
            "chunks_store_skipped": float(self.chunks_store_skipped),
            "replay_seconds": self.seconds,
        }


# -- engine configs ---------------------------------------------------------------------------------
STOCK_L1_ALL_DRAM = "l1-all-dram"
STOCK_STAGING = "staging"
STOCK_VARIANTS = (STOCK_L1_ALL_DRAM, STOCK_STAGING)


def stock_engine_config(budget: Budget, workdir: Path, variant: str = STOCK_L1_ALL_DRAM,
                        staging_mib: int = ReplaySettings.staging_mib) -> Any:
    """Stock LMCache's in-process backends for ``budget`` in one of :data:`STOCK_VARIANTS`."""
    from lmcache.v1.config import LMCacheEngineConfig

    if variant == STOCK_L1_ALL_DRAM:
        local_cpu, cpu_mib, disk_mib = True, budget.dram_mib, budget.ssd_mib
    elif variant == STOCK_STAGING:
        local_cpu, cpu_mib, disk_mib = False, staging_mib, budget.ssd_mib + budget.dram_mib - staging_mib
    else:
        raise ValueError(f"unknown stock variant {variant!r}; one of {STOCK_VARIANTS}")
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_TOKENS, save_unfull_chunk=False, local_cpu=local_cpu, max_local_cpu_size=cpu_mib / 1024,
        local_disk=str(workdir / "lmcache-disk"), max_local_disk_size=disk_mib / 1024,
        extra_config={"disk_io_threads": 1})  # writes land in submit order: the LRU order is reproducible


def stock_policy(variant: str, budget: Budget, settings: ReplaySettings) -> TierPolicy:
    if variant == STOCK_L1_ALL_DRAM:
        return TierPolicy(f"stock {STOCK_L1_ALL_DRAM}: LocalCPUBackend {budget.dram_mib} MiB + LocalDiskBackend "
                          f"{budget.ssd_mib} MiB", "inclusive", float(budget.dram_mib), False)
    return TierPolicy(f"stock {STOCK_STAGING}: {settings.staging_mib} MiB staging (local_cpu: false) + "
                      f"LocalDiskBackend {budget.ssd_mib + budget.dram_mib - settings.staging_mib} MiB",
                      "single", 0.0, False)


def ours_policy(settings: ReplaySettings, store: Mapping[str, Any]) -> TierPolicy:
    from kvshrink.store import StoreConfig

    config = StoreConfig.load(store)
    exclusive = not any(t.write_back for t in config.tiers)
    return TierPolicy(f"KVShrink shipped default store + {settings.staging_mib} MiB staging (local_cpu: false)",
                      "exclusive" if exclusive else "inclusive", 0.0, config.promote_on_hit)


def ours_store_mapping(budget: Budget, settings: ReplaySettings, workdir: Path, template: Path | None = None,
                       tag: str = "") -> dict:
    """The store config (default: the shipped default) with this budget's capacities, a private SSD
    directory and arena, and one worker per engine lane: chunks land (and age) in submit order, so
    the replay repeats exactly; that changes how fast the store works, not what it keeps."""
    dram_bytes = (budget.dram_mib - settings.staging_mib) * MIB
    if dram_bytes <= 0:
        raise ConfigError("budget.dram_mib", f"{budget.dram_mib} MiB leaves nothing for our DRAM tier after "
                                             f"LMCache's {settings.staging_mib} MiB staging pool")
    return derive_store(template, paths={"ssd": workdir / "kvshrink-ssd"},
                        shm_names={"dram": f"kvshrink-bench-{tag or workdir.name}"},
                        capacities={"dram": dram_bytes, "ssd": budget.ssd_mib * MIB}, serial_engine=True)


def ours_engine_config(store: Mapping[str, Any], settings: ReplaySettings) -> Any:
    from lmcache.v1.config import LMCacheEngineConfig

    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_TOKENS, save_unfull_chunk=False, local_cpu=False,
        max_local_cpu_size=settings.staging_mib / 1024, storage_plugins=[PLUGIN_NAME],
        extra_config={f"storage_plugin.{PLUGIN_NAME}.module_path": PLUGIN_MODULE,
                      f"storage_plugin.{PLUGIN_NAME}.class_name": PLUGIN_CLASS, "kvshrink.store": dict(store),
                      "kvshrink.read_workers": 1})


def engine_metadata() -> Any:
    import torch
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(model_name="smollm2-135m", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=KV_SHAPE, chunk_size=CHUNK_TOKENS)


def stock_budget_of(config: Any) -> dict[str, int]:
    """The budget a stock StorageManager was built with, read back from its config."""
    return {"dram_mib": round(config.max_local_cpu_size * 1024), "ssd_mib": round(config.max_local_disk_size * 1024)}


def _built_total(built: Mapping[str, int], budget: Budget, side: str) -> int:
    """The total a side's objects were built with; it must be the budget's, whatever the split."""
    total = built["dram_mib"] + built["ssd_mib"]
    if total != budget.dram_mib + budget.ssd_mib:
        raise KVShrinkError(f"{side} was built with {built} = {total} MiB, not the budget's "
                            f"{budget.dram_mib + budget.ssd_mib} MiB")
    return total


def ours_budget_of(config: Any) -> dict[str, int]:
    """Staging pool + our DRAM tiers, and our SSD tiers, from the config the plugin was built from."""
    from kvshrink.store import StoreConfig

    store = StoreConfig.load(config.extra_config["kvshrink.store"])
    dram = sum(t.capacity for t in store.tiers if t.kind == "dram")
    ssd = sum(t.capacity for t in store.tiers if t.kind == "ssd")
    return {"dram_mib": round(config.max_local_cpu_size * 1024 + dram / MIB), "ssd_mib": round(ssd / MIB)}


@contextlib.contextmanager
def storage_manager(config: Any, expect_plugin: bool) -> Iterator[Any]:
    """LMCache's StorageManager; with ``expect_plugin``, fail loudly if LMCache dropped our plugin."""
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.pin_monitor import PinMonitor
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    PinMonitor.GetOrCreate(config)  # LMCacheEngine creates it before any pin
    manager = StorageManager(config, engine_metadata(), EventManager())
    try:
        if expect_plugin and PLUGIN_NAME not in manager.storage_backends:
            raise KVShrinkError(f"LMCache did not create the {PLUGIN_NAME!r} storage plugin (it only logs why); "
                                f"backends: {list(manager.storage_backends)}")
        yield manager
    finally:
        manager.close()


# -- the replay -------------------------------------------------------------------------------------
@dataclass
class ChunkPool:
    """Real SmolLM2 KV chunks [2, 30, 256, 192] as bf16 tensors, and their fingerprint."""

    chunks: list["torch.Tensor"]

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, index: int) -> "torch.Tensor":
        return self.chunks[index]

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunks[0].numel() * self.chunks[0].element_size())

    @functools.cached_property
    def fingerprint(self) -> str:
        """The KV bytes both sides stored: what 'same model' means for a storage benchmark."""
        import torch

        return "kv-" + digest(*[c.view(torch.int16).numpy() for c in self.chunks])


@functools.lru_cache(maxsize=4)
def chunk_pool(count: int) -> ChunkPool:
    import torch

    from kvshrink.testing.fixtures.real_kv import real_kv_chunks

    return ChunkPool([torch.from_numpy(c).view(torch.bfloat16) for c in real_kv_chunks(count, CHUNK_TOKENS)])


def request_keys(requests: Sequence[Any], config: Any) -> list[list[Any]]:
    """LMCache's own chunk keys for each request (full chunks only, as ``save_unfull_chunk: false``)."""
    from lmcache.v1.token_database import ChunkedTokenDatabase

    database = ChunkedTokenDatabase(config, engine_metadata())
    return [[key for _, _, key in database.process_tokens(tokens=list(map(int, r.token_ids)))] for r in requests]


def replay(manager: Any, requests: Sequence[Any], keys_per_request: Sequence[Sequence[Any]],
           pool: Sequence["torch.Tensor"], settings: ReplaySettings,
           progress: Callable[[int], None] = lambda n: None) -> ReplayStats:
    """Replay the requests in order; count hits that came back bit-exact; raise on wrong bytes."""
    stats = ReplayStats()
    content: dict[Any, int] = {}  # key -> pool index, by first appearance in the trace
    start = time.perf_counter()
    for request, keys in zip(requests, keys_per_request, strict=True):
        stats.requests += 1
        stats.prompt_tokens += len(request.token_ids)
        stats.chunks_looked_up += len(keys)
        stats.ideal_hits += sum(1 for k in keys if k in content)
        for key in keys:
            content.setdefault(key, len(content) % len(pool))
        hit = _lookup_and_retrieve(manager, keys, content, pool, settings)
        stats.chunks_hit += hit
        stored, skipped = _store_missing(manager, keys[hit:], content, pool, settings)
        stats.chunks_stored += stored
        stats.chunks_store_skipped += skipped
        _flush(manager, settings.put_timeout_s)
        progress(1)
    stats.seconds = time.perf_counter() - start
    stats.distinct_keys = len(content)
    stats.chunks_held_end = sum(1 for key in content if manager.contains(key) is not None)
    stats.backend_stats = _backend_stats(manager)
    return stats


def _lookup_and_retrieve(manager: Any, keys: Sequence[Any], content: Mapping[Any, int],
                         pool: Sequence["torch.Tensor"], settings: ReplaySettings) -> int:
    """What LMCacheEngine.lookup + retrieve do; returns the verified prefix of hit chunks."""
    if not keys:
        return 0
    found, pinned = manager.batched_contains(list(keys), None, True)
    manager.touch_cache()
    try:
        chunk_infos = [(key, i * CHUNK_TOKENS, (i + 1) * CHUNK_TOKENS) for i, key in enumerate(keys[:found])]
        loaded = 0
        for location, blocks in manager.get_block_mapping(chunk_infos).items():
            block_keys = [key for key, _, _ in blocks]
            for i in range(0, len(block_keys), settings.retrieve_batch):
                batch = block_keys[i:i + settings.retrieve_batch]
                objs = manager.batched_get(batch, location=location)
                _flush(manager, settings.put_timeout_s)  # this batch's promotions land before the next reads
                ok = _verify_and_release(batch, objs, content, pool, location, settings.full_verify)
                loaded += ok
                if ok < len(batch):
                    return loaded
        return loaded
    finally:
        for location, pinned_keys in pinned.items():
            manager.batched_unpin(pinned_keys, [location])


def _verify_and_release(keys: Sequence[Any], objs: Sequence[Any], content: Mapping[Any, int],
                        pool: Sequence["torch.Tensor"], location: str, full: bool) -> int:
    """Count the leading objects that came back; every returned one must equal what was stored."""
    ok, prefix = 0, True
    for key, obj in zip(keys, objs):
        if obj is None:
            prefix = False
            continue
        try:
            if not _same_kv(obj.tensor, pool[content[key]], full):
                raise CorruptDataError(f"{location} returned wrong bytes for chunk {key.chunk_hash:x}")
        finally:
            obj.ref_count_down()
        if prefix:
            ok += 1
    return ok


def _same_kv(got: "torch.Tensor", expected: "torch.Tensor", full: bool) -> bool:
    """Bit-exact compare (as int16: a bf16 compare is ~10x slower on CPU). Sampled: three 64 KiB
    slices, enough to catch a chunk served for the wrong key; bit-level integrity is each store's
    own checksum's job."""
    import torch

    a, b = got.reshape(-1).view(torch.int16), expected.reshape(-1).view(torch.int16)
    if a.numel() != b.numel():
        return False
    if full:
        return torch.equal(a, b)
    span, n = 32768, a.numel()
    return all(torch.equal(a[i:i + span], b[i:i + span]) for i in (0, max(0, n // 2 - span // 2), max(0, n - span)))


def _store_missing(manager: Any, keys: Sequence[Any], content: Mapping[Any, int],
                   pool: Sequence["torch.Tensor"], settings: ReplaySettings) -> tuple[int, int]:
    """What LMCacheEngine.store does, one prefill step (``store_batch`` chunks) at a time."""
    import torch

    stored = 0
    for i in range(0, len(keys), settings.store_batch):
        batch, objs = [], []
        for key in keys[i:i + settings.store_batch]:
            obj = manager.allocate(torch.Size([2, KV_SHAPE[0], CHUNK_TOKENS, KV_SHAPE[3] * KV_SHAPE[4]]),
                                   torch.bfloat16, busy_loop=False)
            if obj is None:  # LMCache stores only what it could allocate and drops the rest
                break
            obj.tensor.view(torch.int16).copy_(pool[content[key]].view(torch.int16))
            batch.append(key)
            objs.append(obj)
        if batch:
            manager.batched_put(batch, objs)
            _wait_puts(manager, batch, settings.put_timeout_s)
            stored += len(batch)
        if len(batch) < len(keys[i:i + settings.store_batch]):
            return stored, len(keys) - stored
    return stored, 0


def _wait_puts(manager: Any, keys: Sequence[Any], timeout: float) -> None:
    backends = list(manager.storage_backends.values())
    poll_until(lambda: not any(b.exists_in_put_tasks(k) for b in backends for k in keys), timeout,
               interval=0.0005, what="the puts in flight to finish", error=KVShrinkError)


def _flush(manager: Any, timeout: float) -> None:
    """Let background work (write-back, demotion) finish so the next request sees a settled cache."""
    for backend in manager.storage_backends.values():
        flush = getattr(backend, "flush", None)
        if callable(flush):
            flush(timeout)


def _backend_stats(manager: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, backend in manager.storage_backends.items():
        if callable(getattr(backend, "stats", None)):
            out[name] = backend.stats()
        elif hasattr(backend, "current_cache_size"):
            out[name] = {"bytes_used": int(backend.current_cache_size), "chunks": len(backend.dict)}
        elif hasattr(backend, "hot_cache"):
            out[name] = {"chunks": len(backend.hot_cache)}
    return out


# -- one side, one budget ---------------------------------------------------------------------------
def run_side(side: str, budget: Budget, requests: Sequence[Any], pool: ChunkPool, settings: ReplaySettings,
             store_template: Path | None = None, progress: Callable[[int], None] = lambda n: None,
             tag: str = "", variant: str = STOCK_L1_ALL_DRAM) -> SideRun:
    """Replay ``requests`` on one side with one budget, in a private scratch directory (ours: on
    ``store_template``, default the shipped default store; stock: in ``variant``).

    The workload's budget is the DRAM / SSD budget given plus the total read back from what was
    built (equal on both sides, whatever their split); the split each side chose is its policy."""
    workdir = Path(tempfile.mkdtemp(prefix=f"kvshrink-capacity-{'stock' if side == STOCK else 'ours'}-"))
    tag = tag or workdir.name.rsplit("-", 1)[-1]
    try:
        if side == STOCK:
            config, expect_plugin = stock_engine_config(budget, workdir, variant, settings.staging_mib), False
            built, used = stock_budget_of(config), {"variant": variant}
            policy = stock_policy(variant, budget, settings)
        elif side == OURS:
            store = ours_store_mapping(budget, settings, workdir, store_template, tag)
            config, expect_plugin = ours_engine_config(store, settings), True
            built, used = ours_budget_of(config), {"store_config": store_record(store_template)}
            policy = ours_policy(settings, store)
        else:
            raise ValueError(f"unknown side {side!r}")
        keys = request_keys(requests, config)
        with storage_manager(config, expect_plugin) as manager:
            stats = replay(manager, requests, keys, pool, settings, progress)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        _unlink_arena(f"kvshrink-bench-{tag}")
    workload = Workload(trace=trace_fingerprint(requests), model=pool.fingerprint,
                        budget={**asdict(budget), "total_mib_built": _built_total(built, budget, side),
                                "store_batch": settings.store_batch, "chunk_tokens": CHUNK_TOKENS})
    return SideRun(side, workload, stats.figures(budget, pool.chunk_bytes),
                   {"stats": {k: v for k, v in asdict(stats).items() if k != "backend_stats"},
                    "backends": stats.backend_stats, "budget": asdict(budget), "built": built, **used}, policy)


def _replay_task(task: "ReplayTask", requests: Sequence[Any], settings: ReplaySettings,
                 store_template: Path | None) -> SideRun:
    """One replay in a worker process (the chunk pool is loaded once per process)."""
    import os

    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    return run_side(task.side, task.budget, requests, chunk_pool(settings.pool_chunks), settings, store_template,
                    variant=task.variant)


@dataclass(frozen=True)
class ReplayTask:
    side: str
    budget: Budget
    variant: str = STOCK_L1_ALL_DRAM  # stock's arrangement; ignored for ours


def tasks_for(budgets: Sequence[Budget]) -> list[ReplayTask]:
    """Per budget: every stock variant, then ours."""
    return [ReplayTask(side, budget, variant) for budget in budgets
            for side, variant in [*((STOCK, v) for v in STOCK_VARIANTS), (OURS, STOCK_L1_ALL_DRAM)]]


def best_stock(runs: Sequence[SideRun]) -> SideRun:
    """Stock at its best: the variant with the highest hit rate (then the most tokens held)."""
    return max(runs, key=lambda r: (r.figures["chunk_hit_rate"], r.figures["tokens_held"]))


def run_replays(tasks: Sequence[ReplayTask], requests: Sequence[Any], settings: ReplaySettings,
                store_template: Path | None = None, jobs: int = 1,
                on_done: Callable[[ReplayTask], None] = lambda task: None) -> list[SideRun]:
    """Every replay task, ``jobs`` at a time in worker processes; results in task order.

    Replays are independent and deterministic (each waits for its own puts), so running them side
    by side changes how long they take, not what they measure."""
    if jobs <= 1:
        pool = chunk_pool(settings.pool_chunks)
        out = []
        for task in tasks:
            out.append(run_side(task.side, task.budget, requests, pool, settings, store_template,
                                variant=task.variant))
            on_done(task)
        return out
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    results: dict[int, SideRun] = {}
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as executor:
        futures = {executor.submit(_replay_task, task, requests, settings, store_template): i
                   for i, task in enumerate(tasks)}
        try:
            for future in as_completed(futures):
                i = futures[future]
                results[i] = future.result()  # a failed replay raises here, with its own traceback
                on_done(tasks[i])
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    return [results[i] for i in range(len(tasks))]


def _unlink_arena(shm_name: str) -> None:
    path = Path("/dev/shm") / shm_name
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def budgets_for(working_set_mib: int, fractions: Sequence[float], dram_share: float, min_dram_mib: int) -> list[Budget]:
    """Budgets as fractions of the trace's working set, ``dram_share`` of each in DRAM."""
    out = []
    for fraction in fractions:
        total = max(1, round(working_set_mib * fraction))
        dram = max(min_dram_mib, round(total * dram_share))
        out.append(Budget(dram_mib=dram, ssd_mib=max(MIN_SSD_MIB, total - dram)))
    return out
