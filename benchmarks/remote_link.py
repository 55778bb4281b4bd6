"""Store / load GB/s of raw KV through a Redis tier across a rate-limited link: ours vs stock LMCache.

Compression pays most where the link, not the CPU, limits a load, and on one machine a remote tier
is otherwise only reached over loopback (memory speed). So here ``redis-server`` runs in a network
namespace of its own, joined to this one by a veth pair whose two directions are each shaped by a
``tc`` token bucket at ``rate_mbit``. The namespace, the pair and their addresses (a /30 of
10.213.0.0/16) are created and removed by :func:`limited_link`; that needs root and a kernel that
allows namespaces, and :class:`LinkUnavailable` says so where either is missing.

* stock: LMCache 0.5.6's own RESP L2 adapter (``"type": "resp"``, its native C++ connector with its
  default 8 workers; its ``valkey`` adapter runs on the same native worker pool);
* ours: our L2 adapter over the Redis tier of ``configs/store-dram-ssd-redis.yaml`` as the store's
  only tier (labelled: its DRAM and SSD tiers are dropped so that every store and every load
  crosses the link, as a chunk stored by another node would).

Both are timed by ``lmcache bench l2``'s round runners (:func:`l2_throughput.measure`: real SmolLM2
chunks, every load checked bit-exact) against a fresh ``redis-server`` each; bytes in Redis are
what its keys hold after the stores minus before (:func:`stored_bytes`), per stored token.
``kvshrink bench --sections throughput`` runs it (its remote rows; run as root).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from kvshrink.benchmarks.capacity_replay import ChunkPool
from kvshrink.benchmarks.comparison import OURS, STOCK, SideRun, TierPolicy, Workload, digest
from kvshrink.benchmarks.l2_throughput import ADAPTER_CLASS, ADAPTER_MODULE, ThroughputSettings, measure
from kvshrink.configs import shipped_path
from kvshrink.errors import KVShrinkError
from kvshrink.testing.derived_stores import load_store_mapping

REMOTE_STORE = "store-dram-ssd-redis.yaml"  # the shipped store with a remote tier; its Redis tier is measured
REDIS_PORT = 6379  # inside the namespace: its own port space
LOAD_TARGET = 1.35  # ours / stock load GB/s at 1 Gbit/s
BYTES_TARGET = 0.69  # ours / stock bytes in Redis per token


class LinkUnavailable(KVShrinkError):
    """This machine cannot make a shaped link (not root, no ``ip`` / ``tc``, namespaces refused)."""


@dataclass(frozen=True)
class Link:
    """One end of the shaped pair is here (``local_ip``); the other, in ``netns``, is ``peer_ip``."""

    netns: str
    local_ip: str
    peer_ip: str
    rate_mbit: int


def _ip(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode:
        raise LinkUnavailable(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.stdout.strip()}")


def _shape(device: str, rate_mbit: int, netns: str | None = None) -> None:
    # a bucket of 1/100 s at the rate, never under 256 KiB (veth hands over 64 KiB GSO segments)
    burst = max(256 << 10, rate_mbit * 1_000_000 // 8 // 100)
    prefix = ("ip", "netns", "exec", netns) if netns else ()
    _ip(*prefix, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{rate_mbit}mbit",
        "burst", str(burst), "latency", "100ms")


@contextlib.contextmanager
def limited_link(rate_mbit: int) -> Iterator[Link]:
    """A namespace joined to this one by a veth pair shaped to ``rate_mbit`` each way; removed on
    exit, also after an error."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise LinkUnavailable(f"`{tool}` is not installed (Debian: iproute2)")
    tag = uuid.uuid4().hex[:6]
    netns, here, there = f"kvshrink-{tag}", f"kvs{tag}a", f"kvs{tag}b"  # device names: 15 bytes at most
    subnet = int(tag[:4], 16) % (1 << 14)  # a /30 in 10.213.0.0/16
    local_ip, peer_ip = (f"10.213.{subnet >> 6}.{(subnet & 63) * 4 + k}" for k in (1, 2))
    _ip("ip", "netns", "add", netns)
    try:
        _ip("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        try:
            _ip("ip", "link", "set", there, "netns", netns)
            _ip("ip", "addr", "add", f"{local_ip}/30", "dev", here)
            _ip("ip", "link", "set", here, "up")
            for args in (("addr", "add", f"{peer_ip}/30", "dev", there), ("link", "set", there, "up"),
                         ("link", "set", "lo", "up")):
                _ip("ip", "netns", "exec", netns, "ip", *args)
            _shape(here, rate_mbit)
            _shape(there, rate_mbit, netns)
            yield Link(netns, local_ip, peer_ip, rate_mbit)
        finally:
            subprocess.run(("ip", "link", "del", here), capture_output=True)
    finally:
        subprocess.run(("ip", "netns", "del", netns), capture_output=True)


@contextlib.contextmanager
def redis_across(link: Link, workdir: Path, port: int = REDIS_PORT) -> Iterator[Any]:
    """A fresh ``redis-server`` on the far end of ``link`` (no persistence: the link is measured)."""
    from kvshrink.testing.launch import RedisServer

    server = RedisServer(workdir, port=port, host=link.peer_ip, netns=link.netns, maxmemory="4gb",
                         extra_args=("--appendonly", "no", "--protected-mode", "no"),  # a private namespace
                         log_path=workdir / "redis.log")
    try:
        server.start()  # a server that never answers is stopped too
        yield server
    finally:
        server.stop()


def stock_spec(server: Any) -> dict[str, Any]:
    return {"type": "resp", "host": server.host, "port": server.port}


def ours_spec(server: Any, threads: int, template: Path | None = None) -> dict[str, Any]:
    """Our adapter over the remote store's Redis tier alone, pointed at ``server``."""
    data = load_store_mapping(template or shipped_path(REMOTE_STORE))
    (redis,) = [t for t in data["tiers"] if t.get("kind") == "redis"]
    store = {**data, "tiers": [{**redis, "url": server.url, "put": True, "write_back": False}]}
    return {"type": "plugin", "module_path": ADAPTER_MODULE, "class_name": ADAPTER_CLASS,
            "adapter_params": {"store": store, "workers": threads}}


def stored_bytes(server: Any) -> tuple[int, int]:
    """Bytes the keys of ``server`` hold (the sum of ``MEMORY USAGE`` over them: values, key names
    and the allocator's rounding) and how many keys there are.

    Not ``used_memory``: that also counts a client's query buffer, which keeps the last large value
    written (~one chunk) until the server's cron shrinks it seconds later, so a figure read right
    after the stores would depend on the clock."""
    import redis

    client = redis.Redis(host=server.host, port=server.port)
    try:
        keys = list(client.scan_iter(count=1000))
        return sum(client.memory_usage(key, samples=0) or 0 for key in keys), len(keys)
    finally:
        client.close()


def run_side(side: str, link: Link, pool: ChunkPool, threads: int, settings: ThroughputSettings,
             template: Path | None = None) -> SideRun:
    workdir = Path(tempfile.mkdtemp(prefix="kvshrink-remote-"))
    try:
        with redis_across(link, workdir) as server:
            spec = stock_spec(server) if side == STOCK else ours_spec(server, threads, template)
            before = stored_bytes(server)[0]
            figures = measure(spec, pool, threads, settings)
            stored = (settings.warmup_rounds + settings.rounds) * threads * settings.keys_per_submit
            figures["bytes_in_redis_per_token"] = (stored_bytes(server)[0] - before) / (stored * pool[0].shape[2])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    workload = Workload(trace=digest("l2-waves", settings.keys_per_submit, settings.rounds, settings.warmup_rounds),
                        model=pool.fingerprint, budget={"link_mbit": link.rate_mbit, "threads": threads})
    if side == OURS:
        policy = TierPolicy(f"KVShrink L2 adapter, the Redis tier of {REMOTE_STORE} alone (compressed)",
                            "single", 0.0, False)
        details = {"adapter": ADAPTER_CLASS, "store": spec["adapter_params"]["store"]}
    else:
        policy = TierPolicy("LMCache RESP L2 adapter (raw values)", "single", 0.0, False)
        details = {"adapter": "resp"}
    return SideRun(side, workload, figures, details, policy)
