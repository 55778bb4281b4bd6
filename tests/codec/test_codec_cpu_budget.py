"""The process-wide codec thread budget: real encodes and decodes from many threads at once never
have more threads inside block work than the budget allows; env / config overrides; bad values."""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import numpy as np
import pytest

from kvshrink.codec import Codec, blocks, fast_frames
from kvshrink.codec.cpu_budget import ENV, CpuBudget, budget, cpu_count
from kvshrink.errors import ConfigError, KVShrinkError
from kvshrink.store import TieredStore
from kvshrink.store.config import StoreConfig

BLOCK_CODE = {blocks.encode_block.__code__, blocks.decode_block.__code__, blocks.encode_fast_words.__code__,
              fast_frames.WordBlocks.decode.__code__}


@pytest.fixture(autouse=True)
def restore_budget(monkeypatch) -> Iterator[None]:
    monkeypatch.delenv(ENV, raising=False)
    before = budget().configured
    yield
    budget().configure(before)


class BlockWatcher:
    """Samples every thread's stack (sys._current_frames) and records how many threads were
    inside encode_block / decode_block at once, and which ones: an outside view of the budget."""

    def __init__(self) -> None:
        self.peak = 0
        self.names: set[str] = set()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="block-watcher", daemon=True)

    def __enter__(self) -> "BlockWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        while not self._stop.is_set():
            inside = [ident for ident, frame in sys._current_frames().items() if _in_block(frame)]
            if any(i not in names for i in inside):
                names = {t.ident: t.name for t in threading.enumerate()}
            self.peak = max(self.peak, len(inside))
            self.names.update(names.get(i, "?") for i in inside)
            self.samples += 1
            time.sleep(0.0002)


def _in_block(frame) -> bool:
    while frame is not None:
        if frame.f_code in BLOCK_CODE:
            return True
        frame = frame.f_back
    return False


def _hammer(real_chunks, callers: int, rounds: int, method: str = "zstd") -> None:
    """``callers`` threads each encoding and decoding real chunks, wanting 4 threads per call."""
    codec = Codec(method, threads=4, block_size=128 << 10)
    frames = [codec.encode(c) for c in real_chunks[:2]]

    def job(i: int) -> None:
        for r in range(rounds):
            chunk = real_chunks[(i + r) % 2]
            out = np.empty_like(chunk)
            codec.decode(frames[(i + r) % 2], out=out)
            assert np.array_equal(out, chunk)
            assert codec.encode(chunk) == frames[(i + r) % 2]

    with ThreadPoolExecutor(callers) as pool:
        list(pool.map(job, range(callers)))


@pytest.mark.parametrize("method", ["zstd", "fast"])
def test_busy_codec_threads_never_exceed_the_budget(real_chunks, method):
    """Also for the fast method, whose frames are coded a group of blocks per call."""
    budget().configure(2)
    budget().reset_peak()
    with BlockWatcher() as watch:
        _hammer(real_chunks, callers=12, rounds=3, method=method)
    assert watch.samples > 50
    assert watch.peak <= 2, f"{watch.peak} threads in block work at once with a budget of 2"
    assert watch.peak == 2, "the budget's two threads were never busy together"
    assert budget().stats()["peak_busy"] <= 2 and budget().stats()["busy"] == 0


def test_a_codec_with_its_own_budget_leaves_the_process_budget_alone(real_chunks):
    """``Codec(budget=...)``: its calls take tokens from that budget only, and its default thread
    count is that budget's limit; the process-wide budget is neither used nor reconfigured."""
    budget().configure(2)
    budget().reset_peak()
    own = CpuBudget(1)
    codec = Codec("fast", budget=own)
    assert codec.threads == 1
    out = np.empty_like(real_chunks[0])
    codec.decode(codec.encode(real_chunks[0]), out=out)
    assert np.array_equal(out, real_chunks[0])
    assert own.stats()["peak_busy"] == 1 and own.stats()["busy"] == 0
    assert budget().stats()["peak_busy"] == 0 and budget().configured == 2


def test_the_watcher_sees_a_larger_budget_used(real_chunks):
    """The same load under a budget of 8: more than 2 threads are seen in block work at once
    (so the test above would catch a budget that is not enforced, as the old per-Codec pools)."""
    budget().configure(8)
    with BlockWatcher() as watch:
        _hammer(real_chunks, callers=12, rounds=3)
    assert 2 < watch.peak <= 8


