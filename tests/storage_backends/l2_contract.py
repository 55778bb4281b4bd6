"""A conformance suite for LMCache L2 adapters (``lmcache/v1/distributed/l2_adapters/base.py``).

Mix :class:`L2AdapterContract` into a test class that provides an ``make_adapter`` fixture: a
callable returning a fresh adapter (closed by the fixture afterwards). The suite runs against
LMCache's own ``MockL2Adapter`` too, so every assertion here is one the reference implementation
satisfies — the contract, not our implementation's habits.
"""

from __future__ import annotations

import os
import time

import pytest
from l2_harness import L2Driver, RecordingListener, contents, empty_like_obj, memory_obj, object_key


class L2AdapterContract:
    def test_three_distinct_event_fds_also_across_instances(self, make_adapter):
        first, second = make_adapter(), make_adapter()
        fds = [a.get_store_event_fd() for a in (first, second)] + \
              [a.get_lookup_and_lock_event_fd() for a in (first, second)] + \
              [a.get_load_event_fd() for a in (first, second)]
        assert len(set(fds)) == 6

    def test_submits_return_distinct_task_ids_at_once(self, make_adapter, small_chunks):
        adapter = make_adapter()
        keys = [object_key(i) for i in range(8)]
        objs = [memory_obj(c) for c in small_chunks[:8]]
        start = time.perf_counter()
        ids = [adapter.submit_store_task(keys[:4], objs[:4]), adapter.submit_store_task(keys[4:], objs[4:]),
               adapter.submit_lookup_and_lock_task(keys, {})]
        elapsed = time.perf_counter() - start
        assert len(set(ids)) == 3 and all(isinstance(i, int) for i in ids)
        assert elapsed < 0.5, f"submits took {elapsed:.3f} s: the work must not run on the caller's thread"
        driver = L2Driver(adapter)
        assert driver.lookup(keys[:1]) in ([0], [])  # drain: the adapter keeps working
        adapter.submit_unlock(keys)

    def test_store_lookup_load_round_trip_is_bit_exact(self, make_adapter, small_chunks):
        adapter, chunks = make_adapter(), small_chunks[:6]
        driver = L2Driver(adapter)
        keys = [object_key(i) for i in range(len(chunks))]
        result = driver.store(keys, [memory_obj(c) for c in chunks])
        assert result.is_successful() and result.bytes_transferred() == sum(c.nbytes for c in chunks)
        assert driver.lookup(keys) == list(range(len(chunks)))
        outs = [empty_like_obj(c) for c in chunks]
        assert driver.load(keys, outs) == list(range(len(chunks)))
        for out, chunk in zip(outs, chunks):
            assert (contents(out) == chunk).all()
        adapter.submit_unlock(keys)

    def test_store_results_are_popped_once(self, make_adapter, small_chunks):
        adapter = make_adapter()
        driver = L2Driver(adapter)
        driver.store([object_key(1)], [memory_obj(small_chunks[0])])
        assert adapter.pop_completed_store_tasks() == {}

    def test_lookup_marks_only_stored_keys(self, make_adapter, small_chunks):
        adapter = make_adapter()
        driver = L2Driver(adapter)
        driver.store([object_key(1), object_key(3)], [memory_obj(small_chunks[1]), memory_obj(small_chunks[3])])
        keys = [object_key(i) for i in range(5)]
        assert driver.lookup(keys) == [1, 3]
        adapter.submit_unlock(keys)

    def test_load_of_a_missing_key_clears_only_its_bit(self, make_adapter, small_chunks):
        adapter = make_adapter()
        driver = L2Driver(adapter)
        driver.store([object_key(0), object_key(2)], [memory_obj(small_chunks[0]), memory_obj(small_chunks[2])])
        outs = [empty_like_obj(small_chunks[i]) for i in range(3)]
        assert driver.load([object_key(i) for i in range(3)], outs) == [0, 2]
        assert (contents(outs[0]) == small_chunks[0]).all() and (contents(outs[2]) == small_chunks[2]).all()

    def test_unlock_never_fails(self, make_adapter, small_chunks):
        adapter = make_adapter()
        driver = L2Driver(adapter)
        driver.store([object_key(0)], [memory_obj(small_chunks[0])])
        assert driver.lookup([object_key(0)]) == [0]
        adapter.submit_unlock([object_key(0)])
        adapter.submit_unlock([object_key(0)])  # more unlocks than locks
        adapter.submit_unlock([object_key(99)])  # never stored
        adapter.submit_unlock([])
        assert driver.lookup([object_key(0)]) == [0]  # still usable
        adapter.submit_unlock([object_key(0)])

    def test_delete_removes_and_notifies(self, make_adapter, small_chunks):
        adapter = make_adapter()
        listener = RecordingListener()
        adapter.register_listener(listener)
        driver = L2Driver(adapter)
        keys = [object_key(0), object_key(1)]
        driver.store(keys, [memory_obj(small_chunks[0]), memory_obj(small_chunks[1])])
        adapter.delete([keys[0], object_key(42)])
        assert listener.deleted == [keys[0]]
        assert driver.lookup(keys) == [1]
        adapter.submit_unlock(keys)

    def test_listeners_hear_stored_and_accessed_keys(self, make_adapter, small_chunks):
        adapter = make_adapter()
        listener = RecordingListener()
        adapter.register_listener(listener)
        driver = L2Driver(adapter)
        keys = [object_key(i) for i in range(3)]
        driver.store(keys, [memory_obj(c) for c in small_chunks[:3]])
        assert sorted(listener.stored, key=lambda ks: ks[0].chunk_hash) == \
            sorted(zip(keys, [c.nbytes for c in small_chunks[:3]]), key=lambda ks: ks[0].chunk_hash)
        driver.load(keys[:2], [empty_like_obj(c) for c in small_chunks[:2]])
        assert sorted(listener.accessed, key=lambda k: k.chunk_hash) == keys[:2]

    def test_usage_counts_stored_bytes_once_and_drops_on_delete(self, make_adapter, small_chunks):
        adapter = make_adapter()
        driver = L2Driver(adapter)
        before = adapter.get_usage().total_bytes_used
        driver.store([object_key(0)], [memory_obj(small_chunks[0])])
        driver.store([object_key(0)], [memory_obj(small_chunks[0])])  # a repeat store is not new data
        assert adapter.get_usage().total_bytes_used - before == small_chunks[0].nbytes
        adapter.delete([object_key(0)])
        assert adapter.get_usage().total_bytes_used == before

    def test_report_status_says_healthy(self, make_adapter):
        status = make_adapter().report_status()
        assert status["is_healthy"] is True

    def test_close_releases_the_event_fds(self, make_adapter):
        adapter = make_adapter()
        fds = [adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(), adapter.get_load_event_fd()]
        adapter.close()
        for fd in fds:
            with pytest.raises(OSError):
                os.fstat(fd)
