"""Routing simulation: N instances with tiered KV caches serve the agent trace under each policy.

Model (deliberately simple, same for every policy):

* Each instance has three inclusive LRU caches of prefix blocks — GPU (vLLM's prefix cache), DRAM
  and SSD (LMCache L1 / L2, write-through) — with capacities in tokens. Every block of a request's
  prompt is stored/refreshed in all three when its prefill ends, the assistant output's blocks when
  the request ends. Every store and eviction is reported to the policy (``on_tier_change``), which
  is how our index and the kvaware controller learn about caches.
* A request's hit is the longest consecutive prefix of its blocks held in *any* tier of the chosen
  instance when its prefill starts; each block is read from its fastest tier.
* Prefill is one FIFO server per instance: ``uncached tokens * prefill cost + cached tokens * tier
  read cost``; decode runs in parallel for ``max_tokens * decode cost``. Sessions are closed-loop:
  the next turn arrives ``think_s`` after the previous reply; ``concurrency`` sessions in flight.
* Load = in-flight requests per instance (queued + prefilling + decoding), what a router tracks.

Reported per policy: hit rate (cached prompt tokens / prompt tokens), the tier mix of hits, load
balance as max/mean over instances of the time-averaged in-flight requests (also of requests served
and of prefill busy time), and TTFT (queueing + prefill).

    python -m kvshrink.benchmarks.routing_sim                  # 8 instances, default agent trace
    python -m kvshrink.benchmarks.routing_sim --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import heapq
import json
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field

import numpy as np
from tqdm import tqdm

from kvshrink.benchmarks.agent_trace import AgentRequest, TraceConfig, generate_sessions
from kvshrink.benchmarks.routing_policies import MODEL, Policy, make_policies
from kvshrink.index.hashing import prefix_hashes

TIER_NAMES = ("gpu", "dram", "ssd")
POLICIES = ["roundrobin", "session", "prefixaware", "kvaware", "ours"]


@dataclass(frozen=True)
class SimConfig:
    instances: int = 8
    block: int = 64  # tokens per simulated block (must divide 256)
    # per instance; the default trace keeps ~62K tokens of live context per instance, so the SSD
    # tier holds about the mean live working set: the capacity-bound regime tiered offload is for
    gpu_tokens: int = 16_384
    dram_tokens: int = 32_768
    ssd_tokens: int = 65_536
    prefill_ms_per_token: float = 0.1  # recompute cost
    read_ms_per_token: dict = field(default_factory=lambda: {"gpu": 0.0, "dram": 0.01, "ssd": 0.03})
    decode_ms_per_token: float = 20.0
    seed: int = 0


class SimRequest:
    """A trace request plus its block hashes (prompt, and prompt + the reply the trace appends)."""

    __slots__ = ("req", "block_hashes", "stored_after")

    def __init__(self, req: AgentRequest, block: int, next_req: AgentRequest | None) -> None:
        self.req = req
        self.block_hashes = prefix_hashes(req.token_ids.tolist(), MODEL, block)
        if next_req is None:
            self.stored_after = self.block_hashes
        else:
            full = (req.prompt_tokens + req.max_tokens) // block
            self.stored_after = prefix_hashes(next_req.token_ids[:full * block].tolist(), MODEL, block)

    def __getattr__(self, name):  # session_id, token_ids, prompt_tokens, ... from the trace request
        return getattr(self.req, name)


class TierCache:
    """One LRU tier of one instance, capacity in blocks."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def admit(self, hashes: list[int]) -> tuple[list[int], list[int]]:
        stored, evicted = [], []
        for h in hashes:
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                self.blocks[h] = None
                stored.append(h)
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        return stored, evicted


