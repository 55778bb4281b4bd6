"""The ``kvshrink`` console script.

Each sub-command lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; add one line to ``COMMANDS`` to wire it in. Command modules keep their
top-level imports light (argparse, pathlib) and import heavy dependencies (torch, vLLM, FastAPI)
inside ``run``, so ``kvshrink --help`` and light commands stay fast.

The product's commands are ``serve-cache``, ``index``, ``router`` and ``cascade``. ``bench``, ``codec-bench`` and
``store-bench`` run the benchmarks (``kvshrink.benchmarks``) and ``fixture`` builds the harness's
real-model fixtures (``kvshrink.testing``): they are named here by dotted path only, never imported
by product code, and a benchmark command whose ``bench`` extra is not installed stops with the
``pip install`` line that fixes it (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import re
import sys
from typing import Sequence

# command name -> (module path, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "fixture": ("kvshrink.testing.fixtures.cli", "build the SmolLM2 bf16 checkpoint and real-KV samples"),
    "bench": ("kvshrink.benchmarks.suite", "benchmark KVShrink against stock LMCache side by side (codec, capacity, L2, vLLM)"),
    "serve-cache": ("kvshrink.storage_backends.serve_cache", "run lmcache server with the KVShrink L2 adapter (default: the shipped default store; --config YAML)"),
    "codec-bench": ("kvshrink.benchmarks.codec_bench", "KV Shrink codec vs zstd, numcodecs, lz4, deflate, ZipNN on real KV"),
    "store-bench": ("kvshrink.benchmarks.store_bench", "benchmark the tiered store: SSD bytes/token, get_many across tiers, 100k-chunk reopen"),
    "index": ("kvshrink.index.cli", "global KV index: serve it (HTTP + ZMQ KV events), or query a running one"),
    "router": ("kvshrink.plugins.router.router_launcher", "run production-stack's router (vllm_router) with the KVShrink tier-aware routing logic"),
    "cascade": ("kvshrink.cascade.cli", "KV Cascade proxy: a small model condenses marked documents before vLLM sees them"),
}
# command name -> the setup.cfg extra it needs beyond install_requires
EXTRAS: dict[str, str] = {"bench": "bench", "codec-bench": "bench", "store-bench": "bench"}


def missing_extra(extra: str, distribution: str = "kvshrink") -> list[str]:
    """Requirements of ``distribution``'s ``extra`` that are not installed, by distribution name;
    [] also when ``distribution`` itself is not installed (running from a source tree)."""
    try:
        requirements = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    marker = re.compile(rf"""extra\s*==\s*["']{re.escape(extra)}["']""")
    missing = []
    for requirement in requirements:
        name, _, markers = requirement.partition(";")
        if not marker.search(markers):
            continue
        name = re.match(r"[A-Za-z0-9_.-]+", name.strip()).group(0)
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvshrink", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_path, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module_path, _command=name)
        try:
            module = importlib.import_module(module_path)
        except ImportError as exc:
            # A missing optional dependency breaks its own command only, and says so when used.
            sub_parser.set_defaults(_import_error=exc)
            sub_parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            continue
        module.add_arguments(sub_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    extra = EXTRAS.get(args._command)
    missing = missing_extra(extra) if extra else []
    if missing:
        raise SystemExit(f"kvshrink {args._command} needs the {extra} extra ({', '.join(missing)} not installed): "
                         f"pip install 'kvshrink[{extra}]'")
    error = getattr(args, "_import_error", None)
    if error is not None:
        raise SystemExit(f"kvshrink {args._command}: cannot import {args._module}: {error}")
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
