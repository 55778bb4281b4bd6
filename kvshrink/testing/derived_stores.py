"""Stores derived from a shipped store file, for tests and benchmarks: moved and resized, else unchanged.

Every benchmark figure must be a figure of the store users get, so a benchmark (or a test that
needs a real store) starts from a shipped file -- by default ``store-default.yaml``
(:func:`kvshrink.configs.default_store_path`) -- and may only move it (SSD paths, shm names) and
resize it (capacities) with :func:`derive_store`; :func:`store_record` is what a run records about
the file it started from. A different store is a different file, named by the caller.

Nothing here writes, and every function returns a fresh object (no shared state, any thread).
Errors: :class:`~kvshrink.errors.ConfigError` naming the setting that holds the path
(``source_key``) or the store key that is wrong.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from kvshrink.configs import default_store_path
from kvshrink.errors import ConfigError

if TYPE_CHECKING:
    from kvshrink.store.config import StoreConfig

SERIAL_ENGINE = {"put_workers": 1, "background_workers": 1, "read_workers": 1}
_MOVABLE = {"path": "ssd", "shm_name": "dram"}  # the placement key of each local tier kind
_PLACEMENT = {"path": "", "shm_name": "", "capacity": 0}  # what derive_store may change, blanked


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


def unplaced(config: StoreConfig) -> StoreConfig:
    """``config`` with every tier's path, shm name and capacity blanked: what a derived store keeps
    of the file it came from, so two stores compare equal here exactly when they differ only in
    what :func:`derive_store` may change."""
    return dataclasses.replace(config, tiers=tuple(
        dataclasses.replace(t, **{k: v for k, v in _PLACEMENT.items() if hasattr(t, k)}) for t in config.tiers))


def _existing(source: "str | Path | None", source_key: str) -> Path:
    path = default_store_path() if source is None else Path(source).expanduser()
    if not path.is_file():
        raise ConfigError(source_key, f"store config {str(path)!r} does not exist")
    return path.resolve()
