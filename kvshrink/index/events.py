"""Decode vLLM KV-cache event batches, whichever of vLLM's two encodings a publisher uses.

Wire format (``vllm/distributed/kv_events.py``): a ZMQ PUB message is ``(topic, seq: 8 bytes big
endian, payload)``, ``payload`` a msgpack ``KVEventBatch``. The batch envelope is an array
``[ts, events, data_parallel_rank?]`` (``array_like=True``, vLLM 0.32 here) or, in other versions,
a map ``{"ts", "events", "data_parallel_rank"}``. Each event is either a *tagged array* (older
vLLM: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
...]``) or a *map with a ``type`` key* (newer vLLM: ``{"type": "BlockStored", "block_hashes": ...}``).
Trailing defaulted fields are omitted in both (``omit_defaults``); unknown extra fields and event
types are ignored so that vLLM adding fields does not break ingestion. Block hashes are ``int``
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default) or ``bytes``; both are kept as opaque ids.

A malformed envelope raises :class:`CorruptDataError`; a malformed event inside a good envelope is
dropped and named in ``DecodedBatch.dropped`` so the caller can count it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

import msgspec

from kvshrink.errors import CorruptDataError

# Field order of the array encoding, as declared by vLLM's structs (oldest fields first).
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                 "locality", "ownership", "session_id")
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_STORED_REQUIRED = 4  # block_hashes, parent_block_hash, token_ids, block_size

BlockHash = Hashable  # int or bytes, opaque
_HASH_TYPES = {int, bytes}


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    lora_id: int | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class DecodedBatch:
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
    dropped: list[str] = field(default_factory=list)  # one reason per event that was not usable


_decoder = msgspec.msgpack.Decoder()


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one msgpack ``KVEventBatch`` payload (either encoding)."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise CorruptDataError(f"KV event payload is not msgpack: {exc}") from exc
    return normalize_batch(raw)


def normalize_batch(raw: Any) -> DecodedBatch:
    """Turn a decoded envelope (array or map) into a :class:`DecodedBatch`."""
    if isinstance(raw, (list, tuple)):
        if len(raw) < 2:
            raise CorruptDataError(f"KV event batch array has {len(raw)} fields, need ts and events")
        ts, events = raw[0], raw[1]
        dp_rank = raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        if "events" not in raw:
            raise CorruptDataError("KV event batch map has no 'events'")
        ts, events, dp_rank = raw.get("ts", 0.0), raw["events"], raw.get("data_parallel_rank")
    else:
        raise CorruptDataError(f"KV event batch is a {type(raw).__name__}, not an array or map")
    if not isinstance(events, (list, tuple)):
        raise CorruptDataError("KV event batch 'events' is not a list")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise CorruptDataError("KV event batch 'ts' is not a number")
    if dp_rank is not None and (not isinstance(dp_rank, int) or isinstance(dp_rank, bool) or dp_rank < 0):
        raise CorruptDataError("KV event batch 'data_parallel_rank' is not a non-negative integer")
    batch = DecodedBatch(ts=float(ts), events=[], data_parallel_rank=dp_rank)
    for raw_event in events:
        try:
            event = normalize_event(raw_event)
        except CorruptDataError as exc:
            batch.dropped.append(f"malformed_event: {exc}")
            continue
        if event is None:
            batch.dropped.append("unknown_event_type")
        else:
            batch.events.append(event)
    return batch


def normalize_event(raw: Any) -> KVEvent | None:
    """One event (tagged array or ``type`` map) → our dataclass; ``None`` for an unknown type."""
    if isinstance(raw, (list, tuple)):
        if not raw or not isinstance(raw[0], str):
            raise CorruptDataError("tagged-array event has no string tag")
        tag, values = raw[0], raw[1:]
        names = STORED_FIELDS if tag == "BlockStored" else REMOVED_FIELDS if tag == "BlockRemoved" else ()
        fields = dict(zip(names, values))
    elif isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise CorruptDataError("map event has no string 'type'")
        fields = raw
    else:
        raise CorruptDataError(f"event is a {type(raw).__name__}, not an array or map")
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        return BlockRemoved(block_hashes=_hashes(fields), medium=_opt_str(fields, "medium"),
                            group_idx=_opt_int(fields, "group_idx"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _stored(fields: dict[str, Any]) -> BlockStored:
    missing = [name for name in STORED_FIELDS[:_STORED_REQUIRED] if name not in fields]
    if missing:
        raise CorruptDataError(f"BlockStored lacks {', '.join(missing)}")
    hashes = _hashes(fields)
    parent = fields["parent_block_hash"]
    if parent is not None and not isinstance(parent, (int, bytes)):
        raise CorruptDataError("BlockStored parent_block_hash is neither int, bytes nor null")
    tokens = fields["token_ids"]
    if not isinstance(tokens, list):  # the values are checked when hashed (hashing.token_bytes)
        raise CorruptDataError("BlockStored token_ids is not a list")
    block_size = fields["block_size"]
    if type(block_size) is not int or block_size <= 0:
        raise CorruptDataError(f"BlockStored block_size {block_size!r} is not a positive integer")
    extra = fields.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise CorruptDataError("BlockStored extra_keys is not a list")
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=block_size,
                       medium=_opt_str(fields, "medium"), lora_name=_opt_str(fields, "lora_name"),
                       lora_id=_opt_int(fields, "lora_id"), extra_keys=extra,
                       group_idx=_opt_int(fields, "group_idx"),
                       kv_cache_spec_kind=_opt_str(fields, "kv_cache_spec_kind"))


def _hashes(fields: dict[str, Any]) -> list[BlockHash]:
    hashes = fields.get("block_hashes")
    if not isinstance(hashes, list) or not set(map(type, hashes)) <= _HASH_TYPES:
        raise CorruptDataError("block_hashes is not a list of int/bytes")
    return hashes


def _opt_str(fields: dict[str, Any], name: str) -> str | None:
    value = fields.get(name)
    if value is not None and not isinstance(value, str):
        raise CorruptDataError(f"{name} is not a string")
    return value


def _opt_int(fields: dict[str, Any], name: str) -> int | None:
    value = fields.get(name)
    if value is not None and type(value) is not int:
        raise CorruptDataError(f"{name} is not an integer")
    return value


def parse_topic(topic: bytes) -> tuple[str, str]:
    """``kv@<instance>@<model>`` → (instance, model); the model may itself contain ``@``."""
    try:
        text = topic.decode()
    except UnicodeDecodeError as exc:
        raise CorruptDataError("KV event topic is not UTF-8") from exc
    parts = text.split("@", 2)
    if len(parts) != 3 or parts[0] != "kv" or not parts[1] or not parts[2]:
        raise CorruptDataError(f"KV event topic {text!r} is not kv@<instance>@<model>")
    return parts[1], parts[2]
