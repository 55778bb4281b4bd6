"""The SSD tier's on-disk index: a snapshot of every live chunk, then a log of PUT / DELETE records.

Why: a restart must find every complete chunk of a 100k-chunk directory in well under a second
without opening the chunks. Listing and opening 100k files cannot do that; reading one file of a
few MB can, if most of it parses in bulk. So the file is

* a **snapshot** (optional; written whole by compaction: temp file, fsync, rename): a header with
  its own CRC, then ``sizes u64[n] | key lengths u32[n] | keys`` parsed with numpy in one go;
* followed by **records** appended as chunks come and go:
  ``crc32 u32 | op u8 | key_len u32 | size u64 | key``. A torn tail (process killed mid-append)
  fails its CRC and is truncated away at open.

A PUT record is appended only *after* its chunk file was renamed into place, so the index never
names a file that was not complete, and a DELETE record only after the file is gone, so a rescan
never brings a deleted chunk back; the opposite gap (file renamed, record lost) is closed by
:meth:`~kvshrink.store.ssd.SsdTier.reconcile`. Compaction runs when the records after the snapshot
reach a quarter of the live chunks, which bounds the record-by-record part of a replay.

:meth:`IndexLog.fingerprint` names the file's exact content (length, the snapshot's CRC, a running
CRC of the records) at no extra read: the tier's clean-close marker records it, so an index that
was deleted, replaced by an older copy, truncated or corrupted while the tier was closed is told
apart from the one the tier closed with, and the chunk files are rescanned instead of trusted.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Callable

import numpy as np

from kvshrink.store.tier_base import LruIndex

RECORD = struct.Struct("<IBIQ")
PUT, DELETE = 1, 2
SNAPSHOT = struct.Struct("<4sIQQI")  # magic, version, count, keys bytes, crc32 of the body
SNAPSHOT_MAGIC = b"KVSI"
SNAPSHOT_VERSION = 1
COMPACT_MIN_RECORDS = 4096


def encode_record(op: int, key: bytes, size: int) -> bytes:
    body = RECORD.pack(0, op, len(key), size)[4:] + key
    return struct.pack("<I", zlib.crc32(body)) + body


def encode_snapshot(items: list[tuple[bytes, int]]) -> bytes:
    keys = b"".join(k for k, _ in items)
    body = (np.fromiter((s for _, s in items), dtype="<u8", count=len(items)).tobytes()
            + np.fromiter((len(k) for k, _ in items), dtype="<u4", count=len(items)).tobytes() + keys)
    return SNAPSHOT.pack(SNAPSHOT_MAGIC, SNAPSHOT_VERSION, len(items), len(keys), zlib.crc32(body)) + body


def read_snapshot(data: bytes) -> tuple[dict[bytes, int], int] | None:
    """(live key -> size, bytes consumed) from a leading snapshot; ({}, 0) when the file has none;
    None when a snapshot is there but damaged."""
    if not data.startswith(SNAPSHOT_MAGIC):
        return {}, 0
    if len(data) < SNAPSHOT.size:
        return None
    _, version, count, keys_len, crc = SNAPSHOT.unpack_from(data, 0)
    end = SNAPSHOT.size + 12 * count + keys_len
    if version != SNAPSHOT_VERSION or end > len(data) or zlib.crc32(memoryview(data)[SNAPSHOT.size:end]) != crc:
        return None
    sizes = np.frombuffer(data, dtype="<u8", count=count, offset=SNAPSHOT.size).tolist()
    lengths = np.frombuffer(data, dtype="<u4", count=count, offset=SNAPSHOT.size + 8 * count)
    if int(lengths.sum()) != keys_len:
        return None
    stops = (np.cumsum(lengths, dtype=np.int64) + (SNAPSHOT.size + 12 * count)).tolist()
    starts = [SNAPSHOT.size + 12 * count] + stops[:-1]
    return dict(zip([data[a:b] for a, b in zip(starts, stops)], sizes)), end


def replay(data: bytes) -> tuple[dict[bytes, int], int, int]:
    """Replay a whole index file: (live key -> size in write order, bytes of the valid prefix,
    records after the snapshot). A damaged snapshot yields nothing (reconcile rebuilds)."""
    live, valid, records, _ = _replay(data)
    return live, valid, records


def _replay(data: bytes) -> tuple[dict[bytes, int], int, int, int]:
    """:func:`replay`, plus where the snapshot ends (0: no snapshot)."""
    snapshot = read_snapshot(data)
    if snapshot is None:
        return {}, 0, 0, 0
    live, offset = snapshot
    snapshot_end = offset
    records, end = 0, len(data)
    unpack, crc32, head = RECORD.unpack_from, zlib.crc32, RECORD.size
    while offset + head <= end:
        crc, op, key_len, size = unpack(data, offset)
        stop = offset + head + key_len
        if stop > end or crc32(data[offset + 4 : stop]) != crc or op not in (PUT, DELETE):
            break  # torn or foreign tail: everything before it is intact
        key = data[offset + head : stop]
        live.pop(key, None)
        if op == PUT:
            live[key] = size
        records += 1
        offset = stop
    return live, offset, records, snapshot_end


class IndexLog:
    """Append handle on ``index.log``; not thread-safe (the tier holds its lock around calls)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        data = path.read_bytes() if path.exists() else b""
        self.recovered, valid, self.records, snapshot_end = _replay(data)
        self.damaged = bool(data) and valid == 0 and not self.recovered  # nothing usable in a non-empty file
        self.torn_bytes = len(data) - valid  # cut away below: a crash mid-append, or damage
        # the snapshot's CRC is in its header (read_snapshot checked it); the records are few
        self._snapshot_crc = SNAPSHOT.unpack_from(data, 0)[4] if snapshot_end else 0
        self._records_crc = zlib.crc32(memoryview(data)[snapshot_end:valid])
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        if valid != len(data):
            os.ftruncate(self._fd, valid)
        self._end = valid

    def fingerprint(self) -> str:
        """``length:snapshot crc:records crc`` of the file as this handle left it: a file that
        was cut, extended, replaced or altered since has another one (up to CRC collisions)."""
        return f"{self._end}:{self._snapshot_crc:08x}:{self._records_crc:08x}"

    def append(self, op: int, key: bytes, size: int) -> None:
        """Append one record; on failure (disk full) cut the log back so no torn record stays."""
        record = encode_record(op, key, size)
        try:
            written = os.pwrite(self._fd, record, self._end)
            if written != len(record):
                raise OSError(f"short write to {self.path}: {written} of {len(record)} bytes")
        except OSError:
            os.ftruncate(self._fd, self._end)
            raise
        self._end += len(record)
        self._records_crc = zlib.crc32(record, self._records_crc)
        self.records += 1

    def should_compact(self, live: int) -> bool:
        """True when the records after the snapshot reach a quarter of the live chunks."""
        return self.records >= max(COMPACT_MIN_RECORDS, live // 4)

    def compact(self, live_in_order: list[tuple[bytes, int]]) -> None:
        """Replace the file by a snapshot of the live chunks (temp file, fsync, rename)."""
        tmp = self.path.with_suffix(".compact")
        data = encode_snapshot(live_in_order)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY, 0o600)
        self._end = len(data)
        self._snapshot_crc, self._records_crc = SNAPSHOT.unpack_from(data, 0)[4], 0
        self.records = 0

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


