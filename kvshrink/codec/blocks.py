"""Independent blocks: the unit of parallel work, of checksumming and of per-stream decisions.

An input is cut into blocks of ``block_elems`` elements. Each block is split into its byte
streams; a stream is compressed when the sampled entropy of its byte position promised enough
(decided once per frame) *and* the compressed form is actually smaller, and stored otherwise.
Blocks share nothing, so worker threads run them in any order; ``run_blocks`` lets the calling
thread work too, so ``threads=2`` means two busy cores, not one waiting caller plus two workers.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable

import numpy as np
import xxhash

from kvshrink.codec import backends, byteplanes
from kvshrink.codec.errors import CodecError
from kvshrink.codec.frame import STORED, FrameHeader, StreamTable, block_bounds, stream_length


@dataclass(frozen=True)
class EncodePlan:
    method: str
    level: int
    hash_log: int | None
    attempt: tuple[bool, ...]  # per stream: does the sampled entropy promise enough to try compressing?
    rotate: bool
    nstreams: int
    block_elems: int


@dataclass
class EncodedBlock:
    checksum: int
    codings: list[int]
    payloads: list  # bytes or uint8 arrays, in stream order


def encode_block(rows: np.ndarray, plan: EncodePlan) -> EncodedBlock:
    """Split, then store or compress each stream of one block (``uint8[elements, width]``)."""
    checksum = xxhash.xxh3_64_intdigest(rows)
    streams = byteplanes.split(rows, plan.rotate, plan.nstreams)
    coding, compress = backends.compressor_for(plan.method, plan.level, plan.hash_log)
    codings, payloads = [], []
    for stream, attempt in zip(streams, plan.attempt):
        if coding != STORED and attempt:
            packed = compress(stream)
            if len(packed) < stream.size:
                codings.append(coding)
                payloads.append(packed)
                continue
        codings.append(STORED)
        payloads.append(stream)
    return EncodedBlock(checksum, codings, payloads)


def decode_block(blob: memoryview, header: FrameHeader, table: StreamTable, block: int, rows: np.ndarray) -> None:
    """Decode ``block`` of the frame into ``rows`` (its slice of the output) and verify it."""
    start, stop = block_bounds(header, block)
    size = stream_length(header, stop - start)
    streams = []
    for k in range(header.streams_per_block):
        offset, length = int(table.offsets[block, k]), int(table.sizes[block, k])
        data = backends.decompress(int(table.codings[block, k]), blob[offset:offset + length], size)
        streams.append(np.frombuffer(data, dtype=np.uint8))
    byteplanes.merge(tuple(streams), header.transform == "rotl1", rows)
    if xxhash.xxh3_64_intdigest(rows) != int(table.checksums[block]):
        raise CodecError(f"checksum mismatch in block {block} of {header.nblocks} (corrupt payload)")


def run_blocks(nblocks: int, work: Callable[[int], object], pool: Executor | None, threads: int) -> list:
    """``[work(0), ..., work(nblocks-1)]``, spread over the caller and up to ``threads-1`` pool workers.

    The first exception stops the remaining blocks and is re-raised in the caller.
    """
    results: list = [None] * nblocks
    if pool is None or threads <= 1 or nblocks <= 1:
        for b in range(nblocks):
            results[b] = work(b)
        return results
    counter = itertools.count()
    failed = threading.Event()

    def drain() -> None:
        for b in iter(counter.__next__, None):
            if b >= nblocks or failed.is_set():
                return
            try:
                results[b] = work(b)
            except BaseException:
                failed.set()
                raise

    helpers = [pool.submit(drain) for _ in range(min(threads, nblocks) - 1)]
    try:
        drain()
    finally:
        # helpers that never started (busy machine) are cancelled rather than waited for
        errors = [None if f.cancel() else f.exception() for f in helpers]
    for exc in errors:
        if exc is not None:
            raise exc
    return results
