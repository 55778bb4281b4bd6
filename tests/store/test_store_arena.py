"""The shared-memory arena and the SSD index log on their own: crash states and recovery."""

from __future__ import annotations

import os

import pytest

from kvshrink.store.arena import SUPERBLOCK, Arena, block_size_for
from kvshrink.store.dram import SHM_DIR
from kvshrink.store.ssd_index import DELETE, PUT, IndexLog, encode_record, replay

MiB = 2**20


@pytest.fixture
def arena_file(shm_name):
    return SHM_DIR / shm_name


def write(arena: Arena, key: bytes, payload: bytes):
    block = arena.allocate(key, len(payload))
    assert block is not None
    arena.commit(block, payload)
    return block


def test_committed_blocks_survive_reopen(arena_file):
    arena = Arena(arena_file, MiB)
    arena.scan()
    write(arena, b"a", b"x" * 1000)
    write(arena, b"b", b"y" * 3000)
    arena.close()
    again = Arena(arena_file, MiB)
    blocks = again.scan()
    assert [b.key for b in blocks] == [b"a", b"b"]
    assert bytes(again.payload(blocks[1])) == b"y" * 3000
    again.close()


def test_torn_write_is_freed_and_newest_duplicate_wins(arena_file):
    arena = Arena(arena_file, MiB)
    arena.scan()
    write(arena, b"k", b"old" * 100)
    write(arena, b"k", b"new" * 100)  # crash before the old block was freed
    arena.allocate(b"torn", 5000)  # crash before commit
    arena.close()
    again = Arena(arena_file, MiB)
    blocks = again.scan()
    assert [(b.key, bytes(again.payload(b))) for b in blocks] == [(b"k", b"new" * 100)]
    # the old copy and the torn block are free again: only the new block is in use
    assert sum(again.free_by_start.values()) == MiB - SUPERBLOCK - block_size_for(1, 300)
    again.close()


def test_free_coalesces_neighbours(arena_file):
    arena = Arena(arena_file, MiB)
    arena.scan()
    blocks = [write(arena, b"k%d" % i, b"z" * 10000) for i in range(5)]
    for b in (blocks[1], blocks[3], blocks[2]):
        arena.free(b.offset)
    merged = arena.free_by_start[blocks[1].offset]
    assert merged == sum(b.size for b in blocks[1:4])
    assert arena.allocate(b"big", merged - 200) is not None
    arena.close()


def test_full_arena_refuses_instead_of_overwriting(arena_file):
    arena = Arena(arena_file, 64 * 1024)
    arena.scan()
    while arena.allocate(b"k", 4000) is not None:
        pass
    assert arena.allocate(b"one-more", 4000) is None
    arena.close()


def test_scribbled_header_reclaims_the_rest_not_the_start(arena_file):
    arena = Arena(arena_file, MiB)
    arena.scan()
    first = write(arena, b"first", b"1" * 500)
    second = write(arena, b"second", b"2" * 500)
    arena.close()
    with open(arena_file, "r+b") as f:
        f.seek(second.offset)
        f.write(b"\xff" * 16)
    again = Arena(arena_file, MiB)
    assert [b.key for b in again.scan()] == [b"first"]
    assert again.allocate(b"new", 1000) is not None
    again.close()
    assert first.offset == SUPERBLOCK


def test_readonly_view_never_writes(arena_file):
    arena = Arena(arena_file, MiB)
    arena.scan()
    write(arena, b"k", b"v" * 100)
    reader = Arena(arena_file, 0, readonly=True)
    assert [b.key for b in reader.scan()] == [b"k"]
    reader.close()
    arena.close()


# -- index log ------------------------------------------------------------------------------------
def test_index_replay_and_torn_tail(tmp_path):
    path = tmp_path / "index.log"
    log = IndexLog(path)
    log.append(PUT, b"a", 10)
    log.append(PUT, b"b", 20)
    log.append(DELETE, b"a", 0)
    log.append(PUT, b"c", 30)
    log.close()
    with open(path, "ab") as f:
        f.write(encode_record(PUT, b"d", 40)[:-1])  # torn: last byte never written
    again = IndexLog(path)
    assert list(again.recovered.items()) == [(b"b", 20), (b"c", 30)]
    assert path.stat().st_size == len(b"".join(encode_record(op, k, s) for op, k, s in
                                               [(PUT, b"a", 10), (PUT, b"b", 20), (DELETE, b"a", 0), (PUT, b"c", 30)]))
    again.close()


