"""``python experiments/fuse_ttft.py``: TTFT of KV Fuse against stock LMCache on RAG prompts
whose documents were all seen before, in another order (issue 15: TTFT <= 0.4x stock's).

Why it is measured this way: stock LMCache reuses only a prompt's exact prefix, so documents seen
before at other offsets are prefilled again; KV Fuse re-rotates their stored chunks and recomputes
a fraction on the cache server. Only the request a user sends, timed to its first streamed token
through vLLM's OpenAI API, says what that is worth.

Two stacks, like for like: the same vLLM CPU (``e2e_paired.ENGINE_ARGS``, SmolLM2-135M-Instruct
bf16, vLLM's prefix cache off, one OpenMP thread) attached to its own ``lmcache server``, both
with the same LMCache L1 (``--l1-gb``, large enough to hold every chunk of the run, so nothing is
evicted and stock is at its best: every chunk it could reuse is in its L1):

* **stock**: ``lmcache server`` with no L2 adapter (the L1 holds everything); requests carry no
  ``cache_salt``, the salt its seeds were stored under, so its lookups find every prefix they can.
* **ours**: ``kvshrink cache serve`` (the real command) with the shipped default store
  (``kvshrink.testing.derived_stores.derive_store``: moved to this run's folder and /dev/shm
  name, DRAM tier resized) and ``fuse.enabled: true`` + the model path, every other fuse setting as shipped;
  requests carry the fused salt (:func:`kvshrink.fuse.keys.fused_salt`, ``kvfuse1-r0150-c1``),
  seeds too (a tenant that opts in sends it always).

Prompts (token ids, identical on both stacks): a 256-token system prefix (the chat template's
system turn: a short instruction plus reference notes of real prose, cut to exactly one chunk),
``--per-request`` documents of exactly ``--doc-tokens`` tokens (a multiple of LMCache's 256-token
chunk, so every chunk of a document is reusable; real prose of the Python reference with one
made-up fact at its start), then a question about one of them and the assistant header. The pool of
``--pool`` documents is split into seed requests that show each document once; each measured
request then shows ``--per-request`` documents of the pool in a new combination whose first
document was never first before, so stock's only reuse is the system prefix and ours can reuse every
document chunk at its new offset. Every seed runs on both stacks (not timed); then each measured
prompt runs on both, back to back, the order alternating pair by pair, each stack's stores done
(``/status``) and a 1 s pause before every request.

Reported: per-pair TTFTs; the median of per-pair ratios ours / stock with a 95 % bootstrap interval
(``paired_stats``; verdict against 0.4 only where the interval clears it); LMCache's lookup hit
tokens (``/metrics``) and vLLM's prompt tokens per side; our module's counters per request
(``/status`` ``kvshrink_fuse``: fusions, reused chunks, recomputed tokens); whether our greedy
answer equals stock's (fused KV is approximate, answers may differ: reported, not hidden) and
whether each contains the planted fact. Both sides' configurations and the machine (CPU flags,
load average before and after) are in the JSON.

Size: the default (12 documents of 512 tokens, 3 a request, ~1.8K-token prompts, 4 seeds, 8 pairs)
takes ~21 minutes on 2 AVX2 cores (a cold prefill ~30 ms a token: ~55 s a stock request);
``--quick`` (4 documents of 256 tokens, 2 a request, 2 pairs) ~6.

    python experiments/fuse_ttft.py --out /tmp/fuse-ttft [--quick]
    python experiments/fuse_ttft.py --markdown-from /tmp/fuse-ttft/fuse-ttft.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from cascade_bench import FIRST, LAST, PLACES, SYSTEM, TEMPLATES, judge
from kvshrink.benchmarks.e2e_paired import ENGINE_ARGS, ENGINE_LABEL, E2EError, stores_idle, wait_stores_settled
from kvshrink.benchmarks.paired_stats import paired_ratio, ratio_of_sums, verdict

TTFT_TARGET = 0.4  # ours / stock on reordered prompts (issue 15)
MODEL = "smollm2"
CHUNK = 256  # LMCache's chunk (`cache serve`'s and LMCacheServer's default)
STOCK, OURS = "stock", "ours"
SIDES = (STOCK, OURS)
HEADER_TOKENS = CHUNK  # the system prefix: one chunk, the reuse stock has
NOTES = "\n\nReference notes:\n"


@dataclass(frozen=True)
class FuseTTFTSettings:
    pool: int = 12  # documents; seeds show each once
    per_request: int = 3  # documents a request (the pool is a multiple of it)
    doc_tokens: int = 512  # each document exactly (a multiple of CHUNK)
    pairs: int = 8  # measured requests a stack (at most pool - pool / per_request: new first documents)
    max_tokens: int = 8
    l1_gb: float = 0.75  # LMCache's L1 on both stacks: every chunk of the run (~80 a side, 5.6 MiB each) fits
    dram_mib: int = 1024  # our store's DRAM tier (the shipped 4 GiB, smaller beside two vLLMs)
    seed: int = 15

    def quick(self) -> "FuseTTFTSettings":
        return replace(self, pool=4, per_request=2, doc_tokens=256, pairs=2)

    def check(self) -> None:
        if self.doc_tokens % CHUNK or self.doc_tokens <= 0:
            raise ValueError(f"doc_tokens must be a positive multiple of {CHUNK}, got {self.doc_tokens}")
        if self.pool % self.per_request or self.per_request < 2:
            raise ValueError(f"pool ({self.pool}) must be a multiple of per_request ({self.per_request}) >= 2")
        firsts = self.pool - self.pool // self.per_request
        if not 1 <= self.pairs <= firsts:
            raise ValueError(f"pairs must be 1..{firsts} (pool documents never first in a seed), got {self.pairs}")


# -- the workload ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    header: list[int]  # exactly HEADER_TOKENS
    documents: list[list[int]]  # exactly doc_tokens each
    facts: list[tuple[str, str]]  # (question, answer) per document
    tail: list[int]  # end of the user turn + assistant header
    question_prefix: list[int]  # "\n\nQuestion: "
    seeds: list[tuple[int, ...]]
    measured: list[tuple[tuple[int, ...], int]]  # (documents in order, the document asked about)

    def prompt(self, docs: Sequence[int], asked: int, tokenizer: Any) -> list[int]:
        question = tokenizer(self.facts[asked][0], add_special_tokens=False).input_ids
        return [*self.header, *(t for d in docs for t in self.documents[d]), *self.question_prefix, *question,
                *self.tail]


def plan(settings: FuseTTFTSettings) -> tuple[list[tuple[int, ...]], list[tuple[tuple[int, ...], int]]]:
    """Seed requests (consecutive groups: each document once) and measured ones: a new first
    document each (never first before), the rest drawn from the pool, seeded; the fact asked about
    is of one of the request's documents."""
    s, rng = settings, random.Random(settings.seed)
    seeds = [tuple(range(g, g + s.per_request)) for g in range(0, s.pool, s.per_request)]
    firsts = [d for d in range(s.pool) if d % s.per_request]
    rng.shuffle(firsts)
    measured = []
    for first in firsts[:s.pairs]:
        docs = (first, *rng.sample([d for d in range(s.pool) if d != first], s.per_request - 1))
        measured.append((docs, rng.choice(docs)))
    return seeds, measured


