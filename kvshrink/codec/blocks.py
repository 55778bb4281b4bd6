"""Independent blocks: the unit of parallel work, of checksumming and of per-stream decisions.

An input is cut into blocks of ``block_elems`` elements. Each block is split into its byte
streams; a stream is compressed when the sampled entropy of its byte position promised enough
(decided once per frame) *and* the compressed form is actually smaller, and stored otherwise.
Blocks share nothing, so worker threads run them in any order; ``run_blocks`` lets the calling
thread work too, so ``threads=2`` means two busy cores, not one waiting caller plus two workers.
How many threads a call may use is the process budget's to say (:mod:`kvshrink.codec.cpu_budget`).

Decoding writes straight into the caller's rows: a stored stream is read from the frame where it
lies, a compressed one is decompressed into a scratch buffer reused across calls (no new ``bytes``
per stream), then the streams are merged into the output. The ``fast`` method's common block, two
byte streams of which the high one is coded (code pairs, :mod:`kvshrink.codec.nibbles`, or packed
planes, :mod:`kvshrink.codec.packed`) and the low one stored, skips both steps: one fused kernel
writes the elements from the two payloads.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import numpy as np
import xxhash

from kvshrink.codec import backends, byteplanes, fast_frames, nibbles, packed
from kvshrink.codec.errors import CodecError
from kvshrink.codec.frame import NIBBLE, PACKED, PAIRS, STORED, FrameHeader, StreamTable, block_bounds, stream_length


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
    scratch: list = field(default_factory=list)  # pooled buffers the payloads view: ``release`` after use

    def release(self) -> None:
        """Give the pooled buffers back once the payloads have been copied into the frame; the
        payloads must not be used afterwards."""
        for buf in self.scratch:
            _scratch.give(buf)
        self.scratch, self.payloads = [], []


def take_scratch(block: EncodedBlock, n: int) -> np.ndarray:
    """A pooled uint8[n] buffer (fresh ones cost a page fault per 4 KiB: ~40 % of a fast encode)
    that ``block.release()`` gives back; the block's payloads may view it until then."""
    buf = _scratch.take(n)
    block.scratch.append(buf)
    return buf


def encode_block(rows: np.ndarray, plan: EncodePlan) -> EncodedBlock:
    """Split, then store or compress each stream of one block (``uint8[elements, width]``)."""
    checksum = xxhash.xxh3_64_intdigest(rows)
    if plan.method == "fast":
        return _encode_fast(rows, plan, checksum)
    if plan.method == "zstd" and plan.nstreams == 2 and plan.attempt == (True, False) and rows.shape[1] == 2:
        block = _encode_nibbles(rows, plan, checksum)
        if block is not None:
            return block
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


def _encode_nibbles(rows: np.ndarray, plan: EncodePlan, checksum: int) -> EncodedBlock | None:
    """2-byte elements whose high stream alone is worth compressing: the high bytes nibble-coded
    (one fused pass splits the words and codes them; zstd then sees half the symbols), the low
    bytes stored. None when the block's high bytes do not suit the coding (plain zstd then)."""
    block = EncodedBlock(checksum, [], [])
    coded = nibbles.encode_words(rows.reshape(-1).view("<u2"), plan.rotate, plan.level, partial(take_scratch, block))
    if coded is None:
        block.release()
        return None
    block.codings, block.payloads = [NIBBLE, STORED], list(coded)
    return block


def _encode_fast(rows: np.ndarray, plan: EncodePlan, checksum: int) -> EncodedBlock:
    """Pack the streams that the sample said are worth it, store the rest; for 2-byte elements
    with a compressible high byte only, one fused pass splits the words and codes the high bytes:
    as code pairs where the sample picks packing's 4-bit width (a window of 15 values: real KV), as
    packed planes otherwise."""
    elements = rows.shape[0]
    block = EncodedBlock(checksum, [], [])
    alloc = partial(take_scratch, block)
    if plan.nstreams == 2 and plan.attempt == (True, False):
        words = rows.reshape(-1).view("<u2")
        width, base, estimate = packed.choose_words(words, plan.rotate)
        if width == nibbles.PAIRS_WIDTH and estimate < elements:
            coded = nibbles.encode_pair_words(words, plan.rotate, base, alloc)
            if coded is not None:
                block.codings, block.payloads = [PAIRS, STORED], list(coded)
                return block
        payload, low = packed.encode_words(words, plan.rotate, elements, alloc)
        if payload is not None:
            block.codings, block.payloads = [PACKED, STORED], [payload, low]
            return block
    for stream, attempt in zip(byteplanes.split(rows, plan.rotate, plan.nstreams), plan.attempt):
        payload = packed.encode_stream(stream, stream.size, alloc) if attempt else None
        block.codings.append(STORED if payload is None else PACKED)
        block.payloads.append(stream if payload is None else payload)
    return block


