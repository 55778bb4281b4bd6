"""The KV Fuse server module without a server: its settings, its handlers' RPC signatures, and its
lookup path over a stand-in for LMCache's storage manager (same calls, tensors in a dict) with the
real SmolLM2 engine. The real server and vLLM are driven by test_fuse_e2e.py."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvshrink.errors import ConfigError
from kvshrink.fuse.keys import FuseSettings, fused_salt
from kvshrink.storage_backends.kv_fuse.server_module import KVFuseModule, build_server_modules
from kvshrink.storage_backends.kv_fuse.settings import SETTING_KEYS, FuseModuleSettings

CHUNK = 256
SALT = fused_salt(FuseSettings())
MODEL = "smollm2"
REPO = Path(__file__).resolve().parents[2]


# -- settings ---------------------------------------------------------------------------------------
def test_the_shipped_fuse_section_is_off_and_documents_the_defaults() -> None:
    """The ``fuse`` section of the shipped serve-cache YAML spells out every key at its default."""
    from kvshrink.config_checks import load_yaml

    section = load_yaml(REPO / "configs" / "serve-cache-dram-ssd-redis.yaml", "config")["fuse"]
    assert set(section) == set(SETTING_KEYS)
    assert FuseModuleSettings.from_config(section) == FuseModuleSettings() and not FuseModuleSettings().enabled


def test_valid_settings_are_read_as_given() -> None:
    settings = FuseModuleSettings.from_config({"enabled": True, "model_path": "/m", "ratio": 0.05, "threads": 2})
    assert (settings.enabled, settings.model_path, settings.ratio, settings.threads) == (True, "/m", 0.05, 2)
    assert fused_salt(settings.fuse) == "kvfuse1-r0050-c1"


@pytest.mark.parametrize(("config", "key"), [
    ({"enabled": True}, "fuse.model_path"),
    ({"ratio": 1.5}, "fuse.ratio"),
    ({"check_layer": 0}, "fuse.check_layer"),
    ({"timeout_s": 400}, "fuse.timeout_s"),
    ({"enabeld": True}, "fuse.enabeld"),
    ({"store_config": "store.yaml"}, "fuse.store_config"),  # settings no longer come from a store YAML
    ({"enabled": "yes"}, "fuse.enabled"),
    ({"ratio": "0.15"}, "fuse.ratio"),
    ({"model_path": 7}, "fuse.model_path"),
    ({"max_pending": 2.5}, "fuse.max_pending"),
    ({"anchor": True}, "fuse.anchor"),
    ("on", "fuse"),
])
def test_bad_settings_name_their_key(config: Any, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        FuseModuleSettings.from_config(config)
    assert info.value.key == key


def test_disabled_the_factory_replaces_no_handler() -> None:
    build = SimpleNamespace(config={"enabled": False}, modules=(), server_context=None)
    assert build_server_modules(build) is None  # LMCache keeps every built-in handler: stock, byte for byte


def test_the_handlers_match_lmcaches_rpc_specs() -> None:
    from lmcache.v1.multiprocess.request_handler import iter_request_handlers

    module = KVFuseModule(None, None, None, FuseModuleSettings(), engine=None)  # type: ignore[arg-type]
    try:
        names = {handler.operation for handler in iter_request_handlers(module)}  # validates the annotations
    finally:
        module.close()
    assert names == {"register_kv_cache_engine_driven_context", "commit_store", "lookup", "query_prefetch_status",
                     "wait_prefetch_status", "end_session"}


# -- the lookup path over a stand-in storage manager ------------------------------------------------
class Bits:
    def __init__(self, hits: list[bool]) -> None:
        self.hits = hits

    def test(self, i: int) -> bool:
        return self.hits[i]


class FakeStorage:
    """LMCache's StorageManager calls the module makes, over a dict of tensors."""

    def __init__(self) -> None:
        self.objects: dict[Any, torch.Tensor] = {}
        self.writes: list[Any] = []
        self.locks = 0

    def submit_prefetch_task(self, spec: Any, external_request_id: str = "") -> Any:
        return spec

    def wait_prefetch_status(self, handle: Any, timeout: float) -> bool:
        return True

    def query_prefetch_status(self, handle: Any) -> Any:
        keys = handle.key_groups[0].keys
        self.locks += sum(k in self.objects for k in keys)
        return SimpleNamespace(hit_cells=[Bits([k in self.objects for k in keys])], l1_owners={})

    @contextmanager
    def read_prefetched_results(self, keys: list[Any], l1_owners: Any = None) -> Any:
        yield [SimpleNamespace(tensor=self.objects[k]) for k in keys]

    def finish_read_prefetched(self, keys: list[Any], read_locks: int = 1, l1_owners: Any = None) -> None:
        self.locks -= len(keys)

    def reserve_write(self, keys: list[Any], layout: Any) -> dict[Any, Any]:
        return {k: SimpleNamespace(tensor=torch.zeros(layout.shapes[0], dtype=torch.bfloat16))
                for k in keys if k not in self.objects}

    def prepare_write_completion(self, objects: dict[Any, Any]) -> Any:
        return objects

    def finish_write_by_owner(self, completion: dict[Any, Any]) -> None:
        for key, obj in completion.items():
            self.objects[key] = obj.tensor
            self.writes.append(key)


