"""TTFT by context length: cold prefill against warm loads from every tier, both sides, one paired run.

An agent's context grows every turn, and what a cache saves grows with it: prefill costs at least
linearly in the context, loading its KV only linearly in its bytes. Where loading beats recomputing
depends on the machine (a CPU with AMX prefills bf16 several times faster than one with AVX2 only),
so this phase measures it here, at every length, for both sides, in the same run:

* ``cold``: a prompt no cache has seen (each pair a different slice of real text, same length);
* ``warm_l1``: the same prompt again from LMCache's L1 (both sides; our adapter idle);
* ``warm_l2``: LMCache's L1 cleared before each request: ours from our DRAM tier, stock from its
  ``fs_native`` files (LMCache's native file adapter, as the hot path runs it);
* ``warm_ssd``: both cache servers restarted (our DRAM arena gone; a clean close copied it down to
  our SSD tier), L1 cleared: ours from its SSD tier, stock from its files again (page cache on both).

Each pair runs both stacks back to back in rotating order (``e2e_paired``'s harness: neighbours
idle, stores finished). Pairs per length are sized from what this machine measured: the first cold
pair and the first warm pair of a length set how many more fit its share of ``budget_s``, so a slow
CPU takes few pairs at 8K and a fast one many. Figures per length and source: median TTFT of each
side, ours / stock as the median of paired ratios with a 95 % bootstrap interval, and each warm
source over the same side's cold prefill (a ratio of medians, both resampled).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from kvshrink.benchmarks.comparison import OURS, STOCK, TierPolicy, digest
from kvshrink.benchmarks.paired_stats import paired_ratio, verdict

CONTEXT_LENGTHS = (1024, 2048, 4096, 8192)
MODEL_POSITIONS = 8192  # SmolLM2's context; the longest prompt leaves room for its answer
MAX_TOKENS = 2  # TTFT is the first token; the second shows the answer goes on
SOURCES = ("cold", "warm_l1", "warm_l2", "warm_ssd")
WARM = SOURCES[1:]
SOURCE_LABELS = {"cold": "cold prefill", "warm_l1": "warm, LMCache L1",
                 "warm_l2": "warm, first L2 tier (ours: DRAM; stock: fs_native)",
                 "warm_ssd": "warm after restart (ours: SSD tier; stock: fs_native)"}
SIDE_SOURCE_LABELS = {(STOCK, "warm_l2"): "warm from fs_native (its L2)", (OURS, "warm_l2"): "warm from our DRAM tier",
                      (STOCK, "warm_ssd"): "warm from fs_native after restart",
                      (OURS, "warm_ssd"): "warm from our SSD tier after restart"}
TARGET_TOKENS = 8192
DRAM_OVER_COLD_TARGET = 0.25  # ours warm from our DRAM tier / our cold prefill
DRAM_OVER_STOCK_TARGET = 1.05  # ours warm from our DRAM tier / stock warm from its L2
WARM_COST_FACTOR = 2.0  # a warm request from L2 or SSD, over one from L1, when sizing pairs
ROW_SECTION = "e2e TTFT by context length"
PLOT_FILE = "ttft_by_context_length.png"


@dataclass(frozen=True)
class ContextSettings:
    lengths: tuple[int, ...] = CONTEXT_LENGTHS
    budget_s: float = 900.0  # the whole phase; split between lengths as they run
    chunk_tokens: int = 128
    max_cold_pairs: int = 3
    min_warm_pairs: int = 3
    max_warm_pairs: int = 10
    ssd: bool = True  # the warm_ssd source (one restart of both cache servers)


def prompt_tokens_for(length: int) -> int:
    """The prompt sent for a nominal ``length``: the model's context less room for the answer."""
    return min(length, MODEL_POSITIONS - MAX_TOKENS - 6)


def max_model_len_for(lengths: Sequence[int]) -> int:
    """vLLM's ``--max-model-len`` that serves every length (never under the harness's 4096)."""
    return max([4096, *[min(MODEL_POSITIONS, prompt_tokens_for(n) + MAX_TOKENS + 6) for n in lengths]])


