"""YAML configuration of the index service (``configs/index.yaml`` documents every key).

Unknown keys are errors, not silently ignored: a typo in a weight must not quietly fall back to a
default. Every error names the key to fix (:class:`ConfigError`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from kvshrink.config_checks import int_value, load_yaml, mapping_value, number_value, reject_unknown
from kvshrink.errors import ConfigError
from kvshrink.index.block_index import TIERS


@dataclass
class ScoringConfig:
    """How a lookup turns matched prefixes and load into one score per instance (see ``scoring``)."""

    tier_weights: dict[str, float] = field(
        default_factory=lambda: {"gpu": 1.0, "dram": 0.8, "ssd": 0.5, "remote": 0.25})
    hit_length_weight: float = 1.0
    media_speed_weight: float = 1.0
    load_weight: float = 0.5
    # An instance with load > overload_factor * mean load + 1 ranks after all others: the guard that
    # keeps a hot prefix from piling onto one instance. Defaults chosen on the former routing simulation (seed 1).
    overload_factor: float = 1.5


@dataclass
class ZmqConfig:
    bind: list[str] = field(default_factory=lambda: ["tcp://127.0.0.1:5557"])
    connect: list[str] = field(default_factory=list)
    replay_timeout_s: float = 2.0
    rcvhwm: int = 100_000


@dataclass
class InstanceConfig:
    id: str
    url: str | None = None
    models: list[str] = field(default_factory=list)
    replay_endpoint: str | None = None  # vLLM kv-events replay_endpoint (ROUTER), for gap repair
    events_endpoint: str | None = None  # connect our SUB here when the instance binds its PUB
    aliases: list[str] = field(default_factory=list)  # e.g. the LMCache MP server's instance_id


@dataclass
class IndexConfig:
    host: str = "127.0.0.1"
    port: int = 8200
    auth_token: str | None = None
    auth_token_env: str | None = None
    metrics_require_auth: bool = True
    max_body_bytes: int = 16 * 1024 * 1024
    max_request_tokens: int = 1_048_576
    max_blocks: int = 1_000_000
    max_position_keys: int = 1_000_000
    max_instances: int = 256
    auto_register: bool = True
    heartbeat_timeout_s: float = 60.0
    scrape_interval_s: float = 2.0
    scrape_timeout_s: float = 1.0
    lookup_block_sizes: list[int] = field(default_factory=list)  # besides those learned from events
    lmcache_chunk_size: int = 256  # tokens per LMCache chunk; tier-event entries of another length are dropped
    zmq: ZmqConfig = field(default_factory=ZmqConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    vllm_media: dict[str, str] = field(default_factory=lambda: {
        "gpu": "gpu", "cpu": "dram", "storage": "ssd", "disk": "ssd", "remote": "remote"})
    lmcache_tiers: dict[str, str] = field(default_factory=lambda: {
        "l1/dram": "dram", "l1/devdax": "dram", "l1/cxl": "dram", "l1/gds": "ssd", "l2/fs": "ssd",
        # "plugin" is how LMCache names any plugin L2 adapter, whose medium it cannot know: counted as
        # the slowest, so that the medium KVShrink's adapter reports for the same chunk in its own
        # batches (``medium``, see tier_events) always decides, as a block counts on its fastest tier
        "l2/nixl_disk": "ssd", "l2/plugin": "remote", "l2/*": "remote"})
    tokenizers: dict[str, str] = field(default_factory=dict)
    instances: list[InstanceConfig] = field(default_factory=list)

    def resolved_token(self) -> str | None:
        """The bearer token, from ``auth_token`` or the environment variable ``auth_token_env``."""
        if self.auth_token_env:
            value = os.environ.get(self.auth_token_env)
            if not value:
                raise ConfigError("auth_token_env", f"environment variable {self.auth_token_env} is not set")
            return value
        return self.auth_token or None

    def lmcache_tier(self, tier: str, backend: str) -> str | None:
        """Our tier name for an LMCache (tier, backend) pair, ``None`` if unmapped."""
        return self.lmcache_tiers.get(f"{tier}/{backend}".lower()) or self.lmcache_tiers.get(f"{tier}/*".lower())


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> IndexConfig:
    """Read ``path`` (YAML) if given, apply ``overrides``, validate."""
    data = load_yaml(path) if path is not None else {}
    data = {**data, **(overrides or {})}
    return config_from_dict(data)


def config_from_dict(data: Mapping[str, Any]) -> IndexConfig:
    cfg = _build(IndexConfig, data, "")
    _validate(cfg)
    return cfg


def _build(cls: type, data: Any, prefix: str) -> Any:
    if isinstance(data, cls):
        return data
    fields = {f.name: f for f in dataclasses.fields(cls)}
    data = mapping_value(data, prefix.rstrip(".") or "<root>")
    reject_unknown(data, fields, prefix.rstrip("."))
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = prefix + name
        if name == "zmq":
            kwargs[name] = _build(ZmqConfig, value, key + ".")
        elif name == "scoring":
            kwargs[name] = _build(ScoringConfig, value, key + ".")
        elif name == "instances":
            if not isinstance(value, list):
                raise ConfigError(key, "expected a list of instances")
            kwargs[name] = [_build(InstanceConfig, item, f"{key}[{i}].") for i, item in enumerate(value)]
        else:
            kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field (instance id) is missing
        raise ConfigError(prefix.rstrip(".") or "<root>", str(exc)) from exc


def _validate(cfg: IndexConfig) -> None:
    _check_type(cfg.host, str, "host")
    int_value(cfg.port, "port", 0, 65535)  # 0: any free port
    for name in ("max_body_bytes", "max_request_tokens", "max_blocks", "max_position_keys", "max_instances",
                 "lmcache_chunk_size"):
        int_value(getattr(cfg, name), name, 1)
    for name in ("heartbeat_timeout_s", "scrape_interval_s", "scrape_timeout_s"):
        number_value(getattr(cfg, name), name)  # 0 disables
    if not all(isinstance(b, int) and b > 0 for b in cfg.lookup_block_sizes):
        raise ConfigError("lookup_block_sizes", "must be positive integers")
    if not isinstance(cfg.zmq.bind, list) or not isinstance(cfg.zmq.connect, list):
        raise ConfigError("zmq.bind", "zmq.bind and zmq.connect must be lists of endpoints")
    number_value(cfg.zmq.replay_timeout_s, "zmq.replay_timeout_s", above=True)
    s = cfg.scoring
    if not isinstance(s.tier_weights, dict):
        raise ConfigError("scoring.tier_weights", "expected a mapping tier -> weight")
    unknown = set(s.tier_weights) - set(TIERS)
    if unknown:
        raise ConfigError("scoring.tier_weights", f"unknown tier {sorted(unknown)[0]!r} (tiers: {', '.join(TIERS)})")
    s.tier_weights = {**ScoringConfig().tier_weights, **s.tier_weights}
    for tier, weight in s.tier_weights.items():
        number_value(weight, f"scoring.tier_weights.{tier}", 0, maximum=1)
    for name in ("hit_length_weight", "media_speed_weight", "load_weight"):
        number_value(getattr(s, name), f"scoring.{name}")
    number_value(s.overload_factor, "scoring.overload_factor", 1)
    for key, mapping in (("vllm_media", cfg.vllm_media), ("lmcache_tiers", cfg.lmcache_tiers)):
        if not isinstance(mapping, dict):
            raise ConfigError(key, "expected a mapping")
        bad = [v for v in mapping.values() if v not in TIERS]
        if bad:
            raise ConfigError(key, f"unknown tier {bad[0]!r} (tiers: {', '.join(TIERS)})")
    cfg.vllm_media = {k.lower(): v for k, v in cfg.vllm_media.items()}
    cfg.lmcache_tiers = {k.lower(): v for k, v in cfg.lmcache_tiers.items()}
    seen: set[str] = set()
    for i, inst in enumerate(cfg.instances):
        if not isinstance(inst.id, str) or not inst.id or "@" in inst.id:
            raise ConfigError(f"instances[{i}].id", "must be a non-empty string without '@'")
        if inst.id in seen:
            raise ConfigError(f"instances[{i}].id", f"duplicate instance id {inst.id!r}")
        seen.add(inst.id)
    if cfg.auth_token_env is None and cfg.auth_token is not None:
        _check_type(cfg.auth_token, str, "auth_token")


def _check_type(value: Any, typ: type, key: str) -> None:
    if not isinstance(value, typ):
        raise ConfigError(key, f"expected {typ.__name__}, got {type(value).__name__}")
