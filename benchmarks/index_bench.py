"""Index service benchmark: KV-event ingest rate and lookup latency (issue 6 targets).

* **Ingest** — vLLM-encoded ``KVEventBatch`` payloads (built with vLLM's own structs when vLLM is
  importable, else the same wire shape by hand) from ``--instances`` publishers are sent through a
  real ZMQ PUB socket to the service's subscriber; we time until the subscriber has applied all of
  them. Every batch stores ``--blocks-per-event`` blocks per event and later batches remove them,
  so the index stays at a realistic size. Also timed: decode + apply in-process, without sockets.
  Target: ≥ 200k block events/s.
* **Lookup** — for each of ``--block-sizes``: a ``--prompt-tokens`` prompt against ``--instances``
  instances that each hold a different share of its prefix on different tiers (every instance
  leaves the match at another block, the worst case), with ``--background-blocks`` unrelated
  blocks in the index. Timed after ``--warmup`` untimed calls, ``--repeats`` times:
  in-process (``scoring.lookup`` of the router's token bytes, loads and candidates; wall and CPU
  time) and, from a separate client process over one
  keep-alive connection (client-observed wall time): ``POST /lookup`` with a JSON ``token_ids``
  list (a generic client), with the body production-stack's router sends through our routing
  logic (msgpack ``token_bytes`` + ``loads`` + ``instances``) — also from a bare-socket client, which
  shows what the service and the kernel cost without httpx's own ~1 ms per request —, with JSON
  ``token_bytes`` (base64: what the routing logic sent before), and the routing logic's whole
  ``route_request`` (body building, httpx, answer parsing; clients in ``index_bench_clients``). For each HTTP form the service thread's CPU per
  request is reported ("srv"), next to the in-process lookup's own CPU: the service's HTTP cost is
  their difference — compare them within one repeat, this machine's CPU speed drifts over minutes.
  Garbage collections during each measurement and their longest pause are counted (the service
  runs in this process). The 1-minute load average before and after every measurement is
  reported with it, and a fixed ~1 ms
  pure-Python loop is timed the same way as a reference: this machine is shared, and that loop's
  p99 is the floor under every other p99 in the table.
  Target: p99 ≤ 5 ms at 32K tokens, 64 instances, for the in-process lookup and for the router's
  body from the bare-socket client, at each block size: the p99 of all of the run's lookups of that
  form, repeats pooled (PASS/FAIL lines at the end; ``check_targets`` says why pooled).

    python -m kvshrink.benchmarks.index_bench [--block-sizes 16,128] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import time

import msgspec
import numpy as np
import zmq
from tqdm import tqdm

from kvshrink.index.block_index import TIER_INDEX, TIERS
from kvshrink.index.config import config_from_dict
from kvshrink.index.events import decode_batch
from kvshrink.index.hashing import prefix_hashes
from kvshrink.index.scoring import lookup
from kvshrink.index.server import IndexServer
from kvshrink.index.state import IndexState
from kvshrink.benchmarks.index_bench_clients import (MODEL, http_latencies, raw_http_latencies, ready,
                                                    route_latencies)
from kvshrink.index import vllm_ingest
from kvshrink.testing.launch import free_port
from kvshrink.testing.polling import poll_until
from kvshrink.plugins.router_logic import lookup_body


def encode_batches(instances: int, batches_per_instance: int, events_per_batch: int, blocks_per_event: int,
                   block_size: int, seed: int) -> list[tuple[bytes, int, bytes, int]]:
    """(topic, seq, payload, block events) per message; store batches then the matching removals."""
    rng = np.random.default_rng(seed)
    encoder = msgspec.msgpack.Encoder()
    try:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

        def stored(hashes, parent, tokens):
            return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=block_size,
                               lora_id=None, medium="GPU", lora_name=None)

        def removed(hashes):
            return BlockRemoved(block_hashes=hashes, medium="GPU")

        def batch(events):
            return encoder.encode(KVEventBatch(ts=time.time(), events=events))
    except ImportError:  # same wire shape as vLLM 0.32: array envelope, map events
        def stored(hashes, parent, tokens):
            return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
                    "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None}

        def removed(hashes):
            return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}

        def batch(events):
            return encoder.encode([time.time(), events])

    messages = []
    half = batches_per_instance // 2
    for inst in range(instances):
        topic = f"kv@i{inst}@{MODEL}".encode()
        written: list[list[int]] = []
        next_hash = inst << 40
        for seq in range(half):
            events = []
            for _ in range(events_per_batch):
                hashes = list(range(next_hash, next_hash + blocks_per_event))
                next_hash += blocks_per_event
                tokens = rng.integers(0, 49152, blocks_per_event * block_size).tolist()
                events.append(stored(hashes, None, tokens))
                written.append(hashes)
            messages.append((topic, seq, batch(events), events_per_batch * blocks_per_event))
        for seq in range(half, 2 * half):
            events = [removed(written.pop()) for _ in range(events_per_batch)]
            messages.append((topic, seq, batch(events), events_per_batch * blocks_per_event))
    # interleave instances like a fleet would
    order = sorted(range(len(messages)), key=lambda i: (messages[i][1], i))
    return [messages[i] for i in order]


def bench_ingest_inprocess(messages, instances: int) -> tuple[float, float]:
    """(block events per wall second, per CPU second of this thread)."""
    state = IndexState(config_from_dict({"zmq": {"bind": []}}))
    insts = [state.resolve_instance(f"i{k}", MODEL, "bench") for k in range(instances)]
    by_topic = {f"kv@i{k}@{MODEL}".encode(): insts[k] for k in range(instances)}
    blocks = sum(m[3] for m in messages)
    start, cpu = time.perf_counter(), time.thread_time()
    for topic, _, payload, _ in messages:
        with state.lock:
            vllm_ingest.apply_batch(state, by_topic[topic], MODEL, decode_batch(payload))
    return blocks / (time.perf_counter() - start), blocks / (time.thread_time() - cpu)


def bench_ingest_zmq(messages) -> tuple[float, float]:
    """(block events per wall second, per CPU second of the whole process: publisher included)."""
    port = free_port()
    cfg = config_from_dict({"port": free_port(), "scrape_interval_s": 0, "heartbeat_timeout_s": 0,
                            "zmq": {"bind": [f"tcp://127.0.0.1:{port}"], "rcvhwm": 0}})
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.connect(f"tcp://127.0.0.1:{port}")
    blocks = sum(m[3] for m in messages)
    with IndexServer(cfg) as server:
        sub = server.subscriber
        probe = b"kv@probe@" + MODEL.encode()
        seq = 0
        while sub.messages == 0:  # slow joiner: wait until the subscription is live
            pub.send_multipart([probe, seq.to_bytes(8, "big"), msgspec.msgpack.encode([0.0, []])])
            seq += 1
            time.sleep(0.05)
        base = sub.messages
        start, cpu = time.perf_counter(), time.process_time()
        for topic, s, payload, _ in messages:
            pub.send_multipart([topic, s.to_bytes(8, "big"), payload])
        with contextlib.suppress(TimeoutError):  # a shortfall is reported below, after the cleanup
            poll_until(lambda: sub.messages - base >= len(messages), 300, interval=0.001)
        elapsed, cpu_s = time.perf_counter() - start, time.process_time() - cpu
        handled = sub.messages - base
        dropped = server.state.metrics.registry.get_sample_value("kvshrink_index_dropped_total",
                                                                {"source": "vllm", "reason": "remove_unknown_block"})
    pub.close(linger=0)
    ctx.term()
    if handled < len(messages):
        raise RuntimeError(f"subscriber applied {handled} of {len(messages)} messages")
    if dropped:
        raise RuntimeError(f"{dropped} removals of unknown blocks: events were lost or reordered")
    return blocks / elapsed, blocks / cpu_s


def instance_url(k: int) -> str:
    """A backend URL for instance ``k``; never contacted (scraping is off)."""
    return f"http://10.0.{k // 250}.{k % 250 + 1}:8000"


def build_lookup_state(instances: int, prompt_tokens: int, block_size: int, background_blocks: int, seed: int):
    rng = np.random.default_rng(seed)
    cfg = config_from_dict({"port": free_port(), "max_blocks": background_blocks + 10 * prompt_tokens,
                            "scrape_interval_s": 0, "heartbeat_timeout_s": 0, "zmq": {"bind": []},
                            "instances": [{"id": f"i{k}", "url": instance_url(k), "models": [MODEL]}
                                          for k in range(instances)]})
    prompt = rng.integers(0, 49152, prompt_tokens).tolist()
    hashes = prefix_hashes(prompt, MODEL, block_size)
    return cfg, prompt, hashes, rng


def fill(state: IndexState, instances: int, hashes: list[int], background_blocks: int, rng) -> None:
    with state.lock:
        n = len(hashes)
        for k in range(instances):
            inst = state.registry.get(f"i{k}")
            feed = state.feed(inst, "bench")
            depth = max(1, int(n * (k + 1) / instances))  # instance k holds a (k+1)/N share of the prefix
            split = depth // 2
            state.index.store(feed, hashes[:split], hashes[:split], TIER_INDEX[TIERS[k % 4]])
            state.index.store(feed, hashes[split:depth], hashes[split:depth], TIER_INDEX[TIERS[(k + 1) % 4]])
            if k % 8 == 0:  # a hole: this instance lost one block in the middle of its share
                state.index.remove(feed, [hashes[depth * 3 // 4]], None)
        background = rng.integers(0, 2**63, background_blocks).tolist()
        for k in range(instances):
            feed = state.feed(state.registry.get(f"i{k}"), "background")
            part = background[k::instances]
            state.index.store(feed, part, part, TIER_INDEX["gpu"])


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values) * 1e3, q))


def load_average() -> float:
    return os.getloadavg()[0]


class GcPauses:
    """Garbage collections in this process — the service's included, it runs here — while a
    measurement runs: how many, and the longest pause (a p99 suspect on a big index)."""

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


def timed(name: str, fn, *args, server: IndexServer | None = None, requests: int = 0) -> dict:
    """Run one latency measurement; its p50 / p99 / max with the load average around it, and with
    ``server``, the service thread's CPU time per request over the ``requests`` it was sent."""
    before = load_average()
    server_cpu = server.thread_cpu_s() if server is not None else 0.0
    with GcPauses() as pauses:
        samples = fn(*args)
    if server is not None:
        server_cpu = server.thread_cpu_s() - server_cpu
    cpu = None
    if isinstance(samples, tuple):  # (wall, cpu) from the in-process loop
        samples, cpu = samples
    row = {"name": name, "n": len(samples), "p50_ms": percentile_ms(samples, 50), "p99_ms": percentile_ms(samples, 99),
           "max_ms": max(samples) * 1e3, "load_before": before, "load_after": load_average(),
           "gc_collections": pauses.count, "gc_longest_ms": pauses.longest_s * 1e3,
           "samples_ms": [round(x * 1e3, 4) for x in samples]}
    if cpu is not None:
        row.update(cpu_p50_ms=percentile_ms(cpu, 50), cpu_p99_ms=percentile_ms(cpu, 99))
    if server is not None:
        row["server_cpu_ms_per_request"] = server_cpu * 1e3 / requests
    return row