def build_workload(tokenizer: Any, settings: FuseTTFTSettings) -> Workload:
    from kvshrink.testing.fixtures.real_kv import corpus_text

    s, rng = settings, random.Random(settings.seed)
    blocks = [b.strip() for b in corpus_text("prose").split("\n\n") if 200 < len(b.strip()) < 1000]
    marks = ("\u2063SYS\u2063", "\u2063USER\u2063")
    text = tokenizer.apply_chat_template([{"role": "system", "content": marks[0]},
                                          {"role": "user", "content": marks[1]}],
                                         add_generation_prompt=True, tokenize=False)
    before, rest = text.split(marks[0])
    between, after = rest.split(marks[1])
    ids = lambda t: tokenizer(t, add_special_tokens=False).input_ids  # noqa: E731
    head, mid = ids(before), ids(between)
    notes = ids(SYSTEM + NOTES + "\n\n".join(blocks[-12:]))
    room = HEADER_TOKENS - len(head) - len(mid)
    if len(notes) < room:
        raise E2EError(f"reference notes of {len(notes)} tokens cannot fill a {HEADER_TOKENS}-token system prefix")
    header = head + notes[:room] + mid
    docs, facts, cursor, values = [], [], 40, set()
    for d in range(s.pool):
        fact, question, answer = TEMPLATES[d % len(TEMPLATES)]
        while True:  # an answer of its own
            v = {"p": rng.choice(FIRST), "q": rng.choice(LAST), "a": PLACES[d % len(PLACES)],
                 "year": str(rng.randint(1890, 2019)), "n3": str(rng.randint(120, 980)),
                 "n4": str(rng.randint(1000, 9999))}
            if answer.format(**v) not in values:
                break
        values.add(answer.format(**v))
        paragraphs: list[str] = []
        while len(ids("\n\n".join(paragraphs))) < s.doc_tokens + 64:
            paragraphs.append(blocks[cursor % len(blocks)])
            cursor += 1
        cursor += 17
        doc = ids(f"Document: {fact.format(**v)}\n\n" + "\n\n".join(paragraphs))[:s.doc_tokens]
        docs.append(doc)
        facts.append((question.format(**v), answer.format(**v)))
    seeds, measured = plan(s)
    return Workload(header, docs, facts, ids(after), ids("\n\nQuestion: "), seeds, measured)


