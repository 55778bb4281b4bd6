"""LMCache keys as opaque store keys, and back.

The store takes ``bytes`` keys and never interprets them. Both LMCache runtimes have structured
keys; we encode them as short, versioned text so that ``list_l2_keys`` (and a human reading
``kvshrink`` stats) can turn a stored key back into the LMCache key.

* MP runtime, ``ObjectKey``:  ``o1@<model>@<kv_rank hex>@<group hex>@<chunk_hash hex>[@<salt>]``
* in-process runtime, ``CacheEngineKey``: ``e1@`` + ``CacheEngineKey.to_string()``

``@`` cannot occur inside a model name or cache salt (LMCache rejects it), so splitting on it is
unambiguous. The two prefixes keep the runtimes' keys apart when they share one store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvshrink.errors import CorruptDataError

if TYPE_CHECKING:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.distributed.api import ObjectKey

OBJECT_KEY_PREFIX = "o1"
ENGINE_KEY_PREFIX = "e1"
_SEP = "@"


def encode_object_key(key: "ObjectKey") -> bytes:
    """An MP ``ObjectKey`` as store key bytes."""
    parts = [OBJECT_KEY_PREFIX, key.model_name, f"{key.kv_rank:x}", f"{key.object_group_id:x}",
             key.chunk_hash.hex()]
    if key.cache_salt:
        parts.append(key.cache_salt)
    return _SEP.join(parts).encode()


def decode_object_key(data: bytes) -> "ObjectKey":
    """Inverse of :func:`encode_object_key`; :class:`CorruptDataError` for anything else."""
    from lmcache.v1.distributed.api import ObjectKey

    fields = wire_object_key(data)
    try:
        return ObjectKey(chunk_hash=bytes.fromhex(fields["chunk_hash_hex"]), model_name=fields["model_name"],
                         kv_rank=fields["kv_rank"], object_group_id=fields["object_group_id"],
                         cache_salt=fields["cache_salt"])
    except ValueError as exc:
        raise CorruptDataError(f"not an encoded ObjectKey: {data[:80]!r} ({exc})") from exc


def wire_object_key(data: bytes) -> dict[str, Any]:
    """The fields of LMCache's ``EncodedObjectKey`` (what its cache events carry) for a store key
    made by :func:`encode_object_key`, without importing LMCache; :class:`CorruptDataError` for
    anything else."""
    parts = _split(data, OBJECT_KEY_PREFIX)
    if len(parts) not in (4, 5):
        raise CorruptDataError(f"not an encoded ObjectKey: {data[:80]!r}")
    try:
        bytes.fromhex(parts[3])
        return {"chunk_hash_hex": parts[3], "model_name": parts[0], "kv_rank": int(parts[1], 16),
                "object_group_id": int(parts[2], 16), "cache_salt": parts[4] if len(parts) == 5 else ""}
    except ValueError as exc:
        raise CorruptDataError(f"not an encoded ObjectKey: {data[:80]!r} ({exc})") from exc


def encode_engine_key(key: "CacheEngineKey") -> bytes:
    """An in-process ``CacheEngineKey`` (or ``LayerCacheEngineKey``) as store key bytes."""
    return f"{ENGINE_KEY_PREFIX}{_SEP}{key.to_string()}".encode()


def decode_engine_key(data: bytes) -> "CacheEngineKey":
    """Inverse of :func:`encode_engine_key`; :class:`CorruptDataError` for anything else."""
    from lmcache.utils import parse_cache_key

    text = _SEP.join(_split(data, ENGINE_KEY_PREFIX))
    try:
        return parse_cache_key(text)
    except (ValueError, KeyError) as exc:
        raise CorruptDataError(f"not an encoded CacheEngineKey: {data[:80]!r} ({exc})") from exc


def is_object_key(data: bytes) -> bool:
    return data.startswith(f"{OBJECT_KEY_PREFIX}{_SEP}".encode())


def _split(data: bytes, prefix: str) -> list[str]:
    try:
        text = bytes(data).decode()
    except UnicodeDecodeError as exc:
        raise CorruptDataError(f"store key is not UTF-8: {bytes(data)[:80]!r}") from exc
    head, sep, rest = text.partition(_SEP)
    if head != prefix or not sep:
        raise CorruptDataError(f"store key {text[:80]!r} does not start with {prefix}{_SEP}")
    return rest.split(_SEP)
