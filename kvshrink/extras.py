"""Optional dependencies, checked where product code first needs them, with the fix in the error.

``pip install kvshrink`` installs the codec and the tiered store (DRAM, SSD). Each role beyond
them is a setup.cfg extra: ``lmcache`` (``kvshrink cache serve``, the L2 adapter, the in-process
plugin), ``index``, ``router``, ``cascade``, ``redis`` (the Redis tier). The package of a role
(``kvshrink.storage_backends``, ``kvshrink.index``, ``kvshrink.plugins.router``,
``kvshrink.cascade``) calls :func:`check` in its ``__init__``, so a missing extra stops at the
boundary with one line, ``kvshrink cache serve needs lmcache: pip install 'kvshrink[lmcache]'``
(:class:`~kvshrink.errors.MissingExtraError`, an ImportError too), not deep inside a run.

:func:`check` imports nothing (a ``find_spec`` look-up per module), so importing a role's package
stays as cheap as before (``kvshrink --help`` imports every command module). :func:`require`
imports one module, for code that needs it at a call (the Redis tier). A module that is installed
but fails to import raises its own error: reinstalling would not fix it. No state besides
Python's module cache; any thread.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

from kvshrink.errors import MissingExtraError

# extra -> (what needs it, the import names its package checks). The first missing name is the one
# a message names, so each list starts with the dependency that defines the role.
# tests/test_extras_install.py checks each name against the extra's requirements in setup.cfg.
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "lmcache": ("kvshrink cache serve", ("lmcache", "msgspec", "httpx")),
    "index": ("kvshrink index", ("fastapi", "uvicorn", "msgspec", "zmq", "httpx")),
    "router": ("kvshrink router serve", ("httpx", "msgspec")),
    "cascade": ("kvshrink cascade", ("transformers", "torch", "fastapi", "uvicorn", "httpx")),
    "redis": ("kvshrink's redis tier", ("redis",)),
}


def installed(module: str) -> bool:
    """Whether the top-level module ``module`` can be found (or is loaded); imports nothing."""
    if module in sys.modules:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses the name: as good as absent
        return False


def check(extra: str) -> None:
    """MissingExtraError naming the first of ``extra``'s modules (:data:`EXTRAS`) not installed."""
    what, modules = EXTRAS[extra]
    for module in modules:
        if not installed(module):
            raise MissingExtraError(module, extra, what)


def require(module: str, extra: str, what: str | None = None) -> ModuleType:
    """``import module``, or MissingExtraError when it (or a package above it) is not installed.
    ``what`` defaults to the role :data:`EXTRAS` names for ``extra``."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name
        if not missing or not (module == missing or module.startswith(missing + ".")):
            raise  # something the module itself imports: not fixed by installing this extra
        raise MissingExtraError(missing.partition(".")[0], extra, what or EXTRAS[extra][0]) from exc