class FakeContext:
    def __init__(self, layers: int, width: int) -> None:
        from lmcache.v1.distributed.api import MemoryLayoutDesc
        from lmcache.v1.multiprocess.token_hasher import TokenHasher

        self.chunk_size = CHUNK
        self.token_hasher = TokenHasher(CHUNK, "blake3")
        self.storage_manager = FakeStorage()
        layout = MemoryLayoutDesc(shapes=[torch.Size([2, layers, CHUNK, width])], dtypes=[torch.bfloat16])
        self.layout_desc_registry = SimpleNamespace(find_group_layout_descs=lambda model, ws: {0: layout})

    def resolve_obj_keys(self, key: Any, groups: list[int]) -> list[list[Any]]:
        from lmcache.v1.distributed.api import ipc_key_to_object_keys

        hashes = self.token_hasher.compute_chunk_hashes(list(key.token_ids), start=key.start, end=key.end)
        return ipc_key_to_object_keys(key, hashes, groups)


class FakeLookup:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def lookup(self, key: Any, tp_size: int) -> None:
        self.calls.append(key)

    def query_prefetch_status(self, request_id: str) -> int:
        return 7

    def wait_prefetch_status(self, request_id: str, timeout: float) -> int:
        return 7

    def end_session(self, request_id: str) -> None:
        pass


class FakeTransfer:
    """The built-in engine-driven store: puts the given KV (tokens on its second-to-last dim: split
    ``[2, L, T, H*D]`` or vLLM CPU's ``[L, T, H*2D]``) under the key's chunks."""

    def __init__(self, ctx: FakeContext) -> None:
        self.ctx = ctx
        self.kv: torch.Tensor | None = None

    def register_kv_cache_engine_driven_context(self, payload: Any) -> None:
        return None

    def commit_store(self, key: Any, instance_id: int, cpu_data: bytes) -> bool:
        for i, obj_key in enumerate(self.ctx.resolve_obj_keys(key, [0])[0]):
            start = key.start + i * CHUNK
            self.ctx.storage_manager.objects[obj_key] = self.kv.narrow(self.kv.dim() - 2, start, CHUNK).clone()
        return True


def ipc_key(tokens: list[int], salt: str, request_id: str, worker: int | None = None) -> Any:
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

    end = len(tokens) // CHUNK * CHUNK
    return IPCCacheServerKey(model_name=MODEL, world_size=1, worker_id=worker, token_ids=tuple(tokens), start=0,
                             end=end, request_id=request_id, cache_salt=salt, num_kv_readers=1)


