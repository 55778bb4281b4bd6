"""KVShrinkLMCacheConnector as vLLM builds it: ``KVConnectorFactory`` resolves our class from the
benchmark's ``--kv-transfer-config`` (kv_connector + kv_connector_module_path) and constructs it
for a real VllmConfig of SmolLM2; LMCache 0.5.6 then builds its real in-process engine.

Each check runs in a fresh interpreter: LMCache's config and engine are process-wide singletons.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.factory")

REPO = Path(__file__).resolve().parents[2]
CPU_YAML = REPO / "configs" / "lmcache-inprocess-cpu.yaml"

# What vLLM does before it builds a connector: a VllmConfig from the CLI's arguments, the KV cache
# layout resolved from the CPU attention backend's declaration (the engine core's step) and, for a
# worker, the distributed groups.
VLLM_SETUP = """
    import json, socket, sys
    from kvshrink.testing.inprocess import IN_PROCESS_CONNECTOR
    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint
    from vllm.config import KVTransferConfig, set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    vllm_config = EngineArgs(model=str(ensure_checkpoint()), max_model_len=4096, enforce_eager=True,
                             gpu_memory_utilization=0.3,
                             kv_transfer_config=KVTransferConfig(**IN_PROCESS_CONNECTOR)).create_engine_config()

    def resolve_layout():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
        resolve_kv_cache_layout(vllm_config, [[l.name for l in CPUAttentionBackend.supported_kv_cache_layouts()]])

    def init_worker_groups():
        from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with set_current_vllm_config(vllm_config):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            ensure_model_parallel_initialized(1, 1)

    def build(role):
        with set_current_vllm_config(vllm_config):
            return KVConnectorFactory.create_connector(vllm_config, role, None)
"""


def run_python(script: str, *, config: Path = CPU_YAML, seed: str | None = "0",
               extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED" and not k.startswith(("LMCACHE_", "VLLM_"))}
    env.update({"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_CONFIG_FILE": str(config), "VLLM_CPU_KVCACHE_SPACE": "1",
                **(extra_env or {})})
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    code = textwrap.dedent(VLLM_SETUP) + textwrap.dedent(script)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


def last_json(result: subprocess.CompletedProcess[str]) -> dict:
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_vllm_factory_loads_our_class_and_lmcache_engine_gets_the_cpu_connector() -> None:
    out = last_json(run_python("""
        cls = KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config)
        loaded_by_resolution = sorted(m for m in sys.modules if m.startswith("lmcache"))
        import lmcache.v1.gpu_connector as gc
        original = gc.CreateGPUConnector
        resolve_layout()
        scheduler = build(KVConnectorRole.SCHEDULER)
        init_worker_groups()
        worker = build(KVConnectorRole.WORKER)
        engine = worker._lmcache_engine.lmcache_engine
        connector = engine.gpu_connector
        print(json.dumps({
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "loaded_by_resolution": loaded_by_resolution,
            "base": f"{cls.__mro__[1].__module__}.{cls.__mro__[1].__qualname__}",
            "scheduler_engine": scheduler._lmcache_engine.lmcache_engine is not None,
            "worker_connector": f"{type(connector).__module__}.{type(connector).__qualname__}",
            "shape": [connector.num_layers, connector.num_kv_heads, connector.head_size, str(connector.dtype)],
            "restored": gc.CreateGPUConnector is original,
        }))
        worker.shutdown()
    """))
    assert out["class"] == "kvshrink.plugins.vllm.lmcache_cpu_connector.KVShrinkLMCacheConnector"
    # vLLM resolves the class early (KV cache layout, config checks), before its CPU workers start;
    # LMCache must not be loaded then (vLLM CPU's workers trip over it), only when the class is built
    assert out["loaded_by_resolution"] == []
    assert out["base"] == "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector.LMCacheConnectorV1"
    assert out["scheduler_engine"] is False  # LMCache's scheduler runs without an engine, as before
    assert out["worker_connector"] == "kvshrink.plugins.vllm.cpu_connector.VLLMPagedMemCPUConnector"
    assert out["shape"] == [30, 3, 64, "torch.bfloat16"]  # SmolLM2's KV, from LMCache's own metadata
    assert out["restored"], "LMCache's CreateGPUConnector must be its own again after construction"


def test_failures_are_raised_where_lmcache_would_only_log_them(tmp_path: Path) -> None:
    """LMCache's manager turns an engine that fails to build into a cacheless "degraded mode" and logs
    it; on CPU that is never what the user asked for, so the worker refuses to start."""
    config = tmp_path / "lmcache.yaml"
    config.write_text(CPU_YAML.read_text() + "use_layerwise: true\n")
    out = last_json(run_python("""
        from kvshrink.errors import ConfigError
        from kvshrink.plugins.vllm.lmcache_cpu_connector import LMCacheCompatibilityError
        init_worker_groups()
        errors = {}
        for step in ("layout unresolved", "layout resolved"):
            if step == "layout resolved":
                resolve_layout()
            try:
                build(KVConnectorRole.WORKER)
                errors[step] = None
            except (ConfigError, LMCacheCompatibilityError) as exc:
                errors[step] = [type(exc).__name__, str(exc)]
        print(json.dumps(errors))
    """, config=config))
    # LMCache fails before it asks for a connector (vLLM's layout query): no engine, a loud error
    name, message = out["layout unresolved"]
    assert name == "LMCacheCompatibilityError" and "built its vLLM engine with no engine" in message
    # our connector refuses a mode it cannot serve; the error names the key
    assert out["layout resolved"] == ["ConfigError", "config key 'use_layerwise': is not supported by the vLLM "
                                                     "CPU connector; set it to false"]


@pytest.mark.parametrize("extra_env, refused", [
    ({"LMCACHE_PRE_CACHING_HASH_ALGORITHM": "builtin"}, True),  # LMCache's default: Python's hash()
    ({}, False),  # the shipped YAML's sha256_cbor: content hashes need no seed
])
def test_unseeded_process_is_refused_unless_keys_do_not_depend_on_the_seed(extra_env, refused) -> None:
    """E.g. vLLM's engine core inside the first process (VLLM_ENABLE_V1_MULTIPROCESSING=0), unseeded."""
    result = run_python("""
        resolve_layout()
        build(KVConnectorRole.SCHEDULER)
        print('{"built": true}')
    """, seed=None, extra_env=extra_env)
    if refused:
        assert result.returncode != 0
        assert "HashSeedError" in result.stderr and "Export PYTHONHASHSEED=0" in result.stderr, result.stderr[-3000:]
    else:
        assert last_json(result) == {"built": True}
