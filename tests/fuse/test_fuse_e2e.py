"""KV Fuse end to end: real ``lmcache server`` + our L2 adapter + the KV Fuse server module (fusion on)
+ vLLM CPU through its OpenAI API, streaming, SmolLM2 bf16.

One story on one stack (a cold prefill costs ~30 s here, so every request counts):

a. ``A B Q`` with the fused salt: nothing to reuse, a cold prefill; its 4 chunks join the index.
b. ``B A Q`` with the fused salt: all 4 of its chunks are non-prefix copies of (a)'s: the module
   reads them, re-rotates, recomputes 15 %, writes 4 fused chunks, and LMCache's lookup reports a
   1024-token prefix hit; the answer streams.
c. ``B A Q`` again: an ordinary hit of the fused chunks (the module does nothing).
d. ``B A Q`` with another salt ``X`` (fusion not asked for): stock — no fused chunk, no hit, a
   full prefill; its answer is the reference the fused answer is reported against (information
   only: answer agreement at 15 % is known to be poor). Its chunks join tenant ``X``'s index.
e. Fallback: one of (d)'s chunks is deleted from L1 and our store (evicted); ``A B Q`` asking for
   fusion in tenant ``X`` finds 3 reusable chunks and one gone, so nothing is fused and the
   request is an ordinary prefill — its answer equals (a)'s, the stock answer of that prompt.

Documents are chunk-aligned (512 and 256 tokens: document-aligned padding), so every chunk of a
document is reusable; unaligned edges would be recomputed gaps.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

CHUNK = 256
MAX_TOKENS = 8
QUESTION = "\n\nQuestion: Which Python statement do the documents above describe first?\nAnswer:"


def stream(base_url: str, model: str, prompt: list[int], salt: str | None) -> dict[str, Any]:
    """POST /v1/completions, streaming, greedy; the text and the time to the first token."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                            "stream": True}
    if salt is not None:
        body["cache_salt"] = salt
    pieces, ttft, start = [], None, time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600.0) as response:
        assert response.status_code == 200, response.read().decode(errors="replace")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):]).get("choices", []):
                if choice.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    pieces.append(choice["text"])
    assert ttft is not None, "no token streamed"
    return {"text": "".join(pieces), "ttft_s": round(ttft, 3), "total_s": round(time.perf_counter() - start, 3)}


def documents(tokenizer: Any) -> dict[str, list[int]]:
    """Chunk-aligned documents of real text (the Python reference), each a different passage."""
    from kvshrink.testing.fixtures.real_kv import corpus_text

    text = corpus_text("prose")
    docs = {}
    for name, (offset, length) in {"A": (0, 512), "B": (9000, 512)}.items():
        ids = tokenizer("Document: " + text[offset:offset + 6 * length], add_special_tokens=False).input_ids
        docs[name] = ids[:length]
        assert len(docs[name]) == length
    return docs


def fuse_status(cache: Any) -> dict[str, Any]:
    return cache.status()["kvshrink_fuse"]


def delete_chunk(cache: Any, model: str, prompt: list[int], index: int, salt: str) -> dict[str, Any]:
    """Evict chunk ``index`` of ``prompt`` (under ``salt``) from LMCache's L1 and our store."""
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    chunk_hash = TokenHasher(CHUNK, "blake3").compute_chunk_hashes(prompt)[index]
    rank = ObjectKey.ComputeKVRank(world_size=1, global_rank=0, local_world_size=1, local_rank=0)
    key = {"chunk_hash_hex": chunk_hash.hex(), "model_name": model, "kv_rank": rank, "object_group_id": 0,
           "cache_salt": salt}
    response = httpx.request("DELETE", f"{cache.http_url}/cache/objects", timeout=30.0,
                             json={"keys": [key], "tier": "all", "force": True})
    assert response.status_code == 200, response.text
    return response.json()


