"""Which chunk layout a model's objects have, and the codec that reads them, learned once per model.

LMCache registers each model's object layout (shapes, dtypes); vLLM CPU registers its paged block
size. A split ``[2, L, C, H*D]`` object is LMCache's own format and needs nothing more. A vLLM CPU
object ``[L, C, H*2D]`` is read through the paged layout probed from vLLM's cache writer in this
process, which is only right where vLLM runs on the same ISA: before a model's first fusion a stored
chunk, decoded that way, must give the model's own layer-0 keys (:meth:`ChunkLayouts.confirm`).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Sequence

from .chunk_codec import ChunkCodec
from .key_check import KEY_CHECK_TOLERANCE, layer0_key_error
from .outcomes import FuseFallback

if TYPE_CHECKING:
    import torch

    from kvshrink.fuse.engine import FuseEngine

log = logging.getLogger(__name__)


class ChunkLayouts:
    """Per (model, world size): vLLM's paged block size and the codec confirmed for its chunks.

    ``ctx`` is LMCache's server context (borrowed: its ``layout_desc_registry`` and ``chunk_size``).
    Thread-safe: handler threads register block sizes, the fusion thread resolves and confirms; one
    lock guards the tables and is never held while probing or running the model."""

    def __init__(self, engine: "FuseEngine", ctx: Any) -> None:
        self._engine = engine
        self._ctx = ctx
        self._lock = threading.Lock()
        self._block_sizes: dict[tuple[str, int], int] = {}
        self._confirmed: dict[tuple[str, int], ChunkCodec] = {}
        self._warned: set[str] = set()  # models whose layout problem was logged (only once each)

    def register_block_size(self, model: str, world_size: int, block_size: int) -> None:
        with self._lock:
            self._block_sizes[(model, world_size)] = block_size

    def confirmed(self, model: str, world_size: int) -> ChunkCodec | None:
        """The codec confirmed for the model's chunks (None: not yet)."""
        with self._lock:
            return self._confirmed.get((model, world_size))

    def names(self) -> dict[str, str]:
        """``model@world_size`` -> the confirmed codec's name, for ``/status``."""
        with self._lock:
            return {f"{m}@{w}": c.name for (m, w), c in self._confirmed.items()}

    def resolve(self, model: str, world_size: int) -> tuple[Any, ChunkCodec, bool]:
        """The registered chunk layout, its codec and whether that codec is already confirmed
        (split objects need no confirmation). FuseFallback("fallback_layout") where the registered
        shape is not the fusion model's or vLLM CPU's paged layout cannot be probed here."""
        import torch

        layouts = self._ctx.layout_desc_registry.find_group_layout_descs(model, world_size)
        if not layouts or len(layouts) != 1 or 0 not in layouts:
            raise FuseFallback("fallback_layout", f"{len(layouts or {})} object groups registered; one is fused")
        layout = layouts[0]
        e, size = self._engine, self._ctx.chunk_size
        with self._lock:
            block = self._block_sizes.get((model, world_size))
            confirmed = self._confirmed.get((model, world_size))
        if confirmed is not None:
            return layout, confirmed, True
        split, fused = (2, e.num_layers, size, e.kv_width), (e.num_layers, size, 2 * e.kv_width)
        shapes = [tuple(s) for s in layout.shapes]
        dtype = e.kv_dtype or torch.float32
        ok = (shapes == [split] or (shapes == [fused] and block is not None and size % block == 0))
        if not ok or list(layout.dtypes) != [dtype]:
            self._log_once(model, "KV Fuse: %s registered chunks %s %s (block size %s), but the fusion "
                           "model makes %s or %s %s: not fused", model, shapes, list(layout.dtypes), block,
                           split, fused, e.kv_dtype)
            raise FuseFallback("fallback_layout", f"layout {shapes} is neither {split} nor {fused}")
        if shapes == [split]:  # LMCache's own format: no layout to check (a bad chunk is corrupt, not misread)
            return layout, ChunkCodec(split, e.num_layers, e.num_kv_heads, e.head_dim), True
        from kvshrink.plugins.vllm.cpu_kv_layout import KVLayoutError, probe_paged_layout

        try:  # vLLM CPU's own cache writer, as the vLLM engine beside this server runs it
            paged = probe_paged_layout(e.num_kv_heads, block, e.head_dim, dtype)
        except KVLayoutError as exc:
            self._log_once(model, "KV Fuse: %s: vLLM CPU's paged KV layout cannot be probed in the "
                           "cache server's process (%s): not fused", model, exc)
            raise FuseFallback("fallback_layout", f"vLLM CPU's paged layout cannot be probed here: {exc}") from exc
        return layout, ChunkCodec(fused, e.num_layers, e.num_kv_heads, e.head_dim, paged), False

    def confirm(self, model: str, world_size: int, codec: ChunkCodec, tokens: Sequence[int], start: int,
                raw: "torch.Tensor") -> None:
        """Before a model's first fusion: stored chunk ``raw`` (of ``tokens`` at ``start``), decoded
        by ``codec``, must give the model's own layer-0 keys; then ``codec`` is remembered for the
        model. Else the layout is not what the probe says (vLLM runs on another ISA than this
        process, another engine) and FuseFallback("fallback_layout") is raised. Fusion thread only."""
        error = layer0_key_error(self._engine, tokens, start, codec.decode(raw))
        if not error <= KEY_CHECK_TOLERANCE:
            raise FuseFallback("fallback_layout", f"the {codec.name} chunk layout does not give the model's layer-0 "
                                                  f"keys (error {error:.3g} > {KEY_CHECK_TOLERANCE})")
        with self._lock:
            self._confirmed[(model, world_size)] = codec
        log.warning("KV Fuse: %s chunks decode as %s (layer-0 key error %.4f)", model, codec.name, error)

    def _log_once(self, model: str, message: str, *args: Any) -> None:
        """Log a model's layout problem once (every request of it would repeat it)."""
        with self._lock:
            first = model not in self._warned
            self._warned.add(model)
        if first:
            log.error(message, *args)
