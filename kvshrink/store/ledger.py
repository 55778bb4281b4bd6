"""The copy ledger: what the store knows about copies of keys beyond what each tier says.

:class:`CopyLedger` orders copies between tiers (demotion, write-back, promotion: each a
:class:`Move`) against puts of the same key, so a put always wins; it hides superseded copies on
remote tiers, remembers which keys a remote tier backs, and holds :class:`Parked` chunks on their
way to Redis. Contract (see the class docstring): thread-safe, one ``threading.Condition``
(``_cv``) guards everything and is never held across a tier call (the caller holds the tier
write locks, outermost); ``landing`` and ``superseding`` may wait on it. Errors: it does no I/O
and raises no store error. Buffers: a parked ``frame`` is owned by the ledger until it is unparked
or given up; the ledger never modifies it. What it knows lives in this process only.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

@dataclass(eq=False)
class Move:
    """One copy of a key's frame on its way between tiers (demotion, write-back, promotion).
    ``doomed``: a put (or delete) of the key came after the frame was read, so it must not land.
    A move made with ``key=None`` stands for the victims a write has not named yet: it collects
    the keys superseded while it lives (``superseded``), see :meth:`CopyLedger.adopt`."""

    key: bytes | None
    doomed: bool = False
    superseded: set[bytes] = field(default_factory=set)


@dataclass(eq=False)
class Parked:
    """A victim of a local tier on its way to a remote one, held in memory until it lands.
    ``frame`` is in the source tier's format until the first try converts it for the target."""

    frame: bytes
    source: int
    target: int
    move: Move
    size: int = 0  # bytes counted against the parking budget


