"""Compiled (numba) kernel modules, imported on first use, with the numpy path as the fallback.

Why one loader: the byte-plane kernels (``_jit``) and the packed-stream kernels (``_packjit``)
need the same rules: import numba only when a kernel is first wanted (it is slow to import and
optional), honour ``KVSHRINK_CODEC_JIT=0``, and fall back to the numpy reference, with the reason
kept, when numba is missing or cannot compile here (a module's ``self_test()``, if it has one, runs
once at load). Thread-safe: the first caller loads under a lock; later calls read the result.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from types import ModuleType

log = logging.getLogger(__name__)

ENV = "KVSHRINK_CODEC_JIT"


class LazyKernels:
    """The module ``name`` once loaded (``get()``), or None where the numpy path runs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.status = "untried"  # "untried" | "on" | "off: <reason>"
        self._module: ModuleType | None = None
        self._lock = threading.Lock()

    def get(self) -> ModuleType | None:
        if self.status == "untried":
            with self._lock:
                if self.status == "untried":
                    self._load()
        return self._module

    def _load(self) -> None:
        if os.environ.get(ENV, "1") == "0":
            self.status = f"off: {ENV}=0"
            return
        try:
            module = importlib.import_module(self.name)
            if hasattr(module, "self_test"):
                module.self_test()
        except ImportError as exc:
            self.status = f"off: {exc}"
        except Exception as exc:  # numba present but unable to compile here: numpy path
            log.warning("codec: compiled kernels %s unavailable (%s); using numpy", self.name, exc)
            self.status = f"off: {type(exc).__name__}: {exc}"
        else:
            self._module, self.status = module, "on"
