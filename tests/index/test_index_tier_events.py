"""Tier events in LMCache's MP-coordinator shape, posted by LMCache's own ``HttpCacheEventSink``."""

from __future__ import annotations

import msgspec
import pytest

from index_helpers import MODEL, make_config

CHUNK = 256
PROMPT = list(range(5000, 5000 + 3 * CHUNK))


@pytest.fixture
def lm():
    """LMCache's real event classes and HTTP sink."""
    from lmcache.v1.distributed.api import EncodedObjectKey, Tier
    from lmcache.v1.mp_coordinator.api import CacheEventBatch, CacheEventEntry, CacheEventType
    from lmcache.v1.mp_coordinator.cache_events import HttpCacheEventSink

    class LM:
        def __init__(self):
            self.seq = 0
            self.sinks = []

        def sink(self, url):
            s = HttpCacheEventSink(url)
            self.sinks.append(s)
            return s

        def batch(self, event, chunks, tier="l1", backend="dram", instance="lm-a", incarnation=1, seq=None,
                  salt=""):
            if seq is None:
                self.seq += 1
                seq = self.seq
            entries = [CacheEventEntry(key=EncodedObjectKey(chunk_hash_hex=f"{c:032x}", model_name=MODEL, kv_rank=0,
                                                            cache_salt=salt),
                                       size_bytes=100 if event == "store" else 0,
                                       token_ids=PROMPT[c * CHUNK:(c + 1) * CHUNK] if event == "store" else [],
                                       token_offset=c * CHUNK if event == "store" else -1)
                       for c in chunks]
            return CacheEventBatch(instance_id=instance, incarnation=incarnation, seq=seq,
                                   event_type=CacheEventType(event), tier=Tier(tier), backend=backend, entries=entries)

    lm_obj = LM()
    yield lm_obj
    for s in lm_obj.sinks:
        s.close()


def _matched(http, server, tokens=PROMPT):
    resp = http.post(f"{server.url}/lookup", json={"model": MODEL, "token_ids": tokens}).json()
    return {i["instance_id"]: (i["matched_tokens"], i["tiers"]) for i in resp["instances"]}


def _dropped(server, reason):
    return server.state.metrics.registry.get_sample_value("kvshrink_index_dropped_total",
                                                          {"source": "lmcache", "reason": reason}) or 0


def test_lmcache_store_delete_and_tiers(start_index, http, lm):
    server = start_index(make_config(zmq=False, instances=[{"id": "a", "models": [MODEL], "aliases": ["lm-a"]}]))
    sink = lm.sink(server.url)
    sink.publish([lm.batch("store", [0])])  # chunk 0 resolves from the root
    sink.publish([lm.batch("store", [1, 2])])  # nobody asked for this prompt yet: no position key
    assert _matched(http, server)["a"] == (256, {"gpu": 0, "dram": 256, "ssd": 0, "remote": 0})
    assert _dropped(server, "unresolved_prefix") == 2
    # the router's lookup above recorded the prompt's position keys: now later chunks resolve
    sink.publish([lm.batch("store", [1, 2])])
    sink.publish([lm.batch("store", [0, 1, 2], tier="l2", backend="fs")])
    assert _matched(http, server)["a"] == (768, {"gpu": 0, "dram": 768, "ssd": 0, "remote": 0})
    sink.publish([lm.batch("delete", [1])])  # evicted from L1: still on SSD
    assert _matched(http, server)["a"] == (768, {"gpu": 0, "dram": 512, "ssd": 256, "remote": 0})
    sink.publish([lm.batch("delete", [1], tier="l2", backend="fs")])
    assert _matched(http, server)["a"][0] == 256
    sink.publish([lm.batch("access", [0]), lm.batch("store", [0], salt="tenant-1")])
    assert _dropped(server, "cache_salt") == 1
    assert server.state.metrics.registry.get_sample_value("kvshrink_index_events_total",
                                                          {"source": "lmcache", "kind": "access"}) == 1


def test_sequence_gaps_duplicates_and_incarnations(start_index, http, lm):
    server = start_index(make_config(zmq=False))
    url = f"{server.url}/events"
    sink = lm.sink(server.url)
    sink.publish([lm.batch("store", [0], instance="lm-b")])
    assert _matched(http, server)["lm-b"][0] == 256  # auto-registered under its LMCache id
    retry = lm.batch("store", [0], instance="lm-b", seq=1)
    assert http.post(url, json={"batches": [msgspec.to_builtins(retry)]}).json()["dropped"] == {"duplicate_batch": 1}
    lm.seq = 5  # batches 2..5 lost: that emitter's blocks are no longer trustworthy
    sink.publish([lm.batch("access", [0], instance="lm-b")])
    assert _matched(http, server)["lm-b"][0] == 0
    sink.publish([lm.batch("store", [0], instance="lm-b")])
    assert _matched(http, server)["lm-b"][0] == 256
    sink.publish([lm.batch("store", [1], instance="lm-b", incarnation=2, seq=1)])  # restarted server
    assert _matched(http, server)["lm-b"][0] == 0
    stale = lm.batch("store", [0], instance="lm-b", incarnation=1, seq=50)
    assert http.post(url, json={"batches": [msgspec.to_builtins(stale)]}).json()["dropped"] == {"stale_incarnation": 1}


