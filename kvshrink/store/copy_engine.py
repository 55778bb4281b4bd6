"""The asynchronous copy engine: the software form of an Intel DSA work queue.

DSA's value is that the submitting core never waits: it posts a descriptor and moves on, and a
full work queue rejects the descriptor instead of stalling. The same shape here:

* :class:`StagingPool` — a byte budget of reusable staging buffers. ``put`` copies the caller's
  chunk into one (numpy / torch copies release the GIL) and returns; a pool over budget rejects.
  A caller that keeps its chunk unchanged until the put completes (the LMCache adapter: LMCache
  holds the L1 object's read lock until the store task reports) lends it instead
  (:meth:`CopyEngine.borrow`): the workers encode it where it lies, no staging copy.
* :class:`Lane` — a worker pool behind a non-blocking bounded semaphore. ``try_submit`` either
  queues the job or returns None at once; the caller counts the drop. Nothing ever waits for room.

Threads: the lanes and the reader pool only *call* the codec; the threads that run its block
work, theirs included, are counted by the store's codec budget (:attr:`CopyEngine.codec_budget`:
its own :class:`~kvshrink.codec.cpu_budget.CpuBudget` of ``engine.codec_threads`` when given, else
the process-wide one, which LMCache's task threads and other codecs share). So the worker counts
below bound how many jobs are in flight, not how many cores the store burns: that is the budget's
limit, whatever the nesting.

The engine knows nothing about tiers: :class:`~kvshrink.store.tiered.TieredStore` gives it jobs
(compress + write, write-back, demotion, promotion, parallel reads). Of the codec it knows only
which chunks it accepts: :meth:`CopyEngine.stage` checks a chunk against the codec's dtype allow
list before copying it, so a chunk the workers could not encode is refused by ``put`` itself.
"""

from __future__ import annotations

import logging
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from kvshrink.errors import KVShrinkError
from kvshrink.store.config import EngineConfig
from kvshrink.store.stats import ENGINE_COUNTERS, Counters
from kvshrink.store.tier_codecs import StoreCodecs
from kvshrink.store.warm_heap import keep_freed_memory

log = logging.getLogger(__name__)


class StagingPool:
    """Reusable uint8 buffers within a byte budget. Thread-safe.

    Buffers are recycled by exact size (KV chunks of one model share a size), which avoids
    first-touch page faults: a fresh buffer costs about twice a memcpy into a warm one.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._allocated = 0  # bytes of buffers in use or cached free
        self._in_use = 0
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> np.ndarray | None:
        """A buffer of exactly ``nbytes``, or None when the budget is spent (never waits)."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._in_use += nbytes
                return free.pop()
            while self._allocated + nbytes > self.budget and self._drop_one_cached():
                pass
            if self._allocated + nbytes > self.budget:
                return None
            self._allocated += nbytes
            self._in_use += nbytes
        return np.empty(nbytes, dtype=np.uint8)

    def release(self, buf: np.ndarray) -> None:
        with self._lock:
            self._in_use -= buf.nbytes
            self._free.setdefault(buf.nbytes, []).append(buf)

    def in_use(self) -> int:
        with self._lock:
            return self._in_use

    def _drop_one_cached(self) -> bool:
        for size, bufs in self._free.items():
            if bufs:
                bufs.pop()
                self._allocated -= size
                return True
        return False


