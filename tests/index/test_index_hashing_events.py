"""Prefix hashing (seed-independent) and decoding of both vLLM KV-event encodings."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import msgspec
import pytest
import xxhash

from index_helpers import (AllBlocksCleared, BlockRemoved, BlockStored, old_payload, vllm_cleared, vllm_payload,
                           vllm_removed, vllm_stored)
from kvshrink.errors import CorruptDataError
from kvshrink.index import events
from kvshrink.index.hashing import chain_hashes, prefix_hashes, root_hash, token_bytes

TOKENS = list(range(100, 164))


def test_prefix_hashes_chain_and_prefix_property():
    full = prefix_hashes(TOKENS, "m", 16)
    assert len(full) == 4 and len(set(full)) == 4
    assert prefix_hashes(TOKENS[:40], "m", 16) == full[:2]  # partial last block is not hashed
    changed = TOKENS.copy()
    changed[20] += 1
    other = prefix_hashes(changed, "m", 16)
    assert other[0] == full[0] and other[1:] != full[1:]  # a change propagates to every later block
    assert prefix_hashes(TOKENS, "other-model", 16) != full
    assert prefix_hashes(TOKENS, "m", 32)[0] not in full
    # chaining from a parent equals hashing the whole prefix
    data = token_bytes(TOKENS)
    assert chain_hashes(data[32 * 4:], 16, full[1]) == full[2:]


def _documented_chain(tokens: list[int], block_size: int, parent: int) -> list[int]:
    """The hash as ``hashing``'s docstring defines it, one Python int at a time."""
    mask, k = (1 << 64) - 1, 0x9E3779B97F4A7C15
    seed = xxhash.xxh3_64_intdigest(b"kvshrink-index/2\0multipliers")
    multipliers = [xxhash.xxh3_64_intdigest(i.to_bytes(4, "little"), seed) | 1 for i in range(block_size)]

    def fmix64(h: int) -> int:
        h ^= h >> 33
        h = h * 0xFF51AFD7ED558CCD & mask
        h ^= h >> 33
        h = h * 0xC4CEB9FE1A85EC53 & mask
        return h ^ h >> 33

    out, h = [], parent
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start:start + block_size]
        h = (h * k + fmix64(sum((t + 1) * m for t, m in zip(block, multipliers)) & mask)) & mask
        out.append(h)
    return out


@pytest.mark.parametrize("block_size", [1, 16, 128, 256])
def test_vectorized_chain_equals_the_documented_definition(block_size):
    rnd = random.Random(block_size)
    tokens = [rnd.randrange(2**32) for _ in range(70 * block_size)] + [0, 2**32 - 1] * block_size  # extremes too
    root = root_hash("m", block_size)
    assert root == xxhash.xxh3_64_intdigest(b"kvshrink-index/2\0m\0" + str(block_size).encode())
    for n in (len(tokens), 63 * block_size, 64 * block_size, block_size - 1):  # both products, partial, none
        assert chain_hashes(token_bytes(tokens[:n]), block_size, root) == _documented_chain(tokens[:n], block_size, root)
    full = chain_hashes(token_bytes(tokens), block_size, root)
    middle = len(full) // 2
    assert chain_hashes(token_bytes(tokens[middle * block_size:]), block_size, full[middle - 1]) == full[middle:]


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["x"]])
def test_bad_token_ids_are_corrupt_data(bad):
    with pytest.raises(CorruptDataError):
        token_bytes(bad)


def test_hashes_do_not_depend_on_pythonhashseed():
    code = ("from kvshrink.index.hashing import prefix_hashes; "
            "print(prefix_hashes(list(range(100, 164)), 'm', 16), hash('m'))")
    outputs = []
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                             capture_output=True, text=True, check=True).stdout.split("] ")
        outputs.append(out)
    assert outputs[0][0] == outputs[1][0] == str(prefix_hashes(TOKENS, "m", 16))[:-1]
    assert outputs[0][1] != outputs[1][1]  # while Python's own hash did change with the seed
    assert root_hash("m", 16) == root_hash("m", 16)


def test_decode_installed_vllm_encoding():
    payload = vllm_payload([vllm_stored([7, 8], TOKENS[:32], 16), vllm_removed([7]), vllm_cleared()], dp_rank=2)
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and isinstance(raw[1][0], dict) and raw[1][0]["type"] == "BlockStored"
    batch = events.decode_batch(payload)
    stored, removed, cleared = batch.events
    assert isinstance(stored, events.BlockStored) and stored.block_hashes == [7, 8]
    assert stored.token_ids == TOKENS[:32] and stored.block_size == 16 and stored.medium == "GPU"
    assert isinstance(removed, events.BlockRemoved) and removed.block_hashes == [7]
    assert isinstance(cleared, events.AllBlocksCleared)
    assert batch.data_parallel_rank == 2 and not batch.dropped


def test_decode_older_tagged_array_encoding():
    payload = old_payload([BlockStored([7, 8], None, TOKENS[:32], 16, None, "GPU"),
                           BlockRemoved([8], "GPU"), AllBlocksCleared()])
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0][0] == "BlockStored"  # really the tagged-array form
    batch = events.decode_batch(payload)
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert batch.events[0].token_ids == TOKENS[:32] and batch.events[1].block_hashes == [8]


def test_decode_map_envelope_bytes_hashes_and_unknown_fields():
    payload = msgspec.msgpack.encode({"ts": 1.0, "data_parallel_rank": 0, "events": [
        {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None, "token_ids": TOKENS[:16],
         "block_size": 16, "medium": "CPU", "some_future_field": [1, 2]},
        {"type": "SomethingNew", "x": 1}]})
    batch = events.decode_batch(payload)
    assert batch.events[0].block_hashes == [b"\x01" * 32] and batch.events[0].medium == "CPU"
    assert batch.dropped == ["unknown_event_type"]


@pytest.mark.parametrize("payload", [b"\xc1garbage", msgspec.msgpack.encode(42), msgspec.msgpack.encode([1.0]),
                                     msgspec.msgpack.encode({"ts": 1.0}), msgspec.msgpack.encode([1.0, "x"]),
                                     msgspec.msgpack.encode(["now", []])])
def test_malformed_envelopes_raise(payload):
    with pytest.raises(CorruptDataError):
        events.decode_batch(payload)


def test_malformed_events_are_dropped_not_fatal():
    payload = msgspec.msgpack.encode([1.0, [
        ["BlockStored", [1], None],  # too few fields
        {"type": "BlockStored", "block_hashes": "nope", "parent_block_hash": None, "token_ids": [], "block_size": 16},
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1], "block_size": 0},
        {"no_type": True}, 17,
        {"type": "BlockRemoved", "block_hashes": [3]}]])
    batch = events.decode_batch(payload)
    assert len(batch.dropped) == 5 and all(d.startswith("malformed_event") for d in batch.dropped)
    assert len(batch.events) == 1 and batch.events[0].block_hashes == [3]


def test_topic_parsing():
    assert events.parse_topic(b"kv@node-a@Qwen/Qwen3-8B") == ("node-a", "Qwen/Qwen3-8B")
    assert events.parse_topic(b"kv@a@m@with@ats") == ("a", "m@with@ats")
    for bad in (b"kv-events", b"kv@@m", b"xx@a@m", b"kv@a", b"\xff\xfe"):
        with pytest.raises(CorruptDataError):
            events.parse_topic(bad)
