"""Tiered KV store: DRAM arena, SSD directory and Redis tiers behind an async copy engine.

Usage::

    from kvshrink.store import TieredStore
    with TieredStore.from_config("configs/store-default.yaml") as store:   # kvshrink.configs.default_store_path()
        store.put(key, kv).result()      # True once durable on the put tiers
        chunk = store.get(key)           # bit-exact, or None

Module map: ``config`` (YAML -> dataclasses), ``tier`` (the tier contract), ``arena`` + ``dram``,
``ssd`` + ``ssd_index``, ``redis_tier``, ``frames`` (codec method per tier), ``engine`` (staging
buffers and bounded worker lanes), ``tiered`` (TieredStore), ``stats`` (counters, Prometheus).
"""

from kvshrink.store.config import EngineConfig, StoreConfig, TierConfig
from kvshrink.store.stats import StoreCollector
from kvshrink.store.tier import MAX_KEY_BYTES, Tier, TierFullError
from kvshrink.store.tiered import TieredStore

__all__ = ["TieredStore", "StoreConfig", "TierConfig", "EngineConfig", "Tier", "TierFullError", "StoreCollector",
           "MAX_KEY_BYTES"]
