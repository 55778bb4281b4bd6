"""Encoding a ``fast`` frame of 2-byte elements straight into the ``bytes`` it is returned as.

Why: the fused block kernel writes each block into a pooled scratch slot, and the frame writer
then copied every payload (~4.4 MB of a 5.9 MB chunk) into the frame: about a fifth of a one-thread
encode. Here each group of blocks is written into the frame itself. The frame is allocated at its
largest possible size (header, then ``fast_word_slot`` bytes a block); a block's low bytes, which
the kernel leaves at the end of its slot, are moved down behind its high payload while they are
still in the core's cache; a group starts right behind the one before it when that one has
finished, else at its own worst-case offset, and is moved down once all are done (a serial encode
moves nothing). The header goes in front, and the object is shrunk to the frame's size in place
(CPython's ``_PyBytes_Resize``, the documented companion of ``PyBytes_FromStringAndSize(NULL,
n)``; glibc shrinks the allocation without copying it). The bytes are the same as the scratch
path's, which still serves ``into=`` callers and other Pythons. Where the kernels can hash
(``_fastjit.verify_in_kernel``), one call codes, moves and hashes a group's blocks up to one the
general path must take.

Buffers: reads the caller's rows; writes only the new frame, which nothing else can see before it
is returned. Threads: groups run on the caller's budget and write disjoint ranges; placement is
decided under a lock. Errors: MemoryError when the shrink fails (the frame is then gone).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Callable

import numpy as np
import xxhash

from kvshrink.codec import fast_frames, frame_writer
from kvshrink.codec.blocks import WORD_CODING, EncodePlan, encode_block, encode_fast_word_block, fast_word_slot
from kvshrink.codec.dtypes import ArrayKind
from kvshrink.codec.frame import STORED, header_size, pack_header

RunGroups = Callable[[int, Callable[[int], object]], list]  # (count, work) -> results, on the budget

try:
    _resize = ctypes.pythonapi._PyBytes_Resize
    _resize.restype = ctypes.c_int
    _resize.argtypes = (ctypes.POINTER(ctypes.py_object), ctypes.c_ssize_t)
except (AttributeError, ValueError):  # not CPython
    _resize = None


def available() -> bool:
    """Whether frames can be built in place here (CPython's bytes API, the compiled kernels)."""
    return _resize is not None and frame_writer.can_make_fresh_bytes() and fast_frames.kernels() is not None


def encode_fast_frame(rows: np.ndarray, plan: EncodePlan, kind: ArrayKind, transform: str,
                      groups: list[tuple[int, int]], run_groups: RunGroups) -> bytes:
    """The ``fast`` frame of ``rows`` (``uint8[elements, 2]``, every block a fused word block or
    one the general path encodes), byte for byte what ``Codec._write_frame`` would join, as new
    ``bytes`` of exactly its size."""
    nblocks = groups[-1][1]
    slot = fast_word_slot(plan)
    head = header_size(kind, plan.nstreams, nblocks)
    made = frame_writer.fresh_bytes(head + nblocks * slot)
    assert made is not None  # available() said so
    frame, dest = made
    del made
    kernels = fast_frames.kernels()
    layout = _Layout(head, slot, groups)
    metas: list[list[tuple[int, list[int], list[int]]]] = [[] for _ in groups]

    def encode_group(g: int) -> None:
        start = layout.start(g)
        pos = start
        result = np.empty((1, 2), np.int64)
        words = rows.reshape(-1).view("<u2")
        b, stop = groups[g]
        while b < stop:
            if kernels.verify_in_kernel:  # every block up to one the general path must take, in one call
                b, pos = _encode_words(kernels, words, plan, b, stop, dest, pos, slot, metas[g])
                if b == stop:
                    break
                size, coding = 0, 0  # the kernel found block b's high bytes not worth coding
            else:
                size, coding = encode_fast_word_block(words, plan, b, dest[pos:pos + slot], result)
            block_rows = rows[b * plan.block_elems:(b + 1) * plan.block_elems]
            m = block_rows.shape[0]
            if coding:
                low = pos + slot - plan.block_elems
                _move_down(dest, low, pos + size, m)  # behind the high payload, while both are in cache
                sizes, codings = [size, m], [coding, STORED]
            else:  # high bytes not worth coding: the general path's payloads, copied in
                block = encode_block(block_rows, plan)
                try:
                    sizes, codings = frame_writer.put_payloads(dest, pos, block.payloads), block.codings
                finally:
                    block.release()
            metas[g].append((xxhash.xxh3_64_intdigest(block_rows), codings, sizes))
            pos += sum(sizes)
            b += 1
        layout.finished(g, start, pos - start)

    run_groups(len(groups), encode_group)
    end = layout.compact(dest)
    blocks = [meta for group in metas for meta in group]
    header = pack_header(kind, plan.method, transform, plan.nstreams, plan.block_elems,
                         [m[0] for m in blocks], [m[1] for m in blocks], [m[2] for m in blocks])
    assert len(header) == head
    dest[:head] = np.frombuffer(header, np.uint8)
    del dest  # a view of memory the shrink may move
    box = [frame]
    del frame
    return _shrink(box, end)


def _encode_words(kernels, words: np.ndarray, plan: EncodePlan, first: int, stop: int, dest: np.ndarray, pos: int,
                  slot: int, metas: list[tuple[int, list[int], list[int]]]) -> tuple[int, int]:
    """Blocks ``first..`` of a group coded by one ``encode_word_group`` call, their metadata
    appended to ``metas``: (the block it stopped at, the position behind the last one written)."""
    count = stop - first
    checksums, sizes, codings = np.empty(count, np.uint64), np.empty(count, np.int64), np.empty(count, np.int64)
    end, pos = kernels.encode_word_group(words, plan.rotate, plan.block_elems, first, stop, dest, pos, slot,
                                         *WORD_CODING, checksums, sizes, codings)
    n = words.size
    for b, checksum, size, coding in zip(range(first, end), checksums.tolist(), sizes.tolist(), codings.tolist()):
        metas.append((checksum, [coding, STORED], [size, min(plan.block_elems, n - b * plan.block_elems)]))
    return end, pos


class _Layout:
    """Where each group of blocks is written, and the moves that close the gaps afterwards."""

    def __init__(self, head: int, slot: int, groups: list[tuple[int, int]]) -> None:
        self._head, self._slot, self._groups = head, slot, groups
        self._lock = threading.Lock()
        self._written: dict[int, tuple[int, int]] = {}  # group -> (start, bytes)

    def start(self, g: int) -> int:
        """Right behind group ``g - 1`` when it has finished (its end is final), else ``g``'s own
        worst-case offset, which no earlier group can reach."""
        with self._lock:
            before = self._written.get(g - 1) if g else (self._head, 0)
        if before is not None:
            return before[0] + before[1]
        return self._head + self._groups[g][0] * self._slot

    def finished(self, g: int, start: int, used: int) -> None:
        with self._lock:
            self._written[g] = (start, used)

    def compact(self, dest: np.ndarray) -> int:
        """Move every group down behind the one before it; the frame's size."""
        end = self._head
        for g in range(len(self._groups)):
            start, used = self._written[g]
            _move_down(dest, start, end, used)
            end += used
        return end


def _move_down(dest: np.ndarray, src: int, to: int, count: int) -> None:
    """``dest[to:to + count] = dest[src:src + count]`` for ranges that may overlap (libc
    ``memmove``, called without the GIL)."""
    if src != to and count:
        base = dest.ctypes.data
        ctypes.memmove(base + to, base + src, count)


def _shrink(box: list, size: int) -> bytes:
    """The frame in ``box`` (its only reference, taken out) cut to its first ``size`` bytes in place."""
    frame = box.pop()
    if sys.getrefcount(frame) != 2:  # this name and the call's argument: anything more is a bug here
        raise RuntimeError("in-place frame is referenced elsewhere; refusing to resize it")
    holder = ctypes.py_object(frame)
    del frame
    if _resize(ctypes.byref(holder), size) != 0:  # pragma: no cover - only out of memory
        raise MemoryError(f"cannot shrink a frame to {size} bytes")
    return holder.value
