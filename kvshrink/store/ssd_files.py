"""The SSD tier's directory on disk: its layout, the chunk file format, and who owns it.

Layout under the tier's ``path``::

    LOCK               flock'ed by the owner too, and holds its pid (see below)
    CLEAN              present only between a clean close and the next open (ssd_recovery.py)
    index.log          see ssd_index.py
    chunks/ab/<40 hex>.kvc   blake2b(key) names: no caller byte ever reaches a path
    tmp/               writes in progress (deleted at open: torn writes never become chunks)
    quarantine/        files that failed verification, moved aside for inspection

A chunk file is ``KVSC | version | key_len | key | codec frame``. Writes go to ``tmp/`` and are
renamed into place, so a reader sees the old file or the new one, never a torn one.

**One owner.** The owning process holds an exclusive ``flock`` on the directory itself (an
``O_RDONLY`` descriptor of ``path``) and one on ``LOCK``, so a second process (or a second tier in
this one) is refused with :class:`~kvshrink.errors.StoreUnavailableError` while the owner lives;
the kernel drops both when the owner dies, even by SIGKILL. A lock on a file alone would not do:
deleting ``LOCK`` by hand leaves the owner locking a nameless file, and a second process would
lock the new ``LOCK`` it creates and corrupt the directory alongside the first. The directory's
lock cannot be deleted from under a live owner, so deleting ``LOCK`` by hand changes nothing
(the next owner creates it again); removing or renaming the whole directory does, but then the
owner's files go with it. Where the file system cannot flock a directory (NFS emulates flock with
POSIX locks, which need a file open for writing) the tier says so in the log and relies on
``LOCK`` alone, which then must not be deleted while the tier runs.

Contract: functions only, no state; safe from any thread (the tier serialises what must be).
Buffers: ``write_chunk_file`` reads ``frame`` before it returns and keeps nothing;
``read_chunk_file`` returns a view of a per-thread buffer, valid until that thread's next read.
Errors: ``OSError`` propagates unless a function says otherwise.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import struct
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from kvshrink.errors import StoreUnavailableError

log = logging.getLogger(__name__)

FILE_HEADER = struct.Struct("<4sHHI")  # magic, version, reserved, key_len
FILE_MAGIC = b"KVSC"
FILE_VERSION = 1
SUFFIX = ".kvc"
LOCK_FILE = "LOCK"


def chunk_name(key: bytes) -> str:
    """Fixed-length hex name: the only thing derived from a key that touches the file system."""
    return hashlib.blake2b(key, digest_size=20).hexdigest()


def file_prefix(key: bytes) -> bytes:
    return FILE_HEADER.pack(FILE_MAGIC, FILE_VERSION, 0, len(key)) + key


def parse_prefix(data: Any) -> bytes | None:
    """The key stored in a chunk file's header, or None if the header is not ours."""
    if len(data) < FILE_HEADER.size:
        return None
    magic, version, _, key_len = FILE_HEADER.unpack_from(data, 0)
    if magic != FILE_MAGIC or version != FILE_VERSION or FILE_HEADER.size + key_len > len(data):
        return None
    return bytes(data[FILE_HEADER.size : FILE_HEADER.size + key_len])


def chunk_files(chunks_dir: Path) -> Iterator[os.DirEntry]:
    """Every entry of the ``chunks/ab/`` sub-directories (chunk files and strays alike)."""
    for sub in os.scandir(chunks_dir):
        if sub.is_dir():
            yield from os.scandir(sub.path)


def quarantine_path(quarantine_dir: Path, path: Path) -> Path:
    """Where a chunk file that failed verification is moved: a fresh name, never overwritten."""
    return quarantine_dir / f"{path.stem}.{time.time_ns()}{SUFFIX}"


def clear_tmp(tmp_dir: Path) -> None:
    for entry in os.scandir(tmp_dir):
        os.unlink(entry.path)  # torn writes and half-evicted victims from a killed process


