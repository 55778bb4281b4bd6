"""Where a ``POST /lookup`` spends the service's CPU: the lookup itself vs. everything HTTP around it.

``index_bench`` times each form in a block of hundreds of requests; on this shared VM the CPU speed
drifts by tens of percent over minutes, so comparing its in-process row with its HTTP rows mixes
that drift into the difference. Here every round sends one request of each ``--forms`` (raw keep-alive
socket from a client process, bodies built once) and then runs the same lookup in-process, so each
comparison is between neighbours in time. Per request:

* ``service CPU``: the serving thread's CPU time (``IndexServer.thread_cpu_s``) across the request;
* ``its lookup``: the answer's ``elapsed_ms`` — ``scoring.lookup``'s own (wall) time inside the service;
* ``HTTP rest``: service CPU minus its lookup: parsing, routing, body decoding, answer encoding;
* ``in-process``: CPU of the same ``scoring.lookup`` call (same bytes / loads / instances) right after.

Reported: medians and p99 over ``--rounds``, and the median of the per-round differences.

    python -m kvshrink.benchmarks.index_bench_paired [--rounds 300] [--block-size 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time

import msgspec
import numpy as np
from tqdm import tqdm

from kvshrink.benchmarks.index_bench import build_lookup_state, fill, instance_url
from kvshrink.benchmarks.index_bench_clients import MODEL, raw_lookup_once, ready
from kvshrink.index.scoring import lookup
from kvshrink.index.server import IndexServer
from kvshrink.plugins.router_logic import lookup_body

FORMS = ("msgpack-router", "json-base64", "json-token-ids")


def request_bytes(url: str, body: bytes, content_type: str) -> bytes:
    host = url.removeprefix("http://")
    return (f"POST /lookup HTTP/1.1\r\nhost: {host}\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def bodies(prompt: list[int], loads: dict[str, float]) -> dict[str, tuple[bytes, str, dict]]:
    """Each form: (body, content type, lookup() keyword arguments that the service will use)."""
    packed = np.asarray(prompt, dtype="<u4").tobytes()
    routed = {"loads": loads, "instances": list(loads)}
    return {
        "msgpack-router": (msgspec.msgpack.encode({**lookup_body({"prompt": prompt}, MODEL), **routed}),
                           "application/msgpack", {"token_ids": packed, **routed}),
        "json-base64": (msgspec.json.encode({"model": MODEL, "token_bytes": packed, **routed}), "application/json",
                        {"token_ids": packed, **routed}),
        "json-token-ids": (msgspec.json.encode({"model": MODEL, "token_ids": prompt}), "application/json",
                           {"token_ids": prompt}),
    }


def measure(args: argparse.Namespace) -> dict:
    cfg, prompt, hashes, rng = build_lookup_state(args.instances, args.prompt_tokens, args.block_size,
                                                  args.background_blocks, args.seed)
    loads = {instance_url(k): float(k % 5) for k in range(args.instances)}
    forms = {name: spec for name, spec in bodies(prompt, loads).items() if name in args.forms.split(",")}
    samples: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in forms}
    with IndexServer(cfg) as server:
        state = server.state
        fill(state, args.instances, hashes, args.background_blocks, rng)
        state.note_block_size(MODEL, args.block_size)
        requests = {name: request_bytes(server.url, body, ctype) for name, (body, ctype, _) in forms.items()}
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            pool.apply(ready)
            for i in tqdm(range(args.warmup + args.rounds), desc="paired rounds", leave=False):
                for name, (_, _, kwargs) in forms.items():
                    cpu = server.thread_cpu_s()
                    wall_s, elapsed_ms = pool.apply(raw_lookup_once, (server.url, requests[name]))
                    service_ms = (server.thread_cpu_s() - cpu) * 1e3
                    t = time.thread_time()
                    lookup(state, MODEL, kwargs["token_ids"], kwargs.get("loads"), kwargs.get("instances"))
                    inprocess_ms = (time.thread_time() - t) * 1e3
                    if i >= args.warmup:
                        samples[name].append((wall_s * 1e3, service_ms, elapsed_ms, inprocess_ms))
    return {name: summarize(rows) for name, rows in samples.items()}


def summarize(rows: list[tuple[float, float, float, float]]) -> dict:
    wall, service, its_lookup, inprocess = (np.array(column) for column in zip(*rows))
    rest = service - its_lookup
    out = {"n": len(rows)}
    for key, values in (("latency", wall), ("service_cpu", service), ("its_lookup", its_lookup),
                        ("http_rest", rest), ("inprocess_lookup", inprocess)):
        out[f"{key}_p50_ms"] = float(np.median(values))
        out[f"{key}_p99_ms"] = float(np.percentile(values, 99))
    out["lookup_minus_inprocess_median_ms"] = float(np.median(its_lookup - inprocess))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32_768)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--background-blocks", type=int, default=500_000)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated subset of {', '.join(FORMS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    res = measure(args)
    print(f"POST /lookup, {args.prompt_tokens}-token prompt, {args.instances} instances, block size {args.block_size}, "
          f"{args.rounds} paired rounds (ms; p50 / p99)")
    print(f"{'form':<16} {'latency':>13} {'service CPU':>13} {'its lookup':>13} {'HTTP rest':>13} {'in-process':>13}"
          f" {'lookup - in-proc':>17}")
    for name, row in res.items():
        cells = " ".join(f"{row[k + '_p50_ms']:>6.2f}/{row[k + '_p99_ms']:<6.2f}" for k in
                         ("latency", "service_cpu", "its_lookup", "http_rest", "inprocess_lookup"))
        print(f"{name:<16} {cells} {row['lookup_minus_inprocess_median_ms']:>+17.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"setup": vars(args), "forms": res}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
