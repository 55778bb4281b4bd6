"""Submit-then-poll plumbing for LMCache L2 adapters, written once.

LMCache's store and prefetch controllers call an adapter's ``submit_*`` from their own threads,
go back to ``poll()`` on the adapter's event fds, and fetch each result exactly once when an fd
fires. This module gives that shape to any adapter:

* :class:`CompletionChannel` — one per operation kind: its own eventfd (LMCache requires the store,
  lookup and load fds to be distinct), a table of finished results, handed out once.
* :class:`L2TaskRunner` — task ids, a thread pool that runs the blocking part of a task off the
  caller's thread, and the three channels. A task may return its result directly or a
  ``concurrent.futures.Future`` of it (e.g. a store's put futures); either way the result lands
  on the task's channel. An exception in a task is logged, counted and turned into the failure
  result the caller supplied, so LMCache always gets an answer and never a hang.

Thread safety: every public method may be called from any thread. Ownership: the runner owns
the fds and closes them in :meth:`L2TaskRunner.close`; results posted after close are dropped.
Errors: :class:`ChannelClosedError` from a submit after close, :class:`TaskChannelError` when the
three eventfds are not distinct; both are RuntimeErrors too, as they were before they were named.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Generic, TypeVar

from kvshrink.errors import KVShrinkError

log = logging.getLogger(__name__)

R = TypeVar("R")


class TaskChannelError(KVShrinkError, RuntimeError):
    """The task runner cannot be used: its channels are unusable or it is closed."""


class ChannelClosedError(TaskChannelError):
    """A task was submitted after :meth:`L2TaskRunner.close`."""


def when_all_done(futures: "list[Future[Any]]") -> "Future[list[Future[Any]]]":
    """A Future that completes (with ``futures`` themselves) once every one of them is done,
    successfully or not; nothing waits in a thread meanwhile."""
    combined: "Future[list[Future[Any]]]" = Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_: "Future[Any]") -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            combined.set_result(futures)

    if not futures:
        combined.set_result([])
    for future in futures:
        future.add_done_callback(one_done)
    return combined


class CompletionChannel(Generic[R]):
    """Finished results of one operation kind plus the eventfd that announces them."""

    def __init__(self, name: str) -> None:
        from lmcache.v1.platform import create_event_notifier

        self.name = name
        self._notifier = create_event_notifier()
        self._results: dict[int, R] = {}
        self._lock = threading.Lock()
        self._closed = False

    def fileno(self) -> int:
        return self._notifier.fileno()

    def post(self, task_id: int, result: R) -> None:
        """Record ``result`` for ``task_id`` and signal the fd (results first, then the signal,
        so a poller woken by the fd always finds the result)."""
        with self._lock:
            if self._closed:
                log.debug("%s: result of task %d arrived after close; dropped", self.name, task_id)
                return
            self._results[task_id] = result
            self._notifier.notify()

    def take(self, task_id: int) -> R | None:
        """The result of ``task_id`` if finished and not taken yet, else None."""
        with self._lock:
            return self._results.pop(task_id, None)

    def take_all(self) -> dict[int, R]:
        """Every finished, not yet taken result."""
        with self._lock:
            results, self._results = self._results, {}
            return results

    def pending(self) -> int:
        with self._lock:
            return len(self._results)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._results.clear()
            self._notifier.close()


class L2TaskRunner:
    """Task ids, worker threads and the store / lookup / load completion channels."""

    def __init__(self, name: str, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"{name}: workers must be >= 1, got {workers}")
        self.name = name
        self.store: CompletionChannel[Any] = CompletionChannel(f"{name}.store")
        self.lookup: CompletionChannel[Any] = CompletionChannel(f"{name}.lookup")
        self.load: CompletionChannel[Any] = CompletionChannel(f"{name}.load")
        fds = {self.store.fileno(), self.lookup.fileno(), self.load.fileno()}
        if len(fds) != 3:  # LMCache routes poll events by fd; a shared fd would misroute them
            raise TaskChannelError(f"{name}: event fds are not distinct: {fds}")
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._ids = itertools.count()
        self._id_lock = threading.Lock()
        self._in_flight = 0
        self._in_flight_lock = threading.Condition()
        self._errors: Counter[str] = Counter()
        self._errors_lock = threading.Lock()
        self._closed = False

    def submit(self, channel: CompletionChannel[R], work: Callable[[], "R | Future[R]"],
               on_error: Callable[[BaseException], R]) -> int:
        """Run ``work`` on a worker thread; post its result (or ``on_error(exc)``) to ``channel``.

        Returns the task id at once. ``work`` may return a Future: its result is posted when it
        completes, without holding a worker thread.
        """
        if self._closed:
            raise ChannelClosedError(f"{self.name}: submit after close")
        with self._id_lock:
            task_id = next(self._ids)
        with self._in_flight_lock:
            self._in_flight += 1
        future = self._executor.submit(work)
        future.add_done_callback(lambda f: self._settle(channel, task_id, f, on_error))
        return task_id

    def run_in_background(self, work: Callable[[], None], what: str) -> None:
        """Fire-and-forget work (unlock retries, deletes); failures are logged and counted."""
        def guarded() -> None:
            try:
                work()
            except Exception:  # a background job must never kill the worker pool silently
                self._count_error(what)
                log.exception("%s: background %s failed", self.name, what)

        if not self._closed:
            self._executor.submit(guarded)

    def errors(self) -> dict[str, int]:
        """Exceptions caught at the LMCache boundary, by operation kind."""
        with self._errors_lock:
            return dict(self._errors)

    def in_flight(self) -> int:
        with self._in_flight_lock:
            return self._in_flight

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every submitted task has posted its result; False on timeout."""
        with self._in_flight_lock:
            return self._in_flight_lock.wait_for(lambda: self._in_flight == 0, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Stop accepting work, let running tasks finish (up to ``timeout``), close the fds."""
        if self._closed:
            return
        self._closed = True
        if not self.wait_idle(timeout):
            log.warning("%s: %d tasks still running at close", self.name, self.in_flight())
        self._executor.shutdown(wait=True, cancel_futures=True)
        for channel in (self.store, self.lookup, self.load):
            channel.close()

    # -- internals -------------------------------------------------------------------------------
    def _settle(self, channel: CompletionChannel[R], task_id: int, future: "Future[Any]",
                on_error: Callable[[BaseException], R]) -> None:
        try:
            result = future.result()
        except BaseException as exc:  # noqa: BLE001 - every failure must still produce a result
            self._count_error(channel.name)
            log.error("%s: task %d failed: %r", channel.name, task_id, exc, exc_info=exc)
            try:
                result = on_error(exc)
            except Exception:
                log.exception("%s: failure handler of task %d raised; no result posted", channel.name, task_id)
                self._task_done()
                return
        if isinstance(result, Future):
            result.add_done_callback(lambda f: self._settle(channel, task_id, f, on_error))
            return
        channel.post(task_id, result)
        self._task_done()

    def _task_done(self) -> None:
        with self._in_flight_lock:
            self._in_flight -= 1
            self._in_flight_lock.notify_all()

    def _count_error(self, what: str) -> None:
        with self._errors_lock:
            self._errors[what] += 1
