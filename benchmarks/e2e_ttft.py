"""End to end on vLLM CPU + SmolLM2: TTFT cold / warm-DRAM / warm-SSD, and a multi-turn agent replay.

Real processes: ``lmcache server`` (MP mode) with an L2 adapter — stock LMCache's ``fs`` adapter
or our ``KVShrinkL2Adapter`` over the shipped default store (``configs/store-default.yaml``, or
``--store-config``; moved and resized by :func:`kvshrink.configs.derive_store`, else unchanged) —
and one vLLM OpenAI server attached to it (``kvshrink.launch``); TTFT is the first streamed token
(``kvshrink.streaming_client``). Our side records the store file it used (path, sha256).

One vLLM serves both sides in turn: each side gets a fresh cache server on the same port (vLLM's
MP connector re-registers with it), so both sides meet the same warmed-up engine. vLLM's own
prefix cache is off, so every hit is LMCache's. After each cache-server start we wait until vLLM
has registered again (its heartbeat, every ``heartbeat_s``, notices the server went away and came
back; cache-server /status confirms it) and send one throwaway request before anything is timed.
Per context length (prompts are distinct slices of real text):

* cold: first request; then stores are allowed to settle (cache server status);
* warm DRAM: the same prompt again (LMCache L1), median of ``warm_repeats``;
* warm L2: L1 cleared (``POST /cache/clear``) before each request, so the chunks come from the L2
  adapter: our DRAM tier vs stock ``fs`` (page cache); median of ``warm_repeats``;
* warm SSD: after a cache-server restart (L1 empty; our shared-memory DRAM tier removed too, so
  our hits come from the SSD tier like stock's come from its ``fs`` directory).

Whether a warm request really hit is read from LMCache's own lookup counters (``/metrics``: hit
tokens in L1 and L2, via ``kvshrink.storage_backends.mp_observe``) and reported next to the times.
The agent replay runs a small agent trace (sequentially, in arrival order) on a fresh cache server
with a small L1, and reports total prefill time (sum of TTFT) and prompt tokens per second.
Absolute times are indicative only on a shared CPU machine.
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from kvshrink.benchmarks.comparison import (OURS, STOCK, SideRun, Workload, cache_server_policy, digest,
                                            model_fingerprint)
from kvshrink.errors import KVShrinkError
from kvshrink.polling import poll_until

ADAPTER_MODULE = "kvshrink.storage_backends.mp_l2_adapter"
ADAPTER_CLASS = "KVShrinkL2Adapter"
SERVED_NAME = "smollm2"
BYTES_PER_TOKEN = 2 * 30 * 192 * 2  # SmolLM2 KV, bf16
CHUNK_TOKENS = 256
SCENARIOS = ("cold", "warm_dram", "warm_l2", "warm_ssd")
SERVER_ENV = {"LMCACHE_LOG_LEVEL": "INFO"}  # full logs from the servers, whatever this process uses
_throwaways = itertools.count()


def throwaway_prompt() -> list[int]:
    """A fresh 300-token prompt (more than one chunk, never seen before): the first request to a
    (re)started cache server goes through its whole store path before anything is timed."""
    import numpy as np

    return np.random.default_rng(1_000_003 + next(_throwaways)).integers(1000, 40000, 300).tolist()


@dataclass(frozen=True)
class E2ESettings:
    lengths: tuple[int, ...] = (1024, 4096, 8000)
    warm_repeats: int = 2
    max_tokens: int = 8
    l1_size_gb: float = 1.0
    agent_l1_size_gb: float = 0.12  # below the agent trace's KV, so the replay also reads from L2
    agent_sessions: int = 3
    agent_turns: int = 3
    agent_system_tokens: int = 1500
    agent_tokens_per_turn: int = 500
    settle_timeout_s: float = 60.0
    request_timeout_s: float = 300.0
    heartbeat_s: float = 1.0  # vLLM's MP connector pings the cache server this often (LMCache default 10)
    seed: int = 0
    trace_file: str = ""  # a user's JSONL trace (benchmarks/user_trace.py) replayed instead of the agent trace


@dataclass
class Prompts:
    """Every prompt a side sends, in order; identical for both sides."""

    by_length: dict[int, list[int]]
    agent: list[Any] = field(default_factory=list)  # AgentRequest

    def fingerprint(self, settings: E2ESettings) -> str:
        parts = [self.by_length[n] for n in sorted(self.by_length)]
        parts += [list(map(int, r.token_ids)) for r in self.agent]
        return digest(*[digest(p) for p in parts], settings.max_tokens, settings.warm_repeats)


def build_prompts(checkpoint: Path, settings: E2ESettings) -> Prompts:
    """Distinct slices of real text per length (no shared prefixes), plus the agent trace."""
    from transformers import AutoTokenizer

    from kvshrink.benchmarks.agent_trace import TraceConfig, generate
    from kvshrink.fixtures.real_kv import corpus_text

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    code = tokenizer(corpus_text("code")).input_ids
    by_length, offset = {}, 0
    for n in settings.lengths:
        if offset + n > len(code):
            raise KVShrinkError(f"the code corpus has {len(code)} tokens, not enough for prompts of {settings.lengths}")
        by_length[n] = code[offset:offset + n]
        offset += n
    trace = TraceConfig(sessions=settings.agent_sessions, turns=settings.agent_turns,
                        concurrency=settings.agent_sessions, system_tokens=settings.agent_system_tokens,
                        tokens_per_turn=settings.agent_tokens_per_turn, output_tokens=settings.max_tokens,
                        first_user_tokens=200, agents=1, seed=settings.seed)
    if settings.trace_file:
        from kvshrink.benchmarks.user_trace import load_trace

        agent = load_trace(settings.trace_file, tokenizer=lambda text: tokenizer(text, add_special_tokens=False).input_ids)
    else:
        agent = [r for r in generate(trace)] if settings.agent_sessions else []
    return Prompts(by_length=by_length, agent=agent)


# -- the cache server of each side ----------------------------------------------------------------
def stock_adapter(workdir: Path) -> dict[str, Any]:
    return {"type": "fs", "base_path": str(workdir / "lmcache-fs")}


def ours_adapter(workdir: Path, template: Path | None, tag: str, capacity_bytes: int) -> tuple[dict[str, Any], str]:
    """Our adapter over the store config (default: the shipped default) with a private SSD
    directory and arena, the SSD sized for ``capacity_bytes`` and DRAM for at most that; returns
    (spec, shm name)."""
    from kvshrink.configs import derive_store, load_store_mapping
    from kvshrink.store.config import parse_store_config

    shipped = {t.name: t.capacity for t in parse_store_config(load_store_mapping(template)).tiers}
    shm = f"kvshrink-e2e-{tag}"
    store = derive_store(template, paths={"ssd": workdir / "kvshrink-ssd"}, shm_names={"dram": shm},
                         capacities={"dram": min(shipped.get("dram", capacity_bytes), capacity_bytes),
                                     "ssd": capacity_bytes})
    return ({"type": "plugin", "module_path": ADAPTER_MODULE, "class_name": ADAPTER_CLASS,
             "adapter_params": {"store": store}}, shm)


class HitMeter:
    """LMCache's own lookup counters (``/metrics``) around one request: hit tokens, L1 / L2 split."""

    def __init__(self, server: Any) -> None:
        self.url = server.http_url

    @contextlib.contextmanager
    def measure(self, into: dict[str, float]) -> Iterator[None]:
        from kvshrink.storage_backends.mp_observe import cache_counters

        before = cache_counters(self.url)
        yield
        delta = cache_counters(self.url) - before
        into.update(hit_tokens=delta.hit_tokens, l1_hit_tokens=delta.l1_hit_tokens,
                    l2_hit_tokens=delta.l2_hit_tokens)


