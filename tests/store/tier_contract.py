"""The contract every tier fulfils (kvshrink/store/tier_base.py docstring), as tests a tier mixes in.

A test class for a tier subclasses :class:`TierContract` and provides three fixtures-backed
hooks: ``make_tier(capacity=None)`` builds a tier (closed at teardown), ``reopen(tier)`` closes it
and opens the same storage again, ``corrupt(tier, key, how)`` damages the stored bytes of one
chunk the way a failing medium would (``"flip"``: bytes changed, ``"truncate"``: cut short).
Bounded tiers set ``bounded = True`` and get the eviction tests too.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvshrink.codec import OutputMismatchError, encode, read_header
from kvshrink.store.tier_base import MAX_KEY_BYTES, Tier
from kvshrink.store.tier_codecs import FrameSet

HOSTILE_KEYS = [b"../../../../etc/passwd", b"/tmp/absolute", b"..", b".", b"a/b\\c", b"\x00\xff\x00",
                b"%2e%2e%2f", b"~root", b"CON", b"*?[]", b"x" * MAX_KEY_BYTES, b"\n\r\t "]


def encode_for(chunk: np.ndarray, tier: Tier) -> bytes:
    """The frame the store would write to ``tier`` for ``chunk`` (its method and level)."""
    return FrameSet(chunk=chunk).frame_for(tier)


def put(tier: Tier, key: bytes, chunk: np.ndarray) -> list:
    return tier.write_frame(key, encode_for(chunk, tier), keep_victims=True)


def frame_size(tier: Tier, chunk: np.ndarray) -> int:
    return len(encode_for(chunk, tier))


class TierContract:
    bounded = True

    # -- hooks the tier's test class provides ---------------------------------------------------
    @pytest.fixture
    def make_tier(self):
        raise NotImplementedError

    @pytest.fixture
    def reopen(self):
        raise NotImplementedError

    @pytest.fixture
    def corrupt(self):
        raise NotImplementedError

    # -- round trips ----------------------------------------------------------------------------
    def test_round_trip_is_bit_exact(self, make_tier, small_chunks):
        tier = make_tier()
        for i, chunk in enumerate(small_chunks[:4]):
            put(tier, b"k%d" % i, chunk)
        for i, chunk in enumerate(small_chunks[:4]):
            got = tier.get(b"k%d" % i)
            assert got.dtype == chunk.dtype and got.shape == chunk.shape
            assert np.array_equal(got, chunk)
        assert tier.stats()["hits"] == 4

    def test_torch_chunk_comes_back_as_torch(self, make_tier, small_chunks):
        torch = pytest.importorskip("torch")
        tier = make_tier()
        tensor = torch.from_numpy(small_chunks[0].copy()).view(torch.bfloat16)
        put(tier, b"t", tensor)
        got = tier.get(b"t")
        assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.uint16), tensor.view(torch.uint16))

    def test_get_into_caller_buffer(self, make_tier, small_chunks):
        tier = make_tier()
        put(tier, b"k", small_chunks[1])
        out = np.zeros_like(small_chunks[1])
        assert tier.get(b"k", out=out) is out
        assert np.array_equal(out, small_chunks[1])

    def test_wrong_output_buffer_is_a_caller_error_not_corruption(self, make_tier, small_chunks):
        tier = make_tier()
        put(tier, b"k", small_chunks[0])
        with pytest.raises(OutputMismatchError):
            tier.get(b"k", out=np.zeros(10, dtype=np.uint16))
        assert tier.stats()["quarantined"] == 0
        assert np.array_equal(tier.get(b"k"), small_chunks[0])

    def test_header_tells_shape_and_dtype_before_allocating(self, make_tier, small_chunks):
        tier = make_tier()
        put(tier, b"k", small_chunks[2])
        header = tier.header(b"k")
        assert tuple(header.shape) == small_chunks[2].shape
        assert header.dtype == read_header(encode(small_chunks[2])).dtype
        assert tier.header(b"missing") is None

    def test_miss_is_none_and_counted(self, make_tier):
        tier = make_tier()
        assert tier.get(b"nothing") is None
        assert not tier.contains(b"nothing")
        assert tier.stats()["misses"] == 1

    def test_overwrite_replaces(self, make_tier, small_chunks):
        tier = make_tier()
        put(tier, b"k", small_chunks[0])
        put(tier, b"k", small_chunks[1])
        assert np.array_equal(tier.get(b"k"), small_chunks[1])
        assert tier.keys().count(b"k") == 1

    def test_delete(self, make_tier, small_chunks):
        tier = make_tier()
        put(tier, b"k", small_chunks[0])
        assert tier.contains(b"k")
        assert tier.delete(b"k") is True
        assert tier.delete(b"k") is False
        assert tier.get(b"k") is None and not tier.contains(b"k")

    def test_keys_lists_what_is_stored(self, make_tier, small_chunks):
        tier = make_tier()
        for i in range(3):
            put(tier, b"key-%d" % i, small_chunks[i])
        assert sorted(tier.keys()) == [b"key-0", b"key-1", b"key-2"]

    def test_hostile_keys_are_plain_keys(self, make_tier, small_chunks):
        tier = make_tier()
        for i, key in enumerate(HOSTILE_KEYS):
            put(tier, key, small_chunks[i % 4])
        for i, key in enumerate(HOSTILE_KEYS):
            assert np.array_equal(tier.get(key), small_chunks[i % 4]), key

    # -- integrity --------------------------------------------------------------------------------
    @pytest.mark.parametrize("how", ["flip", "truncate"])
    def test_corrupt_chunk_is_a_counted_miss_then_gone(self, make_tier, corrupt, small_chunks, how):
        tier = make_tier()
        put(tier, b"bad", small_chunks[0])
        put(tier, b"good", small_chunks[1])
        corrupt(tier, b"bad", how)
        assert tier.get(b"bad") is None
        stats = tier.stats()
        assert stats["quarantined"] == 1 and stats["misses"] == 1
        assert not tier.contains(b"bad") and tier.get(b"bad") is None
        assert np.array_equal(tier.get(b"good"), small_chunks[1])
        put(tier, b"bad", small_chunks[2])  # the key is usable again
        assert np.array_equal(tier.get(b"bad"), small_chunks[2])

    def test_corrupt_chunk_never_fills_a_caller_buffer_silently(self, make_tier, corrupt, small_chunks):
        tier = make_tier()
        put(tier, b"bad", small_chunks[0])
        corrupt(tier, b"bad", "flip")
        assert tier.get(b"bad", out=np.zeros_like(small_chunks[0])) is None

    def test_survives_reopen(self, make_tier, reopen, small_chunks):
        tier = make_tier()
        for i in range(3):
            put(tier, b"k%d" % i, small_chunks[i])
        tier = reopen(tier)
        for i in range(3):
            assert np.array_equal(tier.get(b"k%d" % i), small_chunks[i])

    def test_threads_write_and_read_concurrently(self, make_tier, small_chunks):
        tier = make_tier()
        errors: list[BaseException] = []

        def worker(offset: int) -> None:
            try:
                for round_ in range(3):
                    for i in range(4):
                        key = b"t%d-%d" % (offset, i)
                        put(tier, key, small_chunks[(offset + i + round_) % len(small_chunks)])
                        got = tier.get(key)
                        assert got is None or np.array_equal(got, small_chunks[(offset + i + round_) % len(small_chunks)])
            except BaseException as exc:  # collected and re-raised in the main thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert tier.stats()["quarantined"] == 0

    def test_bad_keys_are_rejected_before_storing(self, make_tier, small_chunks):
        from kvshrink.store.tier_base import check_key

        for bad, error in (("text", TypeError), (b"", ValueError), (b"x" * (MAX_KEY_BYTES + 1), ValueError)):
            with pytest.raises(error):
                check_key(bad)

    # -- eviction -------------------------------------------------------------------------------
    def test_lru_eviction_returns_victims_oldest_first(self, make_tier, small_chunks):
        if not self.bounded:
            pytest.skip("this tier delegates eviction to its server")
        probe = make_tier()
        room = int(frame_size(probe, small_chunks[0]) * 3.5)
        tier = make_tier(capacity=room)
        for i in range(3):
            put(tier, b"k%d" % i, small_chunks[i])
        tier.get(b"k0")  # k0 is now the most recently used
        victims = put(tier, b"k3", small_chunks[3])
        assert [v.key for v in victims] == [b"k1"]
        assert victims[0].frame is not None and np.array_equal(_decode(victims[0].frame), small_chunks[1])
        assert tier.contains(b"k0") and not tier.contains(b"k1")
        assert tier.stats()["evictions"] == 1
        assert tier.usage()[0] <= room

    def test_pinned_chunks_are_not_evicted(self, make_tier, small_chunks):
        if not self.bounded:
            pytest.skip("this tier delegates eviction to its server")
        probe = make_tier()
        room = int(frame_size(probe, small_chunks[0]) * 2.5)
        pinned = {b"k0"}
        tier = make_tier(capacity=room, is_pinned=pinned.__contains__)
        put(tier, b"k0", small_chunks[0])
        put(tier, b"k1", small_chunks[1])
        victims = put(tier, b"k2", small_chunks[2])
        assert [v.key for v in victims] == [b"k1"] and tier.contains(b"k0")

    def test_chunk_larger_than_the_tier_is_refused(self, make_tier, small_chunks):
        if not self.bounded:
            pytest.skip("this tier delegates eviction to its server")
        from kvshrink.errors import StoreUnavailableError

        tier = make_tier(capacity=frame_size(make_tier(), small_chunks[0]) // 2)
        with pytest.raises(StoreUnavailableError):
            put(tier, b"big", small_chunks[0])
        assert tier.stats()["errors"] == 1


def _decode(frame):
    from kvshrink.codec import decode

    return decode(frame)
