"""Run one phase of ``kvshrink bench`` alone, with its settings overridden, and print it as text.

A development tool, not the main job (``kvshrink bench --sections e2e`` / ``tiers`` runs the same
phases at their shipped settings and renders them in the report)::

    python experiments/run_phase.py e2e --settings '{"hot_pairs": 3, "context_lengths": []}' --time-budget 20
    sudo python experiments/run_phase.py tiers --out /tmp/tier-ttft --rows ssd
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from kvshrink.benchmarks.comparison import OURS, STOCK
from kvshrink.benchmarks.e2e_paired import MIB, PairedBench, PairedResult, PairedSettings
from kvshrink.benchmarks.tier_ttft import ROW_GROUPS, TierTTFT, TierTTFTSettings


def context_lines(context: Mapping[str, Any]) -> list[str]:
    """The phase as text: a line per length and source, then the targets."""
    lines = []
    for e in context.get("by_length", []):
        for source, f in e["figures"].items():
            r = f["ratio"]
            over = "".join(f"; {side} / its cold {f['over_cold'][side]['value']:.3f}" for side in (STOCK, OURS)
                           if "over_cold" in f)
            lines.append(f"context {e['tokens']:5d} {source:8} stock {f['stock_median_s']:.3f} s, ours "
                         f"{f['ours_median_s']:.3f} s, ours/stock {r['median']:.3f} (95 % {r['low']:.3f}-"
                         f"{r['high']:.3f}, {r['pairs']} pairs){over}")
    for t in context.get("targets", {}).values():
        lines.append(f"context {t['tokens']}: {t['what']} {t['value']:.3f} (95 % {t['low']:.3f}-{t['high']:.3f}) "
                     f"<= {t['target']}: {t['verdict']}")
    return lines


def tier_lines(result: dict[str, Any]) -> list[str]:
    """The rows as text: one line each, ratio with its interval and verdict, medians of both sides."""
    lines = [f"TTFT where bytes are the bottleneck: {result['settings']['prompt_tokens']}-token prompt, "
             f"{result['settings']['pairs']} pairs a row; cold TTFT stock {result['cold_ttft_s']['stock']:.1f} s, "
             f"ours {result['cold_ttft_s']['ours']:.1f} s"]
    for row in result["rows"]:
        r = row["ratio"]
        med = {k: statistics.median(x["ttft_s"] for x in row[k]) for k in ("stock", "ours")}
        target = f" (target <= {row['target']})" if row["target"] is not None else ""
        lines.append(f"  {row['name']}: ours / stock {r['median']:.3f} (95 % {r['low']:.3f}-{r['high']:.3f}){target} "
                     f"{row['verdict']}; medians stock {med['stock']:.2f} s, ours {med['ours']:.2f} s -- {row['label']}")
    if "redis_bytes_per_token" in result:
        b = result["redis_bytes_per_token"]
        k = {side: result["redis_stored"][side]["keys"] for side in (STOCK, OURS)}
        lines.append(f"  bytes in Redis per cached token (the prefill's stores: {k[STOCK]} / {k[OURS]} keys): stock "
                     f"{b[STOCK]:.0f}, ours {b[OURS]:.0f} ({b[OURS] / b[STOCK]:.3f}x)")
    lines += [f"  note: {n}" for n in result["notes"]]
    return lines


def markdown_table(result: dict[str, Any]) -> str:
    """README's table of one run: a line per row, medians of both sides and the paired ratio."""
    s = result["settings"]
    lines = ["| row | stock LMCache (median) | KVShrink (median) | ours / stock, 95 % | target | verdict |",
             "|---|---:|---:|---:|---:|---|"]
    for row in result["rows"]:
        r, med = row["ratio"], {k: statistics.median(x["ttft_s"] for x in row[k]) for k in ("stock", "ours")}
        first, second = ("cold on node A", "node B, first request") if row["name"] == "cross-node" else (
            ("KV in our DRAM", "resumed from SSD") if row["name"].startswith("resume") else ("", ""))
        target = f"<= {row['target']:g}" if row["target"] is not None else ""
        lines.append(f"| {row['name']} | {first + ' ' if first else ''}{med['stock']:.2f} s | "
                     f"{second + ' ' if second else ''}{med['ours']:.2f} s | {r['median']:.3f} ({r['low']:.3f}-"
                     f"{r['high']:.3f}) | {target} | {row['verdict']} |")
    if "redis_bytes_per_token" in result:
        b = result["redis_bytes_per_token"]
        lines.append(f"| bytes in Redis per cached token | {b[STOCK]:.0f} | {b[OURS]:.0f} | {b[OURS] / b[STOCK]:.3f} | "
                     "| |")
    device = {row["name"]: {k: statistics.median(x.get("device_read_bytes", 0) for x in row[k]) for k in ("stock", "ours")}
              for row in result["rows"] if row["name"] == "ssd, device"}
    for name, d in device.items():
        lines.append(f"| {name}: read from the disk per request (the cache servers' own, /proc) | {d['stock'] / 1e6:.1f} MB | "
                     f"{d['ours'] / 1e6:.1f} MB | {d['ours'] / d['stock']:.3f} | | |")
    lines.append(f"\n{s['prompt_tokens']}-token prompt, {s['pairs']} pairs a row; cold TTFT stock "
                 f"{result['cold_ttft_s']['stock']:.1f} s, ours {result['cold_ttft_s']['ours']:.1f} s; this disk read "
                 f"{result.get('device_read_gbps', float('nan')):.2f} GB/s sequentially in the run.")
    return "\n".join(lines)


