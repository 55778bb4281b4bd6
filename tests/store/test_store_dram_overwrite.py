"""Overwrites in a full DRAM arena: the new version lands, nothing is evicted for nothing, and a
write that really cannot fit says why (kvshrink/store/dram.py, "Making room").

Found by the randomized fault test: in a 160 KiB arena holding a (40 KiB), k (60 KiB) and b
(50 KiB), a second put of k at 60 KiB evicted a and b and then failed with "every resident chunk
is pinned", leaving the first version of k: the old copy was kept out of eviction and split the
arena into holes too small for the new one. Every test runs on a real arena in /dev/shm.
"""

from __future__ import annotations

import hashlib
import random
import re
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import numpy as np
import pytest
from tier_contract import encode_for

from kvshrink.store import TieredStore, TierFullError
from kvshrink.store.arena import SUPERBLOCK, block_size_for
from kvshrink.store.config import TierConfig
from kvshrink.store.dram import DramTier

KiB = 2**10
MiB = 2**20


@pytest.fixture
def make_tier(shm_name):
    """A DRAM tier of its own arena (``<shm_name>-<suffix>``), destroyed at teardown."""
    tiers: list[DramTier] = []

    def make(capacity: int, pinned: set[bytes] | None = None) -> DramTier:
        config = TierConfig(kind="dram", name="dram", capacity=capacity, compressed=False,
                            shm_name=f"{shm_name}-{uuid.uuid4().hex[:8]}")
        tier = DramTier(config, None if pinned is None else pinned.__contains__)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.destroy()


def chunk(kib: float, seed: int) -> np.ndarray:
    """Random bytes (no two versions alike, so a torn or stale read shows)."""
    return np.random.default_rng(seed).integers(0, 256, int(kib * KiB), dtype=np.uint8)


def put(tier: DramTier, key: bytes, data: np.ndarray, *, plan: bool = True) -> list[bytes]:
    """Write as the store does (plan, then write with the plan first); the victims' keys, which
    must be what the plan named."""
    frame = encode_for(data, tier)
    planned = tier.plan_eviction(key, len(frame)) if plan else []
    victims = tier.write_frame(key, frame, keep_victims=True, evict_first=planned)
    got = [v.key for v in victims]
    if plan:
        assert got == planned, f"plan_eviction named {planned}, write_frame evicted {got}"
    return got


def reads_back(tier: DramTier, key: bytes, data: np.ndarray) -> bool:
    got = tier.get(key)
    return got is not None and np.array_equal(got, data)


def largest_hole(tier: DramTier, freed: set[bytes], blocks: dict | None = None) -> int:
    """The largest hole the arena would have with the blocks of ``freed`` freed (of ``blocks``,
    a snapshot of the tier's index; now by default): the longest run between the blocks that
    stay (the arena tiles its file, so all else is free)."""
    blocks = tier._blocks if blocks is None else blocks
    kept = sorted((b.offset, b.size) for k, b in blocks.items() if k not in freed)
    edges = [(SUPERBLOCK, SUPERBLOCK)] + [(o, o + s) for o, s in kept] + [(tier._arena.size, tier._arena.size)]
    return max(nxt[0] - cur[1] for cur, nxt in zip(edges, edges[1:]))


# -- the reported case ------------------------------------------------------------------------------
def test_overwrite_in_a_full_arena_replaces_in_place_and_evicts_nothing(make_tier):
    tier = make_tier(160 * KiB)
    a, k1, b, k2 = chunk(40, 1), chunk(60, 2), chunk(50, 3), chunk(60, 4)
    for key, data in ((b"a", a), (b"k", k1), (b"b", b)):
        assert put(tier, key, data) == []
    assert tier._arena.largest_free() < block_size_for(1, len(encode_for(k2, tier)))  # it is full
    assert put(tier, b"k", k2) == []
    assert reads_back(tier, b"k", k2) and reads_back(tier, b"a", a) and reads_back(tier, b"b", b)
    stats = tier.stats()
    assert stats["evictions"] == 0 and stats["errors"] == 0 and stats["chunks"] == 3


def test_the_reported_case_through_the_store(shm_name):
    store = TieredStore.from_config({"tiers": [{"kind": "dram", "capacity": 160 * KiB, "shm_name": shm_name,
                                                "codec": "raw"}]})
    try:
        a, k1, b, k2 = chunk(40, 1), chunk(60, 2), chunk(50, 3), chunk(60, 4)
        for key, data in ((b"a", a), (b"k", k1), (b"b", b), (b"k", k2)):
            assert store.put(key, data).result(timeout=30) is True
        for key, data in ((b"a", a), (b"b", b), (b"k", k2)):
            assert np.array_equal(store.get(key), data), key
    finally:
        store.close()