def encode_fast_words(rows: np.ndarray, plan: EncodePlan, first: int, stop: int) -> list[EncodedBlock]:
    """Blocks ``first..stop-1`` of ``rows`` (the whole input, ``uint8[elements, 2]``) encoded as
    ``_encode_fast`` encodes them, byte for byte: sampling, choice and coding of a block in one
    ``nogil`` kernel call (through ``_encode_fast`` a block paid ~20 us of Python under the GIL).
    One pooled buffer holds the group's payloads; the first block's ``release`` gives it back.
    Needs the compiled kernels."""
    slot = fast_word_slot(plan)
    slots = _scratch.take(slot * (stop - first))
    result = np.empty((1, 2), np.int64)
    words = rows.reshape(-1).view("<u2")
    blocks = []
    for b in range(first, stop):  # a call per block: its checksum reads it while it is still in cache
        block_rows = rows[b * plan.block_elems:(b + 1) * plan.block_elems]
        at = (b - first) * slot
        size, coding = encode_fast_word_block(words, plan, b, slots[at:at + slot], result)
        if not coding:  # high bytes not worth coding here: the general path stores them
            blocks.append(encode_block(block_rows, plan))
            continue
        low = at + slot - plan.block_elems
        blocks.append(EncodedBlock(xxhash.xxh3_64_intdigest(block_rows), [coding, STORED],
                                   [slots[at:at + size], slots[low:low + block_rows.shape[0]]]))
    blocks[0].scratch.append(slots)
    return blocks


def fast_word_slot(plan: EncodePlan) -> int:
    """Bytes one block of ``encode_fast_word_block`` writes at most: the high-byte payload from
    the slot's start, the low bytes in its last ``block_elems`` bytes."""
    return packed.encode_buffer_size(plan.block_elems) + plan.block_elems


# The coding settings the fused word kernels take, in their argument order (``_fastjit``'s
# encode_word_blocks and encode_word_group).
WORD_CODING = (packed.ESCAPE_COST_BITS, packed.HEADER, packed.MAX_WIDTH, nibbles.MAX_ESCAPE_SHARE, packed.SAMPLE_RUNS,
               packed.SAMPLE_RUN)


def encode_fast_word_block(words: np.ndarray, plan: EncodePlan, b: int, slot: np.ndarray,
                           result: np.ndarray) -> tuple[int, int]:
    """Block ``b`` of ``words`` (uint16, the whole input) into ``slot`` (``fast_word_slot``
    bytes): (high payload bytes, PAIRS or PACKED), or (0, 0) when its high bytes are not worth
    coding (then nothing useful was written). ``result``: an int64[1, 2] the kernel writes."""
    fast_frames.kernels().encode_word_blocks(words, plan.rotate, plan.block_elems, b, b + 1, slot, slot.size,
                                             *WORD_CODING, result)
    size, coding = result[0].tolist()
    return size, coding


def fast_words_apply(plan: EncodePlan) -> bool:
    """Whether ``encode_fast_words`` encodes blocks of this plan (fast, 2-byte elements, only the
    high byte worth packing, compiled kernels present)."""
    return plan.method == "fast" and plan.nstreams == 2 and plan.attempt == (True, False) and \
        fast_frames.kernels() is not None


