"""A damaged SSD index never orphans intact chunks, and one live process owns a directory.

Every test runs on real files: the tier is closed cleanly (the CLEAN marker is there), then its
index is deleted, replaced by an older copy, truncated or corrupted, or chunk files are changed by
hand; the reopened tier must find every intact chunk again, bit-exact, and serve no damaged one.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvshrink.codec import encode
from kvshrink.errors import StoreUnavailableError
from kvshrink.store.config import TierConfig
from kvshrink.store.ssd import SsdTier
from tier_contract import put

N = 12


@pytest.fixture
def chunks(small_chunks) -> list[np.ndarray]:
    """N distinct real KV chunks of 8 tokens (~180 KB each): quick to encode."""
    return [np.ascontiguousarray(small_chunks[i % len(small_chunks)][:, :, i // 2 : i // 2 + 8]) for i in range(N)]


def config(path: Path) -> TierConfig:
    return TierConfig(kind="ssd", name="ssd", capacity=1 << 30, compressed=True, path=str(path), fsync=False)


def key(i: int) -> bytes:
    return b"chunk-%02d" % i


def reopened(path: Path) -> SsdTier:
    """Open the tier and wait for any background rescan to finish."""
    tier = SsdTier(config(path))
    if tier._reconciler.is_alive():
        tier._reconciler.join(timeout=30)
    return tier


def assert_holds_exactly(tier: SsdTier, expected: dict[bytes, np.ndarray]) -> None:
    assert sorted(tier.keys()) == sorted(expected)
    for k, chunk in expected.items():
        got = tier.get(k)
        assert got is not None and got.dtype == chunk.dtype and np.array_equal(got, chunk), k


def flip(path: Path, offset: int, count: int = 8) -> None:
    data = bytearray(path.read_bytes())
    for i in range(offset, min(offset + count, len(data))):
        data[i] ^= 0xA5
    path.write_bytes(bytes(data))


def older_copy(tier: SsdTier, path: Path, chunks: list[np.ndarray]) -> dict[bytes, np.ndarray]:
    """Copy the index after half the puts; then put the rest, delete two early chunks (the old
    copy still names them) and rewrite one (its old size is stale in the copy)."""
    index = path / "index.log"
    for i in range(N // 2):
        put(tier, key(i), chunks[i])
    saved = index.read_bytes()
    for i in range(N // 2, N):
        put(tier, key(i), chunks[i])
    assert tier.delete(key(0)) and tier.delete(key(1))
    put(tier, key(2), chunks[N - 1])
    tier.close()
    index.write_bytes(saved)
    return {key(i): chunks[N - 1] if i == 2 else chunks[i] for i in range(2, N)}


DAMAGES = {
    "deleted": lambda index: index.unlink(),
    "truncated to half": lambda index: os.truncate(index, index.stat().st_size // 2),
    "truncated mid-header": lambda index: os.truncate(index, 7),
    "emptied": lambda index: os.truncate(index, 0),
    "flipped header": lambda index: flip(index, 0),
    "flipped sizes": lambda index: flip(index, 40),
    "flipped keys": lambda index: flip(index, index.stat().st_size // 2),
    "flipped last byte": lambda index: flip(index, index.stat().st_size - 1, 1),
}


@pytest.mark.parametrize("damage", list(DAMAGES) + ["older copy restored"])
def test_damaged_index_after_a_clean_close_finds_every_intact_chunk(tmp_path, chunks, damage):
    path = tmp_path / "ssd"
    tier = SsdTier(config(path))
    if damage == "older copy restored":
        expected = older_copy(tier, path, chunks)
    else:
        for i in range(N):
            put(tier, key(i), chunks[i])
        tier.close()
        expected = {key(i): chunks[i] for i in range(N)}
    assert (path / "CLEAN").exists()  # the case that used to trust the index blindly
    if damage in DAMAGES:
        DAMAGES[damage](path / "index.log")
    tier = reopened(path)
    try:
        assert not tier.clean_start
        assert_holds_exactly(tier, expected)
    finally:
        tier.close()
    again = reopened(path)  # the rebuilt index is complete: a clean start, nothing lost
    try:
        assert again.clean_start
        assert_holds_exactly(again, expected)
    finally:
        again.close()


def test_damaged_chunks_are_never_served_after_a_rescan(tmp_path, chunks):
    """Index deleted and two chunk files damaged (one body, one header) while closed: the rescan
    adopts the intact ones; the damaged ones are misses and land in quarantine/."""
    path = tmp_path / "ssd"
    tier = SsdTier(config(path))
    for i in range(N):
        put(tier, key(i), chunks[i])
    body, header = tier.path_for(key(3)), tier.path_for(key(4))
    tier.close()
    (path / "index.log").unlink()
    flip(body, body.stat().st_size // 2, 64)
    flip(header, 0, 4)
    tier = reopened(path)
    try:
        assert tier.get(key(3)) is None and tier.get(key(4)) is None
        intact = {key(i): chunks[i] for i in range(N) if i not in (3, 4)}
        assert_holds_exactly(tier, intact)
        assert len(list(tier.quarantine_dir.iterdir())) == 2
    finally:
        tier.close()


def test_healthy_reopen_trusts_the_index_and_skips_the_scan(tmp_path, chunks):
    path = tmp_path / "ssd"
    tier = SsdTier(config(path))
    for i in range(4):
        put(tier, key(i), chunks[i])
    tier.close()
    tier = SsdTier(config(path))
    try:
        assert tier.clean_start and not tier._reconciler.is_alive()
        assert_holds_exactly(tier, {key(i): chunks[i] for i in range(4)})
    finally:
        tier.close()


def test_chunk_files_changed_by_hand_while_closed_are_noticed(tmp_path, chunks):
    """A chunk file restored from another directory is adopted; one deleted by hand is dropped.
    (The check is the directories' mtimes: wait out the file system's timestamp tick first.)"""
    other = tmp_path / "other"
    donor = SsdTier(config(other))
    put(donor, key(9), chunks[9])
    donor.close()
    path = tmp_path / "ssd"
    tier = SsdTier(config(path))
    for i in range(3):
        put(tier, key(i), chunks[i])
    gone, restored = tier.path_for(key(1)), tier.path_for(key(9))
    tier.close()
    time.sleep(0.05)
    gone.unlink()
    restored.parent.mkdir(exist_ok=True)
    shutil.copyfile(donor.path_for(key(9)), restored)
    tier = reopened(path)
    try:
        assert not tier.clean_start
        assert_holds_exactly(tier, {key(0): chunks[0], key(2): chunks[2], key(9): chunks[9]})
    finally:
        tier.close()


FAILING_INDEX = """
import resource, signal, sys
import numpy as np
from kvshrink.codec import encode
from kvshrink.store.config import TierConfig
from kvshrink.store.ssd import SsdTier
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # EFBIG instead of being killed
tier = SsdTier(TierConfig(kind="ssd", name="ssd", capacity=1 << 30, compressed=True, path=sys.argv[1], fsync=False))
frame = encode(np.arange(16, dtype=np.uint16))
index_size = (tier.root / "index.log").stat().st_size
_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (index_size + 10, hard))
tier.write_frame(b"late", frame)   # the chunk file fits; its index record does not
assert tier.counters.snapshot()["errors"] >= 1, tier.counters.snapshot()
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
tier.close()
"""


def test_a_failed_index_append_makes_the_next_open_rescan(tmp_path):
    """A chunk renamed into place whose index record could not be written (file size limit) is
    adopted at the next open, although that tier was closed cleanly afterwards."""
    path = tmp_path / "ssd"
    tier = SsdTier(config(path))
    early = np.arange(64, dtype=np.uint16).reshape(4, 16)
    for i in range(40):  # an index larger than one tiny chunk file
        tier.write_frame(key(i), encode(early + i))
    tier.close()
    assert (path / "index.log").stat().st_size > tier.path_for(key(0)).stat().st_size + 100
    done = subprocess.run([sys.executable, "-c", FAILING_INDEX, str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (path / "CLEAN").exists() is False  # that close knew its index was incomplete
    tier = reopened(path)
    try:
        assert not tier.clean_start
        assert sorted(tier.keys()) == sorted([key(i) for i in range(40)] + [b"late"])
        assert np.array_equal(tier.get(b"late"), np.arange(16, dtype=np.uint16))
        assert np.array_equal(tier.get(key(39)), early + 39)
    finally:
        tier.close()


OWNER = """
import sys, time
from kvshrink.store.config import TierConfig
from kvshrink.store.ssd import SsdTier
tier = SsdTier(TierConfig(kind="ssd", name="ssd", capacity=1 << 30, compressed=True, path=sys.argv[1]))
print("owned", flush=True)
time.sleep(60)
"""


def test_a_second_process_is_refused_even_after_lock_is_deleted(tmp_path):
    path = tmp_path / "ssd"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "owned"
        assert (path / "LOCK").read_text().strip() == str(owner.pid)
        with pytest.raises(StoreUnavailableError, match=f"owned by another live process \\(pid {owner.pid}\\)"):
            SsdTier(config(path))
        (path / "LOCK").unlink()  # by hand: no longer defeats the lock
        with pytest.raises(StoreUnavailableError, match="owned by another live process"):
            SsdTier(config(path))
        (path / "LOCK").write_text("")  # deleted and recreated: still the owner's directory
        with pytest.raises(StoreUnavailableError, match="owned by another live process"):
            SsdTier(config(path))
        assert owner.poll() is None
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
        owner.stdout.close()
    tier = SsdTier(config(path))  # the kernel released the dead owner's lock
    try:
        assert not tier.clean_start  # killed: not a clean close
        assert (path / "LOCK").read_text().strip() == str(os.getpid())
    finally:
        tier.close()


def test_a_key_deleted_during_a_rescan_is_not_adopted_afterwards(tmp_path, chunks):
    """The store deletes a key's older copy below when the key is overwritten; if the rescan has
    not reached that copy's file yet, the delete must remove the file, or the rescan would adopt
    the old value later and serve it. The rescan is paused (real files, real thread) right
    before it looks at the file."""
    import threading

    donor = SsdTier(config(tmp_path / "donor"))
    put(donor, key(5), chunks[5])
    donor.close()
    tier = SsdTier(config(tmp_path / "ssd"))
    try:
        put(tier, key(0), chunks[0])
        orphan = tier.path_for(key(5))  # a file the index does not name (its record was lost)
        orphan.parent.mkdir(exist_ok=True)
        shutil.copyfile(donor.path_for(key(5)), orphan)
        reached, resume = threading.Event(), threading.Event()
        adopt = tier._adopt

        def paused_adopt(path):
            reached.set()
            assert resume.wait(30)
            return adopt(path)

        tier._adopt = paused_adopt
        scan = threading.Thread(target=tier.reconcile)
        scan.start()
        assert reached.wait(30)
        assert tier.delete(key(5)) is True  # not indexed yet, but its file was there
        assert not orphan.exists()
        resume.set()
        scan.join(30)
        assert not tier.contains(key(5)) and tier.get(key(5)) is None
        assert tier.delete(key(5)) is False  # no scan running: an unknown key is just missing
        assert_holds_exactly(tier, {key(0): chunks[0]})
    finally:
        tier.close()


def test_an_older_index_naming_a_gone_file_does_not_cost_the_only_copy(tmp_path, shm_name, small_chunks, monkeypatch):
    """An older copy of index.log put back names a chunk file that a later overwrite deleted. The
    store skips demoting a DRAM chunk that the SSD claims to hold, so until the reconcile has run
    (held back here) the SSD must not claim it: evicting the current value from DRAM must demote it."""
    from kvshrink.store import TieredStore

    cfg = {"engine": {"put_workers": 1},
           "tiers": [{"kind": "dram", "capacity": 6 << 20, "shm_name": shm_name},
                     {"kind": "ssd", "capacity": 1 << 30, "path": str(tmp_path / "ssd")}]}
    index = tmp_path / "ssd" / "index.log"

    def fill(store: TieredStore, prefix: bytes) -> None:
        for i in range(8):
            assert store.put(prefix + b"%02d" % i, small_chunks[2 + i]).result(timeout=60)

    with TieredStore.from_config(cfg) as store:
        assert store.put(b"A", small_chunks[0]).result(timeout=60)
        fill(store, b"first-")
        assert store.where(b"A") == "ssd"
    older = index.read_bytes()
    with TieredStore.from_config(cfg) as store:
        assert store.put(b"A", small_chunks[1]).result(timeout=60)  # deletes the SSD file of the old value
        assert store.where(b"A") == "dram"
    index.write_bytes(older)

    release = threading.Event()
    reconcile = SsdTier._reconcile_quietly
    monkeypatch.setattr(SsdTier, "_reconcile_quietly", lambda tier: (release.wait(60), reconcile(tier)))
    with TieredStore.from_config(cfg) as store:
        try:
            ssd = store.tiers[1]
            assert not ssd.clean_start
            fill(store, b"second-")  # evicts A from DRAM while the reconcile waits
        finally:
            release.set()
        got = store.get(b"A")
        assert got is not None and np.array_equal(got, small_chunks[1]), store.where(b"A")
        assert ssd.counters.snapshot()["quarantined"] == 0
