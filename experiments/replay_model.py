"""The e2e agent replay's hit rates predicted from its trace alone, and what its intervals would be.

A replay on vLLM CPU costs ~95 minutes on 2 AVX2 cores (the default trace), so traces, budgets
and the number of requests an interval needs are chosen here first. The model follows chunks, not
time: each stack looks up a request's longest cached prefix of whole chunks (LMCache's prefix
lookup) and stores the rest, in request order, as the harness runs them (every store finishes
before the next request):

* stock ``l2-all``: one LRU of raw chunks, the whole budget (``fs_native`` evicting a 20th of its
  keys once above 95 %, :data:`e2e_paired.STOCK_L2_EVICTION`);
* stock ``l1-all-dram``: LMCache's L1 caching the DRAM budget (a fifth of its keys evicted above
  80 %) over ``fs_native`` holding the SSD budget, inclusive (every chunk is written to both);
* ours: the shipped default's exclusive tiers: compressed chunks (``ratio``) in a DRAM tier that
  fills ``dram_fill`` of its bytes (the arena's holes), demoting its LRU chunk to the SSD tier,
  which drops its LRU chunk; a hit in the SSD tier moves the chunk up if the shipped default
  promotes (``promote_on_hit``; it does not).

It ignores time (LMCache's once-a-second eviction, store order within a request), so it predicts
hit rates to within a few points of the e2e runs it was checked against (docs/bench/notes.md), and
TTFT only as ``per_token_s`` a missed token plus ``base_s``.

    python experiments/replay_model.py                  # the default trace and budgets
    python experiments/replay_model.py --scale 4        # 4x the sessions, same budgets in MiB
"""

from __future__ import annotations

import argparse
import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence


from kvshrink.benchmarks.e2e_paired import (BYTES_PER_TOKEN, MIB, REPLAY_HIT_POINTS_TARGET, REPLAY_PREFILL_TARGET,
                                            STOCK_L2_EVICTION, PairedSettings, budgets_for, distinct_chunks,
                                            prefix_chunk_keys)
from kvshrink.benchmarks.paired_stats import difference_of_rates, ratio_of_sums, verdict

SHIPPED_RATIO = 1.48  # the codec on real SmolLM2 KV (the codec section measures it)
DRAM_FILL = 0.87  # what a compressed DRAM arena holds in steady state (tests/store/test_store_dram_fill.py)
L1_EVICTION = (0.8, 0.2)  # LMCache's L1 default: trigger watermark, fraction of keys evicted


class _Lru:
    """Chunk keys in recency order within a byte capacity; LMCache-style batch eviction when
    ``trigger`` is below 1 (above ``trigger`` of capacity, drop ``share`` of the keys)."""

    def __init__(self, capacity: float, chunk_bytes: float, trigger: float = 1.0, share: float = 0.0) -> None:
        self.capacity, self.chunk_bytes, self.trigger, self.share = capacity, chunk_bytes, trigger, share
        self.keys: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self.keys

    def touch(self, key: str) -> None:
        self.keys.move_to_end(key)

    def remove(self, key: str) -> None:
        self.keys.pop(key, None)

    def put(self, key: str) -> list[str]:
        """Insert (or refresh) ``key``; returns the keys evicted, oldest first."""
        if key in self.keys:
            self.keys.move_to_end(key)
            return []
        if self.chunk_bytes > self.capacity:
            return []
        self.keys[key] = None
        evicted = []
        if self.share and self._used() > self.trigger * self.capacity:
            for _ in range(max(1, int(len(self.keys) * self.share))):
                evicted.append(self.keys.popitem(last=False)[0])
        while self._used() > self.capacity:
            evicted.append(self.keys.popitem(last=False)[0])
        return evicted

    def _used(self) -> float:
        return len(self.keys) * self.chunk_bytes


