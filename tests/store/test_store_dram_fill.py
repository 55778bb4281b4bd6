"""How full a compressed DRAM tier stays with real KV chunks (kvshrink/store/arena.py, dram.py).

Issue 11: the arena held 15 chunks in 59.6 of 69.2 MB at the end of a replay. The space goes to
holes a little smaller than any chunk: a write whose least recently used victim leaves a hole a
few KB too small evicts a neighbour too, and the leftover (~one chunk minus the frame) fits no
later frame of near-equal size, so it travels with the eviction point. This pins the figure the
allocator reaches today (measured: steady-state mean 0.85, low 0.776 on an AVX2 EPYC; mean 0.879, low 0.747 on an
AVX-512 EPYC, whose model computes slightly different KV, hence other frame sizes; pinned at 0.82 / 0.74) and the LRU order; the
issue's target (>= 0.97) is not met yet (see the report of issue 11).
"""

from __future__ import annotations

import random
import uuid

import numpy as np
import pytest

from kvshrink.store.config import TierConfig
from kvshrink.store.dram import DramTier
from kvshrink.store.tier_codecs import FrameSet
from kvshrink.testing.fixtures.real_kv import real_kv_chunks

CAPACITY = 69_200_000  # the DRAM budget of the run that missed the capacity target


@pytest.fixture
def tier(shm_name):
    config = TierConfig(kind="dram", name="dram", capacity=CAPACITY, compressed=True,
                        shm_name=f"{shm_name}-{uuid.uuid4().hex[:8]}")
    tier = DramTier(config)
    yield tier
    tier.destroy()


@pytest.fixture(scope="module")
def chunks():
    return real_kv_chunks(16, 256) + real_kv_chunks(16, 128)


def test_fill_and_lru_with_real_compressed_chunks(tier, chunks):
    frames = [FrameSet(chunk=c).frame_for(tier) for c in chunks]
    assert len({len(f) for f in frames}) > 4  # sizes vary (two chunk lengths, two corpora)
    rng = random.Random(11)
    recent: list[bytes] = []
    utils: list[float] = []
    for n in range(300):
        if recent and rng.random() < 0.4:  # an agent re-reads a recent prefix
            key = recent[-1 - min(int(rng.expovariate(0.3)), len(recent) - 1)]
            assert tier.get(key) is not None
            recent.remove(key)
            recent.append(key)
            continue
        key = b"k%d" % n
        victims = {v.key for v in tier.write_frame(key, frames[rng.randrange(len(frames))])}
        youngest = set(recent[-4:])
        assert not victims & youngest, f"the 4 most recently used chunks were evicted: {victims & youngest}"
        recent = [k for k in recent if k not in victims] + [key]
        assert sorted(recent) == sorted(tier.keys())
        utils.append(tier.usage()[0] / tier.capacity_bytes)
    steady = utils[len(utils) // 3:]
    assert np.mean(steady) >= 0.82 and min(steady) >= 0.74, (np.mean(steady), min(steady))
