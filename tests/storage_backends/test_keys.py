"""LMCache keys <-> store keys: reversible, distinct per runtime, hostile input rejected."""

from __future__ import annotations

import pytest
import torch
from lmcache.utils import CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.distributed.api import ObjectKey

from kvshrink.errors import CorruptDataError
from kvshrink.storage_backends.keys import (decode_engine_key, decode_object_key, encode_engine_key,
                                            encode_object_key, is_object_key)


@pytest.mark.parametrize("key", [
    ObjectKey(chunk_hash=bytes(range(32)), model_name="/root/models/smollm2", kv_rank=0x01000100),
    ObjectKey(chunk_hash=b"\x00\xff", model_name="org/Model-7B", kv_rank=3, object_group_id=2, cache_salt="user-1"),
])
def test_object_key_round_trip(key):
    data = encode_object_key(key)
    assert isinstance(data, bytes) and is_object_key(data)
    assert decode_object_key(data) == key


def test_distinct_object_keys_give_distinct_bytes():
    base = dict(chunk_hash=b"\x01" * 16, model_name="m", kv_rank=1)
    variants = [ObjectKey(**base), ObjectKey(**{**base, "kv_rank": 2}), ObjectKey(**base, object_group_id=1),
                ObjectKey(**base, cache_salt="s"), ObjectKey(**{**base, "chunk_hash": b"\x02" * 16})]
    assert len({encode_object_key(k) for k in variants}) == len(variants)


@pytest.mark.parametrize("key", [
    CacheEngineKey("smollm2", 1, 0, 0x1234abcd, torch.bfloat16),
    CacheEngineKey("org/m", 2, 1, 2**63 + 5, torch.float16, request_configs={"lmcache.tag.user": "alice"}),
    LayerCacheEngineKey("m", 1, 0, 77, torch.bfloat16, layer_id=5),
])
def test_engine_key_round_trip(key):
    data = encode_engine_key(key)
    assert not is_object_key(data)
    assert decode_engine_key(data) == key


@pytest.mark.parametrize("data", [b"", b"o1", b"o1@m@zz@0@00", b"x1@m@1@0@00", b"\xff\xfe", b"o1@m@1@0@00@a@b",
                                  b"o1@m@1@0@not-hex"])
def test_foreign_object_keys_are_rejected(data):
    with pytest.raises(CorruptDataError):
        decode_object_key(data)


@pytest.mark.parametrize("data", [b"", b"e1@m@1", b"o1@m@1@0@00", b"e1@m@1@0@zz@bfloat16", b"e1@m@1@0@ab@nodtype"])
def test_foreign_engine_keys_are_rejected(data):
    with pytest.raises(CorruptDataError):
        decode_engine_key(data)