def plan_cold_pairs(cold_s: float, budget_s: float, settings: ContextSettings) -> int:
    """Cold pairs for one length, given one measured cold request and the seconds the length may
    spend: cold pairs take at most a third of it (a pair is two prefills), at least one."""
    if cold_s <= 0:
        return settings.max_cold_pairs
    return max(1, min(settings.max_cold_pairs, int(budget_s / 3 // (2 * cold_s))))


def plan_warm_pairs(warm_s: float, left_s: float, sources: int, settings: ContextSettings) -> int:
    """Warm pairs per warm source that fit ``left_s`` (a pair is two loads, ``warm_s`` each), within
    ``min_warm_pairs``..``max_warm_pairs``: the minimum even where the budget is spent, so every
    source has an interval."""
    fit = int(max(0.0, left_s) // (2 * sources * max(warm_s, 1e-3)))
    return max(settings.min_warm_pairs, min(settings.max_warm_pairs, fit))


def ratio_of_medians(num: Sequence[float], den: Sequence[float], resamples: int = 10_000,
                     seed: int = 0) -> dict[str, float]:
    """median(num) / median(den) with a 95 % bootstrap interval, each side resampled on its own
    (warm and cold samples are different prompts, not pairs). One ``den`` sample: its spread is
    not in the interval."""
    n, d = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    rng = np.random.default_rng(seed)
    boot_n = np.median(n[rng.integers(0, n.size, (resamples, n.size))], axis=1)
    boot_d = np.median(d[rng.integers(0, d.size, (resamples, d.size))], axis=1)
    low, high = np.percentile(boot_n / boot_d, [2.5, 97.5])
    return {"value": float(np.median(n) / np.median(d)), "low": float(low), "high": float(high),
            "samples": int(n.size), "cold_samples": int(d.size)}


# -- figures (pure: unit-tested on synthetic samples) -------------------------------------------------
def length_figures(samples: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]], stock_key: str,
                   ours_key: str) -> dict[str, Any]:
    """Per source: both sides' median TTFT, ours / stock paired, each side's warm / its cold."""
    out: dict[str, Any] = {}
    cold = {k: [x["ttft_s"] for x in samples["cold"][k]] for k in (stock_key, ours_key)}
    for source in SOURCES:
        if source not in samples or not all(samples[source].get(k) for k in (stock_key, ours_key)):
            continue
        t = {k: [x["ttft_s"] for x in samples[source][k]] for k in (stock_key, ours_key)}
        entry: dict[str, Any] = {"stock_median_s": statistics.median(t[stock_key]),
                                 "ours_median_s": statistics.median(t[ours_key]),
                                 "ratio": paired_ratio(t[ours_key], t[stock_key]).as_dict()}
        if source != "cold":
            entry["over_cold"] = {STOCK: ratio_of_medians(t[stock_key], cold[stock_key]),
                                  OURS: ratio_of_medians(t[ours_key], cold[ours_key])}
        out[source] = entry
    return out


def hits_as_expected(samples: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]], prompt_tokens: int,
                     chunk: int) -> dict[str, bool]:
    """Cold hit nothing, warm_l1 loaded from L1, warm_l2 / warm_ssd from an L2 (LMCache's counters)."""
    cached = prompt_tokens // chunk * chunk
    field = {"warm_l1": "l1_hit_tokens", "warm_l2": "l2_hit_tokens", "warm_ssd": "l2_hit_tokens"}
    out = {}
    for source, by in samples.items():
        for key, xs in by.items():
            if source == "cold":
                out[f"{source}/{key}"] = all(x["hit_tokens"] == 0 for x in xs)
            else:
                out[f"{source}/{key}"] = all(x[field[source]] >= cached - chunk for x in xs)
    return out


def crossover(by_length: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, int | None]]:
    """Per side and warm source: the shortest measured length from which loading beats recomputing
    on this machine (warm / cold upper bound under 1 there and at every longer length)."""
    out: dict[str, dict[str, int | None]] = {STOCK: {}, OURS: {}}
    for side in (STOCK, OURS):
        for source in WARM:
            rows = [(e["tokens"], e["figures"][source]["over_cold"][side]["high"])
                    for e in by_length if source in e["figures"]]
            if not rows:
                continue
            first = None
            for tokens, high in sorted(rows, reverse=True):
                if high >= 1.0:
                    break
                first = tokens
            out[side][source] = first
    return out


