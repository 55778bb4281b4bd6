"""The configuration files KVShrink ships, installed as package data (``kvshrink.configs``).

The checkout's ``configs/`` folder is this package, so ``kvshrink cache serve`` and ``kvshrink
bench`` find the same files from any folder after ``pip install .``. One file is THE default store,
``store-default.yaml``: ``cache serve`` without ``--config`` runs it, the in-process LMCache YAMLs
load it, and every benchmark section measures it (moved and resized only:
``kvshrink.testing.derived_stores``).

Files are read where they are installed (a wheel installs them as plain files); nothing here
writes, and every function returns a fresh object (no shared state, any thread). Errors:
:class:`~kvshrink.errors.ConfigError` naming the file that is not shipped.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from kvshrink.errors import ConfigError

DEFAULT_STORE = "store-default.yaml"


def shipped_path(name: str) -> Path:
    """Where the shipped config file ``name`` (e.g. ``serve-cache-qat.yaml``) is installed."""
    path = Path(str(resources.files(__name__).joinpath(name)))
    if not path.is_file():
        raise ConfigError(name, f"not a shipped config file (looked in {path.parent})")
    return path


def default_store_path() -> Path:
    """The installed ``store-default.yaml``."""
    return shipped_path(DEFAULT_STORE)
