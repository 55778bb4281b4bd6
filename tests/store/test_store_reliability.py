"""Reliability with real processes, files and servers: kill -9 mid-write, corrupt bytes, full disk,
Redis outage, hostile keys."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvshrink.store import TieredStore

MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]


def ssd_only(path: Path, capacity: int = 1 << 30) -> dict:
    return {"tiers": [{"kind": "ssd", "capacity": capacity, "path": str(path)}]}


def run_child(script: str, *args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, **kwargs)


# A writer that streams puts of real chunks (key k<i> holds chunk i % 16) and reports each durable one.
WRITER = """
import sys, json, numpy as np
from kvshrink.store import TieredStore
chunks = np.load(sys.argv[2])
cfg = json.loads(sys.argv[1])
store = TieredStore.from_config(cfg)
i = 0
while True:
    future = store.put(b"k%d" % i, chunks[i % len(chunks)])
    if future.result():
        print(i, flush=True)
    i += 1
"""


LAYOUTS = {
    # DRAM arena (survives the process) in front of SSD with write-back; evictions demote first
    "dram+ssd": lambda tmp, shm: [{"kind": "dram", "capacity": 6 * MiB, "shm_name": shm, "codec": "raw"},
                                  {"kind": "ssd", "capacity": 1 << 30, "path": str(tmp / "ssd"), "write_back": True}],
    # puts land on the SSD itself: temp file, fsync, rename
    "ssd": lambda tmp, shm: [{"kind": "ssd", "capacity": 1 << 30, "path": str(tmp / "ssd"), "fsync": True}],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kill_after", [3, 11, 25])
def test_kill_9_during_writes_never_serves_a_torn_chunk(tmp_path, shm_name, small_chunks, kill_after, layout):
    chunks_file = tmp_path / "chunks.npy"
    np.save(chunks_file, np.stack(small_chunks))
    cfg = {"engine": {"put_workers": 2}, "tiers": LAYOUTS[layout](tmp_path, shm_name)}
    writer = subprocess.Popen([sys.executable, "-c", WRITER, json.dumps(cfg), str(chunks_file)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    durable = []
    try:
        while len(durable) < kill_after:
            line = writer.stdout.readline()
            assert line, writer.stderr.read()
            durable.append(int(line))
        time.sleep(0.003 * kill_after)  # land the kill somewhere else each time
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    last = max(durable) + 50
    with TieredStore.from_config(cfg) as store:
        served = 0
        for i in range(last):
            got = store.get(b"k%d" % i)
            if got is not None:
                assert np.array_equal(got, small_chunks[i % 16]), f"chunk k{i} is not bit-exact"
                served += 1
        for i in durable:  # every put reported durable survived the kill (DRAM arena or SSD)
            assert store.contains(b"k%d" % i), i
        assert served >= len(durable)
        assert store.stats()["tiers"]["ssd"]["quarantined"] == 0
        assert store.tiers[-1].clean_start is False  # a crash: the index is checked against the files
    assert list((tmp_path / "ssd" / "tmp").iterdir()) == []


def test_corrupt_file_is_a_miss_quarantined_and_the_store_keeps_working(tmp_path, real_chunks):
    with TieredStore.from_config(ssd_only(tmp_path / "ssd")) as store:
        for i in range(3):
            store.put(b"k%d" % i, real_chunks[i]).result(timeout=60)
        path = store.tiers[0].path_for(b"k1")
        with open(path, "r+b") as f:
            f.seek(path.stat().st_size // 2)
            f.write(b"\x00\xff" * 8)
        assert store.get_many([b"k0", b"k1", b"k2"])[1] is None
        stats = store.stats()["tiers"]["ssd"]
        assert stats["quarantined"] == 1 and stats["quarantine_files"] == 1
        assert np.array_equal(store.get(b"k0"), real_chunks[0])
        assert store.put(b"k3", real_chunks[3]).result(timeout=60)
        assert np.array_equal(store.get(b"k3"), real_chunks[3])
    with TieredStore.from_config(ssd_only(tmp_path / "ssd")) as store:  # the quarantine is remembered
        assert not store.contains(b"k1") and store.contains(b"k0")


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); the RLIMIT_FSIZE test covers it")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_counts_errors_and_damages_nothing(small_tmpfs, real_chunks):
    cfg = ssd_only(small_tmpfs / "ssd")
    stored = {}
    with TieredStore.from_config(cfg) as store:
        for i in range(16):  # ~4 MB compressed each into 24 MB: the disk fills up
            ok = False
            try:
                ok = store.put(b"k%d" % i, real_chunks[i % 8]).result(timeout=60)
            except OSError:
                pass
            if ok:
                stored[i] = real_chunks[i % 8]
        stats = store.stats()
        assert 0 < len(stored) < 16
        assert stats["tiers"]["ssd"]["errors"] >= 16 - len(stored) and stats["engine"]["put_errors"] >= 1
        for i, chunk in stored.items():
            assert np.array_equal(store.get(b"k%d" % i), chunk)
        assert list((small_tmpfs / "ssd" / "tmp").iterdir()) == []
    with TieredStore.from_config(cfg) as store:
        assert sorted(store.keys()) == sorted(b"k%d" % i for i in stored)
        for i, chunk in stored.items():
            assert np.array_equal(store.get(b"k%d" % i), chunk)


FSIZE_WRITER = """
import json, resource, signal, sys
import numpy as np
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # get EFBIG instead of being killed
small, big = np.load(sys.argv[2]), np.load(sys.argv[3])
limit = int(sys.argv[4])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from kvshrink.store import TieredStore
store = TieredStore.from_config(json.loads(sys.argv[1]))
report = {"small": [], "big": []}
for i in range(len(small)):
    report["small"].append(store.put(b"s%d" % i, small[i]).result())
