"""The end-to-end benchmark: stock LMCache and KVShrink as paired stacks on vLLM CPU + SmolLM2.

Each stack is a real ``lmcache server`` (multiprocess LMCache, the runtime LMCache's roadmap keeps)
with its own vLLM OpenAI server attached (vLLM's own prefix cache off, so every hit is LMCache's).
Stock's L2 is LMCache's native file-system adapter (``fs_native``, C++ I/O, bounded with LMCache's
own L2 eviction); ours is :class:`~kvshrink.storage_backends.mp_l2_adapter.KVShrinkL2Adapter`
over the shipped default store (``configs/store-default.yaml``, moved and resized only, by
:func:`kvshrink.testing.derived_stores.derive_store`). TTFT is the first streamed token of a
streamed completion.

Every step runs on every stack back to back, the order rotating from one step to the next, and a
stack's background stores finish before the next stack's request starts (``Stack.wait_idle``): load
from elsewhere on the machine falls on all stacks alike and no stack's writes slow another's
prefill. Hits are read from LMCache's own lookup counters (``/metrics``), never inferred from time.
Nor may one stack's engine slow another's: vLLM CPU's worker busy-polls its step queue (``sched_yield``) for 1 s
after every engine step, and every stack's worker is pinned to the same core, so a request sent
within that second of another stack's request ran its forward pass beside a spinning neighbour (a
1-token step took 0.23-0.38 s instead of ~0.05 s) and finished when the spin ended: the ~0.6 s
step that made every short TTFT bimodal. Before each request a stack waits until every other live
stack's vLLM is idle (:meth:`Stack.wait_neighbours_quiet`, measured from ``/proc``, not assumed).

Phases:

* **hot path** (large L1 on both, chunks in it): warm TTFT from LMCache's L1 (our adapter idle) and
  from the first L2 tier (L1 cleared before each request: our DRAM tier vs stock's ``fs_native``
  files in the page cache); medians of paired ratios with 95 % bootstrap intervals.
* **restart**: both cache servers restarted (our shared-memory DRAM tier removed too, so ours comes
  from the SSD tier, as stock's from its files), the hot-path prompt again, against its cold TTFT.
* **context lengths** (:mod:`~kvshrink.benchmarks.context_ttft`, the hot pair): TTFT cold and warm
  from LMCache's L1, from the first L2 tier and from our SSD tier after a restart, at 1K-8K tokens
  (``context_lengths``), pairs sized from the cold prefill it measures; where loading beats
  recomputing on this machine, for both sides.
* **agent replay**, the workload the project exists for: an agent trace whose sessions' contexts
  grow every turn, more KV than the budget, at several budgets, sessions interleaved at random
  (think times longer than a turn) so that the KV a turn needs has aged by varying amounts. Every
  stack spends the same DRAM + SSD budget: stock runs each of its sensible arrangements --
  ``l1-all-dram`` (LMCache's L1 caches the DRAM budget, ``fs_native`` = the SSD budget; LMCache
  writes every chunk to both) and ``l2-all`` (the whole budget in ``fs_native``: the arrangement
  ours uses) -- and ours the shipped default store, its DRAM tier = the DRAM budget, its SSD tier =
  the SSD budget. LMCache's L1 caches nothing else on any stack, but every L1 also keeps free room
  for the largest request's chunks (:func:`l1_headroom_for`, not counted): LMCache's mp L1 evicts
  from a thread once a second, above a watermark, and a store that finds no room when it
  allocates is dropped (a log line, no error), so an L1 with too little free room silently keeps
  the chunks of every larger request out of every L2 alike. Before each request the harness waits
  until that room is free again (:meth:`Stack.wait_l1_room`), and each stack's allocation failures
  are counted from its server log. Reported per budget: hit rate, total
  prefill time (sum of TTFT) with a 95 % bootstrap interval of ours / stock-at-best, TTFT p50 /
  p90, bytes held.

Engine: vLLM CPU serves SmolLM2 in bf16, KV included, as a GPU deployment would. On an AVX2-only
CPU bf16 is emulated: a miss costs ~28 ms a token (1024 tokens cold: ~29 s), ~20x what it costs
with AMX, so the trace's sessions grow to the model's 8192 positions but how many sessions and
turns is chosen per machine: with a time budget (``time_left``, from ``kvshrink bench
--time-budget``) the harness measures this machine's speeds just before the replay and sizes the
trace to fit (:meth:`PairedBench.choose_trace`, ``trace_sizing``); the trace's context lengths, its
working set and the sizing go into ``workload`` (:func:`trace_record`). Each replay also records
the trace's reuse ceiling
(:func:`reuse_ceiling`, what an unbounded cache hits): where stock at its best hits within 10
points of it, no cache can show the +10-point target. Two faster settings were
tried and rejected: fp32 compute with ``--kv-cache-dtype bfloat16`` prefills 5x faster but vLLM
CPU then answers garbage even without any cache; fp32 throughout is correct and fast, but its KV is fp32,
which no deployment caches and which compresses 1.19x instead of bf16's 1.48x. The trace's tokens
are real text (the prose corpus), so the KV is what real prompts make.
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import tempfile
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from kvshrink.benchmarks.comparison import (OURS, STOCK, Budget, SideRun, TierPolicy, Workload, digest,
                                            model_fingerprint)
from kvshrink.benchmarks.paired_stats import difference_of_rates, ratio_of_sums, verdict
from kvshrink.errors import KVShrinkError

BYTES_PER_TOKEN = 2 * 30 * 192 * 2  # SmolLM2-135M KV in bf16: K and V, 30 layers, 3 KV heads x 64
MIB = 1 << 20
ENGINE_ARGS = ("--dtype", "bfloat16")
ENGINE_LABEL = "vLLM CPU 0.32, SmolLM2-135M bf16 (weights, compute and KV), prefix cache off"
L1_FLOOR_MIB = 16  # LMCache's L1 must hold one request's chunks while it loads them into vLLM
L1_EVICTION_RATIO = 0.2  # LMCache's default: a fifth of the L1's keys per eviction pass
# vLLM CPU's worker polls its shared-memory step queue with sched_yield for 1 s after each read
# (vllm/distributed/device_communicators/shm_broadcast.py, SpinCondition busy_loop_s); a stack
# counts as quiet once its vLLM processes used under QUIET_CPU_S of CPU in a QUIET_WINDOW_S window
ENGINE_SPIN_S = 1.0
QUIET_WINDOW_S = 0.1
QUIET_CPU_S = 0.02
ALLOCATION_FAILED = "Failed to batched allocate"  # LMCache's log line for a store dropped for want of L1 room
ADAPTER = {"type": "plugin", "module_path": "kvshrink.storage_backends.mp_l2_adapter",
           "class_name": "KVShrinkL2Adapter"}
# stock's L2 eviction at its best: evict late and little, so it keeps nearly all of its budget
STOCK_L2_EVICTION = {"eviction_policy": "LRU", "trigger_watermark": 0.95, "eviction_ratio": 0.05}
HOT_TARGET_L1 = 1.03
HOT_TARGET_L2 = 1.10
REPLAY_PREFILL_TARGET = 0.80  # total prefill ours / stock at its best, upper bound of the interval
REPLAY_HIT_POINTS_TARGET = 0.10  # hit rate ours - stock at its best, lower bound of the interval
EQUAL_HITS_TTFT_TARGET = 1.02  # TTFT ours / stock where both hit the same tokens: the adapter costs nothing there


class E2EError(KVShrinkError):
    """A stack did not behave as the benchmark needs (no registration, no store, a failed request)."""


# -- what each stack runs ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Arrangement:
    """One stack's cache server for one phase: its L1, its L2 adapter, its policy. ``l1_mib`` is what
    LMCache's L1 may cache; ``l1_headroom_mib`` more is kept free for the chunks of one request in
    flight (the L1's eviction watermark sits at ``l1_mib``; none: LMCache's own watermark)."""

    l1_mib: float
    adapter: dict[str, Any]
    policy: TierPolicy
    shm_name: str | None = None
    disk: Path | None = None
    l1_headroom_mib: float = 0.0
    extra_adapters: tuple[dict[str, Any], ...] = ()  # more L2 adapters after ``adapter`` (LMCache stores to all)
    extra_args: tuple[str, ...] = ()  # more ``lmcache server`` flags (e.g. ``--server-module``)

    @property
    def l1_size_mib(self) -> float:
        return self.l1_mib + self.l1_headroom_mib

    def server_args(self) -> tuple[str, ...]:
        """``lmcache server`` flags that put the L1's eviction watermark at ``l1_mib``."""
        if not self.l1_headroom_mib:
            return self.extra_args
        return ("--eviction-trigger-watermark", f"{self.l1_mib / self.l1_size_mib:.4f}",
                "--eviction-ratio", f"{L1_EVICTION_RATIO if self.l1_mib else 1.0}", *self.extra_args)


