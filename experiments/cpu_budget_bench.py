"""Load time of real KV chunks, and what it costs a busy engine, under two codec thread budgets.

``python experiments/cpu_budget_bench.py [--chunks 8] [--seconds 6] [--out FILE]``

What runs: a :class:`~kvshrink.store.TieredStore` with one compressed DRAM arena holding ``N``
real SmolLM2 KV chunks (256 tokens, 5.9 MB each); ``--task-threads`` threads (the MP adapter's
default 4) load their share of them at once with ``get_many`` into preallocated bf16 tensors,
as LMCache's load tasks do. Two budgets (:mod:`kvshrink.codec.cpu_budget`):

* ``nested``: the old nesting emulated, a budget of 4 + 2 + 1 + 4 = 11 threads (adapter task
  threads + put workers + background worker + reader pool), what could compress at once before;
* ``budget``: the new default, one thread per CPU this process may use.

Each is measured alone (``--loads`` loads per budget, alternating, median wall time and process
CPU time per load) and beside a
*competitor*: a separate process keeping ``--competitor-threads`` cores busy the way vLLM CPU does
during a request, a torch bf16 matmul loop with ``torch.set_num_threads(2)`` (a stand-in for
vLLM's prefill / decode kernels; vLLM itself is not started). Beside it, loads arrive at a fixed
pace (one every ``--interval`` s, like requests), so both budgets do the same work per window;
``--rounds`` rounds of (competitor alone, nested, budget) windows of ``--seconds`` each, the
order reversed every other round, give the competitor's matmul rate and its loss against the
alone window of the same round (median over rounds). Absolute times on a shared machine are
indicative; the comparison is the result, and the load average is printed with it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

NESTED_THREADS = 4 + 2 + 1 + 4  # adapter task threads + put + background + readers
MATMUL_N = 128


def competitor(counter: Any, ready: Any, stop: Any, threads: int) -> None:
    """Spin bf16 matmuls on ``threads`` cores until ``stop``; count them in ``counter``."""
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16)
    b = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ready.set()
    while not stop.is_set():
        a @ b
        counter.value += 1


class Competitor:
    """The competitor process; ``rate(seconds, during)`` = matmuls per second while ``during()`` runs."""

    def __init__(self, threads: int) -> None:
        ctx = mp.get_context("spawn")
        self._counter = ctx.Value("q", 0, lock=False)
        self._ready, self._stop = ctx.Event(), ctx.Event()
        self._proc = ctx.Process(target=competitor, args=(self._counter, self._ready, self._stop, threads),
                                 daemon=True)

    def __enter__(self) -> "Competitor":
        self._proc.start()
        if not self._ready.wait(120):
            raise RuntimeError("the competitor process did not start")
        time.sleep(1.0)  # past its warm-up
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()

    def count(self) -> int:
        return int(self._counter.value)


def _loader(store: Any, keys: list[bytes], outs: list[Any], task_threads: int):
    """A function loading every key once, split over ``task_threads`` concurrent get_many calls."""
    shares = [(keys[i::task_threads], outs[i::task_threads]) for i in range(task_threads)]
    shares = [s for s in shares if s[0]]

    def load_all() -> float:
        errors: list[BaseException] = []

        def task(ks: list[bytes], os_: list[Any]) -> None:
            try:
                found = store.get_many(ks, os_)
                if any(f is None for f in found):
                    raise RuntimeError("a chunk was missing")
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors.append(exc)

        started = time.perf_counter()
        threads = [threading.Thread(target=task, args=share) for share in shares]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return time.perf_counter() - started

    return load_all


def _paced(load_all: Any, seconds: float, interval: float) -> list[float]:
    """Loads started every ``interval`` seconds (at once after one that overran) for ``seconds``,
    like requests arriving: both budgets do the same work per window, so the competitor's loss
    compares CPU cost, not how many loads each budget squeezes in."""
    times: list[float] = []
    started = time.perf_counter()
    next_at = started
    while time.perf_counter() - started < seconds:
        pause = next_at - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        times.append(load_all())
        next_at += interval
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvshrink.codec.cpu_budget import budget, cpu_count
    from kvshrink.testing.fixtures.real_kv import real_kv_chunks
    from kvshrink.store import TieredStore
    from kvshrink.store.dram import SHM_DIR

    cores = cpu_count()
    chunks = [torch.from_numpy(c).view(torch.bfloat16) for c in real_kv_chunks(args.chunks, 256)]
    raw = sum(c.numel() * 2 for c in chunks)
    shm_name = f"kvshrink-cpubench-{uuid.uuid4().hex[:8]}"
    cfg = {"promote_on_hit": False, "engine": {"read_workers": 4},
           "tiers": [{"kind": "dram", "name": "dram", "capacity": int(raw * 1.2) + (16 << 20), "compressed": True,
                      "shm_name": shm_name}]}
    budgets = {"nested": NESTED_THREADS, "budget": cores}
    results: dict[str, Any] = {"cores": cores, "chunks": args.chunks, "chunk_bytes": chunks[0].numel() * 2,
                               "task_threads": args.task_threads, "competitor_threads": args.competitor_threads,
                               "competitor": f"torch bf16 {MATMUL_N}x{MATMUL_N} matmul loop, "
                                             f"torch.set_num_threads({args.competitor_threads})",
                               "interval_s": args.interval, "window_s": args.seconds, "rounds": args.rounds,
                               "budgets": budgets, "load_average_before": os.getloadavg()[0]}
    alone: dict[str, list[float]] = {name: [] for name in budgets}
    cpu: dict[str, list[float]] = {name: [] for name in budgets}  # process CPU seconds per load
    busy: dict[str, list[float]] = {name: [] for name in budgets}
    loss: dict[str, list[float]] = {name: [] for name in budgets}
    idle_rates: list[float] = []
    before = budget().configured
    try:
        with TieredStore.from_config(cfg) as store:
            keys = [b"chunk-%d" % i for i in range(len(chunks))]
            assert all(store.put(k, c).result(timeout=120) for k, c in zip(keys, chunks))
            outs = [torch.empty_like(c) for c in chunks]
            load_all = _loader(store, keys, outs, args.task_threads)
            for name, threads in budgets.items():  # warm-up: threads, scratch, zstd contexts
                budget().configure(threads, key=f"bench.{name}")
                load_all()
            for i in range(args.loads):  # alternating, so drift on a shared machine hits both alike
                for name, threads in budgets.items():
                    budget().configure(threads, key=f"bench.{name}")
                    cpu0 = time.process_time()
                    alone[name].append(load_all())
                    cpu[name].append(time.process_time() - cpu0)
            assert all(torch.equal(o.view(torch.int16), c.view(torch.int16)) for o, c in zip(outs, chunks))
            with Competitor(args.competitor_threads) as rival:
                for r in range(args.rounds):
                    order = list(budgets) if r % 2 == 0 else list(reversed(budgets))
                    count, t0 = rival.count(), time.perf_counter()
                    time.sleep(args.seconds)
                    idle = (rival.count() - count) / (time.perf_counter() - t0)
                    idle_rates.append(idle)
                    for name in order:
                        budget().configure(budgets[name], key=f"bench.{name}")
                        count, t0 = rival.count(), time.perf_counter()
                        busy[name] += _paced(load_all, args.seconds, args.interval)
                        rate = (rival.count() - count) / (time.perf_counter() - t0)
                        loss[name].append(1.0 - rate / idle)
    finally:
        budget().configure(before)
        for path in SHM_DIR.glob(f"{shm_name}*"):
            path.unlink(missing_ok=True)
    results["load_average_after"] = os.getloadavg()[0]
    results["competitor_alone_rate"] = statistics.median(idle_rates)
    results["rows"] = {name: {"threads": budgets[name], "load_alone_s": statistics.median(alone[name]),
                              "cpu_per_load_s": statistics.median(cpu[name]),
                              "load_beside_competitor_s": statistics.median(busy[name]), "loads_beside": len(busy[name]),
                              "competitor_loss": statistics.median(loss[name]), "competitor_loss_rounds": loss[name]}
                       for name in budgets}
    return results


def render(results: dict[str, Any]) -> str:
    mb = results["chunks"] * results["chunk_bytes"] / 1e6
    lines = [f"{results['chunks']} chunks ({mb:.0f} MB raw) loaded by {results['task_threads']} task threads "
             f"from a compressed DRAM arena; {results['cores']} cores; load average {results['load_average_before']:.1f}"
             f" before, {results['load_average_after']:.1f} after",
             f"competitor: {results['competitor']}, alone {results['competitor_alone_rate']:.0f} matmul/s; beside it a "
             f"load starts every {results['interval_s'] * 1e3:.0f} ms, {results['rounds']} rounds of "
             f"{results['window_s']:.1f} s windows", "",
             "| budget | threads | load alone [ms] | CPU per load alone [ms] | load beside competitor [ms] "
             "| competitor loss (median; per round) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, row in results["rows"].items():
        rounds = ", ".join(f"{x * 100:.0f}" for x in row["competitor_loss_rounds"])
        lines.append(f"| {name} | {row['threads']} | {row['load_alone_s'] * 1e3:.1f} | {row['cpu_per_load_s'] * 1e3:.1f} | "
                     f"{row['load_beside_competitor_s'] * 1e3:.1f} (n={row['loads_beside']}) | "
                     f"{row['competitor_loss'] * 100:.1f} % ({rounds}) |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=8, help="real 256-token KV chunks to load (default 8)")
    parser.add_argument("--loads", type=int, default=15, help="loads timed alone per budget (default 15)")
    parser.add_argument("--seconds", type=float, default=2.5, help="length of one measuring window (default 2.5)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of (idle, nested, budget) windows (default 4)")
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between load starts beside the "
                        "competitor (default 0.25)")
    parser.add_argument("--task-threads", type=int, default=4, help="concurrent get_many callers (default 4)")
    parser.add_argument("--competitor-threads", type=int, default=2, help="cores the competitor keeps busy")
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    if os.environ.get("KVSHRINK_CODEC_THREADS"):
        parser.error("unset KVSHRINK_CODEC_THREADS: this benchmark sets the budget itself")
    results = run(args)
    print(render(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
