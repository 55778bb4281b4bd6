"""Render a benchmark report: terminal table, PNG plots, and a README section.

Everything here reads the report dict that ``suite`` writes as ``report.json``, so a table or a
README section can be rendered again from a results folder without re-running anything. Rows are
re-checked (:func:`~kvshrink.benchmarks.comparison.check_rows`) before they are shown, and a
report with errors renders as its errors, never as a partial table.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable, Mapping

from kvshrink.benchmarks.bench_extra import pyplot
from kvshrink.benchmarks.comparison import OURS, STOCK, IncomparableError, check_rows

PLOT_FILES = {"hit_rate": "hit_rate_vs_budget.png", "e2e": "agent_replay_e2e.png", "codec": "ratio_vs_speed.png",
              "throughput": "l2_throughput.png", "context": "ttft_by_context_length.png"}


class ReportError(IncomparableError):
    """The report cannot be shown as a result (it has errors, or rows that do not compare)."""


# -- text -------------------------------------------------------------------------------------------
def _fmt(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}" if magnitude < 1 else f"{value:.2f}"


def _ratio_text(row: Mapping[str, Any]) -> str:
    ratio = row.get("ratio")
    if isinstance(ratio, str) or ratio is None:
        return str(ratio)
    better = (ratio >= 1) == bool(row["higher_is_better"])
    return f"{ratio:.2f}x{'' if math.isclose(ratio, 1.0, rel_tol=0.02) else (' +' if better else ' -')}"


def rows_of(report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    rows = [row for section in report["sections"].values() for row in section.get("comparisons", [])]
    check_rows(rows)
    return rows


def require_complete(report: Mapping[str, Any]) -> None:
    if report.get("status") != "ok" or report.get("errors"):
        raise ReportError("the run has errors; it is reported as its errors, not as a table:\n" + errors_text(report))


def errors_text(report: Mapping[str, Any]) -> str:
    lines = []
    for err in report.get("errors", []):
        lines.append(f"  [{err['section']}] {err['type']}: {err['message']}")
    return "\n".join(lines) or "  (no error recorded, but the run is not marked ok)"


def terminal_table(report: Mapping[str, Any]) -> str:
    """The side-by-side table and the target checks; for a failed run, the errors instead."""
    if report.get("status") != "ok" or report.get("errors"):
        return (f"kvshrink bench FAILED ({len(report.get('errors', []))} error(s)); no table is reported for a run "
                f"with errors.\n{errors_text(report)}\nFigures of the sections that finished are in "
                f"{report.get('out_dir', 'the JSON report')} for debugging; rerun the failed part with --sections.")
    rows = rows_of(report)
    header = ("section", "case", "metric", STOCK, OURS, "ours/stock")
    body = [(r["section"], r["case"], f"{r['metric']} [{r['unit']}]", _fmt(r["stock"]), _fmt(r["ours"]),
             _ratio_text(r)) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) if i < 3 else str(c).rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    out = [_title(report), line(header), "-" * (sum(widths) + 2 * (len(widths) - 1))]
    previous = None
    for cells in body:
        if previous is not None and cells[0] != previous:
            out.append("")
        out.append(line(cells))
        previous = cells[0]
    out.append("")
    store = store_line(report)
    if store:
        out.append(f"  {store}")
    out += [f"  [{'PASS' if t['pass'] else 'FAIL'}] {name}: {t['detail']}" for name, t in targets_of(report)]
    out += [f"  note: {n}" for n in notes_of(report)]
    return "\n".join(out)


def _flags(machine: Mapping[str, Any]) -> str:
    flags = machine.get("cpu_flags")
    if flags is None:
        return "CPU flags not recorded"
    return "flags: " + (" ".join(flags) if flags else "none of AVX2 / AVX-512 / AMX")


def _title(report: Mapping[str, Any]) -> str:
    m = report.get("machine", {})
    return (f"KVShrink vs stock LMCache {m.get('lmcache', '')} — {report.get('mode', '')} run, "
            f"{m.get('cpus', '?')} CPUs ({m.get('cpu_model', '?')}; {_flags(m)}), "
            f"load {m.get('loadavg_before', ['?'])[0]} -> {m.get('loadavg_after', ['?'])[0]}; "
            f"'+' = ours better, '-' = ours worse")


def targets_of(report: Mapping[str, Any]) -> Iterable[tuple[str, Mapping[str, Any]]]:
    for name, section in report["sections"].items():
        for target, result in section.get("targets", {}).items():
            yield f"{name}: {target}", result


def store_line(report: Mapping[str, Any]) -> str | None:
    """Which store file our side ran, from what the sections recorded (None: no section had one)."""
    recorded = dict.fromkeys((r["path"], r["sha256"], r["default"]) for section in report["sections"].values()
                             if (r := section.get("store_config")))
    if not recorded:
        return None
    shipped = shipped_store_sha256()
    parts = [f"{Path(path).name} (sha256 {sha[:12]}, " + (
        "the shipped default)" if default and sha == shipped else
        f"NOT the shipped default: that file is sha256 {shipped[:12]} now)" if default else
        "NOT the shipped default)") for path, sha, default in recorded]
    return "our store config: " + "; ".join(parts)


def shipped_store_sha256() -> str:
    """sha256 of the shipped ``store-default.yaml`` as installed now: a report measured on another
    version of it says so when rendered."""
    import hashlib

    from kvshrink.configs import default_store_path

    return hashlib.sha256(default_store_path().read_bytes()).hexdigest()


def notes_of(report: Mapping[str, Any]) -> list[str]:
    return [f"{name}: {n}" for name, s in report["sections"].items() for n in s.get("notes", [])]


def markdown_table(report: Mapping[str, Any]) -> str:
    rows = rows_of(report)
    out = [f"| section | case | metric | {STOCK} | {OURS} | ours/stock |", "|---|---|---|---:|---:|---:|"]
    out += [f"| {r['section']} | {r['case']} | {r['metric']} [{r['unit']}] | {_fmt(r['stock'])} | {_fmt(r['ours'])} | "
            f"{_ratio_text(r)} |" for r in rows]
    return "\n".join(out)


def readme_section(report: Mapping[str, Any], image_prefix: str = "") -> str:
    """A README section: the command, the machine, the table, the targets and the plots.

    ``image_prefix`` is prepended to plot file names (e.g. ``docs/bench/`` once they are copied
    next to README.md)."""
    require_complete(report)
    m = report.get("machine", {})
    lines = ["## Benchmark: KVShrink vs stock LMCache", "",
             f"Measured side by side in one run on {m.get('cpus', '?')} CPU cores ({m.get('cpu_model', '?')}, "
             f"{_flags(m)}; {m.get('platform', '')}), "
             f"LMCache {m.get('lmcache', '?')}, vLLM {m.get('vllm', '?')}, SmolLM2-135M bf16, "
             f"{report.get('started', '')}; load average {m.get('loadavg_before', ['?'])[0]} before, "
             f"{m.get('loadavg_after', ['?'])[0]} after. Absolute times on a shared CPU machine are indicative; "
             "ratios are the result.", "", "```bash", report.get("command", "kvshrink bench"), "```", "",
             markdown_table(report), ""]
    store = store_line(report)
    if store:
        lines += [store[0].upper() + store[1:] + ".", ""]
    lines += [f"- {'PASS' if t['pass'] else 'FAIL'} — {name}: {t['detail']}" for name, t in targets_of(report)]
    notes = notes_of(report)
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    lines.append("")
    for key, title in (("hit_rate", "Hit rate vs cache budget"), ("e2e", "Agent replay end to end on vLLM"),
                       ("context", "TTFT by context length: loading vs recomputing"),
                       ("codec", "Compression ratio vs speed"), ("throughput", "L2 adapter throughput")):
        name = report.get("plots", {}).get(key)
        if name:
            lines.append(f"![{title}]({image_prefix}{name})")
    return "\n".join(lines) + "\n"


# -- plots ------------------------------------------------------------------------------------------
def write_plots(report: Mapping[str, Any], out_dir: Path) -> dict[str, str]:
    """PNG plots for the sections present; returns {plot key: file name}."""
    pyplot()  # the bench extra, or an ImportError that says how to install it
    written = {}
    sections = report["sections"]
    for key, section, draw in (("hit_rate", "capacity", _plot_hit_rate), ("e2e", "e2e", _plot_e2e),
                               ("codec", "codec", _plot_codec), ("throughput", "throughput", _plot_throughput)):
        if sections.get(section, {}).get("status") == "ok":
            path = out_dir / PLOT_FILES[key]
            draw(sections[section]["figures"], path)
            written[key] = path.name
    e2e = sections.get("e2e", {})
    if e2e.get("status") == "ok" and e2e["figures"].get("context"):  # TTFT by context length, in e2e's run
        from kvshrink.benchmarks.context_ttft import plot

        path = out_dir / PLOT_FILES["context"]
        plot(e2e["figures"]["context"], path)
        written["context"] = path.name
    return written


def _save(fig: Any, path: Path) -> None:
    plt = pyplot()

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_hit_rate(figures: Mapping[str, Any], path: Path) -> None:
    plt = pyplot()

    sweep = figures["sweep"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for side, color in ((STOCK, "tab:blue"), (OURS, "tab:red")):
        x = [p["budget_gib"] for p in sweep]
        left.plot(x, [p[side]["chunk_hit_rate"] * 100 for p in sweep], "o-", color=color, label=side)
        right.plot(x, [p[side]["tokens_held_per_gb"] / 1000 for p in sweep], "o-", color=color, label=side)
    ideal = sweep[0][STOCK]["ideal_hit_rate"] * 100
    left.axhline(ideal, color="grey", linestyle=":", label=f"infinite cache ({ideal:.0f} %)")
    left.axhline(80, color="green", linestyle="--", linewidth=1, label="80 % target")
    left.set(xlabel="cache budget, DRAM + SSD (GiB)", ylabel="chunk hit rate (%)",
             title="Agent trace: hit rate vs budget")
    right.set(xlabel="cache budget, DRAM + SSD (GiB)", ylabel="thousand tokens held per GB of budget",
              title="KV held per GB of budget (end of replay)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path)


def _plot_e2e(figures: Mapping[str, Any], path: Path) -> None:
    """Agent replay end to end: hit rate and total prefill per budget, every stack; hot-path ratios."""
    plt = pyplot()
    import numpy as np

    replay = figures["replay"]
    keys = list(replay[0]["figures"]) if replay else []
    colors = {"ours": "tab:red", "staging": "tab:blue", "l1-all-dram": "tab:cyan"}
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.6), gridspec_kw={"width_ratios": [2, 2, 1.2]})
    x = np.arange(len(replay))
    labels = [f"{e['budget']['dram_mib'] + e['budget']['ssd_mib']:.0f} MiB" for e in replay]
    width = 0.8 / max(1, len(keys))
    for j, key in enumerate(keys):
        name = OURS if key == "ours" else f"{STOCK} ({key})"
        color = colors.get(key, None)
        left.plot(x, [e["figures"][key]["hit_rate"] * 100 for e in replay], "o-", color=color, label=name)
        middle.bar(x + (j - (len(keys) - 1) / 2) * width, [e["figures"][key]["prefill_s"] for e in replay], width,
                   color=color, label=name)
    for i, e in enumerate(replay):
        p = e["prefill_ratio"]
        middle.annotate(f"{p['value']:.2f}x\n[{p['low']:.2f}-{p['high']:.2f}]", (i, 0), xytext=(0, -34),
                        textcoords="offset points", ha="center", fontsize=7)
    left.set_xticks(x, labels)
    middle.set_xticks(x, labels)
    left.set(xlabel="budget behind L1 (DRAM + SSD)", ylabel="LMCache hit rate (% of prompt tokens)",
             title="Agent replay on vLLM: hit rate")
    middle.set(ylabel="total prefill = sum of TTFT (s)", title="Agent replay: total prefill (ours/stock-best, 95 %)")
    hot = figures["hot"]
    names = [("warm_l1", "L1 (adapter idle)"), ("warm_l2", "first L2 tier")]
    for i, (label, title) in enumerate(names):
        r = hot[label]["ratio"]
        right.errorbar([i], [r["median"]], yerr=[[r["median"] - r["low"]], [r["high"] - r["median"]]], fmt="o",
                       color="tab:red", capsize=4)
        right.hlines(hot[label]["target"], i - 0.3, i + 0.3, colors="green", linestyles="--", linewidth=1)
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_xticks(range(len(names)), [t for _, t in names], fontsize=8)
    right.set_xlim(-0.6, len(names) - 0.4)
    right.set(ylabel="warm TTFT ours / stock (median, 95 %)", title="Hot path (target dashed)")
    for ax in (left, middle, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=7)
    middle.legend(fontsize=7)
    _save(fig, path)


def _plot_codec(figures: Mapping[str, Any], path: Path) -> None:
    plt = pyplot()

    names = list(dict.fromkeys(c["name"] for c in figures["codecs"]))
    tab10 = plt.get_cmap("tab10").colors
    palette = iter([tab10[i] for i in (2, 4, 5, 6, 7, 8, 9)] * 2)  # blue and red are stock and ours
    colors = {n: "tab:red" if n.startswith("kvshrink zstd") else "tab:blue" if n.startswith("stock") else next(palette)
              for n in names}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for ax, key, label in ((axes[0], "compress_gbps", "store (compress)"),
                           (axes[1], "decompress_gbps", "load (decompress)")):
        for c in figures["codecs"]:
            ax.scatter(c[key], c["ratio"], marker="o" if c["threads"] == 1 else "^", s=55, color=colors[c["name"]],
                       label=c["name"] if c["threads"] == 1 else None)
        ax.set_xscale("log")
        ax.set(xlabel=f"{label} GB/s of KV, log scale")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("compression ratio (KV bytes / stored bytes)")
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle("Real SmolLM2 KV: ratio vs speed (o 1 thread, ^ all threads; stock LMCache stores raw)")
    _save(fig, path)


def _plot_throughput(figures: Mapping[str, Any], path: Path) -> None:
    plt = pyplot()
    import numpy as np

    cases = figures["cases"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.arange(len(cases))
    for ax, metric in zip(axes, ("store_gbps", "load_gbps")):
        for j, (side, color) in enumerate(((STOCK, "tab:blue"), (OURS, "tab:red"))):
            medians = [c[side][metric] for c in cases]
            runs = [[r[metric] for r in c["repeats"][side]] if "repeats" in c else [m] for m, c in zip(medians, cases)]
            spread = [[m - min(r) for m, r in zip(medians, runs)], [max(r) - m for m, r in zip(medians, runs)]]
            ax.bar(x + (j - 0.5) * 0.38, medians, 0.38, yerr=spread, capsize=3, color=color, label=side)
        ax.set_xticks(x, [c.get("short", c["case"]) for c in cases], fontsize=8, rotation=20, ha="right")
        ax.set(ylabel="GB/s of KV (median; whiskers: min-max of repeats)",
               title=f"L2 adapter {metric.split('_')[0]}")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path)
