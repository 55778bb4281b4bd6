"""Shared pieces of the index tests: configs on free ports, vLLM-encoded event batches, waiting."""

from __future__ import annotations

import time
from typing import Any, Callable

import msgspec

from kvshrink.index.config import IndexConfig, config_from_dict
from kvshrink.testing.launch import free_port
from kvshrink.testing.polling import poll_until

MODEL = "test-model"


def make_config(zmq: bool = True, **overrides: Any) -> IndexConfig:
    data: dict[str, Any] = {"port": free_port(), "scrape_interval_s": 0, "heartbeat_timeout_s": 0,
                            "zmq": {"bind": [f"tcp://127.0.0.1:{free_port()}"] if zmq else []}}
    data.update(overrides)
    return config_from_dict(data)


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    return poll_until(predicate, timeout, interval=0.02, what=what, error=AssertionError)


# -- vLLM's own event classes (the installed vLLM 0.32: array envelope, ``type``-tagged map events) --

def vllm_stored(hashes, tokens, block_size, parent=None, medium="GPU", **extra):
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
                       block_size=block_size, lora_id=None, medium=medium, lora_name=None, **extra)


def vllm_removed(hashes, medium="GPU"):
    from vllm.distributed.kv_events import BlockRemoved

    return BlockRemoved(block_hashes=list(hashes), medium=medium)


def vllm_cleared():
    from vllm.distributed.kv_events import AllBlocksCleared

    return AllBlocksCleared()


def vllm_payload(events, dp_rank=None) -> bytes:
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=time.time(), events=list(events),
                                                         data_parallel_rank=dp_rank))


# -- the older vLLM encoding: events were msgspec structs with array_like=True and tag=True --------

class _OldEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class _OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_OldEvent):  # field set of vLLM ~0.10 (medium added, no lora_name yet)
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(_OldEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(_OldEvent):
    pass


def old_payload(events) -> bytes:
    return msgspec.msgpack.encode(_OldEventBatch(ts=time.time(), events=list(events)))


def frames(instance: str, seq: int, payload: bytes, model: str = MODEL) -> list[bytes]:
    return [f"kv@{instance}@{model}".encode(), seq.to_bytes(8, "big"), payload]
