"""Opening and reserving the ``/dev/shm`` file that backs an :class:`~kvshrink.store.arena.Arena`.

Why the pages are reserved: a tmpfs file is sparse, and storing to (or reading) a page the tmpfs
cannot back through a shared mapping is a SIGBUS that kills the process, long after the open that
could have said so. So the owner reserves every page with ``posix_fallocate`` before it maps the
file: a ``/dev/shm`` too small for the arena is an error at open, naming the path, the size asked
and the free space. A reader refuses a file with holes (one no owner reserved) for the same reason.

Why the owner lock comes first: an exclusive, non-blocking ``flock`` is taken before anything
touches the file, so a second owner never resizes or formats a live arena. The kernel drops the
lock when the owner's fd is closed or the owner dies (``kill -9`` never leaves it locked).

Contract: every function here works on a path or an fd only, holds no state and is safe from any
thread. An fd returned by :func:`open_owner` / :func:`open_reader` belongs to the caller, who
closes it (closing the owner's fd releases the lock); on an error they raise, the fd they opened
is already closed. :func:`reserve` never closes the fd it is given; when it fails the file keeps
its size and the caller restores or removes it. Errors: :class:`~kvshrink.errors.StoreUnavailableError`
(owned by another live process, no room to reserve, a reader finding holes); any other
``OSError`` of opening (no such file, permission) propagates unchanged.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from kvshrink.errors import StoreUnavailableError


def describe_size(n: int) -> str:
    """``67108864 bytes (64.0 MiB)``: exact for logs, readable for people."""
    return f"{n} bytes ({n / 2**20:.1f} MiB)"


def open_owner(path: Path) -> tuple[int, bool]:
    """Open (creating when absent) and lock for writing, before anything touches the file.
    Returns (fd, whether this call created the file)."""
    try:
        fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), True
    except FileExistsError:
        fd, created = os.open(path, os.O_RDWR), False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise StoreUnavailableError(f"arena {path} is owned by another live process; "
                                    "attach with readonly=True") from exc
    return fd, created


def open_reader(path: Path) -> int:
    """Open read-only; refuse a file with holes (no owner reserved it): reading a hole of a
    full tmpfs through the mapping would SIGBUS."""
    fd = os.open(path, os.O_RDONLY)
    st = os.fstat(fd)
    if st.st_blocks * 512 < st.st_size:
        os.close(fd)
        raise StoreUnavailableError(f"arena {path} is not fully allocated ({describe_size(st.st_blocks * 512)} "
                                    f"of {describe_size(st.st_size)}); open it for writing first")
    return fd


def reserve(fd: int, path: Path, size: int) -> None:
    """Make the file ``size`` bytes with every page allocated (a no-op when it already is)."""
    st = os.fstat(fd)
    if st.st_size == size and st.st_blocks * 512 >= size:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        vfs = os.statvfs(path.parent)
        held = os.fstat(fd).st_blocks * 512
        raise StoreUnavailableError(
            f"arena {path}: cannot reserve {describe_size(size)} in {path.parent} ({exc.strerror}): "
            f"{describe_size(vfs.f_bavail * vfs.f_frsize)} free there"
            + (f", {describe_size(held)} already held by the file" if held else "")
            + f"; lower the tier's capacity or enlarge {path.parent}") from exc
