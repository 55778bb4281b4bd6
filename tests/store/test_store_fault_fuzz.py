"""Randomized fault test of the tiered store: kill -9 at random points, random file damage and
truncation, overwrites racing evictions, Redis stopped and resumed, killed and restarted.

Why a model and not fixed expectations: under faults a store may legitimately miss, so each read
is judged against what the store promised. :class:`Model` logs every event with one global
sequence number (put issued, its Future done, drop notice, delete, damage we did, Redis outage,
barrier = every worker paused and ``flush()`` returned) and, once a run ends, judges each read:

* a hit is exactly some stored version of its key (never wrong bytes) and not older than the
  newest version acknowledged (Future True) before the read began (never stale); a version a
  ``delete()`` removed may come back (documented: a copy in flight may still land), counted;
* a miss of an acknowledged, undeleted key needs a documented reason: a drop notice after that
  put was issued (and before the next barrier), a newer put of the key acknowledged since, damage
  we did to the key's media, a delete or a Redis outage during the read, or (right after a crash
  or a damaged index) the SSD reconcile still adopting files in the background;
* a drop notice for a key nothing touched since the last barrier, which a later read still finds
  with a version put before that barrier, was false (the store still held the key);
* nothing outside the KVShrinkError family escapes a call, a Future or a background job (what
  the store logs at ERROR), and odd inputs (bad keys, odd arrays and tensors) either fail that
  way or read back bit-exact.

A crash cannot report drops, so the kill test gives its child an SSD too large to ever evict:
there a kill -9 may lose nothing acknowledged (demote-then-evict, /dev/shm outlives the process).

Budget: ``KVSHRINK_FUZZ_SECONDS`` (default 60) of wall time for the module, split between the
tests; ``KVSHRINK_FUZZ_SEED`` fixes the seed (random by default). Every test prints one summary
line of counts (``pytest -s`` or ``-rA``; also the ``fuzz_counts`` property of the report) and
names its seed on failure. Runs are seeded but threaded: a seed reproduces the schedule roughly.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import os
import random
import struct
import subprocess
import sys
import threading
import time
import traceback
import zlib
from collections import Counter, defaultdict
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from fault_fuzz_worker import ROW, identify, key_of, kid_of, make_chunk, rows_of
from kvshrink.errors import ConfigError, KVShrinkError
from kvshrink.store import TieredStore
from kvshrink.store.arena import SUPERBLOCK, Arena, Block
from kvshrink.store.dram import SHM_DIR

KiB = 2**10
ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("fault_fuzz_worker.py")
BUDGET_S = float(os.environ.get("KVSHRINK_FUZZ_SECONDS", "60"))
SEED = int(os.environ.get("KVSHRINK_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
N_KEYS, HOT = 64, 6  # hot keys take most overwrites
THREADS = 3
MAX_OPS = 60_000  # per run: bounds the model's memory whatever the budget
INF = float("inf")
ODD_PREFIX = b"odd-"


def share(fraction: float) -> float:
    return BUDGET_S * fraction


def seeded(name: str) -> tuple[int, random.Random]:
    seed = (SEED + zlib.crc32(name.encode())) % 2**32
    return seed, random.Random(seed)


# -- the model ---------------------------------------------------------------------------------
@dataclass
class Read:
    key: bytes
    start: int
    end: int
    version: int | None
    wrong: str = ""
    tag: str = ""  # "reconcile": misses excused, the SSD was still adopting files


class Model:
    """What the store was asked and what it answered, as sequence-numbered events.

    Threads: every method may be called from any thread (workers, store workers running Future
    callbacks and drop listeners); ``check`` runs once the store is idle.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._seq = 0
        self._pending = 0
        self.versions: dict[bytes, int] = defaultdict(int)
        self.issued: dict[bytes, dict[int, int]] = defaultdict(dict)  # version -> issue seq
        self.acks: dict[bytes, list[tuple[int, int]]] = defaultdict(list)  # (seq, version)
        self.drops: dict[bytes, list[int]] = defaultdict(list)
        self.deletes: dict[bytes, list[tuple[int, int, int]]] = defaultdict(list)  # (start, end, newest gone)
        self.damage: dict[bytes, list[int]] = defaultdict(list)
        self.unreported: dict[bytes, list[tuple[int, str]]] = defaultdict(list)  # losses only logged
        self.touches: dict[bytes, list[int]] = defaultdict(list)  # what may race a drop notice
        self.barriers: list[int] = []
        self.marks: list[tuple[int, str]] = []  # restarts, crashes: shown in every key's history
        self.outages: list[list[float]] = []
        self.reads: list[Read] = []
        self.violations: list[str] = []
        self.counts: Counter[str] = Counter()
        self.futures: dict[bytes, Future] = {}  # latest put Future per key (under the key's lock)

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def tick(self) -> int:
        with self._lock:
            return self._next()

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    def violation(self, message: str) -> None:
        with self._lock:
            self.violations.append(message)

    # puts
    def issue(self, key: bytes, version: int | None = None) -> int:
        """A put of ``key`` is about to be issued: its version (the next one unless given)."""
        with self._lock:
            version = self.versions[key] + 1 if version is None else version
            self.versions[key] = max(self.versions[key], version)
            seq = self._next()
            if self.issued[key]:
                self.counts["overwrites"] += 1
            self.issued[key][version] = seq
            self.touches[key].append(seq)
            self.counts["puts"] += 1
            return version

    def merged(self, key: bytes, version: int) -> None:
        """put() returned the key's Future in flight: this version was never stored."""
        with self._lock:
            self.issued[key].pop(version, None)
            self.counts["merged"] += 1

    def acked(self, key: bytes, version: int) -> None:
        with self._lock:
            self.acks[key].append((self._next(), version))
            self.counts["acks"] += 1

    def started(self, key: bytes, future: Future) -> None:
        with self._lock:
            self._pending += 1
            self.futures[key] = future

    def finished(self, key: bytes, version: int, future: Future) -> None:
        """Done callback of a put Future (on a store worker)."""
        try:
            exc = future.exception()
            if exc is None and future.result():
                self.acked(key, version)
            elif exc is None:
                self.count("engine_full")
            elif isinstance(exc, KVShrinkError):
                self.count("put_errors")
            else:
                self.violation(f"put({key!r}) v{version}: its Future failed with {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._pending -= 1
                self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    # other events
    def dropped(self, keys: list[bytes]) -> None:
        """The drop listener: quick, never calls the store."""
        with self._lock:
            seq = self._next()
            for key in keys:
                if kid_of(key) is not None:
                    self.drops[key].append(seq)
                    self.counts["drop_notices"] += 1

    def deleted(self, key: bytes, start: int, newest: int) -> None:
        """``delete(key)`` ran from event ``start`` until now; versions up to ``newest`` are gone."""
        with self._lock:
            seq = self._next()
            self.deletes[key].append((start, seq, newest))
            self.touches[key] += [start, seq]
            self.counts["deletes"] += 1

    def damaged(self, key: bytes) -> None:
        with self._lock:
            seq = self._next()
            self.damage[key].append(seq)
            self.touches[key].append(seq)

    def logged_loss(self, key: bytes, message: str) -> None:
        """The store logged that it lost ``key`` without telling the drop listeners."""
        with self._lock:
            self.unreported[key].append((self._next(), message))
            self.counts["logged_losses"] += 1

    def mark(self, what: str) -> None:
        with self._lock:
            self.marks.append((self._next(), what))

    def barrier(self) -> None:
        with self._lock:
            self.barriers.append(self._next())

    def outage_begins(self, what: str) -> None:
        with self._lock:
            self.outages.append([self._next(), INF])
            self.counts[what] += 1

    def outage_ends(self) -> None:
        with self._lock:
            self.outages[-1][1] = self._next()

    def read(self, key: bytes, start: int, got: Any, tag: str = "") -> None:
        kid = kid_of(key)
        version, wrong = (None, "") if got is None else identify(kid, got)
        with self._lock:
            self.reads.append(Read(key, start, self._next(), version, wrong, tag))
            self.touches[key].append(start)
            self.counts["reads"] += 1
            self.counts["hits" if got is not None else "misses"] += 1

    # judgement
    def check(self) -> list[str]:
        """Every violation: those recorded live, then the reads judged against the events."""
        out = list(self.violations)
        for seqs in self.touches.values():
            seqs.sort()
        # per key, in event order: ack seqs with the newest version acknowledged by then, and
        # the issue seqs of acknowledged puts (versions grow with their issue seq)
        self._ack_seqs = {k: [s for s, _ in acks] for k, acks in self.acks.items()}
        self._ack_newest = {k: list(itertools.accumulate((v for _, v in acks), max)) for k, acks in self.acks.items()}
        self._acked_issues = {k: sorted(self.issued[k][v] for _, v in acks if v in self.issued[k])
                              for k, acks in self.acks.items()}
        by_key: dict[bytes, list[Read]] = defaultdict(list)
        for read in self.reads:
            by_key[read.key].append(read)
            problem = self._judge(read)
            if problem:
                out.append(problem)
        out += self._false_notices(by_key)
        return out

    def _judge(self, r: Read) -> str:
        where = f"read of {r.key!r} (events {r.start}..{r.end})"
        if r.wrong:
            self.counts["wrong_reads"] += 1
            return f"wrong bytes: {where} returned {r.wrong}"
        acks = self.acks[r.key]
        n = bisect.bisect_left(self._ack_seqs.get(r.key, []), r.start)
        latest = self._ack_newest[r.key][n - 1] if n else None
        gone = max((v for _, end, v in self.deletes[r.key] if end < r.start), default=None)
        if r.version is not None:
            issued_at = self.issued[r.key].get(r.version)
            if issued_at is None or issued_at > r.end:
                return f"wrong bytes: {where} returned version {r.version}, which was never stored"
            if latest is not None and r.version < latest:
                self.counts["stale_reads"] += 1
                since = self.issued[r.key][latest]
                damaged = any(since < s < r.end for s in self.damage[r.key])
                outage = any(a < r.end and since < b for a, b in self.outages)
                label = " (after damage to the key)" if damaged else " (around a Redis outage)" if outage else ""
                return (f"stale{label}: {where} returned v{r.version}, older than the acknowledged v{latest}; "
                        f"{self.history(r.key, r.end)}")
            if gone is not None and r.version <= gone:
                self.counts["resurrected"] += 1  # documented: a copy in flight at delete() may still land
            return ""
        if latest is None or (gone is not None and latest <= gone):
            return ""  # nothing acknowledged and not deleted since
        reason = self._miss_reason(r, latest)
        self.counts[f"misses_{reason or 'unexplained'}"] += 1
        if reason:
            return ""
        since = self.issued[r.key][latest]
        logged = [(s, why) for s, why in self.unreported[r.key] if since < s < r.end]
        label = f" (the store logged, unreported: {logged[-1][1]})" if logged else ""
        return (f"lost{label}: {where} missed acknowledged v{latest} (issued at {since}, "
                f"acknowledged at {max(s for s, v in acks if v == latest)}) with no drop notice, damage or outage; "
                f"{self.history(r.key, r.end)}; then: {self.history(r.key, INF, after=r.end, last=8)}")

    def history(self, key: bytes, until: float, after: float = -1, last: int = 12) -> str:
        """The key's ``last`` events in (``after``, ``until``], for a violation message (the
        events after a miss tell a chunk in flight from one lost)."""
        events = [(s, f"put v{v}") for v, s in self.issued[key].items()]
        events += [(s, f"ack v{v}") for s, v in self.acks[key]] + [(s, "drop notice") for s in self.drops[key]]
        events += [(s, f"delete <=v{v} begins") for s, _, v in self.deletes[key]]
        events += [(e, "delete done") for _, e, _ in self.deletes[key]] + [(s, "damage") for s in self.damage[key]]
        events += [(r.start, f"read {'miss' if r.version is None else f'v{r.version}'}") for r in self.reads
                   if r.key == key]
        events += [(b, "barrier") for b in self.barriers] + [(a, "outage") for a, _ in self.outages]
        events += [(b, "outage over") for _, b in self.outages if b != INF] + self.marks
        shown = sorted(e for e in events if after < e[0] <= until)
        shown = shown[-last:] if after < 0 else shown[:last]
        return "history: " + ", ".join(f"{s} {what}" for s, what in shown)

    def _miss_reason(self, r: Read, latest: int) -> str:
        issued_at = self.issued[r.key][latest]
        j = bisect.bisect_right(self.barriers, r.end)
        nb = self.barriers[j] if j < len(self.barriers) else INF
        if r.tag:
            return r.tag

        def between(seqs: list[int]) -> bool:  # any of the sorted ``seqs`` in (issued_at, nb]
            return bisect.bisect_right(seqs, nb) > bisect.bisect_right(seqs, issued_at)

        if between(self.drops[r.key]):
            return "dropped"
        if between(self._acked_issues.get(r.key, [])):
            return "reput"  # a re-put between the eviction's check and its report hides the notice
        if any(issued_at < s <= r.end for s in self.damage[r.key]):
            return "damaged"
        if any(issued_at < s < r.end for s, _, _ in self.deletes[r.key]):
            return "deleting"  # the read raced a delete
        if any(a <= r.end and r.start <= b for a, b in self.outages):
            return "outage"
        return ""

    def _false_notices(self, by_key: dict[bytes, list[Read]]) -> list[str]:
        out = []
        for key, seqs in self.drops.items():
            touches = self.touches[key]
            for s in seqs:
                j = bisect.bisect_left(self.barriers, s) - 1
                if j < 0:
                    continue
                barrier = self.barriers[j]
                if bisect.bisect_right(touches, s) > bisect.bisect_right(touches, barrier):
                    continue  # put, read, delete or damage of the key since the barrier
                for r in by_key[key]:
                    issued_at = self.issued[key].get(r.version, INF) if r.version is not None else INF
                    if r.start > s and issued_at < barrier:
                        self.counts["false_notices"] += 1
                        out.append(f"false drop notice: {key!r} was reported dropped at event {s} though nothing "
                                   f"touched it since barrier {barrier}, yet the read at {r.start} returned "
                                   f"v{r.version} (issued at {issued_at}): the store still held it; "
                                   f"{self.history(key, r.end)}")
                        break
        return out

    def summary(self, name: str, seed: int, seconds: float) -> str:
        keys = ("puts", "acks", "merged", "engine_full", "put_errors", "overwrites", "reads", "hits", "misses",
                "deletes", "drop_notices", "kills", "damage", "redis_stops", "redis_kills", "odd_puts",
                "barriers", "documented_errors")
        counts = {k: self.counts[k] for k in keys} | {k: v for k, v in sorted(self.counts.items()) if k not in keys}
        counts["barriers"] = len(self.barriers)
        return f"fault-fuzz {name} seed={seed} {seconds:.1f}s " + " ".join(f"{k}={v}" for k, v in counts.items())


class Gate:
    """Lets workers run operations, or pauses them: ``close`` returns once none is running."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._open = True
        self._active = 0

    @contextmanager
    def op(self) -> Iterator[None]:
        with self._cv:
            self._cv.wait_for(lambda: self._open)
            self._active += 1
        try:
            yield
        finally:
            with self._cv:
                self._active -= 1
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._open = False
            self._cv.wait_for(lambda: self._active == 0)

    def open(self) -> None:
        with self._cv:
            self._open = True
            self._cv.notify_all()


class StoreLog(logging.Handler):
    """What the store logs: an ERROR is what escaped a background job or a drop listener (a
    violation); a WARNING that names a key as evicted without reaching the tier below is a loss
    the listeners may not hear of, kept to explain a later miss in the failure message."""

    LOSSES = ("demotion of", "background lane full")

    def __init__(self, model: Model) -> None:
        super().__init__(logging.WARNING)
        self.model = model

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.ERROR:
            args = record.args if isinstance(record.args, tuple) else ()
            if str(record.msg).startswith(self.LOSSES) and args and isinstance(args[0], str):
                try:
                    self.model.logged_loss(bytes.fromhex(args[0]), record.getMessage())
                except ValueError:
                    pass
            return
        exc = record.exc_info[1] if record.exc_info else None
        self.model.violation(f"logged at ERROR by {record.name}: {record.getMessage()} "
                             f"({type(exc).__name__ if exc else 'no exception'}: {exc})")


@contextmanager
def watching_logs(model: Model) -> Iterator[None]:
    handler = StoreLog(model)
    logger = logging.getLogger("kvshrink")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


# -- odd inputs (documented: a KVShrinkError, or stored and read back bit-exact) -----------------
def odd_cases() -> dict[str, tuple[Any, Any, bool]]:
    """name -> (key, chunk, must be refused)."""
    base = make_chunk(1, 1)
    frozen = base.copy()
    frozen.flags.writeable = False
    cases: dict[str, tuple[Any, Any, bool]] = {
        "empty key": (b"", base, True),
        "1025-byte key": (b"x" * 1025, base, True),
        "str key": ("k001", base, True),
        "None key": (None, base, True),
        "None chunk": (ODD_PREFIX + b"none", None, True),
        "list chunk": (ODD_PREFIX + b"list", [1, 2, 3], True),
        "object array": (ODD_PREFIX + b"object", np.array([object(), 1], dtype=object), True),
        "0-d array": (ODD_PREFIX + b"0d", np.array(7, dtype=np.uint16), False),
        "zero-size array": (ODD_PREFIX + b"empty", np.zeros((0, ROW), dtype=np.uint16), False),
        "strided view": (ODD_PREFIX + b"strided", base[:, ::3], False),
        "Fortran order": (ODD_PREFIX + b"fortran", np.asfortranarray(base[:, :100]), False),
        "big-endian": (ODD_PREFIX + b"be", base.astype(">u2"), False),
        "bool": (ODD_PREFIX + b"bool", base > 0x3C20, False),
        "float64": (ODD_PREFIX + b"f64", base.astype(np.float64) / 3, False),
        "structured": (ODD_PREFIX + b"struct", np.zeros(4, dtype=[("a", "<u2"), ("b", "<f4")]), False),
        "unicode": (ODD_PREFIX + b"str", np.array(["ab", "c"]), False),
        "read-only": (ODD_PREFIX + b"ro", frozen, False),
    }
    try:
        import torch
    except ImportError:
        return cases
    t = torch.from_numpy(base.astype(np.int16)).view(torch.bfloat16)
    cases |= {
        "torch bf16 transposed": (ODD_PREFIX + b"t-bf16", t.t(), False),
        "torch requires_grad": (ODD_PREFIX + b"t-grad", torch.ones(3, 5, requires_grad=True), False),
        "torch zero-size": (ODD_PREFIX + b"t-empty", torch.zeros(0, 4, dtype=torch.bfloat16), False),
        "torch meta": (ODD_PREFIX + b"t-meta", torch.empty(4, 4, device="meta"), False),
    }
    return cases


def same_chunk(got: Any, want: Any) -> bool:
    if hasattr(want, "detach"):
        import torch

        want = want.detach()
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape and \
            bool(torch.equal(got, want))
    return isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape and \
        bool(np.array_equal(got, want))


_ODD: dict[str, tuple[Any, Any, bool]] = {}


# -- damage ------------------------------------------------------------------------------------
def flip(path: Path, rng: random.Random, at: int | None = None, n: int = 0) -> None:
    """XOR 1..8 bytes (or ``n``) of ``path`` with nonzero bytes, at random offsets or ``at``."""
    size = path.stat().st_size
    if size == 0:
        return
    with open(path, "r+b") as f:
        for _ in range(n or rng.randint(1, 8)):
            offset = at if at is not None else rng.randrange(size)
            f.seek(offset)
            old = f.read(1)
            f.seek(offset)
            f.write(bytes([old[0] ^ rng.randint(1, 255)]))


def damage_chunk_file(path: Path, donor: Path | None, rng: random.Random) -> str:
    """Damage one SSD chunk file; the returned name is what was done."""
    kind = rng.choice(["flip", "flip-header", "truncate", "unlink", "foreign"] if donor else
                      ["flip", "flip-header", "truncate", "unlink"])
    try:
        if kind == "flip":
            flip(path, rng)
        elif kind == "flip-header":
            flip(path, rng, at=rng.randrange(min(16, path.stat().st_size)), n=1)
        elif kind == "truncate":
            os.truncate(path, rng.randrange(path.stat().st_size))
        elif kind == "unlink":
            path.unlink()
        else:  # another key's intact file under this key's name
            data = donor.read_bytes()
            path.write_bytes(data)
    except (FileNotFoundError, ValueError):
        return "vanished"  # replaced or evicted while we looked
    return kind


def damage_index(path: Path, rng: random.Random) -> str:
    if not path.exists():
        return "none"
    size = path.stat().st_size
    kind = rng.choice(["flip", "truncate", "garbage-tail", "empty", "unlink"])
    if kind == "flip":
        flip(path, rng)
    elif kind == "truncate":
        os.truncate(path, rng.randrange(max(1, size)))
    elif kind == "garbage-tail":
        with open(path, "ab") as f:
            f.write(rng.randbytes(rng.randint(1, 200)))
    elif kind == "empty":
        os.truncate(path, 0)
    else:
        path.unlink()
    return kind


def arena_blocks(path: Path) -> list[Block]:
    """The committed blocks of an arena file no process owns (after a kill or a close)."""
    if not path.exists():
        return []
    try:
        arena = Arena(path, 0, readonly=True)
    except KVShrinkError:
        return []
    try:
        return arena.scan()
    finally:
        arena.close()


def damage_arena(path: Path, blocks: list[Block], rng: random.Random) -> tuple[str, list[bytes]]:
    """Damage the arena file; (what was done, the keys whose DRAM copy it may have destroyed)."""
    everything = [b.key for b in blocks]
    kind = rng.choice(["payload", "block-header", "state", "state", "size", "superblock", "truncate", "garbage"]
                      if blocks else ["state", "size", "superblock", "truncate", "garbage"])
    if kind == "payload":
        block = rng.choice(blocks)
        flip(path, rng, at=block.payload_offset + rng.randrange(block.frame_len), n=1)
        return kind, [block.key]
    if kind == "block-header":
        block = rng.choice(blocks)
        flip(path, rng, at=block.offset + rng.randrange(64 + len(block.key)), n=1)
    elif kind in ("state", "size"):  # a header's state word or size field (a free block's, mostly)
        starts = {b.offset for b in blocks}
        free = [o for o in sorted(({SUPERBLOCK} | {b.offset + b.size for b in blocks}) - starts)
                if o < path.stat().st_size]
        offset = rng.choice(free if free and rng.random() < 0.6 else sorted(starts) or free)
        with open(path, "r+b") as f:
            f.seek(offset + (4 if kind == "state" else 8))
            if kind == "state":  # another valid state: FREE, WRITING or (most often) COMMITTED
                state = struct.unpack("<I", f.read(4))[0]
                f.seek(offset + 4)
                f.write(struct.pack("<I", rng.choice([s for s in (0, 1, 2, 2) if s != state])))
            else:
                size = struct.unpack("<Q", f.read(8))[0]
                f.seek(offset + 8)
                f.write(struct.pack("<Q", max(0, size + 64 * rng.choice([-3, -1, 1, 2, 40, 2**20]))))
    elif kind == "superblock":
        flip(path, rng, at=rng.randrange(20), n=1)
    elif kind == "truncate":
        os.truncate(path, rng.randrange(path.stat().st_size))
    else:
        with open(path, "r+b") as f:
            f.seek(rng.randrange(path.stat().st_size))
            f.write(rng.randbytes(64))
    return kind, everything


# -- the harness -------------------------------------------------------------------------------
class Fuzz:
    """Worker threads driving one store against a Model, and the faults a controller injects.

    Threads: THREADS workers run operations through ``gate``; the test's thread injects faults,
    takes barriers and restarts the store (only while the gate is closed).
    """

    def __init__(self, config: dict, model: Model, seed: int, redis: Any = None) -> None:
        self.config, self.model, self.seed, self.redis = config, model, seed, redis
        self.rng = random.Random(seed)
        self.gate = Gate()
        self.stop = threading.Event()
        self.key_locks = {key_of(k): threading.Lock() for k in range(N_KEYS)}
        self.redis_lock = threading.Lock()  # held while the Redis state changes, and by deletes
        self.redis_state = "up"
        self.store: TieredStore | None = None
        self.damage_done: list[str] = []  # at rest, before the last reopen

    # -- lifecycle
    def open(self) -> TieredStore | None:
        try:
            store = TieredStore.from_config(self.config)
        except Exception as exc:  # any failure to reopen is a violation: the store must recover
            self.model.violation(f"the store did not reopen: {type(exc).__name__}: {exc}")
            return None
        store.add_drop_listener(self.model.dropped)
        self.store = store
        return store

    def close(self) -> None:
        if self.store is not None:
            self.call("close", self.store.close)
            self.store = None

    @property
    def ssd(self) -> Any:
        return next((t for t in self.store.tiers if t.kind == "ssd"), None) if self.store else None

    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> tuple[bool, Any]:
        """Run one store call: (True, result), or (False, None) after a documented error (counted)
        or any other exception (a violation)."""
        try:
            return True, fn(*args)
        except KVShrinkError:
            self.model.count("documented_errors")
        except Exception as exc:
            self.model.violation(f"{what} raised {type(exc).__name__} (not a KVShrinkError): {exc}\n"
                                 + "".join(traceback.format_exception(exc)[-3:]))
        return False, None

    # -- operations
    def pick(self, rng: random.Random) -> bytes:
        return key_of(rng.randrange(HOT) if rng.random() < 0.6 else rng.randrange(N_KEYS))

    def put(self, key: bytes) -> Future | None:
        """Issue one put of the key's next version; its Future, None when it stored nothing."""
        with self.key_locks[key]:
            version = self.model.issue(key)
            ok, future = self.call(f"put({key!r})", self.store.put, key, make_chunk(kid_of(key), version))
            if not ok:
                self.model.merged(key, version)  # raised at once: nothing was stored
                return None
            if future is self.model.futures.get(key):
                self.model.merged(key, version)
                return None
            self.model.started(key, future)
            future.add_done_callback(partial(self.model.finished, key, version))
            return future

    def get_one(self, rng: random.Random, key: bytes) -> None:
        mode = rng.randrange(3)
        out = np.empty((rows_of(kid_of(key)), ROW), dtype=np.uint16) if mode else None
        start = self.model.tick()
        if mode == 0:
            ok, got = self.call("get", self.store.get, key)
        elif mode == 1:
            ok, got = self.call("get(out)", self.store.get, key, out)
            got = out if got is not None else None
        else:
            ok, hit = self.call("get_into", self.store.get_into, key, out)
            got = out if hit else None
        if ok:
            self.model.read(key, start, got)

    def get_many(self, rng: random.Random) -> None:
        keys = rng.sample([key_of(k) for k in range(N_KEYS)], rng.randint(2, 6))
        outs = [np.empty((rows_of(kid_of(k)), ROW), dtype=np.uint16) for k in keys] if rng.random() < 0.5 else None
        start = self.model.tick()
        ok, got = self.call("get_many", self.store.get_many, keys, outs)
        if ok:
            for i, key in enumerate(keys):
                self.model.read(key, start, outs[i] if outs is not None and got[i] is not None else got[i])

    def lookups(self, rng: random.Random) -> None:
        key = self.pick(rng)
        self.call("contains", self.store.contains, key)
        self.call("where", self.store.where, key)
        self.call("contains_many", self.store.contains_many, [key, self.pick(rng)])
        ok, header = self.call("header", self.store.header, key)
        if ok and header is not None and tuple(header.shape) != (rows_of(kid_of(key)), ROW):
            self.model.violation(f"header({key!r}) gave shape {header.shape} of no version of the key")
        if rng.random() < 0.2:
            self.check_listing()

    def check_listing(self) -> None:
        ok, keys = self.call("keys", self.store.keys)
        for key in keys if ok else []:
            if kid_of(key) is None and not key.startswith(ODD_PREFIX):
                self.model.violation(f"keys() lists {key!r}, a key nobody stored")

    def delete(self, key: bytes) -> None:
        with self.key_locks[key], self.redis_lock:
            if self.redis_state != "up":
                return  # a delete cannot reach a stopped Redis: its copy would come back
            future = self.model.futures.get(key)
            if future is not None:
                try:
                    future.exception(timeout=60)  # a put racing the delete would make it moot
                except TimeoutError:
                    self.model.violation(f"put of {key!r} still running after 60 s")
                    return
            newest = self.model.versions[key]
            start = self.model.tick()
            if self.call("delete", self.store.delete, key)[0]:
                self.model.deleted(key, start, newest)

    def pinned(self, rng: random.Random) -> None:
        keys = rng.sample([key_of(k) for k in range(N_KEYS)], rng.randint(1, 2))
        ok, _ = self.call("lock", self.store.lock, keys)
        if ok:
            for key in keys:
                self.get_one(rng, key)
            self.call("unlock", self.store.unlock, keys)

    def odd_put(self, rng: random.Random) -> None:
        name = rng.choice(sorted(_ODD))
        key, chunk, refuse = _ODD[name]
        self.model.count("odd_puts")
        ok, future = self.call(f"put of {name}", self.store.put, key, chunk)
        if not ok:
            return
        try:
            stored = future.result(timeout=60)
        except KVShrinkError:
            return
        except Exception as exc:
            self.model.violation(f"put of {name}: its Future failed with {type(exc).__name__}: {exc}")
            return
        if stored and refuse:
            self.model.violation(f"put of {name} was acknowledged; it must be refused with a KVShrinkError")
        elif stored:
            ok, got = self.call(f"get of {name}", self.store.get, key)
            if ok and got is not None and not same_chunk(got, chunk):
                self.model.violation(f"{name} did not read back bit-exact: got {type(got).__name__} "
                                     f"{getattr(got, 'dtype', '')} {tuple(getattr(got, 'shape', ()))}")

    def one_op(self, rng: random.Random) -> None:
        roll = rng.random()
        if roll < 0.45:
            self.put(self.pick(rng))
        elif roll < 0.78:
            self.get_one(rng, self.pick(rng))
        elif roll < 0.88:
            self.get_many(rng)
        elif roll < 0.92:
            self.lookups(rng)
        elif roll < 0.94:
            self.delete(self.pick(rng))
        elif roll < 0.97:
            self.pinned(rng)
        else:
            self.odd_put(rng)

    def work(self, index: int) -> None:
        rng = random.Random(self.seed * 31 + index)
        while True:
            with self.gate.op():
                if self.stop.is_set():
                    return
                self.one_op(rng)

    # -- the controller
    def barrier(self) -> bool:
        """Pause the workers, wait for every put and background job, mark the point."""
        self.gate.close()
        try:
            if not self.model.wait_idle(120):
                self.model.violation("put Futures still pending 120 s after the workers paused")
                return False
            ok, _ = self.call("flush", self.store.flush, 120)
            if not ok:
                return False
            self.model.wait_idle(120)
            self.model.barrier()
            return True
        except TimeoutError as exc:
            self.model.violation(f"flush hung: {exc}")
            return False
        finally:
            self.gate.open()

    def live_damage(self, rng: random.Random) -> None:
        ssd = self.ssd
        if ssd is None:
            return
        key = self.pick(rng)
        path = ssd.path_for(key)
        if not path.exists():
            return
        donor = ssd.path_for(self.pick(rng))
        self.model.damaged(key)
        self.model.count("damage")
        done = damage_chunk_file(path, donor if donor != path and donor.exists() else None, rng)
        self.model.count(f"damage_chunk_{done}")

    def redis_fault(self, rng: random.Random) -> None:
        with self.redis_lock:
            if self.redis_state == "up" and rng.random() < 0.75:
                self.model.outage_begins("redis_stops")
                self.redis.pause()
                self.redis_state = "paused"
            elif self.redis_state == "up":
                self.model.outage_begins("redis_kills")
                self.redis.kill()
                self.redis_state = "down"
        self.redis_up_later = rng.randint(1, 4)

    def redis_up(self) -> None:
        with self.redis_lock:
            if self.redis_state == "paused":
                self.redis.resume()
                answers_ping(self.redis.url)
            elif self.redis_state == "down":
                self.redis.start()
            else:
                return
            self.redis_state = "up"
            self.model.outage_ends()

    def run(self, seconds: float) -> None:
        """Workers for ``seconds``, faults injected meanwhile; then a final barrier and a read
        of every key."""
        if self.store is None and self.open() is None:
            return
        if not _ODD:  # importing torch takes seconds: not inside a worker, where it stalls barriers
            _ODD.update(odd_cases())
        threads = [threading.Thread(target=self.work, args=(i,), name=f"fuzz-{i}", daemon=True)
                   for i in range(THREADS)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + seconds
        rng = self.rng
        self.redis_up_later = 0
        try:
            while time.monotonic() < deadline and self.model.counts["reads"] + self.model.counts["puts"] < MAX_OPS \
                    and len(self.model.violations) < 50:
                time.sleep(rng.uniform(0.03, 0.25))
                if self.redis is not None and self.redis_state != "up":
                    self.redis_up_later -= 1
                    if self.redis_up_later <= 0:
                        self.redis_up()
                    continue
                action = rng.choices(["barrier", "damage", "redis", "nothing"],
                                     [3, 2 if self.ssd else 0, 3 if self.redis else 0, 2])[0]
                if action == "barrier":
                    self.barrier()
                elif action == "damage":
                    self.live_damage(rng)
                elif action == "redis":
                    if rng.random() < 0.5:
                        self.barrier()  # a stop right after a barrier: false notices become visible
                    self.redis_fault(rng)
        finally:
            if self.redis is not None:
                self.redis_up()
            self.gate.close()
            self.stop.set()
            self.gate.open()
            for thread in threads:
                thread.join(timeout=120)
        self.barrier()
        self.read_all()

    def read_all(self, tag: str = "") -> None:
        for kid in range(N_KEYS):
            key = key_of(kid)
            start = self.model.tick()
            ok, got = self.call("get", self.store.get, key)
            if ok:
                self.model.read(key, start, got, tag)

    def restart(self, rng: random.Random, damage: bool) -> None:
        """Close (or find closed after a kill) and reopen three times: damage at rest may come
        before the first and the second reopen (the second after a clean close: then the index
        says CLEAN and must not be trusted blindly). After each of those two reopens every key is
        read (a miss is excused while the SSD reconcile runs) and a few chunks are put; after the
        third (any reconcile finished at the close before) every key is read strictly."""
        self.close()
        shm = next((SHM_DIR / t["shm_name"] for t in self.config["tiers"] if t["kind"] == "dram"), None)
        ssd_dir = next((Path(t["path"]) for t in self.config["tiers"] if t["kind"] == "ssd"), None)
        index = ssd_dir / "index.log" if ssd_dir else None
        older_index = index.read_bytes() if index is not None and index.exists() else None
        for step in range(2):
            self.damage_done = []
            if damage and (step == 0 or rng.random() < 0.5):
                self.damage_at_rest(rng, shm, ssd_dir, older_index if step else None)
            self.model.mark(f"reopen after damage {self.damage_done or 'none'}")
            if self.open() is None:
                return
            self.check_listing()
            pending = self.ssd is not None and not self.ssd.clean_start  # adoption runs in the background
            self.read_all("reconcile" if pending else "")
            self.puts_after_restart(rng)
            self.read_all("reconcile" if pending else "")
            self.close()
        self.model.mark("reopen")
        if self.open() is not None:
            self.check_listing()
            self.read_all()

    def puts_after_restart(self, rng: random.Random) -> None:
        for _ in range(rng.randint(3, 10)):
            self.put(self.pick(rng))
        self.model.wait_idle(60)
        # a damaged medium must still take puts: the smallest chunk (4 KiB) always fits once the
        # others are evicted (a big overwrite may not: both copies need room at once, and the old
        # one can split a small arena into holes too small for the new one)
        canary = key_of(min(range(N_KEYS), key=rows_of))
        future = self.put(canary)
        if future is not None and self.call("put result", future.result, 60)[1] is not True:
            tiers = {t.name: {k: v for k, v in t.stats().items() if k in ("chunks", "bytes_stored", "evictions")}
                     for t in self.store.tiers}
            self.model.violation(f"after the restart a put of {canary!r} (4 KiB) was not stored "
                                 f"({future.exception() or 'engine full'}; damage: {self.damage_done}; {tiers})")
        self.model.wait_idle(60)

    def damage_at_rest(self, rng: random.Random, shm: Path | None, ssd_dir: Path | None,
                       older_index: bytes | None) -> None:
        """Damage 1..3 of: SSD chunk files, the SSD index (or put back ``older_index``), the arena."""
        targets = [t for t, here in (("chunk", ssd_dir), ("index", ssd_dir), ("arena", shm)) if here]
        for target in rng.sample(targets, rng.randint(1, len(targets))):
            self.model.count("damage")
            if target == "chunk":
                files = sorted((ssd_dir / "chunks").glob("*/*.kvc"))
                names = {chunk_path(ssd_dir, key_of(k)).stem: key_of(k) for k in range(N_KEYS)}
                for path in rng.sample(files, min(len(files), rng.randint(1, 3))):
                    key = names.get(path.stem)
                    if key is not None:
                        self.model.damaged(key)
                    donor = rng.choice(files)
                    done = damage_chunk_file(path, donor if donor != path else None, rng)
                    self.model.count(f"damage_chunk_{done}")
                    self.damage_done.append(f"chunk file of {key!r}: {done}")
            elif target == "index":
                if older_index is not None and rng.random() < 0.3:
                    (ssd_dir / "index.log").write_bytes(older_index)  # a backup restored: stale, intact
                    done = "older-copy"
                else:
                    done = damage_index(ssd_dir / "index.log", rng)
                self.model.count(f"damage_index_{done}")
                self.damage_done.append(f"index.log: {done}")
            elif shm.exists():
                blocks = arena_blocks(shm)
                kind, keys = damage_arena(shm, blocks, rng)
                self.model.count(f"damage_arena_{kind}")
                self.damage_done.append(f"arena: {kind}")
                for key in keys:
                    if kid_of(key) is not None:
                        self.model.damaged(key)


def answers_ping(url: str, timeout: float = 15.0) -> None:
    """Wait until a resumed redis-server answers again."""
    import redis

    from kvshrink.testing.polling import poll_until

    def ping() -> bool:
        try:
            return bool(redis.Redis.from_url(url, socket_timeout=0.5).ping())
        except redis.RedisError:
            return False

    poll_until(ping, timeout, interval=0.02, what="redis-server to answer PING after SIGCONT")


def chunk_path(ssd_dir: Path, key: bytes) -> Path:
    from kvshrink.store.ssd import SUFFIX, chunk_name

    name = chunk_name(key)
    return ssd_dir / "chunks" / name[:2] / (name + SUFFIX)


def report(model: Model, name: str, seed: int, started: float, record_property: Any) -> None:
    """Print the counts, attach them to the report, and fail with every violation."""
    problems = model.check()
    line = model.summary(name, seed, time.monotonic() - started)
    print(line)
    record_property("fuzz_counts", line)
    kinds: dict[str, list[str]] = defaultdict(list)
    for problem in problems:
        kinds[problem.split(":")[0]].append(problem)
    shown = "\n".join(f"  {kind}: {len(found)}\n" + "\n".join(f"    - {p}" for p in found[:4])
                      for kind, found in kinds.items())
    assert not problems, f"{len(problems)} violations; rerun with KVSHRINK_FUZZ_SEED={SEED}\n{line}\n{shown}"


# -- configurations ----------------------------------------------------------------------------
def store_config(tmp_path: Path, shm_name: str, rng: random.Random, *, write_back: bool,
                 redis_url: str = "", namespace: str = "") -> dict:
    """Tiers a few chunks deep, so that every few puts evict, demote and drop."""
    tiers: list[dict] = [
        {"kind": "dram", "capacity": rng.choice([160, 224, 320]) * KiB, "shm_name": shm_name,
         "compressed": rng.random() < 0.3, "eviction": rng.choice(["lru", "fifo"])},
        {"kind": "ssd", "capacity": (320 if redis_url else 480) * KiB, "path": str(tmp_path / "ssd"),
         "write_back": write_back, "fsync": rng.random() < 0.2, "level": rng.randint(1, 3),
         "eviction": rng.choice(["lru", "fifo"])},
    ]
    if redis_url:
        tiers.append({"kind": "redis", "url": redis_url, "timeout_s": 0.2, "retries": 1, "write_back": True,
                      "namespace": namespace})
    engine = {"put_workers": 2, "background_workers": rng.choice([1, 2]), "read_workers": 2,
              "put_queue": rng.choice([8, 32, 64]), "background_queue": rng.choice([16, 64]),
              "staging_bytes": rng.choice([1, 4]) * 2**20}
    return {"tiers": tiers, "engine": engine, "promote_on_hit": rng.random() < 0.7,
            "persist_on_close": rng.random() < 0.6}


# -- the tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("write_back", [False, True], ids=["dram-ssd-exclusive", "dram-ssd-write-back"])
def test_fuzz_dram_ssd(tmp_path, shm_name, write_back, record_property):
    name = f"dram-ssd-{'write-back' if write_back else 'exclusive'}"
    seed, rng = seeded(name)
    started = time.monotonic()
    model = Model()
    fuzz = Fuzz(store_config(tmp_path, shm_name, rng, write_back=write_back), model, seed)
    with watching_logs(model):
        try:
            fuzz.run(share(0.17))
            fuzz.restart(rng, damage=True)
        finally:
            fuzz.close()
    report(model, name, seed, started, record_property)


def test_fuzz_dram_ssd_redis(tmp_path, shm_name, redis_server, record_property):
    seed, rng = seeded("dram-ssd-redis")
    started = time.monotonic()
    model = Model()
    cfg = store_config(tmp_path, shm_name, rng, write_back=True, redis_url=redis_server.url,
                       namespace=f"fuzz-{seed}")
    fuzz = Fuzz(cfg, model, seed, redis=redis_server)
    with watching_logs(model):
        try:
            fuzz.run(share(0.22))
            fuzz.restart(rng, damage=rng.random() < 0.5)
        finally:
            fuzz.close()
    report(model, "dram-ssd-redis", seed, started, record_property)


def replay(log: Path, model: Model) -> int:
    """Feed the child's log into the model; the number of acknowledged puts."""
    acks = 0
    for line in log.read_text().splitlines():
        parts = line.split()
        if not parts or parts[0] == "R":
            continue
        key = key_of(int(parts[1]))
        if parts[0] == "I":
            model.issue(key, int(parts[2]))
        elif parts[0] == "C":
            model.merged(key, int(parts[2]))
        elif parts[0] == "A":
            model.acked(key, int(parts[2]))
            acks += 1
        elif parts[0] == "F":
            model.count("engine_full")
        elif parts[0] == "E" and len(parts) == 5:
            model.count("put_errors")
            if parts[4] != "1":
                model.violation(f"child put of {key!r} v{parts[2]}: its Future failed with {parts[3]}")
        elif parts[0] == "D":
            model.dropped([key])
    return acks


def count_acks(log: Path) -> int:
    try:
        return log.read_bytes().count(b"\nA ")
    except FileNotFoundError:
        return 0


def test_fuzz_kill_9_and_damage(tmp_path, shm_name, record_property):
    """A child streams puts and is SIGKILLed at a random point; the media may then be damaged
    (chunk files, index.log, the arena); the parent reopens and checks every acknowledged put."""
    seed, rng = seeded("kill-9")
    started = time.monotonic()
    deadline = started + share(0.22)
    model = Model()
    dram_capacity = rng.choice([160, 224]) * KiB  # fixed: a new capacity reformats the arena
    with watching_logs(model):
        for round_no in range(1000):
            if time.monotonic() > deadline or len(model.violations) >= 50:
                break
            cfg = {"engine": {"put_workers": 2, "put_queue": 16}, "promote_on_hit": True,
                   "persist_on_close": rng.random() < 0.5,
                   "tiers": [{"kind": "dram", "capacity": dram_capacity, "shm_name": shm_name,
                              "compressed": rng.random() < 0.3},
                             {"kind": "ssd", "capacity": 1 << 30, "path": str(tmp_path / "ssd"),
                              "write_back": rng.random() < 0.5, "fsync": rng.random() < 0.2}]}
            log = tmp_path / f"child-{round_no}.log"
            errors = tmp_path / f"child-{round_no}.err"
            with open(errors, "wb") as err:
                child = subprocess.Popen([sys.executable, str(WORKER), json.dumps(cfg), str(log), str(seed + round_no),
                                          str((round_no + 1) * 100_000), str(N_KEYS), str(HOT)],
                                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
            target = rng.choice([0, rng.randint(1, 20), rng.randint(1, 100)])
            try:
                give_up = time.monotonic() + 60
                while (count_acks(log) < target or not log.exists()) and child.poll() is None \
                        and time.monotonic() < give_up:
                    time.sleep(0.005)
                time.sleep(rng.uniform(0, 0.03))  # land the kill anywhere, not just after an ack
            finally:
                child.kill()
                child.wait()
            if child.returncode != -9:
                model.violation(f"child {round_no} exited with {child.returncode}:\n{errors.read_text()[-2000:]}")
                break
            model.count("kills")
            if not log.exists():
                model.violation(f"child {round_no} never opened its store:\n{errors.read_text()[-2000:]}")
                break
            replay(log, model)
            fuzz = Fuzz(cfg, model, seed + round_no)
            try:
                fuzz.restart(rng, damage=rng.random() < 0.7)
            finally:
                fuzz.close()
    report(model, "kill-9", seed, started, record_property)


def test_config_levels_are_refused_or_usable(tmp_path):
    """A level the config accepts must be one the codec takes: else every put to the tier fails."""
    seed, rng = seeded("levels")
    levels = sorted({-7, -1, 0, 1, 22, 23, 100} | set(rng.sample(range(-8, 40), 4)))
    accepted_but_broken = []
    for method in ("zstd", "qat"):
        for level in levels:
            cfg = {"tiers": [{"kind": "ssd", "capacity": 1 << 24, "path": str(tmp_path / f"{method}{level}"),
                              "method": method, "level": level, "fsync": False}]}
            try:
                store = TieredStore.from_config(cfg)
            except ConfigError as exc:
                assert exc.key.endswith(".level"), f"level {level} of {method} refused under {exc.key!r}: {exc}"
                continue
            with store:
                try:
                    stored = store.put(b"k001", make_chunk(1, 7)).result(timeout=60)
                    back = identify(1, store.get(b"k001"))[0] if stored else None
                except Exception as exc:  # KVShrinkError or not: the config promised this level works
                    accepted_but_broken.append(f"{method} level {level}: {type(exc).__name__}: {exc}")
                    continue
                if back != 7:
                    accepted_but_broken.append(f"{method} level {level}: put {stored}, read back {back}")
    assert not accepted_but_broken, f"seed {seed}: the config accepted levels the codec refuses:\n" + \
        "\n".join(accepted_but_broken)
