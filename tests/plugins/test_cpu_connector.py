"""The LMCache connector for vLLM CPU on real shapes: real SmolLM2 KV, vLLM's writer, LMCache objects."""

from __future__ import annotations

import pytest
import torch

from cpu_kv_helpers import (
    BLOCK_SIZE,
    DTYPE,
    HEAD_SIZE,
    NUM_KV_HEADS,
    NUM_LAYERS,
    new_kv_caches,
    slots_for,
    write_with_vllm,
)

pytest.importorskip("vllm._custom_ops")
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

from kvshrink.errors import ConfigError  # noqa: E402
from kvshrink.plugins.vllm.cpu_connector import VLLMPagedMemCPUConnector, create_cpu_connector  # noqa: E402
from kvshrink.plugins.vllm.cpu_kv_layout import KVLayoutError, attention_isa  # noqa: E402

CHUNK = 256
NUM_TOKENS = 2000  # 7 full chunks and a partial one that ends mid-block
BLOCK_TABLE = [11, 3, 15, 0, 8, 14, 1, 6, 9, 4, 13, 2, 7, 5, 10, 12]  # 16 blocks, out of order
BOUNDS = [(s, min(s + CHUNK, NUM_TOKENS)) for s in range(0, NUM_TOKENS, CHUNK)]


def _metadata(use_mla: bool = False) -> LMCacheMetadata:
    return LMCacheMetadata(model_name="smollm2", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=DTYPE, kv_shape=(NUM_LAYERS, 1 if use_mla else 2, CHUNK, NUM_KV_HEADS, HEAD_SIZE),
                           use_mla=use_mla)


@pytest.fixture(scope="module")
def isa() -> str:
    return attention_isa(DTYPE, BLOCK_SIZE, HEAD_SIZE)


@pytest.fixture
def connector() -> VLLMPagedMemCPUConnector:
    return create_cpu_connector(LMCacheEngineConfig.from_defaults(chunk_size=CHUNK), _metadata(), {"kv_layout": "HND"})


@pytest.fixture(scope="module")
def slot_mapping() -> torch.Tensor:
    return slots_for(BLOCK_TABLE, 0, NUM_TOKENS)


def _filled_objs(memory_objs, kv: torch.Tensor, bounds=BOUNDS):
    objs = []
    for start, end in bounds:
        obj = memory_objs(end - start)
        obj.tensor.copy_(kv[:, :, start:end])
        objs.append(obj)
    return objs


def _written(caches: list[torch.Tensor]) -> int:
    return sum(int((~layer.isnan()).sum()) for layer in caches)


def test_store_copies_exactly_what_vllm_computed(connector, memory_objs, real_kv_tensor, slot_mapping, isa) -> None:
    kv = real_kv_tensor[:, :, :NUM_TOKENS]
    caches = new_kv_caches(len(BLOCK_TABLE))
    write_with_vllm(caches, kv, slot_mapping, isa)
    objs = [memory_objs(end - start) for start, end in BOUNDS]
    connector.batched_from_gpu(objs, [s for s, _ in BOUNDS], [e for _, e in BOUNDS], kvcaches=caches,
                               slot_mapping=slot_mapping)
    for obj, (start, end) in zip(objs, BOUNDS):
        assert torch.equal(obj.tensor, kv[:, :, start:end]), f"chunk [{start}, {end})"


def test_load_writes_what_vllm_would_and_nothing_else(connector, memory_objs, real_kv_tensor, slot_mapping,
                                                       isa) -> None:
    kv = real_kv_tensor[:, :, :NUM_TOKENS]
    reference = new_kv_caches(len(BLOCK_TABLE))
    write_with_vllm(reference, kv, slot_mapping, isa)
    caches = new_kv_caches(len(BLOCK_TABLE))
    objs = _filled_objs(memory_objs, kv)
    connector.batched_to_gpu(objs, [s for s, _ in BOUNDS], [e for _, e in BOUNDS], kvcaches=caches,
                             slot_mapping=slot_mapping)
    for got, want in zip(caches, reference):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    assert _written(caches) == NUM_LAYERS * NUM_TOKENS * 2 * NUM_KV_HEADS * HEAD_SIZE


def test_load_keeps_the_prefix_vllm_already_has(connector, memory_objs, real_kv_tensor, slot_mapping) -> None:
    kv = real_kv_tensor[:, :, :NUM_TOKENS]
    caches = new_kv_caches(len(BLOCK_TABLE))
    objs = _filled_objs(memory_objs, kv)
    connector.batched_to_gpu(objs, [s for s, _ in BOUNDS], [e for _, e in BOUNDS], kvcaches=caches,
                             slot_mapping=slot_mapping, vllm_cached_tokens=300)
    assert _written(caches) == NUM_LAYERS * (NUM_TOKENS - 300) * 2 * NUM_KV_HEADS * HEAD_SIZE
    back = memory_objs(NUM_TOKENS - 300)
    connector.from_gpu(back, 300, NUM_TOKENS, kvcaches=caches, slot_mapping=slot_mapping)
    assert torch.equal(back.tensor, kv[:, :, 300:])


