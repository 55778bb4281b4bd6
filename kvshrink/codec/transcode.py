"""A ``fast`` frame re-coded as a ``zstd`` (dense) frame without decoding the chunk.

Why: a chunk the DRAM tier (fast) evicts is demoted to the SSD tier (dense) inside the put that
evicted it, so its re-encoding is on a put's path. Decoding the whole chunk and encoding it again
repeats work the fast frame already holds: its blocks keep the low bytes stored and only the
exponent stream coded. A block of code pairs already holds the nibble coding's codes: only zstd
runs, over the pair bytes. A block of packed planes has its exponents decoded (to bytes, not
merged into elements) and nibble-coded. The low bytes and each block's checksum (of the decoded
bytes, which do not change) are reused, and the frame keeps its transform and block size. The
result decodes to the same array; it need not be byte-identical to ``encode(chunk, method="zstd")``.

Threads: blocks are independent; any thread. Buffers: the returned blocks' stored payloads are
views of the frame being transcoded, which must stay alive until they are written. Errors: a
packed exponent stream that does not decode, or a payload that does not fit its block, raises
CodecError here; damage in the parts handed on unread (low bytes, code pairs) fails the reused
checksum, or the escape count, when the new frame is read, so it is never served.
"""

from __future__ import annotations

import numpy as np

from kvshrink.codec import backends, nibbles, packed
from kvshrink.codec.blocks import EncodedBlock, take_scratch
from kvshrink.codec.frame import NIBBLE, PACKED, PAIRS, STORED, ZSTD, FrameHeader, StreamTable, block_bounds


def fast_to_dense_applies(header: FrameHeader, table: StreamTable, method: str) -> bool:
    """Whether :func:`dense_block` re-codes every block of this frame for ``method``: a fast frame of
    2-byte elements split in two streams, the low one stored in every block."""
    if method != "zstd" or header.method != "fast" or header.itemsize != 2 or header.streams_per_block != 2:
        return False
    return bool((table.codings[:, 1] == STORED).all() and np.isin(table.codings[:, 0], (PAIRS, PACKED, STORED)).all())


def dense_block(view: memoryview, header: FrameHeader, table: StreamTable, block: int, level: int,
                hash_log: int | None) -> EncodedBlock:
    """Block ``block`` of a fast frame (see :func:`fast_to_dense_applies`) as a dense block: the
    exponents nibble-coded (plain zstd, or stored, where they do not suit it), the rest reused."""
    start, stop = block_bounds(header, block)
    n = stop - start
    (hi_at, lo_at), (hi_len, lo_len) = table.offsets[block].tolist(), table.sizes[block].tolist()
    result = EncodedBlock(int(table.checksums[block]), [], [])
    low = view[lo_at:lo_at + lo_len]
    if table.codings[block, 0] == PAIRS:
        coded = nibbles.dense_from_pairs(view[hi_at:hi_at + hi_len], n, level)
        if coded is not None:
            result.codings, result.payloads = [NIBBLE, STORED], [coded, low]
            return result
        high = take_scratch(result, n)  # a stream nibble coding does not take: its bytes, for plain zstd
        nibbles.decode_pair_stream(view[hi_at:hi_at + hi_len], high)
    elif table.codings[block, 0] == PACKED:
        high = take_scratch(result, n)
        packed.decode_stream(view[hi_at:hi_at + hi_len], high)
    else:
        high = np.frombuffer(view[hi_at:hi_at + hi_len], np.uint8)
    coded = nibbles.encode_stream(high, level, lambda size: take_scratch(result, size))
    if coded is not None:
        hi_coding, hi_payload = NIBBLE, coded
    else:
        compressed = backends.zstd_compress(high, level, hash_log)
        hi_coding, hi_payload = (ZSTD, compressed) if len(compressed) < n else (STORED, high)
    result.codings, result.payloads = [hi_coding, STORED], [hi_payload, low]
    return result