class _StockL2All:
    """stock ``l2-all``: the whole budget in ``fs_native``, raw chunks."""

    def __init__(self, dram_mib: float, ssd_mib: float, raw: float) -> None:
        trigger, share = STOCK_L2_EVICTION["trigger_watermark"], STOCK_L2_EVICTION["eviction_ratio"]
        self.fs = _Lru((dram_mib + ssd_mib) * MIB, raw, trigger, share)

    def holds(self, key: str) -> bool:
        return key in self.fs

    def hit(self, key: str) -> None:
        self.fs.touch(key)

    def store(self, key: str) -> None:
        self.fs.put(key)


class _StockL1AllDram:
    """stock ``l1-all-dram``: LMCache's L1 caches the DRAM budget over ``fs_native`` = the SSD
    budget; inclusive (every chunk goes to both), a hit is loaded into the L1."""

    def __init__(self, dram_mib: float, ssd_mib: float, raw: float) -> None:
        trigger, share = STOCK_L2_EVICTION["trigger_watermark"], STOCK_L2_EVICTION["eviction_ratio"]
        self.l1, self.fs = _Lru(dram_mib * MIB, raw, *L1_EVICTION), _Lru(ssd_mib * MIB, raw, trigger, share)

    def holds(self, key: str) -> bool:
        return key in self.l1 or key in self.fs

    def hit(self, key: str) -> None:
        if key in self.fs:
            self.fs.touch(key)
        self.l1.put(key)

    def store(self, key: str) -> None:
        self.l1.put(key)
        self.fs.put(key)


class _Ours:
    """The shipped default: exclusive compressed DRAM + SSD tiers; DRAM demotes its LRU chunk to
    the SSD tier; a hit in the SSD tier moves the chunk up only with ``promote`` (the shipped
    default's ``promote_on_hit``, off: the chunk is refreshed where it is)."""

    def __init__(self, dram_mib: float, ssd_mib: float, raw: float, ratio: float, dram_fill: float,
                 promote: bool) -> None:
        self.dram, self.ssd = _Lru(dram_mib * MIB * dram_fill, raw / ratio), _Lru(ssd_mib * MIB, raw / ratio)
        self.promote = promote

    def holds(self, key: str) -> bool:
        return key in self.dram or key in self.ssd

    def hit(self, key: str) -> None:
        if key in self.ssd and not self.promote:
            self.ssd.touch(key)
            return
        self.ssd.remove(key)
        self.store(key)  # promotion, or a DRAM hit refreshing the chunk

    def store(self, key: str) -> None:
        for victim in self.dram.put(key):
            self.ssd.put(victim)


@functools.cache
def _shipped_promotes() -> bool:
    """Whether the shipped default promotes an SSD hit (read once: every budget asks)."""
    from kvshrink.store.config import StoreConfig
    from kvshrink.testing.derived_stores import load_store_mapping

    return bool(load_store_mapping().get("promote_on_hit", StoreConfig.promote_on_hit))


def predict(requests: Sequence[Any], dram_mib: float, ssd_mib: float, chunk_tokens: int,
            ratio: float = SHIPPED_RATIO, dram_fill: float = DRAM_FILL, tail_first: bool = False) -> dict[str, list[int]]:
    """Hit tokens of every request on each stack (``l2-all``, ``l1-all-dram``, ``ours``).
    ``tail_first``: ours stores a request's new chunks and then touches its hits last chunk first,
    so its head is the youngest (not built: docs/bench/notes.md, "Tail-first eviction")."""
    raw = chunk_tokens * BYTES_PER_TOKEN
    stacks = {"l2-all": _StockL2All(dram_mib, ssd_mib, raw), "l1-all-dram": _StockL1AllDram(dram_mib, ssd_mib, raw),
              "ours": _Ours(dram_mib, ssd_mib, raw, ratio, dram_fill, _shipped_promotes())}
    hits: dict[str, list[int]] = {name: [] for name in stacks}
    for request in requests:
        keys = prefix_chunk_keys(request.token_ids, chunk_tokens)
        for name, stack in stacks.items():
            n = next((i for i, key in enumerate(keys) if not stack.holds(key)), len(keys))  # LMCache's prefix lookup
            if tail_first and name == "ours":
                for key in reversed(keys[n:]):
                    stack.store(key)
                for key in reversed(keys[:n]):
                    stack.hit(key)
            else:
                for key in keys[:n]:
                    stack.hit(key)
                for key in keys[n:]:
                    stack.store(key)
            hits[name].append(n * chunk_tokens)
    return hits


