"""LMCache's "GPU connector" for vLLM's CPU build: tokens between vLLM CPU's paged KV and LMCache.

LMCache's in-process runtime moves KV between the engine's cache and its ``MemoryObj`` chunks
through a connector chosen by ``lmcache.v1.gpu_connector.CreateGPUConnector``, which has none for
CPU. This one reads vLLM CPU's per-layer caches (see :mod:`kvshrink.plugins.vllm.cpu_kv_layout` for
their layout) by ``slot_mapping`` into LMCache's ``KV_2LTD`` objects ``[2, layers, tokens,
heads*head_dim]`` and writes them back with vLLM's own cache writer. Everything is vectorised per
layer; nothing loops over tokens in Python. LMCache's engine gets it from our KV connector,
:class:`~kvshrink.plugins.vllm.lmcache_cpu_connector.KVShrinkLMCacheConnector`, through
:func:`create_cpu_connector`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from kvshrink.errors import ConfigError
from kvshrink.plugins.vllm.cpu_kv_layout import KVLayoutError, PagedLayout, gather_tokens, probe_paged_layout, write_tokens

logger = logging.getLogger(__name__)

# LMCache config flags whose connectors exist only for accelerators.
_UNSUPPORTED_FLAGS = ("use_layerwise", "enable_blending", "use_gpu_connector_v3")

# Per chunk: the memory object's tensor, the first token to move, and the slots of the tokens moved.
_Chunk = tuple[torch.Tensor, int, torch.Tensor]


class VLLMPagedMemCPUConnector(GPUConnectorInterface):
    """Moves whole chunks between vLLM CPU's paged KV cache and LMCache ``KV_2LTD`` memory objects.

    Expected kwargs on every call, as LMCache's vLLM adapter passes them: ``kvcaches`` (one
    ``[num_blocks, heads, block_size, 2*head_size]`` tensor per layer), ``slot_mapping`` (one slot
    per token of the whole sequence; chunk ``[start, end)`` uses ``slot_mapping[start:end]``) and,
    when loading, ``vllm_cached_tokens`` (tokens vLLM already holds; they are not overwritten).
    Not thread-safe: LMCache calls it from the worker's forward thread.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                 isa: str | None = None) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.dtype = dtype
        self.isa = isa  # None: the ISA vLLM's attention backend picks
        self.kvcaches: list[torch.Tensor] | None = None
        self.layout: PagedLayout | None = None
        self.num_blocks = 0

    @classmethod
    def from_metadata(cls, metadata: Any, isa: str | None = None) -> "VLLMPagedMemCPUConnector":
        """Build from LMCache's ``LMCacheMetadata`` (``kv_shape`` = layers, 2, chunk, heads, head_size)."""
        num_layers, kv_size, _chunk, num_kv_heads, head_size = metadata.kv_shape
        if metadata.use_mla or kv_size != 2:
            raise KVLayoutError("MLA models are not supported by the CPU connector (LMCache kv_shape "
                                f"{tuple(metadata.kv_shape)}, use_mla={metadata.use_mla})")
        return cls(num_layers, num_kv_heads, head_size, metadata.kv_dtype, isa)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_size])

    def initialize_kvcaches_ptr(self, **kwargs: Any) -> None:
        if "kvcaches" in kwargs:
            self._bind(kwargs["kvcaches"])

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self.batched_from_gpu([memory_obj], [start], [end], **kwargs)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self.batched_to_gpu([memory_obj], [start], [end], **kwargs)

    def batched_from_gpu(self, memory_objs: Sequence[MemoryObj], starts: Sequence[int], ends: Sequence[int],
                         **kwargs: Any) -> None:
        """Copy tokens ``[start, end)`` of every chunk out of the paged cache into its memory object."""
        caches, layout, chunks = self._prepare(memory_objs, starts, ends, kwargs)
        for tensor, _first, slots in chunks:
            k_index, v_index = layout.token_indices(slots)
            for layer_idx, layer in enumerate(caches):
                gather_tokens(layer, k_index, v_index, tensor[0, layer_idx], tensor[1, layer_idx])

    def batched_to_gpu(self, memory_objs: Sequence[MemoryObj] | None = None, starts: Sequence[int] | None = None,
                       ends: Sequence[int] | None = None, **kwargs: Any) -> None:
        """Write every chunk's tokens into the paged cache, skipping the prefix vLLM already holds."""
        if memory_objs is None or starts is None or ends is None:
            raise KVLayoutError("the CPU connector is not layerwise: batched_to_gpu needs memory_objs, starts and ends")
        vllm_cached = int(kwargs.get("vllm_cached_tokens", 0) or 0)
        caches, layout, chunks = self._prepare(memory_objs, starts, ends, kwargs, keep_first=vllm_cached)
        shape = (-1, self.num_kv_heads, self.head_size)
        for tensor, first, slots in chunks:
            if slots.numel() == 0:
                continue
            for layer_idx, layer in enumerate(caches):
                keys = tensor[0, layer_idx, first:].view(shape)
                values = tensor[1, layer_idx, first:].view(shape)
                write_tokens(layer, keys, values, slots, layout.isa)

    # ------------------------------------------------------------------ checks

    def _prepare(self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int],
                 kwargs: Mapping[str, Any], keep_first: int = 0,
                 ) -> tuple[list[torch.Tensor], PagedLayout, list[_Chunk]]:
        """Check everything before moving a byte, so that bad input changes nothing.

        Tokens before ``keep_first`` (vLLM's own cached prefix) are left out; their slots may be -1.
        """
        if not (len(memory_objs) == len(starts) == len(ends)):
            raise KVLayoutError(f"{len(memory_objs)} memory objects but {len(starts)} starts and {len(ends)} ends")
        if any(isinstance(obj, (list, tuple)) for obj in memory_objs):
            raise KVLayoutError("nested (layerwise) memory object lists are not supported by the CPU connector")
        self.initialize_kvcaches_ptr(**kwargs)
        if self.kvcaches is None or self.layout is None:
            raise KVLayoutError("no KV caches: pass kvcaches=[per-layer tensors] (LMCache's vLLM adapter does)")
        slot_mapping = kwargs.get("slot_mapping")
        if not isinstance(slot_mapping, torch.Tensor):
            raise KVLayoutError("'slot_mapping' (a tensor with one slot per token) must be passed in kwargs")
        if slot_mapping.device.type != "cpu" or slot_mapping.dim() != 1:
            raise KVLayoutError(f"slot_mapping must be a 1-D CPU tensor, got {tuple(slot_mapping.shape)} "
                                f"on {slot_mapping.device}")
        if slot_mapping.dtype != torch.long:
            slot_mapping = slot_mapping.to(torch.long)
        chunks = []
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            if not 0 <= start < end <= slot_mapping.numel():
                raise KVLayoutError(f"chunk [{start}, {end}) is outside the slot mapping of "
                                    f"{slot_mapping.numel()} tokens")
            first = min(end - start, max(0, keep_first - start))
            slots = slot_mapping[start + first:end]
            self.layout.check_slots(slots, self.num_blocks)
            chunks.append((self._chunk_tensor(memory_obj, end - start), first, slots))
        return self.kvcaches, self.layout, chunks

    def _chunk_tensor(self, memory_obj: MemoryObj, num_tokens: int) -> torch.Tensor:
        fmt = memory_obj.metadata.fmt
        if fmt != MemoryFormat.KV_2LTD:
            raise KVLayoutError(f"memory object format is {fmt}; the CPU connector reads and writes KV_2LTD "
                                "[2, layers, tokens, heads*head_dim]")
        tensor = memory_obj.tensor
        if tensor is None:
            raise KVLayoutError("memory object has no tensor")
        expected = self.get_shape(num_tokens)
        if tensor.shape != expected:
            raise KVLayoutError(f"memory object has shape {tuple(tensor.shape)}; expected {tuple(expected)} "
                                f"for a chunk of {num_tokens} tokens")
        if tensor.dtype != self.dtype:
            raise KVLayoutError(f"memory object has dtype {tensor.dtype}; the KV cache is {self.dtype}")
        if not tensor.is_contiguous():
            raise KVLayoutError("memory object tensor is not contiguous")
        return tensor

    def _bind(self, kvcaches: Any) -> None:
        """Adopt vLLM's per-layer caches (checked once; LMCache passes the same tensors every call)."""
        if isinstance(kvcaches, Mapping):
            kvcaches = list(kvcaches.values())
        kvcaches = list(kvcaches)
        if self.kvcaches is not None and len(kvcaches) == len(self.kvcaches) and all(
                new is old for new, old in zip(kvcaches, self.kvcaches)):
            return
        if len(kvcaches) != self.num_layers:
            raise KVLayoutError(f"got {len(kvcaches)} KV cache layers; LMCache metadata says {self.num_layers}")
        if not all(isinstance(layer, torch.Tensor) for layer in kvcaches):
            raise KVLayoutError("every KV cache layer must be one tensor (vLLM CPU's fused K/V page layout)")
        first = kvcaches[0]
        if first.dim() != 4:
            raise KVLayoutError(f"KV cache layer has shape {tuple(first.shape)}; expected vLLM CPU's "
                                "[num_blocks, num_kv_heads, block_size, 2*head_size]")
        if first.device.type != "cpu":
            raise KVLayoutError(f"KV cache is on {first.device}; this connector is for vLLM's CPU build")
        layout = probe_paged_layout(self.num_kv_heads, int(first.shape[2]), self.head_size, self.dtype, self.isa)
        for idx, layer in enumerate(kvcaches):
            layout.check_layer(layer, name=f"KV cache layer {idx}")
            if layer.shape[0] != first.shape[0]:
                raise KVLayoutError(f"KV cache layer {idx} has {layer.shape[0]} blocks, layer 0 has {first.shape[0]}")
        self.kvcaches, self.layout, self.num_blocks = kvcaches, layout, int(first.shape[0])
        logger.info("CPU connector bound to %d KV layers of %s (%d blocks, isa=%s)", len(kvcaches),
                    tuple(first.shape), self.num_blocks, layout.isa)


def create_cpu_connector(config: Any, metadata: Any, layout_hints: Mapping[str, Any] | None = None,
                         isa: str | None = None) -> VLLMPagedMemCPUConnector:
    """What ``CreateGPUConnector`` returns for vLLM on CPU; refuses LMCache modes it cannot serve."""
    for flag in _UNSUPPORTED_FLAGS:
        if getattr(config, flag, False):
            raise ConfigError(flag, "is not supported by the vLLM CPU connector; set it to false")
    kv_layout = (layout_hints or {}).get("kv_layout")
    if kv_layout not in (None, "HND", "LBHNC"):
        raise KVLayoutError(f"vLLM reports KV layout {kv_layout!r}; the CPU connector supports vLLM CPU's "
                            "HND (LBHNC) layout")
    return VLLMPagedMemCPUConnector.from_metadata(metadata, isa=isa)
