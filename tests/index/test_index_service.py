"""The running service: vLLM's real ZMQ publisher in, HTTP lookups out, gaps, restarts, bad input."""

from __future__ import annotations

import gc
import subprocess
import sys
import time

import httpx
import msgspec
import pytest
import zmq

from index_helpers import (MODEL, frames, make_config, vllm_cleared, vllm_payload, vllm_removed, vllm_stored,
                           wait_for)
from kvshrink.index.config import config_from_dict
from kvshrink.index.state import IndexState
from kvshrink.index.subscriber import KVEventSubscriber
from kvshrink.testing.launch import ManagedProcess, free_port

PROMPT = list(range(2000, 2000 + 96))


def _lookup(http, server, tokens=PROMPT, **extra):
    resp = http.post(f"{server.url}/lookup", json={"model": MODEL, "token_ids": tokens, **extra})
    assert resp.status_code == 200, resp.text
    return {i["instance_id"]: i for i in resp.json()["instances"]}


def _metric(server, name, **labels):
    return server.state.metrics.registry.get_sample_value(name, labels) or 0.0


def _publisher(server, instance, **kwargs):
    from vllm.distributed.kv_events import ZmqEventPublisher

    pub = ZmqEventPublisher(0, endpoint=server.subscriber.bound[0], topic=f"kv@{instance}@{MODEL}", **kwargs)
    return pub


def _publish(pub, events):
    from vllm.distributed.kv_events import KVEventBatch

    pub.publish(KVEventBatch(ts=time.time(), events=list(events)))


def _connected(server, pub, instance):
    """PUB/SUB joins late: publish empty batches until one arrives."""
    def probe():
        _publish(pub, [])
        time.sleep(0.05)
        return server.state.registry.get(instance) is not None
    wait_for(probe, what=f"{instance} connected")


def test_vllm_publisher_to_lookup_remove_clear_restart(start_index, http):
    server = start_index(make_config())
    a = _publisher(server, "a")
    b = _publisher(server, "b")
    try:
        _connected(server, a, "a")
        _connected(server, b, "b")
        _publish(a, [vllm_stored([11, 12, 13], PROMPT[:48], 16)])
        _publish(b, [vllm_stored([91], PROMPT[:16], 16)])
        wait_for(lambda: _lookup(http, server)["a"]["matched_tokens"] == 48, what="a's blocks")
        # the two publishers are separate sockets: b's batch may arrive after a's
        wait_for(lambda: _lookup(http, server)["b"]["matched_tokens"] == 16, what="b's blocks")
        ranked = _lookup(http, server)
        assert ranked["a"]["tiers"]["gpu"] == 48 and ranked["b"]["matched_tokens"] == 16
        assert list(ranked)[0] == "a"
        _publish(a, [vllm_removed([12])])
        wait_for(lambda: _lookup(http, server)["a"]["matched_tokens"] == 16, what="removal")
        _publish(a, [vllm_cleared()])
        wait_for(lambda: _lookup(http, server)["a"]["matched_tokens"] == 0, what="AllBlocksCleared")
        assert list(_lookup(http, server))[0] == "b"
        _publish(a, [vllm_stored([11, 12], PROMPT[:32], 16)])
        wait_for(lambda: _lookup(http, server)["a"]["matched_tokens"] == 32, what="re-store")
    finally:
        a.shutdown()
    # a restarted engine publishes from sequence 0 again: its old blocks must go
    a2 = _publisher(server, "a")
    try:
        def restarted():
            _publish(a2, [])
            time.sleep(0.05)
            return _metric(server, "kvshrink_index_sequence_gaps_total", source="vllm", action="restart") >= 1
        wait_for(restarted, what="restart detected")
        assert _lookup(http, server)["a"]["matched_tokens"] == 0
        assert _lookup(http, server)["b"]["matched_tokens"] == 16
    finally:
        a2.shutdown()
        b.shutdown()