def stock_fs_native(disk: Path, capacity_mib: float) -> dict[str, Any]:
    return {"type": "fs_native", "base_path": str(disk), "max_capacity_gb": capacity_mib / 1024,
            "eviction": dict(STOCK_L2_EVICTION)}


def ours_adapter(disk: Path, shm_name: str, dram_mib: float, ssd_mib: float, template: Path | None) -> dict[str, Any]:
    from kvshrink.testing.derived_stores import derive_store

    store = derive_store(template, paths={"ssd": disk}, shm_names={"dram": shm_name},
                         capacities={"dram": int(dram_mib * MIB), "ssd": int(ssd_mib * MIB)})
    return {**ADAPTER, "adapter_params": {"store": store}}


STOCK_VARIANTS = ("l1-all-dram", "l2-all")


def replay_arrangement(key: str, budget: Budget, headroom_mib: float, workdir: Path, shm_name: str,
                       template: Path | None) -> Arrangement:
    """The arrangement ``key`` (``ours`` or one of :data:`STOCK_VARIANTS`) of ``budget``; every L1
    keeps ``headroom_mib`` free on top of what it caches."""
    disk = workdir / "l2"
    if key == "l1-all-dram":
        return Arrangement(budget.dram_mib, stock_fs_native(disk, budget.ssd_mib),
                           TierPolicy(f"stock l1-all-dram: L1 caches {budget.dram_mib:.0f} MiB, fs_native "
                                      f"{budget.ssd_mib:.0f} MiB", "inclusive", budget.dram_mib, True),
                           disk=disk, l1_headroom_mib=headroom_mib)
    if key == "l2-all":
        return Arrangement(0.0, stock_fs_native(disk, budget.total_mib),
                           TierPolicy(f"stock l2-all: fs_native {budget.total_mib:.0f} MiB (L1 only stages)",
                                      "inclusive", 0.0, True), disk=disk, l1_headroom_mib=headroom_mib)
    if key == "ours":
        return Arrangement(0.0, ours_adapter(disk, shm_name, budget.dram_mib, budget.ssd_mib, template),
                           TierPolicy(f"KVShrink: shipped default store {budget.dram_mib:.0f} MiB DRAM + "
                                      f"{budget.ssd_mib:.0f} MiB SSD (compressed, exclusive; L1 only stages)",
                                      "exclusive", 0.0, True), shm_name=shm_name, disk=disk,
                           l1_headroom_mib=headroom_mib)
    raise ValueError(f"unknown arrangement {key!r}")


def hot_arrangement(side: str, workdir: Path, shm_name: str, l1_mib: float, template: Path | None) -> Arrangement:
    """Roomy: chunks stay in a large L1, every L2 holds everything."""
    disk = workdir / "l2"
    if side == STOCK:
        return Arrangement(l1_mib, stock_fs_native(disk, 4096),
                           TierPolicy(f"stock: L1 {l1_mib:.0f} MiB + fs_native", "inclusive", l1_mib, True), disk=disk)
    return Arrangement(l1_mib, ours_adapter(disk, shm_name, 1024, 4096, template),
                       TierPolicy(f"KVShrink: L1 {l1_mib:.0f} MiB + shipped default store", "inclusive", l1_mib, True),
                       shm_name=shm_name, disk=disk)


