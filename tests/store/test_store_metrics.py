"""The store's Prometheus metrics (kvshrink.store.metrics) on real stores: a DRAM arena and an SSD
directory in tmp, real SmolLM2 KV chunks, values read through a prometheus_client registry.

Bytes in are the chunks' uncompressed sizes and their frames' sizes, per tier; resident bytes follow
the tiers; every get and put is timed once, each read on the tier that served it; chunks lost are
counted against the tier that lost them; and in prometheus_client's multiprocess mode the
scrape-time values reach the metrics folder."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvshrink.store import TieredStore
from kvshrink.testing.polling import poll_until

WAIT_S = 60


def read(store: TieredStore, name: str, **labels: str) -> float:
    """One sample of ``store.metrics`` (0.0 when absent), as a scrape would read it."""
    return read_metrics(store.metrics, name, **labels)


def read_metrics(metrics: Any, name: str, **labels: str) -> float:
    registry = CollectorRegistry()
    registry.register(metrics)
    return registry.get_sample_value(name, labels) or 0.0


def dram(shm: str, capacity: str = "64MiB", codec: str = "fast", **more: Any) -> dict:
    return {"kind": "dram", "capacity": capacity, "shm_name": shm, "codec": codec, **more}


def ssd(path: Path, capacity: str = "256MiB", codec: str = "dense", **more: Any) -> dict:
    return {"kind": "ssd", "capacity": capacity, "path": str(path), "fsync": False, "codec": codec, **more}


def put_all(store: TieredStore, chunks: list[np.ndarray], prefix: bytes = b"k") -> list[bytes]:
    keys = [prefix + b"%d" % i for i in range(len(chunks))]
    for key, chunk in zip(keys, chunks):
        assert store.put(key, chunk).result(timeout=WAIT_S) is True
    store.flush(timeout=WAIT_S)
    return keys


def test_raw_bytes_in_are_the_chunks_and_codec_tiers_store_fewer(tmp_path, shm_name, small_chunks):
    chunks = small_chunks[:4]
    raw = sum(c.nbytes for c in chunks)
    config = {"tiers": [dram(shm_name), ssd(tmp_path / "ssd", write_back=True)]}
    with TieredStore.from_config(config) as store:
        keys = put_all(store, chunks)
        for index, tier in enumerate(("dram", "ssd")):
            frames = sum(len(store.tiers[index].read_frame(k)) for k in keys)
            labels = {"tier": tier, "kind": tier}
            assert read(store, "kvshrink_store_tier_raw_bytes_in_total", **labels) == raw
            assert read(store, "kvshrink_store_tier_stored_bytes_in_total", **labels) == frames < raw
            used = store.tiers[index].usage()[0]
            assert read(store, "kvshrink_store_tier_stored_bytes", **labels) == used
            # resident raw bytes: exact while nothing left the tier (the SSD counts a key prefix per file)
            assert read(store, "kvshrink_store_tier_raw_bytes", **labels) == pytest.approx(raw, rel=1e-3)
        assert read(store, "kvshrink_store_tier_raw_bytes", tier="dram", kind="dram") == raw
        seconds = read(store, "kvshrink_store_tier_write_seconds_count", tier="ssd", kind="ssd")
        assert seconds == 4  # one timed write per frame


def test_a_scrape_that_falls_in_a_write_leaves_the_resident_ratio_exact(shm_name, small_chunks):
    """A write's bytes show in ``usage()`` before its sizes reach the gauge's books; a scrape between
    the two must not fold them in (CI saw the gauge's ratio drift 0.05 % from the counters' this way)."""
    from kvshrink.store.metrics import StoreMetrics

    chunks = small_chunks[:4]
    with TieredStore.from_config({"tiers": [dram(shm_name)]}) as store:
        tier = store.tiers[0]
        scraped = []
        write_frame = tier.write_frame

        def write_then_scrape(key: bytes, frame: Any, *args: Any, **kwargs: Any) -> Any:
            victims = write_frame(key, frame, *args, **kwargs)  # usage() now counts the frame
            scraped.append(read_metrics(metrics, "kvshrink_store_tier_raw_bytes", tier="dram", kind="dram"))
            return victims

        tier.write_frame = write_then_scrape
        metrics = StoreMetrics(store.tiers, store.stats)  # a second set of books, wrapped around the scrape
        metrics.instrument(0, tier)
        put_all(store, chunks)
        assert len(scraped) == 4  # one scrape inside each write
        raw = sum(c.nbytes for c in chunks)
        assert read_metrics(metrics, "kvshrink_store_tier_raw_bytes_in_total", tier="dram", kind="dram") == raw
        assert read_metrics(metrics, "kvshrink_store_tier_raw_bytes", tier="dram", kind="dram") == raw


def test_an_uncompressed_tier_stores_about_what_it_takes(shm_name, small_chunks):
    with TieredStore.from_config({"tiers": [dram(shm_name, codec="raw")]}) as store:
        put_all(store, small_chunks[:2])
        raw = read(store, "kvshrink_store_tier_raw_bytes_in_total", tier="dram", kind="dram")
        stored = read(store, "kvshrink_store_tier_stored_bytes_in_total", tier="dram", kind="dram")
        assert raw == sum(c.nbytes for c in small_chunks[:2]) and raw <= stored < raw * 1.01  # frame headers


def test_every_get_is_timed_once_and_each_read_on_the_tier_that_served_it(tmp_path, shm_name, small_chunks):
    with TieredStore.from_config({"tiers": [ssd(tmp_path / "ssd")]}) as earlier:  # left by an earlier process
        assert earlier.put(b"on-ssd", small_chunks[0]).result(timeout=WAIT_S) is True
    config = {"promote_on_hit": False, "tiers": [dram(shm_name), ssd(tmp_path / "ssd")]}
    with TieredStore.from_config(config) as store:
        put_all(store, [small_chunks[1]], b"in-dram")
        assert store.get(b"in-dram0") is not None
        assert np.array_equal(store.get(b"on-ssd"), small_chunks[0])
        assert [c is not None for c in store.get_many([b"on-ssd", b"nowhere"])] == [True, False]
        assert store.get(b"nowhere") is None
        assert store.get_into(b"on-ssd", np.empty_like(small_chunks[0])) is True
        counts = {r: read(store, "kvshrink_store_get_seconds_count", result=r) for r in ("hit", "partial", "miss")}
        assert counts == {"hit": 3, "partial": 1, "miss": 1}
        assert read(store, "kvshrink_store_get_chunks_total", result="hit") == 4
        assert read(store, "kvshrink_store_get_chunks_total", result="miss") == 2
        assert read(store, "kvshrink_store_tier_read_seconds_count", tier="dram", kind="dram", result="hit") == 1
        assert read(store, "kvshrink_store_tier_read_seconds_count", tier="ssd", kind="ssd", result="hit") == 3
        # the SSD chunk was looked for in DRAM first; a key no local tier lists is not read at all
        assert read(store, "kvshrink_store_tier_read_seconds_count", tier="dram", kind="dram", result="miss") == 3
        assert read(store, "kvshrink_store_tier_read_seconds_count", tier="ssd", kind="ssd", result="miss") == 0
        assert read(store, "kvshrink_store_get_seconds_sum", result="hit") > 0


def test_puts_are_timed_until_their_result_by_outcome(shm_name, small_chunks):
    config = {"engine": {"staging_bytes": 4096}, "tiers": [dram(shm_name)]}
    with TieredStore.from_config(config) as store:
        assert store.put(b"big", small_chunks[0]).result(timeout=WAIT_S) is False  # no staging room: dropped
        assert store.put(b"lent", small_chunks[1], lend=True).result(timeout=WAIT_S) is True
        poll_until(lambda: read(store, "kvshrink_store_put_seconds_count", outcome="stored") == 1, WAIT_S,
                   what="the stored put to be timed")  # timed by the Future's callback, after result()
        assert read(store, "kvshrink_store_put_seconds_count", outcome="dropped") == 1
        assert read(store, "kvshrink_store_dropped_total", reason="put_staging_full") == 1
        assert read(store, "kvshrink_store_put_seconds_count", outcome="failed") == 0


def test_a_chunk_lost_is_counted_against_the_tier_that_lost_it(tmp_path, small_chunks):
    frame = small_chunks[0].nbytes + 4096  # a raw frame: the chunk and a header
    with TieredStore.from_config({"tiers": [ssd(tmp_path / "ssd", capacity=str(int(2.5 * frame)), codec="raw")]}) \
            as store:
        keys = put_all(store, small_chunks[:3])  # the third evicts the first from the last tier: lost
        assert not store.contains(keys[0])
        labels = {"tier": "ssd", "kind": "ssd"}
        assert read(store, "kvshrink_store_tier_dropped_total", reason="evicted", **labels) == 1
        path = store.tiers[0].path_for(keys[1])
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF  # a flipped payload byte: the checksum fails on read
        path.write_bytes(bytes(data))
        assert store.get(keys[1]) is None
        assert read(store, "kvshrink_store_tier_dropped_total", reason="quarantined", **labels) == 1
        assert read(store, "kvshrink_store_tier_dropped_total", tier="unknown", kind="unknown", reason="other") == 0
        assert store.stats()["engine"]["keys_dropped"] == 2


def test_resident_raw_bytes_follow_evictions_and_a_reopened_tier(tmp_path, small_chunks):
    config = {"tiers": [ssd(tmp_path / "ssd", capacity="5MiB")]}  # about four compressed chunks
    with TieredStore.from_config(config) as store:
        keys = put_all(store, small_chunks[:8])
        held = [k for k in keys if store.contains(k)]
        assert 0 < len(held) < 8
        raw_held = sum(small_chunks[keys.index(k)].nbytes for k in held)
        stored = read(store, "kvshrink_store_tier_stored_bytes", tier="ssd", kind="ssd")
        raw = read(store, "kvshrink_store_tier_raw_bytes", tier="ssd", kind="ssd")
        assert stored == store.tiers[0].usage()[0] and raw > stored
        assert raw == pytest.approx(raw_held, rel=0.05)  # what left took the tier's average ratio along
    with TieredStore.from_config(config) as reopened:  # nothing written yet: the ratio of what it holds
        raw = read(reopened, "kvshrink_store_tier_raw_bytes", tier="ssd", kind="ssd")
        assert raw == pytest.approx(raw_held, rel=1e-3)
        assert read(reopened, "kvshrink_store_tier_raw_bytes_in_total", tier="ssd", kind="ssd") == 0


MIRRORED = textwrap.dedent("""
    import sys
    import numpy as np
    from kvshrink.store import TieredStore
    from kvshrink.store.metrics_export import MultiprocessMirror, multiprocess_mode
    from kvshrink.testing.fixtures.real_kv import real_kv

    assert multiprocess_mode()
    chunk = np.ascontiguousarray(real_kv("code", 512)[:, :, :64])
    config = {"tiers": [{"kind": "dram", "capacity": "16MiB", "shm_name": sys.argv[1], "codec": "fast"}]}
    with TieredStore.from_config(config) as store:
        mirror = MultiprocessMirror(store.metrics.collect_snapshot, interval=60)
        assert store.put(b"k", chunk).result(timeout=60) is True
        store.flush(60)
        assert store.get(b"k") is not None
        mirror.close()  # a last copy
    print(chunk.nbytes)
""")


def test_in_multiprocess_mode_the_scrape_time_values_reach_the_metrics_folder(tmp_path, shm_name):
    from prometheus_client import multiprocess

    folder = tmp_path / "prometheus"
    folder.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}  # set before prometheus_client is imported
    done = subprocess.run([sys.executable, "-c", MIRRORED, shm_name], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    nbytes = int(done.stdout.split()[-1])
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(folder))  # what vLLM's /metrics reads

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert sample("kvshrink_store_tier_hits_total", tier="dram") == 1  # scrape-time: copied by the mirror
    assert sample("kvshrink_store_tier_raw_bytes", tier="dram", kind="dram") == nbytes
    assert 0 < sample("kvshrink_store_tier_stored_bytes", tier="dram", kind="dram") < nbytes
    assert sample("kvshrink_store_tier_raw_bytes_in_total", tier="dram", kind="dram") == nbytes  # file-backed
    assert sample("kvshrink_store_get_seconds_count", result="hit") == 1
    assert sample("kvshrink_store_engine_puts_total") == 1
