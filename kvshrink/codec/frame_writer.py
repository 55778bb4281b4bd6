"""Writing an encoded frame (header, then every block's payloads) into one buffer off the GIL.

Why: joining the payloads into the frame with ``bytes.join`` copied ~4 MB per 6 MB chunk while
holding the GIL: a quarter of a one-thread ``fast`` encode, and the part a second thread could
not share. Here the payloads are copied by a ``nogil`` kernel, a group of blocks per worker of
the codec budget, into a buffer sized once: a fresh ``bytes`` object (what ``Codec.encode``
returns) or a caller's buffer (``Codec.encode(..., into=...)``: e.g. a tier's arena slot, which
saves the copy from the frame to the tier).

A fresh ``bytes`` is made with CPython's ``PyBytes_FromStringAndSize(NULL, n)`` and filled
before anything else can see it, the C API's documented way to build a bytes object in place;
without that API (another Python) the frame is joined as before.

Buffers: payloads are only read; ``dest`` is written in full (header and payloads, nothing else).
Threads: groups write disjoint ranges of ``dest``. Errors: ``CodecArgumentError`` when a caller's
buffer is not a writable, contiguous buffer of exactly the frame's size.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Sequence

import numpy as np

from kvshrink.codec.errors import CodecArgumentError
from kvshrink.codec.lazy_kernels import LazyKernels

_kernels = LazyKernels("kvshrink.codec._jit")
RunGroups = Callable[[int, Callable[[int], object]], list]  # (count, work) -> results, on the budget

try:
    _from_size = ctypes.pythonapi.PyBytes_FromStringAndSize
    _from_size.restype = ctypes.py_object
    _from_size.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
except (AttributeError, ValueError):  # not CPython
    _from_size = None


def can_make_fresh_bytes() -> bool:
    """Whether :func:`fresh_bytes` works here (CPython)."""
    return _from_size is not None


def fresh_bytes(size: int) -> tuple[bytes, np.ndarray] | None:
    """A new, not yet initialised ``bytes`` of ``size`` bytes and a writable uint8 view of it,
    to be filled completely before the bytes object is used; None where that cannot be done."""
    if _from_size is None or size == 0:
        return None
    frame = _from_size(None, size)
    address = np.frombuffer(frame, np.uint8).ctypes.data
    return frame, np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address))


def writable_view(buffer: Any, size: int) -> np.ndarray:
    """``buffer`` (a caller's frame destination) as uint8[size]; CodecArgumentError if unusable."""
    try:
        view = memoryview(buffer)
    except TypeError:
        raise CodecArgumentError("into", f"must return a writable buffer, not {type(buffer).__name__}") from None
    if view.readonly or not view.c_contiguous or view.nbytes != size:
        raise CodecArgumentError("into", f"must return a writable contiguous buffer of exactly {size} bytes "
                                         f"(got {view.nbytes} bytes, readonly={view.readonly})")
    return np.frombuffer(view.cast("B"), np.uint8)


def write(dest: np.ndarray, header: bytes, payloads: Sequence[Sequence[Any]], groups: int,
          run_groups: RunGroups) -> None:
    """Copy ``header`` and then each block's payloads (in block and stream order) into ``dest``,
    ``groups`` contiguous ranges of blocks on the budget."""
    dest[:len(header)] = np.frombuffer(header, np.uint8)
    starts, pos = [], len(header)
    for block in payloads:
        starts.append(pos)
        pos += sum(len(memoryview(p).cast("B")) for p in block)
    nblocks = len(payloads)
    if not nblocks:
        return
    groups = min(max(groups, 1), nblocks)
    edges = [nblocks * g // groups for g in range(groups + 1)]

    def copy_group(g: int) -> None:
        for b in range(edges[g], edges[g + 1]):
            put_payloads(dest, starts[b], payloads[b])

    run_groups(groups, copy_group)


def put_payloads(dest: np.ndarray, at: int, payloads: Sequence[Any]) -> list[int]:
    """Copy one block's ``payloads`` into ``dest`` from ``at`` on, back to back (without the GIL
    where the kernels are compiled); their sizes."""
    jit = _kernels.get()
    sizes = []
    for p in payloads:
        src = _payload_bytes(p)
        if jit is not None:
            jit.copy_bytes(src, dest[at:at + src.size])
        else:
            dest[at:at + src.size] = src
        at += src.size
        sizes.append(src.size)
    return sizes


def _payload_bytes(payload: Any) -> np.ndarray:
    """A block payload (``bytes`` or an array) as a flat uint8 view, no copy."""
    if isinstance(payload, np.ndarray):
        return payload.reshape(-1).view(np.uint8)
    return np.frombuffer(payload, np.uint8)
