"""Races between a re-put, a read and an eviction plan, forced deterministically on a real store
(DRAM arena in /dev/shm + SSD files, real threads).

Each race test makes one interleaving happen for sure: a real tier method (or the SSD tier's own
lock) is wrapped so that one chosen thread pauses at one chosen point, after the real call, while
the other side of the race runs to the end; nothing the store does is replaced. Each failed on
the code before the fix.

* A read of a chunk on an exclusive SSD tier while the same key is re-put (same content): the put
  writes DRAM, then deletes the older SSD copy; a read that had looked at DRAM just before must
  not report a miss (kvshrink/store/tiered.py, ``_retire_older_copies``).
* The same in a full DRAM arena: rewriting frees the old block before the new one is indexed; a
  re-put of the stored value is a refresh instead (tiered.py ``_write_locked``, dram.py
  ``holds_frame``).
* An SSD read that finds its file deleted must not forget the entry of a write that put the file
  back meanwhile: that would lose the chunk (kvshrink/store/ssd.py, ``_open_chunk``).
* A planned eviction victim pinned between the plan and the eviction stays in DRAM: its copy
  below must go, or it sits in both exclusive tiers (tiered.py, ``_settle_planned``); forced
  once, then a loop that pins the next victim on and off while puts run.
* The DRAM tier's usage is a running total that always equals what it holds.
* A delete while a write-back is writing the key into the SSD: the copy landed after the delete
  and the key came back (tiered.py, ``delete``; seen once in CI as a lookup hit after delete).
* A promotion whose exclusive source evicts the chunk while it is copied up: it brought the
  chunk back after a read had missed it, and the drop was never reported (write_path.py,
  ``_after_promotion``; seen once in CI as a fault-fuzz miss with no drop notice).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Callable

import numpy as np
import pytest
from tier_contract import encode_for

from kvshrink.store import TieredStore
from kvshrink.store.config import TierConfig
from kvshrink.store.dram import DramTier
from kvshrink.store.ssd import SsdTier

MiB = 2**20
KEY = b"re-put"
WAIT_S = 30.0


def dram_ssd(tmp_path, shm_name, dram_chunks: int) -> dict:
    """An exclusive DRAM + SSD store (the shipped default's shape) with room for ``dram_chunks``
    raw 1.4 MiB chunks in DRAM and many on the SSD; no promotion (reads must not move chunks)."""
    return {"promote_on_hit": False,
            "tiers": [{"kind": "dram", "capacity": int((dram_chunks + 0.5) * 1.5 * MiB), "shm_name": shm_name,
                       "codec": "raw"},
                      {"kind": "ssd", "capacity": "256MiB", "path": str(tmp_path / "ssd"), "fsync": False}]}


class PauseOnce:
    """Wraps ``obj.name`` (a real method): the first call from ``thread`` (None: any) for which
    ``when(args, result)`` holds runs the real method, then sets ``reached`` and waits for
    ``release`` before returning its result. Every other call passes straight through."""

    def __init__(self, obj: Any, name: str, when: Callable[[tuple, Any], bool], before: bool = False) -> None:
        self.real = getattr(obj, name)
        self.when = when
        self.before = before  # pause before the real call (``when`` then sees result None)
        self.thread: int | None = -1  # set by the test: nobody pauses before
        self.reached, self.release = threading.Event(), threading.Event()
        self.fired = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = None if self.before else self.real(*args, **kwargs)
        if not self.fired and self.thread in (None, threading.get_ident()) and self.when(args, result):
            self.fired = True
            self.reached.set()
            assert self.release.wait(WAIT_S), "the other side of the race did not finish"
        return self.real(*args, **kwargs) if self.before else result


@pytest.mark.parametrize("look", ["contains", "get"])
def test_a_chunk_on_the_ssd_stays_readable_while_it_is_re_put(tmp_path, shm_name, small_chunks, monkeypatch, look):
    """The reader looks at DRAM (miss: the chunk is on the SSD), then pauses; the re-put of the
    same content lands in DRAM and deletes the SSD copy; the reader goes on to the SSD. Before
    the fix it found nothing there and returned None for a chunk stored the whole time.
    ``contains``: the pause is in the read's "which local tier holds it" look; ``get``: in the
    read itself, after that look said the SSD."""
    chunk = small_chunks[0]
    with TieredStore.from_config(dram_ssd(tmp_path, shm_name, dram_chunks=2)) as store:
        for key, data in [(KEY, chunk), (b"a", small_chunks[1]), (b"b", small_chunks[2])]:
            assert store.put(key, data).result(timeout=WAIT_S) is True
        store.flush(timeout=WAIT_S)
        assert store.where(KEY) == "ssd" and store.tiers[0].keys() == [b"a", b"b"]

        pause = PauseOnce(store.tiers[0], look, lambda args, result: args[0] == KEY and not result
                          if look == "contains" else args[0] == KEY and result is None)
        monkeypatch.setattr(store.tiers[0], look, pause)
        got: list[Any] = []

        def read() -> None:
            pause.thread = threading.get_ident()
            got.append(store.get(KEY))

        reader = threading.Thread(target=read)
        reader.start()
        assert pause.reached.wait(WAIT_S), "the reader never paused after its DRAM look"
        assert store.put(KEY, chunk).result(timeout=WAIT_S) is True  # same content, again
        assert store.where(KEY) == "dram" and not store.tiers[1].contains(KEY)  # the SSD copy is gone
        pause.release.set()
        reader.join(WAIT_S)
        assert got and got[0] is not None, "a read of a chunk stored throughout its re-put missed"
        assert np.array_equal(got[0], chunk)


def test_a_chunk_in_a_full_dram_tier_stays_readable_while_it_is_re_put(tmp_path, shm_name, small_chunks,
                                                                      monkeypatch):
    """A full arena (no hole for a second copy): rewriting the chunk would free its old block to
    make room and index the new one only after copying the frame in, so a read in between found
    no copy anywhere (the SSD is exclusive: it has none). The re-put of the same content is a
    refresh instead: nothing is rewritten, a read hits throughout."""
    chunk = small_chunks[0]
    with TieredStore.from_config(dram_ssd(tmp_path, shm_name, dram_chunks=2)) as store:
        for key, data in [(KEY, chunk), (b"a", small_chunks[1])]:
            assert store.put(key, data).result(timeout=WAIT_S) is True
        dram = store.tiers[0]
        assert dram.keys() == [KEY, b"a"] and not store.tiers[1].keys()
        pause = PauseOnce(dram._arena, "commit", lambda args, result: args[0].key == KEY)
        pause.thread = None  # the put worker
        monkeypatch.setattr(dram._arena, "commit", pause)
        puts = dram.counters["puts"]
        future = store.put(KEY, chunk)  # same content, again
        while not (pause.reached.wait(0.01) or future.done()):
            pass
        got = store.get(KEY)  # while the new copy is committed but not yet indexed (before the fix)
        pause.release.set()
        assert future.result(timeout=WAIT_S) is True
        assert got is not None, "a read of a chunk stored throughout its re-put missed"
        assert np.array_equal(got, chunk)
        assert dram.counters["puts"] == puts and dram.keys() == [b"a", KEY]  # refreshed (now the youngest)
        assert np.array_equal(store.get(KEY), chunk) and store.keys("ssd") == []
        other = small_chunks[1]  # a re-put of other content still replaces the value
        assert store.put(KEY, other).result(timeout=WAIT_S) is True
        assert np.array_equal(store.get(KEY), other) and dram.counters["puts"] == puts + 1


class HookedLock:
    """A real ``threading.Lock`` that, the first time ``thread`` is about to take it while
    ``armed``, first runs ``before`` (on another thread, to the end). Other takers pass through."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.thread: int | None = None
        self.armed = False
        self.before: Callable[[], None] = lambda: None

    def __enter__(self) -> bool:
        if self.armed and threading.get_ident() == self.thread:
            self.armed = False
            other = threading.Thread(target=self.before)
            other.start()
            other.join(WAIT_S)
            assert not other.is_alive(), "the hooked write did not finish"
        return self.real.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.real.__exit__(*exc)


def test_an_ssd_read_that_finds_its_file_gone_keeps_a_write_that_replaced_it(tmp_path, small_chunks, monkeypatch):
    """The reader sees the entry, then (before it opens the file) the chunk is deleted, so its
    open fails; before it takes the tier lock to forget the entry, the chunk is written again.
    Before the fix the reader then forgot the *new* entry: the file stayed on disk, unindexed,
    and the chunk was lost (every later read a miss) until the next rescan."""
    config = TierConfig(kind="ssd", name="ssd", capacity=64 * MiB, compressed=True, path=str(tmp_path / "ssd"),
                        fsync=False)
    tier = SsdTier(config)
    try:
        tier._reconciler.join(WAIT_S)  # a fresh directory is scanned once in the background
        chunk = small_chunks[3]
        frame = encode_for(chunk, tier)
        tier.write_frame(KEY, frame)
        lock = HookedLock(tier._lock)
        monkeypatch.setattr(tier, "_lock", lock)
        real_path_for = tier.path_for
        deleted: list[bytes] = []

        def path_for(key: bytes):
            """The reader's open: delete the chunk just before it, then arm the lock hook."""
            if threading.get_ident() == lock.thread and not deleted and key == KEY and tier.contains(KEY):
                deleted.append(key)
                assert tier.delete(KEY)
                lock.before = lambda: tier.write_frame(KEY, frame)
                lock.armed = True
            return real_path_for(key)

        monkeypatch.setattr(tier, "path_for", path_for)
        got: list[Any] = []
        lock.thread = threading.get_ident()
        got.append(tier.get(KEY))  # this thread is the reader
        lock.thread = None
        assert deleted and not lock.armed, "the interleaving did not happen"
        assert tier.contains(KEY), "the entry of the chunk written again was forgotten: the chunk is lost"
        assert np.array_equal(tier.get(KEY), chunk)
        assert got[0] is None or np.array_equal(got[0], chunk)
    finally:
        tier.close()


def test_a_delete_during_a_write_back_leaves_no_copy(tmp_path, shm_name, small_chunks, monkeypatch):
    """DRAM + a write-back SSD (LMCache's L2 contract suite's store): the put's write-back is
    about to write the SSD when the key is deleted. Before the fix the delete returned at once,
    the copy landed after it, and the deleted key was found again on the SSD."""
    config = {"tiers": [{"kind": "dram", "capacity": "16MiB", "shm_name": shm_name, "codec": "raw"},
                        {"kind": "ssd", "capacity": "64MiB", "path": str(tmp_path / "ssd"), "write_back": True}]}
    with TieredStore.from_config(config) as store:
        ssd = store.tiers[1]
        pause = PauseOnce(ssd, "write_frame", lambda args, result: args[0] == KEY, before=True)
        pause.thread = None  # the write-back thread
        monkeypatch.setattr(ssd, "write_frame", pause)
        assert store.put(KEY, small_chunks[0]).result(timeout=WAIT_S) is True
        assert pause.reached.wait(WAIT_S), "the write-back never reached the SSD"
        deleted: list[bool] = []
        deleter = threading.Thread(target=lambda: deleted.append(store.delete(KEY)))
        deleter.start()
        deleter.join(0.5)
        waited = deleter.is_alive()
        pause.release.set()
        deleter.join(WAIT_S)
        store.flush(timeout=WAIT_S)
        assert deleted == [True]
        assert not ssd.contains(KEY) and store.where(KEY) is None and store.get(KEY) is None, \
            "the write-back landed after the delete: the deleted key is back"
        assert waited, "the delete did not wait for the copy it had to remove"
        assert store.put(b"other", small_chunks[1]).result(timeout=WAIT_S) is True  # the store goes on
        store.flush(timeout=WAIT_S)
        assert ssd.contains(b"other")


def test_a_promotion_whose_source_evicts_the_chunk_meanwhile_does_not_bring_it_back(tmp_path, shm_name,
                                                                                     small_chunks, monkeypatch):
    """A read hit on the exclusive SSD queues a promotion; the promotion checked that the SSD
    holds the chunk and is about to write DRAM when the SSD evicts it (the last tier's writes take
    no write lock: a demotion into it runs meanwhile). Before the fix the promotion wrote the chunk
    into DRAM all the same: a read in between missed it, and the drop was never reported (the key
    was held again when the evictor checked). Seen in CI as a fault-fuzz miss with no notice."""
    config = dram_ssd(tmp_path, shm_name, dram_chunks=2)
    config["promote_on_hit"] = True
    with TieredStore.from_config(config) as store:
        dropped: list[bytes] = []
        store.add_drop_listener(dropped.extend)
        for key, data in [(KEY, small_chunks[0]), (b"a", small_chunks[1]), (b"b", small_chunks[2])]:
            assert store.put(key, data).result(timeout=WAIT_S) is True
        store.flush(timeout=WAIT_S)
        assert store.where(KEY) == "ssd"
        dram, ssd = store.tiers
        pause = PauseOnce(dram, "write_frame", lambda args, result: args[0] == KEY, before=True)
        pause.thread = None  # the promotion's worker
        monkeypatch.setattr(dram, "write_frame", pause)
        assert np.array_equal(store.get(KEY), small_chunks[0])  # the hit queues the promotion
        assert pause.reached.wait(WAIT_S), "the promotion never reached its DRAM write"
        ssd.delete(KEY)  # what the SSD's eviction of the chunk does to it (the evictor reports later)
        pause.release.set()
        store.flush(timeout=WAIT_S)
        assert store.where(KEY) is None and store.get(KEY) is None, \
            "the promotion brought back a chunk its source had dropped"
        assert KEY in dropped, "the chunk left the store and no drop notice said so"
        assert not set(store.keys("dram")) & set(store.keys("ssd"))  # the victim the copy evicted: one tier
        for key, data in [(b"a", small_chunks[1]), (b"b", small_chunks[2])]:
            assert np.array_equal(store.get(key), data), key


def test_a_planned_victim_pinned_before_its_eviction_stays_in_one_tier(tmp_path, shm_name, small_chunks):
    """DRAM holds a (oldest) and b; a put of c plans to evict a, copies a to the SSD, and a lookup
    pins a right then (before the DRAM write evicts). The write evicts b instead. Before the fix,
    a stayed in DRAM *and* on the SSD: the exclusive budgets no longer added up."""
    with TieredStore.from_config(dram_ssd(tmp_path, shm_name, dram_chunks=2)) as store:
        for key, data in [(b"a", small_chunks[0]), (b"b", small_chunks[1])]:
            assert store.put(key, data).result(timeout=WAIT_S) is True
        pinned: list[bytes] = []

        def pin_a_once_copied(keys: list[bytes]) -> None:
            """Placement notice of a's demotion: it is on the SSD now, still in DRAM. A test-only
            listener that calls the store (real listeners must only enqueue)."""
            if b"a" in keys and not pinned and store.tiers[1].contains(b"a") and store.tiers[0].contains(b"a"):
                pinned.append(b"a")
                assert store.lock([b"a"]) == [True]

        store.add_placement_listener(pin_a_once_copied)
        assert store.put(b"c", small_chunks[2]).result(timeout=WAIT_S) is True
        store.flush(timeout=WAIT_S)
        store.remove_placement_listener(pin_a_once_copied)
        assert pinned == [b"a"], "the planned victim was not pinned between plan and eviction"

        in_dram, on_ssd = set(store.keys("dram")), set(store.keys("ssd"))
        assert in_dram == {b"a", b"c"} and on_ssd == {b"b"}, (in_dram, on_ssd)
        assert store.stats()["tiers"]["ssd"]["chunks"] == 1  # the budget holds b only

        store.unlock([b"a"])  # a is an ordinary DRAM chunk again: the next eviction demotes it
        for key, data in [(b"d", small_chunks[3]), (b"e", small_chunks[4])]:
            assert store.put(key, data).result(timeout=WAIT_S) is True
        store.flush(timeout=WAIT_S)
        in_dram, on_ssd = set(store.keys("dram")), set(store.keys("ssd"))
        assert in_dram & on_ssd == set() and in_dram | on_ssd == {b"a", b"b", b"c", b"d", b"e"}
        assert b"a" in on_ssd
        for key, data in zip([b"a", b"b", b"c", b"d", b"e"], small_chunks):
            assert np.array_equal(store.get(key), data), key


def test_pins_racing_puts_never_leave_a_chunk_in_both_tiers(tmp_path, shm_name, small_chunks):
    """A lookup keeps pinning and unpinning the oldest DRAM chunk (the next planned victim) while
    puts evict: whatever interleaving comes, after each put no chunk is in both exclusive tiers,
    and every chunk reads back. (Before the fix this failed within the first ten puts.)"""
    keys = [b"k%02d" % i for i in range(24)]
    data = {k: small_chunks[i % len(small_chunks)] for i, k in enumerate(keys)}
    with TieredStore.from_config(dram_ssd(tmp_path, shm_name, dram_chunks=3)) as store:
        done = threading.Event()

        def pinner() -> None:
            while not done.is_set():
                oldest = store.tiers[0].keys()[:1]  # the next planned victim
                store.lock(oldest)
                time.sleep(0.002)  # pinned two thirds of the time, unpinned one third
                store.unlock(oldest)
                time.sleep(0.001)

        thread = threading.Thread(target=pinner)
        thread.start()
        try:
            for key in keys:  # puts one at a time: between them nothing moves between tiers
                assert store.put(key, data[key]).result(timeout=WAIT_S) is True
                both = set(store.keys("dram")) & set(store.keys("ssd"))
                assert both == set(), f"after the put of {key!r}, {sorted(both)} are in both tiers"
        finally:
            done.set()
            thread.join(WAIT_S)
        store.flush(timeout=WAIT_S)
        in_dram, on_ssd = set(store.keys("dram")), set(store.keys("ssd"))
        assert in_dram & on_ssd == set(), f"{sorted(in_dram & on_ssd)} are in both tiers"
        assert in_dram | on_ssd == set(keys)
        for key in keys:
            assert np.array_equal(store.get(key), data[key]), key


def test_dram_usage_is_a_running_total_of_what_it_holds(shm_name):
    """usage() (what a prefetch hint is sized by) is kept as a total, not summed per call: after
    writes, overwrites at other sizes, evictions, deletes, a reopen and in a read-only attacher it
    equals the frames the tier holds."""
    config = TierConfig(kind="dram", name="dram", capacity=2 * MiB, compressed=False,
                        shm_name=f"{shm_name}-{uuid.uuid4().hex[:8]}")
    rng = np.random.default_rng(7)
    frames: dict[bytes, int] = {}
    tier = DramTier(config)
    try:
        def check(t: DramTier) -> None:
            held = t.keys()
            assert t.usage() == (sum(frames[k] for k in held), len(held))

        for step in range(120):
            key = b"k%d" % rng.integers(0, 12)
            if step % 7 == 6:
                tier.delete(key)
            else:
                frame = encode_for(rng.integers(0, 256, int(rng.integers(1, 400)) * 1024, dtype=np.uint8), tier)
                tier.write_frame(key, frame)
                frames[key] = len(frame)
            check(tier)
        assert tier.counters["evictions"] > 0
        reader = DramTier(config, readonly=True)
        try:
            check(reader)
        finally:
            reader.close()
        tier.close()
        tier = DramTier(config)
        check(tier)
    finally:
        tier.destroy()
