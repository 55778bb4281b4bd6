"""The store's data path on real tiers and threads: lent puts (no staging copy), read lanes of
``get_many`` sized to the codec budget, serial decodes, and the SSD tier's cache-priced
durability (no fsync per put; a clean close syncs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvshrink.codec.cpu_budget import budget
from kvshrink.configs import default_store_path
from kvshrink.store import StoreConfig, TieredStore
from kvshrink.store import ssd as ssd_module
from kvshrink.store.ssd_files import sync_filesystem as _sync_filesystem
from test_store_reliability import ROOT, WRITER

MiB = 2**20


def config(tmp_path, shm_name, *, dram=64 * MiB, read_workers=4, fsync=False):
    return {"promote_on_hit": False, "engine": {"read_workers": read_workers},
            "tiers": [{"kind": "dram", "capacity": dram, "shm_name": shm_name, "codec": "raw"},
                      {"kind": "ssd", "capacity": 256 * MiB, "path": str(tmp_path / "ssd"), "fsync": fsync}]}


def lanes_for(store, keys) -> int:
    """The lanes a get_many of ``keys`` would run now (reserved, then given back)."""
    lanes, _ = store._reads.reserve_lanes(keys)
    store._reads.release_lanes(lanes)
    return lanes


@pytest.fixture
def store(tmp_path, shm_name):
    with TieredStore.from_config(config(tmp_path, shm_name)) as s:
        yield s


def test_a_lent_chunk_is_encoded_where_it_lies_without_staging(store, small_chunks):
    futures = [store.put(b"k%d" % i, c, lend=True) for i, c in enumerate(small_chunks[:6])]
    assert all(f.result(timeout=60) is True for f in futures)
    assert store.engine.staging._allocated == 0  # no staging buffer was ever taken
    for i, chunk in enumerate(small_chunks[:6]):
        assert np.array_equal(store.get(b"k%d" % i), chunk)


def test_a_lent_chunk_that_cannot_be_read_in_place_is_staged(store, small_chunks):
    strided = small_chunks[0][:, :, ::2]  # not contiguous: the workers get a staged copy
    assert store.put(b"s", strided, lend=True).result(timeout=60) is True
    assert store.engine.staging._allocated > 0
    assert np.array_equal(store.get(b"s"), strided)


def test_a_lent_torch_tensor_round_trips(store, small_chunks):
    torch = pytest.importorskip("torch")
    tensor = torch.from_numpy(small_chunks[1].copy()).view(torch.bfloat16)
    assert store.put(b"t", tensor, lend=True).result(timeout=60) is True
    out = torch.empty_like(tensor)
    assert store.get(b"t", out) is out and torch.equal(out.view(torch.int16), tensor.view(torch.int16))
    assert store.engine.staging._allocated == 0


def test_get_many_reads_memory_chunks_on_at_most_the_budgets_lanes(store, small_chunks):
    keys = [b"m%d" % i for i in range(12)]
    assert all(store.put(k, small_chunks[i % 16]).result(timeout=60) for i, k in enumerate(keys))
    assert lanes_for(store, keys) == min(len(keys), budget().limit())
    assert lanes_for(store, keys[:1]) == 1 and lanes_for(store, []) == 0
    first, crowded = store._reads.reserve_lanes(keys)  # a batch reading meanwhile leaves fewer lanes to the next
    assert not crowded
    second, crowded = store._reads.reserve_lanes(keys)
    assert crowded and second == max(1, budget().limit() - first)
    store._reads.release_lanes(first + second)
    outs = [np.empty_like(small_chunks[0]) for _ in keys]
    seen: set[str] = set()
    drain = store._reads.drain

    def spy(*args, **kwargs):  # the real drain, noting which threads ran lanes
        seen.add(threading.current_thread().name)
        return drain(*args, **kwargs)

    store._reads.drain = spy
    try:
        results = store.get_many(keys, outs)
    finally:
        del store._reads.drain
    assert len(seen) == min(len(keys), budget().limit())
    for i, (got, out) in enumerate(zip(results, outs)):
        assert got is out and np.array_equal(out, small_chunks[i % 16])


def test_get_many_overlaps_device_reads_with_decodes(tmp_path, shm_name, small_chunks):
    # a DRAM tier of one chunk: the rest are demoted to the SSD, whose reads wait on a device
    size = small_chunks[0].nbytes
    with TieredStore.from_config(config(tmp_path, shm_name, dram=size + MiB, read_workers=3)) as store:
        keys = [b"d%d" % i for i in range(8)]
        for i, k in enumerate(keys):
            assert store.put(k, small_chunks[i]).result(timeout=60)
        store.flush()
        assert store.where(keys[0]) == "ssd"
        # the budget's tokens and one read ahead, at most read_workers + the caller
        assert lanes_for(store, keys) == min(budget().limit() + 1, 4)
        results = store.get_many(keys, [np.empty_like(small_chunks[0]) for _ in keys])
        for i, got in enumerate(results):
            assert np.array_equal(got, small_chunks[i])


def test_concurrent_get_many_share_the_lanes_and_stay_bit_exact(store, small_chunks):
    keys = [b"c%d" % i for i in range(16)]
    assert all(store.put(k, small_chunks[i]).result(timeout=60) for i, k in enumerate(keys))

    def read(part: int) -> bool:
        mine = keys[part * 4:(part + 1) * 4]
        outs = [np.empty_like(small_chunks[0]) for _ in mine]
        for _ in range(5):
            got = store.get_many(mine, outs)
            if not all(np.array_equal(g, small_chunks[part * 4 + j]) for j, g in enumerate(got)):
                return False
        return True

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(read, range(4)))
    assert store._reads.lanes_busy == 0


def test_a_failing_lane_is_waited_for_and_its_error_raised(store, small_chunks):
    keys = [b"f%d" % i for i in range(4)]
    assert all(store.put(k, small_chunks[i]).result(timeout=60) for i, k in enumerate(keys))
    outs = [np.empty_like(small_chunks[0]) for _ in keys]
    outs[3] = np.empty(7, dtype=np.uint8)  # a buffer of the wrong size fails that chunk's decode
    with pytest.raises((ValueError, TypeError)):
        store.get_many(keys, outs)
    assert store._reads.lanes_busy == 0  # every lane had stopped before get_many raised


def test_the_shipped_ssd_tier_does_not_fsync_each_put():
    ssd = [t for t in StoreConfig.load(default_store_path()).tiers if t.kind == "ssd"]
    assert ssd and not any(t.fsync for t in ssd)
    assert "Durability, priced like a cache" in ssd_module.__doc__


def test_sync_filesystem_flushes_a_real_file_system_and_reports_errors(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _sync_filesystem(fd)
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        _sync_filesystem(fd)  # closed: EBADF


@pytest.mark.parametrize("fsync", [False, True])
def test_chunks_put_without_fsync_survive_a_clean_close(tmp_path, shm_name, small_chunks, fsync):
    size = small_chunks[0].nbytes
    cfg = config(tmp_path, shm_name, dram=size + MiB, fsync=fsync)
    with TieredStore.from_config(cfg) as store:
        for i in range(5):
            assert store.put(b"p%d" % i, small_chunks[i]).result(timeout=60)
    assert (tmp_path / "ssd" / "CLEAN").exists()
    with TieredStore.from_config(cfg) as store:
        assert store.tiers[1].clean_start
        for i in range(5):
            assert np.array_equal(store.get(b"p%d" % i), small_chunks[i])


def test_puts_without_fsync_survive_kill_9_and_nothing_torn_is_served(tmp_path, small_chunks):
    """The shipped durability (fsync: false): a put reported durable is in the page cache,
    which outlives the process; the crash makes the next open rescan."""
    chunks_file = tmp_path / "chunks.npy"
    np.save(chunks_file, np.stack(small_chunks))
    cfg = {"engine": {"put_workers": 2},
           "tiers": [{"kind": "ssd", "capacity": 1 << 30, "path": str(tmp_path / "ssd"), "fsync": False}]}
    writer = subprocess.Popen([sys.executable, "-c", WRITER, json.dumps(cfg), str(chunks_file)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    durable = []
    try:
        while len(durable) < 12:
            line = writer.stdout.readline()
            assert line, writer.stderr.read()
            durable.append(int(line))
        time.sleep(0.02)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    with TieredStore.from_config(cfg) as store:
        assert store.tiers[0].clean_start is False
        for i in range(max(durable) + 50):
            got = store.get(b"k%d" % i)
            assert got is None or np.array_equal(got, small_chunks[i % 16]), i
        assert all(store.contains(b"k%d" % i) for i in durable)
        assert store.stats()["tiers"]["ssd"]["quarantined"] == 0
    assert list((tmp_path / "ssd" / "tmp").iterdir()) == []
