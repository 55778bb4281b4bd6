"""``kvshrink cache serve [--config FILE]`` (formerly ``kvshrink serve-cache``): LMCache's
multiprocess cache server with the KVShrink L2 adapter, configured from one YAML file (a
"serve-cache file"); without ``--config``, every server default below and the shipped default
store (``kvshrink.configs.default_store_path()``, ``store-default.yaml``).

The file has these sections::

    server:   {host, port, http_host, http_port, prometheus_port, l1_size_gb, chunk_size,
               supported_transfer_mode, extra_args,                    # `lmcache server` flags
               shutdown_timeout_s}              # how long a stop waits for the store to close
    adapter:  {workers, index_url, index_instance_id, index_flush_interval, index_max_pending}
                                               # optional; index_*: report tiers to the index
    store:    {tiers: [...], engine: {...}, ...}   # a store mapping, or the path of a store YAML
    hints:    {host, port, auth_token_env, auth_token, model_name, max_body_bytes, max_tokens}
                  # optional: the prefetch-hint endpoint (POST /v1/prefetch), an lmcache server module
                  # (:mod:`~kvshrink.storage_backends.prefetch_hints`); loopback unless a token is set.
                  # Prefer auth_token_env: the section is passed on the command line as written
    fuse:     {enabled, model_path, ratio, check_layer, threads, timeout_s, max_pending,
               min_reuse_chunks, max_indexed_chunks, anchor}
                  # optional: enabled: true loads KV Fuse, an lmcache server module
                  # (:mod:`~kvshrink.storage_backends.kv_fuse.server_module`); off: stock handlers

Everything is validated here first (``ConfigError`` names the key, e.g. ``store.tiers[1].path``;
the SSD directory, /dev/shm room and Redis are checked too, creating nothing). Then one pure
function, :func:`lmcache_server_argv`, turns the config into the ``lmcache server`` command line:
``--check`` prints exactly that list and exits; otherwise it runs as a child process until SIGINT /
SIGTERM, then gets SIGTERM itself and ``shutdown_timeout_s`` to close the store (``persist_on_close``
copies DRAM to SSD then) before its process group is killed. The test and benchmark launcher (``kvshrink.testing.launch.LMCacheServer``) builds its
command with the same function, passing its own choices (free loopback ports); nothing here
imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from kvshrink.config_checks import (int_value, load_yaml, mapping_value, number_value, one_of,
                                    port_value, reject_unknown, workers_value)
from kvshrink.errors import ConfigError

if TYPE_CHECKING:
    from kvshrink.store import StoreConfig

ADAPTER_MODULE = "kvshrink.storage_backends.mp_l2_adapter"
ADAPTER_CLASS = "KVShrinkL2Adapter"
TRANSFER_MODES = ("lmcache_driven", "engine_driven", "auto")  # lmcache server's choices
_SECTIONS = {"server", "adapter", "store", "hints", "fuse"}
HINTS_MODULE = "kvshrink.storage_backends.prefetch_hints"
FUSE_MODULE = "kvshrink.storage_backends.kv_fuse.server_module"  # named, not imported: it loads LMCache and torch
_WILDCARDS = ("0.0.0.0", "::", "")
DEFAULT_SHUTDOWN_TIMEOUT_S = 120.0  # ServerFlags says why


@dataclass(frozen=True)
class ServerFlags:
    """The ``lmcache server`` flags ``cache serve`` sets (its ``server`` section), and how long a stop
    waits for it. Defaults are a service's, not a test's: LMCache's own ports (5555 requests on
    localhost, 8080 admin HTTP on loopback only — it has no authentication — which also serves
    Prometheus ``/metrics``; 9090 is passed as ``--prometheus-port``, where LMCache 0.5.6 starts
    nothing), and transfer mode ``auto`` (vLLM CPU's registration is refused without it; CUDA
    engines work with it too).

    ``shutdown_timeout_s`` is no flag: after SIGTERM the server closes the store, and with
    ``persist_on_close`` copies every chunk only DRAM holds to the SSD; past this many seconds its
    process group is killed (what was not copied stays in /dev/shm until a reboot). The default,
    120 s, is three times what the shipped 4 GiB DRAM tier took (~100 MiB of stored bytes a second
    on 2 busy cores, fast -> dense re-encode included): raise it with a bigger DRAM tier or a slower
    disk, and keep a supervisor's grace period (Kubernetes ``terminationGracePeriodSeconds``)
    above it."""

    host: str = "localhost"
    port: int = 5555
    http_host: str = "127.0.0.1"
    http_port: int = 8080
    prometheus_port: int = 9090
    l1_size_gb: float = 2.0
    chunk_size: int = 256
    supported_transfer_mode: str = "auto"
    extra_args: tuple[str, ...] = ()  # any other lmcache server flags, verbatim, last (so they win)
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S

    @classmethod
    def from_section(cls, section: Mapping[str, Any], where: str = "server") -> "ServerFlags":
        """Validate a ``server`` section; missing keys take the defaults above."""
        reject_unknown(section, {f.name for f in fields(cls)}, where)
        d = cls()
        extra = section.get("extra_args", [])
        if not isinstance(extra, list) or not all(isinstance(a, (str, int, float)) for a in extra):
            raise ConfigError(f"{where}.extra_args", f"expected a list of command-line words, got {extra!r}")
        return cls(host=_host(section.get("host", d.host), f"{where}.host"),
                   port=port_value(section.get("port", d.port), f"{where}.port"),
                   http_host=_host(section.get("http_host", d.http_host), f"{where}.http_host"),
                   http_port=port_value(section.get("http_port", d.http_port), f"{where}.http_port"),
                   prometheus_port=port_value(section.get("prometheus_port", d.prometheus_port),
                                              f"{where}.prometheus_port"),
                   l1_size_gb=number_value(section.get("l1_size_gb", d.l1_size_gb), f"{where}.l1_size_gb", above=True),
                   chunk_size=int_value(section.get("chunk_size", d.chunk_size), f"{where}.chunk_size", 1, 1 << 20),
                   supported_transfer_mode=one_of(section.get("supported_transfer_mode", d.supported_transfer_mode),
                                                  TRANSFER_MODES, f"{where}.supported_transfer_mode"),
                   extra_args=tuple(str(a) for a in extra),
                   shutdown_timeout_s=number_value(section.get("shutdown_timeout_s", d.shutdown_timeout_s),
                                                   f"{where}.shutdown_timeout_s", above=True))

    @property
    def http_url(self) -> str:
        """Where this machine reaches the admin HTTP server (/healthcheck, /status)."""
        host = _reachable(self.http_host, "127.0.0.1")
        return f"http://{f'[{host}]' if ':' in host else host}:{self.http_port}"


def lmcache_server_argv(server: ServerFlags, l2_adapters: Sequence[Mapping[str, Any]] = (),
                        python: str = sys.executable) -> list[str]:
    """The exact ``lmcache server`` command line for ``server`` and these ``--l2-adapter`` specs.
    Pure: reads nothing, creates nothing. Every flag is spelled out, so the line does not depend on
    LMCache's defaults; ``extra_args`` come last and so override any of them."""
    argv = [python, "-m", "lmcache.cli.main", "server", "--host", server.host, "--port", str(server.port),
            "--http-host", server.http_host, "--http-port", str(server.http_port),
            "--prometheus-port", str(server.prometheus_port), "--l1-size-gb", str(server.l1_size_gb),
            "--eviction-policy", "LRU", "--supported-transfer-mode", server.supported_transfer_mode,
            "--chunk-size", str(server.chunk_size)]
    for adapter in l2_adapters:
        argv += ["--l2-adapter", json.dumps(adapter)]
    return argv + list(server.extra_args)