@pytest.fixture(scope="module")
def docs(prose_ids: list[int]) -> dict[str, list[int]]:
    return {"A": prose_ids[:CHUNK], "B": prose_ids[1000:1000 + CHUNK], "Q": prose_ids[3000:3040]}


@pytest.fixture(scope="module")
def stored_ab(engine: Any, docs: dict[str, list[int]]) -> tuple[list[int], torch.Tensor]:
    """The KV vLLM would have stored for prompt A B Q (computed here by the same model)."""
    tokens = docs["A"] + docs["B"] + docs["Q"]
    return tokens, engine.prefill(tokens, logits_at=()).kv


@pytest.fixture
def stack(engine: Any) -> Any:
    ctx = FakeContext(engine.num_layers, engine.kv_width)
    lookup, transfer = FakeLookup(), FakeTransfer(ctx)
    module = KVFuseModule(ctx, lookup, transfer, FuseModuleSettings(enabled=True, model_path="unused"), engine)
    yield SimpleNamespace(ctx=ctx, lookup=lookup, transfer=transfer, module=module,
                          storage=ctx.storage_manager)
    module.close()


def store(stack: Any, tokens: list[int], kv: torch.Tensor, salt: str, request_id: str) -> None:
    stack.transfer.kv = kv
    assert stack.module.commit_store(ipc_key(tokens, salt, request_id, worker=0), 0, b"")


def look_up(stack: Any, tokens: list[int], salt: str, request_id: str) -> dict[str, int]:
    before = stack.module.report_status()["kvshrink_fuse"]
    stack.module.lookup(ipc_key(tokens, salt, request_id), 1)
    assert stack.module.wait_prefetch_status(request_id, 120.0) == 7  # waits for the fusion job
    after = stack.module.report_status()["kvshrink_fuse"]
    return {k: after[k] - before[k] for k in after if isinstance(after[k], int) and after[k] != before[k]}


def test_reordered_documents_are_fused_written_under_the_fused_salt_then_looked_up(
        stack: Any, engine: Any, docs: dict, stored_ab: tuple) -> None:
    tokens_ab, kv_ab = stored_ab
    store(stack, tokens_ab, kv_ab, SALT, "r1")
    assert stack.module.report_status()["kvshrink_fuse"]["indexed_chunks"] == 2
    tokens_ba = docs["B"] + docs["A"] + docs["Q"]
    delta = look_up(stack, tokens_ba, SALT, "r2")
    assert delta["fusions"] == 1 and delta["reused_chunks"] == 2 and delta["fused_chunks_written"] == 2
    assert [k.cache_salt for k in stack.storage.writes] == [SALT, SALT]
    assert stack.lookup.calls[-1].request_id == "r2" and stack.storage.locks == 0
    # the written chunks are exactly the engine's fusion of the same pieces
    from kvshrink.fuse.engine import ReusedSegment

    segments = [ReusedSegment(0, CHUNK, kv_ab[:, :, CHUNK:2 * CHUNK]), ReusedSegment(CHUNK, 0, kv_ab[:, :, :CHUNK])]
    expected = engine.fuse(tokens_ba[:2 * CHUNK], segments, 0.15, 1, logits_at=()).kv
    written = torch.cat([stack.storage.objects[k] for k in stack.storage.writes], dim=2)
    assert torch.equal(written, expected)
    # a repeat is an ordinary hit; chunks vLLM stores over the fused prefix never become sources
    assert look_up(stack, tokens_ba, SALT, "r3")["already_fused"] == 1
    store(stack, tokens_ba, written, SALT, "r2")
    store(stack, tokens_ba, written, SALT, "r3")  # r3 loaded the fused prefix too
    assert stack.module.report_status()["kvshrink_fuse"]["indexed_chunks"] == 2


