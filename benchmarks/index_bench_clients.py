"""Client side of ``index_bench``'s lookup measurements, run in a separate process.

The clients must not share the service's process: in it they would fight the service for the GIL.
This module imports only what the clients need, so the client process starts quickly.
"""

from __future__ import annotations

import asyncio
import socket
import time
from types import SimpleNamespace
from urllib.parse import urlsplit

import httpx
import msgspec

from kvshrink.plugins.router_logic import KVShrinkRoutingLogic

MODEL = "bench-model"


def ready() -> bool:
    """Called once by the parent: the client process has started and imported this module."""
    return True


def http_latencies(url: str, body: bytes, content_type: str, n: int, warmup: int) -> list[float]:
    """Wall time of ``n`` POST /lookup calls over one keep-alive connection (run in a child process)."""
    out = []
    with httpx.Client(base_url=url, timeout=10.0) as client:
        for i in range(warmup + n):
            t = time.perf_counter()
            resp = client.post("/lookup", content=body, headers={"content-type": content_type})
            if i >= warmup:
                out.append(time.perf_counter() - t)
            resp.raise_for_status()
    return out


def route_latencies(url: str, prompt: list[int], loads: dict[str, float], n: int, warmup: int) -> list[float]:
    """Wall time of ``n`` calls of the routing logic's ``route_request`` as production-stack's router
    makes them (run in a child process). A generous deadline, and any fallback is an error: a timed
    out lookup must show up as slow, not as a fast fallback."""
    async def run() -> list[float]:
        logic = KVShrinkRoutingLogic(url, timeout_s=5.0)
        endpoints = [SimpleNamespace(url=u, model_names=[MODEL]) for u in loads]
        engine_stats = {u: SimpleNamespace(num_running_requests=load, num_queuing_requests=0)
                        for u, load in loads.items()}
        request_json = {"model": MODEL, "prompt": prompt}
        out = []
        for i in range(warmup + n):
            t = time.perf_counter()
            await logic.route_request(endpoints, engine_stats, {}, None, request_json)
            if i >= warmup:
                out.append(time.perf_counter() - t)
        await logic.aclose()
        if logic.decisions["index"] != warmup + n:
            raise RuntimeError(f"the routing logic fell back: {dict(logic.decisions)} {dict(logic.index_failures)}")
        return out
    return asyncio.run(run())


def raw_http_latencies(url: str, body: bytes, content_type: str, n: int, warmup: int) -> list[float]:
    """Like :func:`http_latencies` with a bare keep-alive socket instead of httpx: what the service
    and the kernel cost, without a client library's ~1 ms of Python per request on this machine."""
    parts = urlsplit(url)
    request = (f"POST /lookup HTTP/1.1\r\nhost: {parts.netloc}\r\ncontent-type: {content_type}\r\n"
               f"content-length: {len(body)}\r\n\r\n").encode() + body
    out = []
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(warmup + n):
            t = time.perf_counter()
            sock.sendall(request)
            status = _read_response(sock)
            if i >= warmup:
                out.append(time.perf_counter() - t)
            if status != 200:
                raise RuntimeError(f"POST /lookup answered {status}")
    return out


_sockets: dict[str, socket.socket] = {}  # url -> keep-alive connection of this client process


def raw_lookup_once(url: str, request: bytes) -> tuple[float, float]:
    """One ready-made ``POST /lookup`` on this process's keep-alive socket to ``url``: (wall seconds,
    the answer's ``elapsed_ms``: the service's own lookup time)."""
    sock = _sockets.get(url)
    if sock is None:
        parts = urlsplit(url)
        sock = _sockets[url] = socket.create_connection((parts.hostname, parts.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t = time.perf_counter()
    sock.sendall(request)
    status, body = _read_full_response(sock)
    wall = time.perf_counter() - t
    if status != 200:
        raise RuntimeError(f"POST /lookup answered {status}: {body[:200]!r}")
    return wall, msgspec.json.decode(body)["elapsed_ms"]


def _read_response(sock: socket.socket) -> int:
    """Read one HTTP/1.1 response with a Content-Length body; its status code."""
    return _read_full_response(sock)[0]


def _read_full_response(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock)
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in lines[1:] if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        rest += _recv(sock)
    return int(lines[0].split()[1]), rest[:length]


def _recv(sock: socket.socket) -> bytes:
    chunk = sock.recv(1 << 16)
    if not chunk:
        raise ConnectionError("the service closed the connection")
    return chunk
