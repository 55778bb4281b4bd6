"""KV Fuse served through vLLM: an ``lmcache server --server-module`` that fuses on lookup (issue 15).

vLLM's scheduler only takes a *prefix* of externally computed tokens, so a fused KV must reach vLLM
as an ordinary LMCache prefix hit. This module makes it one, with no patch of vLLM or LMCache::

    lmcache server ... --supported-transfer-mode auto --l2-adapter '{... KVShrinkL2Adapter ...}'
        --server-module '{"module_path": "kvshrink.fuse.server_module",
                          "config": {"store_config": "<store YAML with a fuse: section>"}}'

(or the ``fuse`` keys inline in ``config``). Its RPC handlers register after LMCache's built-ins and
replace the same-named ones; each delegates to the built-in it replaces:

* ``commit_store`` (the engine-driven store path vLLM CPU uses): after the built-in stored the
  chunks, each stored full chunk is added to a :class:`~kvshrink.fuse.index.ContentIndex` (one per
  model and tenant, i.e. the base of the cache salt) under its ``ObjectKey``, with its tokens and
  start position. Chunks that vLLM computed on top of a fused prefix are not indexed (they are
  approximations themselves).
* ``lookup``: a request opts into fusion by its ``cache_salt``: the OpenAI request's
  ``cache_salt`` reaches every ``ObjectKey``; a client that wants fusion sends
  :func:`~kvshrink.fuse.keys.fused_salt` ``(settings, own_salt)`` (``kvfuse1-r0150-c1`` for the
  defaults and no salt of its own). Every other lookup is the built-in, untouched. For a fused salt
  the lookup is acknowledged at once and a fusion job runs on this module's own thread
  (``kvshrink-fuse``; fusion takes seconds on CPU, and LMCache's server threads must keep serving):
  (1) read the prompt's own chunks under the fused salt — if all are there the prompt was fused
  before (or computed under this salt) and nothing is done; the leading ones are the exact prefix;
  (2) match the rest of the prompt against the tenant's index and read the matched chunks by their
  original keys; (3) :meth:`FuseEngine.fuse <kvshrink.fuse.engine.FuseEngine.fuse>` re-rotates them
  and recomputes the gaps plus the top ``ratio`` of reused tokens; (4) write the result's full
  chunks under the prompt's own chunk keys with the fused salt (``reserve_write`` /
  ``finish_write``: ordinary chunks of the store, compressed, tiered, evictable); (5) call the
  built-in lookup, which now finds a prefix hit that vLLM loads; vLLM computes only the tail.
* ``register_kv_cache_engine_driven_context``: the built-in, remembering vLLM's paged block size
  (vLLM CPU's chunk objects are raw rows of its paged cache, read through the paged layout probed
  from vLLM's own cache writer in this process, see :class:`ChunkCodec`; before a model's first
  fusion, a stored chunk's layer-0 keys decoded that way must be the model's own). The probe needs
  vLLM CPU importable in the cache server's process and the server on vLLM's host (the same ISA).
* ``query_prefetch_status`` / ``wait_prefetch_status`` answer "still running" while a request's
  fusion job runs (vLLM's scheduler polls without blocking and retries), then delegate;
  ``end_session`` of a request whose job still runs makes the job skip its built-in lookup.

Fallback: a matched chunk that is missing (evicted), unreadable, of an unknown layout, not finite
or whose layer-0 keys are not the model's (:data:`KEY_CHECK_TOLERANCE`) makes the whole request
fall back: nothing is written, the built-in lookup runs, vLLM prefills as
stock does — the right answer. Missing chunks leave the index. Any error in a job is logged and
counted, never raised into LMCache; the built-in lookup still runs.

Switching: ``fuse.enabled: false`` (the default) makes the factory return no module — every handler
is LMCache's own, byte for byte. Enabled, requests without a fused salt are stock too, and fused
chunks live only under fused salts (:mod:`kvshrink.fuse.keys`), so they can be counted and evicted
on their own. Only ``world_size`` 1 and one object group are fused (others fall back).

Threads: LMCache's worker threads run the handlers; the index and the job table are guarded by one
lock; fusion jobs run one at a time on the module's thread and own everything they read (copies).
Counters are in the server's ``/status`` under ``kvshrink_fuse``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from lmcache.v1.multiprocess.custom_types import (IPCCacheServerKey, RegisterEngineDrivenContextPayload,
                                                  RegisterEngineDrivenContextResponse)
from lmcache.v1.multiprocess.request_handler import HandlerType, request_handler

from kvshrink.config_checks import (bool_value, int_value, load_yaml, mapping_value, number_value)
from kvshrink.errors import ConfigError, KVShrinkError
from kvshrink.fuse.index import ContentIndex
from kvshrink.fuse.keys import FuseSettings, base_salt_of, fused_salt, is_fused_salt

if TYPE_CHECKING:
    import torch

    from lmcache.v1.multiprocess.ext_server_module import ExtServerModuleBuildContext

    from kvshrink.fuse.engine import FuseEngine
    from kvshrink.plugins.vllm.cpu_kv_layout import PagedLayout

log = logging.getLogger(__name__)

_WHERE = "fuse"
SETTING_KEYS = ("enabled", "ratio", "check_layer", "model_path", "threads", "timeout_s", "max_pending",
                "min_reuse_chunks", "max_indexed_chunks", "anchor")
READ_TIMEOUT_S = 60.0  # one read of stored chunks (L2 loads included)
# A stored chunk's layer-0 keys must match a fresh computation within this relative error (per
# token, worst token): bf16 storage and another engine's kernels stay well below it (measured
# here: under 1e-2), a wrong layout, another model or damaged bytes are far above it (~1.4)
KEY_CHECK_TOLERANCE = 0.1
FUSED_REQUESTS_KEPT = 4096  # request ids remembered as fused (their later stores are not indexed)
FUSED_KEYS_KEPT = 65536  # keys this module wrote fused KV under (a prefix holding one is not exact)
COUNTERS = ("fused_salt_lookups", "fusions", "already_fused", "no_match", "fallback_missing",
            "fallback_corrupt", "fallback_layout", "fallback_busy", "fallback_timeout", "fallback_error",
            "foreign_salt", "cancelled", "reused_chunks", "reused_tokens", "gap_tokens", "recomputed_tokens",
            "prefix_chunks", "fused_chunks_written", "fused_chunks_not_written", "indexed_chunks_added",
            "indexed_chunks_dropped")


class ChunkCodec:
    """LMCache's chunk object <-> the engine's ``[2, L, C, H*D]`` (K post-RoPE, then V).

    Split K/V objects, ``[2, L, C, H*D]``, need no conversion: that shape is LMCache's own KV format,
    which its GPU connectors (CUDA engines) gather into themselves, so no paged layout of the
    engine's enters the object and nothing is probed. vLLM CPU's objects are ``[L, C, H*2D]``:
    LMCache gathers token *rows* of vLLM CPU's paged cache ``[blocks, H, block_size, 2D]``, so
    each block of an object holds its page's memory as ``[block_size rows, H, 2D]``. Where a
    token's K and V sit inside a page depends on the attention ISA vLLM picked (K transposed for
    the vector kernels, 16-token groups of bf16 pairs with AMX, ...); ``paged`` is that layout as
    :func:`~kvshrink.plugins.vllm.cpu_kv_layout.probe_paged_layout` learned it from vLLM's own
    cache writer, the same probe the in-process CPU connector uses. Decode and encode are then one
    gather / scatter over a precomputed index, on every ISA vLLM CPU supports.

    Buffers: ``decode`` returns a new tensor; ``encode`` returns a new tensor (neither input is
    changed). Immutable after construction; safe from any thread."""

    def __init__(self, shape: tuple[int, ...], layers: int, heads: int, head_dim: int,
                 paged: "PagedLayout | None" = None) -> None:
        self.shape, self.layers, self.heads, self.head_dim = shape, layers, heads, head_dim
        self.fused = len(shape) == 3
        if self.fused and paged is None:
            from kvshrink.plugins.vllm.cpu_kv_layout import KVLayoutError

            raise KVLayoutError("a vLLM CPU chunk object [L, C, H*2D] needs the probed paged layout")
        self.paged = paged if self.fused else None
        self._index = _object_index(paged, shape[1]) if self.fused else None

    @property
    def name(self) -> str:
        if self.paged is None:
            return "split"
        return f"vllm-cpu-{self.paged.isa}-bs{self.paged.block_size}"

    def decode(self, x: "torch.Tensor") -> "torch.Tensor":
        if self._index is None:
            return x
        layers, tokens, _ = x.shape
        kv = x.reshape(layers, -1).index_select(1, self._index)  # [L, 2*C*H*D]: K rows, then V rows
        return kv.view(layers, 2, tokens, self.heads * self.head_dim).transpose(0, 1).contiguous()

    def encode(self, kv: "torch.Tensor") -> "torch.Tensor":
        import torch

        if self._index is None:
            return kv
        _, layers, tokens, _ = kv.shape
        out = torch.empty(layers, self._index.numel(), dtype=kv.dtype)
        out.index_copy_(1, self._index, kv.transpose(0, 1).reshape(layers, -1))
        return out.view(layers, tokens, 2 * self.heads * self.head_dim)


def _object_index(paged: "PagedLayout", tokens: int) -> "torch.Tensor":
    """For every element of ``[2, tokens, H, D]`` (K/V, token, head, dim), its offset in one layer of
    a vLLM CPU chunk object (``tokens`` whole blocks of token rows of the paged cache)."""
    import torch

    from kvshrink.plugins.vllm.cpu_kv_layout import KVLayoutError

    bs, heads, dim = paged.block_size, paged.num_kv_heads, paged.head_size
    if tokens % bs:
        raise KVLayoutError(f"a chunk of {tokens} tokens is not whole blocks of {bs}")
    page = paged.positions  # [bs, 2, H, D]: offsets in the page [H, bs, 2D]
    head, within = page // (bs * 2 * dim), page % (bs * 2 * dim)
    row, col = within // (2 * dim), within % (2 * dim)
    in_block = row * (heads * 2 * dim) + head * (2 * dim) + col  # the same element in [bs rows, H, 2D]
    blocks = torch.arange(tokens // bs, dtype=torch.long).view(-1, 1, 1, 1, 1) * paged.page_elems
    index = (blocks + in_block.unsqueeze(0)).view(tokens, 2, heads, dim)
    return index.permute(1, 0, 2, 3).reshape(-1).contiguous()


class FuseFallback(KVShrinkError):
    """A fusion job gave up; ``reason`` is the counter it is counted under. Never leaves the module."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.reason = reason


