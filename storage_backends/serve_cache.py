"""``kvshrink serve-cache [--config FILE]``: LMCache's multiprocess cache server with the KVShrink
L2 adapter, configured from one YAML file; without ``--config``, every server default below and
the shipped default store (``kvshrink.configs.default_store_path()``, ``store-default.yaml``).

The file has three sections::

    server:   {port, http_port, l1_size_gb, chunk_size, extra_args}   # `lmcache server` flags
    adapter:  {workers}                                               # optional
    store:    {tiers: [...], engine: {...}}   # a store mapping, or the path of a store YAML

Everything is validated here first (``ConfigError`` names the key, e.g. ``store.tiers[1].path``;
the SSD directory, /dev/shm room and Redis are checked too), then ``lmcache server`` is started
through :class:`kvshrink.launch.LMCacheServer` and kept running until SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from kvshrink.errors import ConfigError

if TYPE_CHECKING:
    from kvshrink.launch import LMCacheServer
    from kvshrink.store import StoreConfig

ADAPTER_MODULE = "kvshrink.storage_backends.mp_l2_adapter"
ADAPTER_CLASS = "KVShrinkL2Adapter"
_SECTIONS = {"server", "adapter", "store"}
_SERVER_KEYS = {"port", "http_port", "l1_size_gb", "chunk_size", "extra_args"}
_ADAPTER_KEYS = {"workers"}


@dataclass(frozen=True)
class ServeCacheConfig:
    """A validated serve-cache file."""

    store: "StoreConfig"
    adapter_params: dict[str, Any]  # exactly what the adapter will receive
    port: int = 5555
    http_port: int = 8080
    l1_size_gb: float = 2.0
    chunk_size: int = 256
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def l2_adapter_spec(self) -> dict[str, Any]:
        """The ``--l2-adapter`` JSON for ``lmcache server``."""
        return {"type": "plugin", "module_path": ADAPTER_MODULE, "class_name": ADAPTER_CLASS,
                "adapter_params": self.adapter_params}


def load_serve_config(path: "str | Path | None" = None, *, check_services: bool = True) -> ServeCacheConfig:
    """Parse and check a serve-cache YAML (None: the defaults, with the shipped default store);
    :class:`ConfigError` names the key to fix."""
    import yaml

    from kvshrink.configs import default_store_path
    from kvshrink.storage_backends.store_setup import file_key_prefix, load_store_config, preflight

    if path is None:  # no file: the server defaults and the shipped default store
        path, data = default_store_path(), {"store": str(default_store_path())}
    else:
        path = Path(path).expanduser()
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise ConfigError("--config", f"cannot read {path}: {exc.strerror or exc}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError("--config", f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ConfigError("<root>", f"{path} must hold a mapping with server / adapter / store sections")
    _reject_unknown(data, _SECTIONS, "")
    server = _section(data, "server", _SERVER_KEYS)
    adapter = _section(data, "adapter", _ADAPTER_KEYS)
    if "store" not in data:
        raise ConfigError("store", "required: the store tiers (a mapping) or the path of a store YAML")
    source = data["store"]
    if isinstance(source, str):
        store_path = (path.parent / Path(source).expanduser()).resolve()
        store = load_store_config(store_path, file_key_prefix(store_path), "store")
        params: dict[str, Any] = {"config": str(store_path)}
        prefix = file_key_prefix(store_path)
    else:
        store = load_store_config(source, "store.", "store")
        params = {"store": source}
        prefix = "store."
    if "workers" in adapter:
        params["workers"] = _int(adapter["workers"], "adapter.workers", 1, 256)
    if check_services:
        preflight(store, prefix)
    extra = server.get("extra_args", [])
    if not isinstance(extra, list) or not all(isinstance(a, (str, int, float)) for a in extra):
        raise ConfigError("server.extra_args", f"expected a list of command-line words, got {extra!r}")
    return ServeCacheConfig(store=store, adapter_params=params,
                            port=_int(server.get("port", 5555), "server.port", 1, 65535),
                            http_port=_int(server.get("http_port", 8080), "server.http_port", 1, 65535),
                            l1_size_gb=_positive(server.get("l1_size_gb", 2.0), "server.l1_size_gb"),
                            chunk_size=_int(server.get("chunk_size", 256), "server.chunk_size", 1, 1 << 20),
                            extra_args=tuple(str(a) for a in extra))


def build_server(config: ServeCacheConfig, log_path: Path | None = None) -> "LMCacheServer":
    """An (unstarted) ``lmcache server`` with our adapter, on the configured ports."""
    from kvshrink.launch import LMCacheServer

    server = LMCacheServer(port=config.port, l1_size_gb=config.l1_size_gb, l2_adapters=[config.l2_adapter_spec()],
                           chunk_size=config.chunk_size, extra_args=config.extra_args, log_path=log_path)
    # LMCacheServer picks a free HTTP port for tests; a service wants the configured one
    server.argv[server.argv.index("--http-port") + 1] = str(config.http_port)
    server.http_port = config.http_port
    return server


# -- the command ----------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None,
                        help=f"serve-cache YAML (see configs/serve-cache-*.yaml); default: ports "
                             f"{ServeCacheConfig.port} / {ServeCacheConfig.http_port}, {ServeCacheConfig.l1_size_gb:g} "
                             f"GB L1, chunk size {ServeCacheConfig.chunk_size}, and the shipped default store "
                             "(store-default.yaml)")
    parser.add_argument("--check", action="store_true",
                        help="validate the file and the machine (directories, /dev/shm, Redis), print the "
                             "lmcache server command line, and exit")
    parser.add_argument("--log-file", type=Path, default=None, help="where lmcache server logs (default: a temp file)")
    parser.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for /healthcheck")


def run(args: argparse.Namespace) -> int:
    try:
        config = load_serve_config(args.config)
    except ConfigError as exc:
        print(f"kvshrink serve-cache: {args.config or 'default configuration'}: {exc}", file=sys.stderr)
        return 2
    server = build_server(config, args.log_file)
    if args.check:
        print(" ".join(_shell_quote(a) for a in server.argv))
        return 0
    return _serve(server, args.ready_timeout)


def _serve(server: "LMCacheServer", ready_timeout: float) -> int:
    from kvshrink.launch import ServerStartError, log_tail

    stop_requested = []
    previous = {sig: signal.signal(sig, lambda s, _f: stop_requested.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            server.start(timeout=ready_timeout)
        except ServerStartError as exc:
            print(f"kvshrink serve-cache: lmcache server did not start:\n{exc}", file=sys.stderr)
            return 1
        print(f"kvshrink serve-cache: ready on tcp://localhost:{server.port} (status: {server.http_url}/status, "
              f"log: {server.log_path})", flush=True)
        print("vLLM --kv-transfer-config '" + json.dumps(server.connector_config()) + "'", flush=True)
        while not stop_requested:
            if not server.running:
                print(f"kvshrink serve-cache: lmcache server exited:\n{log_tail(server.log_path)}", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# -- validation helpers --------------------------------------------------------------------------
def _section(data: Mapping[str, Any], name: str, allowed: set[str]) -> Mapping[str, Any]:
    section = data.get(name) or {}
    if not isinstance(section, Mapping):
        raise ConfigError(name, f"expected a mapping, got {type(section).__name__}")
    _reject_unknown(section, allowed, name)
    return section


def _reject_unknown(data: Mapping[str, Any], allowed: set[str], prefix: str) -> None:
    for key in data:
        if key not in allowed:
            raise ConfigError(f"{prefix}.{key}" if prefix else str(key), f"unknown key; expected one of {sorted(allowed)}")


def _int(value: Any, key: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(key, f"expected an integer in [{low}, {high}], got {value!r}")
    return value


def _positive(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(key, f"expected a number > 0, got {value!r}")
    return float(value)


def _shell_quote(word: str) -> str:
    import shlex

    return shlex.quote(word)