class Lane:
    """A named worker pool that accepts at most ``depth`` jobs queued or running."""

    def __init__(self, name: str, workers: int, depth: int) -> None:
        self.name = name
        self.depth = depth
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"kvshrink-{name}")
        self._slots = threading.BoundedSemaphore(depth)
        self._pending = 0
        self._idle = threading.Condition()

    def try_submit(self, fn: Callable[..., Any], *args: Any) -> Future | None:
        """Queue ``fn(*args)``; None at once when the lane is full."""
        if not self._slots.acquire(blocking=False):
            return None
        with self._idle:
            self._pending += 1
        try:
            return self._executor.submit(self._run, fn, args)
        except RuntimeError:  # shut down
            self._done()
            return None

    def pending(self) -> int:
        with self._idle:
            return self._pending

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no job is queued or running; False on timeout. (For flush, not puts.)"""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        """Finish every queued job, then stop the workers."""
        self._executor.shutdown(wait=True)

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        try:
            return fn(*args)
        finally:
            self._done()

    def _done(self) -> None:
        with self._idle:
            self._pending -= 1
            if self._pending == 0:
                self._idle.notify_all()
        self._slots.release()


class CopyEngine:
    """Staging pool + a put lane + a background lane + a reader pool, with their counters."""

    def __init__(self, config: EngineConfig) -> None:
        from kvshrink.codec.cpu_budget import CpuBudget, budget

        self._own_budget = config.codec_threads is not None
        self.codec_budget = CpuBudget(config.codec_threads) if self._own_budget else budget()
        self.codecs = StoreCodecs(self.codec_budget)
        keep_freed_memory()  # chunk-sized buffers reuse warm pages (see warm_heap)
        self.staging = StagingPool(config.staging_bytes)
        self.puts = Lane("put", config.put_workers, config.put_queue)
        self.background = Lane("background", config.background_workers, config.background_queue)
        self.readers = ThreadPoolExecutor(max_workers=config.read_workers, thread_name_prefix="kvshrink-read")
        self.counters = Counters(ENGINE_COUNTERS)

    def stage(self, kv: Any) -> tuple[Any, np.ndarray] | None:
        """Copy ``kv`` into a staging buffer; return (a staged twin of kv, the buffer) or None
        when the budget is spent. ``kv`` is only read; the caller owns the buffer until it hands
        it back with ``staging.release``. A chunk that is not a numpy array or a torch tensor the
        codec can encode (object or string dtypes, quantized, sparse, nested or meta tensors,
        Python lists) raises :class:`~kvshrink.codec.UnsupportedArrayError` (a TypeError in the
        KVShrinkError family) naming what is wrong, before anything is copied. Zero-size and
        non-contiguous chunks are fine. Thread-safe."""
        nbytes = chunk_nbytes(kv)
        buf = self.staging.acquire(nbytes)
        if buf is None:
            return None
        try:
            staged = _copy_into(kv, buf)
        except BaseException:
            self.staging.release(buf)
            raise
        return staged, buf

    def borrow(self, kv: Any) -> Any | None:
        """``kv`` itself when the workers can encode it where it lies (a C-contiguous, non-empty
        CPU numpy array or torch tensor), else None: the caller stages it. No copy, no budget:
        the caller guarantees ``kv`` stays unchanged until the put's Future completes (LMCache
        holds its L1 read lock until the store task reports). Raises like :meth:`stage` for a
        chunk the codec cannot encode."""
        if not chunk_nbytes(kv):
            return None
        if isinstance(kv, np.ndarray):
            return kv if kv.flags.c_contiguous else None
        return kv if kv.device.type == "cpu" and kv.is_contiguous() and not kv.requires_grad else None

    def schedule(self, job: Callable[..., Any], *args: Any) -> bool:
        """Queue a background job; False (counted) when the background lane is full. A job that
        fails is counted (``background_errors``) and, unless it is a KVShrinkError, logged."""
        future = self.background.try_submit(job, *args)
        if future is None:
            self.counters.add("background_dropped")
            return False
        self.counters.add("background_jobs")
        future.add_done_callback(self._count_background_failure)
        return True

    def _count_background_failure(self, future: Future) -> None:
        exc = future.exception()
        if exc is not None:
            self.counters.add("background_errors")
            if not isinstance(exc, KVShrinkError):
                log.error("background store job failed", exc_info=exc)

    def stats(self) -> dict[str, int]:
        codec = self.codec_budget.stats()
        return {**self.counters.snapshot(), "codec_threads": codec["limit"], "codec_threads_busy": codec["busy"],
                "put_queue_depth": self.puts.pending(),
                "background_queue_depth": self.background.pending(), "staging_bytes_in_use": self.staging.in_use(),
                "staging_budget_bytes": self.staging.budget}

    def close(self) -> None:
        self.puts.close()
        self.background.close()  # after puts: their last write-backs are queued by now
        self.readers.shutdown(wait=True)
        if self._own_budget:
            self.codec_budget.shutdown()


def chunk_nbytes(kv: Any) -> int:
    """Bytes of a chunk ``put`` accepts; UnsupportedArrayError naming what is wrong otherwise."""
    from kvshrink.codec import UnsupportedArrayError  # the codec's own allow list, loaded on first use
    from kvshrink.codec.dtypes import NUMPY, TORCH, dtype_width

    if isinstance(kv, np.ndarray):
        if dtype_width(NUMPY, kv.dtype.str) is None:
            raise UnsupportedArrayError(f"a KV chunk cannot have numpy dtype {kv.dtype}: use bool, ints, "
                                        "floats or complex (the codec stores fixed-width numbers only)")
        return kv.nbytes
    torch = sys.modules.get("torch")  # a tensor exists only if torch was imported
    if torch is None or not isinstance(kv, torch.Tensor):
        raise UnsupportedArrayError(f"a KV chunk is a numpy array or a torch tensor, got {type(kv).__name__}")
    if dtype_width(TORCH, str(kv.dtype).removeprefix("torch.")) is None:
        raise UnsupportedArrayError(f"a KV chunk cannot have torch dtype {kv.dtype} (quantized or sub-byte): "
                                    "dequantize it or pass its raw bits as uint8")
    if kv.is_nested or kv.layout != torch.strided:
        layout = "nested" if kv.is_nested else str(kv.layout)
        raise UnsupportedArrayError(f"a KV chunk must be a dense (strided) tensor, got layout {layout}")
    if kv.device.type == "meta":
        raise UnsupportedArrayError("a KV chunk on the meta device has no data to store")
    return kv.numel() * kv.element_size()


def _copy_into(kv: Any, buf: np.ndarray) -> Any:
    """A copy of ``kv`` living in ``buf``, of the same container kind, dtype and shape."""
    if isinstance(kv, np.ndarray):
        staged = buf.view(kv.dtype).reshape(kv.shape)
        np.copyto(staged, kv)
        return staged
    import torch

    if kv.numel() == 0:  # torch refuses dtype views of an empty buffer; there is nothing to copy
        return torch.empty(kv.shape, dtype=kv.dtype)
    staged = torch.from_numpy(buf).view(kv.dtype).view(kv.shape)
    staged.copy_(kv.detach())
    return staged
