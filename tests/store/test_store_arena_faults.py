"""The DRAM arena under faults of its medium: a /dev/shm too small for it (private mount namespace
with a small tmpfs), and damaged bytes in the arena file (headers, superblock, truncation)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvshrink.errors import StoreUnavailableError
from kvshrink.store import TieredStore
from kvshrink.store.arena import MIN_BLOCK, SUPERBLOCK, Arena
from kvshrink.store.config import TierConfig
from kvshrink.store.dram import SHM_DIR, DramTier

KiB, MiB = 2**10, 2**20
# header fields (kvshrink/store/arena.py): magic 0, state 4, size 8, frame_len 16, seq 24, key_len 32, crc 36
STATE, SIZE, FRAME_LEN, KEY_LEN, CRC = 4, 8, 16, 32, 36
COMMITTED = 2


# -- a /dev/shm smaller than the tier ---------------------------------------------------------------
def run_with_small_shm(script: str, size: str) -> subprocess.CompletedProcess:
    """Run ``script`` in a child process whose /dev/shm is a private ``size`` tmpfs (a private
    mount namespace: the host's /dev/shm is untouched); afterwards the child prints what that
    tmpfs holds as its last line."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"this machine refuses a private mount namespace with a tmpfs: {probe.stderr.strip()}")
    shell = (f'mount -t tmpfs -o size={size} tmpfs /dev/shm || exit 99; "$0" -c "$1"; rc=$?; '
             'echo "shm: $(ls -A /dev/shm | tr "\\n" " ")"; exit $rc')
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", shell, sys.executable, script],
                          capture_output=True, text=True, timeout=120)


OPEN_AND_FILL = """
import json, os, sys
import numpy as np
from kvshrink.errors import StoreUnavailableError
from kvshrink.store import TieredStore
store_config = {{"tiers": [{{"kind": "dram", "capacity": {capacity}, "compressed": False, "put": True,
                            "shm_name": "kvshrink-faults"}}]}}
try:
    store = TieredStore.from_config(store_config)
except StoreUnavailableError as exc:
    print("refused:", exc)
    sys.exit(3)
st = os.stat("/dev/shm/kvshrink-faults")
chunks = [np.full(1 << 20, i, np.uint8) for i in range(12)]  # 12 MiB of puts
done = [store.put(b"k%d" % i, c).result(timeout=60) for i, c in enumerate(chunks)]
back = [store.get(b"k%d" % i) for i in range(12)]
print(json.dumps({{"allocated": st.st_blocks * 512, "size": st.st_size, "done": done,
                  "exact": [g is not None and bool(np.array_equal(g, c)) for g, c in zip(back, chunks)],
                  "evictions": store.stats()["tiers"]["dram"]["evictions"]}}))
store.close()
"""


def test_tier_larger_than_shm_is_refused_at_open_not_killed_by_sigbus():
    """64 MiB on an 8 MiB tmpfs: before the fix the child died of SIGBUS after a few puts."""
    done = run_with_small_shm(OPEN_AND_FILL.format(capacity=64 * MiB), "8m")
    assert done.returncode == 3, f"rc={done.returncode} (135: killed by SIGBUS)\n{done.stdout}\n{done.stderr}"
    refused = next(line for line in done.stdout.splitlines() if line.startswith("refused:"))
    assert "StoreUnavailableError" not in refused  # the message itself, not a traceback
    assert "tier dram: arena /dev/shm/kvshrink-faults" in refused
    assert f"cannot reserve {64 * MiB} bytes (64.0 MiB)" in refused
    assert f"{8 * MiB} bytes (8.0 MiB) free" in refused
    assert done.stdout.splitlines()[-1].strip() == "shm:"  # no half-created arena left behind


def test_tier_that_fits_is_reserved_up_front_and_works():
    done = run_with_small_shm(OPEN_AND_FILL.format(capacity=6 * MiB), "8m")
    assert done.returncode == 0, f"rc={done.returncode}\n{done.stdout}\n{done.stderr}"
    report = json.loads(done.stdout.splitlines()[-2])
    assert report["size"] == 6 * MiB and report["allocated"] >= 6 * MiB  # every page held from the start
    assert all(report["done"]) and report["evictions"] >= 6  # 12 MiB through a 6 MiB tier
    assert report["exact"][-4:] == [True] * 4
    assert done.stdout.splitlines()[-1].split() == ["shm:", "kvshrink-faults"]