# -- one stack --------------------------------------------------------------------------------------
@dataclass
class Sample:
    """One request on one stack: TTFT, LMCache's hit counters around it, the answer."""

    ttft_s: float
    prompt_tokens: int
    hit_tokens: float
    l1_hit_tokens: float
    l2_hit_tokens: float
    text: str
    neighbour_wait_s: float = 0.0  # waited before the request for other stacks' engines to go idle


class Stack:
    """A cache server (restartable on one port, reconfigurable) with its own vLLM attached.

    Every stack whose vLLM runs in this process is every other's neighbour: they share the
    machine, so before a request each waits until its neighbours' engines are idle
    (``quiet_neighbours``; off only to measure what it prevents)."""

    _live: "weakref.WeakSet[Stack]" = weakref.WeakSet()

    def __init__(self, key: str, side: str, root: Path, log_dir: Path, chunk_tokens: int) -> None:
        self.key, self.side, self.chunk_tokens = key, side, chunk_tokens
        self.workdir = root / key
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self.shm_name = f"kvshrink-e2e-{uuid.uuid4().hex[:10]}"
        self.port: int | None = None
        self.server: Any = None
        self.vllm: Any = None
        self.arrangement: Arrangement | None = None
        self.quiet_neighbours = True
        self._starts = 0

    def launch_cache(self, arrangement: Arrangement) -> None:
        """Start the cache server with ``arrangement`` on this stack's port, without waiting."""
        from kvshrink.testing.launch import LMCacheServer

        self._starts += 1
        self.arrangement = arrangement
        self.server = LMCacheServer(port=self.port, l1_size_gb=arrangement.l1_size_mib / 1024,
                                    l2_adapters=[arrangement.adapter, *arrangement.extra_adapters],
                                    chunk_size=self.chunk_tokens, extra_args=arrangement.server_args(),
                                    log_path=self.server_log,
                                    env={"LMCACHE_LOG_LEVEL": "INFO"})
        self.server.launch()
        self.port = self.server.port

    def launch_vllm(self, model: Path, max_model_len: int = 4096) -> None:
        from kvshrink.testing.launch import VLLMServer
        from kvshrink.testing.mp_observe import connector_config_with_heartbeat

        self.vllm = VLLMServer(model, kv_transfer_config=connector_config_with_heartbeat(self.server),
                               served_model_name="smollm2", extra_args=ENGINE_ARGS, max_model_len=max_model_len,
                               kv_cache_space_gb=1,  # ~45K tokens of bf16 KV: the longest request needs 8K
                               log_path=self.log_dir / f"vllm-{self.key}.log")
        self.vllm.launch()
        Stack._live.add(self)

    def wait_ready(self, timeout: float = 600.0) -> None:
        from kvshrink.testing.mp_observe import wait_for_engine

        self.vllm.wait_serving(timeout)
        wait_for_engine(self.server.http_url)
        self.throwaway()

    def stop_cache(self, wipe: bool) -> None:
        """Stop the cache server; remove its data (``wipe``) or only our DRAM arena."""
        self.server.stop()
        self._drop_arena()
        if wipe and self.arrangement is not None and self.arrangement.disk is not None:
            shutil.rmtree(self.arrangement.disk, ignore_errors=True)

    def throwaway(self) -> None:
        """One never-seen chunk through the whole store path before anything is timed."""
        tokens = self.chunk_tokens + 16
        prompt = np.random.default_rng(uuid.uuid4().int & 0xFFFFFFFF).integers(1000, 40000, tokens).tolist()
        self.request(prompt)
        self.wait_idle()

    def request(self, prompt: Sequence[int], max_tokens: int = 8, timeout: float = 600.0) -> Sample:
        from kvshrink.testing.mp_observe import cache_counters
        from kvshrink.testing.streaming_client import stream_completion

        waited = self.wait_neighbours_quiet() if self.quiet_neighbours else 0.0
        before = cache_counters(self.server.http_url)
        result = stream_completion(self.vllm.url, "smollm2", list(prompt), max_tokens=max_tokens, timeout=timeout)
        delta = cache_counters(self.server.http_url) - before
        return Sample(result.ttft_s, len(prompt), delta.hit_tokens, delta.l1_hit_tokens, delta.l2_hit_tokens,
                      result.text, waited)

    def engine_cpu_s(self) -> float:
        """CPU seconds used so far by every thread of this stack's vLLM processes (from /proc)."""
        from kvshrink.testing.processes import group_pids

        if self.vllm is None or self.vllm.proc is None:
            return 0.0
        total = 0
        for pid in group_pids(self.vllm.proc.pid):
            for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    total += int(stat.read_text().split()[0])  # ns on CPU, run-queue wait, slices
        return total / 1e9

    def neighbours(self) -> list["Stack"]:
        return [s for s in Stack._live if s is not self and s.vllm is not None and s.vllm.running]

    def wait_neighbours_quiet(self, timeout: float = 3 * ENGINE_SPIN_S) -> float:
        """Until every other live stack's vLLM used under :data:`QUIET_CPU_S` of CPU in one
        :data:`QUIET_WINDOW_S` window, i.e. its worker stopped spinning (about
        :data:`ENGINE_SPIN_S` after its last step); seconds waited. After ``timeout`` it goes ahead
        (a neighbour busy for another reason is not this wait's to fix)."""
        others = self.neighbours()
        if not others:
            return 0.0
        start = time.monotonic()
        used = sum(s.engine_cpu_s() for s in others)
        while time.monotonic() - start < timeout:
            time.sleep(QUIET_WINDOW_S)
            now = sum(s.engine_cpu_s() for s in others)
            if now - used < QUIET_CPU_S:
                break
            used = now
        return time.monotonic() - start

    def clear_l1(self) -> None:
        import httpx

        httpx.post(f"{self.server.http_url}/cache/clear", json={"tier": "l1"}, timeout=30).raise_for_status()

    @property
    def server_log(self) -> Path:
        return self.log_dir / f"lmcache-{self.key}-{self._starts}.log"

    def allocation_failures(self) -> int:
        """Stores LMCache's L1 dropped for want of room since this cache server started."""
        if not self.server_log.exists():
            return 0
        with open(self.server_log, errors="replace") as log:
            return sum(ALLOCATION_FAILED in line for line in log)

    def wait_l1_room(self, need_bytes: float, timeout: float = 60.0) -> None:
        """Until LMCache's L1 has ``need_bytes`` free (its eviction thread runs once a second)."""
        from kvshrink.testing.polling import poll_until

        def room() -> bool:
            l1 = self.server.status()["storage_manager"]["l1_manager"]
            return l1["memory_total_bytes"] - l1["memory_used_bytes"] >= need_bytes

        poll_until(room, timeout, interval=0.1, what=f"{self.key}: {need_bytes / MIB:.0f} MiB free in LMCache's L1",
                   error=E2EError)

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Until the cache server has no store in flight and, for ours, the store's queues are empty."""
        wait_stores_settled(lambda: stores_idle(self.server.status(), self.side == OURS), timeout, self.key)

    def held(self) -> dict[str, float]:
        """Chunks and bytes the L2 holds now (stock: its files; ours: the store's tiers)."""
        if self.side == OURS:
            from kvshrink.testing.mp_observe import adapter_status

            tiers = adapter_status(self.server.http_url)["store"]["tiers"]
            return {"chunks": float(sum(t["chunks"] for t in tiers.values())),
                    "bytes": float(sum(t["bytes_stored"] for t in tiers.values()))}
        disk = self.arrangement.disk if self.arrangement else None
        files = [p for p in disk.rglob("*") if p.is_file()] if disk and disk.exists() else []
        return {"chunks": float(len(files)), "bytes": float(sum(p.stat().st_size for p in files))}

    def _drop_arena(self) -> None:
        Path("/dev/shm", self.shm_name).unlink(missing_ok=True)

    def close(self) -> None:
        Stack._live.discard(self)
        for proc in (self.vllm, self.server):
            if proc is not None:
                with contextlib.suppress(Exception):
                    proc.stop()
        self._drop_arena()


