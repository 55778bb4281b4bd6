"""Tier events pushed by LMCache (its MP coordinator's ``POST /events``) or by our tier adapter.

Push API: ``POST /events`` on the index, body JSON (``Content-Type: application/json``) or msgpack
(``application/msgpack``), the shape LMCache 0.5.6's ``HttpCacheEventSink`` already sends
(``lmcache.v1.mp_coordinator.api.CacheEventBatch``), so an LMCache MP server started with
``--coordinator-url http://127.0.0.1:<index port> --coordinator-event-reporting`` reports to us
unchanged. Our MP L2 adapter (``adapter_params.index_url``, see
``kvshrink.storage_backends.tier_reporter``) sends the same shape on a stream of its own, with
``tier: "l2"``, ``backend: "kvshrink"`` and ``medium`` always set: where each chunk lives in our
store, updated on every store, demotion, promotion and drop::

    {"batches": [{
        "instance_id": "lmcache-a",   # emitter id: a registered instance id or one of its aliases
        "incarnation": 1712345678,    # restart counter; a higher one drops what lower ones reported
        "seq": 1,                     # per (instance_id, incarnation), from 1, +1 per batch
        "event_type": "store",        # store | delete | access | config (config is ignored)
        "tier": "l1",                 # l1 | l2
        "backend": "dram",            # l1: dram/devdax/gds...; l2: adapter type (fs, plugin, kvshrink...)
        "medium": null,               # kvshrink extension: gpu|dram|ssd|remote overrides the tier map
        "shared": false, "ts": 0.0,
        "entries": [{
            "key": {"chunk_hash_hex": "ab12…", "model_name": "m", "kv_rank": 0,
                    "object_group_id": 0, "cache_salt": ""},
            "size_bytes": 5898240,
            "token_ids": [...],       # store: the chunk's tokens (lmcache_chunk_size of them)
            "token_offset": 0         # store: position of the chunk's first token
        }]}]}

Answer: ``200 {"applied": n_batches, "entries": n, "dropped": {reason: n}}``; a body that does not
parse is ``400``, and nothing of it is applied. Unknown fields are ignored.

Resolving a chunk to our prefix hash (``hashing``): a key already known for that emitter is reused
(second tier, delete, access); a ``store`` at ``token_offset`` 0 is hashed from the root; a later
chunk is found through the position key that a ``/lookup`` of the same prompt recorded — the
router asks the index before the engine stores anything. Chunks that resolve neither way, salted
chunks (``cache_salt``) and partial chunks are counted and dropped. HTTP cannot replay: a sequence
gap empties that emitter's blocks (they come back with the next stores), a repeated ``seq`` is a
retry and is skipped. Lookups record position keys only once the first tier batch has arrived
(it costs ~10 % of a lookup), so start LMCache's event reporting before sending traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from kvshrink.errors import CorruptDataError
from kvshrink.index.block_index import TIER_INDEX
from kvshrink.index.hashing import chain_hashes, position_key, root_hash, token_bytes
from kvshrink.index.sequence import Verdict
from kvshrink.index.state import IndexState

SOURCE = "lmcache"
EVENT_TYPES = ("store", "delete", "access", "config")


class EncodedKey(msgspec.Struct):
    chunk_hash_hex: str
    model_name: str
    kv_rank: int = 0
    object_group_id: int = 0
    cache_salt: str = ""


class TierEntry(msgspec.Struct):
    key: EncodedKey
    size_bytes: int = 0
    token_ids: list[int] = []
    token_offset: int = -1


class TierBatch(msgspec.Struct):
    instance_id: str
    incarnation: int
    seq: int
    event_type: str
    tier: str
    backend: str = ""
    entries: list[TierEntry] = []
    shared: bool = False
    ts: float = 0.0
    capacity_bytes: int = 0
    capacity_revision: int = 0
    medium: str | None = None


class TierEventsRequest(msgspec.Struct):
    batches: list[TierBatch]


_json = msgspec.json.Decoder(TierEventsRequest)
_msgpack = msgspec.msgpack.Decoder(TierEventsRequest)


def decode_request(body: bytes, content_type: str | None) -> TierEventsRequest:
    """Parse a push body; any structural error rejects the whole body (nothing applied)."""
    decoder = _msgpack if content_type and "msgpack" in content_type else _json
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptDataError(f"tier events body: {exc}") from exc


@dataclass
class TierApplyResult:
    applied: int = 0
    entries: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str, n: int = 1) -> None:
        if n:
            self.dropped[reason] = self.dropped.get(reason, 0) + n


def apply_request(state: IndexState, request: TierEventsRequest) -> TierApplyResult:
    result = TierApplyResult()
    with state.lock:
        state.tier_events_seen = True
        for batch in request.batches:
            _apply_batch(state, batch, result)
        state.sync_eviction_metric()
    m = state.metrics
    for reason, n in result.dropped.items():
        m.drop(SOURCE, reason, n)
    return result


def _invalid(batch: TierBatch) -> str | None:
    """What is wrong with a batch whose stream (instance, incarnation, seq) is fine."""
    if batch.event_type not in EVENT_TYPES:
        return "unknown_event_type"
    if batch.tier not in ("l1", "l2"):
        return "unknown_tier"
    if batch.medium is not None and batch.medium not in TIER_INDEX:
        return "unknown_medium"
    return None


def _apply_batch(state: IndexState, batch: TierBatch, result: TierApplyResult) -> None:
    emitter = batch.instance_id
    if not emitter or batch.seq < 1 or batch.incarnation < 0:
        result.drop("bad_stream_identity", max(1, len(batch.entries)))
        return
    model = batch.entries[0].key.model_name if batch.entries else None
    inst = state.resolve_instance(emitter, model, SOURCE)
    if inst is None:
        result.drop("unknown_instance", max(1, len(batch.entries)))
        return
    name = f"lmcache/{emitter}"
    known_inc = state.tier_incarnations.get(emitter)
    if known_inc is not None and batch.incarnation < known_inc:
        result.drop("stale_incarnation", max(1, len(batch.entries)))
        return
    if known_inc is not None and batch.incarnation > known_inc:
        state.reset_feed(inst, name, "incarnation")
        state.tier_seq.forget((emitter, known_inc))
    state.tier_incarnations[emitter] = batch.incarnation
    stream = (emitter, batch.incarnation)
    verdict = state.tier_seq.observe(stream, batch.seq).verdict
    if verdict in (Verdict.DUPLICATE, Verdict.RESTART):  # HTTP retries resend numbers already applied
        result.drop("duplicate_batch", max(1, len(batch.entries)))
        return
    if verdict is Verdict.GAP:
        state.metrics.seq_gaps.labels(SOURCE, "resync").inc()
        state.reset_feed(inst, name, "sequence_gap")
    state.tier_seq.applied(stream, batch.seq)  # a bad batch still uses its number: no spurious gap
    problem = _invalid(batch)
    if problem:
        result.drop(problem, max(1, len(batch.entries)))
        return
    result.applied += 1
    state.metrics.events.labels(SOURCE, batch.event_type).inc()
    if batch.event_type == "config":
        return
    feed = state.feed(inst, name)
    if batch.event_type == "access":
        keys = [_engine_key(e) for e in batch.entries]
        state.metrics.block_ops.labels(SOURCE, "access").inc(state.index.touch(feed, keys))
        result.entries += len(keys)
        return
    tier_name = batch.medium or state.config.lmcache_tier(batch.tier, batch.backend)
    if tier_name is None:
        result.drop("unmapped_backend", len(batch.entries))
        return
    if batch.shared and batch.medium is None:
        tier_name = "remote"
    tier = TIER_INDEX[tier_name]
    if batch.event_type == "delete":
        removed, unknown = state.index.remove(feed, [_engine_key(e) for e in batch.entries], tier)
        state.metrics.block_ops.labels(SOURCE, "remove").inc(removed)
        result.drop("delete_unknown_key", unknown)
        result.entries += removed
        return
    keys, hashes = [], []
    for entry in batch.entries:
        block_hash, reason = _resolve(state, feed, entry)
        if block_hash is None:
            result.drop(reason)
            continue
        keys.append(_engine_key(entry))
        hashes.append(block_hash)
        state.note_block_size(entry.key.model_name, state.chunk_size)
    outcome = state.index.store(feed, keys, hashes, tier)
    result.drop("hash_conflict", outcome.conflicts)
    state.metrics.block_ops.labels(SOURCE, "store").inc(outcome.stored)
    result.entries += outcome.stored


def _engine_key(entry: TierEntry) -> tuple[str, int, int, str]:
    key = entry.key
    return (key.chunk_hash_hex, key.kv_rank, key.object_group_id, key.cache_salt)


def _resolve(state: IndexState, feed, entry: TierEntry) -> tuple[int | None, str]:
    known = state.index.block_hash_of(feed, _engine_key(entry))
    if known is not None:
        return known, ""
    if entry.key.cache_salt:
        return None, "cache_salt"
    if len(entry.token_ids) != state.chunk_size:
        return None, "no_tokens" if not entry.token_ids else "partial_chunk"
    if entry.token_offset < 0 or entry.token_offset % state.chunk_size:
        return None, "bad_token_offset"
    try:
        block = token_bytes(entry.token_ids)
    except CorruptDataError:
        return None, "bad_token_ids"
    root = root_hash(entry.key.model_name, state.chunk_size)
    if entry.token_offset == 0:
        return chain_hashes(block, state.chunk_size, root)[0], ""
    found = state.positions.get(position_key(block, entry.token_offset, root))
    return (found, "") if found is not None else (None, "unresolved_prefix")
