"""The vLLM plugin: lazy, idempotent patching of LMCache, loud on changed internals, hash seed handling.

Most checks run in a fresh interpreter: what a plugin imports, and when, is process-wide state.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from kvshrink.plugins.hash_seed import HashSeedError, check_process_hash_seed, process_hash_is_seeded, seed_children


def run_python(script: str, *, seed: str | None = "0", extra_env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED" and not k.startswith("LMCACHE_")}
    env.update({"LMCACHE_DISABLE_BANNER": "1", **(extra_env or {})})
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                          timeout=timeout)


def last_json(result: subprocess.CompletedProcess[str]) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_register_is_lazy_idempotent_and_patches_on_first_import() -> None:
    result = run_python("""
        import json, sys
        from kvshrink.plugins import vllm_plugin
        vllm_plugin.register(); vllm_plugin.register()
        heavy = sorted(m for m in ("lmcache", "torch", "vllm") if m in sys.modules)
        hooks = sum(isinstance(f, vllm_plugin._PatchOnImport) for f in sys.meta_path)

        import lmcache.v1.gpu_connector as gc
        from lmcache.utils import EngineType
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        import torch
        patched = gc.CreateGPUConnector
        vllm_plugin.register()
        meta = LMCacheMetadata(model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=torch.bfloat16, kv_shape=(30, 2, 256, 3, 64))
        config = LMCacheEngineConfig.from_defaults(chunk_size=256)
        vllm = gc.CreateGPUConnector(config, meta, EngineType.VLLM, layout_hints={"kv_layout": "HND"})
        mock = gc.CreateGPUConnector(config, meta, EngineType.MOCK)
        print(json.dumps({"heavy": heavy, "hooks": hooks, "same_after_reregister": gc.CreateGPUConnector is patched,
                          "name": patched.__name__, "vllm": type(vllm).__name__, "mock": type(mock).__name__}))
    """)
    out = last_json(result)
    assert out["heavy"] == [], "register() must not import LMCache, torch or vLLM"
    assert out["hooks"] == 1
    assert out["same_after_reregister"]
    assert out["name"] == "CreateGPUConnector"
    assert out["vllm"] == "VLLMPagedMemCPUConnector"
    assert out["mock"] == "MockGPUConnector"  # other engines keep LMCache's own connectors


def test_register_after_lmcache_was_imported_patches_at_once() -> None:
    result = run_python("""
        import json
        import lmcache.v1.gpu_connector as gc
        original = gc.CreateGPUConnector
        from kvshrink.plugins import vllm_plugin
        vllm_plugin.register()
        print(json.dumps({"patched": gc.CreateGPUConnector is not original,
                          "marked": getattr(gc.CreateGPUConnector, vllm_plugin._PATCH_MARK, False)}))
    """)
    assert last_json(result) == {"patched": True, "marked": True}


@pytest.mark.parametrize("change, match", [
    ("del gc.CreateGPUConnector", "CreateGPUConnector is missing"),
    ("gc.CreateGPUConnector = lambda config, metadata, engine, layout_hints=None, device=None: None",
     r"no longer takes \('config', 'metadata', 'engine', 'layout_hints'\)"),
    ("del gc.EngineType", "EngineType.VLLM is missing"),
])
def test_changed_lmcache_internals_fail_loudly_naming_the_version(change: str, match: str) -> None:
    result = run_python(f"""
        import lmcache.v1.gpu_connector as gc
        {change}
        from kvshrink.plugins import vllm_plugin
        vllm_plugin.register()
    """)
    assert result.returncode != 0
    assert "LMCacheCompatibilityError" in result.stderr
    assert "LMCache 0.5.6" in result.stderr
    assert re.search(match, result.stderr), result.stderr[-2000:]


def test_other_devices_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import lmcache.v1.gpu_connector as gc

    from kvshrink.plugins.vllm_plugin import patch_gpu_connector_module

    original = gc.CreateGPUConnector
    monkeypatch.setattr(gc, "CreateGPUConnector", original)  # restored after the test whatever happens
    monkeypatch.setattr(gc, "torch_device_type", "cuda")
    assert patch_gpu_connector_module(gc) is False
    assert gc.CreateGPUConnector is original


# ---------------------------------------------------------------------------------------- hash seed

def test_seed_children_sets_only_an_unset_seed_and_only_for_lmcache() -> None:
    env = {"LMCACHE_CONFIG_FILE": "lmcache.yaml"}
    assert seed_children(env) is True and env["PYTHONHASHSEED"] == "0"
    env = {"LMCACHE_CONFIG_FILE": "lmcache.yaml", "PYTHONHASHSEED": "1234"}
    assert seed_children(env) is False and env["PYTHONHASHSEED"] == "1234"
    env = {}
    assert seed_children(env) is False and env == {}  # vLLM without LMCache keeps Python's hash randomization


def test_which_processes_count_as_seeded() -> None:
    assert process_hash_is_seeded("1234")
    assert not process_hash_is_seeded(None)
    assert not process_hash_is_seeded("random")
    assert process_hash_is_seeded("0") == (sys.flags.hash_randomization == 0)
    check_process_hash_seed("sha256_cbor", seed_at_start=None)  # content hashes need no seed
    with pytest.raises(HashSeedError, match="Export PYTHONHASHSEED=0"):
        check_process_hash_seed("builtin", seed_at_start=None)


SPAWN_TWO_CHILDREN = """
    import json, subprocess, sys
    from kvshrink.plugins import vllm_plugin
    vllm_plugin.register()
    probe = "import sys; print(hash('kvshrink'), sys.flags.hash_randomization)"
    a = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.split()
    b = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.split()
    print(json.dumps({"children_agree": a == b, "randomized": a[1]}))
"""


def test_unset_seed_is_fixed_for_child_processes_when_lmcache_is_configured() -> None:
    """What vLLM's first process does: register(), then spawn the engine; the children hash alike."""
    result = run_python(SPAWN_TWO_CHILDREN, seed=None, extra_env={"LMCACHE_CONFIG_FILE": "lmcache.yaml"})
    assert "PYTHONHASHSEED was unset" in result.stderr
    assert last_json(result) == {"children_agree": True, "randomized": "0"}


def test_without_lmcache_config_children_keep_random_seeds() -> None:
    result = run_python(SPAWN_TWO_CHILDREN, seed=None)
    assert "PYTHONHASHSEED was unset" not in result.stderr
    assert last_json(result) == {"children_agree": False, "randomized": "1"}


IMPORT_IN_PROCESS_CONNECTOR = """
    from kvshrink.plugins import vllm_plugin
    vllm_plugin.register()
    import lmcache.integration.vllm.vllm_v1_adapter
    print('{"imported": true}')
"""


def test_in_process_connector_refuses_an_unseeded_process() -> None:
    """E.g. vLLM's engine core inside the first process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with no seed."""
    result = run_python(IMPORT_IN_PROCESS_CONNECTOR, seed=None)
    assert result.returncode != 0
    assert "HashSeedError" in result.stderr and "Export PYTHONHASHSEED=0" in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("seed, extra_env", [
    ("0", {}),
    ("42", {}),
    (None, {"LMCACHE_PRE_CACHING_HASH_ALGORITHM": "sha256_cbor"}),
])
def test_in_process_connector_starts_when_keys_are_reproducible(seed, extra_env) -> None:
    assert last_json(run_python(IMPORT_IN_PROCESS_CONNECTOR, seed=seed, extra_env=extra_env)) == {"imported": True}

