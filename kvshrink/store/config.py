"""Store configuration: an ordered list of tiers plus copy-engine limits, from YAML or a dict.

Every value is checked once, here, so that tiers can trust what they get; a wrong value raises
:class:`~kvshrink.errors.ConfigError` naming the exact key (``tiers[1].capacity``). Unknown keys
are errors too: a typo must not silently fall back to a default. Checks that belong to another
module are asked of it, not copied: a tier's ``level`` goes through the codec's own range check
for its ``method``; a tier's kind-specific keys through the config class its kind registered
(:mod:`kvshrink.store.tier_registry`; a Redis ``url`` goes on to redis-py's URL parser). This
module names no tier kind.

Defaults: every default here (and in each kind's config class) is what the shipped
``configs/store-default.yaml`` says, so a YAML that names only its tiers' kinds, paths, capacities
and shm names is the store the benchmarks measure (tests/store/test_store_defaults.py checks).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

from kvshrink.config_checks import bool_value, int_value, load_yaml, mapping_value, number_value, one_of, reject_unknown
from kvshrink.errors import ConfigError

EVICTION_POLICIES = ("lru", "fifo")
# A tier's ``codec``: ``raw`` (framed and checksummed, not compressed), ``fast`` (the exponent byte
# packed, the rest moved at memory speed: ~1.33x, decoded at several GB/s per core) or ``dense``
# (byte planes + ``method``: zstd, or qat = deflate, ~1.48x at ~2 GB/s). ``compressed: true/false``
# is the older spelling of dense / raw.
TIER_CODECS = ("raw", "fast", "dense")
DENSE_METHODS = ("zstd", "qat")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(value: Any, key: str) -> int:
    """``"4GiB"``, ``"512 MB"``, ``1048576`` -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(key, f"expected a size such as 4GiB or 1048576, got {value!r}")
    if isinstance(value, (int, float)):
        size = int(value)
    else:
        match = _SIZE_RE.match(str(value))
        unit = (match.group(2) or "").lower() if match else None
        if not match or unit not in _SIZE_UNITS:
            raise ConfigError(key, f"expected a size such as 4GiB or 1048576, got {value!r}")
        size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size < 0:
        raise ConfigError(key, f"must not be negative, got {value!r}")
    return size


_CHECK_BY_TYPE: dict[str, Callable[[Any, str], Any]] = {  # a kind-specific field's type -> its check
    "bool": bool_value, "int": partial(int_value, minimum=0), "float": number_value, "str": lambda value, key: str(value)}


@dataclass(frozen=True)
class TierConfig:
    """The keys every tier has. ``put``: a store lands here and its Future waits for it;
    ``write_back``: the chunk is copied here in the background after the put; eviction from the
    tier above demotes here.

    A kind's own keys (a DRAM tier's ``shm_name``, an SSD tier's ``path``) live in its config
    class, a subclass registered with the kind (:mod:`kvshrink.store.tier_registry`), which also
    checks them (:meth:`parse_kind_keys`). ``TierConfig(kind="ssd", ...)`` builds that subclass,
    as ``pathlib.Path()`` builds a ``PosixPath``; a kind without keys of its own uses this class.
    """

    kind: str
    name: str
    capacity: int
    compressed: bool
    eviction: str = "lru"
    put: bool = False
    write_back: bool = False
    method: str = "zstd"  # the codec method of compressed frames: "fast", or a dense method (zstd, qat)
    level: int = 1

    # what a kind's YAML gets when it leaves a common key out (a subclass overrides these)
    codec_by_default: ClassVar[str] = "dense"  # one of TIER_CODECS (a DRAM tier: fast)
    bounded: ClassVar[bool] = True  # False: the capacity is reported, not enforced (optional, may be 0)

    def __new__(cls, *args: Any, **kwargs: Any) -> "TierConfig":
        if cls is TierConfig and (args or "kind" in kwargs):
            from kvshrink.store.tier_registry import config_class

            cls = config_class(kwargs["kind"] if "kind" in kwargs else args[0])
        return object.__new__(cls)

    @property
    def codec(self) -> str:
        """``raw``, ``fast`` or ``dense`` (:data:`TIER_CODECS`): what the ``codec`` key says."""
        return "raw" if not self.compressed else "fast" if self.method == "fast" else "dense"

    @classmethod
    def kind_keys(cls) -> frozenset[str]:
        """The keys this kind adds to the common ones: its own dataclass fields."""
        return frozenset(f.name for f in fields(cls)) - frozenset(f.name for f in fields(TierConfig))

    @classmethod
    def parse_kind_keys(cls, data: Mapping[str, Any], name: str, prefix: str) -> dict[str, Any]:
        """This kind's own keys from one tier's YAML mapping (``name``: the tier's name; ``prefix``:
        ``tiers[1]``, for messages), checked and converted; the keys left out keep their field
        defaults. Each is checked by its field's type here (bool, int >= 0, number >= 0, str); a
        kind overrides this to check more (call it first). Raises ConfigError naming the key;
        TypeError for a field of another type, which its kind must check itself."""
        out: dict[str, Any] = {}
        types = {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in fields(cls)}
        for key in sorted(cls.kind_keys() & set(data)):
            if types[key] not in _CHECK_BY_TYPE:
                raise TypeError(f"{cls.__name__}.{key}: no generic check for type {types[key]}; "
                                "check it in parse_kind_keys")
            out[key] = _CHECK_BY_TYPE[types[key]](data[key], f"{prefix}.{key}")
        return out


