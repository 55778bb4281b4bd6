"""One request's fusion, start to finish, on the fusion thread.

(1) Read the prompt's own chunks under the fused salt: if all are there the prompt was fused before
(or computed under this salt) and nothing is done; the leading ones are the exact prefix. (2) Match
the rest of the prompt against the tenant's index and read the matched chunks by their original
keys. (3) Check every chunk's layer-0 keys, then :meth:`FuseEngine.fuse
<kvshrink.fuse.engine.FuseEngine.fuse>` re-rotates them and recomputes the gaps plus the top
``ratio`` of reused tokens. (4) Write the result's full chunks under the prompt's own chunk keys
with the fused salt: ordinary chunks of the store, compressed, tiered, evictable.

Any matched chunk that is missing, unreadable, of an unknown layout, not finite or whose layer-0
keys are not the model's makes the whole request fall back (FuseFallback): nothing is written and
vLLM prefills as stock does. Missing or damaged chunks leave the index.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvshrink.fuse.keys import base_salt_of

from .chunk_codec import ChunkCodec
from .chunk_io import ChunkIO
from .chunk_layouts import ChunkLayouts
from .job_queue import FusionJob
from .key_check import KEY_CHECK_TOLERANCE, layer0_key_error
from .outcomes import FuseFallback, FuseStats
from .settings import FuseModuleSettings
from .stored_chunks import StoredChunkIndex

if TYPE_CHECKING:
    import torch

    from kvshrink.fuse.engine import FuseEngine, FuseResult
    from kvshrink.fuse.index import Match


@dataclass(frozen=True)
class _Prompt:
    """What step (1) found: the prompt's whole-chunk tokens, own chunk keys and exact prefix."""

    tokens: list[int]
    own_keys: list[Any]
    prefix_raw: "list[torch.Tensor]"  # the leading own chunks that are stored (copies, as stored)
    layout: Any
    codec: ChunkCodec
    confirmed: bool

    @property
    def prefix(self) -> int:
        """Leading chunks of the prompt already stored under the fused salt."""
        return len(self.prefix_raw)