def reconfigure(stacks: Sequence[Stack], arrangements: Sequence[Arrangement], wipe: bool = True) -> None:
    """Restart every stack's cache server at once with its new arrangement, on the same port, and
    wait until each vLLM has registered again; then one throwaway request each. ``wipe`` removes
    the old data, else only our DRAM arena goes (a restart). Together, so the stacks share one
    restart gap and one settling time instead of paying each in turn."""
    from kvshrink.testing.mp_observe import RESTART_GAP_S, wait_for_engine

    for stack in stacks:
        stack.stop_cache(wipe)
    time.sleep(RESTART_GAP_S)  # vLLM re-registers only once its heartbeat has seen the server gone
    for stack, arrangement in zip(stacks, arrangements, strict=True):
        stack.launch_cache(arrangement)
    for stack in stacks:
        stack.server.wait_healthy()
        wait_for_engine(stack.server.http_url, settle_s=0)
    time.sleep(RESTART_GAP_S)  # every connector's heartbeat sees its server healthy again
    for stack in stacks:
        stack.throwaway()


def rotated(stacks: Sequence[Stack], step: int) -> list[Stack]:
    """``stacks`` starting at ``step`` modulo their number: who goes first rotates step by step."""
    k = step % len(stacks)
    return list(stacks[k:]) + list(stacks[:k])