REGROW = """
import os
from kvshrink.errors import StoreUnavailableError
from kvshrink.store.config import TierConfig
from kvshrink.store.dram import DramTier
config = TierConfig(kind="dram", name="dram", capacity=6 << 20, compressed=False, shm_name="kvshrink-faults")
path = "/dev/shm/kvshrink-faults"
tier = DramTier(config)
frames = {b"k%d" % i: bytes([i]) * 65536 for i in range(4)}
for key, frame in frames.items():
    tier.write_frame(key, frame)
tier.close()
os.truncate(path, 1 << 20)  # the arena file cut short: its chunks lie in the first 1 MiB
with open("/dev/shm/filler", "wb") as filler:  # and 4 of the 8 MiB taken by something else
    os.posix_fallocate(filler.fileno(), 0, 4 << 20)
try:
    DramTier(config)
    print("opened")
except StoreUnavailableError as exc:
    print("refused:", exc)
print("size after refusal:", os.stat(path).st_size)
os.unlink("/dev/shm/filler")
tier = DramTier(config)
print("recovered:", sorted(k.decode() for k in tier.keys()), all(tier.read_frame(k) == f for k, f in frames.items()))
"""


def test_reopening_an_arena_that_no_longer_fits_is_refused_and_leaves_it_as_it_was():
    """Attach path: an existing (truncated) arena whose pages cannot all be reserved again."""
    done = run_with_small_shm(REGROW, "8m")
    assert done.returncode == 0, f"rc={done.returncode}\n{done.stdout}\n{done.stderr}"
    lines = done.stdout.splitlines()
    assert lines[0].startswith("refused: tier dram: arena /dev/shm/kvshrink-faults: cannot reserve"), lines
    assert f"{MiB} bytes (1.0 MiB) already held by the file" in lines[0]
    assert lines[1] == f"size after refusal: {MiB}"
    assert lines[2] == "recovered: ['k0', 'k1', 'k2', 'k3'] True"


def test_second_owner_never_resizes_a_live_arena(shm_name):
    """The owner lock is taken before the file is touched: a second owner asking another
    capacity is refused and leaves the live arena (size, superblock, chunks) alone."""
    config = TierConfig(kind="dram", name="dram", capacity=4 * MiB, compressed=False, shm_name=shm_name)
    owner = DramTier(config)
    frame = _frame(1)
    owner.write_frame(b"live", frame)
    path = SHM_DIR / shm_name
    superblock = path.read_bytes()[:SUPERBLOCK]
    with pytest.raises(StoreUnavailableError, match="owned by another live process"):
        DramTier(TierConfig(kind="dram", name="dram", capacity=MiB, compressed=False, shm_name=shm_name))
    assert path.stat().st_size == 4 * MiB and path.read_bytes()[:SUPERBLOCK] == superblock
    assert owner.read_frame(b"live") == frame
    owner.destroy()


def test_reader_refuses_an_arena_with_holes(shm_name):
    """A sparse file (no owner reserved it): mapping it and reading a hole of a full tmpfs would
    SIGBUS, so a reader refuses it by name."""
    path = SHM_DIR / shm_name
    with open(path, "wb") as f:
        f.truncate(4 * MiB)
    config = TierConfig(kind="dram", name="dram", capacity=4 * MiB, compressed=False, shm_name=shm_name)
    with pytest.raises(StoreUnavailableError, match=f"tier dram: arena {path} is not fully allocated"):
        DramTier(config, readonly=True)


# -- damaged arena files ----------------------------------------------------------------------------
CHUNKS = 8  # stored before the damage; all fit in the tier


def _chunk(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 2**16, size=(2, 4, 32, 64), dtype=np.uint16)  # 32 KiB


def _frame(i: int) -> bytes:
    from kvshrink.codec import encode

    return encode(_chunk(i), method="raw")


def _store_config(shm_name: str, tmp_path: Path) -> dict:
    return {"promote_on_hit": True,
            "tiers": [{"kind": "dram", "name": "dram", "capacity": 512 * KiB, "compressed": False, "put": True,
                       "shm_name": shm_name},
                      {"kind": "ssd", "name": "ssd", "path": str(tmp_path / "ssd"), "capacity": "64MiB"}]}


def _poke(path: Path, offset: int, fmt: str, value: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))


