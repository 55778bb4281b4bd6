"""Reads from the device, not the page cache: drop a tier's files from the cache, measure the
device's own sequential read speed, and emulate a slower device class.

Without this every SSD read of a benchmark that reads what it just wrote comes from the page cache
(memory speed), so the bytes compression saves never show. Three tools, used alike on both sides:

* :func:`drop_cached` — ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file under some folders
  (after an ``fsync``: dirty pages are not dropped), so the next read goes to the device;
* :func:`read_into_cache` — the opposite: every file under some folders read once, so the next
  read of it comes from memory (a request served "from the page cache" is then that, and not
  whatever part of the files a restart or an earlier drop left out);
* :func:`sequential_read_gbps` — the device's own speed, measured in the same run: a file written,
  synced, dropped from the cache and read back in 4 MiB reads;
* :func:`throttled_reads` — a cgroup v1 ``blkio`` group whose ``blkio.throttle.read_bps_device``
  caps some processes' reads of the folder's device (network-attached volumes read at
  0.25-1 GB/s). Needs root and the v1 blkio controller; :class:`DeviceUnavailable` says so where
  either is missing. Buffered reads are throttled there too (they are issued by the reading
  thread); writes are not, which is why only loads are measured under it.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path
from typing import Iterator, Sequence

from kvshrink.errors import KVShrinkError

BLKIO = Path("/sys/fs/cgroup/blkio")
READ_BLOCK = 4 << 20


class DeviceUnavailable(KVShrinkError):
    """This machine cannot throttle reads (no cgroup v1 blkio controller, or not root)."""


def _files_under(folders: Sequence[Path]) -> Iterator[Path]:
    for folder in folders:
        yield from (path for path in Path(folder).rglob("*") if path.is_file())


def drop_cached(folders: Sequence[Path]) -> int:
    """Sync every file under ``folders`` and drop it from the page cache; returns how many."""
    count = 0
    for path in _files_under(folders):
        _drop_file(path)
        count += 1
    return count


def read_into_cache(folders: Sequence[Path]) -> int:
    """Read every file under ``folders`` whole, so its pages are in the page cache; returns how
    many. A file that goes away meanwhile (a store replacing it) is skipped."""
    count = 0
    for path in _files_under(folders):
        try:
            with open(path, "rb", buffering=0) as f:
                while f.read(READ_BLOCK):
                    pass
        except FileNotFoundError:
            continue
        count += 1
    return count


def sequential_read_gbps(folder: Path, size: int = 512 << 20) -> float:
    """GB/s of one sequential read of a ``size``-byte file under ``folder``, from the device."""
    path = Path(folder) / f".kvshrink-read-speed-{uuid.uuid4().hex[:8]}"
    block = os.urandom(READ_BLOCK)
    try:
        with open(path, "wb") as f:
            for _ in range(size // READ_BLOCK):
                f.write(block)
        _drop_file(path)
        start = time.perf_counter()
        read = 0
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(READ_BLOCK):
                read += len(chunk)
        return read / (time.perf_counter() - start) / 1e9
    finally:
        path.unlink(missing_ok=True)


def _drop_file(path: Path) -> None:
    """fsync first: the kernel does not drop dirty pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def device_of(folder: Path) -> str:
    """``major:minor`` of the block device holding ``folder`` (what blkio throttles)."""
    dev = os.stat(folder).st_dev
    return f"{os.major(dev)}:{os.minor(dev)}"


@contextlib.contextmanager
def throttled_reads(folder: Path, bytes_per_s: int, pids: Sequence[int] = ()) -> Iterator[str]:
    """While inside, the processes ``pids`` (default: this one) read ``folder``'s device at
    ``bytes_per_s`` at most, together; yields the device (``major:minor``). Each process goes back
    to the group it came from on exit, also after an error."""
    if not (BLKIO / "blkio.throttle.read_bps_device").exists():
        raise DeviceUnavailable(f"no cgroup v1 blkio controller at {BLKIO}")
    device = device_of(folder)
    group = BLKIO / f"kvshrink-{uuid.uuid4().hex[:8]}"
    homes = {pid: _blkio_group_of(pid) for pid in (pids or [os.getpid()])}
    try:
        group.mkdir()
    except OSError as exc:
        raise DeviceUnavailable(f"cannot make a blkio group under {BLKIO}: {exc}") from exc
    try:
        try:
            (group / "blkio.throttle.read_bps_device").write_text(f"{device} {bytes_per_s}\n")
            for pid in homes:
                (group / "cgroup.procs").write_text(f"{pid}\n")
        except OSError as exc:
            raise DeviceUnavailable(f"cannot throttle reads of device {device}: {exc}") from exc
        yield device
    finally:
        for pid, home in homes.items():
            with contextlib.suppress(OSError):  # a process that has exited meanwhile
                (home / "cgroup.procs").write_text(f"{pid}\n")
        for _ in range(50):  # the group is removable once the kernel has moved every thread out
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.02)


def _blkio_group_of(pid: int) -> Path:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "blkio" in controllers.split(","):
            return BLKIO / path.lstrip("/")
    return BLKIO