# -- the stacks --------------------------------------------------------------------------------------
def stream(base_url: str, prompt: list[int], salt: str | None, max_tokens: int,
           timeout: float = 900.0) -> dict[str, Any]:
    """One streamed greedy completion, with ``cache_salt`` when given: text, TTFT to the first
    streamed token, the prompt tokens vLLM counted."""
    from kvshrink.testing.streaming_client import StreamedCompletionError, stream_completion

    try:
        done = stream_completion(base_url, MODEL, prompt, max_tokens=max_tokens, timeout=timeout,
                                 extra={"cache_salt": salt} if salt is not None else None)
    except StreamedCompletionError as exc:
        raise E2EError(str(exc)) from exc
    return {"text": done.text, "ttft_s": done.ttft_s, "total_s": done.total_s,
            "prompt_tokens": int(done.usage.get("prompt_tokens", len(prompt)))}


class Stack:
    """One ``lmcache server`` (stock's directly, ours through ``kvshrink cache serve``) and its vLLM."""

    def __init__(self, side: str, settings: FuseTTFTSettings, workdir: Path, model: Path) -> None:
        from kvshrink.fuse.keys import FuseSettings, fused_salt

        self.side, self.settings, self.workdir, self.model = side, settings, workdir, model
        self.salt = fused_salt(FuseSettings()) if side == OURS else None
        self.shm_name = f"kvshrink-fuse-ttft-{uuid.uuid4().hex[:10]}"
        self.server: Any = None
        self.vllm: Any = None
        self.http_url = ""
        self.config: dict[str, Any] = {}

    def launch(self, max_model_len: int) -> None:
        """Cache server and vLLM, without waiting (both stacks start at once)."""
        from kvshrink.testing.launch import LMCacheServer, VLLMServer
        from kvshrink.testing.processes import LOOPBACK, ManagedProcess, free_port
        from kvshrink.testing.mp_observe import HEARTBEAT_S

        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        if self.side == STOCK:
            self.server = LMCacheServer(l1_size_gb=self.settings.l1_gb, chunk_size=CHUNK,
                                        log_path=logs / "lmcache-stock.log", env={"LMCACHE_LOG_LEVEL": "INFO"})
            self.server.launch()
            port, self.http_url = self.server.port, self.server.http_url
            self.config = {"command": self.server.argv[1:], "l2_adapters": [],
                           "l1_gb": self.settings.l1_gb, "cache_salt": None}
        else:
            import yaml

            port, http_port = free_port(), free_port()
            store = self.store()
            config = {"server": {"host": "localhost", "port": port, "http_host": LOOPBACK, "http_port": http_port,
                                 "prometheus_port": free_port(), "l1_size_gb": self.settings.l1_gb,
                                 "chunk_size": CHUNK},
                      "store": store}
            path = self.workdir / "serve-cache.yaml"
            path.write_text(yaml.safe_dump(config, sort_keys=False))
            self.server = ManagedProcess([sys.executable, "-m", "kvshrink.cli", "cache", "serve", "--config", str(path),
                                          "--log-file", str(logs / "lmcache-ours.log"), "--ready-timeout", "900"],
                                         env={"LMCACHE_LOG_LEVEL": "INFO"}, log_path=logs / "serve-cache.log").start()
            self.http_url = f"http://{LOOPBACK}:{http_port}"
            self.config = {"command": ["kvshrink", "cache", "serve", "--config", str(path)], "serve_cache": config,
                           "cache_salt": self.salt}
        transfer = {"kv_connector": "LMCacheMPConnector",
                    "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": port,
                                                  "lmcache.mp.heartbeat_interval": HEARTBEAT_S}}
        self.vllm = VLLMServer(self.model, kv_transfer_config=transfer, served_model_name=MODEL, extra_args=ENGINE_ARGS,
                               max_model_len=max_model_len, kv_cache_space_gb=1,
                               log_path=logs / f"vllm-{self.side}.log")
        self.vllm.launch()
        self.config["vllm"] = self.vllm.argv[1:]

    def store(self) -> dict[str, Any]:
        """The shipped default store, moved here and its DRAM tier resized; fusion on."""
        from kvshrink.testing.derived_stores import derive_store

        (self.workdir / "ssd").mkdir(parents=True, exist_ok=True)
        store = derive_store(paths={"ssd": self.workdir / "ssd"}, shm_names={"dram": self.shm_name},
                             capacities={"dram": self.settings.dram_mib << 20})
        store["fuse"] = {**store.get("fuse", {}), "enabled": True, "model_path": str(self.model)}
        return store

    def wait_ready(self, timeout: float = 900.0) -> None:
        from kvshrink.testing.processes import _http_ok
        from kvshrink.testing.mp_observe import wait_for_engine

        self.server.wait_until(lambda: _http_ok(f"{self.http_url}/healthcheck"), timeout, "healthy")
        self.vllm.wait_serving(timeout)
        wait_for_engine(self.http_url)

    def status(self) -> dict[str, Any]:
        import httpx

        return httpx.get(f"{self.http_url}/status", timeout=10.0).json()

    def fuse_counters(self) -> dict[str, int]:
        if self.side != OURS:
            return {}
        return {k: v for k, v in self.status().get("kvshrink_fuse", {}).items() if isinstance(v, int)}

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Until no store is in flight in LMCache and, for ours, the store's queues are empty."""
        wait_stores_settled(lambda: stores_idle(self.status(), self.side == OURS), timeout, self.side)

    def request(self, prompt: list[int]) -> dict[str, Any]:
        """One streamed request after a 1 s pause; TTFT, LMCache's hit tokens, our module's counter deltas."""
        from kvshrink.testing.mp_observe import cache_counters

        self.wait_idle()
        time.sleep(1.0)
        counters, fuse = cache_counters(self.http_url), self.fuse_counters()
        out = stream(self.vllm.url, prompt, self.salt, self.settings.max_tokens)
        self.wait_idle()
        after = self.fuse_counters()
        delta = {k: v - fuse.get(k, 0) for k, v in after.items() if v - fuse.get(k, 0)}
        return {"side": self.side, **out, "hit_tokens": int((cache_counters(self.http_url) - counters).hit_tokens),
                "fuse": delta}

    def close(self) -> None:
        from kvshrink.store.dram import SHM_DIR

        for proc in (self.vllm, self.server):
            if proc is not None:
                proc.stop()
        (SHM_DIR / self.shm_name).unlink(missing_ok=True)