def connector_config(server: ServerFlags) -> dict[str, Any]:
    """vLLM ``--kv-transfer-config`` that attaches an engine on this machine to ``server``."""
    return {"kv_connector": "LMCacheMPConnector",
            "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{_reachable(server.host, 'localhost')}",
                                          "lmcache.mp.port": server.port}}


@dataclass(frozen=True)
class ServeCacheConfig:
    """A validated serve-cache file."""

    store: "StoreConfig"
    adapter_params: dict[str, Any]  # exactly what the adapter will receive
    server: ServerFlags = field(default_factory=ServerFlags)
    hints: dict[str, Any] | None = None  # the hint module's config, as written (None: no hint endpoint)
    fuse: dict[str, Any] | None = None  # the KV Fuse module's config, as written (None: fusion off, stock handlers)

    def l2_adapter_spec(self) -> dict[str, Any]:
        """The ``--l2-adapter`` JSON for ``lmcache server``."""
        return {"type": "plugin", "module_path": ADAPTER_MODULE, "class_name": ADAPTER_CLASS,
                "adapter_params": self.adapter_params}

    def argv(self, python: str = sys.executable) -> list[str]:
        """What ``cache serve`` runs (and ``--check`` prints)."""
        from dataclasses import replace

        modules = [(HINTS_MODULE, self.hints), (FUSE_MODULE, self.fuse)]
        flags = [arg for path, config in modules if config is not None
                 for arg in ("--server-module", json.dumps({"module_path": path, "config": config}))]
        server = replace(self.server, extra_args=(*flags, *self.server.extra_args))
        return lmcache_server_argv(server, [self.l2_adapter_spec()], python)


