"""Drop listeners: the store tells its owner which keys left it on its own (eviction from the
last tier, failed demotion, quarantine) once no tier holds them, and never a key still held."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvshrink.store import TieredStore
from kvshrink.store.tiered import RECENT_DROPS, DropListeners
from kvshrink.store.ssd import FILE_HEADER


class Recorder:
    """A drop listener that also checks, at the moment it is called, that the store really holds
    none of the keys it is given."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.keys: list[bytes] = []
        self.still_held: list[bytes] = []
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, keys: list[bytes]) -> None:
        held = [k for k in keys if self.store.contains(k)]
        with self._lock:
            self.keys += keys
            self.still_held += held
            self.threads.add(threading.current_thread().name)


def dram_ssd(tmp_path, shm_name, chunk_bytes: int, *, write_back: bool, dram: float = 2.5, ssd: float = 3) -> dict:
    """DRAM of ``dram`` raw chunks, SSD of ``ssd`` raw chunks (it holds ~1.45x more compressed)."""
    return {"promote_on_hit": True,
            "tiers": [{"kind": "dram", "capacity": int(chunk_bytes * dram), "shm_name": shm_name, "codec": "raw"},
                      {"kind": "ssd", "capacity": int(chunk_bytes * ssd), "path": str(tmp_path / "ssd"),
                       "write_back": write_back}]}


@pytest.fixture
def open_store():
    stores = []

    def make(config: dict) -> TieredStore:
        store = TieredStore.from_config(config)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


@pytest.mark.parametrize("write_back", [False, True], ids=["demote-on-evict", "write-back"])
def test_listener_hears_exactly_the_keys_no_tier_holds(open_store, tmp_path, shm_name, small_chunks, write_back):
    # write-back: an SSD smaller than DRAM evicts copies of chunks DRAM still holds (not drops)
    sizes = {"dram": 4.5, "ssd": 2.2} if write_back else {"dram": 2.5, "ssd": 3}
    store = open_store(dram_ssd(tmp_path, shm_name, small_chunks[0].nbytes, write_back=write_back, **sizes))
    recorder = Recorder(store)
    store.add_drop_listener(recorder)
    keys = [b"k%02d" % i for i in range(len(small_chunks))]
    for key, chunk in zip(keys, small_chunks):
        assert store.put(key, chunk).result(timeout=60) is True
        store.flush(timeout=60)  # write-back copies (and the evictions they cause) done too
        # reads promote SSD hits into DRAM, which evicts and demotes more
        for earlier in keys[: keys.index(key)]:
            store.get(earlier)
        store.flush(timeout=60)

    gone = [k for k in keys if not store.contains(k)]
    stats = store.stats()
    assert len(gone) >= 6, f"the store should be overfull; only {len(gone)} keys left it"
    assert sorted(recorder.keys) == sorted(gone), "each dropped key reported once, and only those"
    assert recorder.still_held == []
    assert stats["engine"]["keys_dropped"] == len(gone)
    assert stats["engine"]["drop_listener_errors"] == 0
    assert stats["tiers"]["dram"]["evictions"] > 0 and stats["tiers"]["ssd"]["evictions"] >= len(gone)
    if write_back:
        # the SSD also evicted copies DRAM still held: those were evictions but not drops
        assert stats["tiers"]["ssd"]["evictions"] > len(gone)
    assert all(t.startswith("kvshrink-") for t in recorder.threads), recorder.threads
    for key in keys:  # what is still held reads back bit-exact (from its tier: no promotion)
        if key not in gone:
            holder = next(t for t in store.tiers if t.contains(key))
            assert np.array_equal(holder.get(key), small_chunks[keys.index(key)])


def test_delete_is_not_reported_as_a_drop(open_store, tmp_path, shm_name, small_chunks):
    store = open_store(dram_ssd(tmp_path, shm_name, small_chunks[0].nbytes, write_back=True))
    recorder = Recorder(store)
    store.add_drop_listener(recorder)
    store.put(b"k", small_chunks[0]).result(timeout=60)
    store.flush(timeout=60)
    assert store.delete(b"k") is True and not store.contains(b"k")
    assert recorder.keys == [] and store.stats()["engine"]["keys_dropped"] == 0


def test_a_chunk_quarantined_on_read_is_reported(open_store, tmp_path, small_chunks):
    ssd = tmp_path / "ssd"
    store = open_store({"tiers": [{"kind": "ssd", "capacity": "1GiB", "path": str(ssd)}]})
    recorder = Recorder(store)
    store.add_drop_listener(recorder)
    for i in range(2):
        store.put(b"k%d" % i, small_chunks[i]).result(timeout=60)
    victim = store.tiers[0].path_for(b"k0")
    data = bytearray(victim.read_bytes())
    middle = FILE_HEADER.size + len(data) // 2
    data[middle : middle + 64] = bytes(64)  # flip the payload, keep the header naming the key
    victim.write_bytes(bytes(data))
    assert store.get_many([b"k0", b"k1"])[0] is None
    assert recorder.keys == [b"k0"] and recorder.still_held == []
    assert store.stats()["tiers"]["ssd"]["quarantined"] == 1


def test_a_failing_listener_is_counted_and_never_fails_a_put(open_store, tmp_path, shm_name, small_chunks):
    store = open_store(dram_ssd(tmp_path, shm_name, small_chunks[0].nbytes, write_back=False))

    def broken(keys: list[bytes]) -> None:
        raise RuntimeError("listener bug")

    recorder = Recorder(store)
    store.add_drop_listener(broken)
    store.add_drop_listener(recorder)
    results = [store.put(b"k%02d" % i, c).result(timeout=60) for i, c in enumerate(small_chunks[:10])]
    store.flush(timeout=60)
    assert all(r is True for r in results)
    engine = store.stats()["engine"]
    assert recorder.keys, "the second listener still hears the drops"
    assert engine["drop_listener_errors"] > 0 and engine["put_errors"] == 0 and engine["background_errors"] == 0
    store.remove_drop_listener(broken)
    store.remove_drop_listener(broken)  # unknown: ignored
    errors = engine["drop_listener_errors"]
    before = len(recorder.keys)
    for i, chunk in enumerate(small_chunks[10:14]):
        store.put(b"j%d" % i, chunk).result(timeout=60)
    store.flush(timeout=60)
    assert len(recorder.keys) > before and store.stats()["engine"]["drop_listener_errors"] == errors


def test_racing_reports_of_one_drop_reach_listeners_once():
    """An eviction and a read that found the chunk gone both report it; listeners hear it once,
    and again only after a tier took the key back."""
    drops = DropListeners()
    heard: list[list[bytes]] = []
    drops.add(heard.append)
    drops.fire([b"a", b"b"])
    drops.fire([b"b", b"a"])
    drops.stored(b"a")
    drops.fire([b"a", b"b"])
    assert heard == [[b"a", b"b"], [b"a"]]
    assert drops.counters["keys_dropped"] == 3
    drops.fire([b"k%d" % i for i in range(RECENT_DROPS)])  # the memory is bounded: "a" is forgotten
    drops.fire([b"a"])
    assert heard[-1] == [b"a"]