def test_a_reusable_chunk_that_is_gone_falls_back_to_the_stock_lookup(stack: Any, docs: dict,
                                                                     stored_ab: tuple) -> None:
    tokens_ab, kv_ab = stored_ab
    store(stack, tokens_ab, kv_ab, SALT, "r1")
    evicted = stack.ctx.resolve_obj_keys(ipc_key(tokens_ab, SALT, "r1", worker=0), [0])[0][1]
    del stack.storage.objects[evicted]  # B's chunk evicted; A's still there: partly present
    delta = look_up(stack, docs["B"] + docs["A"] + docs["Q"], SALT, "r2")
    assert delta["fallback_missing"] == 1 and "fusions" not in delta
    assert stack.storage.writes == [] and stack.storage.locks == 0  # nothing written, A's read lock released
    assert stack.lookup.calls[-1].request_id == "r2"  # the built-in lookup: vLLM prefills as stock
    assert stack.module.report_status()["kvshrink_fuse"]["indexed_chunks"] == 1  # the gone chunk left the index


def test_a_corrupt_reusable_chunk_falls_back(stack: Any, docs: dict, stored_ab: tuple) -> None:
    tokens_ab, kv_ab = stored_ab
    store(stack, tokens_ab, kv_ab, SALT, "r1")
    first = stack.ctx.resolve_obj_keys(ipc_key(tokens_ab, SALT, "r1", worker=0), [0])[0][0]
    stack.storage.objects[first] = stack.storage.objects[first].clone()
    stack.storage.objects[first][0, 3, 7, 5] = float("nan")
    delta = look_up(stack, docs["B"] + docs["A"] + docs["Q"], SALT, "r2")
    assert delta["fallback_corrupt"] == 1 and stack.storage.writes == []
    assert stack.lookup.calls[-1].request_id == "r2"


def test_other_salts_are_stock_and_tenants_never_share_sources(stack: Any, docs: dict, stored_ab: tuple) -> None:
    tokens_ab, kv_ab = stored_ab
    store(stack, tokens_ab, kv_ab, "tenant-a", "r1")  # tenant a's exact chunks
    tokens_ba = docs["B"] + docs["A"] + docs["Q"]
    stack.module.lookup(ipc_key(tokens_ba, "", "plain"), 1)  # no fusion asked: the built-in, at once
    assert stack.lookup.calls[-1].request_id == "plain"
    assert stack.module.query_prefetch_status("plain") == 7
    assert look_up(stack, tokens_ba, fused_salt(FuseSettings(), "tenant-b"), "b")["no_match"] == 1
    foreign = fused_salt(FuseSettings(ratio=0.3), "tenant-a")  # made with other settings: never ours
    assert look_up(stack, tokens_ba, foreign, "f")["foreign_salt"] == 1
    assert stack.storage.writes == []


def test_a_slow_fusion_reports_still_running(stack: Any, docs: dict, stored_ab: tuple) -> None:
    tokens_ab, kv_ab = stored_ab
    store(stack, tokens_ab, kv_ab, SALT, "r1")
    stack.module.lookup(ipc_key(docs["B"] + docs["A"] + docs["Q"], SALT, "r2"), 1)
    assert stack.module.query_prefetch_status("r2") is None  # the job runs: vLLM polls again
    deadline = time.monotonic() + 120
    while stack.module.query_prefetch_status("r2") is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stack.module.query_prefetch_status("r2") == 7 and stack.lookup.calls[-1].request_id == "r2"


BLOCK = 128  # vLLM CPU's paged block size for SmolLM2