@dataclass(frozen=True)
class EngineConfig:
    """Copy-engine limits. A put beyond ``put_queue`` in flight, or beyond ``staging_bytes`` of
    staged data, is dropped and counted; background jobs beyond ``background_queue`` likewise."""

    put_workers: int = 2
    background_workers: int = 1
    read_workers: int = 4
    put_queue: int = 64
    background_queue: int = 256
    staging_bytes: int = 512 * 2**20
    codec_threads: int | None = None  # this store's codec thread budget (kvshrink.codec.cpu_budget); None: the process's


@dataclass(frozen=True)
class PrefetchConfig:
    """Prefetch hints (``TieredStore.prefetch``): chunks moved up to the first tier ahead of a read.
    ``depth``: most chunks one hint moves, in prefix order (0: hints are ignored, counted dropped);
    ``max_in_flight``: chunk moves running at once in the store; ``max_pending``: chunks queued
    over all hints, beyond which a hint's chunks are dropped and counted, never queued."""

    depth: int = 256
    max_in_flight: int = 2
    max_pending: int = 4096


@dataclass(frozen=True)
class IdleDemotionConfig:
    """Chunks of the first tier not read or written for ``after_s`` seconds move one tier down
    (0: off); a scan every ``scan_interval_s`` demotes at most ``max_per_scan`` of them."""

    after_s: float = 0.0
    scan_interval_s: float = 1.0
    max_per_scan: int = 64


