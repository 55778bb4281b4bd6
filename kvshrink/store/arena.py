"""A crash-consistent heap of byte blocks in one shared-memory file (``/dev/shm/<name>``).

Why a file in ``/dev/shm`` and not anonymous memory: the engine can restart, or a second process
can attach, and find every committed chunk again by walking the block headers — no side index.

Layout: a 4 KiB superblock, then contiguous blocks. Each block starts with a 64-byte header
(magic, state, size, frame length, sequence number, key length, then a CRC of every field but
magic and state, and of the key), then the key (padded to 64 bytes), then the payload. Every
mutation is ordered so that a process killed at any instruction leaves a walkable heap:

* allocate: write the remainder's FREE header first, then this block's WRITING header;
* commit: copy the payload, then flip ``state`` to COMMITTED (one aligned 4-byte store);
* free: flip ``state`` to FREE, then rewrite the (merged) free block's header, key cleared.

A header rewrite is several stores; the superblock notes which header is being rewritten, so a
crash's torn header is told apart from damage.

Opening for writing takes an exclusive ``flock`` before touching the file (a second owner never
resizes a live arena; the kernel drops the lock when the owner dies), then *reserves every page*
with ``posix_fallocate``: a tmpfs too small for the arena is a
:class:`~kvshrink.errors.StoreUnavailableError` at open naming the path, the size asked and the
free space — never a SIGBUS on the first store to a page tmpfs cannot back. A file the failed
open created is removed again. A reader refuses a file with holes for the same reason. (The
lock, the reservation and the holes check live in :mod:`kvshrink.store.shm_file`.)

Recovery (``scan``) trusts no header: one is *sound* when its magic, state, size (aligned, inside
the file) and CRC check out, and a WRITING / COMMITTED one also has a 1..MAX_KEY_BYTES key, a
sequence number and a size that fits its key and frame exactly as ``allocate`` made it. A torn
WRITING block is freed; of two COMMITTED blocks for one key the newer (higher sequence) wins. A
header that is not sound is *damaged*: the walk resumes at the next sound COMMITTED header (a
vectorised search of the aligned slots), everything in between becomes one free block, and its
offset is listed in :attr:`Arena.damaged` (the tier counts it as ``quarantined``). A damaged
block's chunk is lost; it is never listed, served or handed to eviction.

Superblock: a new file, another layout version, or a file whose size is neither the requested
capacity nor the one its superblock records (a capacity change) is zeroed and formatted. A
damaged superblock on a file of the right size is rewritten (counted as damage at offset 0) and
the blocks are recovered; a file shorter than its superblock says (truncated) is grown back and
the blocks past the cut are reclaimed. Payload integrity is the codec frame's checksum, checked
on every read.

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
from typing import Iterable

import numpy as np

from kvshrink.errors import CorruptDataError, StoreUnavailableError
from kvshrink.store.arena_space import FreeSpace, Room
from kvshrink.store.shm_file import open_owner, open_reader, reserve
from kvshrink.store.tier_base import MAX_KEY_BYTES

SUPERBLOCK = 4096
ALIGN = 64
HEADER = struct.Struct("<IIQQQI")  # magic, state, size, frame_len, seq, key_len; CRC follows
HEADER_SIZE = 64
_CRC_FROM, _CRC_AT = 8, HEADER.size  # the CRC covers size .. key_len, then the key
_SUPER = struct.Struct("<8sIQ")  # magic, version, arena size
_WRITING_AT = 24  # superblock: 1 + offset of the header being rewritten, 0 when none
SUPER_MAGIC = b"KVSARENA"
VERSION = 2  # 2: the header CRC covers the block size too
BLOCK_MAGIC = 0x4B56424B
FREE, WRITING, COMMITTED = 0, 1, 2
MIN_BLOCK = HEADER_SIZE + ALIGN
_RESYNC_WINDOW = 16 * 2**20  # bytes of arena one step of the damaged-header search looks at


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
    """The mapping, its block headers and their recovery; where blocks go is :class:`FreeSpace`'s.

    Errors at open: :class:`StoreUnavailableError` (owned by another live process, no room to
    reserve the pages, a reader finding holes), :class:`CorruptDataError` (too small for a block).
    """

    def __init__(self, path: Path, size: int, *, readonly: bool = False) -> None:
        self.path = path
        self.readonly = readonly
        self.space = FreeSpace()
        self.next_seq = 1
        self.damaged: list[int] = []  # offsets of the damaged headers the last scan() skipped
        self._pending_damage: list[int] = []
        created, existing, fresh = False, 0, False
        if readonly:
            self._fd = open_reader(path)
            size = os.fstat(self._fd).st_size
        size -= size % ALIGN  # every block is ALIGN-sized; so is the arena
        if size < SUPERBLOCK + MIN_BLOCK:
            if readonly:
                os.close(self._fd)
            raise CorruptDataError(f"arena {path}: {size} bytes is too small to hold one block")
        if not readonly:
            self._fd, created = open_owner(path)
        try:
            if not readonly:
                existing, fresh = self._prepare_file(size)
            self.mm = mmap.mmap(self._fd, size, access=mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE)
        except BaseException:
            if created:  # leave no half-made arena behind
                path.unlink(missing_ok=True)
            os.close(self._fd)  # also drops the owner lock
            raise
        self.size = size
        self.u8 = np.frombuffer(self.mm, dtype=np.uint8)
        self._limit = size  # where walks stop: the end, or an unusable tail found by scan()
        self._trusted = size  # leading bytes that hold what was written (less after a truncation)
        if not readonly:
            if fresh:
                if existing:  # zeros, not truncation (readers may map it): no stale header survives
                    self.u8[:] = 0
                self._format()
            else:
                self._trusted = self._adopt(min(existing, size))

    def fileno(self) -> int:
        return self._fd

    @property
    def free_by_start(self) -> dict[int, int]:
        """Free blocks, start -> size."""
        return self.space.by_start

    # -- opening ----------------------------------------------------------------------------------
    def _prepare_file(self, size: int) -> tuple[int, bool]:
        """Reserve the file's pages and say whether its content is kept. Returns (its size
        before, whether it must be emptied and formatted)."""
        existing = os.fstat(self._fd).st_size
        head = os.pread(self._fd, _SUPER.size, 0)
        magic, version, recorded = _SUPER.unpack(head) if len(head) == _SUPER.size else (b"", 0, 0)
        fresh = (existing == 0 or (magic == SUPER_MAGIC and version != VERSION)
                 or (existing != size and not (magic == SUPER_MAGIC and recorded == size)))
        if existing > size:
            os.ftruncate(self._fd, size)
        try:
            reserve(self._fd, self.path, size)
        except StoreUnavailableError:
            if 0 < existing < size:  # as it was: its chunks may still be wanted
                os.ftruncate(self._fd, existing)
            raise
        return existing, fresh

    def _adopt(self, written: int) -> int:
        """Keep an existing arena of the right capacity; repair a damaged superblock. Returns
        how many leading bytes were written by a previous owner (less than the size when the
        file had been truncated: blocks past the cut are reclaimed by scan)."""
        magic, version, recorded = _SUPER.unpack_from(self.mm, 0)
        if (magic, version, recorded) != (SUPER_MAGIC, VERSION, self.size):
            _SUPER.pack_into(self.mm, 0, SUPER_MAGIC, VERSION, self.size)
            self._pending_damage.append(0)
        return written - written % ALIGN

    # -- recovery -------------------------------------------------------------------------------
    def _format(self) -> None:
        self._write_header(SUPERBLOCK, FREE, self.size - SUPERBLOCK, 0, 0, b"")
        _SUPER.pack_into(self.mm, 0, SUPER_MAGIC, VERSION, self.size)

    def scan(self) -> list[Block]:
        """Walk every block; return the committed ones, oldest first. In write mode, also free
        torn (WRITING), stale and damaged blocks and rebuild the free lists. A reader never
        writes: it skips what the owner will repair."""
        self.damaged, self._pending_damage = self._pending_damage, []
        limit, trusted = self.size, self._trusted
        if self.readonly:
            magic, version, recorded = _SUPER.unpack_from(self.mm, 0)
            if magic == SUPER_MAGIC and version != VERSION:
                return []  # another layout: nothing here can be read
            if magic == SUPER_MAGIC:
                limit = trusted = min(self.size, recorded - recorded % ALIGN)
        torn = struct.unpack_from("<Q", self.mm, _WRITING_AT)[0] - 1  # a crash's, not damage
        committed: dict[bytes, Block] = {}
        stale: list[tuple[int, int]] = []
        self._limit = limit
        offset, max_seq = SUPERBLOCK, 0
        while offset < limit:
            sound = self._sound(offset, limit, trusted)
            if sound is None:
                if offset != torn:
                    self.damaged.append(offset)
                resume = self._next_committed(offset + MIN_BLOCK, trusted, limit)
                if resume - offset < MIN_BLOCK:  # an unusable tail: walks stop here
                    self._limit = offset
                    break
                if not self.readonly:
                    self._write_header(offset, FREE, resume - offset, 0, 0, b"")
                offset = resume
                continue
            state, size = sound
            if state == COMMITTED:
                _, _, _, frame_len, seq, key_len = HEADER.unpack_from(self.mm, offset)
                key = bytes(self.mm[offset + HEADER_SIZE : offset + HEADER_SIZE + key_len])
                block = Block(offset, size, frame_len, seq, key)
                max_seq = max(max_seq, seq)
                older = committed.get(key)
                if older is None or older.seq < seq:
                    committed[key] = block
                    if older is not None:
                        stale.append((older.offset, older.size))
                else:
                    stale.append((offset, size))
            elif state == WRITING:
                stale.append((offset, size))
            offset += size
        self.next_seq = max_seq + 1
        if not self.readonly:
            for start, size in stale:
                self._release(start, size)
            self._rebuild_free_lists()
            struct.pack_into("<Q", self.mm, _WRITING_AT, 0)
            self._trusted = self.size  # repaired: everything is as this owner wrote it
        return sorted(committed.values(), key=lambda b: b.seq)

    def _sound(self, offset: int, limit: int, trusted: int) -> tuple[int, int] | None:
        """(state, size) when the header at ``offset`` is one this module wrote, else None. A
        free block may reach ``limit``; a written one must end within ``trusted``."""
        magic, state, size, frame_len, seq, key_len = HEADER.unpack_from(self.mm, offset)
        if magic != BLOCK_MAGIC or state not in (FREE, WRITING, COMMITTED):
            return None
        if size < MIN_BLOCK or size % ALIGN or offset + size > (limit if state == FREE else trusted):
            return None
        if HEADER_SIZE + key_len > size or not self._header_crc_ok(offset, key_len):
            return None
        if state != FREE:
            need = block_size_for(key_len, frame_len)
            if not 0 < key_len <= MAX_KEY_BYTES or seq == 0 or not need <= size < need + MIN_BLOCK:
                return None
        return state, size

    def _next_committed(self, start: int, end: int, limit: int) -> int:
        """The first offset in [start, end) holding a sound COMMITTED header, else ``limit``:
        where a walk resumes after a damaged header (what lies between is free or lost). Looks
        at the magic word of each aligned slot with numpy, a window at a time."""
        words = self.u8.view(np.uint32)
        for low in range(start, end, _RESYNC_WINDOW):
            high = min(low + _RESYNC_WINDOW, end)
            for slot in np.flatnonzero(words[low // 4 : high // 4 : ALIGN // 4] == BLOCK_MAGIC):
                offset = low + int(slot) * ALIGN
                sound = self._sound(offset, limit, end)
                if sound is not None and sound[0] == COMMITTED:
                    return offset
        return limit

    def _rebuild_free_lists(self) -> None:
        self.space.clear()
        offset, run_start = SUPERBLOCK, None
        while offset < self._limit:
            _, state, size, *_ = HEADER.unpack_from(self.mm, offset)
            if state == FREE:
                if run_start is None:
                    run_start = offset
                else:  # coalesce adjacent free blocks
                    self._write_header(run_start, FREE, offset + size - run_start, 0, 0, b"")
            else:
                run_start = None
            offset += size
        offset = SUPERBLOCK
        while offset < self._limit:
            _, state, size, *_ = HEADER.unpack_from(self.mm, offset)
            if state == FREE:
                self.space.add(offset, size)
            offset += size

    # -- allocation -----------------------------------------------------------------------------
    def largest_free(self) -> int:
        return self.space.largest()

    def allocate(self, key: bytes, frame_len: int) -> Block | None:
        """Reserve a WRITING block for ``key``; None if no free block is large enough."""
        need = block_size_for(len(key), frame_len)
        found = self.space.best_fit(need)
        if found is None:
            return None
        start, size = found
        if size - need >= MIN_BLOCK:
            self._write_header(start + need, FREE, size - need, 0, 0, b"")
            self.space.add(start + need, size - need)
        else:
            need = size
        seq = self.next_seq
        self.next_seq += 1
        self._write_header(start, WRITING, need, frame_len, seq, key)
        return Block(start, need, frame_len, seq, key)

    def room_for(self, key_len: int, frame_len: int, candidates: Iterable[Block],
                 cheap: bytes | None = None) -> Room:
        """Which of ``candidates`` to free so that :meth:`allocate` succeeds (:meth:`FreeSpace.room_for`)."""
        return self.space.room_for(block_size_for(key_len, frame_len), candidates, cheap)

    def commit(self, block: Block, frame: bytes | memoryview) -> None:
        src = np.frombuffer(frame, dtype=np.uint8)
        self.u8[block.payload_offset : block.payload_offset + block.frame_len] = src
        self._set_state(block.offset, COMMITTED)

    def free(self, offset: int, size: int | None = None) -> bool:
        """Free the block at ``offset`` and merge it with free neighbours. ``size``: what the
        caller's index says (authoritative; without it the header is believed). Returns False
        when the header in the file was no longer sound or disagreed: damage the caller counts;
        the block is freed by the caller's size all the same, and its header rewritten."""
        sound = self._sound(offset, self.size, self.size)
        intact = sound is not None and sound[0] != FREE and (size is None or sound[1] == size)
        if size is None:
            size = struct.unpack_from("<Q", self.mm, offset + 8)[0]
        self._set_state(offset, FREE)
        offset, size = self.space.merged(offset, size)
        self._write_header(offset, FREE, size, 0, 0, b"")
        self.space.add(offset, size)
        return intact

    def payload(self, block: Block) -> np.ndarray:
        """A zero-copy view of a block's payload; valid until the block is freed."""
        return self.u8[block.payload_offset : block.payload_offset + block.frame_len]

    def still_holds(self, block: Block) -> bool:
        """For readers in another process: is this block still the committed copy of its key?"""
        magic, state, size, frame_len, seq, key_len = HEADER.unpack_from(self.mm, block.offset)
        return (magic == BLOCK_MAGIC and state == COMMITTED and seq == block.seq and size == block.size
                and frame_len == block.frame_len and key_len == len(block.key))

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
        # a header is several stores: note where, so that scan() tells a crash's torn header from damage
        struct.pack_into("<Q", self.mm, _WRITING_AT, offset + 1)
        HEADER.pack_into(self.mm, offset, BLOCK_MAGIC, state, size, frame_len, seq, len(key))
        if key:
            self.mm[offset + HEADER_SIZE : offset + HEADER_SIZE + len(key)] = key
        struct.pack_into("<I", self.mm, offset + _CRC_AT, self._crc(offset, len(key)))
        struct.pack_into("<Q", self.mm, _WRITING_AT, 0)

    def _crc(self, offset: int, key_len: int) -> int:
        fixed = bytes(self.mm[offset + _CRC_FROM : offset + HEADER.size])  # size, frame_len, seq, key_len
        return zlib.crc32(self.mm[offset + HEADER_SIZE : offset + HEADER_SIZE + key_len], zlib.crc32(fixed))

    def _header_crc_ok(self, offset: int, key_len: int) -> bool:
        if HEADER_SIZE + key_len > self.size - offset:
            return False
        return struct.unpack_from("<I", self.mm, offset + _CRC_AT)[0] == self._crc(offset, key_len)

    def _set_state(self, offset: int, state: int) -> None:
        struct.pack_into("<I", self.mm, offset + 4, state)

    def _release(self, offset: int, size: int) -> None:
        """Free a block in place (no merge): the state flip makes it free, the rewrite drops its
        key so no later state flip can bring the old chunk back."""
        self._set_state(offset, FREE)
        self._write_header(offset, FREE, size, 0, 0, b"")
