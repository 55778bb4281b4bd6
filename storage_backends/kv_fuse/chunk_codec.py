"""LMCache's chunk objects as the fusion engine's ``[2, L, C, H*D]`` KV, and back.

LMCache stores what the engine hands it; for a CUDA engine that is LMCache's own split K/V format,
for vLLM CPU it is raw token rows of vLLM's paged cache, whose inner layout depends on the
attention ISA vLLM picked. :class:`ChunkCodec` converts one object either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvshrink.plugins.vllm.cpu_kv_layout import PagedLayout


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