@dataclass(frozen=True)
class FuseModuleSettings:
    """The ``fuse`` section (store YAML) or the module's inline ``config``.

    ``ratio`` / ``check_layer``: CacheBlend's recompute fraction and check layer (they name the fused
    salt). ``model_path``: the bf16 checkpoint vLLM serves (the same weights; required when
    enabled). ``threads``: torch threads of the server process (0: torch's default). ``timeout_s``:
    a job still running after this writes nothing and falls back. ``max_pending``: fusion jobs
    queued or running; a lookup beyond them is not fused. ``min_reuse_chunks``: fewer reusable
    chunks than this is not worth fusing. ``max_indexed_chunks``: the index forgets the oldest
    beyond this (about 1 KiB each). ``anchor``: tokens the index looks up at each offset.
    """

    enabled: bool = False
    ratio: float = 0.15
    check_layer: int = 1
    model_path: str | None = None
    threads: int = 0
    timeout_s: float = 120.0
    max_pending: int = 4
    min_reuse_chunks: int = 1
    max_indexed_chunks: int = 65536
    anchor: int = 16

    @property
    def fuse(self) -> FuseSettings:
        return FuseSettings(ratio=self.ratio, check_layer=self.check_layer)

    @classmethod
    def from_config(cls, data: Mapping[str, Any] | None, where: str = _WHERE) -> "FuseModuleSettings":
        """Validate a ``fuse`` mapping; ``store_config`` (the module's config only) names a store YAML
        whose ``fuse:`` section is read first, inline keys override it. ConfigError names the key."""
        data = dict(mapping_value(data, where, {*SETTING_KEYS, "store_config"}))
        path = data.pop("store_config", None)
        if path is not None:
            if not isinstance(path, str) or not path:
                raise ConfigError(f"{where}.store_config", f"expected the path of a store YAML, got {path!r}")
            section = load_yaml(path, f"{where}.store_config").get("fuse")
            data = {**mapping_value(section, f"{path}: fuse", SETTING_KEYS), **data}
        d = cls()
        enabled = bool_value(data.get("enabled", d.enabled), f"{where}.enabled")
        ratio = number_value(data.get("ratio", d.ratio), f"{where}.ratio", maximum=1.0)
        check_layer = int_value(data.get("check_layer", d.check_layer), f"{where}.check_layer", minimum=1)
        model_path = data.get("model_path", d.model_path)
        if model_path is not None and (not isinstance(model_path, str) or not model_path):
            raise ConfigError(f"{where}.model_path", f"expected a checkpoint directory, got {model_path!r}")
        if enabled and model_path is None:
            raise ConfigError(f"{where}.model_path", "required when fusion is enabled: the checkpoint vLLM serves")
        return cls(enabled=enabled, ratio=ratio, check_layer=check_layer, model_path=model_path,
                   threads=int_value(data.get("threads", d.threads), f"{where}.threads", minimum=0, maximum=1024),
                   timeout_s=number_value(data.get("timeout_s", d.timeout_s), f"{where}.timeout_s", above=True,
                                          maximum=290.0),  # LMCache's clients give up after 300 s
                   max_pending=int_value(data.get("max_pending", d.max_pending), f"{where}.max_pending", minimum=1),
                   min_reuse_chunks=int_value(data.get("min_reuse_chunks", d.min_reuse_chunks),
                                              f"{where}.min_reuse_chunks", minimum=1),
                   max_indexed_chunks=int_value(data.get("max_indexed_chunks", d.max_indexed_chunks),
                                                f"{where}.max_indexed_chunks", minimum=1),
                   anchor=int_value(data.get("anchor", d.anchor), f"{where}.anchor", minimum=1))