def test_gap_is_repaired_from_vllm_replay_endpoint():
    """A real vLLM publisher buffers batches for replay; our subscriber fetches a gap from it."""
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    replay = f"tcp://127.0.0.1:{free_port()}"
    # its PUB goes nowhere (nothing listens): every batch is only in its replay buffer
    pub = ZmqEventPublisher(0, endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint=replay,
                            topic=f"kv@a@{MODEL}")
    state = IndexState(make_config(zmq=False, instances=[{"id": "a", "replay_endpoint": replay}]))
    sub = KVEventSubscriber(state, bind=[], replay_timeout_s=2.0)
    try:
        batches = [[vllm_stored([1], PROMPT[:16], 16)], [vllm_stored([2], PROMPT[16:32], 16, parent=1)],
                   [vllm_stored([3], PROMPT[32:48], 16, parent=2)], [vllm_removed([3])],
                   [vllm_stored([4], PROMPT[32:48], 16, parent=2)]]
        for events in batches:
            pub.publish(KVEventBatch(ts=time.time(), events=events))
        wait_for(lambda: len(pub._buffer) == len(batches), what="publisher buffered")
        sub.handle(frames("a", 0, vllm_payload(batches[0])))
        sub.handle(frames("a", 4, vllm_payload(batches[4])))  # 1..3 lost on the wire
        from kvshrink.index.scoring import lookup
        assert {s.instance_id: s.matched_tokens for s in lookup(state, MODEL, PROMPT).instances}["a"] == 48
        gaps = state.metrics.registry.get_sample_value("kvshrink_index_sequence_gaps_total",
                                                       {"source": "vllm", "action": "replayed"})
        assert gaps == 1
        sub.handle(frames("a", 2, vllm_payload(batches[2])))  # late duplicate of a replayed batch: ignored
        assert state.metrics.registry.get_sample_value("kvshrink_index_dropped_total",
                                                       {"source": "vllm", "reason": "duplicate_batch"}) == 1
    finally:
        pub.shutdown()
        sub._ctx.term()


def test_gap_without_replay_resyncs_that_instance_only():
    state = IndexState(make_config(zmq=False))
    sub = KVEventSubscriber(state, bind=[])
    from kvshrink.index.scoring import lookup
    sub.handle(frames("a", 0, vllm_payload([vllm_stored([1, 2], PROMPT[:32], 16)])))
    sub.handle(frames("b", 0, vllm_payload([vllm_stored([1, 2], PROMPT[:32], 16)])))
    sub.handle(frames("a", 7, vllm_payload([vllm_stored([5], PROMPT[:16], 16)])))  # seq 1..6 missing
    matched = {s.instance_id: s.matched_tokens for s in lookup(state, MODEL, PROMPT).instances}
    assert matched == {"a": 16, "b": 32}  # a: only what came after the gap; b untouched
    assert state.metrics.registry.get_sample_value("kvshrink_index_sequence_gaps_total",
                                                   {"source": "vllm", "action": "resync"}) == 1
    sub._ctx.term()


def test_garbage_on_the_wire_is_counted_and_survived(start_index, http):
    server = start_index(make_config())
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(server.subscriber.bound[0])
    try:
        good = vllm_payload([vllm_stored([1], PROMPT[:16], 16)])
        seq = 0

        def probe():
            nonlocal seq
            pub.send_multipart(frames("probe", seq, vllm_payload([])))
            seq += 1
            time.sleep(0.05)
            return server.state.registry.get("probe") is not None
        wait_for(probe, what="connected")
        pub.send_multipart([b"kv@x@" + MODEL.encode(), b"\x00" * 8, b"\xc1\xc1 not msgpack"])
        pub.send_multipart([b"kv@x@" + MODEL.encode(), b"\x00" * 8])  # two frames
        pub.send_multipart([b"kv@no-model-part", b"\x00" * 8, good])  # (other topics are filtered by ZMQ)
        pub.send_multipart([b"kv@x@" + MODEL.encode(), b"\x00" * 3, good])  # short sequence number
        pub.send_multipart(frames("x", 0, msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]])))
        pub.send_multipart(frames("y", 0, good))
        wait_for(lambda: _lookup(http, server).get("y", {}).get("matched_tokens") == 16, what="good message after bad")
        assert _metric(server, "kvshrink_index_dropped_total", source="vllm", reason="malformed_message") == 2
        assert _metric(server, "kvshrink_index_dropped_total", source="vllm", reason="bad_frames") == 2
        assert _metric(server, "kvshrink_index_dropped_total", source="vllm", reason="malformed_event") == 1
    finally:
        pub.close(linger=0)
        ctx.term()


def test_block_index_is_out_of_the_collectors_sight_while_serving(start_index):
    """Every collection of the index's generation would traverse every indexed block (~60 ms per
    million): the service freezes it at start-up and hands it back to the collector at shutdown."""
    server = start_index(make_config(zmq=False))
    entries = server.state.index._entries
    assert not any(obj is entries for obj in gc.get_objects())  # frozen: in no collected generation
    server.stop()
    assert any(obj is entries for obj in gc.get_objects())