def time_calls(fn, n: int, warmup: int, desc: str) -> tuple[list[float], list[float]]:
    """(wall, CPU) seconds of ``n`` calls of ``fn`` in this thread, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in tqdm(range(n), desc=desc, leave=False):
        t, c = time.perf_counter(), time.thread_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    return wall, cpu


def inprocess_latencies(state: IndexState, body: dict, n: int, warmup: int) -> tuple[list[float], list[float]]:
    """In-process lookups of what the router's body carries (token bytes, loads, candidates): the
    service's lookup without HTTP, comparable with the router-body rows."""
    tokens, loads, only = body["token_bytes"], body["loads"], body["instances"]
    return time_calls(lambda: lookup(state, MODEL, tokens, loads, only), n, warmup, "lookup in-process")


def fixed_work() -> int:
    """~1 ms of pure Python: this machine's own jitter, the floor under every p99 here (on a
    shared 2-core VM its p99 is several times its p50)."""
    total = 0
    for i in range(15_000):
        total += i * i
    return total


def bench_lookup(args: argparse.Namespace, block_size: int) -> list[dict]:
    """Every lookup measurement at one block size, ``--repeats`` times."""
    cfg, prompt, hashes, rng = build_lookup_state(args.instances, args.prompt_tokens, block_size,
                                                  args.background_blocks, args.seed)
    loads = {instance_url(k): float(k % 5) for k in range(args.instances)}  # the router's view of load
    generic = msgspec.json.encode({"model": MODEL, "token_ids": prompt})
    router_body = {**lookup_body({"prompt": prompt}, MODEL), "loads": loads, "instances": list(loads)}
    routed = msgspec.msgpack.encode(router_body)
    base64_ids = msgspec.json.encode({"model": MODEL, "token_bytes": np.asarray(prompt, dtype="<u4").tobytes()})
    rows = []
    with IndexServer(cfg) as server:
        state = server.state
        fill(state, args.instances, hashes, args.background_blocks, rng)
        state.note_block_size(MODEL, block_size)
        matched = sorted((s.matched_tokens for s in lookup(state, MODEL, prompt).instances), reverse=True)
        # the client runs in its own process: in this one it would fight the server for the GIL
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            pool.apply(ready)  # the client is up and idle before anything is timed
            for repeat in range(args.repeats):
                n, w = args.lookups, args.warmup
                measures = [
                    ("reference: fixed ~1 ms loop", time_calls, fixed_work, n, w, "reference"),
                    ("in-process", inprocess_latencies, state, router_body, n, w),
                    ("HTTP JSON token_ids", pool.apply, http_latencies, (server.url, generic, "application/json", n, w)),
                    ("HTTP msgpack router body", pool.apply, http_latencies,
                     (server.url, routed, "application/msgpack", n, w)),
                    ("  same, raw socket client", pool.apply, raw_http_latencies,
                     (server.url, routed, "application/msgpack", n, w)),
                    ("HTTP JSON base64 token_bytes", pool.apply, http_latencies,
                     (server.url, base64_ids, "application/json", n, w)),
                    ("router route_request", pool.apply, route_latencies, (server.url, prompt, loads, n, w)),
                ]
                for name, fn, *fn_args in measures:
                    over_http = fn == pool.apply  # the client sends warm-up + timed requests to the service
                    rows.append({"block_size": block_size, "repeat": repeat,
                                 **timed(name, fn, *fn_args, server=server if over_http else None, requests=n + w)})
        index_blocks = len(state.index)
    for row in rows:
        row.update(index_blocks=index_blocks, matched_tokens_top3=matched[:3])
    return rows


