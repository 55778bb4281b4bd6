"""Remote parking: victims of a local tier on their way to a remote tier (Redis), held in memory.

A demotion into a remote tier never runs on the evicting worker: the chunk is *parked* in the
:class:`~kvshrink.store.ledger.CopyLedger` (still readable there) and a background *pump* lands
parked chunks oldest first, each unparked only once it landed, so a read finds it in one place or
the other. A refusal (the tier is down or hung) stops the pump; the next park retries after
:data:`PUMP_RETRY_S`, a flush at once. Beyond the parking budget (``engine.staging_bytes``) the
oldest parked chunks are given up: hidden on their target (a write that timed out may still apply
there) and returned as drop candidates. At close, what Redis still refuses is given up and
reported, and the older copies the ledger hides on remote tiers are deleted there.

Threads: any thread; one lock guards the pump's own state and is never held across a tier call;
landing goes through :meth:`~kvshrink.store.write_path.WritePath.write` (its locks). Errors: a
refusal is logged and leaves the chunk parked; a frame that fails to convert is given up.
Buffers: a parked frame belongs to the ledger until it lands or is given up.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from kvshrink.errors import KVShrinkError, StoreUnavailableError
from kvshrink.store import tier_codecs
from kvshrink.store.drop_reports import DropReports
from kvshrink.store.ledger import Move, Parked
from kvshrink.store.tier_set import TierSet
from kvshrink.store.write_path import WritePath, drop_candidates_of

log = logging.getLogger(__name__)

PUMP_RETRY_S = 1.0  # after a remote tier refused a parked chunk, the next try waits this long (or a flush)


class RemoteParking:
    """Parks victims bound for remote tiers and pumps them there in the background."""

    def __init__(self, tiers: TierSet, writes: WritePath, reports: DropReports, budget_bytes: int,
                 schedule: Callable[..., Any]) -> None:
        self._tiers = tiers
        self._ledger = tiers.ledger
        self._writes = writes
        self._reports = reports
        self._budget = budget_bytes
        self._schedule = schedule  # CopyEngine.schedule: queue a background job
        self._lock = threading.Lock()
        self._pumping = False  # a pump job is queued or running
        self._pump_failed_at = -PUMP_RETRY_S

    def park(self, key: bytes, frame: bytes, source: int, move: Move | None) -> list[bytes]:
        """Hold a victim of tier ``source`` bound for remote tier ``source + 1`` in memory (still
        readable) and make sure the pump will land it; takes over ``move``. Returns the keys given
        up to stay within the budget (drop candidates)."""
        entry = Parked(frame, source, source + 1, move, len(frame))
        given_up = []
        for old_key, old in self._ledger.park(key, entry, self._budget):
            self._give_up(old_key, old, "the parking budget is spent")
            given_up.append(old_key)
        self.kick()
        return given_up

    def kick(self, force: bool = False) -> None:
        """Queue the pump unless it is queued already (or refused lately, unless ``force``)."""
        with self._lock:
            recent = time.monotonic() - self._pump_failed_at < PUMP_RETRY_S
            if self._pumping or not self._ledger.parked or (recent and not force):
                return
            self._pumping = True
        if not self._schedule(self.pump):
            with self._lock:  # the lane is full: the next park or flush retries
                self._pumping = False

    def pump(self) -> None:
        """Land parked chunks on their remote tiers, oldest first; the first refusal stops the run.
        Runs as a background job, and once more (inline) at close."""
        drop_candidates: list[bytes] = []
        failed = False
        try:
            for key, entry in iter(self._oldest, None):
                landed = self._land(key, entry)
                if landed is None:
                    failed = True
                    break
                drop_candidates += landed
        finally:
            with self._lock:
                self._pumping = False
                if failed:
                    self._pump_failed_at = time.monotonic()
            self._reports.report(drop_candidates)
        if not failed:
            self.kick()  # parked while this run finished

    def _oldest(self) -> tuple[bytes, Parked] | None:
        entries = self._ledger.parked_entries(limit=1)
        return entries[0] if entries else None

    def _land(self, key: bytes, entry: Parked) -> list[bytes] | None:
        """Write one parked chunk to its target and unpark it; its drop candidates, or None when
        the tier refused it (it stays parked)."""
        target = self._tiers.tiers[entry.target]
        try:
            entry.frame = tier_codecs.convert(entry.frame, target)
        except KVShrinkError as exc:  # a frame that fails to decode: nothing to land
            self._ledger.unpark(key, entry)
            self._give_up(key, entry, str(exc))
            return [key]
        try:
            written = self._writes.write(entry.target, key, entry.frame, entry.move)
        except StoreUnavailableError as exc:
            log.warning("tier %s refused a parked chunk (%s); %d evicted chunks wait in memory",
                        target.name, exc, len(self._ledger.parked))
            self._reports.report(drop_candidates_of(exc))
            return None
        self._ledger.unpark(key, entry)
        self._ledger.end(entry.move)
        if written.landed:
            self._tiers.tiers[entry.source].counters.add("demotions")
        return written.drop_candidates

    def _give_up(self, key: bytes, entry: Parked, why: str) -> None:
        """A parked chunk will not land: hide whatever its target holds under the key (a write
        that timed out may still apply), so that the drop report that follows is true."""
        self._ledger.hide(entry.target, key)
        self._ledger.end(entry.move)
        log.warning("demotion of %s to tier %s abandoned: %s", key.hex()[:32],
                    self._tiers.tiers[entry.target].name, why)

    def close(self) -> None:
        """At close, after the queues drained: a last try for what is parked, then what is still
        parked is given up and reported; older copies hidden on remote tiers are deleted there."""
        if self._ledger.parked:
            self.pump()
            given_up = []
            for key, entry in self._ledger.parked_entries():
                self._ledger.unpark(key, entry)
                self._give_up(key, entry, "the store closed while the tier refused it")
                given_up.append(key)
            self._reports.report(given_up)
        self._delete_hidden()

    def _delete_hidden(self) -> None:
        """Delete from each remote tier the older copies the ledger hides there, so that the next
        process (which knows nothing of them) does not serve them; stops at the first error."""
        for index in self._tiers.remote:
            tier = self._tiers.tiers[index]
            for key in list(self._ledger.stale[index]):
                errors = tier.counters["errors"]
                tier.delete(key)
                if tier.counters["errors"] != errors:
                    log.warning("close: tier %s unreachable; %d older copies stay there",
                                tier.name, len(self._ledger.stale[index]))
                    break
                self._ledger.unhide(index, [key])
