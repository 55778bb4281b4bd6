"""Index service benchmark: KV-event ingest rate and lookup latency (issue 6 targets).

* **Ingest** — vLLM-encoded ``KVEventBatch`` payloads (built with vLLM's own structs when vLLM is
  importable, else the same wire shape by hand) from ``--instances`` publishers are sent through a
  real ZMQ PUB socket to the service's subscriber; we time until the subscriber has applied all of
  them. Every batch stores ``--blocks-per-event`` blocks per event and later batches remove them,
  so the index stays at a realistic size. Also timed: decode + apply in-process, without sockets.
  Target: ≥ 200k block events/s.
* **Lookup** — a ``--prompt-tokens`` prompt against ``--instances`` instances that each hold a
  different share of its prefix on different tiers (every instance leaves the match at another
  block, the worst case for the walk), with ``--background-blocks`` unrelated blocks in the index.
  Timed in-process (``scoring.lookup``; wall and CPU time) and over HTTP against the running
  service from a separate client process (client-observed wall time, JSON of 32K ids included).
  Target: p99 ≤ 5 ms at 32K tokens, 64 instances.

    python -m kvshrink.benchmarks.index_bench [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time

import httpx
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
from kvshrink.index import vllm_ingest
from kvshrink.launch import free_port

MODEL = "bench-model"


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
        deadline = time.monotonic() + 300
        while sub.messages - base < len(messages) and time.monotonic() < deadline:
            time.sleep(0.001)
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


def build_lookup_state(instances: int, prompt_tokens: int, block_size: int, background_blocks: int, seed: int):
    rng = np.random.default_rng(seed)
    cfg = config_from_dict({"port": free_port(), "max_blocks": background_blocks + 10 * prompt_tokens,
                            "scrape_interval_s": 0, "heartbeat_timeout_s": 0, "zmq": {"bind": []},
                            "instances": [{"id": f"i{k}", "models": [MODEL]} for k in range(instances)]})
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


def http_latencies(url: str, body: bytes, content_type: str, n: int) -> list[float]:
    """Wall time of ``n`` POST /lookup calls over one keep-alive connection (run in a child process)."""
    out = []
    with httpx.Client(base_url=url, timeout=10.0) as client:
        for i in range(n + 20):
            t = time.perf_counter()
            resp = client.post("/lookup", content=body, headers={"content-type": content_type})
            if i >= 20:  # warm-up excluded
                out.append(time.perf_counter() - t)
            resp.raise_for_status()
    return out


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values) * 1e3, q))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=64)
    parser.add_argument("--batches-per-instance", type=int, default=64)
    parser.add_argument("--events-per-batch", type=int, default=8)
    parser.add_argument("--blocks-per-event", type=int, default=16)
    parser.add_argument("--ingest-block-size", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32_768)
    parser.add_argument("--block-size", type=int, default=16, help="lookup block size (vLLM GPU default 16)")
    parser.add_argument("--background-blocks", type=int, default=500_000)
    parser.add_argument("--lookups", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    print(f"encoding {args.instances * args.batches_per_instance} KV event batches ...")
    messages = encode_batches(args.instances, args.batches_per_instance, args.events_per_batch, args.blocks_per_event,
                              args.ingest_block_size, args.seed)
    block_events = sum(m[3] for m in messages)
    inproc_rate, inproc_cpu_rate = bench_ingest_inprocess(messages, args.instances)
    zmq_rate, zmq_cpu_rate = bench_ingest_zmq(messages)

    cfg, prompt, hashes, rng = build_lookup_state(args.instances, args.prompt_tokens, args.block_size,
                                                  args.background_blocks, args.seed)
    with IndexServer(cfg) as server:
        state = server.state
        fill(state, args.instances, hashes, args.background_blocks, rng)
        state.note_block_size(MODEL, args.block_size)
        first = lookup(state, MODEL, prompt)
        matched = sorted((s.matched_tokens for s in first.instances), reverse=True)
        inproc, inproc_cpu = [], []
        for _ in tqdm(range(args.lookups), desc="lookup in-process", leave=False):
            t, c = time.perf_counter(), time.thread_time()
            lookup(state, MODEL, prompt)
            inproc.append(time.perf_counter() - t)
            inproc_cpu.append(time.thread_time() - c)
        query = {"model": MODEL, "token_ids": prompt}
        # the client runs in its own process: in this one it would fight the server for the GIL
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            http = pool.apply(http_latencies, (server.url, msgspec.json.encode(query), "application/json",
                                               args.lookups))
            packed = {"model": MODEL, "token_bytes": np.asarray(prompt, dtype="<u4").tobytes()}
            http_mp = pool.apply(http_latencies, (server.url, msgspec.msgpack.encode(packed), "application/msgpack",
                                                  args.lookups))
        index_blocks = len(state.index)
    import tracemalloc  # memory per block, measured on a fresh index

    probe = IndexState(config_from_dict({"zmq": {"bind": []}, "max_blocks": 10_000_000}))
    fill_inst = probe.resolve_instance("p", MODEL, "bench")
    n_probe = 200_000
    tracemalloc.start()
    block_hashes = rng.integers(0, 2**63, n_probe).tolist()  # 64-bit values, like real ones
    engine_keys = rng.integers(0, 2**63, n_probe).tolist()
    probe.index.store(probe.feed(fill_inst, "p"), engine_keys, block_hashes, 1)  # DRAM: a wider packed int
    del block_hashes, engine_keys  # what stays: the index entry, the feed's key map, both ints
    bytes_per_block = tracemalloc.get_traced_memory()[0] / n_probe
    tracemalloc.stop()

    res = {
        "ingest": {"messages": len(messages), "block_events": block_events,
                   "zmq_block_events_per_s": zmq_rate, "inprocess_block_events_per_s": inproc_rate,
                   "zmq_block_events_per_cpu_s": zmq_cpu_rate, "inprocess_block_events_per_cpu_s": inproc_cpu_rate,
                   "target_block_events_per_s": 200_000},
        "lookup": {"prompt_tokens": args.prompt_tokens, "block_size": args.block_size, "instances": args.instances,
                   "index_blocks": index_blocks, "matched_tokens_top3": matched[:3],
                   "inprocess_p50_ms": percentile_ms(inproc, 50), "inprocess_p99_ms": percentile_ms(inproc, 99),
                   "inprocess_cpu_p50_ms": percentile_ms(inproc_cpu, 50),
                   "inprocess_cpu_p99_ms": percentile_ms(inproc_cpu, 99),
                   "http_p50_ms": percentile_ms(http, 50), "http_p99_ms": percentile_ms(http, 99),
                   "http_msgpack_p50_ms": percentile_ms(http_mp, 50), "http_msgpack_p99_ms": percentile_ms(http_mp, 99),
                   "target_p99_ms": 5.0},
        "memory": {"bytes_per_block": bytes_per_block},
        "load_average": os.getloadavg(), "cpus": os.cpu_count(),
    }
    ing, lk = res["ingest"], res["lookup"]
    print(f"{'measure':<44} {'value':>14} {'target':>12}")
    print(f"{'ingest over ZMQ (block events/s)':<44} {ing['zmq_block_events_per_s']:>14,.0f} {'>= 200,000':>12}")
    print(f"{'ingest over ZMQ, per CPU second':<44} {ing['zmq_block_events_per_cpu_s']:>14,.0f}")
    print(f"{'ingest in-process, no socket (block events/s)':<44} {ing['inprocess_block_events_per_s']:>14,.0f}")
    print(f"{'ingest in-process, per CPU second':<44} {ing['inprocess_block_events_per_cpu_s']:>14,.0f}")
    print(f"{'lookup in-process p50 / p99 (ms)':<44} {lk['inprocess_p50_ms']:>6.2f} / {lk['inprocess_p99_ms']:<5.2f} "
          f"{'p99 <= 5':>12}")
    print(f"{'lookup in-process CPU time p50 / p99 (ms)':<44} {lk['inprocess_cpu_p50_ms']:>6.2f} / "
          f"{lk['inprocess_cpu_p99_ms']:<5.2f}")
    print(f"{'lookup over HTTP, JSON body, p50 / p99 (ms)':<44} {lk['http_p50_ms']:>6.2f} / {lk['http_p99_ms']:<5.2f} "
          f"{'p99 <= 5':>12}")
    print(f"{'lookup over HTTP, msgpack token_bytes, p50/p99 (ms)':<44} {lk['http_msgpack_p50_ms']:>6.2f} / "
          f"{lk['http_msgpack_p99_ms']:<5.2f} {'p99 <= 5':>12}")
    print(f"({args.prompt_tokens}-token prompt, block {args.block_size}, {args.instances} instances, "
          f"{index_blocks:,} blocks indexed; ~{bytes_per_block:.0f} bytes per indexed block; load average "
          f"{res['load_average'][0]:.1f} on {res['cpus']} CPUs — other processes share them)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