def clear_l1(server: Any) -> None:
    """Empty LMCache's L1 so the next hit has to come from the L2 adapter."""
    import httpx

    httpx.post(f"{server.http_url}/cache/clear", json={"tier": "l1"}, timeout=30).raise_for_status()


def wait_settled(server: Any, timeout: float) -> None:
    """Until the cache server has no store in flight (twice in a row)."""
    quiet = 0

    def quiet_twice() -> bool:
        nonlocal quiet
        controller = server.status().get("storage_manager", {}).get("store_controller", {})
        busy = controller.get("pending_keys_count", 0) + controller.get("in_flight_task_count", 0)
        quiet = quiet + 1 if busy == 0 else 0
        return quiet >= 2

    poll_until(quiet_twice, timeout, what="the cache server's stores in flight to finish", error=KVShrinkError)


@dataclass
class Side:
    """One side's cache server configuration (the same L2 folders across its restarts)."""

    name: str
    adapter: dict[str, Any]
    shm_name: str | None
    workdir: Path

    def wait_persisted(self, server: Any, chunks: int, timeout: float) -> None:
        """Until the L2 side holds at least ``chunks`` chunks and is idle, twice in a row (stock:
        ``.data`` files of its fs adapter; ours: the store's local tiers and work queues; with the
        default exclusive tiers, our chunks reach the SSD when the server closes the store)."""
        deadline, steady, last = time.monotonic() + timeout, 0, None
        while time.monotonic() < deadline:
            state = self._disk_state(server)
            steady = steady + 1 if state[0] >= chunks and state[1] and state == last else 0
            if steady >= 2:
                return
            last = state
            time.sleep(0.25)
        raise KVShrinkError(f"{self.name}: L2 not settled with {chunks} chunks on disk after {timeout:.0f} s "
                            f"(last seen: {last})")

    def _disk_state(self, server: Any) -> tuple[int, bool]:
        """(chunks on disk, idle)."""
        if self.name == STOCK:
            return sum(1 for _ in Path(self.adapter["base_path"]).rglob("*.data")), True
        return store_state(server.http_url)

    def chunks_on_disk(self) -> int:
        """Chunk files in this side's L2 directory (read with the cache server stopped)."""
        if self.name == STOCK:
            return sum(1 for _ in Path(self.adapter["base_path"]).rglob("*.data"))
        return sum(1 for _ in (self.workdir / "kvshrink-ssd").rglob("*.kvc"))

    def drop_dram_tier(self) -> None:
        if self.shm_name:
            with contextlib.suppress(FileNotFoundError):
                (Path("/dev/shm") / self.shm_name).unlink()