def test_index_corrupt_record_stops_replay(tmp_path):
    good = encode_record(PUT, b"a", 1)
    bad = bytearray(encode_record(PUT, b"b", 2))
    bad[-1] ^= 1
    live, valid, records = replay(good + bytes(bad) + encode_record(PUT, b"c", 3))
    assert list(live) == [b"a"] and valid == len(good) and records == 1


def test_index_compaction_keeps_live_entries(tmp_path):
    path = tmp_path / "index.log"
    log = IndexLog(path)
    for i in range(100):
        log.append(PUT, b"k", i)
    assert log.should_compact(1) is False  # below the minimum worth a rewrite
    log.compact([(b"k", 99)])
    log.close()
    assert list(IndexLog(path).recovered.items()) == [(b"k", 99)]


def test_snapshot_then_records_replay_in_order(tmp_path):
    path = tmp_path / "index.log"
    log = IndexLog(path)
    for i in range(5):
        log.append(PUT, b"k%d" % i, i)
    log.compact([(b"k%d" % i, i) for i in range(5)])
    log.append(DELETE, b"k1", 0)
    log.append(PUT, b"k0", 100)  # rewritten: becomes the youngest
    log.close()
    again = IndexLog(path)
    assert list(again.recovered.items()) == [(b"k2", 2), (b"k3", 3), (b"k4", 4), (b"k0", 100)]
    assert again.records == 2 and not again.damaged
    again.close()


def test_damaged_snapshot_is_reported_not_trusted(tmp_path):
    path = tmp_path / "index.log"
    log = IndexLog(path)
    log.compact([(b"a", 1), (b"b", 2)])
    log.close()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # a key byte changed on disk
    path.write_bytes(bytes(data))
    again = IndexLog(path)
    assert again.damaged and not again.recovered and path.stat().st_size == 0
    again.close()


def test_compaction_threshold_bounds_the_replayed_records():
    from kvshrink.store.ssd_index import COMPACT_MIN_RECORDS

    log = IndexLog.__new__(IndexLog)
    log.records = COMPACT_MIN_RECORDS - 1
    assert not log.should_compact(1000)
    log.records = 25_000
    assert log.should_compact(100_000) and not log.should_compact(200_000)


def test_index_append_failure_leaves_no_torn_record(tmp_path):
    """A full disk while appending: the log is cut back to its last whole record."""
    import subprocess
    import sys

    path = tmp_path / "index.log"
    log = IndexLog(path)
    log.append(PUT, b"first", 1)
    log.close()
    limit = os.path.getsize(path) + 10
    script = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
        "from kvshrink.store.ssd_index import IndexLog, PUT\n"
        f"log = IndexLog(__import__('pathlib').Path({str(path)!r}))\n"
        "try:\n"
        "    log.append(PUT, b'x' * 100, 2)\n"
        "except OSError:\n"
        "    sys.exit(3)\n"
    )
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == 3
    assert list(IndexLog(path).recovered) == [b"first"]


def test_lru_order_touch_plan_first_and_pins():
    from kvshrink.store.tier_base import LruIndex

    lru = LruIndex("lru")
    for key in (b"a", b"b", b"c", b"d"):
        lru.add(key, 10)
    lru.touch(b"a")
    assert list(lru.oldest(lambda k: False)) == [b"b", b"c", b"d", b"a"]
    assert list(lru.oldest(lambda k: k == b"c", exclude=b"d", first=[b"a", b"zz"])) == [b"a", b"b"]
    assert lru.total == 40 and lru.pop(b"a") == 10 and lru.total == 30
    fifo = LruIndex("fifo")
    fifo.add(b"x", 1)
    fifo.add(b"y", 1)
    fifo.touch(b"x")
    assert list(fifo.oldest(lambda k: False)) == [b"x", b"y"]


def test_lru_candidates_beyond_the_first_window():
    from kvshrink.store.tier_base import LruIndex

    lru = LruIndex("lru")
    for i in range(600):
        lru.add(b"%d" % i, 1)
    pinned = {b"%d" % i for i in range(300)}
    candidates = lru.oldest(pinned.__contains__)
    assert next(candidates) == b"300"
    assert len(list(lru.oldest(pinned.__contains__))) == 300