class ChunkIndex:
    """The SSD tier's live index: key -> file size in eviction order, every change appended to
    ``index.log`` (:class:`IndexLog`) and compacted as the log grows.

    Not thread-safe: the tier calls it under its lock. A failed append (disk full) goes to
    ``on_error`` (the tier counts and logs it) and sets ``incomplete``: the files stay right, so
    does the entry in memory, and the tier writes no clean-close marker, so the next open rescans.
    """

    def __init__(self, path: Path, eviction: str, on_error: Callable[[OSError], None]) -> None:
        self.log = IndexLog(path)
        self.lru = LruIndex(eviction)
        self.lru.load(self.log.recovered)
        del self.log.recovered
        self.on_error = on_error
        self.incomplete = False
        # keys an untrusted index names whose file nobody has seen yet: a crash or a damaged index
        # may name files that are gone (a lost DELETE record, an older copy of the index restored)
        self.unverified: set[bytes] = set()

    def record(self, op: int, key: bytes, size: int) -> None:
        """Append a PUT or DELETE record; compact when the records outgrow the live chunks."""
        try:
            self.log.append(op, key, size)
            if self.log.should_compact(len(self.lru)):
                self.compact()
        except OSError as exc:
            self.incomplete = True
            self.on_error(exc)

    def add(self, key: bytes, size: int) -> None:
        """A complete file of ``key`` is in place: index it (its file is seen, so verified)."""
        self.lru.add(key, size)
        self.unverified.discard(key)
        self.record(PUT, key, size)

    def forget(self, key: bytes) -> bool:
        """Drop the entry of ``key`` (its file is gone or quarantined) and record it; whether there was one."""
        if self.lru.pop(key) is None:
            return False
        self.record(DELETE, key, 0)
        return True

    def compact(self) -> None:
        """Rewrite the log as one snapshot of the live entries (OSError propagates)."""
        self.log.compact(self.lru.items())