def own_directory(root: Path, name: str) -> list[int]:
    """Descriptors holding exclusive flocks on ``root`` itself and on its ``LOCK`` (see the module
    docstring); StoreUnavailableError if another live process owns either (``name``: the tier's,
    for messages)."""
    held: list[int] = []
    try:
        held.append(os.open(root, os.O_RDONLY | os.O_DIRECTORY))
        try:
            _flock(held[-1])
        except BlockingIOError:
            raise
        except OSError as exc:  # NFS emulates flock by POSIX locks, which need a writable file
            os.close(held.pop())
            log.warning("tier %s: cannot flock the directory %s (%s); relying on the LOCK file alone, "
                        "which must then not be deleted while the tier runs", name, root, exc)
        held.append(os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600))
        _flock(held[-1])
        os.ftruncate(held[-1], 0)
        os.pwrite(held[-1], f"{os.getpid()}\n".encode(), 0)
    except BlockingIOError as exc:
        release_directory(held)
        owner = _read_note(root / LOCK_FILE)
        raise StoreUnavailableError(f"tier {name}: {root} is owned by another live process"
                                    f"{f' (pid {owner})' if owner else ''}") from exc
    except OSError as exc:
        release_directory(held)
        raise StoreUnavailableError(f"tier {name}: cannot lock directory {root}: {exc}") from exc
    return held


def release_directory(fds: list[int]) -> None:
    """Close the descriptors :func:`own_directory` returned: the flocks go with them."""
    for fd in fds:
        os.close(fd)
    fds.clear()


def write_chunk_file(tmp: Path, final: Path, prefix: bytes, frame: Any, fsync: bool,
                     rename_lock: AbstractContextManager) -> None:
    """Write ``prefix + frame`` to ``tmp``, then rename it to ``final`` under ``rename_lock`` (so
    a quarantine's "is it still the file I read" check cannot race the rename). ``fsync``: the
    file before the rename and its directory after it. On failure ``tmp`` is removed."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        write_all(fd, prefix)
        write_all(fd, frame)
        if fsync:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        final.parent.mkdir(exist_ok=True)
        with rename_lock:
            os.replace(tmp, final)
        if fsync:
            fsync_dir(final.parent)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise


def read_chunk_file(fd: int, tls: threading.local) -> memoryview:
    """The whole file behind ``fd`` in ``tls``'s reusable buffer (no page faults on fresh
    memory); records the file's inode in ``tls.inode`` for a later quarantine check."""
    stat = os.fstat(fd)
    tls.inode = stat.st_ino
    buf = getattr(tls, "buf", None)
    if buf is None or buf.nbytes < stat.st_size:
        buf = tls.buf = np.empty(stat.st_size, dtype=np.uint8)
    view = memoryview(buf)[: stat.st_size]
    got = 0
    while got < stat.st_size:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            break
        got += n
    return view[:got]


def take_evicted_frame(held: Path, key: bytes) -> bytes | None:
    """The frame of ``key`` from an evicted file set aside in tmp/, which is removed; None when
    the file does not hold ``key``."""
    try:
        data = held.read_bytes()
    finally:
        held.unlink(missing_ok=True)
    return data[len(file_prefix(key)) :] if parse_prefix(data) == key else None


def write_all(fd: int, data: Any) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def sync_filesystem(fd: int) -> None:
    """Flush every dirty page of the file system holding ``fd`` (``syncfs``; ``sync`` where the
    C library lacks it). OSError when the kernel reports a write-back failure."""
    try:
        syncfs = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        os.sync()
        return
    if syncfs(ctypes.c_int(fd)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs: {os.strerror(err)}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _flock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _read_note(path: Path) -> str:
    """The first line of a small text file, '' if it cannot be read."""
    try:
        return path.read_text(errors="replace").strip()[:32]
    except OSError:
        return ""
