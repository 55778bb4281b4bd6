"""Block parallelism: same bytes whatever the thread count, safe sharing of one Codec, errors surface."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kvshrink.codec import Codec, CodecError, decode
from kvshrink.codec.blocks import run_blocks


def test_multithreaded_encode_equals_single_threaded(real_chunks):
    for method in ("zstd", "qat", "fast"):
        with Codec(method=method, threads=1, block_size=128 << 10) as one, \
                Codec(method=method, threads=2, block_size=128 << 10) as two:
            for chunk in real_chunks[:2]:
                blob = two.encode(chunk)
                assert blob == one.encode(chunk), "block-parallel output must not depend on scheduling"
                assert one.decode(blob).tobytes() == chunk.tobytes()
                assert two.decode(blob).tobytes() == chunk.tobytes()


def test_block_size_changes_the_frame_not_the_data(real_chunks):
    kv = real_chunks[1]
    small, large = Codec(block_size=64 << 10, threads=2), Codec(block_size=4 << 20, threads=2)
    a, b = small.encode(kv), large.encode(kv)
    assert small.read_header(a).nblocks > large.read_header(b).nblocks
    assert large.decode(a).tobytes() == small.decode(b).tobytes() == kv.tobytes()
    small.close(), large.close()


def test_one_codec_shared_by_many_threads(real_chunks):
    """zstd contexts are per thread: concurrent calls on one Codec must not corrupt each other."""
    arrays = [real_chunks[i % 4][:, i % 7:(i % 7) + 8] for i in range(16)]
    tensors = [torch.from_numpy(np.ascontiguousarray(a)).view(torch.bfloat16) for a in arrays[:8]]
    work = arrays + tensors
    with Codec(threads=2, block_size=32 << 10) as codec, ThreadPoolExecutor(6) as callers:
        for _ in range(3):
            blobs = list(callers.map(codec.encode, work))
            back = list(callers.map(codec.decode, blobs))
            for x, y in zip(work, back):
                assert type(x) is type(y) and x.shape == y.shape
                if isinstance(x, torch.Tensor):
                    assert torch.equal(x.view(torch.int16), y.view(torch.int16))
                else:
                    assert np.array_equal(x, y)


def test_module_functions_from_many_threads(real_chunks):
    from kvshrink.codec import encode

    errors = []

    def job(i: int) -> None:
        x = real_chunks[i % 4][:, :2]
        try:
            assert decode(encode(x)).tobytes() == x.tobytes()
        except BaseException as exc:  # collect and re-raise in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_corrupt_block_error_surfaces_from_a_worker(real_chunks):
    with Codec(threads=2, block_size=256 << 10) as codec:
        blob = bytearray(codec.encode(real_chunks[0]))
        blob[-100] ^= 0xFF  # inside the last block, which a helper thread may decode
        with pytest.raises(CodecError):
            codec.decode(bytes(blob))
        assert codec.decode(codec.encode(real_chunks[0])).tobytes() == real_chunks[0].tobytes()


def test_run_blocks_stops_early_and_reraises():
    done = []

    def work(b: int) -> int:
        if b == 3:
            raise ValueError("block 3 is bad")
        done.append(b)
        return b

    with ThreadPoolExecutor(1) as pool:
        with pytest.raises(ValueError, match="block 3"):
            run_blocks(1000, work, pool, 2)
        assert len(done) < 1000
        assert run_blocks(50, lambda b: b * b, pool, 2) == [b * b for b in range(50)]
    assert run_blocks(0, lambda b: b, None, 4) == []


def test_close_and_reuse(real_chunks):
    codec = Codec(threads=2, block_size=64 << 10)
    blob = codec.encode(real_chunks[0])
    codec.close()
    assert codec.decode(blob).tobytes() == real_chunks[0].tobytes()  # a new pool starts on demand
    codec.close()
