"""The configuration files KVShrink ships, installed as package data (``kvshrink.configs``).

The checkout's ``configs/`` folder is this package, so ``kvshrink serve-cache`` and ``kvshrink
bench`` find the same files from any folder after ``pip install .``. One file is THE default store,
``store-default.yaml``: ``serve-cache`` without ``--config`` runs it, the in-process LMCache YAMLs
load it, and every benchmark section measures it. A benchmark may move it (SSD paths, shm names)
and resize it (capacities) with :func:`derive_store`, and nothing else, so that every figure is a
figure of the store users get; it records the file it started from with :func:`store_record`
(path and sha256 of the text). A different store is a different file, named by the caller.

Files are read where they are installed (a wheel installs them as plain files); nothing here
writes, and every function returns a fresh object (no shared state, any thread). Errors:
:class:`~kvshrink.errors.ConfigError` naming the setting that holds the path (``source_key``) or
the store key that is wrong.
"""

from __future__ import annotations

import copy
import hashlib
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from kvshrink.errors import ConfigError

DEFAULT_STORE = "store-default.yaml"
SERIAL_ENGINE = {"put_workers": 1, "background_workers": 1, "read_workers": 1}
_MOVABLE = {"path": "ssd", "shm_name": "dram"}  # the placement key of each local tier kind


def shipped_path(name: str) -> Path:
    """Where the shipped config file ``name`` (e.g. ``serve-cache-qat.yaml``) is installed."""
    path = Path(str(resources.files(__name__).joinpath(name)))
    if not path.is_file():
        raise ConfigError(name, f"not a shipped config file (looked in {path.parent})")
    return path


def default_store_path() -> Path:
    """The installed ``store-default.yaml``."""
    return shipped_path(DEFAULT_STORE)


def store_record(source: "str | Path | None" = None, source_key: str = "--store-config") -> dict[str, Any]:
    """What a benchmark records about the store file it used: path, sha256 of its bytes, and
    whether it is the shipped default."""
    path = _existing(source, source_key)
    return {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "default": path == default_store_path().resolve()}


def load_store_mapping(source: "str | Path | None" = None, source_key: str = "--store-config") -> dict[str, Any]:
    """A store YAML (default: the shipped default) as a plain mapping, not yet validated."""
    from kvshrink.config_checks import load_yaml

    path = _existing(source, source_key)
    data = load_yaml(path, source_key)
    if not isinstance(data.get("tiers"), list):
        raise ConfigError(source_key, f"{path} is not a store config (a mapping with a 'tiers' list)")
    return dict(data)


def derive_store(source: "str | Path | None" = None, *, paths: Mapping[str, "str | Path"] | None = None,
                 shm_names: Mapping[str, str] | None = None, capacities: Mapping[str, "int | str"] | None = None,
                 serial_engine: bool = False, source_key: str = "--store-config") -> dict[str, Any]:
    """The store in ``source`` (default: the shipped default), moved and resized, else unchanged.

    ``paths`` (ssd tiers), ``shm_names`` (dram tiers) and ``capacities`` (any tier) are keyed by
    tier name. Every dram and ssd tier must be moved, so a benchmark never touches the store of
    the machine it runs on. ``serial_engine`` runs each engine lane on one thread (chunks then
    land and age in submit order, for replays that must repeat exactly): it changes how fast the
    store works, not what it keeps. Returns a validated mapping (``adapter_params["store"]``,
    ``kvshrink.store``)."""
    from kvshrink.store.config import parse_store_config

    data = copy.deepcopy(load_store_mapping(source, source_key))
    where = _existing(source, source_key)
    tiers = {str(t.get("name", t.get("kind"))): t for t in data["tiers"] if isinstance(t, dict)}
    for key, values in (("path", paths), ("shm_name", shm_names), ("capacity", capacities)):
        for name, value in (values or {}).items():
            tier = tiers.get(name)
            if tier is None:
                raise ConfigError(source_key, f"{where} has no tier named {name!r} (tiers: {sorted(tiers)})")
            if key in _MOVABLE and tier.get("kind") != _MOVABLE[key]:
                raise ConfigError(source_key, f"{where}: tier {name!r} is {tier.get('kind')}; "
                                              f"only {_MOVABLE[key]} tiers have a {key}")
            tier[key] = str(value) if key == "path" else value
    for name, tier in tiers.items():
        for key, kind in _MOVABLE.items():
            if tier.get("kind") == kind and name not in ((paths if key == "path" else shm_names) or {}):
                raise ConfigError(source_key, f"tier {name!r} of {where} needs its own {key}: a derived store must "
                                              "not share the machine's default store")
    if serial_engine:
        data["engine"] = {**(data.get("engine") or {}), **SERIAL_ENGINE}
    try:
        parse_store_config(data)
    except ConfigError as exc:
        raise ConfigError(source_key if exc.key is None else f"{where}:{exc.key}", exc.reason) from exc
    return data


def _existing(source: "str | Path | None", source_key: str) -> Path:
    path = default_store_path() if source is None else Path(source).expanduser()
    if not path.is_file():
        raise ConfigError(source_key, f"store config {str(path)!r} does not exist")
    return path.resolve()
