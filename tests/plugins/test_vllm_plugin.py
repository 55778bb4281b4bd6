"""The vLLM general plugin: light and idempotent, and the hash seed it gives vLLM's processes.

Most checks run in a fresh interpreter: what a plugin imports, and the environment its children
inherit, are process-wide state. The in-process connector's own checks are in test_lmcache_cpu_connector.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kvshrink.plugins.vllm.hash_seed import HashSeedError, check_process_hash_seed, process_hash_is_seeded, seed_children


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


def test_register_is_idempotent_imports_nothing_heavy_and_hooks_no_import() -> None:
    """vLLM calls it in every process, before its CPU workers start: it must load neither LMCache nor torch."""
    out = last_json(run_python("""
        import json, sys
        finders = len(sys.meta_path)
        from kvshrink.plugins.vllm import vllm_plugin
        vllm_plugin.register(); vllm_plugin.register()
        print(json.dumps({"heavy": sorted(m for m in ("lmcache", "torch", "vllm") if m in sys.modules),
                          "finders_added": len(sys.meta_path) - finders}))
    """))
    assert out == {"heavy": [], "finders_added": 0}


def test_the_installed_entry_point_is_register() -> None:
    """What vLLM loads (``vllm.general_plugins`` from the installed metadata): after a move of the
    module, a stale install names a path that no longer imports, and vLLM only logs that."""
    from importlib.metadata import entry_points

    from kvshrink.plugins.vllm import vllm_plugin

    (entry_point,) = entry_points(group="vllm.general_plugins", name="kvshrink")
    assert entry_point.load() is vllm_plugin.register, "reinstall: pip install --no-deps -e ."


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
    from kvshrink.plugins.vllm import vllm_plugin
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