def load_serve_config(path: "str | Path | None" = None, *, check_services: bool = True) -> ServeCacheConfig:
    """Parse and check a serve-cache YAML (None: the defaults, with the shipped default store);
    :class:`ConfigError` names the key to fix. ``check_services`` also checks the machine
    (directories, /dev/shm, Redis), reading only."""
    from kvshrink.configs import default_store_path
    from kvshrink.storage_backends.store_setup import file_key_prefix, load_store_config, preflight
    from kvshrink.storage_backends.tier_reporter import REPORTER_KEYS, ReporterSettings

    if path is None:  # no file: the server defaults and the shipped default store
        path, data = default_store_path(), {"store": str(default_store_path())}
    else:
        path = Path(path).expanduser()
        data = load_yaml(path, "--config")
    reject_unknown(data, _SECTIONS)
    server = ServerFlags.from_section(mapping_value(data.get("server"), "server"))
    adapter = mapping_value(data.get("adapter"), "adapter", {"workers", *REPORTER_KEYS})
    if "store" not in data:
        raise ConfigError("store", "required: the store tiers (a mapping) or the path of a store YAML")
    source = data["store"]
    if isinstance(source, str):
        store_path = (path.parent / Path(source).expanduser()).resolve()
        prefix = file_key_prefix(store_path)
        store = load_store_config(store_path, prefix, "store")
        params: dict[str, Any] = {"config": str(store_path)}
    else:
        prefix = "store."
        store = load_store_config(source, prefix, "store")
        params = {"store": source}
    if "workers" in adapter:
        params["workers"] = workers_value(adapter["workers"], "adapter.workers")
    if ReporterSettings.from_params(adapter, "adapter.") is not None:  # validated here, passed on as written
        params.update({key: adapter[key] for key in REPORTER_KEYS if key in adapter})
    hints = None
    if data.get("hints") is not None:
        from kvshrink.storage_backends.prefetch_hints import HintSettings

        hints = dict(mapping_value(data["hints"], "hints"))
        HintSettings.from_config(hints, "hints")  # validated here, passed on as written
    fuse = _fuse_section(data.get("fuse"))
    if check_services:
        preflight(store, prefix)
    return ServeCacheConfig(store=store, adapter_params=params, server=server, hints=hints, fuse=fuse)


def _fuse_section(section: Any) -> dict[str, Any] | None:
    """The KV Fuse module's config: the ``fuse`` section as written once it validates, None when
    absent or not enabled (then no module is loaded at all)."""
    from kvshrink.storage_backends.kv_fuse.settings import SECTION, FuseModuleSettings

    if section is None or not FuseModuleSettings.from_config(section, SECTION).enabled:
        return None
    return dict(section)


# -- the command ----------------------------------------------------------------------------------
PROG = "kvshrink cache serve"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServerFlags()
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help=f"serve-cache YAML (see configs/serve-cache-*.yaml); default: ports {d.port} (requests) / "
                             f"{d.http_port} (HTTP: /status and Prometheus /metrics), {d.l1_size_gb:g} GB L1, chunk "
                             f"size {d.chunk_size}, and the shipped default store (store-default.yaml)")
    parser.add_argument("--check", action="store_true",
                        help="validate the file and the machine (directories, free disk and /dev/shm, Redis), print "
                             "the exact lmcache server command line, and exit; creates nothing")
    parser.add_argument("--log-file", type=Path, default=None, metavar="FILE",
                        help="where lmcache server logs (default: a new temp file, named when ready)")
    parser.add_argument("--ready-timeout", type=float, default=180.0, metavar="SECONDS",
                        help="seconds to wait for lmcache server's /healthcheck before giving up (default 180)")
    parser.add_argument("--shutdown-timeout", type=float, default=None, metavar="SECONDS",
                        help="after SIGINT / SIGTERM, seconds lmcache server gets to close the store "
                             "(persist_on_close copies DRAM to SSD) before it is killed; default: the file's "
                             f"server.shutdown_timeout_s, else {d.shutdown_timeout_s:g}")