def test_a_grown_overwrite_evicts_only_the_neighbour_that_makes_room(make_tier):
    tier = make_tier(160 * KiB)
    a, k1, b = chunk(40, 1), chunk(60, 2), chunk(50, 3)
    for key, data in ((b"a", a), (b"k", k1), (b"b", b)):
        put(tier, key, data)
    k2 = chunk(75, 4)  # old k + a make 100 KiB in one hole; b and the tail only 56
    assert put(tier, b"k", k2) == [b"a"]
    assert reads_back(tier, b"k", k2) and reads_back(tier, b"b", b)
    assert tier.stats()["evictions"] == 1


def test_an_older_chunk_that_makes_no_room_is_kept(make_tier):
    tier = make_tier(160 * KiB)
    v1, v2 = chunk(20, 1), chunk(20, 2)
    for key, data in ((b"v1", v1), (b"x", chunk(40, 3)), (b"v2", v2), (b"y", chunk(40, 4))):
        put(tier, key, data)
    tier.delete(b"x")
    tier.delete(b"y")  # [v1][40 free][v2][free to the end]
    n = chunk(90, 5)
    # v1 is the oldest, but freeing it makes a 60 KiB hole; v2 with the tail makes the room alone
    assert put(tier, b"n", n) == [b"v2"]
    assert reads_back(tier, b"v1", v1) and reads_back(tier, b"n", n)


def test_a_pinned_old_copy_is_replaced_when_nothing_else_makes_room(make_tier):
    pinned = {b"a", b"b", b"k"}
    tier = make_tier(160 * KiB, pinned)
    a, b = chunk(40, 1), chunk(50, 3)
    for key, data in ((b"a", a), (b"k", chunk(60, 2)), (b"b", b)):
        put(tier, key, data)
    k2 = chunk(60, 4)
    assert put(tier, b"k", k2) == []
    assert reads_back(tier, b"k", k2) and reads_back(tier, b"a", a) and reads_back(tier, b"b", b)


# -- when it really cannot fit --------------------------------------------------------------------
def _numbers(message: str) -> set[int]:
    return {int(n) for n in re.findall(r"\d+", message)}


def test_a_frame_larger_than_the_arena_names_both_sizes(make_tier):
    tier = make_tier(160 * KiB)
    put(tier, b"a", chunk(40, 1))
    frame = encode_for(chunk(200, 2), tier)
    with pytest.raises(TierFullError) as caught:
        tier.write_frame(b"big", frame)
    assert {len(frame), tier.capacity_bytes} <= _numbers(str(caught.value)), caught.value
    assert "capacity" in str(caught.value)
    assert tier.keys() == [b"a"] and tier.stats()["errors"] == 1 and tier.stats()["evictions"] == 0


def test_no_room_behind_pinned_chunks_evicts_nothing_and_says_why(make_tier):
    pinned = {b"a", b"b"}
    tier = make_tier(160 * KiB, pinned)
    c = chunk(30, 3)
    for key, data in ((b"a", chunk(40, 1)), (b"b", chunk(50, 2)), (b"c", c)):
        put(tier, key, data)
    frame = encode_for(chunk(80, 4), tier)
    assert tier.plan_eviction(b"d", len(frame)) == []
    with pytest.raises(TierFullError) as caught:
        tier.write_frame(b"d", frame)
    message = str(caught.value)
    pinned_bytes = tier._blocks[b"a"].size + tier._blocks[b"b"].size
    reachable = largest_hole(tier, {b"c"})
    expected = {len(frame), tier.capacity_bytes, tier._arena.largest_free(), pinned_bytes, reachable}
    assert expected <= _numbers(message), message
    assert "pinned" in message and "every resident chunk is pinned" not in message
    assert reads_back(tier, b"c", c)  # evicting c would not have made room: it stays
    assert tier.stats()["evictions"] == 0 and tier.stats()["errors"] == 1


# -- concurrent readers of the old copy -----------------------------------------------------------
def test_a_read_of_the_old_copy_in_progress_finishes_on_the_old_bytes(make_tier):
    tier = make_tier(160 * KiB)
    k1, k2 = chunk(60, 2), chunk(60, 4)
    for key, data in ((b"a", chunk(40, 1)), (b"k", k1), (b"b", chunk(50, 3))):
        put(tier, key, data)
    old = encode_for(k1, tier)
    done = threading.Event()
    writer = threading.Thread(target=lambda: (put(tier, b"k", k2, plan=False), done.set()))
    with tier._open_frame(b"k") as view:  # a read in progress holds the old block
        writer.start()
        assert not done.wait(0.3)  # the new copy needs that block: the writer waits for the read
        assert bytes(view) == old
    writer.join(10)
    assert done.is_set() and reads_back(tier, b"k", k2)
    assert tier.stats()["evictions"] == 0 and tier.stats()["quarantined"] == 0