def bytes_per_block(rng) -> float:
    """Memory per indexed block (index entry, feed key map, both ints), measured on a fresh index."""
    import tracemalloc

    probe = IndexState(config_from_dict({"zmq": {"bind": []}, "max_blocks": 10_000_000}))
    fill_inst = probe.resolve_instance("p", MODEL, "bench")
    n_probe = 200_000
    tracemalloc.start()
    block_hashes = rng.integers(0, 2**63, n_probe).tolist()  # 64-bit values, like real ones
    engine_keys = rng.integers(0, 2**63, n_probe).tolist()
    probe.index.store(probe.feed(fill_inst, "p"), engine_keys, block_hashes, 1)  # DRAM: a wider packed int
    del block_hashes, engine_keys  # what stays: the index entry, the feed's key map, both ints
    size = tracemalloc.get_traced_memory()[0] / n_probe
    tracemalloc.stop()
    return size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=64)
    parser.add_argument("--batches-per-instance", type=int, default=64)
    parser.add_argument("--events-per-batch", type=int, default=8)
    parser.add_argument("--blocks-per-event", type=int, default=16)
    parser.add_argument("--ingest-block-size", type=int, default=16)
    parser.add_argument("--no-ingest", action="store_true", help="lookup latency only")
    parser.add_argument("--prompt-tokens", type=int, default=32_768)
    parser.add_argument("--block-sizes", default="16,128",
                        help="lookup block sizes, comma-separated (vLLM GPU default 16, CPU 128)")
    parser.add_argument("--background-blocks", type=int, default=500_000)
    parser.add_argument("--lookups", type=int, default=1000, help="timed lookups per measurement")
    parser.add_argument("--warmup", type=int, default=50, help="untimed lookups before each measurement")
    parser.add_argument("--repeats", type=int, default=1, help="measure every lookup form this many times")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    started_load = os.getloadavg()

    res: dict = {"cpus": os.cpu_count()}
    if not args.no_ingest:
        print(f"encoding {args.instances * args.batches_per_instance} KV event batches ...")
        messages = encode_batches(args.instances, args.batches_per_instance, args.events_per_batch,
                                  args.blocks_per_event, args.ingest_block_size, args.seed)
        inproc_rate, inproc_cpu_rate = bench_ingest_inprocess(messages, args.instances)
        zmq_rate, zmq_cpu_rate = bench_ingest_zmq(messages)
        res["ingest"] = {"messages": len(messages), "block_events": sum(m[3] for m in messages),
                         "zmq_block_events_per_s": zmq_rate, "inprocess_block_events_per_s": inproc_rate,
                         "zmq_block_events_per_cpu_s": zmq_cpu_rate,
                         "inprocess_block_events_per_cpu_s": inproc_cpu_rate, "target_block_events_per_s": 200_000}
    res["lookup"] = [row for bs in (int(b) for b in args.block_sizes.split(",")) for row in bench_lookup(args, bs)]
    res["lookup_setup"] = {"prompt_tokens": args.prompt_tokens, "instances": args.instances,
                           "lookups": args.lookups, "warmup": args.warmup, "target_p99_ms": 5.0}
    res["memory"] = {"bytes_per_block": bytes_per_block(np.random.default_rng(args.seed))}
    res["load_average"] = {"start": started_load, "end": os.getloadavg()}
    res["targets"] = check_targets(res)
    print_report(res)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


