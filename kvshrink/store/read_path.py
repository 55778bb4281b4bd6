"""The read path: ``get_many`` and the lookups (``header``, ``where``, ``contains_many``, ``keys``).

A read looks tier by tier, fastest first, and takes the first hit; a parked chunk is read from
memory; a copy hidden on a remote tier (an older value, see the ledger) is skipped. Looks are
*settled* (:meth:`~kvshrink.store.tier_set.TierSet.settled`): a look that found nothing while a
chunk moved between tiers looks again. Chunks local tiers hold are read and decoded on a few
*lanes* (the caller's thread among them, as many as the codec budget has tokens, see
:meth:`ReadPath.reserve_lanes`); chunks only a remote tier may hold are fetched one per key on the
reader pool and decoded as each arrives (one batched fetch would hold every decode back until its
last byte arrived). A hit below the first tier queues a promotion.

Threads: any thread; one lock guards the count of busy lanes. ``get_many`` returns only once no
lane writes into the caller's buffers any more, also when it raises. Errors: a missing, corrupt or
unreachable chunk is a miss (None); a wrong-sized ``out`` raises (ValueError / TypeError) after
every lane stopped. Buffers: decoded into the caller's ``outs`` when given, else into new arrays
the caller owns; parked frames are only read.
"""

from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import wait
from functools import partial
from typing import Any, Callable

from kvshrink.errors import StoreUnavailableError
from kvshrink.store.config import StoreConfig
from kvshrink.store.copy_engine import CopyEngine
from kvshrink.store.drop_reports import DropReports
from kvshrink.store.idle import IdleTracker
from kvshrink.store.prefetch import Prefetcher
from kvshrink.store.tier_base import Tier
from kvshrink.store.tier_set import TierSet

log = logging.getLogger(__name__)

Hit = tuple[int, Any, "int | None"]  # (position in the batch, chunk or None, tier it came from; None: parked)