class Instance:
    def __init__(self, idx: int, cfg: SimConfig) -> None:
        self.idx = idx
        self.tiers = [TierCache(getattr(cfg, f"{t}_tokens") // cfg.block) for t in TIER_NAMES]
        self.queue: deque = deque()
        self.busy = False
        self.in_flight = 0
        self.area = 0.0  # integral of in_flight over time
        self.last_t = 0.0
        self.served = 0
        self.busy_s = 0.0

    def match(self, hashes: list[int]) -> list[int]:
        """Blocks of the consecutive cached prefix per tier (fastest tier holding each block)."""
        counts = [0, 0, 0]
        for h in hashes:
            for t, tier in enumerate(self.tiers):
                if h in tier.blocks:
                    counts[t] += 1
                    break
            else:
                break
        return counts

    def set_load(self, now: float, delta: int) -> None:
        self.area += self.in_flight * (now - self.last_t)
        self.last_t = now
        self.in_flight += delta


@dataclass
class PolicyResult:
    policy: str
    requests: int
    hit_rate: float
    tier_share: dict
    load_balance: float  # max/mean of time-averaged in-flight requests
    requests_balance: float
    busy_balance: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    lookup_p99_ms: float | None
    sim_wall_s: float


def simulate(policy: Policy, sessions: list[list[AgentRequest]], trace: TraceConfig, cfg: SimConfig,
             progress: bool = True) -> PolicyResult:
    started = time.perf_counter()
    insts = [Instance(i, cfg) for i in range(cfg.instances)]
    read_ms = [cfg.read_ms_per_token[t] for t in TIER_NAMES]
    heap: list = []
    counter = 0

    def push(t: float, kind: str, data) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(heap, (t, counter, kind, data))

    slots = [deque(sessions[s::trace.concurrency]) for s in range(trace.concurrency)]
    rng = np.random.default_rng(cfg.seed)
    for slot, queue in enumerate(slots):
        if queue:
            push(float(rng.uniform(0, 2.0)), "arrive", (slot, queue.popleft(), 0))

    total_prompt = hit_tokens = 0
    tier_tokens = [0, 0, 0]
    ttfts: list[float] = []

    def admit(inst: Instance, hashes: list[int]) -> None:
        for t, tier in enumerate(inst.tiers):
            stored, evicted = tier.admit(hashes)
            if stored or evicted:
                policy.on_tier_change(inst.idx, TIER_NAMES[t], stored, evicted)

    def start_prefill(inst: Instance, now: float) -> None:
        nonlocal total_prompt, hit_tokens
        sreq, meta = inst.queue.popleft()
        counts = inst.match(sreq.block_hashes)
        cached = sum(counts) * cfg.block
        n = sreq.prompt_tokens
        total_prompt += n
        hit_tokens += cached
        for t in range(3):
            tier_tokens[t] += counts[t] * cfg.block
        prefill_s = ((n - cached) * cfg.prefill_ms_per_token
                     + sum(c * cfg.block * ms for c, ms in zip(counts, read_ms))) / 1e3
        inst.busy = True
        inst.busy_s += prefill_s
        push(now + prefill_s, "prefilled", (inst, sreq, meta))

    bar = tqdm(total=sum(len(s) for s in sessions), desc=f"sim {policy.name}", disable=not progress, leave=False)
    while heap:
        now, _, kind, data = heapq.heappop(heap)
        if kind == "arrive":
            slot, turns, k = data
            sreq = SimRequest(turns[k], cfg.block, turns[k + 1] if k + 1 < len(turns) else None)
            loads = [inst.in_flight for inst in insts]
            inst = insts[policy.choose(sreq, loads)]
            inst.set_load(now, +1)
            inst.served += 1
            inst.queue.append((sreq, (now, slot, turns, k)))
            if not inst.busy:
                start_prefill(inst, now)
        elif kind == "prefilled":
            inst, sreq, (arrived, slot, turns, k) = data
            ttfts.append(now - arrived)
            admit(inst, sreq.block_hashes)
            inst.busy = False
            push(now + sreq.max_tokens * cfg.decode_ms_per_token / 1e3, "done", (inst, sreq, slot, turns, k))
            if inst.queue:
                start_prefill(inst, now)
        else:  # done
            inst, sreq, slot, turns, k = data
            admit(inst, sreq.stored_after)
            inst.set_load(now, -1)
            bar.update(1)
            if k + 1 < len(turns):
                push(now + turns[k + 1].think_s, "arrive", (slot, turns, k + 1))
            elif slots[slot]:
                push(now + float(rng.exponential(trace.think_s)), "arrive", (slot, slots[slot].popleft(), 0))
    bar.close()
    end = max(inst.last_t for inst in insts)
    for inst in insts:
        inst.set_load(end, 0)
    avg_load = np.array([inst.area / end for inst in insts])
    served = np.array([inst.served for inst in insts], dtype=float)
    busy = np.array([inst.busy_s for inst in insts])
    tt = np.array(ttfts)
    lookup_ms = getattr(policy, "lookup_ms", None)
    return PolicyResult(
        policy=policy.name, requests=len(ttfts), hit_rate=hit_tokens / total_prompt,
        tier_share={name: tier_tokens[t] / total_prompt for t, name in enumerate(TIER_NAMES)},
        load_balance=float(avg_load.max() / avg_load.mean()), requests_balance=float(served.max() / served.mean()),
        busy_balance=float(busy.max() / busy.mean()), ttft_mean_s=float(tt.mean()),
        ttft_p50_s=float(np.percentile(tt, 50)), ttft_p90_s=float(np.percentile(tt, 90)),
        ttft_p99_s=float(np.percentile(tt, 99)),
        lookup_p99_ms=float(np.percentile(lookup_ms, 99)) if lookup_ms else None,
        sim_wall_s=time.perf_counter() - started)


def format_table(results: list[PolicyResult]) -> str:
    head = (f"{'policy':<12} {'hit rate':>8} {'gpu':>6} {'dram':>6} {'ssd':>6} {'load max/mean':>13} "
            f"{'req max/mean':>12} {'busy max/mean':>13} {'TTFT mean':>9} {'TTFT p90':>8} {'TTFT p99':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        s = r.tier_share
        lines.append(f"{r.policy:<12} {r.hit_rate:>8.1%} {s['gpu']:>6.1%} {s['dram']:>6.1%} {s['ssd']:>6.1%} "
                     f"{r.load_balance:>13.2f} {r.requests_balance:>12.2f} {r.busy_balance:>13.2f} "
                     f"{r.ttft_mean_s:>8.2f}s {r.ttft_p90_s:>7.2f}s {r.ttft_p99_s:>7.2f}s")
    return "\n".join(lines)


def check_target(results: list[PolicyResult], min_hit: float = 0.85, max_balance: float = 1.3) -> list[str]:
    """Issue 6's acceptance: ours ≥ 85 % hits, max/mean load ≤ 1.3, hit rate above every other policy."""
    ours = next((r for r in results if r.policy == "ours"), None)
    if ours is None:
        return ["policy 'ours' not simulated"]
    failures = []
    if ours.hit_rate < min_hit:
        failures.append(f"ours hit rate {ours.hit_rate:.1%} < {min_hit:.0%}")
    if ours.load_balance > max_balance:
        failures.append(f"ours load max/mean {ours.load_balance:.2f} > {max_balance}")
    for r in results:
        if r.policy != "ours" and r.hit_rate >= ours.hit_rate:
            failures.append(f"{r.policy} hit rate {r.hit_rate:.1%} >= ours {ours.hit_rate:.1%}")
    return failures


def plot(results: list[PolicyResult], path: str) -> None:
    from kvshrink.benchmarks.bench_extra import pyplot

    plt = pyplot()
    names = [r.policy for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    bottom = np.zeros(len(results))
    for tier, color in zip(TIER_NAMES, ("#1b9e77", "#7570b3", "#d95f02")):
        values = np.array([r.tier_share[tier] for r in results])
        axes[0].bar(names, values, bottom=bottom, label=tier, color=color)
        bottom += values
    axes[0].axhline(0.85, ls="--", c="k", lw=1)
    axes[0].set_title("cache hit rate by tier")
    axes[0].legend(loc="upper left", fontsize=8)
    axes[1].bar(names, [r.load_balance for r in results], color="#666")
    axes[1].axhline(1.3, ls="--", c="k", lw=1)
    axes[1].set_title("load max/mean (time-avg in-flight)")
    axes[2].bar(names, [r.ttft_mean_s for r in results], color="#999", label="mean")
    axes[2].plot(names, [r.ttft_p90_s for r in results], "ko", label="p90")
    axes[2].set_title("TTFT (s)")
    axes[2].legend()
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=",".join(POLICIES))
    for f in SimConfig.__dataclass_fields__.values():
        if f.name != "read_ms_per_token":
            parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    for f in TraceConfig.__dataclass_fields__.values():
        if f.name != "seed":
            parser.add_argument("--trace-" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    parser.add_argument("--scoring", default="{}", help="JSON overrides of the index's scoring config")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a PNG here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    sim = SimConfig(**{k: getattr(args, k) for k in SimConfig.__dataclass_fields__ if k != "read_ms_per_token"})
    trace = TraceConfig(seed=args.seed, **{k: getattr(args, "trace_" + k) for k in TraceConfig.__dataclass_fields__
                                           if k != "seed"})
    sessions = generate_sessions(trace)
    results = [simulate(p, sessions, trace, sim, progress=not args.no_progress)
               for p in make_policies(args.policies.split(","), sim.instances, sim.seed, sim.block,
                                      json.loads(args.scoring))]
    print(f"{sim.instances} instances, {trace.sessions} sessions x ~{trace.turns} turns, "
          f"{trace.concurrency} concurrent; per instance GPU {sim.gpu_tokens} / DRAM {sim.dram_tokens} / "
          f"SSD {sim.ssd_tokens} tokens")
    print(format_table(results))
    failures = check_target(results) if "ours" in args.policies.split(",") else []
    print("target (ours >= 85 % hits, load max/mean <= 1.3, best hit rate):",
          "MET" if not failures else "NOT MET: " + "; ".join(failures))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"sim": asdict(sim), "trace": asdict(trace), "results": [asdict(r) for r in results],
                       "target_failures": failures}, fh, indent=2)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