def store_state(http_url: str) -> tuple[int, bool]:
    """(chunks in the local tiers of our adapter's store, whether adapter and store are idle)."""
    from kvshrink.storage_backends.mp_observe import adapter_status

    status = adapter_status(http_url)
    engine = status["store"]["engine"]
    idle = not status["in_flight_tasks"] and not engine["put_queue_depth"] and not engine["background_queue_depth"]
    local = [t for t in status["store"]["tiers"].values() if t["kind"] in ("dram", "ssd")]
    return sum(t["chunks"] for t in local), idle


@contextlib.contextmanager
def cache_server(side: Side, port: int, l1_size_gb: float, log_dir: Path, vllm_url: str | None = None,
                 settings: E2ESettings | None = None) -> Iterator[Any]:
    """A cache server for ``side``; with ``vllm_url``, ready only once vLLM has registered with it."""
    from kvshrink.launch import LMCacheServer
    from kvshrink.storage_backends.mp_observe import wait_for_engine

    log = log_dir / f"lmcache-{'stock' if side.name == STOCK else 'ours'}-{time.strftime('%H%M%S')}.log"
    server = LMCacheServer(port=port, l1_size_gb=l1_size_gb, l2_adapters=[side.adapter], log_path=log,
                           env=SERVER_ENV)
    try:
        server.start()
        if vllm_url is not None and settings is not None:
            # vLLM re-registers its KV caches when its heartbeat sees the server come back
            # (unhealthy -> healthy), and only then will lookups and stores work again
            # (a request sent before that fails its store and can stall vLLM's engine)
            wait_for_engine(server.http_url, settle_s=2.5 * settings.heartbeat_s)
            _request(vllm_url, throwaway_prompt(), settings)
        yield server
    finally:
        server.stop()
        if settings is not None:  # let vLLM's heartbeat see it gone, or it will not re-register
            time.sleep(3 * settings.heartbeat_s)


