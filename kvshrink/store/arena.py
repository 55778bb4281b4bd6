"""A crash-consistent heap of byte blocks in one shared-memory file (``/dev/shm/<name>``).

Why a file in ``/dev/shm`` and not anonymous memory: the engine can restart, or a second process
can attach, and find every committed chunk again by walking the block headers — no side index.

Layout: a 4 KiB superblock, then contiguous blocks. Each block starts with a 64-byte header
(magic, state, size, frame length, sequence number, key length, CRC of the immutable fields), then
the key (padded to 64 bytes), then the payload. Every mutation is ordered so that a process killed
at any instruction leaves a walkable heap:

* allocate: write the remainder's FREE header first, then this block's WRITING header;
* commit: copy the payload, then flip ``state`` to COMMITTED (one aligned 4-byte store);
* free: flip ``state`` to FREE, then merge neighbours by growing one ``size`` field.

A WRITING block found at open time is freed; of two COMMITTED blocks for one key the newer
(higher sequence) wins. Payload integrity is the codec frame's checksum, checked on every read.

Not thread-safe on its own: :class:`~kvshrink.store.dram.DramTier` serialises mutations.
"""

from __future__ import annotations

import gc
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from kvshrink.errors import CorruptDataError

SUPERBLOCK = 4096
ALIGN = 64
HEADER = struct.Struct("<IIQQQI")  # magic, state, size, frame_len, seq, key_len; CRC follows
HEADER_SIZE = 64
_CRC_AT = HEADER.size
_SUPER = struct.Struct("<8sIQ")  # magic, version, arena size
SUPER_MAGIC = b"KVSARENA"
VERSION = 1
BLOCK_MAGIC = 0x4B56424B
FREE, WRITING, COMMITTED = 0, 1, 2
MIN_BLOCK = HEADER_SIZE + ALIGN


def _round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def block_size_for(key_len: int, frame_len: int) -> int:
    """Bytes a block needs to hold a key and a frame of these lengths."""
    return HEADER_SIZE + _round_up(key_len) + _round_up(frame_len)


@dataclass
class Block:
    offset: int
    size: int
    frame_len: int
    seq: int
    key: bytes

    @property
    def payload_offset(self) -> int:
        return self.offset + HEADER_SIZE + _round_up(len(self.key))