class ReadPath:
    """Reads chunks and answers lookups over a :class:`TierSet`; see the module docstring."""

    def __init__(self, tiers: TierSet, config: StoreConfig, engine: CopyEngine, reports: DropReports,
                 prefetch: Prefetcher, idle: IdleTracker | None, promote: Callable[[int, bytes], None]) -> None:
        self._tiers = tiers
        self._ledger = tiers.ledger
        self._config = config
        self._engine = engine
        self._reports = reports
        self._prefetch = prefetch
        self._idle = idle
        self._promote = promote  # CopyJobs.promote, queued on the background lane
        self._lock = threading.Lock()
        self.lanes_busy = 0  # lanes reserved now (under _lock): see reserve_lanes

    def get_many(self, keys: list[bytes], outs: list[Any]) -> list[Any]:
        """Chunks for ``keys`` (checked by the caller; None for misses), decoded into ``outs``
        (None entries: new arrays); each lane runs :meth:`drain`."""
        self._prefetch.before_read(keys)  # wait for moves running, take queued ones over
        held = [self._tiers.held_locally(k) for k in keys]
        local = [i for i, here in enumerate(held) if here]
        remote = [i for i, here in enumerate(held) if not here]
        lanes, crowded = self.reserve_lanes([keys[i] for i in local])
        # lanes pull local chunks from one counter, the caller's among them (a single get never
        # changes threads); see drain for which decodes run alone
        take = itertools.count().__next__
        run_lane = partial(self.drain, take, local, keys, outs, lanes, crowded)
        pending = []
        try:
            for _ in range(lanes - 1):
                pending.append(self._engine.readers.submit(run_lane))
        except RuntimeError:  # the pool shut down (a close racing this read): the caller reads more
            self.release_lanes(lanes - 1 - len(pending))
        try:
            hits = list(self._read_remote(keys, outs, remote))
            if lanes:
                hits += run_lane()
        finally:
            wait(pending)  # no lane writes into the caller's buffers once this returns or raises
        for future in pending:
            hits += future.result()
        return self._finish(keys, local, hits)

    def _finish(self, keys: list[bytes], local: list[int], hits: list[Hit]) -> list[Any]:
        """The batch's results in order; promotions queued, first-tier reads noted, and chunks that
        were held when the read began but read as a miss (quarantined, file vanished) reported."""
        results: list[Any] = [None] * len(keys)
        found_in: list[int | None] = [None] * len(keys)
        for i, chunk, tier_index in hits:
            results[i], found_in[i] = chunk, tier_index
            if tier_index and self._config.promote_on_hit and self._engine.schedule(self._promote, tier_index, keys[i]):
                self._engine.counters.add("promotions")
        first = [keys[i] for i, chunk in enumerate(results) if chunk is not None and found_in[i] == 0]
        self._prefetch.read(first)
        if self._idle is not None:
            self._idle.touch(first)
        self._reports.report([keys[i] for i in local if results[i] is None])
        return results

    def reserve_lanes(self, keys: list[bytes]) -> tuple[int, bool]:
        """Threads that read ``keys`` (held locally) at once, the caller included, counted as
        busy until each lane ends (:meth:`drain`): as many as the codec budget has tokens, plus
        one reading ahead when some chunk waits on a device (its read overlaps the decodes),
        less the lanes other reads run now, at most ``engine.read_workers + 1``. More would only
        queue for tokens. Also whether other reads held lanes already (``crowded``: then no
        decode of this batch hands blocks to helpers)."""
        cap = 1
        if len(keys) > 1:
            device = [t for t in self._tiers.local if self._tiers.tiers[t].device_reads]
            ahead = 1 if device and any(self._tiers.tiers[t].contains(k) for k in keys for t in device) else 0
            cap = min(self._engine.codec_budget.limit() + ahead, self._config.engine.read_workers + 1)
        with self._lock:
            crowded = self.lanes_busy > 0
            lanes = min(len(keys), max(1, cap - self.lanes_busy))
            self.lanes_busy += lanes
        return lanes, crowded

    def release_lanes(self, n: int) -> None:
        with self._lock:
            self.lanes_busy -= n

    def drain(self, take: Callable[[], int], local: list[int], keys: list[bytes], outs: list[Any],
              lanes: int, crowded: bool) -> list[Hit]:
        """One of the ``lanes`` read lanes of ``get_many`` (reserved by :meth:`reserve_lanes`;
        released here): read the chunks ``local[take()]`` until none is left (``take`` is shared:
        each chunk is read once). While there are chunks for every lane, or other reads run lanes
        too (``crowded``), each is decoded alone (serial); else the last few block-parallel."""
        hits = []
        try:
            while (j := take()) < len(local):
                i = local[j]
                serial = crowded or len(local) - j >= lanes > 1
                hits.append(self._read_from(i, keys[i], outs[i], serial))
        finally:
            self.release_lanes(1)
        return hits

    def _read_from(self, i: int, key: bytes, out: Any, serial: bool = False) -> Hit:
        """Try the tiers in order; the first hit wins. A parked chunk is read from memory (reported
        as found in no tier: nothing to promote). ``serial``: decode on this thread alone."""
        def look() -> tuple[Any, int | None] | None:
            for index, tier in enumerate(self._tiers.tiers):
                parked = self._ledger.parked_frame(key, index)
                if parked is not None:
                    chunk = _decode(self._engine.codecs.decoder(serial), parked, out)
                    if chunk is not None:
                        return chunk, None
                if self._tiers.hidden(index, key):
                    continue
                chunk = tier.get(key, out, serial=serial)
                if chunk is not None:
                    return chunk, index
            return None

        found = self._tiers.settled(key, look)
        return (i, None, None) if found is None else (i, *found)

    def _read_remote(self, keys: list[bytes], outs: list[Any], indices: list[int]):
        """Keys no local tier holds, from each remote tier in turn: one fetch per key on the
        reader pool, each decoded as soon as it arrives, so decodes overlap the transfers still
        on the wire (where the link is the limit, a batched fetch costs the compression's gain)."""
        for index, tier in enumerate(self._tiers.tiers):
            if not indices:
                return
            if index not in self._tiers.remote:
                for i in indices:
                    tier.counters.add("misses")
                continue
            ask = [i for i in indices if not self._ledger.is_stale(index, keys[i])]
            reads = [self._engine.readers.submit(_fetch_decode, tier, keys[i], outs[i]) for i in ask]
            missing = set(indices) - set(ask)
            for i, read in zip(ask, reads):
                chunk = read.result()
                if chunk is None:
                    missing.add(i)
                else:
                    yield i, chunk, index
            for i in set(indices) - set(ask):
                tier.counters.add("misses")
            indices = sorted(missing)

    def header(self, key: bytes) -> Any:
        """The stored chunk's frame header (dtype, shape, sizes) without decoding it, or None."""
        from kvshrink.codec import CodecError, read_header

        def look() -> Any:
            for index, tier in enumerate(self._tiers.tiers):
                parked = self._ledger.parked_frame(key, index)
                if parked is not None:
                    try:
                        return read_header(parked)
                    except CodecError:
                        pass
                if self._tiers.hidden(index, key):
                    continue
                found = tier.header(key)
                if found is not None:
                    return found
            return None

        return self._tiers.settled(key, look)

    def where(self, key: bytes) -> str | None:
        """Name of the fastest tier holding ``key`` (a parked chunk: the tier it is bound for)."""
        def look() -> str | None:
            for index, tier in enumerate(self._tiers.tiers):
                if self._ledger.parked_frame(key, index) is not None:
                    return tier.name
                if self._tiers.hidden(index, key):
                    continue
                if tier.contains(key):
                    return tier.name
            return None

        return self._tiers.settled(key, look)

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """Membership for a batch: local tiers first, then one round trip per remote tier."""
        found = [self._tiers.held_locally(k) for k in keys]
        for index in self._tiers.remote:
            missing = [i for i, hit in enumerate(found) if not hit and not self._ledger.is_stale(index, keys[i])]
            if missing:
                for i, hit in zip(missing, self._tiers.tiers[index].contains_many([keys[i] for i in missing])):
                    found[i] = hit
        return found

    def keys(self, tier: str | None = None) -> list[bytes]:
        """Keys held by one tier (by name) or by any tier, without duplicates (a parked chunk
        counts for the tier it is bound for). Best effort: an unreachable tier is logged and
        left out (its error is counted)."""
        found: dict[bytes, None] = {}
        for index, t in enumerate(self._tiers.tiers):
            if tier is not None and t.name != tier:
                continue
            try:
                listed = t.keys()
            except StoreUnavailableError as exc:
                log.warning("listing keys: %s", exc)
                listed = []
            if index in self._tiers.remote:
                listed = [k for k in listed if not self._ledger.is_stale(index, k)]
            found.update(dict.fromkeys(listed))
            found.update(dict.fromkeys(k for k, _ in self._ledger.parked_entries(index)))
        return list(found)


def _fetch_decode(tier: Tier, key: bytes, out: Any) -> Any:
    """One chunk of a remote tier, decoded into ``out``; None for a miss (counted) or a corrupt
    frame (the tier counts and quarantines it)."""
    (frame,) = tier.fetch_frames([key])
    if frame is None:
        tier.counters.add("misses")
        return None
    return tier.decode_frame(key, frame, out)


def _decode(codec: Any, frame: bytes, out: Any) -> Any:
    """A parked frame decoded (into ``out`` when given); None if it does not decode."""
    from kvshrink.codec import CodecError

    try:
        return codec.decode(frame, out=out)
    except CodecError:
        return None