def test_caller_works_itself_when_the_pool_is_taken(real_chunks):
    """One token held elsewhere, budget 2: a call asking for 4 threads gets only its own and
    decodes every block itself; no helper thread runs, and it never waits for one."""
    budget().configure(2)
    codec = Codec(threads=4, block_size=64 << 10)
    frame = codec.encode(real_chunks[0])
    held, release = threading.Event(), threading.Event()

    def hog() -> None:
        with budget().hold():
            held.set()
            release.wait(60)

    hogger = threading.Thread(target=hog)
    hogger.start()
    try:
        assert held.wait(10)
        out = np.empty_like(real_chunks[0])
        with BlockWatcher() as watch:
            for _ in range(10):
                codec.decode(frame, out=out)
        assert np.array_equal(out, real_chunks[0])
        assert watch.names == {threading.current_thread().name}, watch.names
    finally:
        release.set()
        hogger.join()


def test_a_caller_waits_while_every_token_is_held(real_chunks):
    budget().configure(1)
    codec = Codec(threads=2)
    frame = codec.encode(real_chunks[0])
    done = threading.Event()

    def decode() -> None:
        codec.decode(frame)
        done.set()

    with budget().hold():
        worker = threading.Thread(target=decode)
        worker.start()
        assert not done.wait(0.3), "decoded while the only token was held"
        assert budget().stats()["busy"] == 1
    assert done.wait(30)
    worker.join()


def test_nested_holds_take_one_token():
    budget().configure(1)
    with budget().hold(), budget().hold():
        assert budget().stats()["busy"] == 1
    assert budget().stats()["busy"] == 0


def test_a_failing_block_gives_every_token_back(real_chunks):
    budget().configure(2)
    codec = Codec(threads=2, block_size=64 << 10)
    blob = bytearray(codec.encode(real_chunks[0]))
    blob[-100] ^= 0xFF
    for _ in range(5):
        with pytest.raises(KVShrinkError):
            codec.decode(bytes(blob))
    assert budget().stats()["busy"] == 0
    assert codec.decode(codec.encode(real_chunks[1])).tobytes() == real_chunks[1].tobytes()


def test_default_is_the_affinity_then_env_then_config(monkeypatch, tmp_path, shm_name):
    budget().configure(None)
    import os

    assert budget().limit() == cpu_count() == len(os.sched_getaffinity(0))
    monkeypatch.setenv(ENV, "3")
    assert budget().limit() == 3 and Codec().threads == 3
    assert Codec(threads=1).threads == 1
    cfg = {"engine": {"codec_threads": 1}, "tiers": [{"kind": "dram", "capacity": 8 << 20, "shm_name": shm_name}]}
    budget().reset_peak()
    with TieredStore.from_config(cfg) as store:  # the store's key sizes its own budget, not the process's
        assert store.engine.codec_budget.limit() == 1 and store.stats()["engine"]["codec_threads"] == 1
        assert store.tiers[0].codecs.parallel.threads == 1 and store.tiers[0].codecs.budget is store.engine.codec_budget
        assert budget().limit() == 3 and budget().configured is None and Codec().threads == 3
        store.put(b"k", np.arange(4096, dtype=np.float32)).result()
        assert store.get(b"k").tobytes() == np.arange(4096, dtype=np.float32).tobytes()
        assert budget().stats()["peak_busy"] == 0 and store.engine.codec_budget.stats()["peak_busy"] == 1
    with TieredStore.from_config({**cfg, "engine": {}}) as store:  # auto: the process's budget
        assert store.engine.codec_budget is budget() and store.stats()["engine"]["codec_threads"] == 3


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_bad_env_value_names_the_variable(monkeypatch, value):
    budget().configure(None)
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ConfigError) as err:
        Codec()
    assert err.value.key == ENV


@pytest.mark.parametrize("value", [0, -1, "two", True, 2.0])
def test_bad_config_value_names_the_key(value):
    tiers = [{"kind": "dram", "capacity": 8 << 20}]
    with pytest.raises(ConfigError) as err:
        StoreConfig.load({"engine": {"codec_threads": value}, "tiers": tiers})
    assert err.value.key == "engine.codec_threads"
    with pytest.raises(ConfigError):
        budget().configure(value)


def test_auto_in_config_means_no_override():
    tiers = [{"kind": "dram", "capacity": 8 << 20}]
    assert StoreConfig.load({"engine": {"codec_threads": "auto"}, "tiers": tiers}).engine.codec_threads is None
    assert StoreConfig.load({"engine": {"codec_threads": 3}, "tiers": tiers}).engine.codec_threads == 3


def test_helper_threads_stay_within_the_budget(real_chunks):
    """However many calls come and go, the pool never grows past limit - 1 threads."""
    budget().configure(3)
    _hammer(real_chunks, callers=8, rounds=2)
    helpers = [t for t in threading.enumerate() if t.name.startswith("kvshrink-codec")]
    pool = budget()._executor()
    assert len(pool._threads) <= 2, len(pool._threads)
    assert helpers