TARGET_ROWS = {"in-process": "lookup p99, in-process", "  same, raw socket client":
               "lookup p99, POST /lookup with the router's body (bare-socket client)"}


def check_targets(res: dict) -> list[dict]:
    """Issue 6's targets. A lookup target is judged per block size on the run's p99: the 99th
    percentile of every lookup of that form in the run, all repeats pooled. (Each repeat's own p99,
    in the table, rests on its 10 slowest samples out of 1000, taken within a few seconds: on this
    shared VM whether such a window holds a burst of host contention decides it.) The reference
    loop's p99, pooled the same way, comes with it."""
    out = []
    if "ingest" in res:
        rate = res["ingest"]["zmq_block_events_per_s"]
        out.append({"name": "ingest over ZMQ, block events/s", "value": rate, "target": ">= 200000",
                    "passed": rate >= 200_000})
    limit = res["lookup_setup"]["target_p99_ms"]

    def pooled_p99(name: str, block_size: int) -> tuple[float, int]:
        samples = [x for r in res["lookup"] if r["name"] == name and r["block_size"] == block_size
                   for x in r["samples_ms"]]
        return float(np.percentile(samples, 99)), len(samples)

    reference_name = next(r["name"] for r in res["lookup"] if r["name"].startswith("reference"))
    for block_size in sorted({r["block_size"] for r in res["lookup"]}):
        reference, _ = pooled_p99(reference_name, block_size)
        for row_name, label in TARGET_ROWS.items():
            p99, n = pooled_p99(row_name, block_size)
            out.append({"name": f"{label}, block size {block_size}, {n} lookups", "value": p99,
                        "target": f"<= {limit} ms", "passed": p99 <= limit, "reference_loop_p99_ms": reference})
    return out


