"""Prefetch hints: chunks moved up to the first tier ahead of the read that will want them.

:meth:`TieredStore.prefetch(keys) <kvshrink.store.tiered.TieredStore.prefetch>` hands the keys of
one request (prefix order) to the store's :class:`Prefetcher` and returns a
:class:`PrefetchHandle` at once. Contract:

* **Bounded, never blocking.** A hint takes its first ``prefetch.depth`` keys, and no more than
  fill ``HINT_SHARE`` of the first tier at the store's mean chunk size (a bigger hint would evict
  its own first chunks before their read; the rest are counted ``prefetch_dropped``); a key already in the first tier, or already queued or moving for
  another hint, is skipped (``prefetch_skipped``); the others are queued, unless
  ``prefetch.max_pending`` keys are queued already: those are dropped and counted, never waited
  for. At most ``prefetch.max_in_flight`` moves run at once, in queue (prefix) order, on this
  module's own threads (``kvshrink-prefetch``), so a prefetch never occupies the store's put or
  background lanes.
* **A move is a promotion.** Each chunk is read from the fastest lower tier holding it and
  written into the first tier through the store's own write path (demote-then-evict, the copy
  ledger): an exclusive source drops its copy once the first tier holds it durably, so the chunk
  is always in exactly one tier; what the write evicts is demoted, pinned chunks are never
  evicted. Counted ``prefetch_issued`` when queued, ``prefetch_moved`` when it landed.
* **Reads never read twice.** A read (``get`` / ``get_many`` / ``get_into``, hence the LMCache
  adapter's load) of a key whose move is running waits for that move (at most
  :data:`WAIT_S`), then reads the first tier; a key still queued is taken off the queue
  (``prefetch_cancelled``) and read by the reader itself, so no chunk is read twice for one request.
* **Outcomes.** A key no tier holds (never cached, or evicted before its move ran) is
  ``prefetch_missing``; one the first tier has no room for (what is there is pinned) is
  ``prefetch_dropped``; a move that failed otherwise (the first tier refused the write) is counted
  ``prefetch_errors`` and logged. Either way the chunk stays where it was. A moved chunk later read from the
  first tier counts ``prefetch_useful`` once; one evicted or demoted from it before any read counts
  ``prefetch_wasted`` (the last :data:`TRACKED` moved keys are remembered for this).
  :meth:`PrefetchHandle.cancel` (and store close) takes a hint's queued keys off the queue,
  counted ``prefetch_cancelled``; running moves finish.
* **Handles.** ``handle.future`` completes (never fails) with a :class:`PrefetchResult` once every
  queued key of the hint settled. Keys are the caller's bytes; no buffer is handed over.

Threads and locks: one lock guards the queue, the running set and the moved-key record; it is a
leaf (never held while the store or a tier is called), so the store may call :meth:`evicted` and
:meth:`read` under its own locks. Errors: only the KVShrinkError family is caught from a move
(counted, logged); anything else is a bug and is logged with its traceback.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvshrink.errors import KVShrinkError
from kvshrink.store.config import PrefetchConfig
from kvshrink.store.stats import PREFETCH_COUNTERS, Counters

log = logging.getLogger(__name__)

WAIT_S = 5.0  # longest a read waits for a running move of its key
TRACKED = 65536  # moved, not yet read keys remembered for the useful / wasted counts
OUTCOMES = ("moved", "present", "missing", "dropped", "error", "cancelled")


@dataclass
class PrefetchResult:
    """What one hint did: ``requested`` keys; ``dropped`` beyond depth or the pending bound;
    ``skipped`` already in the first tier or queued by another hint; of the ``queued`` ones,
    ``moved``, ``present`` (there by the time the move ran), ``missing``, ``error``, ``cancelled``."""

    requested: int = 0
    dropped: int = 0
    skipped: int = 0
    queued: int = 0
    moved: int = 0
    present: int = 0
    missing: int = 0
    error: int = 0
    cancelled: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(eq=False)
class PrefetchHandle:
    """One hint in flight; ``future`` completes with its :class:`PrefetchResult`."""

    result: PrefetchResult = field(default_factory=PrefetchResult)
    future: Future = field(default_factory=Future)
    _open: int = 0
    _prefetcher: "Prefetcher | None" = None

    def cancel(self) -> int:
        """Take this hint's queued keys off the queue; returns how many (running moves finish)."""
        return 0 if self._prefetcher is None else self._prefetcher.cancel(self)

    def done(self) -> bool:
        return self.future.done()

    def wait(self, timeout: float | None = None) -> PrefetchResult:
        """The result once settled; TimeoutError after ``timeout`` seconds."""
        return self.future.result(timeout)