class CopyLedger:
    """What the store knows about copies of keys beyond what each tier says, and the order of
    copies between tiers against puts of the same key.

    Why: a copy read from one tier lands in another some time later. A put of the key in between
    must win: the copy must not land after the put made it obsolete, and no older copy may stay
    readable once the put's Future is True. So every copy registers a :class:`Move` *before* it
    reads its frame. A put writes its first put tier under that tier's write lock and, still
    holding it, marks the key *superseding*, dooms every registered move of the key (moves
    registered meanwhile are born doomed), waits for doomed moves still writing into a local
    tier, and deletes the key from the other local tiers; a doomed move never starts writing.
    Demotions out of the first put tier read their frame under its write lock, so a move of the
    new value cannot exist before the put is done; any other move registered before the put is
    done may carry an older value (a copy of the new one that is doomed needlessly is redone by
    the put's own write-back). A put whose write fails retires and dooms nothing.

    Remote tiers (Redis) are never waited for or written on a put's path. The put *hides* the
    key there instead (``stale``): reads, ``contains`` and drop checks skip a hidden copy, and
    the next copy of the current value that lands there un-hides it. Hidden copies are deleted
    from Redis at ``close`` (best effort); until then they cost a set entry each. Copies that
    land on one remote tier are serialised per key, so a doomed one never overtakes a fresh one.
    ``backed`` remembers which keys a remote tier holds the current value of (this process wrote
    it there), so evictions need not ask Redis; ``parked`` holds evicted chunks on their way to
    Redis, readable meanwhile.

    Limits: a write that Redis applies after the client gave up on it (a hung server that
    resumes) can land after a newer one. What the ledger knows lives in this process only: after
    a restart, nothing is hidden or known to be backed (evictions then write to Redis again).

    Thread-safe; ``_cv`` guards everything and is never held across a tier call.
    """

    def __init__(self, remote: Sequence[int]) -> None:
        self._cv = threading.Condition()
        self._moves: dict[bytes, list[Move]] = {}
        self._open_victims: list[Move] = []  # key=None moves of writes that evict
        self._landing: Counter[tuple[bytes, int]] = Counter()  # (key, tier) -> moves writing it there now
        self._superseding: Counter[bytes] = Counter()
        self.parked: dict[bytes, Parked] = {}  # oldest first
        self.parked_bytes = 0
        self.stale: dict[int, set[bytes]] = {t: set() for t in remote}
        self.backed: dict[int, set[bytes]] = {t: set() for t in remote}
        self.moved = 0  # chunks moved up or unparked: a read that missed while it changed looks again
        self._evicting: Counter[bytes] = Counter()  # evicted by a write that did not plan it, not yet demoted

    # -- moves ------------------------------------------------------------------------------------
    def begin(self, key: bytes) -> Move:
        """Register a copy of ``key`` about to read its frame; call :meth:`end` when done."""
        with self._cv:
            return _register(self._moves, key, self._superseding[key] > 0)

    def begin_victims(self) -> Move:
        """A move for the victims a tier write is about to evict (their keys are known after it)."""
        move = Move(None)
        with self._cv:
            self._open_victims.append(move)
        return move

    def adopt(self, victims: Move, key: bytes) -> Move:
        """The move of victim ``key`` of ``victims``: doomed if the key was superseded since."""
        with self._cv:
            return _register(self._moves, key, key in victims.superseded or self._superseding[key] > 0)

    def end(self, move: Move | None) -> None:
        """The copy is done (landed, abandoned or failed); ending a move twice is harmless."""
        if move is None:
            return
        with self._cv:
            if move.key is None:
                self._open_victims.remove(move)
            else:
                _unregister(self._moves, move)

    @contextmanager
    def landing(self, move: Move | None, key: bytes, index: int) -> Iterator[bool]:
        """Around a tier write of ``key`` into tier ``index``: yields False (write nothing) when
        ``move`` is doomed. Writes into a remote tier wait for one of the same key there."""
        with self._cv:
            if index in self.stale:
                self._cv.wait_for(lambda: not self._landing[(key, index)] or (move is not None and move.doomed))
            ok = move is None or not move.doomed
            if ok:
                self._landing[(key, index)] += 1
        try:
            yield ok
        finally:
            if ok:
                with self._cv:
                    self._landing[(key, index)] -= 1
                    if not self._landing[(key, index)]:
                        del self._landing[(key, index)]
                    self._cv.notify_all()

    def landed(self, index: int, key: bytes, move: Move | None) -> None:
        """A write of ``key`` into tier ``index`` succeeded: on a remote tier, it now holds the
        current value (unless a put superseded the move meanwhile)."""
        if index not in self.stale:
            return
        with self._cv:
            if move is None or not move.doomed:
                self.stale[index].discard(key)
                self.backed[index].add(key)

    @contextmanager
    def superseding(self, key: bytes, wait_for: Sequence[int], hide_in: Sequence[int]) -> Iterator[bool]:
        """A put or a delete of ``key`` runs inside: every move of the key is doomed, its parked
        chunk dropped, its copies on the ``hide_in`` tiers hidden, and landings in the
        ``wait_for`` tiers finished before the body runs (a doomed move that was already writing
        lands first, so the body sees it); moves that begin inside are born doomed. Yields
        whether a parked chunk was dropped."""
        with self._cv:
            self._superseding[key] += 1
            parked = self._doom_locked(key)
            if parked:
                self.moved += 1  # its parked copy went, the new one is in place: a read that missed looks again
            for index in hide_in:
                self.stale[index].add(key)
            self._cv.wait_for(lambda: not any(self._landing[(key, t)] for t in wait_for))
        try:
            yield parked
        finally:
            with self._cv:
                self._superseding[key] -= 1
                if not self._superseding[key]:
                    del self._superseding[key]

    def _doom_locked(self, key: bytes) -> bool:
        for move in self._moves.get(key, ()):
            move.doomed = True
        for victims in self._open_victims:
            victims.superseded.add(key)
        for backed in self.backed.values():
            backed.discard(key)
        return self._pop_locked(key, end=True) is not None

    # -- what remote tiers and the parking hold ---------------------------------------------------
    def holds(self, index: int, key: bytes) -> bool:
        """Whether remote tier ``index`` is known to hold the current value of ``key``."""
        with self._cv:
            return key in self.backed[index] and key not in self.stale[index]

    def is_stale(self, index: int, key: bytes) -> bool:
        with self._cv:
            return key in self.stale.get(index, ())

    def hide(self, index: int, key: bytes) -> None:
        with self._cv:
            self.stale[index].add(key)
            self.backed[index].discard(key)

    def unhide(self, index: int, keys: Sequence[bytes]) -> None:
        with self._cv:
            self.stale[index].difference_update(keys)

    def forget_backed(self, index: int, key: bytes) -> None:
        """Remote tier ``index`` may still hold the current value of ``key``, but no local copy
        is left whose eviction could rely on it: the next demotion writes it there again."""
        with self._cv:
            self.backed[index].discard(key)

    def park(self, key: bytes, entry: Parked, budget: int) -> list[tuple[bytes, Parked]]:
        """Park ``entry``; return the oldest entries taken out to stay within ``budget`` bytes
        (the caller gives them up)."""
        with self._cv:
            self._pop_locked(key, end=True)
            self.parked[key] = entry
            self.parked_bytes += entry.size
            evicted = []
            while self.parked_bytes > budget and self.parked:
                oldest = next(iter(self.parked))
                evicted.append((oldest, self._pop_locked(oldest)))
            return evicted

    def _pop_locked(self, key: bytes, end: bool = False) -> Parked | None:
        entry = self.parked.pop(key, None)
        if entry is not None:
            self.parked_bytes -= entry.size
            if end and entry.move is not None:
                _unregister(self._moves, entry.move)
        return entry

    def recall(self, key: bytes, target: int) -> None:
        """The demotion of ``key`` to remote tier ``target`` is undone (the chunk stayed in the
        faster tier): its parked chunk is dropped, its move doomed (a landing in progress then
        does not count as the current value) and whatever the target holds under it hidden."""
        with self._cv:
            entry = self.parked.get(key)
            if entry is not None and entry.target == target:
                if entry.move is not None:
                    entry.move.doomed = True
                self._pop_locked(key, end=True)
            self.stale[target].add(key)
            self.backed[target].discard(key)

    def parked_entries(self, index: int | None = None, limit: int | None = None) -> list[tuple[bytes, Parked]]:
        """The parked chunks (bound for tier ``index`` when given), oldest first, ``limit`` at most."""
        with self._cv:
            entries = ((k, e) for k, e in self.parked.items() if index is None or e.target == index)
            return list(itertools.islice(entries, limit))

    def unpark(self, key: bytes, entry: Parked) -> None:
        with self._cv:
            if self.parked.get(key) is entry:
                self._pop_locked(key)
                self.moved += 1

    def parked_frame(self, key: bytes, index: int | None = None) -> bytes | None:
        """The parked frame of ``key`` (bound for tier ``index`` when given), or None."""
        with self._cv:
            entry = self.parked.get(key)
        if entry is None or (index is not None and entry.target != index):
            return None
        return entry.frame

    def note_moved(self) -> None:
        with self._cv:
            self.moved += 1

    def evicting(self, key: bytes) -> None:
        """A tier is evicting ``key`` before its demotion (a victim the write did not plan): for
        a moment no tier holds it. Call :meth:`evicted` once it was demoted (or given up)."""
        with self._cv:
            self._evicting[key] += 1
            self.moved += 1

    def evicted(self, keys: Sequence[bytes]) -> None:
        with self._cv:
            for key in keys:
                self._evicting[key] -= 1
                if self._evicting[key] <= 0:
                    del self._evicting[key]
            self._cv.notify_all()

    def wait_evicted(self, key: bytes, timeout: float) -> bool:
        """Wait until ``key`` is no longer between eviction and demotion; False if it was not."""
        with self._cv:
            if not self._evicting[key]:
                return False
            self._cv.wait_for(lambda: not self._evicting[key], timeout)
            return True


def _register(moves: dict[bytes, list[Move]], key: bytes, doomed: bool) -> Move:
    """A new move of ``key`` entered in ``moves`` (call with the ledger's condition held)."""
    move = Move(key, doomed)
    moves.setdefault(key, []).append(move)
    return move


def _unregister(moves: dict[bytes, list[Move]], move: Move) -> None:
    """``move`` taken out of ``moves``, if it is there (call with the ledger's condition held)."""
    registered = moves.get(move.key, [])
    if move in registered:
        registered.remove(move)
    if not registered:
        moves.pop(move.key, None)