class Arena:
    """The mapping plus a first-fit allocator over its free blocks."""

    def __init__(self, path: Path, size: int, *, readonly: bool = False) -> None:
        self.path = path
        self.readonly = readonly
        size -= size % ALIGN  # every block is ALIGN-sized; so is the arena
        flags = os.O_RDONLY if readonly else os.O_RDWR | os.O_CREAT
        self._fd = os.open(path, flags, 0o600)
        existing = os.fstat(self._fd).st_size
        if readonly:
            size = existing
        elif existing != size:
            os.ftruncate(self._fd, size)
        if size < SUPERBLOCK + MIN_BLOCK:
            os.close(self._fd)
            raise CorruptDataError(f"arena {path} has {size} bytes, too small to hold one block")
        self.size = size
        access = mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE
        self.mm = mmap.mmap(self._fd, size, access=access)
        self.u8 = np.frombuffer(self.mm, dtype=np.uint8)
        self.free_by_start: dict[int, int] = {}
        self.free_by_end: dict[int, int] = {}
        self.next_seq = 1
        if not readonly and (existing != size or not self._superblock_ok()):
            self._format()

    def fileno(self) -> int:
        return self._fd

    # -- recovery -------------------------------------------------------------------------------
    def _superblock_ok(self) -> bool:
        magic, version, size = _SUPER.unpack_from(self.mm, 0)
        return magic == SUPER_MAGIC and version == VERSION and size == self.size

    def _format(self) -> None:
        self._write_header(SUPERBLOCK, FREE, self.size - SUPERBLOCK, 0, 0, b"")
        _SUPER.pack_into(self.mm, 0, SUPER_MAGIC, VERSION, self.size)

    def scan(self) -> list[Block]:
        """Walk every block; return the committed ones. In write mode, also rebuild the free
        lists, free torn (WRITING) blocks and keep only the newest block of each key."""
        if not self._superblock_ok():
            if self.readonly:
                return []
            self._format()
        committed: dict[bytes, Block] = {}
        stale: list[int] = []
        self._limit = self.size
        offset, max_seq = SUPERBLOCK, 0
        while offset < self.size:
            magic, state, size, frame_len, seq, key_len = HEADER.unpack_from(self.mm, offset)
            if magic != BLOCK_MAGIC or size < MIN_BLOCK or size % ALIGN or offset + size > self.size:
                if self.readonly or self.size - offset < MIN_BLOCK:
                    self._limit = offset  # an unusable tail: walks stop here
                    break
                # a header we never wrote: everything from here on is unrecoverable; reclaim it
                self._write_header(offset, FREE, self.size - offset, 0, 0, b"")
                continue
            if state == COMMITTED and self._header_crc_ok(offset, key_len):
                key = bytes(self.mm[offset + HEADER_SIZE : offset + HEADER_SIZE + key_len])
                block = Block(offset, size, frame_len, seq, key)
                max_seq = max(max_seq, seq)
                older = committed.get(key)
                if older is None or older.seq < seq:
                    committed[key] = block
                    if older is not None:
                        stale.append(older.offset)
                else:
                    stale.append(offset)
            elif state != FREE:
                stale.append(offset)
            offset += size
        self.next_seq = max_seq + 1
        if not self.readonly:
            for start in stale:
                self._set_state(start, FREE)
            self._rebuild_free_lists()
        return sorted(committed.values(), key=lambda b: b.seq)

    def _rebuild_free_lists(self) -> None:
        self.free_by_start.clear()
        self.free_by_end.clear()
        offset, run_start = SUPERBLOCK, None
        while offset < self._limit:
            _, state, size, *_ = HEADER.unpack_from(self.mm, offset)
            if state == FREE:
                if run_start is None:
                    run_start = offset
                else:  # coalesce adjacent free blocks
                    struct.pack_into("<Q", self.mm, run_start + 8, offset + size - run_start)
            else:
                run_start = None
            offset += size
        offset = SUPERBLOCK
        while offset < self._limit:
            _, state, size, *_ = HEADER.unpack_from(self.mm, offset)
            if state == FREE:
                self.free_by_start[offset] = size
                self.free_by_end[offset + size] = offset
            offset += size

    # -- allocation -----------------------------------------------------------------------------
    def largest_free(self) -> int:
        return max(self.free_by_start.values(), default=0)

    def allocate(self, key: bytes, frame_len: int) -> Block | None:
        """Reserve a WRITING block for ``key``; None if no free block is large enough."""
        need = block_size_for(len(key), frame_len)
        fits = [(size, start) for start, size in self.free_by_start.items() if size >= need]
        if not fits:
            return None
        size, start = min(fits)  # best fit keeps large holes for large frames
        self._take_free(start)
        if size - need >= MIN_BLOCK:
            self._write_header(start + need, FREE, size - need, 0, 0, b"")
            self._add_free(start + need, size - need)
        else:
            need = size
        seq = self.next_seq
        self.next_seq += 1
        self._write_header(start, WRITING, need, frame_len, seq, key)
        return Block(start, need, frame_len, seq, key)

    def frees_needed(self, key_len: int, frame_len: int, candidates: Iterator[Block]) -> list[Block]:
        """Which of ``candidates`` (in order) must be freed before ``allocate`` can succeed:
        a dry run of :meth:`free` with its merges, touching nothing."""
        need = block_size_for(key_len, frame_len)
        by_start, by_end = dict(self.free_by_start), dict(self.free_by_end)
        chosen: list[Block] = []
        while not any(size >= need for size in by_start.values()):
            block = next(candidates, None)
            if block is None:
                break
            chosen.append(block)
            start, size = block.offset, block.size
            if start + size in by_start:
                size += by_start.pop(start + size)
                del by_end[start + size]
            if start in by_end:
                prev = by_end.pop(start)
                size += by_start.pop(prev)
                start = prev
            by_start[start] = size
            by_end[start + size] = start
        return chosen

    def commit(self, block: Block, frame: bytes | memoryview) -> None:
        src = np.frombuffer(frame, dtype=np.uint8)
        self.u8[block.payload_offset : block.payload_offset + block.frame_len] = src
        self._set_state(block.offset, COMMITTED)

    def free(self, offset: int) -> None:
        size = struct.unpack_from("<Q", self.mm, offset + 8)[0]
        self._set_state(offset, FREE)
        end = offset + size
        if end in self.free_by_start:  # merge with the next block
            next_size = self._take_free(end)
            size += next_size
            struct.pack_into("<Q", self.mm, offset + 8, size)
        if offset in self.free_by_end:  # merge into the previous block
            prev = self.free_by_end[offset]
            prev_size = self._take_free(prev)
            struct.pack_into("<Q", self.mm, prev + 8, prev_size + size)
            offset, size = prev, prev_size + size
        self._add_free(offset, size)

    def payload(self, block: Block) -> np.ndarray:
        """A zero-copy view of a block's payload; valid until the block is freed."""
        return self.u8[block.payload_offset : block.payload_offset + block.frame_len]

    def still_holds(self, block: Block) -> bool:
        """For readers in another process: is this block still the committed copy of its key?"""
        magic, state, size, frame_len, seq, key_len = HEADER.unpack_from(self.mm, block.offset)
        return magic == BLOCK_MAGIC and state == COMMITTED and seq == block.seq and frame_len == block.frame_len

    def close(self) -> None:
        del self.u8
        try:
            self.mm.close()
        except BufferError:
            # a view is still referenced, typically from a traceback held in a reference cycle
            # (a decode that failed on a worker); collect cycles and try once more
            gc.collect()
            try:
                self.mm.close()
            except BufferError:
                pass  # the mapping is released with its last view; the file is closed below
        os.close(self._fd)

    # -- header primitives ------------------------------------------------------------------------
    def _write_header(self, offset: int, state: int, size: int, frame_len: int, seq: int, key: bytes) -> None:
        HEADER.pack_into(self.mm, offset, BLOCK_MAGIC, state, size, frame_len, seq, len(key))
        if key:
            self.mm[offset + HEADER_SIZE : offset + HEADER_SIZE + len(key)] = key
        struct.pack_into("<I", self.mm, offset + _CRC_AT, self._crc(offset, len(key)))

    def _crc(self, offset: int, key_len: int) -> int:
        fixed = bytes(self.mm[offset + 16 : offset + HEADER.size])  # frame_len, seq, key_len
        return zlib.crc32(self.mm[offset + HEADER_SIZE : offset + HEADER_SIZE + key_len], zlib.crc32(fixed))

    def _header_crc_ok(self, offset: int, key_len: int) -> bool:
        if HEADER_SIZE + key_len > self.size - offset:
            return False
        return struct.unpack_from("<I", self.mm, offset + _CRC_AT)[0] == self._crc(offset, key_len)

    def _set_state(self, offset: int, state: int) -> None:
        struct.pack_into("<I", self.mm, offset + 4, state)

    def _add_free(self, start: int, size: int) -> None:
        self.free_by_start[start] = size
        self.free_by_end[start + size] = start

    def _take_free(self, start: int) -> int:
        size = self.free_by_start.pop(start)
        del self.free_by_end[start + size]
        return size
