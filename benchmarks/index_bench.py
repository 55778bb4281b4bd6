"""Index service benchmark: KV-event ingest, lookup latency, where a lookup request spends its time.

Issue 6's targets, and the service's CPU per ``POST /lookup`` split into the lookup and its HTTP.

One set-up serves every lookup measurement: a real :class:`IndexServer` in this process, filled so
that a ``--prompt-tokens`` prompt meets ``--instances`` instances that each hold a different share
of its prefix on different tiers (each leaves the match at another block, the worst case), among
``--background-blocks`` unrelated blocks. The HTTP clients run in one spawned process (in this one
they would fight the service for the GIL) over one keep-alive connection, with bodies built once
(``--forms``): ``msgpack-router`` (what production-stack's router sends through our routing logic:
msgpack ``token_bytes`` + ``loads`` + ``instances``), ``json-base64`` (the same fields as JSON) and
``json-token-ids`` (a generic client's id list).

* ``latency`` — **Ingest**: vLLM-encoded ``KVEventBatch`` payloads (vLLM's own structs when vLLM
  imports, else the same wire shape by hand) from ``--instances`` publishers through a real ZMQ PUB
  socket, timed until the subscriber has applied them all (stores, then their removals, so the
  index keeps its size); also decode + apply in-process. Target ≥ 200k block events/s over ZMQ.
  **Lookup**, per block size, ``--repeats`` times, ``--lookups`` timed after ``--warmup``:
  ``scoring.lookup`` in-process on the router's fields; each form from a bare socket (``raw``: the
  service and the kernel) and from httpx (``httpx``: the router's client, ~1 ms of Python more); and
  a fixed ~1 ms pure-Python loop, this shared machine's own jitter (its p99 is the floor under every
  other). Each row counts garbage collections (the service runs here) and the load average around it.
  Target: p99 ≤ 5 ms at 32K tokens, 64 instances, for ``in-process`` and ``raw msgpack-router``.
* ``paired`` — the service's CPU per request, split into its lookup and the HTTP around it. Every
  round sends one request of each form and runs the same lookup in-process, the two in alternating
  order, so each comparison is between neighbours in time (this VM's CPU speed drifts by tens of
  percent over minutes); the service's lookup over the in-process one is a median per-pair ratio
  with a bootstrap interval (``paired_stats``).

    python -m kvshrink.benchmarks.index_bench latency [--block-sizes 16,128] [--repeats 2] [--json out.json]
    python -m kvshrink.benchmarks.index_bench paired [--block-sizes 16] [--forms msgpack-router] [--rounds 1000]

Threads: the driver is one thread; the service runs its own (``IndexServer``). Errors: a lost or
reordered ingest message, or a lookup answered with another status than 200, raises KVShrinkError.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.pool import Pool
from urllib.parse import urlsplit

import httpx
import msgspec
import numpy as np
import zmq
from tqdm import tqdm

from kvshrink.benchmarks.paired_stats import paired_ratio
from kvshrink.errors import KVShrinkError
from kvshrink.index import vllm_ingest
from kvshrink.index.block_index import TIER_INDEX, TIERS
from kvshrink.index.config import config_from_dict
from kvshrink.index.events import decode_batch
from kvshrink.index.hashing import prefix_hashes
from kvshrink.index.scoring import lookup
from kvshrink.index.server import IndexServer
from kvshrink.index.state import IndexState
from kvshrink.plugins.router.router_logic import lookup_body
from kvshrink.testing.polling import poll_until
from kvshrink.testing.processes import free_port

MODEL = "bench-model"
FORMS = ("msgpack-router", "json-base64", "json-token-ids")
TARGET_P99_MS = 5.0
TARGET_BLOCK_EVENTS_PER_S = 200_000
REFERENCE = "reference: fixed ~1 ms loop"
TARGET_ROWS = {"in-process": "lookup p99, in-process",
               "raw msgpack-router": "lookup p99, POST /lookup with the router's body (bare-socket client)"}


# --- ingest -------------------------------------------------------------------------------------

def encode_batches(instances: int, batches_per_instance: int, events_per_batch: int, blocks_per_event: int,
                   block_size: int, seed: int) -> list[tuple[bytes, int, bytes, int]]:
    """(topic, seq, payload, block events) per message; store batches then the matching removals."""
    rng = np.random.default_rng(seed)
    encoder = msgspec.msgpack.Encoder()
    try:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

        def stored(hashes, tokens):
            return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=block_size,
                               lora_id=None, medium="GPU", lora_name=None)

        def removed(hashes):
            return BlockRemoved(block_hashes=hashes, medium="GPU")

        def batch(events):
            return encoder.encode(KVEventBatch(ts=time.time(), events=events))
    except ImportError:  # same wire shape as vLLM 0.32: array envelope, map events
        def stored(hashes, tokens):
            return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
                    "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None}

        def removed(hashes):
            return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}

        def batch(events):
            return encoder.encode([time.time(), events])

    messages = []
    half, blocks = batches_per_instance // 2, events_per_batch * blocks_per_event
    for inst in range(instances):
        topic = f"kv@i{inst}@{MODEL}".encode()
        written: list[list[int]] = []
        next_hash = inst << 40
        for seq in range(half):
            events = []
            for _ in range(events_per_batch):
                hashes = list(range(next_hash, next_hash + blocks_per_event))
                next_hash += blocks_per_event
                events.append(stored(hashes, rng.integers(0, 49152, blocks_per_event * block_size).tolist()))
                written.append(hashes)
            messages.append((topic, seq, batch(events), blocks))
        for seq in range(half, 2 * half):
            messages.append((topic, seq, batch([removed(written.pop()) for _ in range(events_per_batch)]), blocks))
    return sorted(messages, key=lambda m: m[1])  # interleave instances like a fleet would (stable sort)


def bench_ingest_inprocess(messages, instances: int) -> float:
    """Block events per second, decoded and applied in this thread without sockets."""
    state = IndexState(config_from_dict({"zmq": {"bind": []}}))
    by_topic = {f"kv@i{k}@{MODEL}".encode(): state.resolve_instance(f"i{k}", MODEL, "bench") for k in range(instances)}
    start = time.perf_counter()
    for topic, _, payload, _ in messages:
        with state.lock:
            vllm_ingest.apply_batch(state, by_topic[topic], MODEL, decode_batch(payload))
    return sum(m[3] for m in messages) / (time.perf_counter() - start)


def bench_ingest_zmq(messages) -> float:
    """Block events per second through a real PUB socket into the service's subscriber."""
    port = free_port()
    cfg = config_from_dict({"port": free_port(), "scrape_interval_s": 0, "heartbeat_timeout_s": 0,
                            "zmq": {"bind": [f"tcp://127.0.0.1:{port}"], "rcvhwm": 0}})
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.connect(f"tcp://127.0.0.1:{port}")
    with IndexServer(cfg) as server:
        sub = server.subscriber
        seq = 0
        while sub.messages == 0:  # slow joiner: wait until the subscription is live
            pub.send_multipart([f"kv@probe@{MODEL}".encode(), seq.to_bytes(8, "big"), msgspec.msgpack.encode([0.0, []])])
            seq += 1
            time.sleep(0.05)
        base, start = sub.messages, time.perf_counter()
        for topic, s, payload, _ in messages:
            pub.send_multipart([topic, s.to_bytes(8, "big"), payload])
        with contextlib.suppress(TimeoutError):  # a shortfall is reported below, after the cleanup
            poll_until(lambda: sub.messages - base >= len(messages), 300, interval=0.001)
        elapsed, handled = time.perf_counter() - start, sub.messages - base
        dropped = server.state.metrics.registry.get_sample_value("kvshrink_index_dropped_total",
                                                                {"source": "vllm", "reason": "remove_unknown_block"})
    pub.close(linger=0)
    ctx.term()
    if handled < len(messages):
        raise KVShrinkError(f"subscriber applied {handled} of {len(messages)} messages")
    if dropped:
        raise KVShrinkError(f"{dropped} removals of unknown blocks: events were lost or reordered")
    return sum(m[3] for m in messages) / elapsed


