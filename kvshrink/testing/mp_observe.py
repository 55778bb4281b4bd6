"""What an ``lmcache server`` says about its cache, read from its own HTTP endpoints.

Tests and benchmarks judge hits by LMCache's counters (``/metrics``: lookup hit tokens in L1 and
L2, L2 loads per adapter) and by our adapter's store counters (``/status``: tier hits, puts,
quarantines), never by wall time alone.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import httpx

from kvshrink.testing.polling import poll_until

# vLLM's MP connector notices a cache-server restart only when a heartbeat ping fails; a server
# back within one interval is never re-registered with (LMCache 0.5.6). Engines attached by our
# tests and benchmarks ping every HEARTBEAT_S, and a restart keeps the port closed for longer.
HEARTBEAT_S = 2.0
RESTART_GAP_S = 2.5 * HEARTBEAT_S

_SAMPLE = re.compile(r"^(lmcache_mp_[A-Za-z0-9_]+)(?:\{[^}]*\})? ([-+0-9.eE]+|NaN|[+-]Inf)$", re.M)


@dataclass(frozen=True)
class CacheCounters:
    """Cumulative LMCache MP counters (summed over labels) at one moment."""

    values: dict[str, float]

    def __getitem__(self, name: str) -> float:
        return self.values.get(name, 0.0)

    def __sub__(self, other: "CacheCounters") -> "CacheCounters":
        names = set(self.values) | set(other.values)
        return CacheCounters({n: self[n] - other[n] for n in names})

    @property
    def hit_tokens(self) -> float:
        return self["lmcache_mp_lookup_hit_tokens_total"]

    @property
    def l1_hit_tokens(self) -> float:
        return self["lmcache_mp_lookup_hit_l1_tokens_total"]

    @property
    def l2_hit_tokens(self) -> float:
        return self["lmcache_mp_lookup_hit_l2_tokens_total"]

    @property
    def l2_loads(self) -> float:
        return self["lmcache_mp_l2_load_completed_requests_total"]


def cache_counters(http_url: str) -> CacheCounters:
    text = httpx.get(f"{http_url}/metrics", timeout=10.0).text
    values: dict[str, float] = {}
    for name, value in _SAMPLE.findall(text):
        values[name] = values.get(name, 0.0) + float(value)
    return CacheCounters(values)


def adapter_status(http_url: str, index: int = 0) -> dict[str, Any]:
    """``report_status()`` of the server's L2 adapter ``index`` (ours: includes store stats)."""
    status = httpx.get(f"{http_url}/status", timeout=10.0).json()
    return status["storage_manager"]["l2_adapters"][index]


def connector_config_with_heartbeat(server: Any) -> dict[str, Any]:
    """``server.connector_config()`` with a short heartbeat, so a restart is noticed quickly."""
    config = server.connector_config()
    config["kv_connector_extra_config"] = {**config["kv_connector_extra_config"],
                                           "lmcache.mp.heartbeat_interval": HEARTBEAT_S}
    return config


def wait_for_engine(http_url: str, timeout: float = 120.0, settle_s: float = RESTART_GAP_S) -> None:
    """Wait until an engine (vLLM) has registered its KV caches with this cache server, then
    ``settle_s`` more: vLLM's scheduler-side connector skips lookups until its own heartbeat has
    seen the server healthy again. Requests sent before that are misses."""
    def engine_registered() -> bool:
        status = httpx.get(f"{http_url}/status", timeout=10.0).json()
        return bool(status.get("registered_non_cuda_instance_ids") or status.get("registered_gpu_ids"))

    poll_until(engine_registered, timeout, interval=0.5,
               what=f"an engine to register with the cache server at {http_url}")
    time.sleep(settle_s)


def wait_for_store(http_url: str, tier: str, chunks: int, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until our adapter's ``tier`` holds at least ``chunks`` chunks (write-back finished)."""
    tiers: dict[str, Any] = {}  # the last reading, also for the error message

    def tiers_once_filled() -> dict[str, Any] | None:
        nonlocal tiers
        tiers = adapter_status(http_url)["store"]["tiers"]
        return tiers if tiers[tier]["chunks"] >= chunks else None

    return poll_until(tiers_once_filled, timeout, what=f"tier {tier} to hold {chunks} chunks",
                      error=lambda message: TimeoutError(f"{message} (it holds {tiers[tier]['chunks']})"))