@dataclass(frozen=True)
class StoreConfig:
    tiers: tuple[TierConfig, ...]
    engine: EngineConfig = field(default_factory=EngineConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    idle_demotion: IdleDemotionConfig = field(default_factory=IdleDemotionConfig)
    # a hit below the first tier is not moved up: LMCache's L1 already keeps what it loaded
    promote_on_hit: bool = False
    # close() copies what only a faster tier holds down to the next one: with exclusive tiers
    # (no write_back) a clean shutdown then keeps it on SSD, not only in /dev/shm
    persist_on_close: bool = True

    @classmethod
    def load(cls, source: "str | Path | Mapping[str, Any] | StoreConfig") -> "StoreConfig":
        """From a YAML file path, a dict with the same structure, or an existing config. A file that
        cannot be read or parsed is a ConfigError with ``key`` None (the caller knows which setting
        named the file); a bad value names its key within the file."""
        if isinstance(source, StoreConfig):
            return source
        if isinstance(source, (str, Path)):
            return parse_store_config(load_yaml(source))
        return parse_store_config(source)


_COMMON_TIER_KEYS = frozenset(f.name for f in fields(TierConfig)) | {"codec"}


def parse_store_config(data: Any) -> StoreConfig:
    if not isinstance(data, Mapping):
        raise ConfigError("<root>", f"expected a mapping with a 'tiers' list, got {type(data).__name__}")
    reject_unknown(data, {"tiers", "engine", "promote_on_hit", "persist_on_close", "prefetch", "idle_demotion"})
    tiers_data = data.get("tiers")
    if not isinstance(tiers_data, list) or not tiers_data:
        raise ConfigError("tiers", "expected a non-empty list of tiers, fastest first")
    tiers = tuple(_parse_tier(t, i) for i, t in enumerate(tiers_data))
    names = [t.name for t in tiers]
    for i, name in enumerate(names):
        if names.index(name) != i:
            raise ConfigError(f"tiers[{i}].name", f"duplicate tier name {name!r}; give each tier a distinct name")
    if not any(t.put for t in tiers):
        tiers = (replace(tiers[0], put=True),) + tiers[1:]
    engine = _parse_engine(data.get("engine", {}))
    promote = bool_value(data.get("promote_on_hit", StoreConfig.promote_on_hit), "promote_on_hit")
    persist = bool_value(data.get("persist_on_close", StoreConfig.persist_on_close), "persist_on_close")
    prefetch = _parse_prefetch(data.get("prefetch", {}))
    idle = _parse_idle_demotion(data.get("idle_demotion", {}))
    if idle.after_s and len(tiers) < 2:
        raise ConfigError("idle_demotion.after_s", "needs a tier below the first to demote to; set 0 (off)")
    return StoreConfig(tiers=tiers, engine=engine, promote_on_hit=promote, persist_on_close=persist,
                       prefetch=prefetch, idle_demotion=idle)


def _parse_prefetch(data: Any) -> PrefetchConfig:
    data = mapping_value(data, "prefetch", {f.name for f in fields(PrefetchConfig)})
    d = PrefetchConfig()
    return PrefetchConfig(depth=int_value(data.get("depth", d.depth), "prefetch.depth", minimum=0),
                          max_in_flight=int_value(data.get("max_in_flight", d.max_in_flight),
                                                  "prefetch.max_in_flight", minimum=1, maximum=64),
                          max_pending=int_value(data.get("max_pending", d.max_pending), "prefetch.max_pending",
                                                minimum=1))


def _parse_idle_demotion(data: Any) -> IdleDemotionConfig:
    data = mapping_value(data, "idle_demotion", {f.name for f in fields(IdleDemotionConfig)})
    d = IdleDemotionConfig()
    return IdleDemotionConfig(
        after_s=number_value(data.get("after_s", d.after_s), "idle_demotion.after_s"),
        scan_interval_s=number_value(data.get("scan_interval_s", d.scan_interval_s), "idle_demotion.scan_interval_s",
                                     above=True),
        max_per_scan=int_value(data.get("max_per_scan", d.max_per_scan), "idle_demotion.max_per_scan", minimum=1))


def _parse_tier(data: Any, index: int) -> TierConfig:
    """One tier: the common keys here, the kind's own by its config class (looked up, never named)."""
    from kvshrink.store.tier_registry import config_class

    prefix = f"tiers[{index}]"
    if not isinstance(data, Mapping):
        raise ConfigError(prefix, f"expected a mapping, got {type(data).__name__}")
    kind_config = config_class(data.get("kind"), f"{prefix}.kind")
    reject_unknown(data, _COMMON_TIER_KEYS | kind_config.kind_keys(), prefix)
    out: dict[str, Any] = {"kind": data["kind"], "name": str(data.get("name", data["kind"]))}
    if "capacity" not in data and kind_config.bounded:
        raise ConfigError(f"{prefix}.capacity", "required: the most bytes this tier may hold (e.g. 4GiB)")
    out["capacity"] = parse_size(data.get("capacity", 0), f"{prefix}.capacity")
    if kind_config.bounded and out["capacity"] == 0:
        raise ConfigError(f"{prefix}.capacity", "must be greater than zero")
    for key in ("compressed", "put", "write_back"):
        if key in data:
            out[key] = bool_value(data[key], f"{prefix}.{key}")
    out["eviction"] = one_of(str(data.get("eviction", TierConfig.eviction)).lower(), EVICTION_POLICIES,
                             f"{prefix}.eviction")
    _parse_codec(data, out, prefix, kind_config.codec_by_default)
    out.update(kind_config.parse_kind_keys(data, out["name"], prefix))
    if index == 0 and out.get("write_back"):
        raise ConfigError(f"{prefix}.write_back", "the first tier cannot be a write-back target; use put: true")
    return kind_config(**out)


def _parse_codec(data: Mapping[str, Any], out: dict[str, Any], prefix: str, default: str) -> None:
    """``codec`` (raw / fast / dense; left out: ``compressed`` if given, else the kind's
    ``default``), ``method`` (dense only) and ``level`` into ``compressed``, ``method`` and
    ``level``; ``compressed`` (the older key) must agree with ``codec``."""
    if "method" in data:
        out["method"] = one_of(data["method"], DENSE_METHODS, f"{prefix}.method")
    if "codec" in data:
        codec = one_of(data["codec"], TIER_CODECS, f"{prefix}.codec")
        if "compressed" in data and out["compressed"] != (codec != "raw"):
            raise ConfigError(f"{prefix}.compressed", f"says {out['compressed']} but codec says {codec}; "
                                                      "drop compressed (codec replaces it)")
    elif "compressed" in data:
        codec = "dense" if out["compressed"] else "raw"
    else:
        codec = default
    if "method" in data and codec != "dense":
        chosen = "" if "codec" in data or "compressed" in data else " (its kind's default; set codec: dense)"
        raise ConfigError(f"{prefix}.method", f"chooses a dense method; this tier's codec is {codec}{chosen}")
    out["compressed"] = codec != "raw"
    if codec == "fast":
        out["method"] = "fast"
    method = out.get("method", TierConfig.method)
    out["level"] = _level(data.get("level", TierConfig.level), method, f"{prefix}.level")


def _level(value: Any, method: str, key: str) -> int:
    """A level the codec accepts for ``method``; the codec owns the ranges (zstd 1..22, deflate
    1..9), so a level that would fail every put fails here instead."""
    from kvshrink.codec.backends import validate_level

    try:
        return validate_level(method, int_value(value, key))
    except ValueError as exc:
        raise ConfigError(key, str(exc)) from None


def _parse_engine(data: Any) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)}
    data = mapping_value(data, "engine", names)
    out: dict[str, Any] = {}
    for name in names & set(data):
        key = f"engine.{name}"
        out[name] = parse_size(data[name], key) if name == "staging_bytes" else None if name == "codec_threads" \
            and data[name] in (None, "auto") else int_value(data[name], key, minimum=1)
    return EngineConfig(**out)

