"""End to end, MP mode: real vLLM CPU + real ``lmcache server`` with our L2 adapter + SmolLM2 bf16.

One story, in order (the tests share one cache directory and one vLLM where the story allows):

a. a ~2K-token prompt twice: the second is served from LMCache (LMCache's lookup counters say so);
   after LMCache's L1 is cleared the third is served by our adapter (L2 hit, DRAM-tier load); the
   greedy tokens equal plain vLLM's every time;
b. vLLM restarted alone: hits; the cache server restarted with its DRAM arena gone: hits from the
   SSD tier (our store counters say so);
c. truncated chunk files and garbage in the SSD directory: nothing damaged is served, the request
   is recomputed (token for token like plain vLLM when no chunk is servable), vLLM and the cache
   server keep serving, the repaired cache serves the next request whole; one torn chunk behaves
   exactly like that chunk being absent (same prefix served, same output).
"""

from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path

import pytest
from l2_harness import SHM_DIR, greedy, plugin_json

from kvshrink.testing.mp_observe import (RESTART_GAP_S, adapter_status, cache_counters,
                                        connector_config_with_heartbeat, wait_for_engine, wait_for_store)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

CHUNKS = 2200 // 256  # 8 whole chunks = 2048 tokens; LMCache keeps whole chunks only
CACHED_TOKENS = CHUNKS * 256


class Stack:
    """One cache server (restartable on the same port and SSD directory) and one vLLM."""

    def __init__(self, workdir: Path, model: Path) -> None:
        self.workdir, self.model = workdir, model
        self.ssd = workdir / "ssd"
        self.shm = f"kvshrink-e2e-{uuid.uuid4().hex[:10]}"
        self.port: int | None = None
        self.cache = None
        self.vllm = None
        self.generation = 0

    def adapter_spec(self) -> dict:
        return plugin_json({"store": {"tiers": [
            {"kind": "dram", "capacity": "256MiB", "shm_name": self.shm},
            {"kind": "ssd", "path": str(self.ssd), "capacity": "2GiB", "write_back": True}]}})

    def start_cache(self) -> None:
        from kvshrink.testing.launch import LMCacheServer

        self.generation += 1
        self.cache = LMCacheServer(port=self.port, l1_size_gb=0.5, l2_adapters=[self.adapter_spec()],
                                   log_path=self.workdir / f"lmcache-{self.generation}.log",
                                   env={"LMCACHE_LOG_LEVEL": "INFO"})  # _retrieved_tokens reads its INFO lines
        self.port = self.cache.port
        self.cache.start()

    def stop_cache(self, drop_dram: bool) -> None:
        self.cache.stop()
        if drop_dram:
            (SHM_DIR / self.shm).unlink(missing_ok=True)
        time.sleep(RESTART_GAP_S)  # vLLM must notice the outage to register with the next server

    def start_vllm(self) -> None:
        from kvshrink.testing.launch import VLLMServer

        self.generation += 1
        self.vllm = VLLMServer(self.model, kv_transfer_config=connector_config_with_heartbeat(self.cache),
                               log_path=self.workdir / f"vllm-{self.generation}.log")
        self.vllm.start()

    def close(self) -> None:
        for server in (self.vllm, self.cache):
            if server is not None:
                server.stop()
        (SHM_DIR / self.shm).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model, plain_tokens):
    stack = Stack(tmp_path_factory.mktemp("mp-e2e"), model)
    try:
        stack.start_cache()
        stack.start_vllm()
        yield stack
    finally:
        stack.close()


def test_a_second_request_is_served_from_lmcache_and_matches_plain_vllm(stack, prompt, plain_tokens):
    before = cache_counters(stack.cache.http_url)
    assert greedy(stack.vllm, prompt) == plain_tokens  # cold: computed, then stored
    cold = cache_counters(stack.cache.http_url) - before
    assert cold.hit_tokens == 0
    tiers = wait_for_store(stack.cache.http_url, "ssd", CHUNKS)  # our adapter stored and wrote back
    assert tiers["dram"]["puts"] == CHUNKS

    before = cache_counters(stack.cache.http_url)
    assert greedy(stack.vllm, prompt) == plain_tokens
    warm = cache_counters(stack.cache.http_url) - before
    assert warm.hit_tokens == CACHED_TOKENS

    # LMCache's own L1 emptied: the next hit must come from our adapter
    import httpx

    httpx.post(f"{stack.cache.http_url}/cache/clear", json={"tier": "l1"}, timeout=30).raise_for_status()
    before = cache_counters(stack.cache.http_url)
    assert greedy(stack.vllm, prompt) == plain_tokens
    from_l2 = cache_counters(stack.cache.http_url) - before
    assert from_l2.l2_hit_tokens == CACHED_TOKENS and from_l2.l2_loads >= 1
    assert adapter_status(stack.cache.http_url)["store"]["tiers"]["dram"]["hits"] == CHUNKS