for i in range(len(big)):
    try:
        report["big"].append(store.put(b"b%d" % i, big[i]).result())
    except Exception as exc:
        report["big"].append(type(exc).__name__)
report["reads"] = [bool(np.array_equal(store.get(b"s%d" % i), small[i])) for i in range(len(small))]
report["stats"] = store.stats()["tiers"]["ssd"]
store.close()
print(json.dumps(report))
"""


def test_file_size_limit_refuses_big_chunks_and_keeps_small_ones(tmp_path, small_chunks, real_chunks):
    np.save(tmp_path / "small.npy", np.stack(small_chunks[:4]))
    np.save(tmp_path / "big.npy", np.stack(real_chunks[:3]))
    cfg = ssd_only(tmp_path / "ssd")
    done = run_child(FSIZE_WRITER, json.dumps(cfg), str(tmp_path / "small.npy"), str(tmp_path / "big.npy"),
                     str(2 * MiB))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["small"] == [True] * 4 and report["reads"] == [True] * 4
    assert report["big"] == ["StoreUnavailableError"] * 3
    assert report["stats"]["errors"] == 3 and report["stats"]["chunks"] == 4
    with TieredStore.from_config(cfg) as store:
        assert sorted(store.keys()) == [b"s%d" % i for i in range(4)]
        for i in range(4):
            assert np.array_equal(store.get(b"s%d" % i), small_chunks[i])


def test_redis_killed_and_restarted_mid_run(redis_server, shm_name, small_chunks):
    cfg = {"tiers": [{"kind": "dram", "capacity": int(small_chunks[0].nbytes * 2.5), "shm_name": shm_name,
                      "codec": "raw"},
                     {"kind": "redis", "url": redis_server.url, "timeout_s": 0.3, "write_back": True,
                      "namespace": "midrun"}],
           "promote_on_hit": False}
    keys = [b"k%d" % i for i in range(8)]
    with TieredStore.from_config(cfg) as store:
        for key, chunk in zip(keys, small_chunks):
            assert store.put(key, chunk).result(timeout=60)
        store.flush(timeout=60)
        assert all(store.tiers[1].contains(k) for k in keys)
        redis_server.kill()
        during = store.get_many(keys)  # no exception: DRAM hits, Redis misses
        in_dram = [store.tiers[0].contains(k) for k in keys]
        assert [g is not None for g in during] == in_dram and not all(in_dram)
        assert store.get(keys[0]) is None or in_dram[0]
        assert store.put(b"during", small_chunks[9]).result(timeout=60)  # DRAM still takes puts
        store.flush(timeout=60)
        stats = store.stats()
        assert stats["tiers"]["redis"]["errors"] > 0 and stats["engine"]["background_errors"] >= 1
        in_dram = [store.tiers[0].contains(k) for k in keys]  # "during" evicted one of them
        assert store.lock(keys) == in_dram  # lookups answer from what is reachable
        store.unlock(keys)
        assert set(store.keys()) == {k for k, here in zip(keys, in_dram) if here} | {b"during"}
        redis_server.start()
        after = store.get_many(keys)
        assert all(np.array_equal(a, c) for a, c in zip(after, small_chunks))
        assert store.contains_many(keys) == [True] * len(keys)


def test_hostile_keys_cannot_escape_the_directory(tmp_path, small_chunks):
    base = tmp_path / "area"
    base.mkdir()
    sentinel = tmp_path / "sentinel"
    sentinel.write_bytes(b"untouched")
    keys = [b"../sentinel", b"../../sentinel", str(sentinel).encode(), b"ssd/../../sentinel", b"/" + b"../" * 40,
            b"\x00../sentinel"]
    with TieredStore.from_config(ssd_only(base / "ssd")) as store:
        for key in keys:
            assert store.put(key, small_chunks[0]).result(timeout=60)
        for key in keys:
            assert np.array_equal(store.get(key), small_chunks[0])
    assert sentinel.read_bytes() == b"untouched"
    outside = {p for p in tmp_path.rglob("*")} - {p for p in base.rglob("*")} - {base}
    assert outside == {sentinel}
    assert os.listdir(base) == ["ssd"]
