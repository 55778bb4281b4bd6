"""A budget of threads busy encoding or decoding, shared by every caller that uses it: one
process-wide (:func:`budget`), and one per store that sets ``engine.codec_threads``.

Why: the LMCache adapter's task threads, the store's put / background / reader workers and each
codec's own block helpers nest (up to 4 + 2 + 1 + 4 + n threads could compress at once), so on a
2-core host the cache would fight vLLM for its cores and itself for the caches. Every thread that
runs codec block work holds one *token* of a budget, whoever started it.

Contract:

* **Size** (``limit()``): the ``threads`` it was built with or given to
  :meth:`CpuBudget.configure` (a store's ``engine.codec_threads``), else
  ``KVSHRINK_CODEC_THREADS``, else the number of CPUs this process may run on
  (``os.sched_getaffinity``). Looked up at every call, so a change applies to calls that start afterwards; calls already running finish as they
  began.
* **Tokens**: a caller takes one for itself (:meth:`CpuBudget.hold`, blocking until one is free:
  then the budget's cores are busy anyway) and, without waiting, up to ``threads - 1`` more for
  helpers (:meth:`CpuBudget.run`); each helper gives its token back when it stops. So at most
  ``limit()`` threads run codec block work at any moment, however many Codecs, store workers or
  adapter task threads call in. ``hold`` is re-entrant per thread (a nested call takes no second
  token).
* **The caller works**: it never hands its blocks off and waits. It decodes / encodes blocks
  itself alongside the helpers it got tokens for (none when the budget is taken: it then does all
  of them alone); helpers that have not started when the blocks run out are cancelled.
* **Threads**: helpers run on one shared pool of ``limit() - 1`` threads named ``kvshrink-codec``,
  started on first need and replaced (the old one dropped) when the limit changes. Every method
  is thread-safe.
* **Ownership**: the budget owns its helper threads (:meth:`CpuBudget.shutdown` stops them; a
  later call starts new ones); block work reads and writes only the buffers its caller passed.
* **Errors**: a bad size is a :class:`~kvshrink.errors.ConfigError` naming the key
  (``engine.codec_threads`` / ``threads`` from ``configure``, ``KVSHRINK_CODEC_THREADS`` from the
  first call that reads a bad value); the first exception of any block is re-raised in the caller
  (see :func:`~kvshrink.codec.blocks.run_blocks`) after every helper has stopped.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator

from kvshrink.codec.blocks import run_blocks
from kvshrink.errors import ConfigError

log = logging.getLogger(__name__)

ENV = "KVSHRINK_CODEC_THREADS"


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def env_threads() -> int | None:
    """``KVSHRINK_CODEC_THREADS`` as an integer >= 1, None when unset; ConfigError when malformed."""
    env = os.environ.get(ENV)
    if not env:
        return None
    try:
        value = int(env)
    except ValueError:
        raise ConfigError(ENV, f"not an integer: {env!r}") from None
    if value < 1:
        raise ConfigError(ENV, f"must be >= 1, got {value}")
    return value


def check_threads(value: object, key: str) -> int:
    """``value`` if it is an integer >= 1; ConfigError naming ``key`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, f"expected an integer >= 1 (threads busy encoding / decoding), got {value!r}")
    return value


class CpuBudget:
    """A count of busy codec threads with a ceiling, and the helper pool that stays under it."""

    def __init__(self, threads: int | None = None) -> None:
        self._configured = None if threads is None else check_threads(threads, "threads")
        self._cond = threading.Condition()
        self._busy = 0
        self._peak = 0
        self._waits = 0
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    def limit(self) -> int:
        """The most threads that may run codec block work at once (see the module docstring)."""
        return self._configured or env_threads() or cpu_count()

    @property
    def configured(self) -> int | None:
        """The limit fixed by :meth:`configure`, None when it follows the environment / CPUs."""
        return self._configured

    def configure(self, threads: int | None, key: str = "engine.codec_threads") -> None:
        """Fix the limit at ``threads`` (None: back to the environment / CPU default)."""
        value = None if threads is None else check_threads(threads, key)
        with self._cond:
            if value is not None and self._configured not in (None, value):
                log.info("codec thread budget changed from %d to %d by %s", self._configured, value, key)
            self._configured = value
            self._cond.notify_all()  # a larger limit lets waiting callers in

    @contextmanager
    def hold(self) -> Iterator[None]:
        """One token for the calling thread for the duration of the block (blocking until free)."""
        if getattr(self._local, "depth", 0):
            self._local.depth += 1
            try:
                yield
            finally:
                self._local.depth -= 1
            return
        limit = self.limit()
        with self._cond:
            if self._busy >= limit:
                self._waits += 1
                self._cond.wait_for(lambda: self._busy < self.limit())
            self._take_locked(1)
        self._local.depth = 1
        try:
            yield
        finally:
            self._local.depth = 0
            self._give_back()

    def run(self, nblocks: int, work: Callable[[int], object], threads: int, parallel: bool = True) -> list:
        """``[work(0), ..., work(nblocks - 1)]`` on the caller plus the helpers the budget allows
        now (at most ``threads - 1``; none unless ``parallel``)."""
        with self.hold():
            want = min(threads, nblocks) - 1 if parallel else 0
            extra = self._try_take(want) if want > 0 else 0
            if not extra:
                return run_blocks(nblocks, work, None, 1)
            try:
                pool = self._executor()
            except BaseException:
                for _ in range(extra):
                    self._give_back()
                raise
            return run_blocks(nblocks, work, pool, extra + 1, release=self._give_back)

    def stats(self) -> dict[str, int]:
        """``limit``, ``busy`` (tokens held now), ``peak_busy`` and ``waits`` (callers that found
        every token taken) since start or the last :meth:`reset_peak`."""
        limit = self.limit()
        with self._cond:
            return {"limit": limit, "busy": self._busy, "peak_busy": self._peak, "waits": self._waits}

    def reset_peak(self) -> None:
        with self._cond:
            self._peak = self._busy
            self._waits = 0

    def shutdown(self) -> None:
        """Stop the helper threads (after the work queued on them); the budget stays usable."""
        with self._cond:
            pool, self._pool, self._pool_size = self._pool, None, 0
        if pool is not None:
            pool.shutdown(wait=True)

    # -- internals --------------------------------------------------------------------------------
    def _take_locked(self, n: int) -> None:
        self._busy += n
        self._peak = max(self._peak, self._busy)

    def _try_take(self, n: int) -> int:
        """Up to ``n`` tokens, without waiting; how many were taken."""
        limit = self.limit()
        with self._cond:
            taken = max(0, min(n, limit - self._busy))
            self._take_locked(taken)
            return taken

    def _give_back(self) -> None:
        with self._cond:
            self._busy -= 1
            self._cond.notify()

    def _executor(self) -> ThreadPoolExecutor:
        """The helper pool, sized ``limit() - 1`` (helpers never outnumber the tokens they hold,
        so a queued helper waits for a thread only while another helper finishes)."""
        size = max(1, self.limit() - 1)
        with self._cond:
            if self._pool is not None and self._pool_size == size:
                return self._pool
            # a replaced pool is dropped, not shut down: a caller may still be submitting to it;
            # its threads exit once it is garbage (concurrent.futures wakes them then)
            self._pool, self._pool_size = ThreadPoolExecutor(size, "kvshrink-codec"), size
            return self._pool


_budget = CpuBudget()


def budget() -> CpuBudget:
    """The process's budget, shared by every Codec and every store."""
    return _budget
