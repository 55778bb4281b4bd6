"""The ``kvshrink`` console script.

Each sub-command lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; add one line to ``COMMANDS`` to wire it in. Command modules keep their
top-level imports light (argparse, pathlib) and import heavy dependencies (torch, vLLM, FastAPI)
inside ``run``, so ``kvshrink --help`` and light commands stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# command name -> (module path, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "fixture": ("kvshrink.fixtures.cli", "build the SmolLM2 bf16 checkpoint and real-KV samples"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvshrink", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_path, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module_path)
        _load(module_path, name).add_arguments(sub_parser)
    return parser


def _load(module_path: str, name: str):
    try:
        return importlib.import_module(module_path)
    except ImportError as exc:  # a missing optional dependency must not break every command
        raise SystemExit(f"kvshrink {name}: cannot import {module_path}: {exc}") from exc


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