def vllm_cpu_chunks(kv: torch.Tensor, isa: str) -> torch.Tensor:
    """``kv`` ``[2, L, T, H*D]`` as LMCache stores it for vLLM CPU (``[L, T, H*2D]``): written into a
    paged cache ``[blocks, H, block, 2D]`` by vLLM's own cache writer for ``isa``, then gathered by
    token rows (each slot's row over every head), as LMCache's engine-driven store does."""
    from kvshrink.plugins.vllm.cpu_kv_layout import write_tokens

    _, layers, tokens, width = kv.shape
    heads, dim = 3, width // 3
    out = torch.empty(layers, tokens, heads * 2 * dim, dtype=kv.dtype)
    for layer in range(layers):
        cache = torch.full((tokens // BLOCK, heads, BLOCK, 2 * dim), float("nan"), dtype=kv.dtype)
        write_tokens(cache, kv[0, layer].reshape(tokens, heads, dim).contiguous(),
                     kv[1, layer].reshape(tokens, heads, dim).contiguous(), torch.arange(tokens), isa)
        out[layer] = cache.permute(0, 2, 1, 3).reshape(tokens, -1)
    return out


def usable_isa(isa: str) -> str:
    from kvshrink.testing.vllm_cpu_isa import isa_unavailable

    reason = isa_unavailable(isa)
    if reason is not None:
        pytest.skip(reason)
    return isa


@pytest.mark.parametrize("isa", ["amx", "vec", "vec16"])
def test_the_chunk_codec_reads_and_writes_vllm_cpu_chunks_through_the_probed_layout(isa: str) -> None:
    """Real KV written by vLLM's cache writer for each ISA (AMX's 16-token groups of bf16 pairs,
    the vector kernels' transposed K), gathered as LMCache stores it: decode gives K and V back,
    encode gives the stored chunk back, bit for bit."""
    pytest.importorskip("vllm._custom_ops")
    from kvshrink.storage_backends.kv_fuse.chunk_codec import ChunkCodec
    from kvshrink.plugins.vllm.cpu_kv_layout import probe_paged_layout
    from kvshrink.testing.fixtures.real_kv import real_kv

    usable_isa(isa)
    kv = torch.from_numpy(real_kv("prose", 2 * CHUNK)[:, :3].copy()).view(torch.bfloat16)  # [2, 3, 512, 192]
    chunk = vllm_cpu_chunks(kv, isa)
    codec = ChunkCodec(tuple(chunk.shape), 3, 3, 64, probe_paged_layout(3, BLOCK, 64, torch.bfloat16, isa))
    assert codec.name == f"vllm-cpu-{isa}-bs{BLOCK}"
    assert torch.equal(codec.decode(chunk), kv) and torch.equal(codec.encode(kv), chunk)
    naive_k = chunk.view(3, 2 * CHUNK, 3, 128)[..., :64].reshape(3, 2 * CHUNK, 192)
    assert not torch.equal(naive_k, kv[0])  # the rows are not [K | V] per token on any ISA


def test_a_vllm_cpu_chunk_object_without_its_layout_is_refused() -> None:
    from kvshrink.storage_backends.kv_fuse.chunk_codec import ChunkCodec
    from kvshrink.plugins.vllm.cpu_kv_layout import KVLayoutError

    with pytest.raises(KVLayoutError, match="probed paged layout"):
        ChunkCodec((30, CHUNK, 384), 30, 3, 64)


@pytest.fixture
def cpu_stack(engine: Any) -> Any:
    """The stand-in stack with vLLM CPU's chunk objects ``[L, C, H*2D]`` and its block size registered."""
    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.multiprocess.custom_types import RegisterEngineDrivenContextPayload

    pytest.importorskip("vllm._custom_ops")
    ctx = FakeContext(engine.num_layers, engine.kv_width)
    layout = MemoryLayoutDesc(shapes=[torch.Size([engine.num_layers, CHUNK, 2 * engine.kv_width])],
                              dtypes=[torch.bfloat16])
    ctx.layout_desc_registry = SimpleNamespace(find_group_layout_descs=lambda model, ws: {0: layout})
    lookup, transfer = FakeLookup(), FakeTransfer(ctx)
    module = KVFuseModule(ctx, lookup, transfer, FuseModuleSettings(enabled=True, model_path="unused"), engine)
    module.register_kv_cache_engine_driven_context(RegisterEngineDrivenContextPayload(
        instance_id=1, model_name=MODEL, world_size=1, block_size=BLOCK, num_layers=engine.num_layers,
        hidden_dim_size=2 * engine.kv_width, dtype_str="bfloat16", use_mla=False))
    yield SimpleNamespace(ctx=ctx, lookup=lookup, transfer=transfer, module=module, storage=ctx.storage_manager)
    module.close()


def test_vllm_cpu_chunks_of_the_isa_vllm_picks_here_are_fused(cpu_stack: Any, docs: dict, stored_ab: tuple) -> None:
    """What KV Fuse meets under vLLM CPU on this machine: chunks in the layout of the ISA vLLM's
    attention picks here. They fuse (no layout fallback), and the fused chunks it writes are in
    that layout too: read back through vLLM's own layout, their layer-0 keys are the model's."""
    from kvshrink.storage_backends.kv_fuse.key_check import KEY_CHECK_TOLERANCE, layer0_key_error
    from kvshrink.plugins.vllm.cpu_kv_layout import attention_isa, probe_paged_layout

    isa = attention_isa(torch.bfloat16, BLOCK, 64)
    tokens_ab, kv_ab = stored_ab
    store(cpu_stack, tokens_ab, vllm_cpu_chunks(kv_ab[:, :, :2 * CHUNK], isa), SALT, "r1")
    tokens_ba = docs["B"] + docs["A"] + docs["Q"]
    delta = look_up(cpu_stack, tokens_ba, SALT, "r2")
    assert delta.get("fallback_layout", 0) == 0 and delta["fusions"] == 1, cpu_stack.module.last_fallback
    assert delta["fused_chunks_written"] == 2
    status = cpu_stack.module.report_status()["kvshrink_fuse"]
    assert status["layouts"] == {f"{MODEL}@1": f"vllm-cpu-{isa}-bs{BLOCK}"}
    codec = cpu_stack.module.layouts.confirmed(MODEL, 1)
    assert codec.paged is probe_paged_layout(3, BLOCK, 64, torch.bfloat16)  # the CPU connector's probe
    written = [cpu_stack.storage.objects[k] for k in cpu_stack.storage.writes]
    for i, chunk in enumerate(written):
        assert tuple(chunk.shape) == (30, CHUNK, 384)
        error = layer0_key_error(cpu_stack.module.engine, tokens_ba[i * CHUNK:(i + 1) * CHUNK], i * CHUNK,
                                 codec.decode(chunk))
        assert error <= KEY_CHECK_TOLERANCE, (i, error)


def test_vllm_cpu_chunks_in_another_isas_layout_are_refused_not_misread(cpu_stack: Any, docs: dict,
                                                                        stored_ab: tuple) -> None:
    """Chunks laid out for an ISA other than the one this process probes (vLLM on another host):
    the layer-0 key check refuses the layout, nothing is written, the stock lookup runs."""
    from kvshrink.plugins.vllm.cpu_kv_layout import attention_isa

    here = attention_isa(torch.bfloat16, BLOCK, 64)
    other = usable_isa("vec" if here == "amx" else "amx")
    tokens_ab, kv_ab = stored_ab
    store(cpu_stack, tokens_ab, vllm_cpu_chunks(kv_ab[:, :, :2 * CHUNK], other), SALT, "r1")
    delta = look_up(cpu_stack, docs["B"] + docs["A"] + docs["Q"], SALT, "r2")
    assert delta["fallback_layout"] == 1 and "fusions" not in delta, delta
    assert "does not give the model's layer-0 keys" in cpu_stack.module.last_fallback["detail"]
    assert cpu_stack.storage.writes == [] and cpu_stack.lookup.calls[-1].request_id == "r2"