def test_prefix_slots_vllm_holds_may_be_unmapped(connector, memory_objs, real_kv_tensor, slot_mapping) -> None:
    """vLLM marks the slots of its own cached prefix -1; a load that skips them must not trip on them."""
    kv = real_kv_tensor[:, :, :2 * CHUNK]
    slots = slot_mapping[:2 * CHUNK].clone()
    slots[:300] = -1
    caches = new_kv_caches(len(BLOCK_TABLE))
    objs = _filled_objs(memory_objs, kv, BOUNDS[:2])
    connector.batched_to_gpu(objs, [0, CHUNK], [CHUNK, 2 * CHUNK], kvcaches=caches, slot_mapping=slots,
                             vllm_cached_tokens=300)
    assert _written(caches) == NUM_LAYERS * (2 * CHUNK - 300) * 2 * NUM_KV_HEADS * HEAD_SIZE
    with pytest.raises(KVLayoutError, match=r"slots in \[-1"):
        connector.batched_to_gpu(objs, [0, CHUNK], [CHUNK, 2 * CHUNK], kvcaches=caches, slot_mapping=slots,
                                 vllm_cached_tokens=299)


def test_round_trip_through_a_second_cache(connector, memory_objs, real_kv_tensor, slot_mapping) -> None:
    """Store from one engine's blocks, load into another block table: the model's KV survives."""
    kv = real_kv_tensor[:, :, :NUM_TOKENS]
    objs = _filled_objs(memory_objs, kv)
    caches = new_kv_caches(len(BLOCK_TABLE))
    connector.batched_to_gpu(objs, [s for s, _ in BOUNDS], [e for _, e in BOUNDS], kvcaches=caches,
                             slot_mapping=slot_mapping)
    other = VLLMPagedMemCPUConnector.from_metadata(_metadata())
    other_caches = new_kv_caches(20)
    other_slots = slots_for(list(range(19, 3, -1)), 0, NUM_TOKENS)
    other.batched_to_gpu(objs, [s for s, _ in BOUNDS], [e for _, e in BOUNDS], kvcaches=other_caches,
                         slot_mapping=other_slots)
    for start, end in BOUNDS:
        back = memory_objs(end - start)
        other.from_gpu(back, start, end, kvcaches=other_caches, slot_mapping=other_slots)
        assert torch.equal(back.tensor, kv[:, :, start:end])


@pytest.mark.parametrize("bad, match", [
    ("dtype", "dtype"),
    ("tokens", "shape"),
    ("format", "format"),
    ("prefix_slot", r"slots in \[-1"),
    ("slot_past_cache", "cache holds slots"),
    ("chunk_past_mapping", "outside the slot mapping"),
])
def test_bad_chunk_is_refused_and_nothing_is_written(bad, match, connector, memory_objs, real_kv_tensor,
                                                     slot_mapping) -> None:
    kv = real_kv_tensor[:, :, :NUM_TOKENS]
    objs = _filled_objs(memory_objs, kv, BOUNDS[:2])
    starts, ends = [0, CHUNK], [CHUNK, 2 * CHUNK]
    slots = slot_mapping.clone()
    if bad == "dtype":
        objs[1] = memory_objs(CHUNK, dtype=torch.float16)
    elif bad == "tokens":
        objs[1] = memory_objs(CHUNK - 1)
    elif bad == "format":
        objs[1] = memory_objs(CHUNK, fmt=MemoryFormat.KV_T2D)
    elif bad == "prefix_slot":
        slots[CHUNK + 5] = -1
    elif bad == "slot_past_cache":
        slots[CHUNK + 5] = len(BLOCK_TABLE) * BLOCK_SIZE
    elif bad == "chunk_past_mapping":
        slots = slots[:CHUNK + 10]
    caches = new_kv_caches(len(BLOCK_TABLE))
    with pytest.raises(KVLayoutError, match=match):
        connector.batched_to_gpu(objs, starts, ends, kvcaches=caches, slot_mapping=slots)
    assert _written(caches) == 0


def test_bad_caches_are_refused(connector, memory_objs, slot_mapping) -> None:
    obj = memory_objs(CHUNK)
    with pytest.raises(KVLayoutError, match="29 KV cache layers"):
        connector.from_gpu(obj, 0, CHUNK, kvcaches=new_kv_caches(16, num_layers=29), slot_mapping=slot_mapping)
    with pytest.raises(KVLayoutError, match="slot_mapping"):
        connector.from_gpu(obj, 0, CHUNK, kvcaches=new_kv_caches(16))
    fp16 = [layer.to(torch.float16) for layer in new_kv_caches(16)]
    with pytest.raises(KVLayoutError, match="dtype"):
        connector.from_gpu(obj, 0, CHUNK, kvcaches=fp16, slot_mapping=slot_mapping)


def test_get_shape_is_lmcache_kv_2ltd(connector) -> None:
    assert connector.get_shape(CHUNK) == torch.Size([2, NUM_LAYERS, CHUNK, NUM_KV_HEADS * HEAD_SIZE])
    assert connector.get_shape(CHUNK) == _metadata().get_shapes(CHUNK)[0]


@pytest.mark.parametrize("flag", ["use_layerwise", "enable_blending", "use_gpu_connector_v3"])
def test_accelerator_only_modes_name_the_key(flag: str) -> None:
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, **{flag: True})
    with pytest.raises(ConfigError, match=flag):
        create_cpu_connector(config, _metadata())


def test_mla_and_foreign_layouts_are_refused() -> None:
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK)
    with pytest.raises(KVLayoutError, match="MLA"):
        create_cpu_connector(config, _metadata(use_mla=True))
    with pytest.raises(KVLayoutError, match="NHD"):
        create_cpu_connector(config, _metadata(), {"kv_layout": "NHD"})