# -- the run -----------------------------------------------------------------------------------------
def run(model: Path, settings: FuseTTFTSettings, out: Path, progress: Callable[[str], None] = print) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from kvshrink.benchmarks.suite_sections import loadavg, machine

    settings.check()
    started, host = time.perf_counter(), machine()
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    work = build_workload(tokenizer, settings)
    longest = len(work.header) + settings.per_request * settings.doc_tokens + 128
    stacks = {side: Stack(side, settings, out / side, model) for side in SIDES}
    seeds, samples, error, l1, fuse_final = [], [], None, {}, {}
    try:
        for stack in stacks.values():
            stack.launch(max(4096, longest + settings.max_tokens))
        for stack in stacks.values():
            stack.wait_ready()
        progress(f"both stacks serving after {time.perf_counter() - started:.0f} s")
        for i, docs in enumerate(work.seeds):
            prompt = work.prompt(docs, docs[0], tokenizer)
            for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                sample = {"seed": i, "documents": list(docs), **stacks[side].request(prompt)}
                seeds.append(sample)
                progress(f"seed {i + 1}/{len(work.seeds)} {side}: TTFT {sample['ttft_s']:.2f} s (not timed), "
                         f"{sample['prompt_tokens']} prompt tokens, {sample['hit_tokens']} hit")
        for i, (docs, asked) in enumerate(work.measured):
            prompt = work.prompt(docs, asked, tokenizer)
            for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                sample = {"pair": i, "documents": list(docs), "expected": work.facts[asked][1],
                          **stacks[side].request(prompt)}
                sample["match"] = judge(sample["text"], sample["expected"])[1]
                samples.append(sample)
                fused = sample["fuse"].get("reused_chunks", 0)
                progress(f"pair {i + 1}/{settings.pairs} {side}: TTFT {sample['ttft_s']:.2f} s, "
                         f"{sample['prompt_tokens']} prompt tokens, {sample['hit_tokens']} hit"
                         + (f", {fused} chunks reused" if side == OURS else ""))
        fuse_final = stacks[OURS].status().get("kvshrink_fuse", {})
        l1 = {side: {k: v for k, v in stack.status()["storage_manager"]["l1_manager"].items()
                     if isinstance(v, (int, float))} for side, stack in stacks.items()}
    except Exception as exc:  # noqa: BLE001 - a stack died mid-run: report the pairs done, and why
        error = f"{type(exc).__name__}: {exc}"
        progress(f"stopped: {error}")
    finally:
        for stack in stacks.values():
            stack.close()
    done = {x["pair"] for x in samples if x["side"] == OURS} & {x["pair"] for x in samples if x["side"] == STOCK}
    samples = [x for x in samples if x["pair"] in done]
    if not samples:
        raise E2EError(f"fuse_ttft: no complete pair ({error})")
    return {"settings": asdict(settings), "machine": {**host, "loadavg_after": loadavg()}, "engine": ENGINE_LABEL,
            "stacks": {side: stack.config for side, stack in stacks.items()},
            "workload": {"header_tokens": len(work.header), "document_tokens": settings.doc_tokens,
                         "seeds": [list(d) for d in work.seeds],
                         "measured": [{"documents": list(d), "asked": a} for d, a in work.measured],
                         "prompt_tokens": [len(work.prompt(d, a, tokenizer)) for d, a in work.measured]},
            "target": TTFT_TARGET, "error": error, "seeds": seeds, "samples": samples, "fuse_status": fuse_final,
            "l1_at_end": l1,
            "figures": figures(samples, seeds, settings.doc_tokens // CHUNK * settings.per_request),
            "wall_s": time.perf_counter() - started}


def figures(samples: Sequence[dict[str, Any]], seeds: Sequence[dict[str, Any]], document_chunks: int) -> dict[str, Any]:
    """Every figure of a run from its samples (pure: the fast test calls it on made-up samples).
    ``document_chunks``: the document chunks of one measured prompt (what ours can reuse)."""
    by = {side: sorted((x for x in samples if x["side"] == side), key=lambda x: x["pair"]) for side in SIDES}
    if [x["pair"] for x in by[STOCK]] != [x["pair"] for x in by[OURS]] or not by[STOCK]:
        raise E2EError("fuse_ttft: samples are not complete pairs")
    ours, stock = by[OURS], by[STOCK]
    r = paired_ratio([x["ttft_s"] for x in ours], [x["ttft_s"] for x in stock]).as_dict()
    agree = sum(o["text"] == s["text"] for o, s in zip(ours, stock))
    seed_pairs = [(a, b) for a in seeds for b in seeds if a["seed"] == b["seed"] and a["side"] == STOCK != b["side"]]
    fused = [o["fuse"].get("fusions", 0) == 1 for o in ours]
    return {"pairs": len(ours),
            "ttft_s": {side: {"median": statistics.median(x["ttft_s"] for x in by[side]),
                              "min": min(x["ttft_s"] for x in by[side]), "max": max(x["ttft_s"] for x in by[side]),
                              "per_pair": [round(x["ttft_s"], 3) for x in by[side]]} for side in SIDES},
            "ours_over_stock": {**r, "target": TTFT_TARGET, "verdict": verdict(r, TTFT_TARGET)},
            "sum_ours_over_stock": ratio_of_sums([x["ttft_s"] for x in ours], [x["ttft_s"] for x in stock]),
            "prompt_tokens": {side: statistics.mean(x["prompt_tokens"] for x in by[side]) for side in SIDES},
            "hit_tokens": {side: statistics.mean(x["hit_tokens"] for x in by[side]) for side in SIDES},
            "fused_requests": sum(fused),
            "reused_chunks": sum(o["fuse"].get("reused_chunks", 0) for o in ours),
            "reusable_chunks": document_chunks * len(ours),
            "recomputed_tokens": sum(o["fuse"].get("recomputed_tokens", 0) for o in ours),
            "gap_tokens": sum(o["fuse"].get("gap_tokens", 0) for o in ours),
            "fallbacks": sum(v for o in ours for k, v in o["fuse"].items() if k.startswith("fallback")),
            "answers_agree": agree, "answers_agree_fraction": agree / len(ours),
            "seed_answers_agree": sum(a["text"] == b["text"] for a, b in seed_pairs), "seed_pairs": len(seed_pairs),
            "matches": {side: sum(bool(x.get("match")) for x in by[side]) for side in SIDES}}


def report_lines(result: dict[str, Any]) -> list[str]:
    f, s, m = result["figures"], result["settings"], result["machine"]
    r, t = f["ours_over_stock"], f["ttft_s"]
    lines = [f"KV Fuse vs stock LMCache, reordered RAG prompts: {s['per_request']} of {s['pool']} documents of "
             f"{s['doc_tokens']} tokens a request, {f['prompt_tokens'][STOCK]:.0f} prompt tokens, {f['pairs']} pairs",
             f"  TTFT ours / stock: {r['median']:.3f} (95 % {r['low']:.3f}-{r['high']:.3f}; target <= "
             f"{r['target']:g}) {r['verdict']}; sums {f['sum_ours_over_stock']['value']:.3f}",
             f"  TTFT median ours {t[OURS]['median']:.2f} s ({t[OURS]['min']:.2f}-{t[OURS]['max']:.2f}), stock "
             f"{t[STOCK]['median']:.2f} s ({t[STOCK]['min']:.2f}-{t[STOCK]['max']:.2f})",
             f"  per pair ours {t[OURS]['per_pair']}", f"  per pair stock {t[STOCK]['per_pair']}",
             f"  hit tokens per request: ours {f['hit_tokens'][OURS]:.0f}, stock {f['hit_tokens'][STOCK]:.0f}; fused "
             f"{f['fused_requests']}/{f['pairs']} requests, reused {f['reused_chunks']}/{f['reusable_chunks']} "
             "document "
             f"chunks, {f['recomputed_tokens']} tokens recomputed, {f['gap_tokens']} gap tokens, "
             f"{f['fallbacks']} fallbacks",
             f"  greedy answers equal to stock's: {f['answers_agree']}/{f['pairs']} (seeds, both full prefills: "
             f"{f['seed_answers_agree']}/{f['seed_pairs']}); planted fact in the answer: ours {f['matches'][OURS]}, "
             f"stock {f['matches'][STOCK]}",
             f"  machine: {m.get('cpus')} CPUs, {m.get('cpu_model')}, flags {','.join(m.get('cpu_flags', []))}; load "
             f"{m.get('loadavg_before')} -> {m.get('loadavg_after')}; {result['wall_s']:.0f} s"]
    if result.get("error"):
        lines.append(f"  stopped early after {f['pairs']} of {s['pairs']} pairs: {result['error']}")
    return lines


def markdown_table(result: dict[str, Any]) -> str:
    f, s = result["figures"], result["settings"]
    r, t = f["ours_over_stock"], f["ttft_s"]
    return "\n".join([
        "| stack | TTFT (median) | vs stock, 95 % | target | verdict | hit tokens | answers = stock's |",
        "|---|---:|---:|---:|---|---:|---:|",
        f"| stock LMCache (prefix reuse) | {t[STOCK]['median']:.2f} s | | | | {f['hit_tokens'][STOCK]:.0f} | |",
        f"| KV Fuse (`kvshrink cache serve`, fuse on) | {t[OURS]['median']:.2f} s | {r['median']:.3f} "
        f"({r['low']:.3f}-{r['high']:.3f}) | <= {r['target']:g} | {r['verdict']} | {f['hit_tokens'][OURS]:.0f} | "
        f"{f['answers_agree']}/{f['pairs']} |",
        "",
        f"{f['pairs']} pairs of {f['prompt_tokens'][STOCK]:.0f}-token prompts ({s['per_request']} documents of "
        f"{s['doc_tokens']} tokens, all seen before in another order); {f['reused_chunks']}/{f['reusable_chunks']} "
        f"document chunks reused; {result['engine']}."])


def main(argv: Sequence[str] | None = None) -> int:
    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    d = FuseTTFTSettings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for fuse-ttft.json and the logs")
    parser.add_argument("--quick", action="store_true", help="4 documents of 256 tokens, 2 a request, 2 pairs (~6 min)")
    parser.add_argument("--pool", type=int, default=d.pool, help="documents in the pool")
    parser.add_argument("--per-request", type=int, default=d.per_request, help="documents a request")
    parser.add_argument("--doc-tokens", type=int, default=d.doc_tokens,
                        help=f"tokens a document (a multiple of {CHUNK})")
    parser.add_argument("--pairs", type=int, default=d.pairs, help="measured requests a stack")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--l1-gb", type=float, default=d.l1_gb, help="LMCache's L1 on both stacks")
    parser.add_argument("--markdown-from", type=Path, default=None, metavar="JSON",
                        help="do not run: print the table of an earlier run's fuse-ttft.json")
    args = parser.parse_args(argv)
    if args.markdown_from is not None:
        print(markdown_table(json.loads(args.markdown_from.read_text())))
        return 0
    settings = FuseTTFTSettings(args.pool, args.per_request, args.doc_tokens, args.pairs, args.max_tokens, args.l1_gb)
    settings = settings.quick() if args.quick else settings
    out = args.out or Path(tempfile.mkdtemp(prefix="kvshrink-fuse-ttft-"))
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()

    def progress(line: str) -> None:
        print(f"[{time.monotonic() - began:6.0f} s, load {os.getloadavg()[0]:.1f}] {line}", flush=True)

    result = run(ensure_checkpoint(), settings, out, progress)
    (out / "fuse-ttft.json").write_text(json.dumps(result, indent=1))
    print("\n".join(report_lines(result)))
    print(f"\n{out / 'fuse-ttft.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