def decode_block(blob: memoryview, header: FrameHeader, table: StreamTable, block: int, rows: np.ndarray) -> None:
    """Decode ``block`` of the frame into ``rows`` (its slice of the output) and verify it."""
    codings = table.codings[block].tolist()
    if codings == [PACKED, STORED] and header.itemsize == 2:  # fused: straight into the caller's words
        (high, low), (h_len, l_len) = table.offsets[block].tolist(), table.sizes[block].tolist()
        packed.decode_words(blob[high:high + h_len], np.frombuffer(blob[low:low + l_len], dtype=np.uint8),
                            rows.reshape(-1).view("<u2"), header.transform == "rotl1")
        _verify(rows, table, block, header)
        return
    if codings == [PAIRS, STORED]:  # validated: 2-byte elements; fused straight into the caller's words
        (high, low), (h_len, l_len) = table.offsets[block].tolist(), table.sizes[block].tolist()
        nibbles.decode_pair_words(blob[high:high + h_len], np.frombuffer(blob[low:low + l_len], dtype=np.uint8),
                                  rows.reshape(-1).view("<u2"), header.transform == "rotl1")
        _verify(rows, table, block, header)
        return
    if codings == [NIBBLE, STORED]:  # validated: 2-byte elements; fused straight into the caller's words
        (high, low), (h_len, l_len) = table.offsets[block].tolist(), table.sizes[block].tolist()
        scratch = _scratch.take((rows.shape[0] + 1) // 2)
        try:
            nibbles.decode_words(blob[high:high + h_len], np.frombuffer(blob[low:low + l_len], dtype=np.uint8),
                                 rows.reshape(-1).view("<u2"), header.transform == "rotl1", scratch)
        finally:
            _scratch.give(scratch)
        _verify(rows, table, block, header)
        return
    start, stop = block_bounds(header, block)
    size = stream_length(header, stop - start)
    coded = sum(c != STORED for c in codings)
    scratch = _scratch.take(size * coded) if coded else None
    try:
        streams, used = [], 0
        for k, coding in enumerate(codings):
            offset, length = int(table.offsets[block, k]), int(table.sizes[block, k])
            payload = blob[offset:offset + length]
            if coding == STORED:
                data = backends.decompress(coding, payload, size)
            else:
                data = backends.decompress_into(coding, payload, scratch[used:used + size])
                used += size
            streams.append(np.frombuffer(data, dtype=np.uint8))
        byteplanes.merge(tuple(streams), header.transform == "rotl1", rows)
    finally:
        if scratch is not None:
            _scratch.give(scratch)
    _verify(rows, table, block, header)


def _verify(rows: np.ndarray, table: StreamTable, block: int, header: FrameHeader) -> None:
    if xxhash.xxh3_64_intdigest(rows) != int(table.checksums[block]):
        raise CodecError(f"checksum mismatch in block {block} of {header.nblocks} (corrupt payload)")


class ScratchPool:
    """Reusable uint8 buffers by exact size, shared by every thread (so a thread new to decoding
    reuses one a finished call gave back rather than allocating). Keeps at most ``per_size`` free
    buffers of a size and ``sizes`` distinct sizes. Thread-safe; a buffer belongs to whoever
    took it until it is given back."""

    def __init__(self, per_size: int = 16, sizes: int = 8) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._per_size, self._sizes = per_size, sizes
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return np.empty(nbytes, dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            free = self._free.get(buf.nbytes)
            if free is None:
                if len(self._free) >= self._sizes:
                    self._free.pop(next(iter(self._free)))  # the oldest size seen goes
                free = self._free[buf.nbytes] = []
            if len(free) < self._per_size:
                free.append(buf)


_scratch = ScratchPool()


def run_blocks(nblocks: int, work: Callable[[int], object], pool: Executor | None, threads: int,
               release: Callable[[], None] | None = None) -> list:
    """``[work(0), ..., work(nblocks-1)]``, spread over the caller and up to ``threads-1`` pool workers.

    The first exception stops the remaining blocks and is re-raised in the caller, once every
    helper has stopped. ``release`` (the budget's token return) is called exactly once for each of
    the ``min(threads, nblocks) - 1`` helpers: by the helper when it stops, or here when it never
    started (no pool, could not be queued, cancelled).
    """
    results: list = [None] * nblocks
    asked = max(0, min(threads, nblocks) - 1)
    if pool is None or asked == 0:
        for _ in range(asked if release is not None else 0):
            release()
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

    def helper() -> None:
        try:
            drain()
        finally:
            if release is not None:
                release()

    helpers = []
    try:
        for _ in range(asked):
            helpers.append(pool.submit(helper))
    except RuntimeError:  # the pool was shut down: the caller does those blocks itself
        pass
    if release is not None:
        for _ in range(asked - len(helpers)):
            release()
    try:
        drain()
    finally:
        # helpers that never started (busy machine) are cancelled rather than waited for
        errors = [None if _cancelled(f, release) else f.exception() for f in helpers]
    for exc in errors:
        if exc is not None:
            raise exc
    return results


def _cancelled(future: Future, release: Callable[[], None] | None) -> bool:
    """Cancel a helper that has not started; its token comes back here, since it never will run."""
    if not future.cancel():
        return False
    if release is not None:
        release()
    return True
