"""Intel QAT through libqatzip (ctypes), optional: the ``qat`` method's hardware path.

QATzip's default session compresses deflate level 1 into standard gzip members (its "gzip ext"
format: a normal gzip member with an extra header field), which any zlib decodes — so frames
written on a QAT host decode anywhere, and without the library the ``qat`` method writes the same
format in software (ISA-L when the ``isal`` package is installed, else zlib).

Only the stable entry points are bound (``qzInit``, ``qzCompress``, ``qzTeardownSession``,
``qzClose``) with library-default session parameters (deflate level 1: the codec's ``level`` does
not reach the hardware), so no parameter struct layout, which changed across QATzip releases, is
assumed. One session per thread, as the library requires. Decompression always runs in software
(ISA-L or zlib inflate): it is the cheap direction, and it keeps one decoder for frames from any
host. Set ``KVSHRINK_QATZIP_LIB`` to a path to pick a specific ``libqatzip.so``;
``KVSHRINK_QATZIP_LIB=off`` disables the lookup.

Not exercised on hardware in this repository's CI (no QAT device there): ``qat_status()`` says
which path ran.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import logging
import os
import threading
from typing import TYPE_CHECKING

from kvshrink.errors import KVShrinkError

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

QZ_OK, QZ_DUPLICATE = 0, 1
_SW_FALLBACK_CODES = {2: "forced to software", 11: "no QAT hardware", 12: "no memory driver",
                      13: "no instance to attach", 14: "not enough pinned memory"}
_SESSION_BYTES = 256  # QzSession_T is 40 bytes today; leave room for growth
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_path: str | None = None
_searched = False
_last_path = "none yet"  # what the most recent qat-method stream used
_local = threading.local()
_sessions: list[ctypes.Array] = []


class QatUnavailable(KVShrinkError, RuntimeError):
    """libqatzip could not compress this stream; the caller falls back to software deflate. Also a
    RuntimeError, as it was before it joined the family."""


def library() -> ctypes.CDLL | None:
    """The loaded libqatzip, or None."""
    global _lib, _lib_path, _searched
    if _searched:
        return _lib
    with _lock:
        if _searched:
            return _lib
        wanted = os.environ.get("KVSHRINK_QATZIP_LIB", "")
        default = [ctypes.util.find_library("qatzip"), "libqatzip.so.3", "libqatzip.so"]
        candidates = [] if wanted == "off" else ([wanted] if wanted else default)
        for path in filter(None, candidates):
            try:
                lib = ctypes.CDLL(path)
                _bind(lib)
            except (OSError, AttributeError) as exc:
                log.debug("libqatzip candidate %s not usable: %s", path, exc)
                continue
            _lib, _lib_path = lib, path
            atexit.register(_close_sessions)
            break
        _searched = True
    return _lib


def qat_status() -> str:
    """One line: whether libqatzip was found, and which path the ``qat`` method last used."""
    lib = library()
    found = f"libqatzip loaded from {_lib_path}" if lib is not None else "libqatzip not found"
    return f"{found}; software deflate: {software_deflate_name()}; last qat-method stream: {_last_path}"


def software_deflate_name() -> str:
    try:
        import isal  # noqa: F401
    except ImportError:
        return "zlib"
    return "isal"


def note_path(path: str) -> None:
    global _last_path
    _last_path = path


def compress(data: "np.ndarray") -> bytes:
    """gzip members of ``data`` (contiguous ``uint8``) compressed by QATzip; QatUnavailable to fall back."""
    lib = library()
    if lib is None:
        raise QatUnavailable("libqatzip not loaded")
    session = _session(lib)
    src_len = ctypes.c_uint(len(data))
    capacity = len(data) + len(data) // 8 + 64 * (len(data) // 1024 + 1) + 4096
    dest = ctypes.create_string_buffer(capacity)
    dest_len = ctypes.c_uint(capacity)
    src = data.ctypes.data_as(ctypes.c_void_p)
    rc = lib.qzCompress(session, src, ctypes.byref(src_len), dest, ctypes.byref(dest_len), 1)
    if rc != QZ_OK or src_len.value != len(data):
        raise QatUnavailable(f"qzCompress returned {rc} after {src_len.value} of {len(data)} bytes")
    return dest.raw[:dest_len.value]


def _bind(lib: ctypes.CDLL) -> None:
    uint_p = ctypes.POINTER(ctypes.c_uint)
    lib.qzInit.argtypes = [ctypes.c_void_p, ctypes.c_ubyte]
    lib.qzInit.restype = ctypes.c_int
    lib.qzCompress.argtypes = [ctypes.c_void_p, ctypes.c_void_p, uint_p, ctypes.c_void_p, uint_p, ctypes.c_uint]
    lib.qzCompress.restype = ctypes.c_int
    lib.qzTeardownSession.argtypes = [ctypes.c_void_p]
    lib.qzClose.argtypes = [ctypes.c_void_p]


def _session(lib: ctypes.CDLL) -> ctypes.Array:
    session = getattr(_local, "session", None)
    if session is None:
        session = ctypes.create_string_buffer(_SESSION_BYTES)
        rc = lib.qzInit(session, 1)  # 1: let the library fall back to its own software path
        if rc not in (QZ_OK, QZ_DUPLICATE) and rc not in _SW_FALLBACK_CODES:
            raise QatUnavailable(f"qzInit returned {rc}")
        _local.session, _local.hardware = session, rc in (QZ_OK, QZ_DUPLICATE)
        if rc in _SW_FALLBACK_CODES:
            log.info("libqatzip: %s; QATzip runs deflate in software", _SW_FALLBACK_CODES[rc])
        with _lock:
            _sessions.append(session)
    note_path("libqatzip (" + ("hardware" if _local.hardware else "QATzip software fallback") + ")")
    return session


def _close_sessions() -> None:
    if _lib is None:
        return
    for session in _sessions:
        _lib.qzTeardownSession(session)
        _lib.qzClose(session)
    _sessions.clear()
