"""Helpers for the vLLM CPU connector tests: vLLM CPU caches of SmolLM2's shape, written by vLLM."""

from __future__ import annotations

import torch

# SmolLM2-135M as vLLM CPU serves it: 30 layers, 3 KV heads of 64, blocks of 128 tokens, bf16.
NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 30, 3, 64, 128
DTYPE = torch.bfloat16


def new_kv_caches(num_blocks: int, num_layers: int = NUM_LAYERS, fill: float = float("nan")) -> list[torch.Tensor]:
    """Per-layer caches shaped like vLLM CPU allocates them, filled with a sentinel."""
    return [torch.full((num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE), fill, dtype=DTYPE)
            for _ in range(num_layers)]


def write_with_vllm(caches: list[torch.Tensor], kv: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
    """Write KV [2, L, T, H*D] at ``slots`` the way vLLM CPU's attention does, layer by layer."""
    from kvshrink.plugins.vllm.cpu_kv_layout import write_tokens

    shape = (-1, NUM_KV_HEADS, HEAD_SIZE)
    for layer_idx, layer in enumerate(caches):
        write_tokens(layer, kv[0, layer_idx].reshape(shape).contiguous(), kv[1, layer_idx].reshape(shape).contiguous(),
                     slots, isa)


def slots_for(blocks: list[int], start_offset: int, num_tokens: int) -> torch.Tensor:
    """Slots of ``num_tokens`` consecutive tokens laid out over ``blocks`` (vLLM's block table)."""
    positions = torch.arange(start_offset, start_offset + num_tokens)
    table = torch.tensor(blocks)
    return table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
