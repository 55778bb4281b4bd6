"""The paged layout probed from vLLM CPU's cache writer, checked against vLLM's source and real KV."""

from __future__ import annotations

import pytest
import torch

from cpu_kv_helpers import BLOCK_SIZE, DTYPE, HEAD_SIZE, NUM_KV_HEADS, new_kv_caches, slots_for, write_with_vllm

pytest.importorskip("vllm._custom_ops")
from kvshrink.plugins.vllm.cpu_kv_layout import (  # noqa: E402
    KVLayoutError,
    attention_isa,
    gather_tokens,
    probe_paged_layout,
)

ISAS = ("amx", "vec", "vec16")


def _layout(isa: str):
    """The probed layout of ``isa`` (AMX's too on a CPU without AMX tiles: packing needs none)."""
    from kvshrink.testing.vllm_cpu_isa import isa_unavailable

    reason = isa_unavailable(isa)
    if reason is not None:
        pytest.skip(reason)
    return probe_paged_layout(NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE, DTYPE, isa)


def _source_offsets(isa: str, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Offsets of K[t, d] and V[t, d] in a block page, transcribed from vLLM's reshape_and_cache.

    csrc/cpu/cpu_attn_amx.hpp: K packed as bf16 pairs in groups of 16 tokens; V with token pairs
    interleaved in groups of 16 dims. csrc/cpu/cpu_attn_vec.hpp: K column-major [head_dim,
    block_size], V row-major [block_size, head_dim]. Each head's page is K half then V half.
    """
    t = torch.arange(BLOCK_SIZE).view(-1, 1)
    d = torch.arange(HEAD_SIZE).view(1, -1)
    k_base = head * 2 * BLOCK_SIZE * HEAD_SIZE
    v_base = k_base + BLOCK_SIZE * HEAD_SIZE
    if isa == "amx":
        k = (t // 16) * 16 * HEAD_SIZE + (d // 2) * 32 + (t % 16) * 2 + d % 2
        v = (d // 16) * BLOCK_SIZE * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2
    else:
        k = d * BLOCK_SIZE + t
        v = t * HEAD_SIZE + d
    return k_base + k, v_base + v


@pytest.mark.parametrize("isa", ISAS)
def test_probe_agrees_with_the_layout_in_vllm_source(isa: str) -> None:
    layout = _layout(isa)
    for head in range(NUM_KV_HEADS):
        k, v = _source_offsets(isa, head)
        assert torch.equal(layout.positions[:, 0, head], k)
        assert torch.equal(layout.positions[:, 1, head], v)


def test_vllm_picks_amx_for_bf16_where_the_cpu_has_it() -> None:
    expected = "amx" if torch.cpu._is_amx_tile_supported() else None
    isa = attention_isa(DTYPE, BLOCK_SIZE, HEAD_SIZE)
    if expected:
        assert isa == expected
    assert probe_paged_layout(NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE, DTYPE).isa == isa


@pytest.mark.parametrize("isa", ISAS)
def test_gather_returns_exactly_what_vllm_wrote(isa: str, real_kv_tensor: torch.Tensor) -> None:
    """Real KV written by vLLM's writer at scattered slots (blocks out of order, starting mid-block)."""
    layout = _layout(isa)
    kv = real_kv_tensor[:, :2, :300]  # two layers are enough here
    slots = slots_for([7, 2, 5, 0], start_offset=50, num_tokens=300)
    caches = new_kv_caches(8, num_layers=2)
    for layer_idx, layer in enumerate(caches):
        write_with_vllm([layer], kv[:, layer_idx:layer_idx + 1], slots, isa)
        k_index, v_index = layout.token_indices(slots)
        out_k = torch.empty(300, NUM_KV_HEADS * HEAD_SIZE, dtype=DTYPE)
        out_v = torch.empty_like(out_k)
        gather_tokens(layer, k_index, v_index, out_k, out_v)
        assert torch.equal(out_k, kv[0, layer_idx])
        assert torch.equal(out_v, kv[1, layer_idx])


def test_k_and_v_are_not_concatenated_on_the_last_dim(real_kv_tensor: torch.Tensor) -> None:
    """The allocation shape [blocks, heads, block_size, 2*head_size] does not mean [K | V] per token."""
    isa = attention_isa(DTYPE, BLOCK_SIZE, HEAD_SIZE)
    kv = real_kv_tensor[:, :1, :BLOCK_SIZE]
    cache = torch.zeros(1, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=DTYPE)
    write_with_vllm([cache], kv, torch.arange(BLOCK_SIZE), isa)
    naive_k = cache[0, :, :, :HEAD_SIZE].transpose(0, 1).reshape(BLOCK_SIZE, -1)
    assert not torch.equal(naive_k, kv[0, 0])


def test_unsupported_dtype_is_refused_clearly() -> None:
    with pytest.raises(KVLayoutError, match="not supported"):
        probe_paged_layout(NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE, torch.float8_e4m3fn, "amx")


def test_checks_name_the_mismatch() -> None:
    layout = probe_paged_layout(NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE, DTYPE)
    with pytest.raises(KVLayoutError, match="shape"):
        layout.check_layer(torch.zeros(4, BLOCK_SIZE, NUM_KV_HEADS, 2 * HEAD_SIZE, dtype=DTYPE))
    with pytest.raises(KVLayoutError, match="dtype"):
        layout.check_layer(torch.zeros(4, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=torch.float16))
    with pytest.raises(KVLayoutError, match="contiguous"):
        layout.check_layer(torch.zeros(NUM_KV_HEADS, 4, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=DTYPE).transpose(0, 1))
    with pytest.raises(KVLayoutError, match=r"slots in \[-1"):
        layout.check_slots(torch.tensor([-1, 0, 1]), num_blocks=4)
    with pytest.raises(KVLayoutError, match="cache holds slots"):
        layout.check_slots(torch.tensor([4 * BLOCK_SIZE]), num_blocks=4)