def print_report(result: PairedResult, out: Callable[[str], None] = print) -> None:
    w = result.workload
    if "requests" not in w:
        out(f"engine: {result.engine}; no agent replay")
    else:
        out(f"engine: {result.engine}; trace: {w['requests']} requests, {w['prompt_tokens']} prompt tokens, "
            f"{w['distinct_chunks']} distinct chunks, an unbounded cache would hit "
            f"{w.get('reuse_ceiling', float('nan')):.1%}")
    if "context" in w:
        c = w["context"]
        out(f"trace contexts: prompts {c['prompt_tokens_min']}-{c['prompt_tokens_max']} tokens (median "
            f"{c['prompt_tokens_median']:.0f}), sessions end at {min(c['session_final_positions'])}-"
            f"{max(c['session_final_positions'])} positions; working set {w['working_set_bytes'] / MIB:.0f} MiB = "
            f"{w['working_set_over_largest_budget']:.2f}x the largest budget")
    if w.get("sizing"):
        out(f"sizing: {w['sizing']['why']}")
        for warning in w["sizing"]["warnings"]:
            out(f"sizing: WARNING: {warning}")
    for label in ("warm_l1", "warm_l2"):
        h = result.hot[label]
        r = h["ratio"]
        out(f"hot path {label}: ours/stock {r['median']:.3f} (95 % {r['low']:.3f}-{r['high']:.3f}, {r['pairs']} pairs), "
            f"target <= {h['target']}: {h['verdict']}")
    for line in context_lines(result.context):
        out(line)
    for entry in result.replay:
        out(f"agent replay at {entry['label']} (stock at its best: {entry['stock_best']}):")
        for key, f in entry["figures"].items():
            out(f"  {key:12} hit {f['hit_rate']:.1%}  prefill {f['prefill_s']:7.1f} s  p50 {f['ttft_p50_s']:.2f} s  "
                f"p90 {f['ttft_p90_s']:.2f} s  held {f['held_bytes'] / MIB:.0f} MiB in {f['held_chunks']:.0f} chunks")
        p, h = entry["prefill_ratio"], entry["hit_rate_points"]
        out(f"  prefill ours/stock {p['value']:.3f} (95 % {p['low']:.3f}-{p['high']:.3f}) <= {p['target']}: "
            f"{p['verdict']}; hit rate {h['value'] * 100:+.1f} points (95 % {h['low'] * 100:+.1f} to "
            f"{h['high'] * 100:+.1f}) >= +{h['target'] * 100:.0f}: {h['verdict']}")


def e2e_main(argv: Sequence[str]) -> int:
    from dataclasses import asdict

    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default="{}", help="JSON overrides of PairedSettings fields")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--time-budget", type=float, default=None, metavar="MINUTES",
                        help="size the agent trace so the whole run fits (default: the trace of --settings as it is)")
    parser.add_argument("--size-only", action="store_true",
                        help="with --time-budget: measure, size and record the trace, replay nothing")
    args = parser.parse_args(argv)
    overrides = json.loads(args.settings)
    if "fractions" in overrides:
        overrides["fractions"] = tuple(overrides["fractions"])
    settings = PairedSettings(**overrides)
    bench = PairedBench(ensure_checkpoint(), settings, progress=lambda s: print(s, flush=True))
    if args.time_budget is not None:
        deadline = time.monotonic() + 60 * args.time_budget
        bench.time_left = lambda speeds: max(0.0, deadline - time.monotonic())
        bench.size_only = args.size_only
    result = bench.run()
    print_report(result)
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=2, default=str))
    return 0


def tiers_main(argv: Sequence[str]) -> int:
    from tqdm import tqdm

    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for tier-ttft.json and the logs")
    parser.add_argument("--pairs", type=int, default=TierTTFTSettings.pairs)
    parser.add_argument("--prompt-tokens", type=int, default=TierTTFTSettings.prompt_tokens)
    parser.add_argument("--store-config", type=Path, default=None, help="our store file (default: the shipped one)")
    parser.add_argument("--rows", default=",".join(ROW_GROUPS),
                        help=f"row groups to run, comma-separated (default: all of {','.join(ROW_GROUPS)})")
    parser.add_argument("--markdown-from", type=Path, default=None, metavar="JSON",
                        help="do not run: print README's table of an earlier run's tier-ttft.json")
    args = parser.parse_args(argv)
    if args.markdown_from is not None:
        print(markdown_table(json.loads(args.markdown_from.read_text())))
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="kvshrink-tier-ttft-out-"))
    out.mkdir(parents=True, exist_ok=True)
    settings = TierTTFTSettings(prompt_tokens=args.prompt_tokens, pairs=args.pairs,
                                rows=tuple(r.strip() for r in args.rows.split(",") if r.strip()))
    with tqdm(desc="tier TTFT", bar_format="{desc}: {elapsed} {postfix}") as bar:
        bench = TierTTFT(ensure_checkpoint(), settings, args.store_config, out / "logs", bar.set_postfix_str)
        result = bench.run()
    (out / "tier-ttft.json").write_text(json.dumps(result, indent=1))
    print("\n".join(tier_lines(result)))
    print(f"\n{out / 'tier-ttft.json'}")
    return 0


if __name__ == "__main__":
    phases = {"e2e": e2e_main, "tiers": tiers_main}
    if len(sys.argv) < 2 or sys.argv[1] not in phases:
        raise SystemExit(f"usage: python experiments/run_phase.py {{{','.join(phases)}}} [options] (--help after the phase)")
    raise SystemExit(phases[sys.argv[1]](sys.argv[2:]))