def _damage(path: Path, how: str, blocks: list) -> set[int]:
    """Damage the arena file; return the indexes of the chunks that must survive."""
    b3, tail = blocks[3], blocks[-1].offset + blocks[-1].size  # tail: the free block after the chunks
    everything, but_3 = set(range(CHUNKS)), set(range(CHUNKS)) - {3}
    if how == "free block marked committed":
        _poke(path, tail + STATE, "<I", COMMITTED)
        return everything
    if how == "free block with a garbage size":
        _poke(path, tail + SIZE, "<Q", 8 * KiB)
        return everything
    if how == "wrong crc":
        _poke(path, b3.offset + CRC, "<I", 0xDEADBEEF)
        return but_3
    if how.startswith("size "):
        size = {"size huge": 2**40, "size small": MIN_BLOCK, "size swallows the next": b3.size + blocks[4].size}[how]
        _poke(path, b3.offset + SIZE, "<Q", size)
        return but_3
    if how.startswith("frame_len "):
        _poke(path, b3.offset + FRAME_LEN, "<Q", 2**50 if how.endswith("huge") else b3.frame_len - 64)
        return but_3
    if how.startswith("key_len "):
        _poke(path, b3.offset + KEY_LEN, "<I", {"key_len 0": 0, "key_len huge": 2**31}[how])
        return but_3
    if how == "header overwritten":
        with open(path, "r+b") as f:
            f.seek(b3.offset)
            f.write(b"\xff" * 64)
        return but_3
    if how == "truncated":
        os.truncate(path, blocks[5].offset + 100)  # inside chunk 5: 0..4 are whole
        return set(range(5))
    if how == "superblock zeroed":
        with open(path, "r+b") as f:
            f.write(bytes(SUPERBLOCK))
        return everything
    raise AssertionError(how)


DAMAGE = ["free block marked committed", "free block with a garbage size", "wrong crc", "size huge", "size small",
          "size swallows the next", "frame_len huge", "frame_len short", "key_len 0", "key_len huge",
          "header overwritten", "truncated", "superblock zeroed"]


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_arena_is_recovered_around_the_damage(shm_name, tmp_path, how):
    config = _store_config(shm_name, tmp_path)
    keys = [b"chunk-%d" % i for i in range(CHUNKS)]
    with TieredStore.from_config(config) as store:
        assert all(store.put(k, _chunk(i)).result(timeout=60) for i, k in enumerate(keys))
        assert store.tiers[0].keys() == keys and store.tiers[0].counters["evictions"] == 0
    path = SHM_DIR / shm_name
    reader = Arena(path, 0, readonly=True)
    blocks = sorted(reader.scan(), key=lambda b: b.offset)
    reader.close()
    survivors = [keys[i] for i in sorted(_damage(path, how, blocks))]

    # a reader attaching to the damaged file sees only intact chunks, and never writes
    damaged = path.read_bytes()
    view = DramTier(TierConfig(kind="dram", name="dram", capacity=0, compressed=False, shm_name=shm_name),
                    readonly=True)
    assert view.keys() == survivors
    assert all(np.array_equal(view.get(k), _chunk(keys.index(k))) for k in survivors)
    view.close()
    assert path.read_bytes() == damaged

    with TieredStore.from_config(config) as store:
        dram = store.tiers[0]
        assert dram.keys() == survivors  # no b"" and no garbage key listed
        assert dram.counters["quarantined"] >= 1
        assert all(np.array_equal(dram.get(k), _chunk(keys.index(k))) for k in survivors)  # bit-exact, from DRAM
        # later puts evict everything that was there (damaged space included): none fails
        new = [b"new-%d" % i for i in range(24)]
        assert all(store.put(k, _chunk(100 + i)).result(timeout=60) for i, k in enumerate(new))
        assert dram.counters["evictions"] >= len(survivors) and dram.counters["errors"] == 0
        assert store.engine.counters["put_errors"] == 0
        store.flush(timeout=60)
        assert all(np.array_equal(store.get(k), _chunk(100 + i)) for i, k in enumerate(new))
        assert all(store.get(k) is not None for k in survivors)  # demoted to the SSD, not lost
        assert b"" not in store.keys()
        store.flush(timeout=60)  # promotions of the survivors read back from the SSD
        held = set(dram.keys())
    with TieredStore.from_config(config) as store:  # the repair held: a clean reopen
        assert set(store.tiers[0].keys()) == held and store.tiers[0].counters["quarantined"] == 0


