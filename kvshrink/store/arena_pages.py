"""Page requests on a DRAM tier's arena mapping: huge pages, ``mlock``, prefaulting.

Huge pages (``madvise(MADV_HUGEPAGE)`` on the shared mapping) and ``mlock`` are requests: when the
kernel refuses, the tier runs on normal, unlocked pages and says so once in the log. The pages
are reserved (``posix_fallocate``) before the mapping is advised, so whether they are huge is up
to the tmpfs mount (``huge=``) or khugepaged.

``prefault`` (on by default) maps every page of the owner's mapping writable at open
(``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+). Why: ``posix_fallocate`` reserves tmpfs pages but
leaves each to be zeroed and mapped by a page fault on its first write, and a put that lands on
fresh pages paid that in its copy: the first write into a fresh arena ran at ~1.6 GB/s against
~7 GB/s once mapped (2-core Xeon). Prefaulting costs ~0.33 s per GB at open and no memory beyond
what the reservation already holds. Refused (an older kernel), the tier runs as before and says
so once in the log.

Threads: each is called once per tier at open, before the tier is shared. Buffers: they advise
the caller's mapping and never write it. Errors: none raised; a refusal is the False they return.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import time
from pathlib import Path

log = logging.getLogger("kvshrink.store.dram")  # the tier's own log: its operators look there

THP_SHMEM = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+; Python's mmap may not name it
_warned: set[str] = set()


def _warn_once(topic: str, message: str, *args: object) -> None:
    if topic not in _warned:
        _warned.add(topic)
        log.warning(message, *args)


def advise_hugepages(mm: mmap.mmap) -> bool:
    """Ask for huge pages on the shared mapping; False (said once in the log) when refused."""
    policy = THP_SHMEM.read_text().split("[")[-1].split("]")[0] if THP_SHMEM.exists() else "absent"
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError) as exc:
        _warn_once("hugepages", "DRAM tier: huge pages refused (%s); using normal pages", exc)
        return False
    if policy not in ("always", "within_size", "advise", "force"):
        _warn_once("hugepages", "DRAM tier: huge pages refused by the kernel (shmem_enabled=%s); "
                   "using normal pages", policy)
        return False
    return True


def prefault(mm: mmap.mmap, name: str) -> bool:
    """Map every page of ``mm`` writable now rather than on each page's first write; False (said
    once in the log) when the kernel refuses."""
    start = time.perf_counter()
    try:
        mm.madvise(MADV_POPULATE_WRITE)
    except OSError as exc:
        _warn_once("prefault", "DRAM tier: prefaulting the arena refused (%s; needs Linux 5.14+); "
                   "pages are mapped on first write", exc)
        return False
    log.info("tier %s: prefaulted %.1f MiB of arena in %.2f s", name, len(mm) / (1 << 20),
             time.perf_counter() - start)
    return True


def lock_in_ram(mm: mmap.mmap, size: int) -> bool:
    """Lock the mapping's pages in RAM; False (said once in the log) when refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        rc = libc.mlock(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size))
    finally:
        del anchor
    if rc != 0:
        err = ctypes.get_errno()
        _warn_once("mlock", "DRAM tier: mlock of %d bytes refused (%s); pages may be swapped out",
                   size, errno.errorcode.get(err, err))
        return False
    return True
