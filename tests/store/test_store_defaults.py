"""One source of defaults (issue 29): the code's store defaults are the shipped store-default.yaml.

A store YAML that names only its tiers' kinds, paths, capacities and shm names must be the store
every command runs and every benchmark measures. The shipped file keeps its other keys as
documentation only: each restates the code's default (deleting it changes nothing); the keys
without a default (a tier's capacity, an SSD tier's path) are the ones it sets on purpose.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterator

import pytest

from kvshrink.config_checks import load_yaml
from kvshrink.configs import default_store_path
from kvshrink.errors import ConfigError
from kvshrink.store.config import StoreConfig, TierConfig, parse_store_config

ON_PURPOSE = {"capacity", "path"}  # tier keys without a default: what the shipped file sets on purpose
PLACEMENT = ON_PURPOSE | {"shm_name"}  # what a minimal YAML names besides kind (and derive_store moves)

MINIMAL = """
tiers:
  - {kind: dram, capacity: 1GiB, shm_name: kvshrink-defaults-test}
  - {kind: ssd, path: SSD_PATH, capacity: 2GiB}
"""


def shipped() -> dict[str, Any]:
    return load_yaml(default_store_path())


def flat(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Leaves of a nested dict / list as (``tiers[1].fsync``, value)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from flat(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from flat(item, f"{prefix}[{i}]")
    else:
        yield prefix, value


def leaf_keys() -> list[tuple[Any, ...]]:
    """Every key the shipped file sets, as a path into its mapping: ("engine", "put_workers"),
    ("tiers", 1, "fsync"), ..."""
    data = shipped()
    keys: list[tuple[Any, ...]] = []
    for key, value in data.items():
        if key == "tiers":
            keys += [("tiers", i, k) for i, tier in enumerate(value) for k in tier]
        elif isinstance(value, dict):
            keys += [(key, k) for k in value]
        else:
            keys.append((key,))
    return keys


def without(data: dict[str, Any], key: tuple[Any, ...]) -> dict[str, Any]:
    out = copy.deepcopy(data)
    holder: Any = out
    for part in key[:-1]:
        holder = holder[part]
    del holder[key[-1]]
    return out


def label(key: tuple[Any, ...]) -> str:
    return "tiers[%d].%s" % key[1:] if key[0] == "tiers" else ".".join(key)


def test_a_minimal_yaml_is_the_shipped_store_but_for_placement(tmp_path):
    full = StoreConfig.load(default_store_path())
    minimal = parse_store_config(load_yaml("minimal.yaml", text=MINIMAL.replace("SSD_PATH", str(tmp_path))))
    assert [(t.kind, t.name) for t in minimal.tiers] == [(t.kind, t.name) for t in full.tiers]
    ours, theirs = dict(flat(dataclasses.asdict(minimal))), dict(flat(dataclasses.asdict(full)))
    assert ours.keys() == theirs.keys()
    differ = {key for key in ours if ours[key] != theirs[key]}
    assert differ == {f"tiers[{i}].{k}" for i, t in enumerate(full.tiers) for k in PLACEMENT if hasattr(t, k)}, \
        {key: (theirs[key], ours[key]) for key in differ}


@pytest.mark.parametrize("key", [k for k in leaf_keys() if k[-1] not in ON_PURPOSE | {"kind"}], ids=label)
def test_every_other_key_of_the_shipped_file_restates_the_default(key):
    data = shipped()
    assert parse_store_config(without(data, key)) == parse_store_config(data), \
        f"{label(key)} in {default_store_path().name} is not the code's default: change one of them"


@pytest.mark.parametrize("key", [k for k in leaf_keys() if k[-1] in ON_PURPOSE], ids=label)
def test_the_keys_set_on_purpose_have_no_default(key):
    with pytest.raises(ConfigError) as raised:
        parse_store_config(without(shipped(), key))
    assert raised.value.key == label(key)


def test_configs_built_in_code_get_the_same_defaults():
    """A StoreConfig / tier config constructed directly (no YAML) leaves out the same keys to the
    same effect: the dataclass defaults agree with the parser's."""
    full = StoreConfig.load(default_store_path())
    assert StoreConfig(tiers=full.tiers) == full
    given = {f.name for f in dataclasses.fields(TierConfig) if f.name not in ("eviction", "write_back")}
    for tier in full.tiers:
        named = given | (PLACEMENT & {f.name for f in dataclasses.fields(tier)})
        assert TierConfig(**{k: getattr(tier, k) for k in named}) == tier