def print_report(res: dict) -> None:
    if "ingest" in res:
        ing = res["ingest"]
        print(f"{'measure':<48} {'value':>14} {'target':>12}")
        print(f"{'ingest over ZMQ (block events/s)':<48} {ing['zmq_block_events_per_s']:>14,.0f} {'>= 200,000':>12}")
        print(f"{'ingest over ZMQ, per CPU second':<48} {ing['zmq_block_events_per_cpu_s']:>14,.0f}")
        print(f"{'ingest in-process, no socket (block events/s)':<48} {ing['inprocess_block_events_per_s']:>14,.0f}")
        print(f"{'ingest in-process, per CPU second':<48} {ing['inprocess_block_events_per_cpu_s']:>14,.0f}")
    setup = res["lookup_setup"]
    print(f"\nlookup latency, {setup['prompt_tokens']}-token prompt, {setup['instances']} instances, "
          f"{setup['lookups']} timed after {setup['warmup']} warm-up (target p99 <= {setup['target_p99_ms']} ms)")
    print(f"{'block':>5} {'rep':>3}  {'measure':<28} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'CPU p50/p99':>12}"
          f"  {'GC n/longest ms':>15}  {'load 1-min before/after':>23}")
    print(f"{'':>38}(CPU: in-process, the lookup's own; over HTTP, the service thread's per request)")
    for row in res["lookup"]:
        cpu = f"{row['cpu_p50_ms']:.2f}/{row['cpu_p99_ms']:.2f}" if "cpu_p50_ms" in row else ""
        if "server_cpu_ms_per_request" in row:
            cpu = f"srv {row['server_cpu_ms_per_request']:.2f}"
        gcs = f"{row['gc_collections']}/{row['gc_longest_ms']:.1f}"
        print(f"{row['block_size']:>5} {row['repeat']:>3}  {row['name']:<28} {row['p50_ms']:>7.2f} {row['p99_ms']:>7.2f} "
              f"{row['max_ms']:>7.1f} {cpu:>12}  {gcs:>15}  {row['load_before']:>11.2f} / {row['load_after']:<9.2f}")
    blocks = ", ".join(f"{r['index_blocks']:,}" for r in res["lookup"] if r["repeat"] == 0 and r["name"] == "in-process")
    load = res["load_average"]
    print(f"({blocks} blocks indexed; ~{res['memory']['bytes_per_block']:.0f} bytes per indexed block; load average "
          f"{load['start'][0]:.1f} at start, {load['end'][0]:.1f} at end, on {res['cpus']} CPUs — other processes "
          f"share them)")
    print()
    for t in res["targets"]:
        value = f"{t['value']:,.0f}" if t["value"] >= 1000 else f"{t['value']:.2f} ms"
        context = (f"   (the 1 ms reference loop's p99 alongside: {t['reference_loop_p99_ms']:.2f} ms)"
                   if "reference_loop_p99_ms" in t else "")
        print(f"{'PASS' if t['passed'] else 'FAIL'}  {t['name']}: {value} (target {t['target']}){context}")


if __name__ == "__main__":
    raise SystemExit(main())