def test_service_thread_cpu_is_measured_and_runs_on_uvloop_httptools(start_index, http):
    """Benchmarks divide the serving thread's CPU by their requests; without uvloop / httptools the
    service would fall back to a slower stack (and log it)."""
    from kvshrink.errors import KVShrinkError
    from kvshrink.index.server import IndexServer, missing_fast_http

    with pytest.raises(KVShrinkError, match="start"):
        IndexServer(make_config(zmq=False)).thread_cpu_s()
    server = start_index(make_config(zmq=False))
    before = server.thread_cpu_s()
    for _ in range(20):
        assert http.get(f"{server.url}/healthz").status_code == 200
    assert server.thread_cpu_s() > before
    assert missing_fast_http() == []


def test_token_bytes_json_and_msgpack_bodies(start_index, http):
    import base64
    import struct

    server = start_index(make_config(zmq=False))
    state = server.state
    with state.lock:
        from kvshrink.index.hashing import prefix_hashes
        hashes = prefix_hashes(PROMPT, MODEL, 16)
        state.index.store(state.feed(state.resolve_instance("a", MODEL, "t"), "t"), hashes, hashes, 0)
        state.note_block_size(MODEL, 16)
    packed = struct.pack(f"<{len(PROMPT)}I", *PROMPT)
    as_json = http.post(f"{server.url}/lookup", json={"model": MODEL, "token_bytes": base64.b64encode(packed).decode()})
    as_msgpack = http.post(f"{server.url}/lookup",
                           content=msgspec.msgpack.encode({"model": MODEL, "token_bytes": packed}),
                           headers={"content-type": "application/msgpack"})
    for resp in (as_json, as_msgpack):
        assert resp.status_code == 200, resp.text
        assert resp.json()["prompt_tokens"] == len(PROMPT) and resp.json()["instances"][0]["matched_tokens"] == 96
    bad = http.post(f"{server.url}/lookup", content=msgspec.msgpack.encode({"model": MODEL, "token_bytes": b"12345"}),
                    headers={"content-type": "application/msgpack"})
    assert bad.status_code == 400


def test_http_refusals_are_counted_and_change_nothing(start_index, http):
    server = start_index(make_config(max_request_tokens=100, max_body_bytes=4096))
    url = server.url
    cases = [
        (http.post(f"{url}/lookup", content=b"{not json"), 400),
        (http.post(f"{url}/lookup", json={"token_ids": [1, 2]}), 400),  # no model
        (http.post(f"{url}/lookup", json={"model": MODEL, "token_ids": [1], "prompt": "x"}), 400),
        (http.post(f"{url}/lookup", json={"model": MODEL, "token_ids": [-5]}), 400),
        (http.post(f"{url}/lookup", json={"model": MODEL, "token_ids": list(range(101))}), 413),
        (http.post(f"{url}/lookup", content=b"[" + b"1," * 3000 + b"1]"), 413),
        (http.post(f"{url}/lookup", json={"model": "no-such-model", "prompt": "hello"}), 422),
        (http.post(f"{url}/events", content=b"{}"), 400),
        (http.post(f"{url}/instances", json={"id": "a@b"}), 400),
        (http.post(f"{url}/instances/nobody/heartbeat", json={"load": 1}), 404),
    ]
    for resp, status in cases:
        assert resp.status_code == status, (resp.status_code, resp.text)
        assert "error" in resp.json()
    rejected = sum(s.value for m in server.state.metrics.registry.collect() if m.name == "kvshrink_index_http_rejected"
                   for s in m.samples if s.name.endswith("_total"))
    assert rejected == len(cases)
    assert server.state.snapshot()["instances"] == [] and server.state.snapshot()["blocks"] == 0
    assert http.get(f"{url}/healthz").json() == {"ok": True}