class Prefetcher:
    """The store's prefetch queue. ``move(key)`` (the store's) returns one of :data:`OUTCOMES`
    but ``cancelled``; ``in_first(key)`` says whether the first tier holds ``key``."""

    def __init__(self, config: PrefetchConfig, move: Callable[[bytes], str], in_first: Callable[[bytes], bool]) -> None:
        self.config = config
        self._move = move
        self._in_first = in_first
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # notified when nothing is queued or running
        self._queue: deque[tuple[bytes, PrefetchHandle]] = deque()
        self._queued: dict[bytes, PrefetchHandle] = {}  # key -> its hint, while queued
        self._running: dict[bytes, threading.Event] = {}  # key -> set when its move ended
        self._moved: dict[bytes, None] = {}  # moved into the first tier, not read since (oldest first)
        self._active = 0
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=config.max_in_flight, thread_name_prefix="kvshrink-prefetch")
        self.counters = Counters(PREFETCH_COUNTERS)

    # -- hints ----------------------------------------------------------------------------------------
    def submit(self, keys: Sequence[bytes], room: int | None = None) -> PrefetchHandle:
        """Queue ``keys`` (prefix order, checked by the store); never blocks. At most ``room``
        keys (the store's estimate of what its first tier holds) besides ``depth``."""
        handle = PrefetchHandle(_prefetcher=self)
        result = handle.result
        result.requested = len(keys)
        self.counters.add("prefetch_hints")
        unique = list(dict.fromkeys(keys))
        take = unique[: self.config.depth if room is None else min(self.config.depth, room)]
        result.dropped = len(unique) - len(take)
        result.skipped = len(keys) - len(unique)  # repeated within the hint
        fresh = [k for k in take if not self._in_first(k)]
        result.skipped += len(take) - len(fresh)
        with self._lock:
            for key in fresh:
                if self._closed:
                    result.cancelled += 1
                elif key in self._queued or key in self._running:
                    result.skipped += 1
                elif len(self._queued) >= self.config.max_pending:
                    result.dropped += 1
                else:
                    self._queue.append((key, handle))
                    self._queued[key] = handle
                    result.queued += 1
            handle._open = result.queued
            if len(self._queue) > 2 * self.config.max_pending:  # entries cancelled or taken by readers
                self._queue = deque(item for item in self._queue if self._queued.get(item[0]) is item[1])
        self.counters.add("prefetch_issued", result.queued)
        self.counters.add("prefetch_dropped", result.dropped)
        self.counters.add("prefetch_skipped", result.skipped)
        self.counters.add("prefetch_cancelled", result.cancelled)
        if not result.queued:
            handle.future.set_result(result)
        self._dispatch()
        return handle

    def cancel(self, handle: PrefetchHandle) -> int:
        with self._lock:
            keys = [k for k, h in self._queued.items() if h is handle]
            for key in keys:
                del self._queued[key]
            self._notify_if_idle()
        for key in keys:
            self._settle(handle, "cancelled")
        self.counters.add("prefetch_cancelled", len(keys))
        return len(keys)

    # -- hooks the store calls ------------------------------------------------------------------------
    def before_read(self, keys: Sequence[bytes], timeout: float = WAIT_S) -> None:
        """A read of ``keys`` is about to start: wait for their running moves, take their queued
        ones off the queue (the reader reads those itself). Cheap when nothing is queued."""
        if not self._queued and not self._running:
            return
        waits, taken = [], []
        with self._lock:
            for key in keys:
                handle = self._queued.pop(key, None)
                if handle is not None:
                    taken.append(handle)
                event = self._running.get(key)
                if event is not None:
                    waits.append(event)
            self._notify_if_idle()
        for handle in taken:
            self._settle(handle, "cancelled")
        self.counters.add("prefetch_cancelled", len(taken))
        for event in waits:
            if not event.wait(timeout):
                log.warning("a read waited %.1f s for a prefetch move; reading without it", timeout)
                break

    def read(self, keys: Sequence[bytes]) -> None:
        """``keys`` were read from the first tier: a moved one was useful."""
        self._settle_moved(keys, "prefetch_useful")

    def evicted(self, keys: Sequence[bytes]) -> None:
        """``keys`` left the first tier (evicted, demoted): a moved one not read since was wasted."""
        self._settle_moved(keys, "prefetch_wasted")

    def _settle_moved(self, keys: Sequence[bytes], counter: str) -> None:
        """Count under ``counter`` the keys of ``keys`` moved and not settled yet, and forget them."""
        if not self._moved:
            return
        with self._lock:
            settled = sum(self._moved.pop(k, 0) is None for k in keys)
        if settled:
            self.counters.add(counter, settled)

    def forget(self, key: bytes) -> None:
        """``key`` was deleted or overwritten: neither useful nor wasted."""
        with self._lock:
            self._moved.pop(key, None)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no move is queued or running (``TieredStore.flush``); False on timeout."""
        with self._settled:
            return self._settled.wait_for(lambda: not self._queued and not self._running, timeout)

    def busy(self, key: bytes) -> bool:
        """Whether a move of ``key`` is queued or running."""
        return key in self._queued or key in self._running

    def stats(self) -> dict[str, int]:
        with self._lock:
            gauges = {"prefetch_pending": len(self._queued), "prefetch_running": len(self._running),
                      "prefetch_unread": len(self._moved)}
        return {**self.counters.snapshot(), **gauges}

    def close(self) -> None:
        """Cancel what is queued (counted), let running moves finish, stop the threads."""
        with self._lock:
            self._closed = True
            items = [(k, h) for k, h in self._queued.items()]
            self._queued.clear()
            self._queue.clear()
            self._notify_if_idle()
        for _, handle in items:
            self._settle(handle, "cancelled")
        self.counters.add("prefetch_cancelled", len(items))
        self._executor.shutdown(wait=True)

    # -- the workers ----------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Start queued moves while fewer than ``max_in_flight`` run."""
        while True:
            with self._lock:
                if self._closed or self._active >= self.config.max_in_flight:
                    return
                item = None
                while self._queue:
                    key, handle = self._queue.popleft()
                    if self._queued.get(key) is handle:  # not cancelled or taken by a reader
                        del self._queued[key]
                        item = key, handle
                        break
                if item is None:
                    return
                self._running[item[0]] = threading.Event()
                self._active += 1
            try:
                self._executor.submit(self._run, *item)
            except RuntimeError:  # shut down meanwhile
                self._finish(item[0], item[1], "cancelled")
                self.counters.add("prefetch_cancelled")
                return

    def _run(self, key: bytes, handle: PrefetchHandle) -> None:
        outcome = "error"
        try:
            outcome = self._move(key)
        except KVShrinkError as exc:
            log.warning("prefetch of %s failed: %s", key.hex()[:32], exc)
        except Exception:  # a bug: keep the worker and the hint's accounting alive
            log.exception("prefetch of %s failed", key.hex()[:32])
        finally:
            self._finish(key, handle, outcome)
            self._dispatch()

    def _finish(self, key: bytes, handle: PrefetchHandle, outcome: str) -> None:
        with self._lock:
            self._running.pop(key).set()
            self._active -= 1
            self._notify_if_idle()
            if outcome == "moved":
                self._moved.pop(key, None)
                self._moved[key] = None
                while len(self._moved) > TRACKED:
                    del self._moved[next(iter(self._moved))]
        counter = {"moved": "prefetch_moved", "missing": "prefetch_missing", "error": "prefetch_errors",
                   "present": "prefetch_skipped", "dropped": "prefetch_dropped"}.get(outcome)
        if counter:
            self.counters.add(counter)
        self._settle(handle, outcome)

    def _notify_if_idle(self) -> None:
        """Wake ``wait_idle`` callers once nothing is queued or running (call with the lock held)."""
        if not self._queued and not self._running:
            self._settled.notify_all()

    @staticmethod
    def _settle(handle: PrefetchHandle, outcome: str) -> None:
        with _SETTLE_LOCK:
            setattr(handle.result, outcome, getattr(handle.result, outcome) + 1)
            handle._open -= 1
            finished = handle._open == 0
        if finished:
            handle.future.set_result(handle.result)


_SETTLE_LOCK = threading.Lock()  # a hint's result is settled by several workers and readers