# -- figures ----------------------------------------------------------------------------------------
def side_figures(samples: Sequence[Sample]) -> dict[str, float]:
    ttft = [s.ttft_s for s in samples]
    prompt = sum(s.prompt_tokens for s in samples)
    hits = sum(s.hit_tokens for s in samples)
    return {"requests": float(len(samples)), "prompt_tokens": float(prompt), "hit_tokens": float(hits),
            "hit_rate": hits / prompt if prompt else 0.0, "prefill_s": float(sum(ttft)),
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p90_s": float(np.percentile(ttft, 90))}


# -- settings ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PairedSettings:
    hot_prompt_tokens: int = 1024
    hot_pairs: int = 15
    hot_l1_mib: float = 256
    restart: bool = True
    # agent sessions as agents run them: each starts at ~1K tokens (system prompt + first user
    # message) and grows by tool output and replies until it fills SmolLM2's 8192 positions, all in
    # flight at once and interleaved at random (a think time of ~20 s against a nominal 3 s turn).
    # Sessions and turns here are the unsized default: ``kvshrink bench`` picks them for the time it
    # has from this machine's measured speeds (benchmarks/trace_sizing.py); the shape stays
    trace: dict[str, Any] = field(default_factory=lambda: dict(
        sessions=8, turns=6, concurrency=8, system_tokens=256, first_user_tokens=768, context_tokens=8192,
        output_tokens=16, agents=1, think_s=20.0, seed=0))
    # budget / distinct KV of the trace: the working set is 2.2-4x every budget, so every budget
    # evicts and stock's hit rate stays well under the trace's reuse ceiling
    fractions: tuple[float, ...] = (0.25, 0.35, 0.45)
    dram_share: float = 0.25
    chunk_tokens: int = 256  # LMCache's default, both sides
    # cold prefill lengths the sizing measures before the replay when no earlier phase did
    sizing_lengths: tuple[int, ...] = (1024, 4096)
    stock_variants: tuple[str, ...] = STOCK_VARIANTS
    max_tokens: int = 4
    trace_file: str = ""
    quiet_neighbours: bool = True  # each request waits for the other stacks' engines to go idle
    # TTFT by context length (benchmarks/context_ttft.py) on the hot pair: nominal lengths (none: not
    # run) and the seconds the phase may spend; its pairs are sized from the cold prefill it measures
    context_lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    context_budget_s: float = 900.0


def stores_idle(status: dict[str, Any], ours: bool) -> bool:
    """Whether a cache server's ``/status`` shows no store in flight in LMCache and, for ours
    (``ours``: its first L2 adapter is KVShrink's), the store's put and background queues empty."""
    manager = status.get("storage_manager", {})
    controller = manager.get("store_controller", {})
    if controller.get("pending_keys_count", 0) or controller.get("in_flight_task_count", 0):
        return False
    if not ours:
        return True
    adapter = manager["l2_adapters"][0]
    engine = adapter["store"]["engine"]
    return not adapter["in_flight_tasks"] and not engine["put_queue_depth"] and not engine["background_queue_depth"]


def wait_stores_settled(idle: Callable[[], bool], timeout: float, name: str) -> None:
    """Until ``idle()`` holds twice in a row, 50 ms apart (a store task can start right after the
    last one ended), so that a stack's writes never overlap the next stack's request.
    :class:`E2EError` after ``timeout`` seconds."""
    from kvshrink.testing.polling import poll_until

    streak = 0

    def settled() -> bool:
        nonlocal streak
        streak = streak + 1 if idle() else 0
        return streak >= 2

    poll_until(settled, timeout, interval=0.05, what=f"{name}'s stores to finish",
               error=lambda message: E2EError(f"{name}: {message}"))


# -- the run ----------------------------------------------------------------------------------------
@dataclass
class PairedResult:
    """Everything measured, raw (per request) and summed; JSON-able via ``to_dict``."""

    settings: dict[str, Any]
    workload: dict[str, Any]
    hot: dict[str, Any] = field(default_factory=dict)
    restart: dict[str, Any] = field(default_factory=dict)
    replay: list[dict[str, Any]] = field(default_factory=list)
    store_config: dict[str, Any] | None = None
    engine: str = ENGINE_LABEL
    context: dict[str, Any] = field(default_factory=dict)  # TTFT by context length (context_ttft)


def prefix_chunk_keys(token_ids: Any, chunk_tokens: int) -> list[str]:
    """One key per whole chunk of a prompt, naming the whole prefix up to it (as LMCache's chained
    chunk hashes do)."""
    import hashlib

    ids = np.asarray(token_ids, dtype=np.int64)
    running, keys = hashlib.sha256(), []
    for i in range(ids.size // chunk_tokens):  # one pass: an 8K-token prompt is 32 chunks
        running.update(ids[i * chunk_tokens:(i + 1) * chunk_tokens].tobytes())
        keys.append(running.copy().hexdigest()[:16])
    return keys


def distinct_chunks(requests: Sequence[Any], chunk_tokens: int) -> int:
    """Distinct whole-chunk prefixes in the trace: the KV an infinite cache would hold."""
    return len({key for r in requests for key in prefix_chunk_keys(r.token_ids, chunk_tokens)})


def reuse_ceiling(requests: Sequence[Any], chunk_tokens: int) -> float:
    """Hit rate of an unbounded prefix cache on this trace: the prompt tokens that lie in whole
    chunks of a prefix seen before. No budget hits more, so where stock at its best already hits
    within d of it, no cache can gain d over stock."""
    total = sum(len(r.token_ids) for r in requests)
    return sum(reusable_tokens(requests, chunk_tokens)) / total if total else 0.0


def reusable_tokens(requests: Sequence[Any], chunk_tokens: int) -> list[int]:
    """Per request, the tokens an unbounded prefix cache would serve: its whole chunks up to the
    first one no earlier request had."""
    seen: set[str] = set()
    out = []
    for r in requests:
        keys = prefix_chunk_keys(r.token_ids, chunk_tokens)
        out.append(next((i for i, k in enumerate(keys) if k not in seen), len(keys)) * chunk_tokens)
        seen.update(keys)
    return out


def trace_record(requests: Sequence[Any], chunk_tokens: int, budgets: Sequence[Budget],
                 requested: dict[str, Any] | None) -> dict[str, Any]:
    """What report.json says of the replay's trace: its fingerprint and size, the context lengths
    it reaches (per session: the last prompt plus its answer, in positions) against ``requested``
    (the generator's settings; None for a user's trace), and the KV working set against the
    largest budget."""
    prompts = [len(r.token_ids) for r in requests]
    final: dict[Any, int] = {}
    for r in requests:
        final[r.session_id] = max(final.get(r.session_id, 0), len(r.token_ids) + int(getattr(r, "max_tokens", 0)))
    distinct = distinct_chunks(requests, chunk_tokens)
    working_set = distinct * chunk_tokens * BYTES_PER_TOKEN
    largest = max((b.total_mib for b in budgets), default=0.0) * MIB
    lengths = None
    if requested is not None:
        lengths = {"first_prompt_tokens": requested.get("system_tokens", 0) + requested.get("first_user_tokens", 0),
                   "context_tokens": requested.get("context_tokens", 0), "sessions": requested.get("sessions"),
                   "turns": requested.get("turns")}
    return {"trace": digest(*[np.asarray(r.token_ids, dtype=np.int64) for r in requests]),
            "requests": len(requests), "sessions": len(final), "prompt_tokens": int(sum(prompts)),
            "distinct_chunks": distinct, "reuse_ceiling": reuse_ceiling(requests, chunk_tokens),
            "replay_l1_headroom_mib": l1_headroom_for(requests),
            "context": {"requested": lengths, "session_final_positions": [final[k] for k in sorted(final)],
                        "prompt_tokens_min": int(min(prompts)), "prompt_tokens_median": float(np.median(prompts)),
                        "prompt_tokens_max": int(max(prompts))},
            "working_set_bytes": int(working_set),
            "working_set_over_largest_budget": working_set / largest if largest else None}


def phase_samples(result: PairedResult) -> dict[str, Any]:
    """What the phases before the replay measured, as the sizing needs it: (prompt tokens, median
    cold TTFT) per length, the TTFT of a request that prefills nothing (warm from L1, shortest
    prompt), what a token loaded from L2 adds, and the mean wait for the other stacks' engines."""
    by: dict[str, dict[int, list[float]]] = {"cold": {}, "warm_l1": {}, "warm_l2": {}}
    waits: list[float] = []
    sets = [result.hot.get("samples", {})] + [e.get("samples", {}) for e in result.context.get("by_length", [])]
    for samples in sets:
        for label, per_stack in samples.items():
            for xs in per_stack.values():
                for x in xs:
                    if label in by:
                        by[label].setdefault(int(x["prompt_tokens"]), []).append(float(x["ttft_s"]))
                    if label != "cold":
                        waits.append(float(x.get("neighbour_wait_s", 0.0)))
    med = {label: {n: statistics.median(v) for n, v in d.items()} for label, d in by.items()}
    fixed = med["warm_l1"][min(med["warm_l1"])] if med["warm_l1"] else 0.2
    load = [(t - fixed) / n for n, t in med["warm_l2"].items() if n]
    return {"cold": sorted(med["cold"].items()), "fixed_s": fixed,
            "load_s_per_token": max(0.0, statistics.median(load)) if load else 0.0,
            "wait_s": (statistics.fmean(waits) if waits else ENGINE_SPIN_S) + 0.1}  # + the harness's own polls


def budgets_for(distinct: int, chunk_tokens: int, fractions: Sequence[float], dram_share: float) -> list[Budget]:
    kv_mib = distinct * chunk_tokens * BYTES_PER_TOKEN / MIB
    return [Budget(round(kv_mib * f * dram_share, 1), round(kv_mib * f * (1 - dram_share), 1)) for f in fractions]


def largest_request_bytes(requests: Sequence[Any]) -> int:
    return max(len(r.token_ids) for r in requests) * BYTES_PER_TOKEN


def l1_headroom_for(requests: Sequence[Any]) -> float:
    """Free L1 room every replay stack keeps: twice the largest request's KV (its chunks loaded
    and stored in one request while the once-a-second eviction catches up), in 8 MiB steps."""
    largest = 2 * largest_request_bytes(requests) / MIB
    return float(max(L1_FLOOR_MIB, 8 * -(-largest // 8)))


def corpus_tokens(model: Path, corpus: str) -> list[int]:
    """A real-text corpus of the KV fixture, tokenized with the served model's tokenizer."""
    from transformers import AutoTokenizer

    from kvshrink.testing.fixtures.real_kv import corpus_text

    return list(AutoTokenizer.from_pretrained(model)(corpus_text(corpus)).input_ids)


def hot_prompt(model: Path, tokens: int) -> list[int]:
    """The hot-path prompt: the first ``tokens`` of the code corpus (the trace reads prose)."""
    ids = corpus_tokens(model, "code")
    if tokens > len(ids):
        raise E2EError(f"the code corpus has {len(ids)} tokens, not enough for a {tokens}-token prompt")
    return ids[:tokens]


def trace_requests(settings: PairedSettings, model: Path, trace: dict[str, Any] | None = None) -> list[Any]:
    """The replay's requests: the user's file, else the agent trace of ``trace`` (default
    ``settings.trace``) over real prose."""
    if settings.trace_file:
        from transformers import AutoTokenizer

        from kvshrink.benchmarks.user_trace import load_trace

        tokenizer = AutoTokenizer.from_pretrained(model)
        return load_trace(settings.trace_file,
                          tokenizer=lambda text: tokenizer(text, add_special_tokens=False).input_ids)
    from kvshrink.benchmarks.agent_trace import TraceConfig, generate

    return generate(TraceConfig(**(trace or settings.trace)),
                    text_tokens=np.asarray(corpus_tokens(model, "prose"), np.int32))


class PairedBench:
    """Starts the stacks (``launch`` early, ``run`` later), runs the phases, stops everything."""

    def __init__(self, model: Path, settings: PairedSettings, template: Path | None = None,
                 log_dir: Path | None = None, progress: Callable[[str], None] = lambda s: None) -> None:
        self.model, self.settings, self.template = model, settings, template
        self.root = Path(tempfile.mkdtemp(prefix="kvshrink-e2e-"))
        self.log_dir = Path(log_dir or self.root / "logs")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.progress = progress
        variants = settings.stock_variants if settings.fractions else settings.stock_variants[:1]  # no replay: the hot pair
        keys = [(v, STOCK) for v in variants] + [("ours", OURS)]
        self.stacks = [Stack(k, side, self.root, self.log_dir, settings.chunk_tokens) for k, side in keys]
        for stack in self.stacks:
            stack.quiet_neighbours = settings.quiet_neighbours
        self._launched = False
        # seconds the replay may take, given this machine's measured speeds (``kvshrink bench`` sets
        # it from --time-budget); None: the trace of ``settings`` as it is, nothing measured
        self.time_left: Callable[[Any], float] | None = None
        self.say: Callable[[str], None] = print
        self.size_only = False  # measure and size the trace, replay nothing (checking the sizing)

    @property
    def ours(self) -> Stack:
        return self.stacks[-1]

    def hot(self, stack: Stack) -> Arrangement:
        return hot_arrangement(stack.side, stack.workdir, stack.shm_name, self.settings.hot_l1_mib, self.template)

    def launch(self) -> "PairedBench":
        """Start every cache server and every vLLM without waiting for vLLM (a minute or more)."""
        if not self._launched:
            for stack in self.stacks:
                stack.launch_cache(self.hot(stack))
            for stack in self.stacks:
                stack.server.wait_healthy()
            from kvshrink.benchmarks.context_ttft import max_model_len_for

            for stack in self.stacks:
                stack.launch_vllm(self.model, max_model_len=max(max_model_len_for(self.settings.context_lengths),
                                                                self.settings.trace.get("context_tokens", 0)))
            self._launched = True
        return self

    def run(self) -> PairedResult:
        from kvshrink.testing.derived_stores import store_record

        try:
            self.launch()
            prompt = hot_prompt(self.model, self.settings.hot_prompt_tokens)
            result = PairedResult(
                settings={**vars(self.settings)},
                workload={"model": model_fingerprint(self.model), "engine": ENGINE_LABEL, "hot_prompt": digest(prompt)},
                store_config=store_record(self.template))
            self.progress("starting vLLM")
            for stack in self.stacks:
                stack.wait_ready()
            result.hot = self.hot_path(prompt)
            if self.settings.restart:
                result.restart = self.restart(prompt, result.hot)
            if self.settings.context_lengths:
                result.context = self.context_lengths()
            if self.settings.fractions:
                requests, budgets = self.choose_trace(result)
                started = time.monotonic()
                for budget in budgets if not self.size_only else ():
                    result.replay.append(self.replay(requests, budget, result.workload["replay_l1_headroom_mib"]))
                if result.workload.get("sizing") and result.replay:  # next to predicted_s: how good the sizing was
                    result.workload["sizing"]["replay_s"] = time.monotonic() - started
            return result
        finally:
            self.stop()

    def choose_trace(self, result: PairedResult) -> tuple[list[Any], list[Budget]]:
        """The replay's trace and budgets, recorded in ``result.workload``. With ``time_left`` set
        (by ``kvshrink bench``): this machine's speeds measured first (:meth:`measure_speeds`),
        then the built-in trace sized to fit (:func:`trace_sizing.size_trace`), or a ``--trace``
        file only checked against it; the choice and why are printed (``say``)."""
        from kvshrink.benchmarks import trace_sizing as ts

        s, choice = self.settings, None
        if self.time_left is not None:
            speeds = self.measure_speeds(result)
            budget_s = self.time_left(speeds)
            self.progress("sizing the agent trace")
            if s.trace_file:
                requests = trace_requests(s, self.model)
                choice = ts.check_trace(requests, speeds, len(self.stacks), len(s.fractions), budget_s, s.chunk_tokens)
            else:
                choice = ts.size_trace(s.trace, speeds, len(self.stacks), len(s.fractions), budget_s, s.chunk_tokens)
                requests = trace_requests(s, self.model, choice.trace)
            self.say(f"e2e agent replay: {choice.why}")
            for warning in choice.warnings:
                self.say(f"e2e agent replay: WARNING: {warning}")
        else:
            requests = trace_requests(s, self.model)
        distinct = distinct_chunks(requests, s.chunk_tokens)
        budgets = budgets_for(distinct, s.chunk_tokens, s.fractions, s.dram_share)
        requested = None if s.trace_file else (choice.trace if choice else s.trace)
        result.workload.update(trace_record(requests, s.chunk_tokens, budgets, requested),
                               sizing=choice.as_dict() if choice else None)
        return requests, budgets

    def measure_speeds(self, result: PairedResult) -> Any:
        """This machine's cost of a request, for sizing the replay: cold prefill at the lengths of
        ``settings.sizing_lengths`` that earlier phases did not measure (one request each, on our
        stack, fresh random tokens), and the fixed, load, store and wait costs from the samples
        the earlier phases took."""
        from kvshrink.benchmarks import trace_sizing as ts
        from kvshrink.testing.mp_observe import RESTART_GAP_S

        samples = phase_samples(result)
        have = {n for n, _ in samples["cold"]}
        stores = []
        for n in self.settings.sizing_lengths:
            if any(abs(n - m) <= n // 4 for m in have):
                continue
            self.progress(f"sizing: a cold {n}-token request")
            prompt = np.random.default_rng(n).integers(1000, 40000, n).tolist()
            started = time.monotonic()
            x = self.ours.request(prompt, max_tokens=self.settings.max_tokens)
            self.ours.wait_idle()
            stores.append((n, time.monotonic() - started - x.ttft_s - x.neighbour_wait_s))
            samples["cold"].append((n, x.ttft_s))
        throwaway = ts.Speeds(tuple(samples["cold"]), samples["fixed_s"]).cold_s(self.settings.chunk_tokens)
        return ts.Speeds(cold=tuple(sorted(samples["cold"])), fixed_s=samples["fixed_s"],
                         load_s_per_token=samples["load_s_per_token"],
                         store_s_per_token=max(0.0, statistics.median(t / n for n, t in stores)) if stores else 0.0,
                         overhead_s=samples["wait_s"],
                         per_budget_s=2 * RESTART_GAP_S + 10.0 + len(self.stacks) * (throwaway + 1.0))

    def stop(self) -> None:
        for stack in self.stacks:
            stack.close()
        for stack in self.stacks:  # chunk files: hundreds of MB; the logs stay
            shutil.rmtree(stack.workdir, ignore_errors=True)

    # -- phases ----------------------------------------------------------------------------------
    def _pair(self) -> list[Stack]:
        """The hot-path pair: stock's first arrangement (in its hot configuration) and ours."""
        return [self.stacks[0], self.ours]

    def hot_path(self, prompt: list[int]) -> dict[str, Any]:
        chunk = self.settings.chunk_tokens
        stock, ours = pair = self._pair()
        samples: dict[str, dict[str, list[Sample]]] = {"cold": {}, "warm_l1": {}, "warm_l2": {}}
        for s in pair:
            samples["cold"][s.key] = [s.request(prompt)]
            s.wait_idle()
        for label, clear in (("warm_l1", False), ("warm_l2", True)):
            for step in range(self.settings.hot_pairs):
                self.progress(f"hot path: {label} {step + 1}/{self.settings.hot_pairs}")
                for s in rotated(pair, step):
                    if clear:
                        s.clear_l1()
                    samples[label].setdefault(s.key, []).append(s.request(prompt))
                    s.wait_idle()
        from kvshrink.benchmarks.paired_stats import paired_ratio

        out: dict[str, Any] = {"prompt_tokens": len(prompt), "pairs": self.settings.hot_pairs,
                               "stock": stock.key, "policies": {s.key: vars(s.arrangement.policy) for s in pair}}
        for label, target in (("warm_l1", HOT_TARGET_L1), ("warm_l2", HOT_TARGET_L2)):
            o = [x.ttft_s for x in samples[label][ours.key]]
            st = [x.ttft_s for x in samples[label][stock.key]]
            r = paired_ratio(o, st).as_dict()
            out[label] = {"ratio": r, "target": target, "verdict": verdict({"low": r["low"], "high": r["high"]}, target),
                          "stock_median_s": statistics.median(st), "ours_median_s": statistics.median(o)}
        out["samples"] = {label: {k: [vars(x) for x in v] for k, v in by.items()} for label, by in samples.items()}
        out["hits_as_expected"] = _hot_hits_ok(samples, len(prompt), chunk)
        return out

    def context_lengths(self) -> dict[str, Any]:
        """TTFT by context length on the hot pair, cold and warm from every tier
        (:mod:`~kvshrink.benchmarks.context_ttft`); leaves the pair on its own arrangement."""
        from kvshrink.benchmarks import context_ttft as ct

        settings = ct.ContextSettings(lengths=tuple(self.settings.context_lengths),
                                      budget_s=self.settings.context_budget_s, chunk_tokens=self.settings.chunk_tokens)
        return ct.ContextTTFT(*self._pair(), self.model, settings, self.template, self.progress).run()

    def restart(self, prompt: list[int], hot: dict[str, Any]) -> dict[str, Any]:
        """Both cache servers restarted (ours without its DRAM arena), the hot prompt again."""
        self.progress("restart")
        pair = self._pair()
        reconfigure(pair, [s.arrangement for s in pair], wipe=False)  # keeps the SSD / files, not our DRAM arena
        after = {}
        for s in pair:
            after[s.key] = s.request(prompt)
            s.wait_idle()
        cold = {key: xs[0] for key, xs in hot["samples"]["cold"].items()}
        return {"prompt_tokens": len(prompt),
                "sides": {s.key: {"cold_ttft_s": cold[s.key]["ttft_s"], "after_restart": vars(after[s.key]),
                                  "over_cold": after[s.key].ttft_s / cold[s.key]["ttft_s"]} for s in pair}}

    def replay(self, requests: Sequence[Any], budget: Budget, headroom_mib: float) -> dict[str, Any]:
        reconfigure(self.stacks, [replay_arrangement(s.key, budget, headroom_mib, s.workdir, s.shm_name, self.template)
                                  for s in self.stacks])
        samples: dict[str, list[Sample]] = {s.key: [] for s in self.stacks}
        need = largest_request_bytes(requests)
        for i, r in enumerate(requests):
            self.progress(f"agent replay {budget.label()}: {i + 1}/{len(requests)}")
            prompt = [int(t) for t in r.token_ids]
            for s in rotated(self.stacks, i):
                s.wait_l1_room(need)
                samples[s.key].append(s.request(prompt, max_tokens=self.settings.max_tokens))
                s.wait_idle()
        held = {s.key: s.held() for s in self.stacks}
        figures = {k: {**side_figures(v), "held_bytes": held[k]["bytes"], "held_chunks": held[k]["chunks"]}
                   for k, v in samples.items()}
        for s in self.stacks:  # a dropped store would bias the comparison: say so next to the figures
            figures[s.key]["l1_allocation_failures"] = float(s.allocation_failures())
        stock_keys = [s.key for s in self.stacks if s.side == STOCK]
        best = min(stock_keys, key=lambda k: (figures[k]["prefill_s"], -figures[k]["hit_rate"]))
        ours = self.ours.key
        prefill = ratio_of_sums([x.ttft_s for x in samples[ours]], [x.ttft_s for x in samples[best]])
        points = difference_of_rates([x.hit_tokens for x in samples[ours]], [x.hit_tokens for x in samples[best]],
                                     [x.prompt_tokens for x in samples[ours]])
        return {"budget": vars(budget), "label": budget.label(), "l1_headroom_mib": headroom_mib, "stock_best": best,
                "figures": figures,
                "policies": {s.key: vars(s.arrangement.policy) for s in self.stacks},
                "prefill_ratio": {**prefill, "target": REPLAY_PREFILL_TARGET,
                                  "verdict": verdict(prefill, REPLAY_PREFILL_TARGET)},
                "hit_rate_points": {**points, "target": REPLAY_HIT_POINTS_TARGET,
                                    "verdict": verdict(points, REPLAY_HIT_POINTS_TARGET, higher_is_better=True)},
                "same_text": _agreement(samples, ours, best),
                "samples": {k: [vars(x) for x in v] for k, v in samples.items()}}


def _hot_hits_ok(samples: dict[str, dict[str, list[Sample]]], prompt_tokens: int, chunk: int) -> dict[str, bool]:
    cached = prompt_tokens // chunk * chunk
    out = {}
    for label, by in samples.items():
        for key, xs in by.items():
            if label == "cold":
                ok = all(x.hit_tokens == 0 for x in xs)
            elif label == "warm_l1":
                ok = all(x.l1_hit_tokens >= cached - chunk for x in xs)
            else:
                ok = all(x.l2_hit_tokens >= cached - chunk for x in xs)
            out[f"{label}/{key}"] = ok
    return out


def equal_hits_ttft(replay: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """TTFT ours / stock at its best on the replay's requests where both hit the same tokens, every
    budget pooled: what the adapter costs where it wins nothing (the median of the paired ratios,
    95 % interval, verdict against :data:`EQUAL_HITS_TTFT_TARGET`). None without such requests."""
    from kvshrink.benchmarks.paired_stats import paired_ratio

    ours, stock = [], []
    for entry in replay:
        for o, s in zip(entry["samples"]["ours"], entry["samples"][entry["stock_best"]]):
            if o["hit_tokens"] == s["hit_tokens"]:
                ours.append(o["ttft_s"])
                stock.append(s["ttft_s"])
    if not ours:
        return None
    ratio = paired_ratio(ours, stock)
    interval = {"value": ratio.median, "low": ratio.low, "high": ratio.high, "pairs": ratio.pairs}
    return {**interval, "target": EQUAL_HITS_TTFT_TARGET, "verdict": verdict(interval, EQUAL_HITS_TTFT_TARGET)}


def _agreement(samples: dict[str, list[Sample]], ours: str, stock: str) -> dict[str, int]:
    """Requests where ours and stock hit the same tokens, and how many of them got the same answer."""
    same_hits = [(o, s) for o, s in zip(samples[ours], samples[stock]) if o.hit_tokens == s.hit_tokens]
    return {"same_hits": len(same_hits), "same_text": sum(o.text == s.text for o, s in same_hits)}


def side_runs(result: PairedResult) -> Iterator[tuple[str, SideRun, SideRun]]:
    """(case, stock-at-best, ours) per replay budget, as comparable side runs."""
    for entry in result.replay:
        budget = {**entry["budget"], "l1_headroom_mib": entry["l1_headroom_mib"],
                  "chunk_tokens": result.settings["chunk_tokens"]}
        workload = Workload(result.workload["trace"], result.workload["model"], budget)
        best = entry["stock_best"]
        stock = SideRun(STOCK, workload, entry["figures"][best], {"variant": best}, TierPolicy(**entry["policies"][best]))
        ours = SideRun(OURS, workload, entry["figures"]["ours"], {"store_config": result.store_config},
                       TierPolicy(**entry["policies"]["ours"]))
        yield entry["label"], stock, ours
