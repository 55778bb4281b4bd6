"""``python experiments/cascade_ttft.py``: what the KV Cascade proxy saves a real vLLM --
TTFT, main-model prompt tokens and KV bytes -- against the same request sent to vLLM directly with
the full documents, and the main / small model size ratio at which it breaks even on compute.

Why it is measured this way: the cascade pays the small model's scoring pass to save main-model
prefill, so only the request a user sends, timed to its first streamed token, says whether it pays.

The stack: one vLLM CPU server (SmolLM2-135M-Instruct in bf16, ``e2e_paired.ENGINE_ARGS``, vLLM's
prefix cache off, so every request prefills its whole prompt) and ``kvshrink cascade serve``
(the real command, its own process, the same SmolLM2 as the small model, on one torch thread as
vLLM's model runs on one OpenMP thread here) in front of it. Requests
are streamed ``/v1/completions`` (``kvshrink.testing.streaming_client``, TTFT = the first streamed
token, as in every e2e benchmark of the project): the chat template of cascade_bench's RAG prompt
(its SYSTEM line, "Document i:" blocks, then the question) rendered to text, each document between
the proxy's ``<doc>`` markers. The direct request is that prompt with the markers removed, which is
exactly what the proxy sends upstream at ratio 1: same vLLM, same model, same documents, same
question, greedy, the same ``max_tokens``.

The documents come from cascade_bench's set builder (real prose with made-up facts; each step asks
for one fact of its own documents). After an untimed warm-up of all three kinds on short
documents, each step has **fresh documents** (never seen by the proxy: its cache is not cleared, it
has never held them) and sends three requests, the order rotating: ``direct`` (vLLM, full
documents), ``uncached`` (the proxy, condensing the documents: the first time it sees them) and
``cached`` (the proxy again, the condensations from its cache), ``uncached`` always before
``cached``. The proxy's own ``/metrics``
around each request must show it: every document a miss on ``uncached``, a memory hit on ``cached``
(else the run stops). TTFT ratios are medians of per-step paired ratios with 95 % bootstrap
intervals (``paired_stats``); the target (cached / direct <= 0.6 at ratio 0.5) is called met or
not met only where the interval clears it.

Also reported: main-model prompt tokens (vLLM's own usage count) and KV bytes per request (prompt
tokens x ``e2e_paired.BYTES_PER_TOKEN``, SmolLM2 bf16), and the **break-even size ratio**. Small
and main model are one model here, so it is computed from measured per-token costs: ``s`` the
proxy's scoring seconds per document token (its ``condense_seconds`` over its ``tokens_in``, on the
uncached requests) and ``m`` the main model's prefill seconds per prompt token (the median of
direct TTFT / prompt tokens: a request's fixed cost, ~0.1 s of ~30, is counted in; the JSON also
has the per-step slope ``(TTFT direct - TTFT cached) / (tokens direct - tokens cached)``, free of
fixed costs but the difference of two noisy times).
With a main model ``k`` times the small one's parameters (prefill cost per token taken to scale
with them), a request whose documents are condensed once costs ``s * D + k * m * (P - S)`` against
``k * m * P`` direct (``D`` document tokens, ``P`` prompt tokens, ``S`` saved), so the cascade
breaks even at ``k* = s * D / (m * S)``, and at ``k* / n`` when a condensation serves ``n`` requests.
The two costs are of different engines (torch fp32 for the small model, vLLM CPU bf16 for the
main one, emulated bf16 on an AVX2-only CPU), as they would be deployed; the report says which CPU.

Size: the default (3 documents of >= 600 tokens, 6 steps) takes ~12-15 minutes on 2 AVX2 cores
(vLLM CPU prefills ~28 ms a token there; starting vLLM takes 1-2 of them); ``--quick`` (2 documents
of >= 160 tokens, 2 steps) ~3. On a machine loaded by other work both take longer (the last
``--quick`` at 200 tokens a document took 7 minutes at a load average of 7-12 on 2 cores).

    python experiments/cascade_ttft.py --out /tmp/cascade-ttft [--quick]
    python experiments/cascade_ttft.py --markdown-from /tmp/cascade-ttft/cascade-ttft.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from cascade_bench import Question, build_set, judge, rag_messages
from kvshrink.benchmarks.e2e_paired import BYTES_PER_TOKEN, ENGINE_ARGS, ENGINE_LABEL, E2EError
from kvshrink.benchmarks.paired_stats import paired_ratio, verdict

TTFT_TARGET = 0.6  # cached condensations / full documents, TTFT, at ratio 0.5 (issue 17)
TARGET_RATIO = 0.5  # the ratio the target is stated for
MODEL = "smollm2"
DIRECT, UNCACHED, CACHED = "direct", "uncached", "cached"
SIDES = (DIRECT, UNCACHED, CACHED)
# one step's order; rotated so that every side runs first, second and third alike (uncached before cached)
ORDERS = ((DIRECT, UNCACHED, CACHED), (UNCACHED, DIRECT, CACHED), (UNCACHED, CACHED, DIRECT))
MARKERS = ("<doc>", "</doc>")
_PROXY_COUNTERS = {"hits": "kvshrink_cascade_cache_hits_total", "misses": "kvshrink_cascade_cache_misses_total",
                   "tokens_in": "kvshrink_cascade_document_tokens_in_sum",
                   "tokens_out": "kvshrink_cascade_document_tokens_out_sum",
                   "condense_s": "kvshrink_cascade_condense_seconds_sum",
                   "requests": "kvshrink_cascade_requests_total"}


@dataclass(frozen=True)
class CascadeTTFTSettings:
    documents: int = 3  # per request
    doc_tokens: int = 600  # each document at least this many tokens
    pairs: int = 6  # steps, each with fresh documents: direct, uncached, cached
    ratio: float = 0.5
    max_tokens: int = 16
    # torch threads of the small model: vLLM CPU runs its model on one OpenMP thread here (its other
    # core reserved); with two, torch's forward passes ran 4-8x slower on a loaded 2-core machine
    proxy_threads: int = 1
    warmup: bool = True  # one untimed request of each kind first (lazy set-up in vLLM and torch)
    granularity: str = "word"  # the proxy's --granularity (its default)

    def quick(self) -> "CascadeTTFTSettings":
        return replace(self, documents=2, doc_tokens=160, pairs=2)


def prompt_text(tokenizer: Any, documents: Sequence[str], question: str, markers: tuple[str, str] | None) -> str:
    """cascade_bench's RAG prompt through the chat template, as text; each document between
    ``markers`` (the proxy's), or bare (``None``: what vLLM gets directly)."""
    return tokenizer.apply_chat_template(rag_messages(documents, question, markers), add_generation_prompt=True,
                                         tokenize=False)


def steps_of(tokenizer: Any, settings: CascadeTTFTSettings, groups: int) -> list[tuple[list[str], Question]]:
    """``groups`` disjoint sets of ``settings.documents`` documents, each with one question about
    one of its own documents (cascade_bench's seeded set)."""
    docs, questions = build_set(tokenizer, settings.documents * groups, 1, settings.doc_tokens)
    out = []
    for g in range(groups):
        mine = range(g * settings.documents, (g + 1) * settings.documents)
        out.append((docs[mine.start:mine.stop], next(q for q in questions if q.document in mine)))
    return out


def proxy_counters(text: str) -> dict[str, float]:
    """The proxy's cumulative counters (summed over labels; requests: the condensed ones only) from
    its /metrics exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {name: key for key, name in _PROXY_COUNTERS.items()}
    out = dict.fromkeys(_PROXY_COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted and sample.labels.get("action", "condensed") == "condensed":
                out[wanted[sample.name]] += sample.value
    return out


class CascadeTTFT:
    """One vLLM and the cascade proxy in front of it, started together; :meth:`run` measures."""

    def __init__(self, model: Path, settings: CascadeTTFTSettings, log_dir: Path,
                 progress: Callable[[str], None] = print, upstream: Any = None) -> None:
        """``upstream``: a vLLM server already serving ``model`` as ``MODEL`` with ``ENGINE_ARGS``
        (the tests share one); it is used and left running. Without it, :meth:`start` launches one."""
        self.model, self.settings, self.log_dir, self.progress = model, settings, log_dir, progress
        self.own_vllm = upstream is None
        self.vllm: Any = upstream
        self.proxy: Any = None
        self.proxy_url = ""

    def start(self, max_model_len: int) -> None:
        """vLLM and the proxy, launched at once (each loads its model meanwhile), then both waited for."""
        from kvshrink.testing.launch import VLLMServer
        from kvshrink.testing.processes import LOOPBACK, ManagedProcess, _http_ok, free_port

        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.own_vllm:
            self.vllm = VLLMServer(self.model, served_model_name=MODEL, extra_args=ENGINE_ARGS, kv_cache_space_gb=1,
                                   max_model_len=max_model_len, log_path=self.log_dir / "vllm.log").launch()
        port = free_port()
        self.proxy_url = f"http://{LOOPBACK}:{port}"
        self.proxy = ManagedProcess([sys.executable, "-m", "kvshrink.cli", "cascade", "serve", "--upstream",
                                     self.vllm.url, "--port", str(port), "--model-path", str(self.model),
                                     "--ratio", str(self.settings.ratio), "--threads",
                                     str(self.settings.proxy_threads), "--granularity", self.settings.granularity,
                                     "--log-level", "warning"],
                                    log_path=self.log_dir / "cascade.log").start()
        self.proxy.wait_until(lambda: _http_ok(f"{self.proxy_url}/metrics"), 300, "serving")
        self.vllm.wait_serving(600)

    def close(self) -> None:
        for proc in (self.proxy, self.vllm if self.own_vllm else None):
            if proc is not None:
                proc.stop()

    def request(self, side: str, documents: Sequence[str], question: Question, tokenizer: Any) -> dict[str, Any]:
        """One streamed request; its TTFT, vLLM's usage, the answer and the proxy's counter deltas."""
        import httpx

        from kvshrink.testing.streaming_client import stream_completion

        url = self.vllm.url if side == DIRECT else self.proxy_url
        prompt = prompt_text(tokenizer, documents, question.text, None if side == DIRECT else MARKERS)
        before = proxy_counters(httpx.get(f"{self.proxy_url}/metrics", timeout=10).text)
        result = stream_completion(url, MODEL, prompt, max_tokens=self.settings.max_tokens)
        after = proxy_counters(httpx.get(f"{self.proxy_url}/metrics", timeout=10).text)
        if "prompt_tokens" not in result.usage:
            raise E2EError(f"{side}: the stream carried no usage (stream_options.include_usage)")
        return {"side": side, "ttft_s": result.ttft_s, "total_s": result.total_s, "chunks": result.chunks,
                "prompt_tokens": int(result.usage["prompt_tokens"]),
                "completion_tokens": int(result.usage.get("completion_tokens", 0)), "text": result.text,
                "expected": question.answer, "match": judge(result.text, question.answer)[1],
                "proxy": {k: after[k] - before[k] for k in after}}

    def run(self) -> dict[str, Any]:
        from transformers import AutoTokenizer

        from kvshrink.benchmarks.suite_sections import machine

        s, started = self.settings, time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(str(self.model))
        steps = steps_of(tokenizer, s, s.pairs + 1)  # the first one's documents, shortened, for the warm-up
        longest = max(len(tokenizer(prompt_text(tokenizer, d, q.text, None)).input_ids) for d, q in steps)
        host = machine()
        try:
            self.start(max(4096, longest + s.max_tokens + 64))
            warm_docs = ["\n\n".join(d.split("\n\n")[:2]) for d in steps[0][0]]  # short, but condensed
            for side in SIDES if s.warmup else ():
                warm = self.request(side, warm_docs, steps[0][1], tokenizer)
                self.progress(f"warm-up {side} (not timed): TTFT {warm['ttft_s']:.2f} s")
            samples = []
            for step, (documents, question) in enumerate(steps[1:]):
                for side in ORDERS[step % len(ORDERS)]:
                    sample = {"step": step, **self.request(side, documents, question, tokenizer)}
                    _check(sample, s.documents)
                    samples.append(sample)
                    self.progress(f"step {step + 1}/{s.pairs} {side}: TTFT {sample['ttft_s']:.2f} s, "
                                  f"{sample['prompt_tokens']} prompt tokens")
        finally:
            self.close()
        doc_tokens = [len(tokenizer(doc, add_special_tokens=False).input_ids) for docs, _ in steps[1:] for doc in docs]
        return {"settings": asdict(s), "machine": {**host, "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
                "engine": ENGINE_LABEL, "small_model": "SmolLM2-135M-Instruct, torch float32 CPU, in the proxy",
                "documents": {"fresh_per_step": True, "tokens": doc_tokens}, "target": TTFT_TARGET,
                "samples": samples, "figures": figures(samples, s.ratio), "wall_s": time.perf_counter() - started}


def _check(sample: dict[str, Any], documents: int) -> None:
    """The proxy did what the side says: condensed every document (uncached) or found each in its
    cache (cached); the direct request never passed the proxy."""
    p = sample["proxy"]
    expected = {DIRECT: (0, 0, 0), UNCACHED: (0, documents, 1), CACHED: (documents, 0, 1)}[sample["side"]]
    if (p["hits"], p["misses"], p["requests"]) != expected:
        raise E2EError(f"step {sample['step']} {sample['side']}: the proxy counted {p['hits']:.0f} cache hits, "
                       f"{p['misses']:.0f} misses, {p['requests']:.0f} condensed requests; expected {expected}")


def figures(samples: Sequence[dict[str, Any]], ratio: float) -> dict[str, Any]:
    """Every figure of a run from its samples (pure: the fast test calls it on made-up samples)."""
    by = {side: sorted((x for x in samples if x["side"] == side), key=lambda x: x["step"]) for side in SIDES}
    direct = by[DIRECT]
    out: dict[str, Any] = {"ttft_s": {side: statistics.median(x["ttft_s"] for x in by[side]) for side in SIDES},
                           "prompt_tokens": {side: sum(x["prompt_tokens"] for x in by[side]) / len(by[side])
                                             for side in SIDES},
                           "matches": {side: sum(x["match"] for x in by[side]) for side in SIDES},
                           "requests_per_side": len(direct)}
    for side in (CACHED, UNCACHED):
        r = paired_ratio([x["ttft_s"] for x in by[side]], [x["ttft_s"] for x in direct]).as_dict()
        target = TTFT_TARGET if side == CACHED and abs(ratio - TARGET_RATIO) < 1e-9 else None
        out[f"{side}_over_direct"] = {**r, "target": target,
                                      "verdict": verdict(r, target) if target is not None else None}
    saved = out["prompt_tokens"][DIRECT] - out["prompt_tokens"][CACHED]
    out["tokens_saved_per_request"] = saved
    out["tokens_saved_fraction"] = saved / out["prompt_tokens"][DIRECT]
    out["kv_bytes_per_request"] = {side: t * BYTES_PER_TOKEN for side, t in out["prompt_tokens"].items()}
    out["kv_bytes_saved_per_request"] = saved * BYTES_PER_TOKEN
    out["bytes_per_token"] = BYTES_PER_TOKEN
    out["break_even"] = break_even(by[UNCACHED], by[CACHED], direct)
    return out


def break_even(uncached: Sequence[dict[str, Any]], cached: Sequence[dict[str, Any]],
               direct: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The main / small parameter ratio ``k* = s * D / (m * S)`` (module docstring) from measured costs."""
    tokens_in = sum(x["proxy"]["tokens_in"] for x in uncached)
    small = sum(x["proxy"]["condense_s"] for x in uncached) / tokens_in  # s, per document token
    main = statistics.median(d["ttft_s"] / d["prompt_tokens"] for d in direct)  # m, per prompt token
    slopes = [(d["ttft_s"] - c["ttft_s"]) / (d["prompt_tokens"] - c["prompt_tokens"])
              for d, c in zip(direct, cached) if d["prompt_tokens"] > c["prompt_tokens"]]
    doc_tokens = tokens_in / len(uncached)
    saved = statistics.mean(d["prompt_tokens"] - c["prompt_tokens"] for d, c in zip(direct, cached))
    k = small * doc_tokens / (main * saved) if main > 0 and saved > 0 else float("nan")
    return {"small_s_per_document_token": small, "main_prefill_s_per_token": main,
            "main_prefill_s_per_token_slope": statistics.median(slopes) if slopes else float("nan"),
            "document_tokens_per_request": doc_tokens, "prompt_tokens_saved_per_request": saved,
            "size_ratio": k, "uncached_overhead_s": statistics.median(
                u["ttft_s"] - c["ttft_s"] for u, c in zip(uncached, cached))}


def report_lines(result: dict[str, Any]) -> list[str]:
    """The run as text: the two TTFT ratios with intervals and verdict, tokens, bytes, break-even."""
    f, s, b = result["figures"], result["settings"], result["figures"]["break_even"]
    lines = [f"KV Cascade through the proxy vs vLLM directly: {s['documents']} documents of >= {s['doc_tokens']} "
             f"tokens, ratio {s['ratio']} by {s.get('granularity', 'word')}, {f['requests_per_side']} steps "
             "(fresh documents each)"]
    for side in (CACHED, UNCACHED):
        r = f[f"{side}_over_direct"]
        target = f" (target <= {r['target']:g}) {r['verdict']}" if r["target"] is not None else ""
        lines.append(f"  TTFT {side} / direct: {r['median']:.3f} (95 % {r['low']:.3f}-{r['high']:.3f}){target}; "
                     f"medians {f['ttft_s'][side]:.2f} s vs {f['ttft_s'][DIRECT]:.2f} s")
    t, kv = f["prompt_tokens"], f["kv_bytes_per_request"]
    lines.append(f"  main-model prompt tokens per request: direct {t[DIRECT]:.0f}, proxy {t[CACHED]:.0f} "
                 f"({f['tokens_saved_fraction']:.1%} saved); KV {kv[DIRECT] / 2**20:.1f} -> {kv[CACHED] / 2**20:.1f} "
                 f"MiB ({f['kv_bytes_saved_per_request'] / 2**20:.1f} MiB saved, {f['bytes_per_token']} B/token)")
    lines.append("  answers matching: " + ", ".join(f"{side} {f['matches'][side]}/{f['requests_per_side']}"
                                                    for side in SIDES))
    lines.append(f"  break-even main/small size ratio {b['size_ratio']:.2f} (a larger main model saves compute; for a "
                 f"condensation used once, / n if used n times): "
                 f"small model {b['small_s_per_document_token'] * 1e3:.2f} ms per document token, main prefill "
                 f"{b['main_prefill_s_per_token'] * 1e3:.2f} ms per prompt token; uncached adds "
                 f"{b['uncached_overhead_s']:.2f} s to TTFT")
    m = result["machine"]
    lines.append(f"  machine: {m.get('cpus')} CPUs, {m.get('cpu_model')}, flags {','.join(m.get('cpu_flags', []))}; "
                 f"load {m.get('loadavg_before')} -> {m.get('loadavg_after')}; {result['wall_s']:.0f} s")
    return lines


def markdown_table(result: dict[str, Any]) -> str:
    """README's table of one run: TTFT of each side with the paired ratio, tokens, KV bytes, break-even."""
    f, s, b = result["figures"], result["settings"], result["figures"]["break_even"]
    t, kv = f["prompt_tokens"], f["kv_bytes_per_request"]
    lines = ["| request | TTFT (median) | vs direct, 95 % | target | verdict | main-model prompt tokens | KV |",
             "|---|---:|---:|---:|---|---:|---:|",
             f"| vLLM directly, full documents | {f['ttft_s'][DIRECT]:.2f} s | | | | {t[DIRECT]:.0f} | "
             f"{kv[DIRECT] / 2**20:.1f} MiB |"]
    for side, label in ((CACHED, "proxy, condensations cached"), (UNCACHED, "proxy, condensations uncached")):
        r = f[f"{side}_over_direct"]
        target = f"<= {r['target']:g}" if r["target"] is not None else ""
        lines.append(f"| {label} | {f['ttft_s'][side]:.2f} s | {r['median']:.3f} ({r['low']:.3f}-{r['high']:.3f}) | "
                     f"{target} | {r['verdict'] or ''} | {t[side]:.0f} | {kv[side] / 2**20:.1f} MiB |")
    m = result["machine"]
    lines.append(f"\n{s['documents']} documents of >= {s['doc_tokens']} tokens a request, ratio {s['ratio']} by "
                 f"{s.get('granularity', 'word')}, "
                 f"{f['requests_per_side']} steps of fresh documents; answers matching: "
                 + ", ".join(f"{side} {f['matches'][side]}/{f['requests_per_side']}" for side in SIDES)
                 + f". Break-even main/small size ratio (above it the cascade saves compute): {b['size_ratio']:.2f} "
                 f"for a condensation used once, / n if used n times "
                 f"(small model {b['small_s_per_document_token'] * 1e3:.2f} ms per document token, main prefill "
                 f"{b['main_prefill_s_per_token'] * 1e3:.2f} ms per token). {m.get('cpus')} CPUs "
                 f"({','.join(m.get('cpu_flags', []))}), {result['engine']}.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from tqdm import tqdm

    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    defaults = CascadeTTFTSettings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for cascade-ttft.json and the logs")
    parser.add_argument("--quick", action="store_true", help="2 documents of >= 160 tokens, 2 steps (~3 min)")
    parser.add_argument("--documents", type=int, default=defaults.documents, help="documents a request")
    parser.add_argument("--doc-tokens", type=int, default=defaults.doc_tokens, help="tokens a document, at least")
    parser.add_argument("--pairs", type=int, default=defaults.pairs, help="steps (direct, uncached, cached each)")
    parser.add_argument("--ratio", type=float, default=defaults.ratio, help="the proxy's kept tokens / document tokens")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--proxy-threads", type=int, default=defaults.proxy_threads, help="small model's torch threads")
    parser.add_argument("--granularity", choices=("word", "sentence"), default=defaults.granularity,
                        help="what the condenser keeps or drops whole (the proxy's --granularity)")
    parser.add_argument("--markdown-from", type=Path, default=None, metavar="JSON",
                        help="do not run: print README's table of an earlier run's cascade-ttft.json")
    args = parser.parse_args(argv)
    if args.markdown_from is not None:
        print(markdown_table(json.loads(args.markdown_from.read_text())))
        return 0
    settings = CascadeTTFTSettings(args.documents, args.doc_tokens, args.pairs, args.ratio, args.max_tokens,
                                   args.proxy_threads, granularity=args.granularity)
    settings = settings.quick() if args.quick else settings
    out = args.out or Path(tempfile.mkdtemp(prefix="kvshrink-cascade-ttft-"))
    out.mkdir(parents=True, exist_ok=True)
    with tqdm(total=3 * (settings.pairs + settings.warmup), desc="cascade TTFT", unit="request") as bar:
        def progress(line: str) -> None:
            bar.update(1)
            bar.write(line)

        result = CascadeTTFT(ensure_checkpoint(), settings, out / "logs", progress).run()
    (out / "cascade-ttft.json").write_text(json.dumps(result, indent=1))
    print("\n".join(report_lines(result)))
    print(f"\n{out / 'cascade-ttft.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
