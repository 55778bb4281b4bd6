"""``kvshrink cache serve``: the default (no ``--config``: the shipped default store), the shipped
alternative YAML files, loud errors naming keys, and a real ``lmcache server`` started with our
adapter, reporting it in /status, and stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from l2_harness import SHM_DIR

from kvshrink.testing.derived_stores import derive_store
from kvshrink.testing.launch import free_port
from kvshrink.testing.polling import poll_until
from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig

from kvshrink.cli import main as kvshrink_main
from kvshrink.configs import default_store_path
from kvshrink.errors import ConfigError
from kvshrink.store import StoreConfig
from kvshrink.storage_backends.mp_l2_adapter import KVShrinkL2AdapterConfig
from kvshrink.storage_backends.serve_cache import ServerFlags, lmcache_server_argv, load_serve_config

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs").glob("serve-cache-*.yaml"))


def private_config(tmp_path: Path, shm: str, edit=None) -> Path:
    """What ``cache serve`` runs without --config, on free ports, over the default store moved into
    ``tmp_path`` and ``shm`` (tiers[0] dram, tiers[1] ssd)."""
    store = derive_store(paths={"ssd": tmp_path / "ssd"}, shm_names={"dram": shm},
                         capacities={"dram": "64MiB", "ssd": "1GiB"})
    server = {"port": free_port(), "http_port": free_port(), "prometheus_port": free_port(), "l1_size_gb": 0.2}
    data = {"server": server, "adapter": {"workers": 4}, "store": store}
    if edit is not None:
        edit(data)
    path = tmp_path / f"serve-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_files_give_an_adapter_spec_lmcache_accepts(path):
    config = load_serve_config(path, check_services=False)
    spec = config.l2_adapter_spec()
    plugin = PluginL2AdapterConfig.from_dict({k: v for k, v in spec.items() if k != "type"})
    assert plugin.module_path == "kvshrink.storage_backends.mp_l2_adapter"
    parsed = KVShrinkL2AdapterConfig.from_dict(json.loads(json.dumps(plugin.adapter_params)))  # survives JSON
    assert [t.kind for t in parsed.store_config.tiers] == [t.kind for t in config.store.tiers]


def test_without_a_file_serve_cache_runs_the_shipped_default_store():
    config = load_serve_config(None, check_services=False)
    assert config.adapter_params == {"config": str(default_store_path())}
    assert config.store == StoreConfig.load(default_store_path())
    assert [t.kind for t in config.store.tiers] == ["dram", "ssd"]
    assert config.server == ServerFlags()  # production defaults, not the test launcher's
    server = config.server
    assert (server.port, server.http_port, server.prometheus_port, server.l1_size_gb, server.chunk_size) == \
        (5555, 8080, 9090, 2.0, 256)
    assert (server.host, server.http_host, server.supported_transfer_mode) == ("localhost", "127.0.0.1", "auto")


def test_check_without_config_validates_the_default_store_on_this_machine(tmp_path, monkeypatch, capsys):
    import shutil

    needed = StoreConfig.load(default_store_path()).tiers[0].capacity
    if shutil.disk_usage(SHM_DIR).free < needed:
        pytest.skip(f"/dev/shm has less than the default DRAM tier's {needed >> 30} GiB free")
    disk = StoreConfig.load(default_store_path()).tiers[1].capacity
    if shutil.disk_usage(tmp_path).free < disk:
        pytest.skip(f"this disk has less than the default SSD tier's {disk >> 30} GiB free")
    monkeypatch.setenv("HOME", str(tmp_path))  # the default SSD tier is ~/.cache/kvshrink/store-ssd
    assert kvshrink_main(["cache", "serve", "--check"]) == 0
    out = capsys.readouterr().out
    assert str(default_store_path()) in out
    assert shlex.split(out) == load_serve_config(None, check_services=False).argv()
    assert not (tmp_path / ".cache").exists()  # checked (the nearest existing folder is writable), not created


def test_shipped_alternatives_cover_redis_and_qat():
    kinds = {p.name: [t.kind for t in load_serve_config(p, check_services=False).store.tiers] for p in SHIPPED}
    assert sorted(kinds) == ["serve-cache-dram-ssd-redis.yaml", "serve-cache-qat.yaml"]  # no second default
    assert kinds["serve-cache-dram-ssd-redis.yaml"] == ["dram", "ssd", "redis"]
    qat = load_serve_config(REPO / "configs" / "serve-cache-qat.yaml", check_services=False)
    assert [(t.kind, t.method) for t in qat.store.tiers] == [("dram", "fast"), ("ssd", "qat")]  # the default's DRAM


@pytest.mark.parametrize("edit, key", [
    (lambda d: d.update(serverr={}), "serverr"),
    (lambda d: d["server"].update(port=70000), "server.port"),
    (lambda d: d["server"].update(l1_size_gb=0), "server.l1_size_gb"),
    (lambda d: d["server"].update(hots="x"), "server.hots"),
    (lambda d: d["server"].update(prometheus_port=0), "server.prometheus_port"),
    (lambda d: d["server"].update(supported_transfer_mode="fast"), "server.supported_transfer_mode"),
    (lambda d: d["server"].update(host="local host"), "server.host"),
    (lambda d: d["server"].update(chunk_size=True), "server.chunk_size"),
    (lambda d: d.update(server=[1]), "server"),
    (lambda d: d["adapter"].update(workers=1000), "adapter.workers"),
    (lambda d: d["store"]["tiers"][1].update(level=12, method="qat"), "store.tiers[1].level"),
    (lambda d: d["store"]["tiers"][1].update(level=0), "store.tiers[1].level"),
    (lambda d: d["adapter"].update(workers=0), "adapter.workers"),
    (lambda d: d["adapter"].update(index_url="http://127.0.0.1:8200"), "adapter.index_instance_id"),
    (lambda d: d["store"]["tiers"][1].update(capacity="a lot"), "store.tiers[1].capacity"),
    (lambda d: d["store"]["tiers"][1].update(method="lzma"), "store.tiers[1].method"),
    (lambda d: d.pop("store"), "store"),
    (lambda d: d.update(store="no-such-store.yaml"), "store"),
    (lambda d: d.update(fuse={"enabled": "yes"}), "fuse.enabled"),
    (lambda d: d.update(fuse={"enabled": False, "anchr": 8}), "fuse.anchr"),
    (lambda d: d["store"].update(fuse={"enabled": False}), "store.fuse"),  # KV Fuse is not the store's
])
def test_bad_files_exit_2_naming_the_key(tmp_path, shm_name, capsys, edit, key):
    path = private_config(tmp_path, shm_name, edit)
    with pytest.raises(ConfigError) as info:
        load_serve_config(path)
    assert info.value.key == key, str(info.value)
    assert kvshrink_main(["cache", "serve", "--config", str(path), "--check"]) == 2
    assert f"'{key}'" in capsys.readouterr().err


def test_index_reporting_settings_reach_the_adapter_as_written(tmp_path, shm_name):
    from kvshrink.storage_backends.tier_reporter import ReporterSettings

    index = {"index_url": "http://127.0.0.1:8200", "index_instance_id": "engine-a", "index_flush_interval": 0.2}
    config = load_serve_config(private_config(tmp_path, shm_name, lambda d: d["adapter"].update(index)),
                               check_services=False)
    assert {key: config.adapter_params[key] for key in index} == index
    parsed = KVShrinkL2AdapterConfig.from_dict(json.loads(json.dumps(config.adapter_params)))
    assert parsed.reporter == ReporterSettings("http://127.0.0.1:8200", "engine-a", 0.2)
    assert load_serve_config(private_config(tmp_path, shm_name), check_services=False).adapter_params.keys() == \
        {"store", "workers"}  # off unless asked for


def test_bad_yaml_names_the_file_and_line(tmp_path, capsys):
    path = tmp_path / "serve.yaml"
    path.write_text("server:\n  port: 5555\n  http_port: [8080\nstore: store.yaml\n")
    with pytest.raises(ConfigError) as info:
        load_serve_config(path)
    assert info.value.key == "--config"
    assert info.value.reason.startswith(f"{path} is not valid YAML at line 4, column 6: ")
    assert kvshrink_main(["cache", "serve", "--config", str(path), "--check"]) == 2
    assert "line 4" in capsys.readouterr().err


def test_unreachable_redis_and_unwritable_ssd_are_refused(tmp_path, shm_name):
    def add_redis(d):
        d["store"]["tiers"].append({"kind": "redis", "url": f"redis://127.0.0.1:{free_port()}/0", "capacity": 0})

    with pytest.raises(ConfigError) as info:
        load_serve_config(private_config(tmp_path, shm_name, add_redis))
    assert info.value.key == "store.tiers[2].url"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError) as info:
        load_serve_config(private_config(tmp_path, shm_name,
                                         lambda d: d["store"]["tiers"][1].update(path=str(tmp_path / "file" / "s"))))
    assert info.value.key == "store.tiers[1].path"


def test_store_may_be_a_separate_yaml_file(tmp_path, shm_name):
    store_file = tmp_path / "store.yaml"
    store_file.write_text(yaml.safe_dump({"tiers": [{"kind": "ssd", "path": str(tmp_path / "s"), "capacity": 0}]}))
    with pytest.raises(ConfigError) as info:
        load_serve_config(private_config(tmp_path, shm_name, lambda d: d.update(store="store.yaml")))
    assert info.value.key == f"{store_file}:tiers[0].capacity"
    store_file.write_text(yaml.safe_dump({"tiers": [{"kind": "ssd", "path": str(tmp_path / "s"), "capacity": "1GiB"}]}))
    config = load_serve_config(private_config(tmp_path, shm_name, lambda d: d.update(store="store.yaml")))
    assert config.adapter_params["config"] == str(store_file)


def _server_modules(argv: list[str]) -> dict[str, dict]:
    return {m["module_path"]: m["config"] for m in
            (json.loads(argv[i + 1]) for i, arg in enumerate(argv) if arg == "--server-module")}


def test_the_fuse_section_loads_the_fuse_module_as_written_and_off_loads_nothing(tmp_path, shm_name):
    """The serve-cache YAML's ``fuse`` section switches KV Fuse: enabled, the module gets the
    section as written (it validates it again when LMCache loads it); off or absent, no module."""
    from kvshrink.storage_backends.serve_cache import FUSE_MODULE

    assert FUSE_MODULE not in _server_modules(load_serve_config(check_services=False).argv())  # default: off
    for shipped in SHIPPED:
        assert FUSE_MODULE not in _server_modules(load_serve_config(shipped, check_services=False).argv())
    section = {"enabled": True, "model_path": str(tmp_path / "ckpt"), "ratio": 0.3}
    hints = {"port": free_port()}
    on = load_serve_config(private_config(tmp_path, shm_name, lambda d: d.update(fuse=section, hints=hints)),
                           check_services=False)
    assert _server_modules(on.argv()) == {FUSE_MODULE: section, "kvshrink.storage_backends.prefetch_hints": hints}
    off = load_serve_config(private_config(tmp_path, shm_name, lambda d: d.update(fuse={"enabled": False})),
                            check_services=False)
    assert _server_modules(off.argv()) == {}


@pytest.mark.parametrize(("section", "key"), [
    ({"enabeld": True}, "fuse.enabeld"),  # a typo is refused, not read as "off"
    ({"enabled": True, "model_path": "/m", "ratios": 0.3}, "fuse.ratios"),
    ({"enabled": "true"}, "fuse.enabled"),
    ({"enabled": True}, "fuse.model_path"),
    ({"enabled": False, "ratio": 2}, "fuse.ratio"),  # checked even when off
    ({"enabled": False, "max_pending": "4"}, "fuse.max_pending"),
    (["enabled"], "fuse"),
])
def test_a_bad_fuse_section_names_its_key(tmp_path, shm_name, section, key):
    with pytest.raises(ConfigError) as info:
        load_serve_config(private_config(tmp_path, shm_name, lambda d: d.update(fuse=section)), check_services=False)
    assert info.value.key == key


def test_argv_is_exactly_the_lmcache_server_command_for_the_config():
    flags = ServerFlags(host="0.0.0.0", port=6000, http_host="10.0.0.5", http_port=6001, prometheus_port=6002,
                        l1_size_gb=0.5, chunk_size=128, supported_transfer_mode="lmcache_driven",
                        extra_args=("--max-workers", "3"))
    adapter = {"type": "plugin", "module_path": "m", "class_name": "C", "adapter_params": {"config": "/s.yaml"}}
    assert lmcache_server_argv(flags, [adapter], python="/py") == [
        "/py", "-m", "lmcache.cli.main", "server", "--host", "0.0.0.0", "--port", "6000",
        "--http-host", "10.0.0.5", "--http-port", "6001", "--prometheus-port", "6002", "--l1-size-gb", "0.5",
        "--eviction-policy", "LRU", "--supported-transfer-mode", "lmcache_driven", "--chunk-size", "128",
        "--l2-adapter", json.dumps(adapter), "--max-workers", "3"]
    assert flags.http_url == "http://10.0.0.5:6001"
    assert ServerFlags(http_host="0.0.0.0").http_url == "http://127.0.0.1:8080"  # a wildcard is dialled on loopback


def test_server_section_keys_reach_the_command_line(tmp_path, shm_name):
    path = private_config(tmp_path, shm_name, lambda d: d["server"].update(
        host="127.0.0.1", http_host="0.0.0.0", supported_transfer_mode="engine_driven", extra_args=["--x", 1]))
    config = load_serve_config(path, check_services=False)
    argv = config.argv(python="/py")
    assert argv == lmcache_server_argv(config.server, [config.l2_adapter_spec()], "/py")
    pairs = dict(zip(argv[4::2], argv[5::2]))
    assert pairs["--host"] == "127.0.0.1" and pairs["--http-host"] == "0.0.0.0"
    assert pairs["--supported-transfer-mode"] == "engine_driven" and argv[-2:] == ["--x", "1"]
    server = yaml.safe_load(path.read_text())["server"]
    assert (pairs["--port"], pairs["--http-port"], pairs["--prometheus-port"]) == \
        (str(server["port"]), str(server["http_port"]), str(server["prometheus_port"]))
    assert json.loads(pairs["--l2-adapter"]) == config.l2_adapter_spec()


def test_the_test_launcher_builds_its_command_with_the_same_function(tmp_path):
    from kvshrink.testing.launch import LOOPBACK, LMCacheServer

    adapter = {"type": "plugin", "module_path": "m", "class_name": "C", "adapter_params": {}}
    server = LMCacheServer(l1_size_gb=0.3, l2_adapters=[adapter], chunk_size=64, extra_args=["--x"],
                           log_path=tmp_path / "log")
    prometheus = int(server.argv[server.argv.index("--prometheus-port") + 1])
    flags = ServerFlags(host="localhost", port=server.port, http_host=LOOPBACK, http_port=server.http_port,
                        prometheus_port=prometheus, l1_size_gb=0.3, chunk_size=64, extra_args=("--x",))
    assert server.argv == lmcache_server_argv(flags, [adapter])
    assert len({server.port, server.http_port, prometheus} - {5555, 8080, 9090}) == 3  # free ports, not a service's


def test_check_prints_exactly_what_runs_and_creates_nothing(tmp_path, shm_name):
    ssd = tmp_path / "not" / "yet" / "ssd"
    path = private_config(tmp_path, shm_name, lambda d: d["store"]["tiers"][1].update(path=str(ssd)))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = subprocess.run([sys.executable, "-m", "kvshrink.cli", "cache", "serve", "--config", str(path), "--check"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(scratch)})
    assert done.returncode == 0, done.stderr
    assert shlex.split(done.stdout) == load_serve_config(path, check_services=False).argv()
    assert not (tmp_path / "not").exists() and not (SHM_DIR / shm_name).exists()
    assert list(scratch.iterdir()) == []  # no log file either


def test_serve_cache_runs_lmcache_server_with_our_adapter_until_sigterm(tmp_path, shm_name):
    path = private_config(tmp_path, shm_name)
    config = load_serve_config(path)
    log = tmp_path / "serve.out"
    proc = subprocess.Popen([sys.executable, "-m", "kvshrink.cli", "cache", "serve", "--config", str(path),
                             "--log-file", str(tmp_path / "lmcache.log")],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def ready() -> bool:
            if "ready on" in log.read_text():
                return True
            assert proc.poll() is None, log.read_text()
            return False

        poll_until(ready, 180, interval=0.5, what="cache serve to become ready",
                   error=lambda message: AssertionError(f"{message}:\n{log.read_text()}"))
        check = subprocess.run([sys.executable, "-m", "kvshrink.cli", "cache", "serve", "--config", str(path), "--check"],
                               capture_output=True, text=True, timeout=120)
        (child,) = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        running = Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")[:-1]
        assert running == shlex.split(check.stdout), check.stderr
        status = httpx.get(f"http://127.0.0.1:{config.server.http_port}/status", timeout=10).json()
        adapters = status["storage_manager"]["l2_adapters"]
        assert [a["type"] for a in adapters] == ["KVShrinkL2Adapter"]
        assert adapters[0]["is_healthy"] and set(adapters[0]["store"]["tiers"]) == {"dram", "ssd"}
        assert "LMCacheMPConnector" in log.read_text()  # the vLLM line to copy
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{config.server.http_port}/healthcheck", timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        (SHM_DIR / shm_name).unlink(missing_ok=True)