# --- the lookup set-up ----------------------------------------------------------------------------

def instance_url(k: int) -> str:
    """A backend URL for instance ``k``; never contacted (scraping is off)."""
    return f"http://10.0.{k // 250}.{k % 250 + 1}:8000"


def fill(state: IndexState, instances: int, hashes: list[int], background_blocks: int, rng) -> None:
    """Instance k holds a (k+1)/N share of the prompt's prefix, split over two tiers (every 8th with a
    hole), and 1/N of the unrelated background blocks."""
    with state.lock:
        n = len(hashes)
        for k in range(instances):
            feed = state.feed(state.registry.get(f"i{k}"), "bench")
            depth = max(1, int(n * (k + 1) / instances))
            split = depth // 2
            state.index.store(feed, hashes[:split], hashes[:split], TIER_INDEX[TIERS[k % 4]])
            state.index.store(feed, hashes[split:depth], hashes[split:depth], TIER_INDEX[TIERS[(k + 1) % 4]])
            if k % 8 == 0:
                state.index.remove(feed, [hashes[depth * 3 // 4]], None)
        background = rng.integers(0, 2**63, background_blocks).tolist()
        for k in range(instances):
            part = background[k::instances]
            state.index.store(state.feed(state.registry.get(f"i{k}"), "background"), part, part, TIER_INDEX["gpu"])


def bodies(prompt: list[int], loads: dict[str, float]) -> dict[str, tuple[bytes, str, tuple]]:
    """Each form: (body, content type, the ``lookup()`` arguments the service will decode from it)."""
    packed = np.asarray(prompt, dtype="<u4").tobytes()
    routed = {"loads": loads, "instances": list(loads)}
    router_args = (packed, loads, list(loads))
    return {
        "msgpack-router": (msgspec.msgpack.encode({**lookup_body({"prompt": prompt}, MODEL), **routed}),
                           "application/msgpack", router_args),
        "json-base64": (msgspec.json.encode({"model": MODEL, "token_bytes": packed, **routed}), "application/json",
                        router_args),
        "json-token-ids": (msgspec.json.encode({"model": MODEL, "token_ids": prompt}), "application/json",
                           (prompt, None, None)),
    }


@dataclass
class Service:
    """A filled index behind a running server, the client process, and each form's body. The driver
    thread owns it; the client process holds its own sockets."""

    server: IndexServer
    pool: Pool
    bodies: dict[str, tuple[bytes, str, tuple]]
    matched_top3: list[int]

    def request(self, form: str) -> bytes:
        """The whole HTTP/1.1 request for ``form``, ready for a bare socket."""
        body, content_type, _ = self.bodies[form]
        return (f"POST /lookup HTTP/1.1\r\nhost: {urlsplit(self.server.url).netloc}\r\ncontent-type: {content_type}"
                f"\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body

    def lookup_call(self, form: str) -> Callable[[], object]:
        """The in-process ``scoring.lookup`` the service runs for ``form``."""
        state, (tokens, loads, only) = self.server.state, self.bodies[form][2]
        return lambda: lookup(state, MODEL, tokens, loads, only)

    def http_lookup(self, request: bytes) -> tuple[float, float, float]:
        """One bare-socket request from the client process: (client wall ms, the service thread's CPU
        ms across it, the answer's ``elapsed_ms``: the service's own lookup)."""
        cpu = self.server.thread_cpu_s()
        wall_s, elapsed_ms = self.pool.apply(raw_lookup_once, (self.server.url, request))
        return wall_s * 1e3, (self.server.thread_cpu_s() - cpu) * 1e3, elapsed_ms


@contextlib.contextmanager
def serve(args: argparse.Namespace, block_size: int) -> Iterator[Service]:
    """Start the service at ``block_size``, fill it, and start the (idle) client process."""
    rng = np.random.default_rng(args.seed)
    cfg = config_from_dict({"port": free_port(), "max_blocks": args.background_blocks + 10 * args.prompt_tokens,
                            "scrape_interval_s": 0, "heartbeat_timeout_s": 0, "zmq": {"bind": []},
                            "instances": [{"id": f"i{k}", "url": instance_url(k), "models": [MODEL]}
                                          for k in range(args.instances)]})
    prompt = rng.integers(0, 49152, args.prompt_tokens).tolist()
    loads = {instance_url(k): float(k % 5) for k in range(args.instances)}  # the router's view of load
    with IndexServer(cfg) as server:
        fill(server.state, args.instances, prefix_hashes(prompt, MODEL, block_size), args.background_blocks, rng)
        server.state.note_block_size(MODEL, block_size)
        matched = sorted((s.matched_tokens for s in lookup(server.state, MODEL, prompt).instances), reverse=True)
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            pool.apply(ready)  # the client is up and idle before anything is timed
            yield Service(server, pool, bodies(prompt, loads), matched[:3])


# --- client side: runs in the spawned process -----------------------------------------------------

_sockets: dict[str, socket.socket] = {}  # url -> this client process's keep-alive connection (paired)


def ready() -> bool:
    """Called once by the parent: the client process has started and imported this module."""
    return True


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def raw_post(sock: socket.socket, request: bytes) -> tuple[float, bytes]:
    """One ready-made request on a keep-alive socket: (wall seconds, the answer's body)."""
    t = time.perf_counter()
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in lines[1:] if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += _recv(sock)
    wall = time.perf_counter() - t
    if int(lines[0].split()[1]) != 200:
        raise KVShrinkError(f"POST /lookup answered {lines[0].decode()}: {body[:200]!r}")
    return wall, body[:length]


def _recv(sock: socket.socket) -> bytes:
    chunk = sock.recv(1 << 16)
    if not chunk:
        raise KVShrinkError("the index service closed the connection")
    return chunk


def raw_latencies(url: str, request: bytes, n: int, warmup: int) -> list[float]:
    """Wall seconds of ``n`` bare-socket requests after ``warmup``, on a connection of their own (the
    service closes one idle for 5 s): the service and the kernel, without a client library's ~1 ms of
    Python per request on this machine."""
    with connect(url) as sock:
        return [raw_post(sock, request)[0] for _ in range(warmup + n)][warmup:]


def raw_lookup_once(url: str, request: bytes) -> tuple[float, float]:
    """(wall seconds, the answer's ``elapsed_ms``: the service's own lookup time) of one request on
    this process's connection to ``url``, kept busy by the paired rounds."""
    if url not in _sockets:
        _sockets[url] = connect(url)
    wall, body = raw_post(_sockets[url], request)
    return wall, msgspec.json.decode(body)["elapsed_ms"]


def httpx_latencies(url: str, body: bytes, content_type: str, n: int, warmup: int) -> list[float]:
    """Wall seconds of ``n`` POSTs from httpx (the router's client library) after ``warmup``."""
    out = []
    with httpx.Client(base_url=url, timeout=10.0) as client:
        for _ in range(warmup + n):
            t = time.perf_counter()
            client.post("/lookup", content=body, headers={"content-type": content_type}).raise_for_status()
            out.append(time.perf_counter() - t)
    return out[warmup:]


# --- latency --------------------------------------------------------------------------------------

class GcPauses:
    """Garbage collections in this process — the service's included — while a measurement runs: how
    many, and the longest pause (a p99 suspect on a big index)."""

    def __init__(self) -> None:
        self.count, self.longest_s, self._started = 0, 0.0, 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.count += 1
            self.longest_s = max(self.longest_s, time.perf_counter() - self._started)

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def timed(name: str, measure: Callable[[], list[float]]) -> dict:
    """One latency measurement: p50 / p99 / max, GC pauses and the 1-minute load average around it."""
    before = os.getloadavg()[0]
    with GcPauses() as pauses:
        samples = np.array(measure()) * 1e3
    return {"name": name, "n": len(samples), "p50_ms": float(np.percentile(samples, 50)),
            "p99_ms": float(np.percentile(samples, 99)), "max_ms": float(samples.max()), "load_before": before,
            "load_after": os.getloadavg()[0], "gc_collections": pauses.count, "gc_longest_ms": pauses.longest_s * 1e3,
            "samples_ms": [round(float(x), 4) for x in samples]}


def time_calls(fn: Callable[[], object], n: int, warmup: int, desc: str) -> list[float]:
    """Wall seconds of ``n`` calls of ``fn`` in this thread, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    wall = []
    for _ in tqdm(range(n), desc=desc, leave=False):
        t = time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t)
    return wall


def fixed_work() -> int:
    """~1 ms of pure Python: this machine's own jitter (on a shared 2-core VM its p99 is several
    times its p50)."""
    total = 0
    for i in range(15_000):
        total += i * i
    return total


def bench_lookup(args: argparse.Namespace, block_size: int, forms: list[str]) -> list[dict]:
    """Every latency row at one block size, ``--repeats`` times."""
    rows = []
    n, w = args.lookups, args.warmup
    with serve(args, block_size) as svc:
        url = svc.server.url
        measures: list[tuple[str, Callable[[], list[float]]]] = [
            (REFERENCE, lambda: time_calls(fixed_work, n, w, "reference")),
            ("in-process", lambda: time_calls(svc.lookup_call("msgpack-router"), n, w, "lookup in-process"))]
        for form in forms:
            body, content_type, _ = svc.bodies[form]
            measures += [(f"raw {form}", lambda r=svc.request(form): svc.pool.apply(raw_latencies, (url, r, n, w))),
                         (f"httpx {form}", lambda b=body, c=content_type:
                          svc.pool.apply(httpx_latencies, (url, b, c, n, w)))]
        for repeat in range(args.repeats):
            rows += [{"block_size": block_size, "repeat": repeat, **timed(name, fn)} for name, fn in measures]
        index_blocks = len(svc.server.state.index)
    for row in rows:
        row.update(index_blocks=index_blocks, matched_tokens_top3=svc.matched_top3)
    return rows


def check_targets(res: dict) -> list[dict]:
    """Issue 6's targets. A lookup target is judged per block size on the run's p99: the 99th
    percentile of every lookup of that row in the run, all repeats pooled. (Each repeat's own p99, in
    the table, rests on its 10 slowest samples out of 1000, taken within a few seconds: on this shared
    VM whether such a window holds a burst of host contention decides it.) The reference loop's p99,
    pooled the same way, comes with it."""
    out = []
    if "ingest" in res:
        rate = res["ingest"]["zmq_block_events_per_s"]
        out.append({"name": "ingest over ZMQ, block events/s", "value": rate,
                    "target": f">= {TARGET_BLOCK_EVENTS_PER_S}", "passed": rate >= TARGET_BLOCK_EVENTS_PER_S})
    limit = res["lookup_setup"]["target_p99_ms"]

    def pooled(name: str, block_size: int) -> list[float]:
        return [x for r in res["lookup"] if r["name"] == name and r["block_size"] == block_size for x in r["samples_ms"]]

    for block_size in sorted({r["block_size"] for r in res["lookup"]}):
        reference = float(np.percentile(pooled(REFERENCE, block_size), 99))
        for row_name, label in TARGET_ROWS.items():
            samples = pooled(row_name, block_size)
            if samples:  # a row left out by --forms is not judged
                p99 = float(np.percentile(samples, 99))
                out.append({"name": f"{label}, block size {block_size}, {len(samples)} lookups", "value": p99,
                            "target": f"<= {limit} ms", "passed": p99 <= limit, "reference_loop_p99_ms": reference})
    return out


def run_latency(args: argparse.Namespace, forms: list[str]) -> dict:
    res: dict = {"cpus": os.cpu_count(), "load_average_start": os.getloadavg()}
    if not args.no_ingest:
        print(f"encoding {args.instances * args.batches_per_instance} KV event batches ...")
        messages = encode_batches(args.instances, args.batches_per_instance, args.events_per_batch,
                                  args.blocks_per_event, args.ingest_block_size, args.seed)
        res["ingest"] = {"messages": len(messages), "block_events": sum(m[3] for m in messages),
                         "inprocess_block_events_per_s": bench_ingest_inprocess(messages, args.instances),
                         "zmq_block_events_per_s": bench_ingest_zmq(messages)}
    res["lookup"] = [row for bs in args.block_sizes for row in bench_lookup(args, bs, forms)]
    res["lookup_setup"] = {"prompt_tokens": args.prompt_tokens, "instances": args.instances, "lookups": args.lookups,
                           "warmup": args.warmup, "target_p99_ms": TARGET_P99_MS}
    res["load_average_end"] = os.getloadavg()
    res["targets"] = check_targets(res)
    if "ingest" in res:
        ing = res["ingest"]
        print(f"ingest over ZMQ {ing['zmq_block_events_per_s']:,.0f} block events/s, in-process without a socket "
              f"{ing['inprocess_block_events_per_s']:,.0f}")
    setup = res["lookup_setup"]
    print(f"\nlookup latency, {setup['prompt_tokens']}-token prompt, {setup['instances']} instances, "
          f"{setup['lookups']} timed after {setup['warmup']} warm-up (target p99 <= {setup['target_p99_ms']} ms)")
    print(f"{'block':>5} {'rep':>3}  {'measure':<28} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7}  {'GC n/longest ms':>15}"
          f"  {'load 1-min before/after':>23}")
    for r in res["lookup"]:
        print(f"{r['block_size']:>5} {r['repeat']:>3}  {r['name']:<28} {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} "
              f"{r['max_ms']:>7.1f}  {r['gc_collections']:>6}/{r['gc_longest_ms']:<8.1f}  "
              f"{r['load_before']:>11.2f} / {r['load_after']:<9.2f}")
    blocks = ", ".join(f"{r['index_blocks']:,}" for r in res["lookup"] if r["repeat"] == 0 and r["name"] == "in-process")
    print(f"({blocks} blocks indexed; load average {res['load_average_start'][0]:.1f} at start, "
          f"{res['load_average_end'][0]:.1f} at end, on {res['cpus']} CPUs — other processes share them)\n")
    for t in res["targets"]:
        value = f"{t['value']:,.0f}" if t["value"] >= 1000 else f"{t['value']:.2f} ms"
        context = (f"   (the 1 ms reference loop's p99 alongside: {t['reference_loop_p99_ms']:.2f} ms)"
                   if "reference_loop_p99_ms" in t else "")
        print(f"{'PASS' if t['passed'] else 'FAIL'}  {t['name']}: {value} (target {t['target']}){context}")
    return res


# --- paired ---------------------------------------------------------------------------------------

def run_paired(args: argparse.Namespace, forms: list[str]) -> dict:
    """Per block size and form: p50 / p99 of each part of a request, and the paired ratio of the
    service's lookup over the same lookup in-process."""
    res: dict = {}
    for block_size in args.block_sizes:
        samples: dict[str, list[tuple[float, float, float, float]]] = {form: [] for form in forms}
        with serve(args, block_size) as svc:
            calls = {form: (svc.request(form), svc.lookup_call(form)) for form in forms}
            for i in tqdm(range(args.warmup + args.rounds), desc=f"paired rounds, block {block_size}", leave=False):
                for j, (form, (request, inprocess)) in enumerate(calls.items()):
                    http_first = (i + j) % 2 == 0  # alternate which side goes first
                    first = svc.http_lookup(request) if http_first else None
                    t = time.perf_counter()
                    inprocess()
                    inprocess_ms = (time.perf_counter() - t) * 1e3
                    wall_ms, service_ms, elapsed_ms = first or svc.http_lookup(request)
                    if i >= args.warmup:
                        samples[form].append((wall_ms, service_ms, elapsed_ms, inprocess_ms))
        res[str(block_size)] = {form: summarize(rows) for form, rows in samples.items()}
    print(f"POST /lookup, {args.prompt_tokens}-token prompt, {args.instances} instances, {args.rounds} paired rounds "
          f"(ms, p50 / p99; service lookup / in-process: median per-pair ratio [95 % interval])")
    print(f"{'block':>5} {'form':<16} {'latency':>13} {'service CPU':>13} {'its lookup':>13} {'HTTP rest':>13} "
          f"{'in-process':>13}  {'lookup ratio':>22}")
    for block_size, by_form in res.items():
        for form, row in by_form.items():
            cells = " ".join(f"{row[k + '_p50_ms']:>6.2f}/{row[k + '_p99_ms']:<6.2f}" for k in
                             ("latency", "service_cpu", "its_lookup", "http_rest", "inprocess_lookup"))
            ratio = row["lookup_ratio"]
            print(f"{block_size:>5} {form:<16} {cells}  {ratio['median']:>6.3f} [{ratio['low']:.3f}, {ratio['high']:.3f}]")
    return {"forms": res}


def summarize(rows: list[tuple[float, float, float, float]]) -> dict:
    wall, service, its_lookup, inprocess = (np.array(column) for column in zip(*rows))
    out: dict = {"n": len(rows)}
    for key, values in (("latency", wall), ("service_cpu", service), ("its_lookup", its_lookup),
                        ("http_rest", service - its_lookup), ("inprocess_lookup", inprocess)):
        out[f"{key}_p50_ms"] = float(np.median(values))
        out[f"{key}_p99_ms"] = float(np.percentile(values, 99))
    out["lookup_ratio"] = paired_ratio(its_lookup.tolist(), inprocess.tolist()).as_dict()
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--instances", type=int, default=64)
    common.add_argument("--prompt-tokens", type=int, default=32_768)
    common.add_argument("--background-blocks", type=int, default=500_000)
    common.add_argument("--warmup", type=int, default=50, help="untimed lookups (paired: rounds) first")
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--json", help="write the results here")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    latency = sub.add_parser("latency", parents=[common], help="ingest rate and lookup latency against the targets")
    latency.add_argument("--block-sizes", default="16,128", help="comma-separated (vLLM GPU default 16, CPU 128)")
    latency.add_argument("--forms", default="msgpack-router", help=f"comma-separated subset of {', '.join(FORMS)}")
    latency.add_argument("--lookups", type=int, default=1000, help="timed lookups per measurement")
    latency.add_argument("--repeats", type=int, default=1, help="measure every row this many times")
    latency.add_argument("--no-ingest", action="store_true", help="lookup latency only")
    latency.add_argument("--batches-per-instance", type=int, default=64)
    latency.add_argument("--events-per-batch", type=int, default=8)
    latency.add_argument("--blocks-per-event", type=int, default=16)
    latency.add_argument("--ingest-block-size", type=int, default=16)
    paired = sub.add_parser("paired", parents=[common], help="service CPU: its lookup vs the HTTP around it")
    paired.add_argument("--block-sizes", default="16", help="comma-separated")
    paired.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated subset of {', '.join(FORMS)}")
    paired.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args(argv)
    args.block_sizes = [int(b) for b in args.block_sizes.split(",")]
    unknown = set(args.forms.split(",")) - set(FORMS)
    if unknown:
        parser.error(f"unknown form(s) {', '.join(sorted(unknown))} (known: {', '.join(FORMS)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    forms = args.forms.split(",")
    res = run_latency(args, forms) if args.command == "latency" else run_paired(args, forms)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"setup": vars(args), **res}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