def test_bearer_token(start_index, http, monkeypatch):
    monkeypatch.setenv("KVS_TEST_TOKEN", "s3cret")
    server = start_index(make_config(auth_token_env="KVS_TEST_TOKEN"))
    body = {"model": MODEL, "token_ids": [1, 2, 3]}
    assert http.post(f"{server.url}/lookup", json=body).status_code == 401
    assert http.post(f"{server.url}/lookup", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = {"Authorization": "Bearer s3cret"}
    assert http.post(f"{server.url}/lookup", json=body, headers=ok).status_code == 200
    assert http.get(f"{server.url}/metrics").status_code == 401
    assert b"kvshrink_index_lookups_total 1.0" in http.get(f"{server.url}/metrics", headers=ok).content
    assert http.get(f"{server.url}/healthz").status_code == 200


def test_registration_heartbeat_loads_and_timeout(start_index, http):
    server = start_index(make_config(zmq=False, heartbeat_timeout_s=1.0))
    url = server.url
    for name in ("a", "b"):
        resp = http.post(f"{url}/instances", json={"id": name, "url": f"http://127.0.0.1:{9000 + ord(name)}",
                                                   "models": [MODEL]})
        assert resp.status_code == 200
    assert http.post(f"{url}/instances/a/heartbeat", json={"load": 7}).json()["load"] == 7.0
    ranked = _lookup(http, server, tokens=[1, 2, 3])
    assert ranked["a"]["load"] == 7.0 and list(ranked)[0] == "b"
    # loads passed by the router override, by URL too
    ranked = _lookup(http, server, tokens=[1, 2, 3], loads={"http://127.0.0.1:9098": 9.0, "a": 0.0})
    assert list(ranked)[0] == "a" and ranked["b"]["load"] == 9.0
    assert list(_lookup(http, server, tokens=[1], instances=["b"])) == ["b"]

    def heartbeat_a():
        http.post(f"{url}/instances/a/heartbeat", json={})
        time.sleep(0.2)
        return len(server.state.registry) == 1
    wait_for(heartbeat_a, timeout=10, what="silent instance b dropped")
    assert server.state.registry.get("a") is not None and server.state.registry.get("b") is None
    assert http.delete(f"{url}/instances/a").json() == {"removed": "a"}
    assert len(server.state.registry) == 0


def test_prompt_and_messages_are_tokenized_like_vllm(start_index, http):
    from transformers import AutoTokenizer

    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    ckpt = str(ensure_checkpoint())
    server = start_index(make_config(zmq=False, tokenizers={MODEL: ckpt}))
    tok = AutoTokenizer.from_pretrained(ckpt)
    text = "The capital of France is Paris. " * 20
    ids = tok.encode(text)
    state = server.state
    with state.lock:
        inst = state.resolve_instance("a", MODEL, "test")
        from kvshrink.index.hashing import prefix_hashes
        hashes = prefix_hashes(ids, MODEL, 16)
        state.index.store(state.feed(inst, "t"), hashes, hashes, 0)
        state.note_block_size(MODEL, 16)
    resp = http.post(f"{server.url}/lookup", json={"model": MODEL, "prompt": text}).json()
    assert resp["prompt_tokens"] == len(ids) and resp["instances"][0]["matched_tokens"] == len(ids) // 16 * 16
    messages = [{"role": "user", "content": text}]
    chat_ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    resp = http.post(f"{server.url}/lookup", json={"model": MODEL, "messages": messages}).json()
    assert resp["prompt_tokens"] == len(chat_ids)


def test_config_file_is_valid_and_errors_name_the_key(tmp_path):
    from pathlib import Path

    from kvshrink.errors import ConfigError
    from kvshrink.index.config import load_config

    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(repo / "configs" / "index.yaml")
    assert cfg.host == "127.0.0.1" and cfg.scoring.tier_weights["dram"] == 0.8
    for bad, key in [({"scoring": {"tier_weights": {"gpu": 2}}}, "scoring.tier_weights.gpu"),
                     ({"scoring": {"hit_lenght_weight": 1}}, "scoring.hit_lenght_weight"),
                     ({"prot": 1}, "prot"), ({"instances": [{"url": "x"}]}, "instances[0]"),
                     ({"lmcache_tiers": {"l2/s3": "tape"}}, "lmcache_tiers"), ({"max_blocks": 0}, "max_blocks")]:
        with pytest.raises(ConfigError) as err:
            config_from_dict(bad)
        assert err.value.key == key
    path = tmp_path / "bad.yaml"
    path.write_text("- not a mapping\n")
    with pytest.raises(ConfigError):
        load_config(path)


def test_index_cli_serves(tmp_path):
    """``kvshrink index serve`` starts from the YAML config and answers on its port."""
    cfg = tmp_path / "index.yaml"
    http_port, zmq_port = free_port(), free_port()
    cfg.write_text(f"port: {http_port}\nzmq: {{bind: ['tcp://127.0.0.1:{zmq_port}']}}\nscrape_interval_s: 0\n")
    proc = ManagedProcess([sys.executable, "-m", "kvshrink.cli", "index", "serve", "--config", str(cfg),
                           "--log-level", "warning"], log_path=tmp_path / "index.log")
    proc.start()
    try:
        proc.wait_until(lambda: _healthy(f"http://127.0.0.1:{http_port}/healthz"), 60, "healthy")
        out = subprocess.run([sys.executable, "-m", "kvshrink.cli", "index", "lookup", "--url",
                              f"http://127.0.0.1:{http_port}", "--model", "m", "--token-ids", "1,2,3"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and '"prompt_tokens": 3' in out.stdout
    finally:
        proc.stop()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False