def test_kv_fuse_serves_reordered_documents_through_vllm(tmp_path: Path, checkpoint: Path, tokenizer: Any,
                                                         record_property: Any) -> None:
    import torch

    from kvshrink.fuse.keys import FuseSettings, fused_salt
    from kvshrink.plugins.vllm.cpu_kv_layout import attention_isa
    from kvshrink.testing.launch import LMCacheServer, VLLMServer
    from kvshrink.testing.mp_observe import (cache_counters, connector_config_with_heartbeat, wait_for_engine,
                                            wait_for_store)

    began = time.monotonic()
    docs = documents(tokenizer)
    question = tokenizer(QUESTION, add_special_tokens=False).input_ids
    salt = fused_salt(FuseSettings(ratio=0.15, check_layer=1))
    shm = f"kvshrink-fuse-e2e-{uuid.uuid4().hex[:10]}"
    adapter = {"type": "plugin", "module_path": "kvshrink.storage_backends.mp_l2_adapter",
               "class_name": "KVShrinkL2Adapter",
               "adapter_params": {"store": {"tiers": [{"kind": "dram", "capacity": "512MiB", "shm_name": shm}]}}}
    module = {"module_path": "kvshrink.storage_backends.kv_fuse.server_module",
              "config": {"enabled": True, "model_path": str(checkpoint), "ratio": 0.15, "check_layer": 1}}
    cache = LMCacheServer(l1_size_gb=0.5, l2_adapters=[adapter], log_path=tmp_path / "lmcache.log",
                          extra_args=["--server-module", json.dumps(module)], env={"LMCACHE_LOG_LEVEL": "INFO"})
    vllm = None
    report: dict[str, Any] = {}
    try:
        cache.start(timeout=300.0)
        assert fuse_status(cache)["fusions"] == 0
        vllm = VLLMServer(checkpoint, kv_transfer_config=connector_config_with_heartbeat(cache),
                          log_path=tmp_path / "vllm.log")
        vllm.start(timeout=900.0)  # minutes on a loaded 2-core machine
        wait_for_engine(cache.http_url)
        url, model = f"http://127.0.0.1:{vllm.port}", vllm.served_model_name
        ab, ba = docs["A"] + docs["B"] + question, docs["B"] + docs["A"] + question

        def request(name: str, prompt: list[int], request_salt: str | None) -> tuple[dict, dict, float]:
            before, counters = fuse_status(cache), cache_counters(cache.http_url)
            out = stream(url, model, prompt, request_salt)
            time.sleep(1.0)  # let the store of this request's chunks land before the next lookup
            after = fuse_status(cache)
            hit = (cache_counters(cache.http_url) - counters).hit_tokens
            delta = {k: after[k] - before[k] for k in after if isinstance(after[k], int) and k in before}
            report[name] = {**out, "hit_tokens": hit, "fuse": {k: v for k, v in delta.items() if v}}
            return out, delta, hit

        # a. the first RAG prompt: nothing to reuse, a cold prefill, its chunks indexed
        first, delta, hit = request("a_AB_fused_salt", ab, salt)
        assert delta["fused_salt_lookups"] == 1 and delta["no_match"] == 1 and delta["fusions"] == 0
        assert delta["indexed_chunks_added"] == 4 and hit == 0

        # b. the documents reordered: every chunk reused at another offset, fused, served as a prefix hit
        fused, delta, hit = request("b_BA_fused", ba, salt)
        assert delta["fallback_layout"] == 0 and delta["fusions"] == 1, report
        isa = attention_isa(torch.bfloat16, 128, 64)  # what vLLM's attention picks on this CPU
        assert [v.rsplit("-bs", 1)[0] for v in fuse_status(cache)["layouts"].values()] == [f"vllm-cpu-{isa}"], report
        assert delta["reused_chunks"] == 4 and delta["fused_chunks_written"] == 4, report
        assert hit == 4 * CHUNK, report
        report["last_fusion"] = fuse_status(cache)["last_fusion"]

        # c. the fused prompt again: an ordinary hit of the fused chunks
        again, delta, hit = request("c_BA_fused_again", ba, salt)
        assert delta["already_fused"] == 1 and delta["fusions"] == 0 and hit == 4 * CHUNK
        assert again["text"] == fused["text"]

        # d. fusion not asked for (another salt): stock, a full prefill, no fused chunk
        full, delta, hit = request("d_BA_stock", ba, "tenant-x")
        assert delta.get("fused_salt_lookups", 0) == 0 and delta.get("fused_chunks_written", 0) == 0
        assert hit == 0
        report["answers"] = {"fused": fused["text"], "full_prefill": full["text"],
                             "agree": fused["text"] == full["text"]}

        # e. fallback: a reusable chunk evicted -> nothing fused, an ordinary prefill, the stock answer
        wait_for_store(cache.http_url, "dram", 12)  # (a) 4 + (b) 4 + (d) 4: (d)'s chunks are in our store too
        report["deleted"] = delete_chunk(cache, model, ba, 2, "tenant-x")
        fell_back, delta, hit = request("e_AB_one_source_evicted", ab, fused_salt(FuseSettings(), "tenant-x"))
        assert delta["fallback_missing"] == 1 and delta.get("fused_chunks_written", 0) == 0, report
        assert hit == 0
        assert fell_back["text"] == first["text"], report
    finally:
        report["seconds"] = round(time.monotonic() - began, 1)
        try:
            report["fuse_status"] = fuse_status(cache)
        except Exception as exc:  # noqa: BLE001 - the report only; the server may be down
            report["fuse_status"] = repr(exc)
        record_property("kv_fuse_e2e", json.dumps(report))
        print("KV Fuse e2e:", json.dumps(report, indent=1))
        for server in (vllm, cache):
            if server is not None:
                server.stop()
        from kvshrink.store.dram import SHM_DIR

        (SHM_DIR / shm).unlink(missing_ok=True)