def targets(by_length: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The two targets at :data:`TARGET_TOKENS` (none where that length was not run), each with a
    verdict only where its 95 % interval clears it, and false where a request did not hit as
    it should (then the figure is not what it claims to be)."""
    entry = next((e for e in by_length if e["tokens"] == TARGET_TOKENS), None)
    if entry is None or "warm_l2" not in entry["figures"]:
        return {}
    f = entry["figures"]["warm_l2"]
    hits_ok = all(ok for k, ok in entry["hits_as_expected"].items() if k.split("/")[0] in ("cold", "warm_l2"))
    over, vs = f["over_cold"][OURS], f["ratio"]
    out = {}
    for name, interval, target, what in (
            ("dram_over_cold", over, DRAM_OVER_COLD_TARGET, "ours warm from our DRAM tier / our cold prefill"),
            ("dram_over_stock_l2", {"value": vs["median"], "low": vs["low"], "high": vs["high"]},
             DRAM_OVER_STOCK_TARGET, "ours warm from our DRAM tier / stock warm from its L2 (paired)")):
        v = verdict(interval, target)
        out[name] = {"tokens": TARGET_TOKENS, "prompt_tokens": entry["prompt_tokens"], "what": what,
                     "value": interval["value"], "low": interval["low"], "high": interval["high"], "target": target,
                     "verdict": v, "hits_as_expected": hits_ok, "pass": v == "met" and hits_ok}
    return out


def summarize(by_length: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures, crossovers and targets from each length's samples (``by_length[i]["samples"]``)."""
    for entry in by_length:
        entry["figures"] = length_figures(entry["samples"], entry["stock"], entry["ours"])
        entry["hits_as_expected"] = hits_as_expected(entry["samples"], entry["prompt_tokens"], entry["chunk_tokens"])
    return {"crossover": crossover(by_length), "targets": targets(by_length)}


# -- the measured phase -----------------------------------------------------------------------------
class PromptSlices:
    """Successive, disjoint slices of real text (the code corpus, then prose): each cold prompt is
    text no cache has seen, of the length asked."""

    def __init__(self, tokens: Sequence[int], start: int = 0) -> None:
        self.tokens, self.offset = list(tokens), start

    def take(self, n: int) -> list[int]:
        if self.offset + n > len(self.tokens):
            raise ValueError(f"the corpora hold {len(self.tokens)} tokens; {self.offset + n} needed")
        out = self.tokens[self.offset:self.offset + n]
        self.offset += n
        return out


class ContextTTFT:
    """The phase on a stock stack and ours (``e2e_paired.Stack``, already serving): reconfigures
    both (wiping what they held), measures every length, returns a JSON-able dict."""

    def __init__(self, stock: Any, ours: Any, model: Path, settings: ContextSettings, template: Path | None = None,
                 progress: Callable[[str], None] = lambda s: None) -> None:
        self.stock, self.ours, self.model = stock, ours, model
        self.settings, self.template, self.progress = settings, template, progress
        self._warm: dict[int, list[int]] = {}  # length -> the prompt its warm requests send

    def arrangements(self) -> list[Any]:
        """Both sides as the hot path runs them, sized so nothing the phase needs is evicted:
        LMCache's L1 caches a length's cold prompts (the warm one is the last of them) and keeps
        room free for one more prompt's stores (below that room LMCache drops a store silently);
        our DRAM tier holds every prompt of the phase (so warm_l2 is our DRAM tier, never a
        demotion to SSD)."""
        from kvshrink.benchmarks.e2e_paired import BYTES_PER_TOKEN, MIB, Arrangement, ours_adapter, stock_fs_native

        s = self.settings
        longest = max(prompt_tokens_for(n) for n in s.lengths) * BYTES_PER_TOKEN / MIB
        l1 = float(64 * -(-(s.max_cold_pairs * longest + 64) // 64))
        headroom = float(64 * -(-(longest + 64) // 64))
        everything = s.max_cold_pairs * sum(prompt_tokens_for(n) for n in s.lengths) * BYTES_PER_TOKEN / MIB
        dram = float(256 * -(-(everything + 256) // 256))
        stock_disk, ours_disk = self.stock.workdir / "l2", self.ours.workdir / "l2"
        return [Arrangement(l1, stock_fs_native(stock_disk, 2 * dram),
                            TierPolicy(f"stock: L1 {l1:.0f} MiB + fs_native", "inclusive", l1, True), disk=stock_disk,
                            l1_headroom_mib=headroom),
                Arrangement(l1, ours_adapter(ours_disk, self.ours.shm_name, dram, 2 * dram, self.template),
                            TierPolicy(f"KVShrink: L1 {l1:.0f} MiB + shipped default store ({dram:.0f} MiB DRAM)",
                                       "inclusive", l1, True), shm_name=self.ours.shm_name, disk=ours_disk,
                            l1_headroom_mib=headroom)]

    def run(self) -> dict[str, Any]:
        from kvshrink.benchmarks.e2e_paired import corpus_tokens, reconfigure

        s, started = self.settings, time.monotonic()
        pair = [self.stock, self.ours]
        self.progress("context lengths: reconfiguring")
        reconfigure(pair, self.arrangements(), wipe=True)
        # past the first MODEL_POSITIONS tokens of the code corpus: the hot path's prompt is there
        slices = PromptSlices(corpus_tokens(self.model, "code") + corpus_tokens(self.model, "prose"), MODEL_POSITIONS)
        by_length: list[dict[str, Any]] = []
        for i, length in enumerate(sorted(s.lengths)):
            share = (s.budget_s - (time.monotonic() - started)) / (len(s.lengths) - i)
            by_length.append(self._length(length, slices, share))
        tiers = self._ours_tiers()
        if s.ssd:
            self.progress("context lengths: restarting both cache servers (ours from its SSD tier)")
            reconfigure(pair, [st.arrangement for st in pair], wipe=False)
            for entry in by_length:
                self._pairs(entry, "warm_ssd", entry["warm_pairs"], clear=True)
        out = {"settings": asdict(self.settings), "stock": self.stock.key, "ours": self.ours.key,
               "policies": {st.key: vars(st.arrangement.policy) for st in pair},
               "ours_tiers_before_restart": tiers, "by_length": by_length}
        out.update(summarize(by_length))
        out["seconds"] = time.monotonic() - started
        return out

    def _length(self, length: int, slices: PromptSlices, budget_s: float) -> dict[str, Any]:
        s, pair = self.settings, [self.stock, self.ours]
        n = prompt_tokens_for(length)
        entry: dict[str, Any] = {"tokens": length, "prompt_tokens": n, "chunk_tokens": s.chunk_tokens,
                                 "stock": self.stock.key, "ours": self.ours.key, "budget_s": budget_s,
                                 "samples": {src: {st.key: [] for st in pair} for src in SOURCES[:3]}}
        started = time.monotonic()
        prompts = [slices.take(n)]
        self._cold(entry, prompts[0], 0)
        cold_s = max(x["ttft_s"] for xs in entry["samples"]["cold"].values() for x in xs)
        cold_pairs = plan_cold_pairs(cold_s, budget_s, s)
        for step in range(1, cold_pairs):  # the warm prompt is the last one prefilled: freshest in L1
            prompts.append(slices.take(n))
            self._cold(entry, prompts[-1], step)
        self._warm[length] = prompts[-1]
        self._pairs(entry, "warm_l1", 1, clear=False)
        warm_s = WARM_COST_FACTOR * max(x["ttft_s"] for xs in entry["samples"]["warm_l1"].values() for x in xs)
        warm_pairs = plan_warm_pairs(warm_s, budget_s - (time.monotonic() - started), 3 if s.ssd else 2, s)
        entry.update(cold_pairs=cold_pairs, warm_pairs=warm_pairs, cold_estimate_s=cold_s, warm_estimate_s=warm_s,
                     prompt_digest=digest(*prompts))
        self.progress(f"context {length}: {cold_pairs} cold, {warm_pairs} warm pairs (cold {cold_s:.1f} s)")
        self._pairs(entry, "warm_l1", warm_pairs - 1, clear=False, first_step=1)
        self._pairs(entry, "warm_l2", warm_pairs, clear=True)  # after L1's: a chunk loaded from L2 stays out of L1
        return entry

    def _cold(self, entry: dict[str, Any], prompt: list[int], step: int) -> None:
        from kvshrink.benchmarks.e2e_paired import BYTES_PER_TOKEN, rotated

        self.progress(f"context {entry['tokens']}: cold {step + 1}")
        for st in rotated([self.stock, self.ours], step):
            st.wait_l1_room(len(prompt) * BYTES_PER_TOKEN)  # its chunks must reach L1, hence every L2
            entry["samples"]["cold"][st.key].append(vars(st.request(prompt, max_tokens=MAX_TOKENS)))
            st.wait_idle()

    def _pairs(self, entry: dict[str, Any], source: str, pairs: int, clear: bool, first_step: int = 0) -> None:
        from kvshrink.benchmarks.e2e_paired import rotated

        by = entry["samples"].setdefault(source, {self.stock.key: [], self.ours.key: []})
        for step in range(first_step, first_step + pairs):
            self.progress(f"context {entry['tokens']}: {source} {step + 1}")
            for st in rotated([self.stock, self.ours], step):
                if clear:
                    st.clear_l1()
                by[st.key].append(vars(st.request(self._warm[entry["tokens"]], max_tokens=MAX_TOKENS)))
                st.wait_idle()

    def _ours_tiers(self) -> dict[str, float]:
        """Chunks in each of our tiers before the restart: all in DRAM means warm_l2 read DRAM."""
        from kvshrink.testing.mp_observe import adapter_status

        tiers = adapter_status(self.ours.server.http_url)["store"]["tiers"]
        return {name: float(t["chunks"]) for name, t in tiers.items()}


# -- rendering --------------------------------------------------------------------------------------
def add_to_section(section: Any, context: Mapping[str, Any], model: str) -> None:
    """Rows (median TTFT of both sides per length), the two targets and the notes, into an
    ``e2e`` :class:`~kvshrink.benchmarks.suite_sections.Section`."""
    from kvshrink.benchmarks.comparison import Metric, SideRun, Workload, compare

    if not context:
        return
    keys = {STOCK: context["stock"], OURS: context["ours"]}
    policies = {side: TierPolicy(**context["policies"][keys[side]]) for side in (STOCK, OURS)}
    for entry in context["by_length"]:
        f = entry["figures"]
        workload = Workload(entry["prompt_digest"], model, {"context_tokens": entry["prompt_tokens"],
                                                             "chunk_tokens": entry["chunk_tokens"]})
        figures = {STOCK: {}, OURS: {}}
        metrics = []
        for source in SOURCES:
            if source in f:
                figures[STOCK][f"{source}_ttft_s"] = f[source]["stock_median_s"]
                figures[OURS][f"{source}_ttft_s"] = f[source]["ours_median_s"]
                metrics.append(Metric(f"{source}_ttft_s", "s", False))
        for source in WARM:
            if source in f:
                for side in (STOCK, OURS):
                    figures[side][f"{source}_over_cold"] = f[source]["over_cold"][side]["value"]
                metrics.append(Metric(f"{source}_over_cold", "x", False))
        sides = [SideRun(side, workload, figures[side], policy=policies[side]) for side in (STOCK, OURS)]
        section.comparisons += compare(ROW_SECTION, f"{entry['tokens']} tokens ({entry['prompt_tokens']} sent)",
                                       *sides, metrics)
        missed = [k for k, ok in entry["hits_as_expected"].items() if not ok]
        if missed:
            section.notes.append(f"context {entry['tokens']}: requests that did not hit as expected: {missed}")
    for t in context["targets"].values():
        section.target(f"TTFT at {t['tokens']} tokens, {t['what']} <= {t['target']}", t["pass"],
                       f"{t['value']:.3f} (95 % {t['low']:.3f}-{t['high']:.3f}): {t['verdict']}"
                       + ("" if t["hits_as_expected"] else "; some requests did not hit as they should"))
    if not context["targets"]:
        section.notes.append(f"context lengths: {TARGET_TOKENS} tokens not run in this mode, so no target")
    section.notes.append(crossover_note(context))
    budget = context["settings"]["budget_s"]
    if context["seconds"] > 1.1 * budget:
        cold = "; ".join(f"{e['tokens']}: {e['cold_estimate_s']:.1f} s" for e in context["by_length"])
        section.notes.append(f"TTFT by context length took {context['seconds']:.0f} s, over its {budget:.0f} s "
                             f"budget even at the fewest pairs: one cold prefill here takes {cold}")
    pairs = ", ".join(f"{e['tokens']}: {e['cold_pairs']} cold / {e['warm_pairs']} warm" for e in context["by_length"])
    section.notes.append(f"TTFT by context length ({context['seconds']:.0f} s): pairs sized from this machine's "
                         f"measured cold and warm TTFT ({pairs}); each cold prompt a different slice of real text; "
                         "warm / cold is a ratio of medians with both resampled; our tiers before the restart held "
                         + ", ".join(f"{k} {v:.0f}" for k, v in context.get("ours_tiers_before_restart", {}).items())
                         + " chunks")


def crossover_note(context: Mapping[str, Any]) -> str:
    parts = []
    for side in (STOCK, OURS):
        for source, tokens in context["crossover"][side].items():
            parts.append(f"{side} {source}: " + (f"from {tokens} tokens" if tokens else "not at any length run"))
    return ("where loading beats recomputing on this machine (warm / cold, 95 % upper bound under 1 from that "
            "length up): " + "; ".join(parts))


def plot(context: Mapping[str, Any], path: Path) -> None:
    """Left: median TTFT vs context length, a line per side and source (cold dashed). Right: each
    warm source over the same side's cold prefill, with its interval; under 1, loading wins."""
    from kvshrink.benchmarks.bench_extra import pyplot

    plt = pyplot()
    by_length = context["by_length"]
    x = [e["tokens"] for e in by_length]
    colors = {STOCK: "tab:blue", OURS: "tab:red"}
    markers = {"cold": "x", "warm_l1": "o", "warm_l2": "s", "warm_ssd": "^"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for side in (STOCK, OURS):
        for source in SOURCES:
            pts = [(e["tokens"], e["figures"][source][f"{'ours' if side == OURS else 'stock'}_median_s"])
                   for e in by_length if source in e["figures"]]
            if pts:
                left.plot(*zip(*pts), marker=markers[source], linestyle="--" if source == "cold" else "-",
                          color=colors[side], alpha=1.0 if source in ("cold", "warm_l2") else 0.6,
                          label=f"{side}: {SIDE_SOURCE_LABELS.get((side, source), SOURCE_LABELS[source])}")
        for j, source in enumerate(WARM):
            pts = [(e["tokens"], e["figures"][source]["over_cold"][side]) for e in by_length if source in e["figures"]]
            if not pts:
                continue
            shift = 1 + 0.03 * (j - 1) + (0.01 if side == OURS else -0.01)
            xs = [t * shift for t, _ in pts]
            ys = [r["value"] for _, r in pts]
            err = [[r["value"] - r["low"] for _, r in pts], [r["high"] - r["value"] for _, r in pts]]
            right.errorbar(xs, ys, yerr=err, marker=markers[source], color=colors[side], capsize=3,
                           alpha=1.0 if source == "warm_l2" else 0.6, label=f"{side}: {source}")
    right.axhline(1.0, color="grey", linewidth=1, label="= recomputing")
    right.axhline(DRAM_OVER_COLD_TARGET, color="green", linestyle="--", linewidth=1,
                  label=f"target at {TARGET_TOKENS}: ours DRAM <= {DRAM_OVER_COLD_TARGET}x cold")
    left.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="TTFT, median (s)",
             title="TTFT by context length: cold prefill vs warm loads")
    right.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="warm TTFT / cold TTFT (95 %)",
              title="Loading vs recomputing (under 1: loading wins)")
    for ax in (left, right):
        ax.set_xticks(x, [f"{t // 1024}K" if t % 1024 == 0 else str(t) for t in x])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5)
    from kvshrink.benchmarks.report import _save

    _save(fig, path)