def test_a_reader_in_another_process_gets_a_version_or_a_miss_never_a_mix(make_tier, tmp_path):
    tier = make_tier(4 * MiB)
    versions = [chunk(1024, seed) for seed in (11, 12)]
    encoded = [encode_for(v, tier) for v in versions]
    put(tier, b"filler", chunk(2600, 13))  # no room beside k: every overwrite is in place
    put(tier, b"k", versions[0])
    out = tmp_path / "seen.txt"
    script = textwrap.dedent(f"""
        import hashlib, sys, time
        from kvshrink.store.config import TierConfig
        from kvshrink.store import dram
        from kvshrink.store.dram import DramTier
        dram._RESCAN_INTERVAL_S = 0.0  # look for the owner's newest copy at every miss
        cfg = TierConfig(kind="dram", name="dram", capacity=1, compressed=False, shm_name={tier.config.shm_name!r})
        t = DramTier(cfg, readonly=True)
        seen = []
        print("ready", flush=True)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            frame = t.read_frame(b"k")
            seen.append("none" if frame is None else hashlib.sha256(frame).hexdigest())
            got = t.get(b"k")
            seen.append("none" if got is None else hashlib.sha256(got.tobytes()).hexdigest())
        open({str(out)!r}, "w").write("\\n".join(seen))
    """)
    reader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "ready"
        end, n = time.monotonic() + 1.0, 0
        while time.monotonic() < end:  # a 1 MiB overwrite in a full arena: in place, again and again
            n += 1
            tier.write_frame(b"k", encoded[n % 2])
            time.sleep(0.0005)  # let the reader find each version committed, then overwrite it mid-read
        assert reader.wait(30) == 0
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    allowed = {hashlib.sha256(f).hexdigest() for f in encoded} | {hashlib.sha256(v.tobytes()).hexdigest()
                                                                   for v in versions} | {"none"}
    seen = out.read_text().split("\n")
    torn = [h for h in seen if h not in allowed]
    assert not torn, f"{len(torn)} torn reads among {len(seen)}"
    # it read across the overwrites: the first write put version 1 in place of version 0
    assert {hashlib.sha256(f).hexdigest() for f in encoded} <= set(seen), "the reader missed a version"
    assert tier.stats()["evictions"] == 0


# -- randomized -----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_puts_and_overwrites_keep_the_contract(make_tier, seed):
    rng = random.Random(seed)
    capacity = rng.choice([96, 160, 224]) * KiB
    pinned: set[bytes] = set()
    tier = make_tier(capacity, pinned)
    model: dict[bytes, np.ndarray] = {}
    keys = [b"k%d" % i for i in range(7)]
    deadline, steps = time.monotonic() + 0.6, 0
    while time.monotonic() < deadline and steps < 400:
        steps += 1
        key = rng.choice(keys)
        roll = rng.random()
        if roll < 0.1:
            pinned.symmetric_difference_update({rng.choice(keys)})
            continue
        if roll < 0.15:
            assert tier.delete(key) == (key in model)
            model.pop(key, None)
            continue
        data = chunk(rng.choice([4, 8, 16, 24, 40, 50, 60, 80, 100, rng.uniform(1, 120)]), rng.randrange(2**32))
        frame = encode_for(data, tier)
        need = block_size_for(len(key), len(frame))
        before = dict(tier._blocks)
        others = {k for k in before if k not in pinned and k != key}
        feasible = need <= tier.capacity_bytes and largest_hole(tier, others | {key}) >= need
        # the old copy may be freed for the room: first when unpinned, last when pinned
        old_freeable = key in before and (key not in pinned or largest_hole(tier, others) < need)
        if not feasible:
            with pytest.raises(TierFullError) as caught:
                put(tier, key, data)
            assert len(frame) in _numbers(str(caught.value))
            assert set(tier._blocks) == set(before), "a write that cannot fit evicted chunks"
        else:
            victims = put(tier, key, data)
            assert not set(victims) & pinned, f"pinned chunks evicted: {victims}"
            assert key not in victims
            for k in victims:  # each victim was needed: without it no hole fits
                spared = (set(victims) - {k}) | ({key} if old_freeable else set())
                assert largest_hole(tier, spared, before) < need, f"{k!r} was evicted for nothing"
            for k in victims:
                del model[k]
            model[key] = data
        assert sorted(tier.keys()) == sorted(model)
        for k, expected in model.items():
            assert reads_back(tier, k, expected), k
    assert steps > 20
    assert tier.stats()["quarantined"] == 0