class Fusion:
    """Runs :meth:`run` for one job at a time (the job queue's thread owns the engine). ``ctx`` is
    LMCache's server context (borrowed); every tensor read is a copy owned here."""

    def __init__(self, ctx: Any, engine: "FuseEngine", settings: FuseModuleSettings, layouts: ChunkLayouts,
                 sources: StoredChunkIndex, chunk_io: ChunkIO, stats: FuseStats) -> None:
        self._ctx = ctx
        self._engine = engine
        self._settings = settings
        self._layouts = layouts
        self._sources = sources
        self._io = chunk_io
        self._stats = stats

    def run(self, job: FusionJob) -> str:
        """Fuse ``job``'s prompt; the outcome counter ("fusions", "already_fused", "no_match"), or
        FuseFallback naming the fallback."""
        key, size = job.key, self._ctx.chunk_size
        if min(key.end, len(key.token_ids)) // size == 0:
            return "no_match"
        if key.world_size != 1:
            raise FuseFallback("fallback_layout", f"world size {key.world_size} is not fused")
        prompt = self._read_prompt(job)
        chunks = len(prompt.own_keys)
        if self._sources.holds_fused(prompt.own_keys[:prompt.prefix]):
            self._sources.note_fused(key.request_id)  # what vLLM computes over a fused prefix is no source
        if prompt.prefix == chunks:
            return "already_fused"
        tenant = base_salt_of(key.cache_salt)
        matches = self._sources.match(key.model_name, tenant, prompt.tokens, prompt.prefix * size)
        if len(matches) < self._settings.min_reuse_chunks:
            return "no_match"
        sources, prefix_kv, errors = self._checked_sources(job, prompt, matches)
        result, took = self._fuse(job, prompt.tokens, matches, sources, prefix_kv)
        written, skipped = self._io.write(prompt.own_keys[prompt.prefix:], result.kv[:, :, prompt.prefix * size:],
                                          prompt.layout, prompt.codec, size)
        self._sources.note_fused(key.request_id, prompt.own_keys[prompt.prefix:])
        reused, gap = sum(m.length for m in matches), result.computed_tokens - result.recomputed_tokens
        self._stats.record_fusion(took, {
            "reused_chunks": len(matches), "reused_tokens": reused, "prefix_chunks": prompt.prefix,
            "recomputed_tokens": result.recomputed_tokens, "gap_tokens": gap, "fused_chunks_written": written,
            "fused_chunks_not_written": skipped}, {
            "request_id": key.request_id, "tokens": len(prompt.tokens), "prefix_chunks": prompt.prefix,
            "reused_chunks": len(matches), "reused_tokens": reused, "gap_tokens": gap,
            "recomputed_tokens": result.recomputed_tokens, "written": written,
            "layer0_key_error": round(max(errors), 5), "seconds": round(took, 3)})
        return "fusions"

    def _read_prompt(self, job: FusionJob) -> _Prompt:
        """Step (1): the prompt's own chunk keys under the fused salt and what is stored under them."""
        from lmcache.v1.distributed.api import ipc_key_to_object_keys

        key, ctx = job.key, self._ctx
        size = ctx.chunk_size
        chunks = min(key.end, len(key.token_ids)) // size
        layout, codec, confirmed = self._layouts.resolve(key.model_name, key.world_size)
        tokens = list(key.token_ids[:chunks * size])
        hashes = ctx.token_hasher.compute_chunk_hashes(tokens, end=chunks * size)
        own = ipc_key_to_object_keys(key, hashes, [0])[0]
        present = self._io.read(own, layout, key.request_id, job.deadline)
        prefix = 0
        while prefix < chunks and present[prefix] is not None:
            prefix += 1
        return _Prompt(tokens, own, present[:prefix], layout, codec, confirmed)

    def _checked_sources(self, job: FusionJob, prompt: _Prompt,
                         matches: "list[Match]") -> "tuple[list[torch.Tensor], list[torch.Tensor], list[float]]":
        """Step (2) and the checks: the matched chunks and the prefix chunks (decoded), and the
        layer-0 key error of each matched, then each prefix chunk. Gone or damaged sources leave the
        index and fail the request."""
        key = job.key
        raw = self._io.read([m.key for m in matches], prompt.layout, key.request_id, job.deadline)
        missing = [m.key for m, kv in zip(matches, raw) if kv is None]
        if missing:
            self._sources.forget(missing)
            raise FuseFallback("fallback_missing", f"{len(missing)} of {len(matches)} reusable chunks "
                                                   "are gone (evicted or unreadable)")
        tokens, codec, size = prompt.tokens, prompt.codec, self._ctx.chunk_size
        if not prompt.confirmed:
            first = matches[0]
            self._layouts.confirm(key.model_name, key.world_size, codec, tokens[first.start:first.end],
                                  first.source_start, raw[0])
        sources = [codec.decode(x) for x in raw]
        prefix_kv = [codec.decode(x) for x in prompt.prefix_raw]
        errors = [layer0_key_error(self._engine, tokens[m.start:m.end], m.source_start, kv)
                  for m, kv in zip(matches, sources)]
        errors += [layer0_key_error(self._engine, tokens[i * size:(i + 1) * size], i * size, kv)
                   for i, kv in enumerate(prefix_kv)]
        bad = [m.key for m, err in zip(matches, errors) if not err <= KEY_CHECK_TOLERANCE]
        if bad or not all(err <= KEY_CHECK_TOLERANCE for err in errors[len(matches):]):
            self._sources.forget(bad)
            raise FuseFallback("fallback_corrupt", f"stored layer-0 keys deviate from the model's by up to "
                                                   f"{max(errors):.3g} (> {KEY_CHECK_TOLERANCE}): damaged "
                                                   "bytes, another model or another layout")
        return sources, prefix_kv, errors

    def _fuse(self, job: FusionJob, tokens: list[int], matches: "list[Match]", sources: "list[torch.Tensor]",
              prefix: "list[torch.Tensor]") -> "tuple[FuseResult, float]":
        """Step (3): the engine's fusion and its seconds; nothing of it is kept past the deadline."""
        import torch

        from kvshrink.fuse.engine import ReusedSegment

        prefix_kv = torch.cat(prefix, dim=2) if prefix else None
        segments = [ReusedSegment(start=m.start, source_start=m.source_start, kv=kv) for m, kv in zip(matches, sources)]
        job.check_time(self._settings.timeout_s)
        began = time.monotonic()
        result = self._engine.fuse(tokens, segments, self._settings.ratio, self._settings.check_layer,
                                   prefix_kv=prefix_kv, logits_at=())
        took = time.monotonic() - began
        job.check_time(self._settings.timeout_s)
        return result, took
