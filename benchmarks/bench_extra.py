"""Imports from the ``bench`` extra (plots, the codecs we compare against), with the fix in the error.

``pip install kvshrink`` leaves matplotlib, numcodecs, lz4 and zipnn out: only benchmarks use them.
A benchmark imports them through :func:`require` (or :func:`pyplot`), so a missing one fails where
it is needed with an ``ImportError`` that says how to install it, not deep inside a run; the rest
of the benchmark module still imports. No state besides Python's module cache; any thread.
"""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL_HINT = "pip install 'kvshrink[bench]'"


def require(module: str) -> ModuleType:
    """``import module`` or ImportError naming it and the extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{module} is not installed; benchmarks need the bench extra: {INSTALL_HINT}") from exc


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the file-only Agg backend (benchmarks write PNGs, never open windows)."""
    require("matplotlib").use("Agg")
    return require("matplotlib.pyplot")
