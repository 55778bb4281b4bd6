"""KVShrink: more vLLM + LMCache KV cache per GB, losslessly compressed in a DRAM / SSD / Redis store.

Commands are ``kvshrink <component> <verb>``: ``cache serve``, ``index serve | lookup | stats``,
``router serve``, ``cascade serve``. Options follow one scheme too: ``--config`` is the command's
own YAML (a serve-cache file for ``cache serve``, an index file for ``index serve``),
``--store-config`` a store YAML a command keeps data in (``cascade serve``, ``bench``), ``--url``
the service a client command asks, and ``--<component>-...`` an option about another component
(``router serve --index-url``). The development commands (``fixture``, ``bench``, ``codec-bench``,
``store-bench``) come last in the help and say so.

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
add one entry to ``COMMANDS`` to wire it in (``verb``: the module's parser is ``<name> <verb>``).
Command modules keep their top-level imports light (argparse, pathlib) and import heavy
dependencies (torch, vLLM, FastAPI) inside ``run``, so ``kvshrink --help`` and light commands stay
fast. ``bench``, ``codec-bench`` and ``store-bench`` (``kvshrink.benchmarks``) and ``fixture``
(``kvshrink.testing``) are named here by dotted path only, never imported by product code, and a
benchmark command whose ``bench`` extra is not installed stops with the ``pip install`` line that
fixes it (docs/architecture.md). Old spellings (:data:`DEPRECATED`) still work, hidden, with a
one-line notice on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import re
import sys
from typing import NamedTuple, Sequence

DEVELOPMENT = "development: "


class Command(NamedTuple):
    module: str  # dotted path of the module with add_arguments / run
    help: str  # one line
    verb: str | None = None  # the module's parser is `<name> <verb>` (None: `<name>` itself)
    verb_help: str | None = None  # that verb's one line


# Product commands first, then the development ones (their help starts with DEVELOPMENT).
COMMANDS: dict[str, Command] = {
    "cache": Command("kvshrink.storage_backends.serve_cache",
                     "the cache server: lmcache server with the KVShrink store as its L2 adapter", "serve",
                     "run lmcache server + the KVShrink store until SIGTERM (--check: validate the config and the "
                     "machine, print the command, exit)"),
    "index": Command("kvshrink.index.cli", "global KV index: serve it (HTTP + ZMQ KV events), or query a running one"),
    "router": Command("kvshrink.plugins.router.router_launcher",
                      "production-stack's router (vllm_router) with the KVShrink tier-aware routing logic", "serve",
                      "run vllm_router with the KVShrink routing logic (its own flags after --)"),
    "cascade": Command("kvshrink.cascade.cli",
                       "KV Cascade proxy (experimental): a small model condenses marked documents before vLLM"),
    "fixture": Command("kvshrink.testing.fixtures.cli",
                       DEVELOPMENT + "build the SmolLM2 bf16 checkpoint and real-KV samples"),
    "bench": Command("kvshrink.benchmarks.suite",
                     DEVELOPMENT + "benchmark KVShrink against stock LMCache side by side (codec, capacity, L2, vLLM)"),
    "codec-bench": Command("kvshrink.benchmarks.codec_bench",
                           DEVELOPMENT + "KV Shrink codec vs zstd, numcodecs, lz4, deflate, ZipNN on real KV"),
    "store-bench": Command("kvshrink.benchmarks.store_bench",
                           DEVELOPMENT + "the tiered store: SSD bytes/token, get_many across tiers, 100k-chunk reopen"),
}
# command name -> the setup.cfg extra it needs beyond install_requires (product packages check
# their own extra when imported: kvshrink.extras)
EXTRAS: dict[str, str] = {"bench": "bench", "codec-bench": "bench", "store-bench": "bench"}
# old spelling -> the words that replace it (hidden; each use prints one line on stderr)
DEPRECATED: dict[str, tuple[str, ...]] = {"serve-cache": ("cache", "serve"), "router": ("router", "serve")}


def resolve_deprecated(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """``argv`` with an old command spelling replaced by the current one, and the notice to print
    (None when nothing was replaced). ``router <options>`` is the old ``router serve <options>``;
    ``router serve`` and ``router --help`` are left alone."""
    argv = list(argv)
    if not argv or argv[0] not in DEPRECATED:
        return argv, None
    new = DEPRECATED[argv[0]]
    if argv[0] == "router" and (len(argv) == 1 or argv[1] in ("serve", "-h", "--help")):
        return argv, None
    rest = argv[1:]
    notice = (f"kvshrink: `kvshrink {' '.join(argv[:1])}` is deprecated and will be removed; "
              f"use `kvshrink {' '.join(new)}`")
    return [*new, *rest], notice


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
    parser = argparse.ArgumentParser(prog="kvshrink", description=__doc__.splitlines()[0],
                                     epilog="Every command has --help. Commands marked development: need a "
                                            "source checkout (fixtures, benchmarks).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=command.help, description=command.help)
        target = sub_parser
        if command.verb is not None:
            verbs = sub_parser.add_subparsers(dest=f"{name}_command", required=True, metavar="SUBCOMMAND")
            target = verbs.add_parser(command.verb, help=command.verb_help, description=command.verb_help)
        target.set_defaults(_module=command.module, _command=name,
                            _words=" ".join(w for w in (name, command.verb) if w))
        try:
            module = importlib.import_module(command.module)
        except ImportError as exc:
            # A missing optional dependency breaks its own command only, and says so when used.
            target.set_defaults(_import_error=exc)
            target.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            continue
        module.add_arguments(target)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv, notice = resolve_deprecated(sys.argv[1:] if argv is None else argv)
    if notice is not None:
        print(notice, file=sys.stderr)
    parser = build_parser()
    # a command whose package is missing has no options registered: say what to install, not
    # "unrecognized arguments"
    args, unknown = parser.parse_known_args(argv)
    if unknown and getattr(args, "_import_error", None) is None:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    extra = EXTRAS.get(args._command)
    missing = missing_extra(extra) if extra else []
    if missing:
        raise SystemExit(f"kvshrink {args._words} needs the {extra} extra ({', '.join(missing)} not installed): "
                         f"pip install 'kvshrink[{extra}]'")
    error = getattr(args, "_import_error", None)
    if error is not None:
        from kvshrink.errors import MissingExtraError

        if isinstance(error, MissingExtraError):  # its message is the whole fix, one line
            raise SystemExit(str(error))
        raise SystemExit(f"kvshrink {args._words}: cannot import {args._module}: {error}")
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