def test_b_restarted_vllm_hits_the_running_cache_server(stack, prompt, plain_tokens):
    stack.vllm.stop()
    stack.start_vllm()
    before = cache_counters(stack.cache.http_url)
    assert greedy(stack.vllm, prompt) == plain_tokens
    assert (cache_counters(stack.cache.http_url) - before).hit_tokens == CACHED_TOKENS


def test_b_restarted_cache_server_hits_from_the_ssd_tier(stack, prompt, plain_tokens):
    stack.stop_cache(drop_dram=True)  # lose LMCache's L1 and our DRAM tier: only the SSD is left
    stack.start_cache()
    wait_for_engine(stack.cache.http_url)  # the running vLLM re-registers by itself
    assert greedy(stack.vllm, prompt) == plain_tokens
    counters = cache_counters(stack.cache.http_url)
    assert counters.l2_hit_tokens == CACHED_TOKENS
    tiers = adapter_status(stack.cache.http_url)["store"]["tiers"]
    assert tiers["ssd"]["hits"] == CHUNKS and tiers["dram"]["hits"] == 0


def _retrieved_tokens(server) -> list[int]:
    """LMCache's own account of each retrieval into vLLM, from the cache server's log."""
    return [int(n) for n in re.findall(r"Retrieved (\d+) tokens in", server.log_path.read_text(errors="replace"))]


def _restart_over_damaged_ssd(stack, damage) -> list[Path]:
    stack.stop_cache(drop_dram=True)
    files = sorted((stack.ssd / "chunks").glob("*/*.kvc"))  # chunk files live in two-hex-digit folders
    assert len(files) == CHUNKS
    damage(files)
    (stack.ssd / "chunks" / "garbage.kvc").write_bytes(os.urandom(4096))
    (stack.ssd / "chunks" / files[0].parent.name / "junk.tmp").write_bytes(b"\x00" * 100)
    stack.start_cache()
    wait_for_engine(stack.cache.http_url)
    return files


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a torn chunk file


def test_c_truncated_chunk_files_are_recomputed_exactly(stack, prompt, plain_tokens):
    _restart_over_damaged_ssd(stack, lambda files: [_truncate(f) for f in files])
    assert greedy(stack.vllm, prompt) == plain_tokens  # nothing servable: a full, exact recompute
    status = adapter_status(stack.cache.http_url)
    assert status["is_healthy"] and status["boundary_errors"] == {}
    assert status["store"]["tiers"]["ssd"]["quarantined"] >= 1
    assert _retrieved_tokens(stack.cache) == []
    # the recomputed chunks were stored again: the next request is served whole. (Wait on the DRAM
    # tier, empty since the restart: the SSD's count includes torn files until a read finds them.)
    wait_for_store(stack.cache.http_url, "dram", CHUNKS)
    assert greedy(stack.vllm, prompt) == plain_tokens
    assert _retrieved_tokens(stack.cache) == [CACHED_TOKENS]


def test_c_one_torn_chunk_is_served_like_a_missing_one(stack, prompt):
    """One torn chunk file must behave exactly like that chunk being absent: the same clean prefix
    served, the same output. (A partial hit is not compared with plain vLLM: on vLLM CPU, bf16, a
    clean k-chunk prefix hit may change the greedy tail even with stock LMCache; measured here: a
    1280-token hit of this prompt changes the 7th output token.)"""
    import shutil

    stack.stop_cache(drop_dram=True)
    snapshot = stack.workdir / "ssd-snapshot"
    shutil.copytree(stack.ssd, snapshot)
    victim = sorted((stack.ssd / "chunks").glob("*/*.kvc"))[CHUNKS // 2]

    def run(damage) -> tuple[list[int], list[int], int]:
        shutil.rmtree(stack.ssd)
        shutil.copytree(snapshot, stack.ssd)
        damage(victim)
        stack.start_cache()
        wait_for_engine(stack.cache.http_url)
        output = greedy(stack.vllm, prompt)
        served = _retrieved_tokens(stack.cache)
        assert stack.vllm.running and stack.cache.running
        status = adapter_status(stack.cache.http_url)
        assert status["is_healthy"] and status["boundary_errors"] == {}
        stack.stop_cache(drop_dram=True)
        return output, served, status["store"]["tiers"]["ssd"]["quarantined"]

    missing_output, missing_served, _ = run(lambda path: path.unlink())
    torn_output, torn_served, quarantined = run(_truncate)
    assert torn_served == missing_served and all(n % 256 == 0 and n < CACHED_TOKENS for n in torn_served)
    assert torn_output == missing_output
    assert quarantined == 1
    stack.start_cache()  # leave a running server for whatever runs next
    wait_for_engine(stack.cache.http_url)
