"""Exclusive tiers add up: with neither ``put`` nor ``write_back`` on the SSD, a chunk lives in DRAM
or on the SSD, never both, also when SSD hits are promoted back to DRAM (a promotion moves the
chunk), so the store holds about as many chunks as the two capacities allow together."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvshrink.codec import encode
from kvshrink.store import TieredStore
from kvshrink.store.arena import block_size_for
from kvshrink.store.ssd import file_prefix

DRAM_CHUNKS, SSD_CHUNKS = 8, 16


def exclusive(tmp_path, shm_name, dram: int, ssd: int) -> dict:
    return {"promote_on_hit": True,
            "tiers": [{"kind": "dram", "capacity": dram, "shm_name": shm_name, "codec": "raw"},
                      {"kind": "ssd", "capacity": ssd, "path": str(tmp_path / "ssd"), "fsync": False}]}


def footprints(chunks: list[np.ndarray], key: bytes) -> tuple[float, float]:
    """Mean bytes one of ``chunks`` takes in the DRAM arena (raw frames: the DRAM tier above says
    codec: raw) and in an SSD file (zstd level 1 frames, the SSD default)."""
    dram = [block_size_for(len(key), len(encode(c, method="raw"))) for c in chunks]
    ssd = [len(file_prefix(key)) + len(encode(c, method="zstd", level=1)) for c in chunks]
    return sum(dram) / len(chunks), sum(ssd) / len(chunks)


@pytest.fixture
def store(tmp_path, shm_name, small_chunks):
    """DRAM_CHUNKS raw chunks fit in DRAM, SSD_CHUNKS compressed ones on the SSD."""
    dram_each, ssd_each = footprints(small_chunks, b"k00")
    cfg = exclusive(tmp_path, shm_name, int(dram_each * (DRAM_CHUNKS + 0.5)), int(ssd_each * (SSD_CHUNKS + 0.5)))
    with TieredStore.from_config(cfg) as opened:
        opened.footprints = (dram_each, ssd_each)
        yield opened


def test_promotions_move_chunks_and_the_two_capacities_add_up(store, small_chunks):
    keys = [b"k%02d" % i for i in range(48)]
    chunk_of = {k: small_chunks[i % len(small_chunks)] for i, k in enumerate(keys)}
    for i, key in enumerate(keys):
        assert store.put(key, chunk_of[key]).result(timeout=60) is True
        for old in (keys[max(0, i - 10)], keys[max(0, i - 14)]):  # SSD hits, promoted back to DRAM
            got = store.get(old)
            assert got is None or np.array_equal(got, chunk_of[old])
        store.flush(timeout=60)
    store.flush(timeout=60)

    in_dram, on_ssd = set(store.keys("dram")), set(store.keys("ssd"))
    held = set(store.keys())
    stats = store.stats()
    assert stats["engine"]["promotions"] >= 10 and stats["tiers"]["dram"]["demotions"] > 0
    assert in_dram & on_ssd == set(), f"{len(in_dram & on_ssd)} chunks are held by both tiers"
    assert held == in_dram | on_ssd
    dram_each, ssd_each = store.footprints
    allowed = store.tiers[0].capacity_bytes // dram_each + store.tiers[1].capacity_bytes // ssd_each
    assert len(held) >= 0.9 * allowed, f"{len(held)} distinct chunks held, the capacities allow {allowed}"
    assert len(in_dram) >= DRAM_CHUNKS - 1 and len(on_ssd) >= 0.9 * SSD_CHUNKS
    for key in held:  # from the tier that holds it, so that reading does not move it
        tier = store.tiers[0] if key in in_dram else store.tiers[1]
        assert np.array_equal(tier.get(key), chunk_of[key]), key


def test_reads_racing_promotion_moves_always_find_the_chunk(tmp_path, shm_name, small_chunks):
    """Every chunk fits (DRAM 2.5 chunks, a large SSD): readers on two threads keep promoting
    chunks up and evicting others down; none of their reads may miss while a chunk moves."""
    cfg = exclusive(tmp_path, shm_name, int(small_chunks[0].nbytes * 2.5), 1 << 30)
    cfg["engine"] = {"background_workers": 2}
    keys = [b"k%d" % i for i in range(8)]
    misses: list[bytes] = []
    with TieredStore.from_config(cfg) as store:
        for key, chunk in zip(keys, small_chunks):
            assert store.put(key, chunk).result(timeout=60)
        store.flush(timeout=60)

        def reader(offset: int) -> None:
            for round_ in range(5):
                for i in range(len(keys)):
                    key = keys[(i * 3 + offset) % len(keys)]
                    got = store.get(key)
                    if got is None or not np.array_equal(got, small_chunks[keys.index(key)]):
                        misses.append(key)

        threads = [threading.Thread(target=reader, args=(n,)) for n in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        store.flush(timeout=60)
        assert misses == []
        in_dram, on_ssd = set(store.keys("dram")), set(store.keys("ssd"))
        assert in_dram & on_ssd == set() and in_dram | on_ssd == set(keys)
        assert store.stats()["engine"]["promotions"] > 0 and store.stats()["tiers"]["ssd"]["evictions"] == 0


def test_write_back_tiers_stay_inclusive(tmp_path, shm_name, small_chunks):
    """With write_back the SSD holds copies by design: a promoted chunk stays on the SSD too."""
    cfg = exclusive(tmp_path, shm_name, int(small_chunks[0].nbytes * 2.5), 1 << 30)
    cfg["tiers"][1]["write_back"] = True
    with TieredStore.from_config(cfg) as store:
        for i in range(4):
            assert store.put(b"k%d" % i, small_chunks[i]).result(timeout=60)
        store.flush(timeout=60)
        assert store.where(b"k0") == "ssd"
        assert np.array_equal(store.get(b"k0"), small_chunks[0])
        store.flush(timeout=60)
        assert store.tiers[0].contains(b"k0") and store.tiers[1].contains(b"k0")
        assert set(store.keys("ssd")) == {b"k%d" % i for i in range(4)}
