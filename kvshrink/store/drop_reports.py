"""Drop reports: which of the keys a store operation may have removed really left the store.

Every part of the store that removes chunks (a write's evictions, a failed demotion, a parked
chunk given up, a read that found a chunk corrupt) returns its *drop candidates*; the store hands
them to :meth:`DropReports.report` once it released every lock. Local tiers and the ledger are
asked at once; a key a remote tier may hold is checked with that tier in a background job, and
reported only if the tier *answered* that it lacks it (see
:class:`~kvshrink.store.drops.DropListeners` for the listeners' contract). Threads: any thread,
never under a store lock (listeners run on the calling thread). Errors: none raised; a remote tier
that cannot answer suppresses the notice (logged). Buffers: none.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from kvshrink.store.drops import DropListeners
from kvshrink.store.placements import PlacementListeners
from kvshrink.store.tier_set import TierSet

log = logging.getLogger(__name__)


class DropReports:
    """Checks drop candidates and fires the drop listeners for those no tier holds."""

    def __init__(self, tiers: TierSet, drops: DropListeners, placements: PlacementListeners,
                 schedule: Callable[..., Any]) -> None:
        self._tiers = tiers
        self._drops = drops
        self._placements = placements
        self._schedule = schedule  # CopyEngine.schedule: queue a background job

    def report(self, candidates: Sequence[bytes]) -> None:
        """Fire the drop listeners for the ``candidates`` no tier holds any more; a key a remote
        tier may hold is checked with it in the background. Call with no store lock held."""
        if not candidates:
            return
        self._placements.notify(list(candidates))
        gone, unsure = [], []
        for key in dict.fromkeys(candidates):
            if self._tiers.held_anywhere_known(key):
                continue
            maybe_remote = any(not self._tiers.ledger.is_stale(t, key) for t in self._tiers.remote)
            (unsure if maybe_remote else gone).append(key)
        if gone:
            self._drops.fire(gone)
        if unsure:
            self._schedule(self._check_remote_job, unsure)

    def _check_remote_job(self, keys: list[bytes]) -> None:
        """Ask the remote tiers about drop candidates; report those every tier answered it lacks.
        A tier that could not answer (it counted an error meanwhile) stops the check: no notice."""
        for index in self._tiers.remote:
            ask = [k for k in keys if not self._tiers.ledger.is_stale(index, k)]
            if not ask:
                continue
            tier = self._tiers.tiers[index]
            errors = tier.counters["errors"]
            held = tier.contains_many(ask)
            if tier.counters["errors"] != errors:
                log.info("tier %s did not answer; %d possibly dropped keys are not reported", tier.name, len(keys))
                return
            present = {k for k, here in zip(ask, held) if here}
            keys = [k for k in keys if k not in present]
        gone = [k for k in keys if not self._tiers.held_anywhere_known(k)]
        if gone:
            self._drops.fire(gone)
