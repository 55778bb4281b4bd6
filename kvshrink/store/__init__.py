"""Tiered KV store: DRAM arena, SSD directory and Redis tiers behind an async copy engine.

Usage::

    from kvshrink.store import TieredStore
    with TieredStore.from_config("configs/store-default.yaml") as store:   # kvshrink.configs.default_store_path()
        store.put(key, kv).result()      # True once durable on the put tiers
        chunk = store.get(key)           # bit-exact, or None

Module map: ``config`` (YAML -> dataclasses), ``tier_base`` (the tier contract), ``arena`` +
``dram`` (+ ``shm_file``), ``ssd`` + ``ssd_index``, ``redis_tier``, ``tier_codecs`` (which codec
method and level each tier uses), ``copy_engine`` (staging buffers and bounded worker lanes),
``tiered`` (TieredStore, a facade) over ``tier_set`` (tier roles and shared lookups),
``write_path`` (write, evict, demote, retire older copies), ``copy_jobs`` (put, write-back,
promotion, prefetch and idle moves), ``read_path`` (reads and lookups), ``parking`` (chunks bound
for Redis), ``drop_reports`` (which removed keys really left), ``ledger`` (copies in flight),
``pins``, ``drops`` (drop listeners) and ``placements`` (placement notices), ``stats`` (counters,
Prometheus), ``metrics`` (the store's Prometheus collector: raw and stored bytes per tier, latency
histograms). ``tiered`` is the top: no other module here imports it (docs/architecture.md); the
protocol across tiers is written out in docs/store-consistency.md.
"""

from kvshrink.store.config import EngineConfig, StoreConfig, TierConfig
from kvshrink.store.stats import StoreCollector
from kvshrink.store.tier_base import MAX_KEY_BYTES, Tier, TierFullError
from kvshrink.store.tiered import TieredStore

__all__ = ["TieredStore", "StoreConfig", "TierConfig", "EngineConfig", "Tier", "TierFullError", "StoreCollector",
           "MAX_KEY_BYTES"]