@dataclass
class _Job:
    key: IPCCacheServerKey
    tp_size: int
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False


class KVFuseModule:
    """The server module. ``lookup_module`` / ``transfer_module`` are LMCache's built-in
    ``LookupModule`` and ``EngineDrivenTransferModule`` (borrowed, owned by the server);
    ``engine`` is owned here and used by the fusion thread only."""

    def __init__(self, ctx: Any, lookup_module: Any, transfer_module: Any, settings: FuseModuleSettings,
                 engine: "FuseEngine") -> None:
        self._ctx = ctx
        self._lookup = lookup_module
        self._transfer = transfer_module
        self.settings = settings
        self.engine = engine
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self.fuse_seconds = 0.0
        self.last_fusion: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._indexes: dict[tuple[str, str], ContentIndex] = {}
        self._indexed: OrderedDict[Any, ContentIndex] = OrderedDict()  # every indexed key, oldest first
        self._pending: dict[str, _Job] = {}
        self._fused_requests: OrderedDict[str, None] = OrderedDict()
        self._fused_keys: OrderedDict[Any, None] = OrderedDict()
        self._salt_tag = fused_salt(settings.fuse)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvshrink-fuse")
        self._warned: set[str] = set()
        self._block_sizes: dict[tuple[str, int], int] = {}  # (model, world size) -> vLLM's paged block size
        self._codecs: dict[tuple[str, int], ChunkCodec] = {}  # chunk codecs checked against the model
        self.last_fallback: dict[str, Any] = {}

    # -- EngineModule -------------------------------------------------------------------------------
    @property
    def context(self) -> Any:
        return self._ctx

    def report_status(self) -> dict:
        with self._lock:
            return {"kvshrink_fuse": {"salt": self._salt_tag, "ratio": self.settings.ratio,
                                      "check_layer": self.settings.check_layer, **dict(self.counters),
                                      "indexed_chunks": len(self._indexed), "pending": len(self._pending),
                                      "fuse_seconds": round(self.fuse_seconds, 3),
                                      "last_fusion": dict(self.last_fusion),
                                      "last_fallback": dict(self.last_fallback),
                                      "layouts": {f"{m}@{w}": c.name for (m, w), c in self._codecs.items()}}}

    def close(self) -> None:
        with self._lock:
            for job in self._pending.values():
                job.cancelled = True
        self._executor.shutdown(wait=True, cancel_futures=False)

    # -- handlers (same names, types and scheduling as the built-ins they replace) ------------------
    @request_handler()
    def register_kv_cache_engine_driven_context(
            self, payload: RegisterEngineDrivenContextPayload) -> RegisterEngineDrivenContextResponse:
        """The built-in registration; the engine's paged block size is remembered (vLLM CPU's chunk
        layout depends on it)."""
        with self._lock:
            self._block_sizes[(payload.model_name, payload.world_size)] = payload.block_size
        return self._transfer.register_kv_cache_engine_driven_context(payload)

    @request_handler(HandlerType.BLOCKING, requires_client_affinity=True)
    def commit_store(self, key: IPCCacheServerKey, instance_id: int, cpu_data: bytes) -> bool:
        """The built-in store, then the stored chunks join the content index."""
        stored = self._transfer.commit_store(key, instance_id, cpu_data)
        if stored:
            try:
                self._index_stored(key)
            except Exception:  # noqa: BLE001 - indexing is an optimization; the store succeeded
                log.exception("KV Fuse: indexing the chunks of %s failed", key.request_id)
        return stored

    @request_handler(HandlerType.BLOCKING)
    def lookup(self, key: IPCCacheServerKey, tp_size: int) -> None:
        """Stock for every salt but the fused one; for that, queue a fusion job and return."""
        salt = key.cache_salt
        if not is_fused_salt(salt):
            return self._lookup.lookup(key, tp_size)
        with self._lock:
            self.counters["fused_salt_lookups"] += 1
            if salt != self._fused_salt_for(base_salt_of(salt)):
                self.counters["foreign_salt"] += 1  # made with other settings: never answered with ours
                job = None
            elif key.request_id in self._pending:
                return None  # a job for this request runs; it calls the built-in lookup itself
            elif len(self._pending) >= self.settings.max_pending:
                self.counters["fallback_busy"] += 1
                job = None
            else:
                job = _Job(key, tp_size, time.monotonic() + self.settings.timeout_s)
                self._pending[key.request_id] = job
        if job is None:
            return self._lookup.lookup(key, tp_size)
        self._executor.submit(self._run_job, job)
        return None

    @request_handler(HandlerType.BLOCKING)
    def query_prefetch_status(self, request_id: str) -> int | None:
        with self._lock:
            if request_id in self._pending:
                return None  # still fusing: the scheduler polls again
        return self._lookup.query_prefetch_status(request_id)

    @request_handler(HandlerType.BLOCKING)
    def wait_prefetch_status(self, request_id: str, timeout: float) -> int | None:
        start = time.monotonic()
        with self._lock:
            job = self._pending.get(request_id)
        if job is not None and not job.done.wait(timeout):
            return None
        return self._lookup.wait_prefetch_status(request_id, max(0.0, timeout - (time.monotonic() - start)))

    @request_handler(HandlerType.BLOCKING)
    def end_session(self, request_id: str) -> None:
        with self._lock:
            job = self._pending.get(request_id)
            if job is not None:
                job.cancelled = True  # its built-in lookup would take locks nobody releases
            self._fused_requests.pop(request_id, None)
        return self._lookup.end_session(request_id)

    # -- the index ----------------------------------------------------------------------------------
    def _fused_salt_for(self, base: str) -> str:
        return fused_salt(self.settings.fuse, base)

    def _index_stored(self, key: IPCCacheServerKey) -> None:
        if key.world_size != 1:
            return
        with self._lock:
            if key.request_id in self._fused_requests:
                return  # computed over a fused prefix: not exact, never a source
        size = self._ctx.chunk_size
        obj_keys = self._ctx.resolve_obj_keys(key, [0])[0]
        tokens = key.token_ids
        first = key.start // size
        with self._lock:
            index = self._index_of(key.model_name, base_salt_of(key.cache_salt))
            for i, obj_key in enumerate(obj_keys):
                start = (first + i) * size
                if start + size > len(tokens):
                    break
                if index.add(obj_key, tokens[start:start + size], start):
                    self._indexed[obj_key] = index
                    self._indexed.move_to_end(obj_key)
                    self.counters["indexed_chunks_added"] += 1
            while len(self._indexed) > self.settings.max_indexed_chunks:
                old, owner = self._indexed.popitem(last=False)
                owner.remove(old)
                self.counters["indexed_chunks_dropped"] += 1

    def _index_of(self, model_name: str, tenant: str) -> ContentIndex:
        index = self._indexes.get((model_name, tenant))
        if index is None:
            index = self._indexes[(model_name, tenant)] = ContentIndex(self.settings.anchor)
        return index

    def _forget(self, keys: list[Any]) -> None:
        with self._lock:
            for obj_key in keys:
                owner = self._indexed.pop(obj_key, None)
                if owner is not None:
                    owner.remove(obj_key)
                    self.counters["indexed_chunks_dropped"] += 1

    # -- the fusion job (the module's thread) -------------------------------------------------------
    def _run_job(self, job: _Job) -> None:
        key = job.key
        outcome = "fallback_error"
        started = time.monotonic()
        try:
            outcome = self._fuse(job)
        except FuseFallback as exc:
            outcome = exc.reason
            with self._lock:
                self.last_fallback = {"request_id": key.request_id, "reason": exc.reason, "detail": str(exc)}
            log.info("KV Fuse: %s falls back (%s): %s", key.request_id, exc.reason, exc)
        except Exception:  # noqa: BLE001 - never raised into LMCache; the request is served stock
            log.exception("KV Fuse: fusing %s failed; served without fusion", key.request_id)
        finally:
            with self._lock:
                self.counters[outcome] += 1
                cancelled = job.cancelled
                if cancelled:
                    self.counters["cancelled"] += 1
            try:
                if not cancelled:
                    self._lookup.lookup(key, job.tp_size)
            except Exception:  # noqa: BLE001
                log.exception("KV Fuse: the built-in lookup of %s failed", key.request_id)
            finally:
                with self._lock:
                    self._pending.pop(key.request_id, None)
                job.done.set()
            log.info("KV Fuse: %s -> %s in %.2f s", key.request_id, outcome, time.monotonic() - started)

    def _fuse(self, job: _Job) -> str:
        import torch

        from lmcache.v1.distributed.api import ipc_key_to_object_keys

        from kvshrink.fuse.engine import ReusedSegment

        key, ctx, engine = job.key, self._ctx, self.engine
        size = ctx.chunk_size
        chunks = min(key.end, len(key.token_ids)) // size
        if chunks == 0:
            return "no_match"
        if key.world_size != 1:
            raise FuseFallback("fallback_layout", f"world size {key.world_size} is not fused")
        layout, codec, checked = self._layout(key)
        tokens = list(key.token_ids[:chunks * size])
        hashes = ctx.token_hasher.compute_chunk_hashes(tokens, end=chunks * size)
        own = ipc_key_to_object_keys(key, hashes, [0])[0]
        present = self._read(own, layout, key.request_id, job)
        prefix = 0
        while prefix < chunks and present[prefix] is not None:
            prefix += 1
        with self._lock:
            if any(k in self._fused_keys for k in own[:prefix]):
                self._remember_fused(key.request_id, [])  # what vLLM computes over a fused prefix is no source
        if prefix == chunks:
            return "already_fused"
        with self._lock:
            index = self._indexes.get((key.model_name, base_salt_of(key.cache_salt)))
            matches = index.match(tokens, start=prefix * size) if index is not None else []
        if len(matches) < self.settings.min_reuse_chunks:
            return "no_match"
        sources = self._read([m.key for m in matches], layout, key.request_id, job)
        missing = [m.key for m, kv in zip(matches, sources) if kv is None]
        if missing:
            self._forget(missing)
            raise FuseFallback("fallback_missing", f"{len(missing)} of {len(matches)} reusable chunks "
                                                   "are gone (evicted or unreadable)")
        if not checked:
            self._check_codec(key, codec, tokens[matches[0].start:matches[0].end], matches[0].source_start, sources[0])
        sources = [codec.decode(x) for x in sources]
        present = [None if x is None else codec.decode(x) for x in present]
        errors = [self._key_error(tokens[m.start:m.end], m.source_start, kv) for m, kv in zip(matches, sources)]
        errors += [self._key_error(tokens[i * size:(i + 1) * size], i * size, present[i]) for i in range(prefix)]
        bad = [m.key for m, err in zip(matches, errors) if not err <= KEY_CHECK_TOLERANCE]
        if bad or not all(err <= KEY_CHECK_TOLERANCE for err in errors[len(matches):]):
            self._forget(bad)
            raise FuseFallback("fallback_corrupt", f"stored layer-0 keys deviate from the model's by up to "
                                                   f"{max(errors):.3g} (> {KEY_CHECK_TOLERANCE}): damaged "
                                                   "bytes, another model or another layout")
        prefix_kv = torch.cat([present[i] for i in range(prefix)], dim=2) if prefix else None
        segments = [ReusedSegment(start=m.start, source_start=m.source_start, kv=kv)
                    for m, kv in zip(matches, sources)]
        self._check_time(job)
        began = time.monotonic()
        result = engine.fuse(tokens, segments, self.settings.ratio, self.settings.check_layer,
                             prefix_kv=prefix_kv, logits_at=())
        took = time.monotonic() - began
        self._check_time(job)
        written, skipped = self._write(own[prefix:], result.kv[:, :, prefix * size:], layout, codec, size)
        reused = sum(m.length for m in matches)
        with self._lock:
            self._remember_fused(key.request_id, own[prefix:])
            self.fuse_seconds += took
            self.counters.update(reused_chunks=len(matches), reused_tokens=reused, prefix_chunks=prefix,
                                 recomputed_tokens=result.recomputed_tokens,
                                 gap_tokens=result.computed_tokens - result.recomputed_tokens,
                                 fused_chunks_written=written, fused_chunks_not_written=skipped)
            self.last_fusion = {"request_id": key.request_id, "tokens": len(tokens), "prefix_chunks": prefix,
                                "reused_chunks": len(matches), "reused_tokens": reused,
                                "gap_tokens": result.computed_tokens - result.recomputed_tokens,
                                "recomputed_tokens": result.recomputed_tokens, "written": written,
                                "layer0_key_error": round(max(errors), 5),
                                "seconds": round(took, 3)}
        return "fusions"

    def _remember_fused(self, request_id: str, keys: list[Any]) -> None:
        """(Under the lock.) ``request_id`` loads fused KV; ``keys`` now hold fused KV."""
        self._fused_requests[request_id] = None
        while len(self._fused_requests) > FUSED_REQUESTS_KEPT:
            self._fused_requests.popitem(last=False)
        for k in keys:
            self._fused_keys[k] = None
        while len(self._fused_keys) > FUSED_KEYS_KEPT:
            self._fused_keys.popitem(last=False)

    def _layout(self, key: IPCCacheServerKey) -> tuple[Any, ChunkCodec, bool]:
        """The registered chunk layout, its codec and whether that codec was already checked against
        the model's own keys (once per model); FuseFallback("fallback_layout") where the registered
        shape is not the fusion model's or vLLM CPU's paged layout cannot be probed here."""
        import torch

        layouts = self._ctx.layout_desc_registry.find_group_layout_descs(key.model_name, key.world_size)
        if not layouts or len(layouts) != 1 or 0 not in layouts:
            raise FuseFallback("fallback_layout", f"{len(layouts or {})} object groups registered; one is fused")
        layout = layouts[0]
        e, size = self.engine, self._ctx.chunk_size
        with self._lock:
            block = self._block_sizes.get((key.model_name, key.world_size))
            checked = self._codecs.get((key.model_name, key.world_size))
        if checked is not None:
            return layout, checked, True
        split, fused = (2, e.num_layers, size, e.kv_width), (e.num_layers, size, 2 * e.kv_width)
        shapes = [tuple(s) for s in layout.shapes]
        dtype = e.kv_dtype or torch.float32
        ok = (shapes == [split] or (shapes == [fused] and block is not None and size % block == 0))
        if not ok or list(layout.dtypes) != [dtype]:
            self._log_once(key.model_name, "KV Fuse: %s registered chunks %s %s (block size %s), but the fusion "
                           "model makes %s or %s %s: not fused", key.model_name, shapes, list(layout.dtypes), block,
                           split, fused, e.kv_dtype)
            raise FuseFallback("fallback_layout", f"layout {shapes} is neither {split} nor {fused}")
        if shapes == [split]:  # LMCache's own format: no layout to check (a bad chunk is corrupt, not misread)
            return layout, ChunkCodec(split, e.num_layers, e.num_kv_heads, e.head_dim), True
        from kvshrink.plugins.vllm.cpu_kv_layout import KVLayoutError, probe_paged_layout

        try:  # vLLM CPU's own cache writer, as the vLLM engine beside this server runs it
            paged = probe_paged_layout(e.num_kv_heads, block, e.head_dim, dtype)
        except KVLayoutError as exc:
            self._log_once(key.model_name, "KV Fuse: %s: vLLM CPU's paged KV layout cannot be probed in the "
                           "cache server's process (%s): not fused", key.model_name, exc)
            raise FuseFallback("fallback_layout", f"vLLM CPU's paged layout cannot be probed here: {exc}") from exc
        return layout, ChunkCodec(fused, e.num_layers, e.num_kv_heads, e.head_dim, paged), False

    def _log_once(self, model_name: str, message: str, *args: Any) -> None:
        """Log a model's layout problem once (every request of it would repeat it)."""
        if model_name not in self._warned:
            self._warned.add(model_name)
            log.error(message, *args)

    def _check_codec(self, key: IPCCacheServerKey, codec: ChunkCodec, tokens: list[int], start: int,
                     raw: "torch.Tensor") -> None:
        """Before a model's first fusion: a stored chunk's layer-0 keys, decoded by ``codec``, must be
        the model's own (remembered per model). Else the layout is not what the probe says (vLLM runs
        on another ISA than this process, another engine) and nothing of this model is fused."""
        error = self._key_error(tokens, start, codec.decode(raw))
        if not error <= KEY_CHECK_TOLERANCE:
            raise FuseFallback("fallback_layout", f"the {codec.name} chunk layout does not give the model's layer-0 "
                                                  f"keys (error {error:.3g} > {KEY_CHECK_TOLERANCE})")
        with self._lock:
            self._codecs[(key.model_name, key.world_size)] = codec
        log.warning("KV Fuse: %s chunks decode as %s (layer-0 key error %.4f)", key.model_name, codec.name, error)

    def _key_error(self, tokens: list[int], start: int, kv: "torch.Tensor") -> float:
        """Worst per-token relative error of ``kv``'s layer-0 keys against the model's own; infinite
        when any value of ``kv`` is not finite."""
        import torch

        if not bool(torch.isfinite(kv).all()):
            return float("inf")
        fresh = self.engine.layer0_keys(tokens, range(start, start + len(tokens)))
        stored = kv[0, 0].float()
        err = (stored - fresh).norm(dim=-1) / fresh.norm(dim=-1).clamp_min(1e-6)
        value = float(err.max())
        return value if value == value else float("inf")  # NaN (non-finite bytes): never within tolerance

    def _check_time(self, job: _Job) -> None:
        if job.cancelled:
            raise FuseFallback("cancelled", "the request ended")
        if time.monotonic() > job.deadline:
            raise FuseFallback("fallback_timeout", f"past timeout_s {self.settings.timeout_s}")

    def _read(self, keys: list[Any], layout: Any, request_id: str, job: _Job) -> "list[torch.Tensor | None]":
        """Copies of the stored chunks ``keys`` (None where one is not stored or not readable): one
        prefetch into L1 (L2 loads included), read, locks released."""
        from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec

        if not keys:
            return []
        unique = list(dict.fromkeys(keys))
        sm = self._ctx.storage_manager
        spec = PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=unique, object_group_id=0, layout_desc=layout)],
                                num_kv_readers=1, fetching_policy="full")
        handle = sm.submit_prefetch_task(spec, external_request_id=f"kvfuse-{request_id}")
        if not sm.wait_prefetch_status(handle, min(READ_TIMEOUT_S, max(1.0, job.deadline - time.monotonic()))):
            raise FuseFallback("fallback_timeout", "reading stored chunks timed out")
        result = sm.query_prefetch_status(handle)
        if result is None:
            raise FuseFallback("fallback_missing", "the read's result was taken by someone else")
        bits = result.hit_cells[0] if result.hit_cells else None
        hit = [k for i, k in enumerate(unique) if bits is not None and bits.test(i)]
        owners = result.l1_owners or None
        copies: dict[Any, Any] = {}
        if hit:
            try:
                with sm.read_prefetched_results(hit, l1_owners=owners) as objs:
                    for obj_key, obj in zip(hit, objs or ()):
                        if obj is not None and obj.tensor is not None:
                            copies[obj_key] = obj.tensor.detach().clone()
            finally:
                sm.finish_read_prefetched(hit, read_locks=1, l1_owners=owners)
        want = tuple(layout.shapes[0])
        return [copies[k] if k in copies and tuple(copies[k].shape) == want else None for k in keys]

    def _write(self, keys: list[Any], kv: "torch.Tensor", layout: Any, codec: ChunkCodec,
               size: int) -> tuple[int, int]:
        """Write chunk ``i`` of ``kv`` under ``keys[i]``; (written, not written). A key that is
        already stored (or cannot be reserved) keeps what it holds."""
        sm = self._ctx.storage_manager
        reserved = sm.reserve_write(keys, layout)
        written = {}
        try:
            for i, obj_key in enumerate(keys):
                obj = reserved.get(obj_key)
                if obj is None or obj.tensor is None:
                    continue
                obj.tensor.copy_(codec.encode(kv[:, :, i * size:(i + 1) * size]))
                written[obj_key] = obj
        finally:
            if written:  # as LMCache's own engine-driven store: only what was copied in is admitted
                sm.finish_write_by_owner(sm.prepare_write_completion(written))
        return len(written), len(keys) - len(written)


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
