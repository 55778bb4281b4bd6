"""Condensations cached: a document shared by concurrent and later requests is condensed once
(counted in the metrics), entries outlive the process in a real TieredStore, and an unreadable
stored entry is a miss."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from cascade_texts import prose

from kvshrink.cascade.cache import CondensationCache, condensation_key
from kvshrink.cascade.condenser import Condenser
from kvshrink.cascade.service import CondenseService
from kvshrink.store.tiered import TieredStore


def _value(service: CondenseService, name: str, **labels: str) -> float:
    return service.metrics.registry.get_sample_value(name, labels) or 0.0


def _ssd_store(path: Path) -> TieredStore:
    return TieredStore.from_config({"tiers": [{"kind": "ssd", "path": str(path), "capacity": 16 << 20}]})


def test_a_shared_document_is_condensed_once(service: CondenseService) -> None:
    doc = prose(1, start=40)
    concurrent = [service.submit(doc, None, 0.5) for _ in range(3)]
    results = [f.result(120) for f in concurrent]
    later = service.submit(doc, None, 0.5).result(1)
    assert results[0] == results[1] == results[2] == later
    assert _value(service, "kvshrink_cascade_cache_misses_total") == 1
    assert _value(service, "kvshrink_cascade_inflight_shared_total") == 2
    assert _value(service, "kvshrink_cascade_cache_hits_total", source="memory") == 1
    assert _value(service, "kvshrink_cascade_condense_seconds_count") == 1
    # another ratio or a question is another condensation
    service.submit(doc, "What is the code?", 0.5).result(120)
    assert _value(service, "kvshrink_cascade_cache_misses_total") == 2


def test_keys_tell_apart_what_changes_the_condensation() -> None:
    keys = {condensation_key("f", "doc", None, 0.5), condensation_key("f", "doc", "", 0.5),
            condensation_key("f", "doc", None, 0.3), condensation_key("g", "doc", None, 0.5),
            condensation_key("f", "doc2", None, 0.5)}
    assert len(keys) == 5 and condensation_key("f", "doc", None, 0.5) == condensation_key("f", "doc", None, 0.50001)


def test_condensations_outlive_the_process_in_a_tiered_store(condenser: Condenser, tmp_path: Path) -> None:
    doc = prose(1, start=7)
    store = _ssd_store(tmp_path / "ssd")
    first = CondenseService(condenser, CondensationCache(store=store))
    made = first.submit(doc, None, 0.5).result(120)
    first.close()
    store.flush()
    store.close()
    store = _ssd_store(tmp_path / "ssd")  # a restarted proxy: empty memory, the same store
    try:
        second = CondenseService(condenser, CondensationCache(store=store))
        assert second.submit(doc, None, 0.5).result(1) == made
        assert _value(second, "kvshrink_cascade_cache_hits_total", source="store") == 1
        assert _value(second, "kvshrink_cascade_cache_misses_total") == 0
        second.close()
    finally:
        store.close()


def test_an_unreadable_stored_entry_is_a_miss(tmp_path: Path) -> None:
    store = _ssd_store(tmp_path / "ssd")
    try:
        key = condensation_key("f", "doc", None, 0.5)
        assert store.put(key, np.frombuffer(b"not an entry", dtype=np.uint8)).result(10)
        cache = CondensationCache(store=store)
        assert cache.get(key) is None and cache.corrupt == 1
    finally:
        store.close()


def test_the_memory_cache_keeps_within_its_bytes(condenser: Condenser) -> None:
    cache = CondensationCache(max_bytes=600)
    made = condenser.condense("word " * 10, ratio=0.5)
    for i in range(10):
        cache.put(condensation_key("f", str(i), None, 0.5), made)
    assert 0 < len(cache) < 10
    assert cache.get(condensation_key("f", "9", None, 0.5)) is not None
    assert cache.get(condensation_key("f", "0", None, 0.5)) is None