def test_msgpack_body_kvshrink_medium_and_bad_batches(start_index, http):
    server = start_index(make_config(zmq=False))
    url = f"{server.url}/events"
    entry = {"key": {"chunk_hash_hex": "00", "model_name": MODEL}, "token_ids": PROMPT[:CHUNK], "token_offset": 0}
    body = {"batches": [
        {"instance_id": "x", "incarnation": 0, "seq": 1, "event_type": "store", "tier": "l2",
         "backend": "kvshrink_redis", "medium": "remote", "entries": [entry]},
        {"instance_id": "x", "incarnation": 0, "seq": 2, "event_type": "explode", "tier": "l2", "entries": [entry]},
        {"instance_id": "x", "incarnation": 0, "seq": 3, "event_type": "store", "tier": "l9", "entries": [entry]},
        {"instance_id": "x", "incarnation": 0, "seq": 4, "event_type": "store", "tier": "l1", "backend": "dram",
         "entries": [{**entry, "key": {"chunk_hash_hex": "01", "model_name": MODEL}, "token_ids": PROMPT[:100]},
                     {**entry, "key": {"chunk_hash_hex": "02", "model_name": MODEL}, "token_offset": 7}]}]}
    resp = http.post(url, content=msgspec.msgpack.encode(body), headers={"content-type": "application/msgpack"})
    assert resp.status_code == 200
    assert resp.json()["dropped"] == {"unknown_event_type": 1, "unknown_tier": 1, "partial_chunk": 1,
                                      "bad_token_offset": 1}
    assert _matched(http, server)["x"] == (256, {"gpu": 0, "dram": 0, "ssd": 0, "remote": 256})
    for bad in (b"[1, 2]", b'{"batches": [{"instance_id": 3}]}', b"\xff"):
        assert http.post(url, content=bad).status_code == 400
    assert server.state.snapshot()["blocks"] == 1  # nothing of a refused body was applied


def test_lmcache_registrar_and_events_land_on_the_aliased_instance(start_index, http, lm):
    """An ``lmcache server --coordinator-url <index>`` registers, heartbeats and reports events."""
    import asyncio

    import httpx

    from lmcache.v1.mp_coordinator.registrar import register

    server = start_index(make_config(zmq=False, instances=[{"id": "A", "url": "http://127.0.0.1:8000",
                                                            "models": [MODEL], "aliases": ["lm-a"]}]))

    async def lmcache_side():
        async with httpx.AsyncClient() as client:
            assigned = await register(client, server.url, http_port=8080, advertise_ip="127.0.0.1",
                                      instance_id="lm-a")
            beat = await client.put(f"{server.url}/instances/{assigned}/heartbeat")
            return assigned, beat.status_code
    assert asyncio.run(lmcache_side()) == ("lm-a", 200)
    assert [i["id"] for i in http.get(f"{server.url}/instances").json()] == ["A"]  # no duplicate instance
    lm.sink(server.url).publish([lm.batch("store", [0], instance="lm-a")])
    assert _matched(http, server)["A"] == (256, {"gpu": 0, "dram": 256, "ssd": 0, "remote": 0})


def test_a_plugin_adapter_counts_as_remote_until_our_adapter_reports_the_medium(start_index, http, lm):
    """LMCache cannot tell a plugin L2 adapter's medium; KVShrink's adapter reports it on a stream of
    its own (another emitter of the same instance), and a block counts on its fastest tier."""
    server = start_index(make_config(zmq=False, instances=[{"id": "a", "models": [MODEL], "aliases": ["lm-a"]}]))
    lm.sink(server.url).publish([lm.batch("store", [0], tier="l2", backend="plugin")])
    assert _matched(http, server)["a"] == (256, {"gpu": 0, "dram": 0, "ssd": 0, "remote": 256})
    key = {"chunk_hash_hex": f"{0:032x}", "model_name": MODEL}
    ours = {"instance_id": "a", "incarnation": 1, "seq": 1, "event_type": "store", "tier": "l2", "backend": "kvshrink",
            "medium": "dram", "entries": [{"key": key, "token_ids": PROMPT[:CHUNK], "token_offset": 0}]}
    assert http.post(f"{server.url}/events", json={"batches": [ours]}).json()["entries"] == 1
    assert _matched(http, server)["a"] == (256, {"gpu": 0, "dram": 256, "ssd": 0, "remote": 0})