# -- measuring -------------------------------------------------------------------------------------
def _request(vllm_url: str, prompt: Sequence[int], settings: E2ESettings) -> Any:
    from kvshrink.streaming_client import stream_completion

    return stream_completion(vllm_url, SERVED_NAME, list(prompt), max_tokens=settings.max_tokens,
                             timeout=settings.request_timeout_s)


def measure_side(side: Side, vllm_url: str, port: int, prompts: Prompts, settings: E2ESettings, log_dir: Path,
                 progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Cold, warm-DRAM and warm-SSD TTFT per length, then the agent replay; raw records."""
    records: dict[str, Any] = {"lengths": {}, "outputs": {}}
    chunks = sum(n // CHUNK_TOKENS for n in prompts.by_length)
    with cache_server(side, port, settings.l1_size_gb, log_dir, vllm_url, settings) as server:
        meter = HitMeter(server)
        for n, prompt in prompts.by_length.items():
            progress(f"{n} cold")
            cold_hits: dict[str, float] = {}
            with meter.measure(cold_hits):
                cold = _request(vllm_url, prompt, settings)
            wait_settled(server, settings.settle_timeout_s)
            warm, warm_hits = [], {}
            for _ in range(settings.warm_repeats):
                progress(f"{n} warm DRAM")
                with meter.measure(warm_hits):
                    warm.append(_request(vllm_url, prompt, settings))
            l2, l2_hits = [], {}
            for _ in range(settings.warm_repeats):
                progress(f"{n} warm L2")
                clear_l1(server)
                with meter.measure(l2_hits):
                    l2.append(_request(vllm_url, prompt, settings))
            records["lengths"][n] = {"cold": cold.ttft_s, "cold_hits": cold_hits,
                                     "warm_dram": statistics.median(r.ttft_s for r in warm),
                                     "warm_dram_all": [r.ttft_s for r in warm], "warm_dram_hits": warm_hits,
                                     "warm_l2": statistics.median(r.ttft_s for r in l2),
                                     "warm_l2_all": [r.ttft_s for r in l2], "warm_l2_hits": l2_hits}
            records["outputs"][n] = {"cold": cold.text, "warm": [r.text for r in warm + l2]}
        wait_settled(server, settings.settle_timeout_s)
        side.wait_persisted(server, chunks, settings.settle_timeout_s)
    on_disk = side.chunks_on_disk()
    if on_disk < chunks:
        raise KVShrinkError(f"{side.name}: {on_disk} chunk files on disk after the cache server "
                            f"stopped, expected at least {chunks}; warm-SSD would measure a recompute")
    side.drop_dram_tier()  # warm-SSD: only what survived on disk
    with cache_server(side, port, settings.l1_size_gb, log_dir, vllm_url, settings) as server:
        meter = HitMeter(server)
        for n, prompt in prompts.by_length.items():
            progress(f"{n} warm SSD")
            hits: dict[str, float] = {}
            with meter.measure(hits):
                result = _request(vllm_url, prompt, settings)
            records["lengths"][n].update(warm_ssd=result.ttft_s, warm_ssd_hits=hits)
            records["outputs"][n]["warm_ssd"] = result.text
    if prompts.agent:
        records["agent"] = agent_replay(side, vllm_url, port, prompts.agent, settings, log_dir, progress)
    return records


def agent_replay(side: Side, vllm_url: str, port: int, requests: Sequence[Any], settings: E2ESettings,
                 log_dir: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    """The agent trace in arrival order, one request at a time, on a fresh server with a small L1."""
    ttfts, totals, tokens, hits = [], [], 0, {}
    with cache_server(side, port, settings.agent_l1_size_gb, log_dir, vllm_url, settings) as server:
        with HitMeter(server).measure(hits):
            for i, request in enumerate(requests):
                progress(f"agent {i + 1}/{len(requests)}")
                result = _request(vllm_url, list(map(int, request.token_ids)), settings)
                ttfts.append(result.ttft_s)
                totals.append(result.total_s)
                tokens += int(request.token_ids.size)
    return {"requests": len(requests), "prompt_tokens": tokens, "prefill_s": sum(ttfts), "wall_s": sum(totals),
            "prompt_tokens_per_s": tokens / sum(ttfts), "hit_tokens": hits["hit_tokens"], "ttft_s": ttfts}


def figures_of(records: dict[str, Any]) -> dict[str, float]:
    """Flat figures: per length TTFTs, warm/cold ratios and hit tokens; agent totals."""
    out: dict[str, float] = {}
    for n, r in records["lengths"].items():
        for scenario in SCENARIOS:
            out[f"{n}.{scenario}_ttft_s"] = r[scenario]
        out[f"{n}.warm_dram_over_cold"] = r["warm_dram"] / r["cold"]
        out[f"{n}.warm_ssd_over_cold"] = r["warm_ssd"] / r["cold"]
        out[f"{n}.warm_dram_hit_tokens"] = float(r["warm_dram_hits"]["hit_tokens"])
        out[f"{n}.warm_l2_hit_tokens"] = float(r["warm_l2_hits"]["l2_hit_tokens"])
        out[f"{n}.warm_ssd_hit_tokens"] = float(r["warm_ssd_hits"]["hit_tokens"])
        out[f"{n}.warm_ssd_l2_hit_tokens"] = float(r["warm_ssd_hits"]["l2_hit_tokens"])
    if "agent" in records:
        a = records["agent"]
        out.update({"agent.prefill_s": a["prefill_s"], "agent.prompt_tokens_per_s": a["prompt_tokens_per_s"],
                    "agent.hit_tokens": float(a["hit_tokens"])})
    return out


class EngineLaunch:
    """The one vLLM both sides share, attached to a cache-server port.

    vLLM CPU needs a minute or more before it serves; :meth:`launch` starts it (behind a throwaway
    stock cache server, which must be up while vLLM registers its KV caches) without waiting, so
    a caller can spend that minute on work that measures no time (the suite runs the capacity
    replay meanwhile). :meth:`wait_ready` waits, warms the engine and removes the throwaway server.
    """

    def __init__(self, checkpoint: Path, settings: E2ESettings, log_dir: Path | None = None) -> None:
        from kvshrink.launch import VLLMServer, free_port

        self.settings = settings
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvshrink-e2e-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self._warmup_dir = Path(tempfile.mkdtemp(prefix="kvshrink-e2e-warmup-"))
        self._stack = contextlib.ExitStack()
        connector = {"kv_connector": "LMCacheMPConnector",
                     "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
                     "kv_role": "kv_both",
                     "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": self.port,
                                                   "lmcache.mp.heartbeat_interval": settings.heartbeat_s}}
        self.vllm = VLLMServer(checkpoint, kv_transfer_config=connector, served_model_name=SERVED_NAME,
                               log_path=self.log_dir / "vllm.log", env=SERVER_ENV)
        self._ready = False

    def launch(self) -> "EngineLaunch":
        if self.vllm.proc is None:
            warmup = Side(STOCK, stock_adapter(self._warmup_dir), None, self._warmup_dir)
            self._stack.enter_context(cache_server(warmup, self.port, self.settings.l1_size_gb, self.log_dir,
                                                   settings=self.settings))
            self.vllm.launch()
        return self

    def wait_ready(self, progress: Callable[[str], None] = lambda s: None) -> str:
        """vLLM's URL once it serves and has run one request (its first store also starts the MP
        connector's heartbeat, which re-registers vLLM after each cache-server restart)."""
        if not self._ready:
            self.launch()
            progress("starting vLLM")
            self.vllm.wait_serving()
            _request(self.vllm.url, throwaway_prompt(), self.settings)
            self._stack.close()
            self._ready = True
        return self.vllm.url

    def stop(self) -> None:
        try:
            self.vllm.stop()
        finally:
            self._stack.close()
            shutil.rmtree(self._warmup_dir, ignore_errors=True)


def run(checkpoint: Path, settings: E2ESettings, template: Path | None = None, log_dir: Path | None = None,
        progress: Callable[[str], None] = lambda s: None,
        engine: EngineLaunch | None = None) -> tuple[SideRun, SideRun]:
    """Both sides against one vLLM (``engine``, possibly launched earlier; stopped here), ours on
    ``template`` (default: the shipped default store); returns (stock, ours)."""
    from kvshrink.configs import store_record

    engine = engine or EngineLaunch(checkpoint, settings, log_dir)
    prompts = build_prompts(checkpoint, settings)
    total_tokens = sum(len(p) for p in prompts.by_length.values()) + sum(int(r.token_ids.size) for r in prompts.agent)
    needed = total_tokens * BYTES_PER_TOKEN + (1 << 30)  # every chunk the run can write, raw, plus slack
    workdirs = [Path(tempfile.mkdtemp(prefix=f"kvshrink-e2e-{n}-")) for n in ("stock", "ours")]
    spec, shm = ours_adapter(workdirs[1], template, workdirs[1].name.rsplit("-", 1)[-1], needed)
    sides = [Side(STOCK, stock_adapter(workdirs[0]), None, workdirs[0]), Side(OURS, spec, shm, workdirs[1])]
    model = model_fingerprint(checkpoint)
    trace = prompts.fingerprint(settings)
    results = []
    try:
        vllm_url = engine.wait_ready(progress)
        for side in sides:
            records = measure_side(side, vllm_url, engine.port, prompts, settings, engine.log_dir,
                                   lambda s, n=side.name: progress(f"{n}: {s}"))
            budget = {"l1_size_gb": settings.l1_size_gb, "agent_l1_size_gb": settings.agent_l1_size_gb,
                      "l2_holds_every_chunk": _l2_holds(side, needed)}
            used = {"store_config": store_record(template)} if side.name == OURS else {}
            results.append(SideRun(side.name, Workload(trace, model, budget), figures_of(records),
                                   {"records": records, "adapter": side.adapter, "logs": str(engine.log_dir), **used},
                                   cache_server_policy(side.name, settings.l1_size_gb)))
    finally:
        engine.stop()
        for side in sides:
            side.drop_dram_tier()
        for workdir in workdirs:
            shutil.rmtree(workdir, ignore_errors=True)
    stock, ours = results
    _check_outputs(stock, ours)
    return stock, ours


def _l2_holds(side: Side, needed: int) -> bool:
    """Stock fs is unbounded; ours must have been given room for every chunk the run writes."""
    if side.name == STOCK:
        return True
    tiers = side.adapter["adapter_params"]["store"]["tiers"]
    return max(int(t["capacity"]) for t in tiers) >= needed - (1 << 30)


def _check_outputs(stock: SideRun, ours: SideRun) -> None:
    """KVShrink must answer exactly as stock LMCache does in every scenario (its codec is bit-exact,
    so the KV it serves is stock's KV): every disagreement is recorded as a mismatch.

    Warm and cold answers of one side may differ where a prompt ends inside a chunk: the cached
    prefix stops at the last whole chunk and vLLM CPU computes the tail in a differently shaped
    bf16 batch, which can flip a greedy token (it happens with stock LMCache alike). Those are
    recorded apart, as ``cold_vs_warm``, not as mismatches."""
    def scenarios(out: dict[str, Any]) -> list[tuple[str, str]]:
        return [("cold", out["cold"]), *(("warm", t) for t in out["warm"]), ("warm_ssd", out["warm_ssd"])]

    mismatches, cold_vs_warm = [], []
    for n, s_out in stock.details["records"]["outputs"].items():
        s_all, o_all = scenarios(s_out), scenarios(ours.details["records"]["outputs"][n])
        for (label, s_text), (_, o_text) in zip(s_all, o_all, strict=True):
            if o_text != s_text:
                mismatches.append(f"{n} tokens, {label}: ours {o_text!r} != stock {s_text!r}")
        if any(text != s_out["cold"] for _, text in s_all[1:]):
            cold_vs_warm.append(n)
    for run in (stock, ours):
        run.details["output_mismatches"] = mismatches
        run.details["cold_vs_warm_differs"] = cold_vs_warm
        run.figures["output_mismatches"] = float(len(mismatches))