def test_superblock_of_another_layout_starts_an_empty_arena(shm_name, tmp_path):
    """Not damage but a different format: nothing in it is interpreted; the arena starts over."""
    config = _store_config(shm_name, tmp_path)
    with TieredStore.from_config(config) as store:
        assert store.put(b"old", _chunk(0)).result(timeout=60)
    _poke(SHM_DIR / shm_name, 8, "<I", 99)  # the superblock's version
    with TieredStore.from_config(config) as store:
        dram = store.tiers[0]
        assert dram.keys() == [] and dram.counters["quarantined"] == 0
        assert store.put(b"new", _chunk(1)).result(timeout=60)
        assert np.array_equal(dram.get(b"new"), _chunk(1))


def test_header_damaged_while_in_use_is_counted_when_freed(shm_name):
    """The owner frees by the size it indexed, not by what the file says now: a header
    scribbled on while the arena is open is counted, rewritten, and the heap stays sound."""
    config = TierConfig(kind="dram", name="dram", capacity=512 * KiB, compressed=False, shm_name=shm_name)
    tier = DramTier(config)
    keys = [b"k%d" % i for i in range(4)]
    for i, key in enumerate(keys):
        tier.write_frame(key, _frame(i))
    victim = tier._blocks[b"k1"]
    _poke(tier.path, victim.offset + SIZE, "<Q", 2**40)
    assert tier.delete(b"k1")
    assert tier.counters["quarantined"] == 1
    for i in range(4, 30):  # wraps the arena: reuses the freed block and evicts the rest
        tier.write_frame(b"k%d" % i, _frame(i))
    held = tier.keys()
    tier.close()
    again = DramTier(config)
    assert again.keys() == held and again.counters["quarantined"] == 0
    assert all(again.read_frame(k) == _frame(int(k[1:])) for k in held)
    again.destroy()


CHURN = """
import sys
import numpy as np
from kvshrink.codec import encode
from kvshrink.store.config import TierConfig
from kvshrink.store.dram import DramTier
tier = DramTier(TierConfig(kind="dram", name="dram", capacity=256 * 1024, compressed=False, shm_name={shm!r}))
frames = [encode(np.random.default_rng(i).integers(0, 2**16, size=(2, 4, 32, 64), dtype=np.uint16), method="raw")
          for i in range(16)]
print("ready", flush=True)
for n in range(10**9):  # puts with evictions, overwrites and deletes until killed
    tier.write_frame(b"k%d" % (n % 16), frames[n % 16])
    if n % 5 == 0:
        tier.delete(b"k%d" % ((n * 7) % 16))
"""


@pytest.mark.parametrize("round_", range(3))
def test_kill_9_mid_churn_leaves_an_arena_that_opens_clean(shm_name, round_):
    """The free path now rewrites headers: a SIGKILL at any point of puts, evictions and deletes
    must still leave only sound headers and whole chunks."""
    proc = subprocess.Popen([sys.executable, "-c", CHURN.format(shm=shm_name)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        import time

        time.sleep(0.05 + 0.1 * round_)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    tier = DramTier(TierConfig(kind="dram", name="dram", capacity=256 * KiB, compressed=False, shm_name=shm_name))
    held = tier.keys()
    assert held and all(k.startswith(b"k") for k in held)
    assert tier.counters["quarantined"] == 0
    assert all(np.array_equal(tier.get(k), _chunk(int(k[1:]))) for k in held)
    tier.destroy()


def test_header_torn_by_a_crash_is_reclaimed_without_counting_damage(shm_name):
    """The same bytes as "free block with a garbage size", but the superblock notes that this
    header was being rewritten when the owner died: reclaimed like damage, not counted as such."""
    config = TierConfig(kind="dram", name="dram", capacity=512 * KiB, compressed=False, shm_name=shm_name)
    tier = DramTier(config)
    keys = [b"k%d" % i for i in range(4)]
    for i, key in enumerate(keys):
        tier.write_frame(key, _frame(i))
    last = max(tier._blocks.values(), key=lambda b: b.offset)
    tier.close()
    tail = last.offset + last.size
    _poke(SHM_DIR / shm_name, 24, "<Q", tail + 1)  # superblock: "rewriting the header at tail"
    _poke(SHM_DIR / shm_name, tail + SIZE, "<Q", 8 * KiB)  # ... and the size store landed, the CRC did not
    again = DramTier(config)
    assert again.keys() == keys and again.counters["quarantined"] == 0
    assert again._arena.largest_free() == again.capacity_bytes - (tail - SUPERBLOCK)  # the tail is free again
    again.write_frame(b"k4", _frame(4))
    assert all(again.read_frame(k) == _frame(int(k[1:])) for k in keys + [b"k4"])
    again.destroy()
