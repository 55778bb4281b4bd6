"""Whether an SSD tier may trust its index at open: the clean-close marker.

**Clean close.** ``CLEAN`` records what the index and the chunk directories looked like at close:
the index's fingerprint (length and CRCs, ssd_index.py), its entry count and bytes, and the
modification times of ``chunks/`` and its sub-directories. At open the index is trusted, and the
file scan skipped, only when all of these still agree; otherwise (no marker: a crash; an index
deleted, replaced by an older copy, truncated or corrupted; chunk files added or removed by hand;
an index append that failed during the last run) :meth:`~kvshrink.store.ssd.SsdTier.reconcile`
runs in the background: it adopts every intact chunk file the index does not name and drops
entries whose file is gone; until it is done, a chunk it has not reached yet is a miss. Checking
costs a few hundred ``stat`` calls, not a listing of the chunks; the price is that a file changed
by hand within one tick of the file system's timestamps after the close can go unnoticed (a
damaged index never does).

Contract: functions only; the tier calls them under its lock, at open and at close. Errors:
``OSError`` from writing the marker propagates; reading it never raises (what went wrong is the
reason to rescan).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any, Callable

from kvshrink.store.ssd_files import fsync_dir, write_all
from kvshrink.store.ssd_index import IndexLog

CLEAN_MARKER = "CLEAN"
CLEAN_FORMAT = 1
NOT_CLOSED = "the last owner did not close cleanly"


def clean_state(index: IndexLog, entries: int, stored_bytes: int, chunks_dir: Path) -> dict[str, Any]:
    """What a clean close leaves and the next open compares (see the module docstring)."""
    return {"format": CLEAN_FORMAT, "index": index.fingerprint(), "entries": entries, "bytes": stored_bytes,
            "chunk_dirs": _chunk_dirs_fingerprint(chunks_dir)}


def write_clean_marker(root: Path, state: dict[str, Any]) -> None:
    """Written (and fsync'ed) last: a marker cut short by a crash fails to parse: a rescan."""
    fd = os.open(root / CLEAN_MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        write_all(fd, json.dumps(state).encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def check_clean_marker(root: Path, index: IndexLog, current: Callable[[], dict[str, Any]]) -> str | None:
    """None when the last owner closed cleanly and the index and chunk directories are as it
    left them (``current``: :func:`clean_state` now, asked only if it comes to that); else what
    disagrees. The marker is removed
    (durably) so that a crash of this process is seen as one by the next."""
    marker = root / CLEAN_MARKER
    try:
        text = marker.read_bytes()
        marker.unlink()
    except FileNotFoundError:
        return NOT_CLOSED
    except OSError as exc:
        return f"cannot read the clean-close marker {marker}: {exc}"
    fsync_dir(root)
    if index.damaged:
        return "index.log is damaged"
    if index.torn_bytes:
        return f"index.log had {index.torn_bytes} bytes past its last intact record"
    try:
        recorded = json.loads(text)
    except ValueError:
        return "the clean-close marker is unreadable"
    if not isinstance(recorded, dict):
        return "the clean-close marker is unreadable"
    for what, value in current().items():
        if recorded.get(what) != value:
            return f"the index does not match the last clean close: {what} is {value!r}, was {recorded.get(what)!r}"
    return None


def _chunk_dirs_fingerprint(chunks_dir: Path) -> str:
    """CRC of the names and mtimes of ``chunks/`` and its sub-directories: adding, removing or
    renaming a chunk file changes its directory's mtime. ~256 stat calls, no listing of chunks."""
    parts = [f"{os.stat(chunks_dir).st_mtime_ns}"]
    for entry in sorted(os.scandir(chunks_dir), key=lambda e: e.name):
        parts.append(f"{entry.name}={entry.stat(follow_symlinks=False).st_mtime_ns}")
    return f"{len(parts)}:{zlib.crc32(';'.join(parts).encode()):08x}"