def run(args: argparse.Namespace) -> int:
    import shlex
    from dataclasses import replace

    try:  # a bad flag is refused before the file is read: its checks (e.g. free disk) must not hide it
        timeout = None if args.shutdown_timeout is None else \
            number_value(args.shutdown_timeout, "--shutdown-timeout", above=True)
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    try:
        config = load_serve_config(args.config)
        if timeout is not None:
            config = replace(config, server=replace(config.server, shutdown_timeout_s=timeout))
    except ConfigError as exc:
        print(f"{PROG}: {args.config or 'default configuration'}: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(shlex.join(config.argv()))
        return 0
    return _serve(config, args.log_file, args.ready_timeout)


def _serve(config: ServeCacheConfig, log_path: Path | None, ready_timeout: float) -> int:
    """Run ``config.argv()`` in its own process group until it exits or we get SIGINT / SIGTERM;
    0 after a requested stop, 1 if the server failed to start or died."""
    import tempfile

    if log_path is None:
        log_path = Path(tempfile.mkstemp(prefix="kvshrink-serve-cache-", suffix=".log")[1])
    stop_requested: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _f: stop_requested.append(s))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(config.argv(), env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"}, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    server = config.server
    ready = False
    try:
        deadline = time.monotonic() + ready_timeout
        while not stop_requested:
            if proc.poll() is not None:
                print(f"{PROG}: lmcache server exited with {proc.returncode}:\n{_tail(log_path)}", file=sys.stderr)
                return 1
            if not ready and _healthy(f"{server.http_url}/healthcheck"):
                ready = True
                print(f"{PROG}: ready on tcp://{_reachable(server.host, 'localhost')}:{server.port} "
                      f"(status: {server.http_url}/status, log: {log_path})", flush=True)
                print("vLLM --kv-transfer-config '" + json.dumps(connector_config(server)) + "'", flush=True)
            elif not ready and time.monotonic() > deadline:
                print(f"{PROG}: lmcache server not healthy after {ready_timeout:g} s:\n{_tail(log_path)}",
                      file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        at_risk = _dram_chunks(server.http_url) if ready and config.store.persist_on_close else None
        _stop(proc, server.shutdown_timeout_s, _unpersisted(config, at_risk))
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop(proc: "subprocess.Popen[bytes]", timeout: float, unpersisted: str = "") -> None:
    """SIGTERM to the server (it stops its own children and closes the store), SIGKILL to its
    process group if it has not exited within ``timeout`` seconds, saying in one line what that
    cost (``unpersisted``); then SIGKILL to any straggler."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"{PROG}: lmcache server still closing the store {timeout:g} s after SIGTERM "
                  f"(server.shutdown_timeout_s / --shutdown-timeout); killing it{unpersisted}", file=sys.stderr,
                  flush=True)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _dram_chunks(http_url: str) -> int | None:
    """Chunks in our adapter's DRAM tiers, from /status (None: no answer). Asked just before
    SIGTERM: with ``persist_on_close`` these are what the close copies to the SSD, at most."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{http_url}/status", timeout=2.0) as response:
            status = json.load(response)
        adapters = status["storage_manager"]["l2_adapters"]
        tiers = next(a["store"]["tiers"] for a in adapters if a.get("type") == ADAPTER_CLASS)
        return sum(int(t.get("chunks", 0)) for t in tiers.values() if t.get("kind") == "dram")
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError, StopIteration):
        return None


def _unpersisted(config: ServeCacheConfig, dram_chunks: int | None) -> str:
    """The end of the kill line: what a cut-short close leaves unpersisted, as far as it is known."""
    if not config.store.persist_on_close:
        return " (persist_on_close is off: no DRAM chunks were being copied)"
    if dram_chunks is None:
        return ": DRAM chunks not yet copied to the SSD stay in /dev/shm only, until a reboot"
    return (f": up to {dram_chunks} chunks held in DRAM at SIGTERM were not copied to the SSD (persist_on_close); "
            "they stay in /dev/shm only, until a reboot")


def _healthy(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _host(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value):
        raise ConfigError(key, f"expected a host name or address, got {value!r}")
    return value


def _reachable(host: str, local: str) -> str:
    """``host`` as a client on this machine dials it: a wildcard bind address means ``local``."""
    return local if host in _WILDCARDS else host
