"""Decoding a ``fast`` frame of 2-byte elements with the stream table validated once per frame.

Why: decoded through ``blocks.decode_block``, each 512 KiB block paid ~10 us of Python (stream
table lookups, payload views and checks) holding the GIL; on a kernel that decodes ~20 GB/s
from cache that was the part two threads could not share. Here the table of the whole frame is
checked in one compiled pass, and each worker decodes a contiguous group of blocks in one
``nogil`` kernel call that hashes each block right after decoding it, while the block is still in
the core's cache (hashing a whole group after decoding it read it back from memory). Where the
kernels cannot call xxhash's library (``_fastjit.verify_in_kernel`` False), it is a kernel call per
block followed by its checksum in Python (xxhash, also without the GIL).

Only frames whose every block is the fused case (high bytes as code pairs or packed planes, low
bytes stored) take this path; any other frame, or one whose table fails a check, gets None from
:func:`word_blocks` and is decoded block by block as before, which raises the precise ``CodecError``.
The compiled loops live in ``_fastjit`` (:func:`kernels`).

Buffers: reads the frame where it lies, writes only the caller's ``out``. Threads: a
``WordBlocks`` is read-only after construction; groups write disjoint slices of ``out``.
Errors: ``CodecError`` for a payload whose escape codes and exceptions disagree or a block whose
checksum does not match (the same messages as the block-by-block path).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from kvshrink.codec import packed
from kvshrink.codec.errors import CodecError
from kvshrink.codec.frame import PACKED, PAIRS, STORED, FrameHeader, StreamTable
from kvshrink.codec.lazy_kernels import LazyKernels

_kernels = LazyKernels("kvshrink.codec._fastjit")


def kernels():
    """The compiled per-block loops of fast frames, None when the numpy reference runs (then every
    frame is decoded block by block)."""
    return _kernels.get()


@dataclass(frozen=True)
class WordBlocks:
    """Per-block kernel arguments of a fast frame whose blocks are all fused word blocks."""

    blob: np.ndarray  # the frame, uint8
    header: FrameHeader
    checksums: np.ndarray  # uint64[nblocks]
    hi_off: np.ndarray  # int64[nblocks]: offset of the packed high-byte payload
    hi_len: np.ndarray
    lo_off: np.ndarray  # offset of the stored low bytes
    codings: np.ndarray  # int64[nblocks]: PAIRS or PACKED, the high stream's coding
    widths: np.ndarray  # int64[nblocks]
    bases: np.ndarray
    planes_len: np.ndarray  # bytes of the bit planes or of the code pairs

    def decode(self, kernels, out: np.ndarray, first: int, stop: int) -> None:
        """Decode blocks ``first..stop-1`` into ``out`` (uint16 over the whole frame) and verify
        them, each block hashed right after it is decoded, while it is still in the core's cache."""
        h = self.header
        rotate, elems = h.transform == "rotl1", h.block_elems
        if kernels.verify_in_kernel:  # the whole group in one call without the GIL
            status = kernels.decode_verify_word_blocks(self.blob, self.hi_off, self.hi_len, self.lo_off, self.codings,
                                                       self.widths, self.bases, self.planes_len, elems, out, rotate,
                                                       self.checksums, first, stop)
            if status:
                block, code = divmod(-status, 4)
                if code == kernels.ERR_CHECKSUM:
                    raise CodecError(f"checksum mismatch in block {block} of {h.nblocks} (corrupt payload)")
                raise packed.kernel_error(-code)
            return
        for b in range(first, stop):
            status = kernels.decode_word_blocks(self.blob, self.hi_off, self.hi_len, self.lo_off, self.codings,
                                                self.widths, self.bases, self.planes_len, elems, out, rotate, b, b + 1)
            if status:
                raise packed.kernel_error(-(-status % 4))
            if xxhash.xxh3_64_intdigest(out[b * elems:(b + 1) * elems]) != int(self.checksums[b]):
                raise CodecError(f"checksum mismatch in block {b} of {h.nblocks} (corrupt payload)")


def word_blocks(view: memoryview, header: FrameHeader, table: StreamTable, kernels) -> WordBlocks | None:
    """The kernel arguments for ``view``'s blocks, or None when the frame is not all fused word
    blocks or a payload header does not fit its block (then the block path reports it)."""
    if header.method != "fast" or header.itemsize != 2 or header.streams_per_block != 2 or not header.nblocks:
        return None
    codings = table.codings[:, 0].astype(np.int64)
    if not ((table.codings[:, 1] == STORED).all() and ((codings == PAIRS) | (codings == PACKED)).all()):
        return None
    blob = np.frombuffer(view, dtype=np.uint8)
    hi_off, hi_len = table.offsets[:, 0], table.sizes[:, 0]
    widths, bases, planes_len = (np.empty(header.nblocks, np.int64) for _ in range(3))
    if not kernels.word_block_args(blob, hi_off, hi_len, codings, header.block_elems, header.raw_size // 2,
                                   packed.HEADER, packed.MAX_WIDTH, widths, bases, planes_len):
        return None
    return WordBlocks(blob, header, table.checksums, hi_off, hi_len, table.offsets[:, 1], codings, widths, bases,
                      planes_len)
