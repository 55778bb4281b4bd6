"""KV Infinity on the agent replay: half the DRAM with idle demotion and prefetch hints, against the
full DRAM without them -- ours vs ours on vLLM CPU + SmolLM2.

The question an operator asks before turning idle demotion on: if the KV of sessions that wait for
a tool leaves DRAM, and a hint brings it back before the session's next turn, can the DRAM budget
be halved without losing hits or time? Two stacks (``e2e_paired.Stack``: each its own ``lmcache
server`` and vLLM) replay an agent trace (real text, six sessions interleaved at random; the
e2e section's until it grew, :attr:`InfinitySettings.trace`), requests to both back to back in
rotating order:

* ``full``: the shipped default store, DRAM tier ``dram_mib``, SSD tier ``ssd_mib``, idle
  demotion off (as shipped), no hints;
* ``half``: the same store with half the DRAM, ``idle_demotion.after_s`` = ``idle_after_s`` and
  the prefetch-hint endpoint; ``hint_lead_s`` before each of its requests the harness sends the
  request's token ids as a hint (an agent framework calling it when the tool finished).

The SSD tier holds the whole trace on both (``ssd_mib`` above its distinct KV), so the budget that
differs is DRAM alone: what it costs is reads from the SSD instead of DRAM, which is why both
stacks' SSD files are dropped from the page cache before every request (device reads). LMCache's
L1 only stages (as in the e2e replay). Targets (issue 16): ``half``'s hit rate >= ``full``'s,
its total prefill (sum of TTFT) <= 1.05x with a 95 % interval, prefetch waste (moved, evicted
unread) <= 10 %.

    sudo python experiments/infinity_replay.py --out /tmp/infinity
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from kvshrink.benchmarks import device_reads as dr
from kvshrink.benchmarks.comparison import OURS, Budget, TierPolicy
from kvshrink.benchmarks.e2e_paired import (BYTES_PER_TOKEN, MIB, Arrangement, PairedSettings, Sample, Stack,
                                            distinct_chunks, l1_headroom_for, largest_request_bytes,
                                            replay_arrangement, rotated, side_figures, trace_requests)
from kvshrink.benchmarks.paired_stats import difference_of_rates, ratio_of_sums, verdict
from kvshrink.benchmarks.tier_ttft import prefetch_stats, send_hint, with_hints_and_idle_demotion

PREFILL_TARGET = 1.05  # half / full total prefill
WASTE_TARGET = 0.10  # prefetched chunks evicted before they were read / moved


@dataclass(frozen=True)
class InfinitySettings:
    dram_mib: float = 16.0  # the full DRAM budget; ``half`` gets half of it
    ssd_mib: float = 96.0  # above the trace's distinct KV (~63 MiB): both hold every chunk
    idle_after_s: float = 20.0  # about the time between a session's turns in this replay
    hint_lead_s: float = 1.0
    drop_page_cache: bool = True
    max_tokens: int = 4
    # the agent trace its figures were measured on (docs/bench/infinity-replay.json): the e2e
    # section's trace until it grew to 8 sessions; kept so that the figures can be rerun
    trace: tuple[tuple[str, Any], ...] = (
        ("sessions", 6), ("turns", 4), ("concurrency", 6), ("system_tokens", 128), ("first_user_tokens", 384),
        ("tokens_per_turn", 32), ("output_tokens", 16), ("agents", 1), ("think_s", 20.0), ("seed", 0))


class InfinityReplay:
    """The two stacks and the replay; ``run`` returns a JSON-able dict and leaves nothing running."""

    def __init__(self, model: Path, settings: InfinitySettings = InfinitySettings(), template: Path | None = None,
                 log_dir: Path | None = None, progress: Callable[[str], None] = lambda s: None) -> None:
        self.model, self.settings, self.template, self.progress = model, settings, template, progress
        self.paired = PairedSettings(trace=dict(settings.trace))
        self.root = Path(tempfile.mkdtemp(prefix="kvshrink-infinity-"))
        self.log_dir = Path(log_dir or self.root / "logs")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.full = Stack("full", OURS, self.root, self.log_dir, self.paired.chunk_tokens)
        self.half = Stack("half", OURS, self.root, self.log_dir, self.paired.chunk_tokens)
        self.hint_url = ""

    def _arrangements(self, headroom: float) -> list[Arrangement]:
        s = self.settings
        full = replay_arrangement("ours", Budget(s.dram_mib, s.ssd_mib), headroom, self.full.workdir,
                                  self.full.shm_name, self.template)
        base = replay_arrangement("ours", Budget(s.dram_mib / 2, s.ssd_mib), headroom, self.half.workdir,
                                  self.half.shm_name, self.template)
        half, self.hint_url = with_hints_and_idle_demotion(
            base, self.model, s.idle_after_s, 0.5,
            TierPolicy(f"KVShrink: shipped default store {s.dram_mib / 2:g} MiB DRAM + {s.ssd_mib:g} MiB SSD, "
                       f"idle_demotion.after_s {s.idle_after_s:g}, prefetch hints {s.hint_lead_s:g} s ahead "
                       "(L1 only stages)", "exclusive", 0.0, True))
        return [full, half]

    def run(self) -> dict[str, Any]:
        from kvshrink.benchmarks.comparison import digest, model_fingerprint
        from kvshrink.testing.derived_stores import store_record

        s = self.settings
        requests = trace_requests(self.paired, self.model)
        distinct_mib = distinct_chunks(requests, self.paired.chunk_tokens) * self.paired.chunk_tokens * BYTES_PER_TOKEN / MIB
        if s.ssd_mib < distinct_mib:
            raise ValueError(f"ssd_mib {s.ssd_mib} is below the trace's distinct KV ({distinct_mib:.0f} MiB): "
                             "the comparison needs an SSD tier that holds every chunk")
        stacks = [self.full, self.half]
        try:
            self.progress("starting the cache servers and vLLM")
            headroom = l1_headroom_for(requests)
            for st, arrangement in zip(stacks, self._arrangements(headroom)):
                st.launch_cache(arrangement)
            for st in stacks:
                st.server.wait_healthy()
            for st in stacks:
                st.launch_vllm(self.model)
            for st in stacks:
                st.wait_ready()
            samples = self._replay(requests)
            stats = prefetch_stats(self.hint_url)
            held = {st.key: st.held() for st in stacks}
            engine = {st.key: _engine(st) for st in stacks}
        finally:
            for st in stacks:
                st.close()
            for st in stacks:
                shutil.rmtree(st.workdir, ignore_errors=True)
        figures = {k: {**side_figures(v), "held_chunks": held[k]["chunks"], "held_bytes": held[k]["bytes"]}
                   for k, v in samples.items()}
        prefill = ratio_of_sums([x.ttft_s for x in samples["half"]], [x.ttft_s for x in samples["full"]])
        points = difference_of_rates([x.hit_tokens for x in samples["half"]], [x.hit_tokens for x in samples["full"]],
                                     [x.prompt_tokens for x in samples["half"]])
        moved = stats["store"].get("prefetch_moved", 0)
        waste = stats["store"].get("prefetch_wasted", 0) / moved if moved else 0.0
        return {"settings": asdict(s), "trace": digest(*[list(r.token_ids) for r in requests]),
                "model": model_fingerprint(self.model), "store_config": store_record(self.template),
                "requests": len(requests), "distinct_kv_mib": distinct_mib, "figures": figures,
                "policies": {st.key: vars(st.arrangement.policy) for st in stacks},
                "prefill_ratio": {**prefill, "target": PREFILL_TARGET, "verdict": verdict(prefill, PREFILL_TARGET)},
                "hit_rate_points": {**points, "target": 0.0,
                                    "verdict": verdict(points, 0.0, higher_is_better=True)},
                "prefetch": stats, "engine": engine,
                "waste": {"value": waste, "target": WASTE_TARGET, "verdict": "met" if waste <= WASTE_TARGET else "not met"},
                "samples": {k: [asdict(x) for x in v] for k, v in samples.items()}}

    def _replay(self, requests: Sequence[Any]) -> dict[str, list[Sample]]:
        s = self.settings
        samples: dict[str, list[Sample]] = {"full": [], "half": []}
        need = largest_request_bytes(requests)
        for i, r in enumerate(requests):
            prompt = [int(t) for t in r.token_ids]
            for st in rotated([self.full, self.half], i):
                self.progress(f"agent replay: {i + 1}/{len(requests)} on {st.key}")
                st.wait_l1_room(need)
                if s.drop_page_cache:
                    dr.drop_cached([st.arrangement.disk])
                if st is self.half:
                    send_hint(self.hint_url, prompt, session_id=str(r.session_id))
                time.sleep(s.hint_lead_s)  # both stacks wait alike
                sample = st.request(prompt, max_tokens=s.max_tokens)
                st.wait_idle()
                samples[st.key].append(sample)
        return samples


def _engine(st: Stack) -> dict[str, Any]:
    from kvshrink.testing.mp_observe import adapter_status

    engine = adapter_status(st.server.http_url)["store"]["engine"]
    return {k: v for k, v in engine.items() if k.startswith(("idle_", "prefetch_", "demotion"))}


def report_lines(result: dict[str, Any]) -> list[str]:
    f, p, h, w = result["figures"], result["prefill_ratio"], result["hit_rate_points"], result["waste"]
    s = result["settings"]
    return [f"KV Infinity on the agent replay ({result['requests']} requests, {result['distinct_kv_mib']:.0f} MiB of "
            f"distinct KV; SSD tier {s['ssd_mib']:g} MiB on both):",
            f"  full DRAM {s['dram_mib']:g} MiB, no demotion: hit {f['full']['hit_rate']:.1%}, prefill "
            f"{f['full']['prefill_s']:.1f} s, TTFT p50 {f['full']['ttft_p50_s']:.2f} s",
            f"  half DRAM {s['dram_mib'] / 2:g} MiB, idle demotion {s['idle_after_s']:g} s + hints: hit "
            f"{f['half']['hit_rate']:.1%}, prefill {f['half']['prefill_s']:.1f} s, TTFT p50 {f['half']['ttft_p50_s']:.2f} s",
            f"  hit rate half - full {h['value'] * 100:+.1f} points (95 % {h['low'] * 100:+.1f} to {h['high'] * 100:+.1f}) "
            f"(target >= 0) {h['verdict']}",
            f"  prefill half / full {p['value']:.3f} (95 % {p['low']:.3f}-{p['high']:.3f}) (target <= {p['target']}) "
            f"{p['verdict']}",
            f"  prefetch waste {w['value']:.1%} of {result['prefetch']['store'].get('prefetch_moved', 0)} moved "
            f"(target <= {w['target']:.0%}) {w['verdict']}; idle demotions {result['engine']['half'].get('idle_demotions', 0)}"]


def main(argv: Sequence[str] | None = None) -> int:
    from tqdm import tqdm

    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for infinity-replay.json and the logs")
    parser.add_argument("--store-config", type=Path, default=None, help="our store file (default: the shipped one)")
    parser.add_argument("--idle-after", type=float, default=InfinitySettings.idle_after_s)
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="kvshrink-infinity-out-"))
    out.mkdir(parents=True, exist_ok=True)
    settings = InfinitySettings(idle_after_s=args.idle_after)
    with tqdm(desc="KV Infinity replay", bar_format="{desc}: {elapsed} {postfix}") as bar:
        result = InfinityReplay(ensure_checkpoint(), settings, args.store_config, out / "logs",
                                bar.set_postfix_str).run()
    (out / "infinity-replay.json").write_text(json.dumps(result, indent=1))
    print("\n".join(report_lines(result)))
    print(f"\n{out / 'infinity-replay.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
