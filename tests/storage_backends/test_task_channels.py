"""The shared submit-then-poll scaffold: distinct eventfds, results handed out once, failures
turned into results, futures chained, close() waits and drops late results."""

from __future__ import annotations

import select
import threading
import time
from concurrent.futures import Future

import pytest

from kvshrink.storage_backends.task_channels import L2TaskRunner


def wait_readable(fd: int, timeout: float = 5.0) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


@pytest.fixture
def runner():
    r = L2TaskRunner("test-runner", workers=2)
    yield r
    r.close()


def test_three_distinct_fds_and_distinct_across_runners(runner):
    other = L2TaskRunner("other", workers=1)
    try:
        fds = [runner.store.fileno(), runner.lookup.fileno(), runner.load.fileno(),
               other.store.fileno(), other.lookup.fileno(), other.load.fileno()]
        assert len(set(fds)) == 6
    finally:
        other.close()


def test_result_is_signalled_and_returned_once(runner):
    assert not wait_readable(runner.lookup.fileno(), timeout=0.05)
    task_id = runner.submit(runner.lookup, lambda: "found", on_error=lambda exc: "failed")
    assert wait_readable(runner.lookup.fileno())
    assert runner.lookup.take(task_id) == "found"
    assert runner.lookup.take(task_id) is None
    # the other channels were not signalled
    assert not wait_readable(runner.store.fileno(), timeout=0.05)
    assert not wait_readable(runner.load.fileno(), timeout=0.05)


def test_submit_does_not_block_on_slow_work(runner):
    gate = threading.Event()
    start = time.perf_counter()
    task_id = runner.submit(runner.load, lambda: gate.wait(5) and "late", on_error=lambda exc: None)
    assert time.perf_counter() - start < 0.5
    assert runner.load.take(task_id) is None  # not finished yet
    gate.set()
    assert wait_readable(runner.load.fileno())
    assert runner.load.take(task_id) == "late"


def test_exception_becomes_failure_result_and_is_counted(runner):
    def boom():
        raise OSError("disk on fire")

    task_id = runner.submit(runner.store, boom, on_error=lambda exc: f"failed: {exc}")
    assert wait_readable(runner.store.fileno())
    assert runner.store.take_all() == {task_id: "failed: disk on fire"}
    assert runner.errors() == {"test-runner.store": 1}


def test_future_results_are_chained_without_holding_a_worker(runner):
    pending: list[Future] = [Future() for _ in range(4)]  # more than the 2 workers
    ids = [runner.submit(runner.store, (lambda f=f: f), on_error=lambda exc: -1) for f in pending]
    time.sleep(0.1)
    # the workers are free: a plain task still runs while four futures are pending
    quick = runner.submit(runner.lookup, lambda: "quick", on_error=lambda exc: None)
    assert wait_readable(runner.lookup.fileno())
    assert runner.lookup.take(quick) == "quick"
    assert runner.store.take_all() == {}
    for i, f in enumerate(pending):
        f.set_result(i)
    assert runner.wait_idle(5)
    assert runner.store.take_all() == dict(zip(ids, range(4)))


def test_failed_future_uses_on_error(runner):
    fut: Future = Future()
    task_id = runner.submit(runner.store, lambda: fut, on_error=lambda exc: "failed")
    fut.set_exception(ValueError("bad chunk"))
    assert runner.wait_idle(5)
    assert runner.store.take(task_id) == "failed"


def test_close_waits_for_running_tasks_then_rejects_new_ones():
    runner = L2TaskRunner("closing", workers=1)
    done = threading.Event()
    runner.submit(runner.store, lambda: (time.sleep(0.2), done.set()), on_error=lambda exc: None)
    runner.close()
    assert done.is_set()
    with pytest.raises(RuntimeError, match="after close"):
        runner.submit(runner.store, lambda: 1, on_error=lambda exc: None)
    runner.close()  # idempotent


def test_result_after_close_is_dropped_not_raised():
    runner = L2TaskRunner("late", workers=1)
    fut: Future = Future()
    runner.submit(runner.store, lambda: fut, on_error=lambda exc: None)
    runner.close(timeout=0.1)
    fut.set_result(1)  # posting to a closed channel must not raise
    assert runner.store.take_all() == {}
