"""The chunks of the randomized fault test (test_store_fault_fuzz.py), and the child process it kills.

Why chunks are made, not loaded: every read must say *which* put it returned. A chunk of key
``kid`` at ``version`` is a uint16 array (4..64 KiB, its size fixed per key) whose first four
elements are (MAGIC, kid, version low, version high) and whose other elements are a function of
(kid, version) with bf16-like byte statistics (the codec compresses it ~2.6x), so a read is
identified exactly, and a torn, mixed, foreign or stale chunk is told apart from the right one.

As a script: ``python fault_fuzz_worker.py CONFIG_JSON LOG SEED BASE N_KEYS HOT`` opens a
TieredStore on CONFIG and streams puts of versions BASE+1, BASE+2, ... (hot keys overwritten,
up to WINDOW puts in flight) until it is SIGKILLed. Each step is appended to LOG with one
``write()`` per line (a kill leaves whole lines; no fsync: the page cache outlives a process):
``I kid v`` before ``put()``, then ``C kid v`` (merged into the key's put in flight: not stored),
``A kid v`` (Future True), ``F kid v`` (Future False: engine full) or ``E kid v Type 0|1`` (Future
failed; 1: a KVShrinkError); ``D kid`` for each key a drop listener was told about; ``R`` once the store is open.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
from functools import partial
from typing import Any

import numpy as np

MAGIC = 0xF022
ROW = 256
MAX_ROWS = 128
NOISE_SPAN = 4096
_NOISE = np.random.default_rng(20240611).integers(0, 256, MAX_ROWS * ROW + NOISE_SPAN, dtype=np.uint32)
_RAMP = np.arange(MAX_ROWS * ROW, dtype=np.uint32)
WINDOW = 6  # puts in flight in the child


def key_of(kid: int) -> bytes:
    return b"k%03d" % kid


def kid_of(key: bytes) -> int | None:
    """The key id of a fuzz key, None for any other key (odd inputs, foreign keys)."""
    if len(key) == 4 and key[:1] == b"k" and key[1:].isdigit():
        return int(key[1:])
    return None


def rows_of(kid: int) -> int:
    return 8 + (kid * 7919) % (MAX_ROWS - 7)  # 8..128 rows of 256 uint16: 4..64 KiB


def make_chunk(kid: int, version: int) -> np.ndarray:
    """The one chunk (kid, version) stands for; version < 2**32."""
    n = rows_of(kid) * ROW
    h = (kid * 0x9E3779B1 + version * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF
    off = h % NOISE_SPAN
    low = (_NOISE[off : off + n] ^ ((_RAMP[:n] * (2 * kid + 1) + h) >> 3)) & 0x3F
    chunk = (low | 0x3C00).astype(np.uint16)
    chunk[:4] = (MAGIC, kid, version & 0xFFFF, version >> 16)
    return chunk.reshape(-1, ROW)


def identify(kid: int, got: Any) -> tuple[int | None, str]:
    """(version, "") when ``got`` is exactly some version of ``kid``; (None, what is wrong) else."""
    if not isinstance(got, np.ndarray) or got.dtype != np.uint16:
        return None, f"got {type(got).__name__} of dtype {getattr(got, 'dtype', '?')}, not a uint16 array"
    flat = got.reshape(-1)
    if flat.size < 4 or int(flat[0]) != MAGIC:
        return None, f"no chunk header (shape {got.shape}, first elements {flat[:4].tolist()})"
    if int(flat[1]) != kid:
        return None, f"the bytes of key k{int(flat[1]):03d}, not of k{kid:03d}"
    version = int(flat[2]) | int(flat[3]) << 16
    expected = make_chunk(kid, version)
    if got.shape != expected.shape:
        return None, f"header of version {version} but shape {got.shape}, expected {expected.shape}"
    differ = int(np.count_nonzero(got != expected))
    if differ:
        return None, f"header of version {version} but {differ} of {expected.size} elements differ"
    return version, ""


def _run(config: dict, log_path: str, seed: int, base: int, n_keys: int, hot: int) -> None:
    from kvshrink.errors import KVShrinkError
    from kvshrink.store import TieredStore

    rng = random.Random(seed)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def log(line: str) -> None:
        os.write(fd, (line + "\n").encode())

    def dropped(keys: list[bytes]) -> None:
        for key in keys:
            kid = kid_of(key)
            if kid is not None:
                log(f"D {kid}")

    def done(kid: int, version: int, future: Any) -> None:
        try:
            exc = future.exception()
            if exc is not None:
                log(f"E {kid} {version} {type(exc).__name__} {int(isinstance(exc, KVShrinkError))}")
            else:
                log(f"{'A' if future.result() else 'F'} {kid} {version}")
        finally:
            window.release()

    store = TieredStore.from_config(config)
    store.add_drop_listener(dropped)
    log("R")
    window = threading.BoundedSemaphore(WINDOW)
    versions: dict[int, int] = {}
    last: dict[int, Any] = {}
    while True:
        kid = rng.randrange(hot) if rng.random() < 0.6 else rng.randrange(n_keys)
        version = versions[kid] = versions.get(kid, base) + 1
        window.acquire()
        log(f"I {kid} {version}")
        future = store.put(key_of(kid), make_chunk(kid, version))
        if future is last.get(kid):
            log(f"C {kid} {version}")
            window.release()
            continue
        last[kid] = future
        future.add_done_callback(partial(done, kid, version))


if __name__ == "__main__":
    cfg, log_file, seed_arg, base_arg, keys_arg, hot_arg = sys.argv[1:7]
    _run(json.loads(cfg), log_file, int(seed_arg), int(base_arg), int(keys_arg), int(hot_arg))