@dataclass(frozen=True)
class Prediction:
    label: str
    hit_rate: dict[str, float]
    stock_best: str
    hit_rate_points: dict[str, Any]
    prefill_ratio: dict[str, Any]
    prefill_s: dict[str, float]


def evaluate(requests: Sequence[Any], budgets: Sequence[Any], chunk_tokens: int, per_token_s: float = 0.028,
             base_s: float = 0.3, tail_first: bool = False) -> list[Prediction]:
    """Per budget: predicted hit rates, stock's best arrangement (the lower total prefill, as the
    harness picks it) and the intervals and verdicts the harness would report."""
    prompt = [len(r.token_ids) for r in requests]
    out = []
    for budget in budgets:
        hits = predict(requests, budget.dram_mib, budget.ssd_mib, chunk_tokens, tail_first=tail_first)
        ttft = {k: [base_s + (p - h) * per_token_s for p, h in zip(prompt, v)] for k, v in hits.items()}
        prefill = {k: sum(v) for k, v in ttft.items()}
        rates = {k: sum(v) / sum(prompt) for k, v in hits.items()}
        best = min(("l1-all-dram", "l2-all"), key=lambda k: (prefill[k], -rates[k]))
        points = difference_of_rates(hits["ours"], hits[best], prompt)
        ratio = ratio_of_sums(ttft["ours"], ttft[best])
        out.append(Prediction(budget.label(), rates, best,
                              {**points, "verdict": verdict(points, REPLAY_HIT_POINTS_TARGET, higher_is_better=True)},
                              {**ratio, "verdict": verdict(ratio, REPLAY_PREFILL_TARGET)}, prefill))
    return out


def default_requests(scale: int = 1, seed: int | None = None) -> tuple[list[Any], PairedSettings]:
    """The full run's trace (random token ids: the same shape as its real text), with ``scale``
    times the sessions run back to back in the same slots (the same working set in flight)."""
    from kvshrink.benchmarks.agent_trace import TraceConfig, generate

    settings = PairedSettings()
    trace = dict(settings.trace, sessions=settings.trace["sessions"] * scale)
    if seed is not None:
        trace["seed"] = seed
    return generate(TraceConfig(**trace)), settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=1, help="sessions x this, budgets kept in MiB (default 1)")
    parser.add_argument("--seeds", default="0", help="trace seeds, e.g. 0-5 or 0,3 (default 0)")
    parser.add_argument("--tail-first", action="store_true", help="ours touches each request's chunks last first")
    args = parser.parse_args(argv)
    lo, _, hi = args.seeds.partition("-")
    seeds = range(int(lo), int(hi) + 1) if hi else [int(s) for s in args.seeds.split(",")]
    for seed in seeds:
        base, settings = default_requests(1, seed)
        budgets = budgets_for(distinct_chunks(base, settings.chunk_tokens), settings.chunk_tokens,
                              settings.fractions, settings.dram_share)
        requests = base if args.scale == 1 else default_requests(args.scale, seed)[0]
        tokens = sum(len(r.token_ids) for r in requests)
        print(f"seed {seed}: {len(requests)} requests, {tokens} prompt tokens")
        for p in evaluate(requests, budgets, settings.chunk_tokens, tail_first=args.tail_first):
            h, r = p.hit_rate_points, p.prefill_ratio
            print(f"  {p.label}: hit stock {p.stock_best} {p.hit_rate[p.stock_best]:.1%} ours {p.hit_rate['ours']:.1%}, "
                  f"{h['value'] * 100:+.1f} points (95 % {h['low'] * 100:+.1f} to {h['high'] * 100:+.1f}) {h['verdict']}; "
                  f"prefill {r['value']:.2f} ({r['low']:.2f}-{r['high']:.2f}) {r['verdict']}; "
                  f"replay ~{sum(p.prefill_s.values()) / 60:.0f} min of prefill")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
