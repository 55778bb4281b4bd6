"""``kvshrink bench``: KVShrink vs stock LMCache, side by side in one run, on this machine.

Sections (``--sections``, default all): ``codec`` (ratio and GB/s on real SmolLM2 KV),
``capacity`` (agent-trace hit rate vs cache budget through LMCache's in-process storage stack),
``throughput`` (L2 adapter store / load GB/s, DRAM and SSD tiers, 1 and 2 threads), ``e2e``
(paired stacks of vLLM CPU + SmolLM2 through ``lmcache server``: hot-path TTFT, restart, agent replay per budget),
``tiers`` (full runs only: warm TTFT from SSD at device speed and throttled, from Redis across a shaped
link, and on a second node from the shared tier; ``tier_ttft``).

Our side runs the shipped default store (``configs/store-default.yaml``; ``--store-config`` names
another file) in every section with a store, each section moving and resizing it only (paths,
arena names, capacities); each section records the file it ran (path, sha256) as ``store_config``.
Writes ``report.json`` (every figure), PNG plots, ``table.txt`` and ``README-section.md`` to
``--out`` (default ``results/<timestamp>/``). The timed sections run first on a quiet machine; the
capacity replay (no timings) then runs while e2e's vLLM starts up. ``--time-budget`` bounds the whole
run: the e2e agent replay is sized, from speeds measured just before it, to what the run has left.
Every comparison is checked to come from two sides that ran the same trace, model and budget. A section that fails is reported as its error and the
run exits 1 without a table; ``--readme-from DIR`` renders the README section of an earlier run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

SECTION_NAMES = ("codec", "capacity", "throughput", "e2e", "tiers")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="small sizes, no agent replay: under 10 minutes on 2 AVX2 cores (default: full, its "
                             "agent replay sized to --time-budget)")
    parser.add_argument("--sections", default=",".join(SECTION_NAMES),
                        help=f"comma-separated subset of {','.join(SECTION_NAMES)} (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: results/<timestamp>/)")
    parser.add_argument("--time-budget", type=float, default=None, metavar="MINUTES",
                        help="minutes the whole run may take; the e2e agent replay is sized to what the sections "
                             "before it left, less an allowance for the tiers section (default: 25 on a CPU with "
                             "AMX, 40 on one without)")
    from kvshrink.configs import default_store_path

    parser.add_argument("--store-config", type=Path, default=None,
                        help=f"our store YAML to benchmark (default: the shipped default store, "
                             f"{default_store_path()})")
    parser.add_argument("--threads", type=int, default=None, help="the 'all threads' count (default: CPU count)")
    parser.add_argument("--trace", type=Path, default=None, metavar="FILE",
                        help="replay your own JSONL trace (one request a line: arrival_s, session_id, token_ids or "
                             "text, max_tokens; see benchmarks/user_trace.py) in the capacity and e2e sections "
                             "instead of the built-in agent trace")
    parser.add_argument("--readme-from", metavar="DIR", default=None,
                        help="do not run: print the README section of an earlier run ('latest' = newest in results/)")
    parser.add_argument("--image-prefix", default="",
                        help="with --readme-from: prefix for plot paths (e.g. docs/bench/ once the PNGs are there)")


def run(args: argparse.Namespace) -> int:
    if args.readme_from:
        return _print_readme(args.readme_from, args.image_prefix)
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")  # LMCache logs each chunk op at INFO/WARNING
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    sections = _parse_sections(args.sections)
    if args.trace is not None:  # a malformed trace fails here, with its line number, before anything runs
        from kvshrink.benchmarks.user_trace import TraceError, load_trace

        try:
            load_trace(args.trace)
        except TraceError as exc:
            print(f"kvshrink bench: {exc}", file=sys.stderr)
            return 2
    out_dir = Path(args.out or Path("results") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "kvshrink bench " + " ".join(_argv_tail())
    report = run_suite(sections, "quick" if args.quick else "full", out_dir, args.store_config, args.threads, command,
                       trace=args.trace, time_budget_min=args.time_budget)
    return 0 if report["status"] == "ok" else 1


def run_suite(sections: Sequence[str], mode: str, out_dir: Path, store_config: Path | None = None,
              threads: int | None = None, command: str = "kvshrink bench", trace: Path | None = None,
              time_budget_min: float | None = None) -> dict[str, Any]:
    """Run ``sections``; write and print the report; return it. Never raises for a failing section.
    ``time_budget_min`` (default by CPU: :func:`trace_sizing.default_time_budget_min`) bounds the
    run: the e2e replay is sized to fit what is left of it."""
    from tqdm import tqdm

    from kvshrink.benchmarks import report as render
    from kvshrink.benchmarks.suite_sections import SECTIONS, Context, loadavg, machine
    from kvshrink.configs import default_store_path

    from kvshrink.benchmarks.trace_sizing import default_time_budget_min

    about = machine()
    budget_min = time_budget_min if time_budget_min is not None else default_time_budget_min(about["cpu_flags"])
    ctx = Context(mode=mode, out_dir=out_dir, store_template=Path(store_config or default_store_path()),
                  threads=threads or os.cpu_count() or 1, bar=tqdm, trace=Path(trace).resolve() if trace else None,
                  deadline=time.monotonic() + 60 * budget_min, sections=tuple(sections))
    report: dict[str, Any] = {"kvshrink_bench": 1, "command": command, "mode": mode, "out_dir": str(out_dir),
                              "started": time.strftime("%Y-%m-%d %H:%M"), "machine": about, "sections": {},
                              "errors": [], "plots": {}, "time_budget_min": budget_min}
    results: dict[str, Any] = {}
    try:
        with tqdm(execution_order(sections), desc="kvshrink bench", unit="section") as bar:
            for name in bar:
                bar.set_postfix_str(name)
                if name == "capacity" and "e2e" in sections:
                    _launch_e2e_engine(ctx, report["errors"])
                if name == "e2e" and "e2e" in {e["section"] for e in report["errors"]}:
                    results[name] = {"status": "error", "seconds": 0.0}
                    continue
                results[name] = _run_section(name, SECTIONS[name], ctx, report["errors"])
    finally:
        if ctx.e2e_engine is not None:
            ctx.e2e_engine.stop()  # stopped by the e2e section already, unless it never ran
    report["sections"] = {name: results[name] for name in sections}  # the documented order
    report["machine"]["loadavg_after"] = loadavg()
    report["status"] = "ok" if not report["errors"] else "error"
    if report["status"] == "ok":
        try:
            report["plots"] = render.write_plots(report, out_dir)
        except Exception as exc:  # noqa: BLE001 - a broken plot is an error of the run, reported like any other
            _record_error(report["errors"], "plots", exc)
            report["status"] = "error"
    _write(report, out_dir)
    print(render.terminal_table(report))
    print(f"\nreport: {out_dir / 'report.json'}" + (f"; README section: {out_dir / 'README-section.md'}"
                                                     if report["status"] == "ok" else ""))
    return report


def execution_order(sections: Sequence[str]) -> list[str]:
    """Timed sections first, on a quiet machine; then the capacity replay, which measures no time,
    while e2e's vLLM starts up; e2e, then tiers (its own vLLM stacks, started once e2e's are gone)."""
    first = [s for s in sections if s not in ("capacity", "e2e", "tiers")]
    return first + [s for s in ("capacity", "e2e", "tiers") if s in sections]


def _launch_e2e_engine(ctx: Any, errors: list[dict[str, Any]]) -> None:
    try:
        ctx.launch_e2e_engine()
    except Exception as exc:  # noqa: BLE001 - reported as the e2e section's error
        _record_error(errors, "e2e", exc)


def _run_section(name: str, section_fn: Any, ctx: Any, errors: list[dict[str, Any]]) -> dict[str, Any]:
    """One section, all or nothing: its rows, or its error and no rows."""
    started = time.perf_counter()
    try:
        section = section_fn(ctx)
    except Exception as exc:  # noqa: BLE001 - every failure is reported, the other sections still run
        _record_error(errors, name, exc)
        return {"status": "error", "seconds": time.perf_counter() - started}
    return {"status": "ok", "seconds": time.perf_counter() - started,
            "comparisons": [row.to_dict() for row in section.comparisons], "figures": section.figures,
            "targets": section.targets, "notes": section.notes, "store_config": section.store_config}


def _record_error(errors: list[dict[str, Any]], section: str, exc: BaseException) -> None:
    errors.append({"section": section, "type": type(exc).__name__, "message": str(exc),
                   "traceback": "".join(traceback.format_exception(exc))})


def _write(report: dict[str, Any], out_dir: Path) -> None:
    from kvshrink.benchmarks import report as render

    (out_dir / "report.json").write_text(json.dumps(portable_paths(report), indent=2, default=_json_default))
    (out_dir / "table.txt").write_text(render.terminal_table(report) + "\n")
    if report["status"] == "ok":
        (out_dir / "README-section.md").write_text(render.readme_section(report))


def portable_paths(value: Any, roots: Sequence[tuple[Path, str]] | None = None) -> Any:
    """``value`` with every absolute path string under the checkout made relative to it and every
    one under the temporary folder written ``$TMPDIR/...``: a committed report names no machine."""
    if roots is None:
        from kvshrink.configs import default_store_path

        checkout = default_store_path().resolve().parents[1]  # <checkout>/configs/store-default.yaml
        roots = [(checkout, ""), (Path(tempfile.gettempdir()).resolve(), "$TMPDIR")]
    if isinstance(value, dict):
        return {k: portable_paths(v, roots) for k, v in value.items()}
    if isinstance(value, list):
        return [portable_paths(v, roots) for v in value]
    if isinstance(value, (str, Path)) and str(value).startswith("/"):
        for root, label in roots:
            with contextlib.suppress(ValueError):
                relative = Path(value).relative_to(root)
                return str(Path(label, relative)) if label else str(relative)
    return str(value) if isinstance(value, Path) else value


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _parse_sections(text: str) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTION_NAMES]
    if unknown or not chosen:
        raise SystemExit(f"kvshrink bench: --sections takes a comma-separated subset of {','.join(SECTION_NAMES)}; "
                         f"got {text!r}")
    return [s for s in SECTION_NAMES if s in chosen]  # always in the documented order


def _argv_tail() -> list[str]:
    argv = sys.argv[1:]
    return argv[1:] if argv and argv[0] == "bench" else argv


def latest_results(root: Path = Path("results")) -> Path:
    runs = sorted((p for p in root.glob("*/report.json")), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise SystemExit(f"kvshrink bench: no report.json under {root}/; run `kvshrink bench` first")
    return runs[-1].parent


def render_readme(results_dir: Path, image_prefix: str = "") -> str:
    """The README section for the run in ``results_dir`` (raises ReportError for a failed run)."""
    from kvshrink.benchmarks import report as render

    report = json.loads((Path(results_dir) / "report.json").read_text())
    return render.readme_section(report, image_prefix)


def _print_readme(where: str, image_prefix: str = "") -> int:
    from kvshrink.benchmarks.report import ReportError

    results_dir = latest_results() if where == "latest" else Path(where)
    try:
        print(render_readme(results_dir, image_prefix), end="")
    except ReportError as exc:
        print(f"kvshrink bench: {results_dir}: {exc}", file=sys.stderr)
        return 1
    return 0
