"""Drive an LMCache L2 adapter the way LMCache's store and prefetch controllers do: submit, poll
the operation's eventfd, consume the signal, fetch the result once. Plus real CPU MemoryObjs."""

from __future__ import annotations

import select
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L2AdapterListener
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform import consume_fd

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
from kvshrink.store.dram import SHM_DIR  # noqa: F401  (the test modules import it from here)


def dram_ssd_store(shm_name: str, ssd_path: Path, dram: str = "64MiB", ssd: str = "1GiB",
                   codec: str | None = None) -> dict:
    """A DRAM (raw) + SSD (compressed, written back) store config, as a mapping; ``codec`` (raw,
    fast, dense) sets both tiers' codec instead."""
    return {"tiers": [{"kind": "dram", "capacity": dram, "shm_name": shm_name, "codec": codec or "raw"},
                      {"kind": "ssd", "path": str(ssd_path), "capacity": ssd, "write_back": True,
                       "codec": codec or "dense"}]}


ADAPTER_MODULE = "kvshrink.storage_backends.mp_l2_adapter"


def plugin_json(adapter_params: dict) -> dict:
    """``--l2-adapter`` JSON that loads our adapter through LMCache's ``plugin`` type."""
    return {"type": "plugin", "module_path": ADAPTER_MODULE, "class_name": "KVShrinkL2Adapter",
            "adapter_params": adapter_params}


def build_from_json(spec: dict):
    """What ``lmcache server --l2-adapter JSON`` does with one adapter spec."""
    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class
    from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

    spec = dict(spec)
    config_class = get_l2_adapter_config_class(spec.pop("type"))
    return create_l2_adapter_from_registry(config_class.from_dict(spec))


def memory_obj(chunk: np.ndarray) -> TensorMemoryObj:
    """A real LMCache CPU ``TensorMemoryObj`` holding a copy of ``chunk`` (uint16 view of bf16)."""
    tensor = torch.from_numpy(np.ascontiguousarray(chunk).copy()).view(torch.bfloat16)
    raw = tensor.reshape(-1).view(torch.uint8)
    meta = MemoryObjMetadata(shape=tensor.shape, dtype=torch.bfloat16, address=0, phy_size=raw.numel(),
                             ref_count=1, fmt=MemoryFormat.KV_2LTD)
    return TensorMemoryObj(raw, meta, None)


def empty_like_obj(chunk: np.ndarray, fill: int = 0xAB) -> TensorMemoryObj:
    """A load buffer the size of ``chunk``, filled with junk so a missed write is visible."""
    return memory_obj(np.full_like(chunk, fill))


def contents(obj: TensorMemoryObj) -> np.ndarray:
    return obj.tensor.view(torch.uint16).numpy()


def object_key(i: int, model: str = MODEL, salt: str = "") -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(4, "big") * 8, model_name=model, kv_rank=0x01000100, cache_salt=salt)


def wait_fd(fd: int, timeout: float = 30.0) -> bool:
    """Poll ``fd`` like LMCache's controllers; consume the signal when it fires."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if not poller.poll(timeout * 1000):
        return False
    consume_fd(fd)
    return True


class L2Driver:
    """The controller side of the L2 contract, for one adapter."""

    def __init__(self, adapter, timeout: float = 60.0) -> None:
        self.adapter = adapter
        self.timeout = timeout
        self._store_results: dict = {}

    def store(self, keys, objs):
        task_id = self.adapter.submit_store_task(keys, objs)
        deadline = time.monotonic() + self.timeout
        while task_id not in self._store_results:
            assert time.monotonic() < deadline, "store task never completed"
            wait_fd(self.adapter.get_store_event_fd(), timeout=1.0)
            self._store_results.update(self.adapter.pop_completed_store_tasks())
        return self._store_results.pop(task_id)

    def lookup(self, keys) -> list[int]:
        task_id = self.adapter.submit_lookup_and_lock_task(keys, {})
        return self._await(task_id, self.adapter.get_lookup_and_lock_event_fd(),
                           self.adapter.query_lookup_and_lock_result).get_indices_list()

    def load(self, keys, objs) -> list[int]:
        task_id = self.adapter.submit_load_task(keys, objs)
        return self._await(task_id, self.adapter.get_load_event_fd(), self.adapter.query_load_result).get_indices_list()

    def _await(self, task_id, fd, query):
        deadline = time.monotonic() + self.timeout
        while True:
            result = query(task_id)
            if result is not None:
                assert query(task_id) is None, "a result must be handed out once"
                return result
            assert time.monotonic() < deadline, "task never completed"
            wait_fd(fd, timeout=1.0)


@dataclass
class RecordingListener(L2AdapterListener):
    """Collects what an adapter reports through LMCache's listener hooks."""

    stored: list = field(default_factory=list)
    accessed: list = field(default_factory=list)
    deleted: list = field(default_factory=list)

    def on_l2_keys_stored(self, keys, sizes):
        self.stored += list(zip(keys, sizes))

    def on_l2_keys_accessed(self, keys):
        self.accessed += list(keys)

    def on_l2_keys_deleted(self, keys):
        self.deleted += list(keys)


def greedy(server, prompt: list[int], max_tokens: int = 16) -> list[int]:
    """Greedy completion of a token-id prompt from a running VLLMServer, as token ids."""
    from kvshrink.testing.inprocess import greedy_token_ids

    return greedy_token_ids(server.url, server.served_model_name, prompt, max_tokens=max_tokens)
