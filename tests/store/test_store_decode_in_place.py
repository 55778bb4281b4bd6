"""Reads decode straight from the tier's memory into the caller's buffer: no intermediate
``bytes`` of the frame or of the decoded chunk (nor of one of its codec blocks) is built.

tracemalloc sees every Python and numpy allocation. A load of four 5.9 MB chunks from the
compressed DRAM arena or the SSD must peak below a quarter of one codec block (128 KiB), and
write into the very buffers given. (Before decoding went into reused scratch, each block built
one ``bytes`` per compressed stream: a 1.35 MB peak for the same load.)
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from kvshrink.codec.codec import DEFAULT_BLOCK_SIZE
from kvshrink.codec.cpu_budget import budget
from kvshrink.store import TieredStore

MiB = 2**20
PEAK_LIMIT = DEFAULT_BLOCK_SIZE // 4


@pytest.fixture(autouse=True)
def restore_budget():
    before = budget().configured
    yield
    budget().configure(before)


def _store(kind: str, tmp_path, shm_name) -> TieredStore:
    tier = {"kind": "dram", "capacity": 64 * MiB, "compressed": True, "shm_name": shm_name} if kind == "dram" \
        else {"kind": "ssd", "capacity": 256 * MiB, "compressed": True, "path": str(tmp_path / "ssd"), "fsync": False}
    # fixed thread counts, so that warm-up meets every thread the measured loads use
    return TieredStore.from_config({"engine": {"read_workers": 1, "codec_threads": 2}, "promote_on_hit": False,
                                    "tiers": [tier]})


def _peak_of(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("kind", ["dram", "ssd"])
def test_get_many_decodes_into_the_callers_buffers_without_copies(kind, tmp_path, shm_name, real_chunks):
    chunks = real_chunks[:4]
    keys = [b"k%d" % i for i in range(len(chunks))]
    with _store(kind, tmp_path, shm_name) as store:
        assert all(store.put(k, c).result(timeout=60) for k, c in zip(keys, chunks))
        assert store.where(keys[0]) == kind
        outs = [np.zeros_like(c) for c in chunks]
        addresses = [o.ctypes.data for o in outs]
        for _ in range(3):  # warm-up: per-thread file buffers, zstd contexts, decode scratch
            store.get_many(keys, outs)
        for o in outs:
            o[:] = 0
        results: list = []
        peak = min(_peak_of(lambda: results.append(store.get_many(keys, outs))) for _ in range(3))
        assert all(r is o for r, o in zip(results[-1], outs)), "decoded into new arrays"
        assert [o.ctypes.data for o in outs] == addresses
        for o, c in zip(outs, chunks):
            assert np.array_equal(o, c)
        assert peak < PEAK_LIMIT, f"a load of {len(chunks)} chunks allocated {peak} bytes at its peak"


def test_torch_l1_buffer_is_written_in_place(tmp_path, shm_name, real_chunks):
    """The MP adapter's load path: a bf16 tensor (LMCache's L1 memory) as the destination."""
    chunk = torch.from_numpy(real_chunks[0]).view(torch.bfloat16)
    with _store("dram", tmp_path, shm_name) as store:
        assert store.put(b"t", chunk).result(timeout=60)
        out = torch.zeros_like(chunk)
        pointer = out.data_ptr()
        store.get_many([b"t"], [out])
        out.zero_()
        found: list = []
        peak = _peak_of(lambda: found.append(store.get_many([b"t"], [out])[0]))
        assert found[0] is out and out.data_ptr() == pointer
        assert torch.equal(out.view(torch.int16), chunk.view(torch.int16))
        assert peak < PEAK_LIMIT, peak
