"""TTFT on vLLM where bytes are the bottleneck: warm from SSD at device speed, from a remote tier
across a shaped link, and on a second node from the shared tier -- ours vs stock LMCache.

A 4K-token prompt (real text), prefilled once per stack, then requested again with LMCache's L1
cleared before every request, so each one loads its KV from the tier under test. Stacks are
``e2e_paired.Stack``: a real ``lmcache server`` with its own vLLM CPU (SmolLM2 bf16, prefix cache
off), TTFT = the first streamed token, hits from LMCache's own counters. Each row is a set of pairs
in alternating order; its ratio is the median of the paired ratios with a 95 % bootstrap interval,
and a verdict only where the interval clears the target.

* **SSD** (``ssd``: the shipped default store, ``configs/store-default.yaml``, vs stock's
  ``fs_native`` on the same disk): both cache servers restarted after the prefill, so ours reads
  its SSD tier (its DRAM arena is gone; a clean close copied it down) and stock its files; the
  device rows run against stock's ``fs_native`` buffered and with ``use_odirect`` (the same files),
  and each keeps stock's better one, named in its label. Rows:
  ``page cache`` (both sides' files read into the page cache before every request,
  ``device_reads.read_into_cache``: memory speed, labelled), ``L1 floor`` (before the restart,
  from the prefill's chunks in LMCache's L1, not cleared: no L2 read at all, the TTFT under every
  ssd row: the reads are a small part of TTFT; each throttled row notes the best ratio reading fewer
  bytes could reach, :func:`read_bound_note`), ``device`` (both sides' files
  dropped from the page cache before every request, ``device_reads.drop_cached``; the disk's own
  sequential read speed measured in the same run) and ``<N> MB/s device`` (also both cache
  servers' reads capped together with a cgroup v1 blkio throttle: a network-attached volume class).
* **remote** (labelled: ours runs the Redis tier of ``configs/store-dram-ssd-redis.yaml`` alone):
  each side's own ``redis-server`` in a network namespace behind a veth pair shaped with ``tc`` to
  ``link_mbit`` each way; stock = LMCache's RESP adapter. Stock's Redis was filled by stock's own
  prefill (its L2 adapters: ``fs_native`` and RESP, LMCache stores to both), ours' by another node:
* **cross-node**: node A (ours: the shipped default + a Redis-tier adapter) prefills the prompt;
  node B (its own cache server and vLLM, nothing local, the same Redis) serves it from the shared
  tier. B's first request is the cross-node row (hits on B, output equal to A's cold output), and
  it is compared with the cold TTFT of the same prompt on A (same engine, same settings).

* **resume** (KV Infinity, ours vs ours): ours restarted with idle demotion on (``idle_after_s``, a
  setting of the shipped YAML, off there by default: labelled) and the prefetch-hint endpoint
  (:mod:`kvshrink.storage_backends.prefetch_hints`). Each step, in rotating order: the session's KV
  in our DRAM tier (a hint, waited for); resumed from SSD (demoted while idle, page cache dropped)
  with the hint sent ``hint_lead_s`` before the request (an agent framework calling it when a
  tool finishes); the same without a hint. Rows: each over the DRAM case.

Needs root for the throttle and the namespaces; rows this machine cannot run are skipped with the
reason. Cold prefills dominate: ~2 minutes each at 4K tokens on 2 AVX2 cores, three of them.

    sudo python experiments/run_phase.py tiers --out /tmp/tier-ttft   (one phase alone; kvshrink bench --sections tiers)
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import httpx

from kvshrink.benchmarks import device_reads as dr
from kvshrink.benchmarks import remote_link as rl
from kvshrink.benchmarks.comparison import OURS, STOCK, TierPolicy
from kvshrink.benchmarks.e2e_paired import (Arrangement, E2EError, Sample, Stack, hot_prompt, ours_adapter, rotated,
                                            reconfigure, stock_fs_native)
from kvshrink.benchmarks.paired_stats import paired_ratio, verdict

RESUME_TARGET = 1.15  # KV Infinity: resumed from SSD with a hint 1 s ahead / the same with the KV in DRAM
SSD_DEVICE_TARGET = 1.0  # ours / stock warm-from-SSD TTFT, cache dropped, this disk
SSD_SLOW_TARGET = 0.80  # the same on the throttled device class (we read ~0.68x the bytes)
CROSS_NODE_TARGET = 0.35  # node B from the shared tier / cold
STOCK_REDIS_PORT, OURS_REDIS_PORT = 6379, 6380
ROW_GROUPS = ("cross-node", "ssd", "resume", "remote")


@dataclass(frozen=True)
class TierTTFTSettings:
    prompt_tokens: int = 4096
    pairs: int = 10
    chunk_tokens: int = 256  # LMCache's default
    l1_mib: float = 512  # room for the prompt's chunks while they load; cleared before every request
    throttle_mb_s: tuple[int, ...] = (500,)
    link_mbit: int = 1000
    max_tokens: int = 8
    resume: bool = True  # the KV Infinity rows (prefetch hint vs KV in DRAM)
    hint_lead_s: float = 1.0  # how long before the request the hint is sent
    rows: tuple[str, ...] = ROW_GROUPS  # which row groups run (the SSD rows alone: ("ssd",))
    idle_after_s: float = 3.0  # idle demotion in the resume rows: a waiting session's KV leaves DRAM


@dataclass
class Row:
    """One measured row: paired samples of both sides and the verdict against its target."""

    name: str
    label: str
    stock: list[dict[str, Any]]
    ours: list[dict[str, Any]]
    target: float | None = None
    policies: dict[str, dict[str, Any]] = field(default_factory=dict)  # stack key -> its TierPolicy, as run
    stock_variants: dict[str, Any] = field(default_factory=dict)  # stock's other settings' runs of this row
    ratio: dict[str, Any] = field(default_factory=dict)
    verdict: str = "reported"

    def settle(self) -> "Row":
        r = paired_ratio([x["ttft_s"] for x in self.ours], [x["ttft_s"] for x in self.stock]).as_dict()
        self.ratio = r
        if self.target is not None:
            self.verdict = verdict({"low": r["low"], "high": r["high"]}, self.target)
        return self


def _ours_remote(server: Any) -> dict[str, Any]:
    from kvshrink.storage_backends.mp_l2_adapter import DEFAULT_WORKERS

    return rl.ours_spec(server, DEFAULT_WORKERS)


class TierTTFT:
    """The three stacks and the phases; ``run`` returns a JSON-able dict and never leaves a
    process, namespace or throttle group behind."""

    def __init__(self, model: Path, settings: TierTTFTSettings = TierTTFTSettings(), template: Path | None = None,
                 log_dir: Path | None = None, progress: Callable[[str], None] = lambda s: None) -> None:
        self.model, self.settings, self.template, self.progress = model, settings, template, progress
        self.root = Path(tempfile.mkdtemp(prefix="kvshrink-tier-ttft-"))
        self.log_dir = Path(log_dir or self.root / "logs")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        chunk = settings.chunk_tokens
        self.stock = Stack("stock", STOCK, self.root, self.log_dir, chunk)
        self.ours = Stack("ours", OURS, self.root, self.log_dir, chunk)  # node A
        self.node_b = Stack("ours-node-b", OURS, self.root, self.log_dir, chunk)
        self.stacks = [self.stock, self.ours, self.node_b]
        self.notes: list[str] = []
        self.redis: dict[str, Any] = {}  # side -> its redis-server behind the link

    # -- arrangements ----------------------------------------------------------------------------
    def _stock_ssd(self, *extra: dict[str, Any], odirect: bool = False) -> Arrangement:
        disk = self.stock.workdir / "l2"
        adapter = {**stock_fs_native(disk, 4096), "use_odirect": odirect}
        how = "fs_native O_DIRECT" if odirect else "fs_native"
        return Arrangement(self.settings.l1_mib, adapter,
                           TierPolicy(f"stock: L1 {self.settings.l1_mib:.0f} MiB (cleared) + {how}", "inclusive",
                                      self.settings.l1_mib, True), disk=disk, extra_adapters=tuple(extra))

    def _ours_ssd(self, *extra: dict[str, Any]) -> Arrangement:
        disk = self.ours.workdir / "l2"
        return Arrangement(self.settings.l1_mib, ours_adapter(disk, self.ours.shm_name, 1024, 4096, self.template),
                           TierPolicy(f"KVShrink: L1 {self.settings.l1_mib:.0f} MiB (cleared) + shipped default store",
                                      "exclusive", self.settings.l1_mib, False), shm_name=self.ours.shm_name,
                           disk=disk, extra_adapters=tuple(extra))

    def _remote(self, adapter: dict[str, Any], who: str) -> Arrangement:
        return Arrangement(self.settings.l1_mib, adapter,
                           TierPolicy(f"{who}: L1 {self.settings.l1_mib:.0f} MiB (cleared) + Redis across the link",
                                      "single", self.settings.l1_mib, False))

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        from kvshrink.benchmarks.comparison import digest, model_fingerprint
        from kvshrink.testing.derived_stores import store_record

        s = self.settings
        prompt = hot_prompt(self.model, s.prompt_tokens)
        out: dict[str, Any] = {"settings": asdict(s), "prompt": digest(prompt), "model": model_fingerprint(self.model),
                               "store_config": store_record(self.template), "rows": [], "notes": self.notes}
        unknown = set(s.rows) - set(ROW_GROUPS)
        if unknown:
            raise E2EError(f"unknown row groups {sorted(unknown)}: choose from {', '.join(ROW_GROUPS)}")
        try:
            with contextlib.ExitStack() as stack:
                wants_redis = "cross-node" in s.rows or "remote" in s.rows
                redis = self.redis = self._remote_servers(stack) if wants_redis else {}
                self._launch(redis)
                before = {side: rl.stored_bytes(server) for side, server in redis.items()}
                cold = self._cold(prompt)
                out["cold_ttft_s"] = {k: v.ttft_s for k, v in cold.items()}
                if redis:
                    cached = len(prompt) // s.chunk_tokens * s.chunk_tokens
                    grown = {side: [a - b for a, b in zip(rl.stored_bytes(server), before[side])]
                             for side, server in redis.items()}
                    out["redis_stored"] = {side: {"bytes": g[0], "keys": g[1], "tokens": cached} for side, g in grown.items()}
                    out["redis_bytes_per_token"] = {side: g[0] / cached for side, g in grown.items()}
                    if "cross-node" in s.rows:
                        out["rows"].append(self._cross_node(prompt, cold).__dict__)
                if "ssd" in s.rows:
                    out["rows"] += [r.__dict__ for r in self._ssd_rows(prompt, out)]
                if s.resume and "resume" in s.rows:
                    out["rows"] += [r.__dict__ for r in self._resume_rows(prompt, out)]
                if redis and "remote" in s.rows:
                    remote = self._remote_row(prompt)
                    out["rows"].append(remote.__dict__)
                    if "cross-node" in s.rows:
                        _cross_node_interval(out["rows"][0], remote, cold["ours"].ttft_s)
        finally:
            for st in self.stacks:
                st.close()
            for st in self.stacks:
                shutil.rmtree(st.workdir, ignore_errors=True)
        return out

    def _remote_servers(self, stack: contextlib.ExitStack) -> dict[str, Any]:
        """Each side's Redis behind the shaped link, or none (noted) where the machine refuses."""
        try:
            link = stack.enter_context(rl.limited_link(self.settings.link_mbit))
        except rl.LinkUnavailable as exc:
            self.notes.append(f"remote and cross-node rows: skipped ({exc})")
            return {}
        servers = {}
        for side, port in ((STOCK, STOCK_REDIS_PORT), (OURS, OURS_REDIS_PORT)):
            workdir = self.root / f"redis-{side}"
            workdir.mkdir()
            servers[side] = stack.enter_context(rl.redis_across(link, workdir, port))
        return servers

    def _launch(self, redis: dict[str, Any]) -> None:
        self.progress("starting the cache servers and vLLM")
        stock_extra = (rl.stock_spec(redis[STOCK]),) if redis else ()
        ours_extra = (_ours_remote(redis[OURS]),) if redis else ()
        arrangements = [self._stock_ssd(*stock_extra), self._ours_ssd(*ours_extra)]
        stacks = [self.stock, self.ours]
        if redis:
            arrangements.append(self._remote(_ours_remote(redis[OURS]), "KVShrink node B"))
            stacks.append(self.node_b)
        else:
            self.stacks.remove(self.node_b)
        for st, arrangement in zip(stacks, arrangements):
            st.launch_cache(arrangement)
        for st in stacks:
            st.server.wait_healthy()
        for st in stacks:
            st.launch_vllm(self.model, max_model_len=self.settings.prompt_tokens + 256)
        for st in stacks:
            st.wait_ready()

    def _request(self, st: Stack, prompt: list[int]) -> Sample:
        sample = st.request(prompt, max_tokens=self.settings.max_tokens)
        st.wait_idle()
        return sample

    def _cold(self, prompt: list[int]) -> dict[str, Sample]:
        cold = {}
        for st in (self.stock, self.ours):
            self.progress(f"cold prefill of {len(prompt)} tokens on {st.key}")
            cold[st.key] = self._request(st, prompt)
            if cold[st.key].hit_tokens:
                raise E2EError(f"{st.key}: the cold request hit {cold[st.key].hit_tokens:.0f} tokens")
        return cold

    def _cross_node(self, prompt: list[int], cold: dict[str, Sample]) -> Row:
        self.progress("cross-node: node B")
        first = self._request(self.node_b, prompt)
        cached = len(prompt) // self.settings.chunk_tokens * self.settings.chunk_tokens
        if first.hit_tokens < cached - self.settings.chunk_tokens:
            raise E2EError(f"node B hit {first.hit_tokens:.0f} of the {cached} tokens node A stored")
        self.notes.append(f"cross-node: node B hit {first.hit_tokens:.0f} tokens from the shared tier; its output "
                          f"{'equals' if first.text == cold['ours'].text else 'DIFFERS FROM'} node A's cold output")
        return Row("cross-node", "node B from the shared Redis / the same prompt cold on node A (same engine)",
                   [asdict(cold["ours"])], [asdict(first)], CROSS_NODE_TARGET, _policies(self.ours, self.node_b))

    def _ssd_rows(self, prompt: list[int], out: dict[str, Any]) -> list[Row]:
        """The L1 floor row first (the prefill's chunks still in LMCache's L1), then restart both
        cache servers on their SSD arrangement only; the page cache row, then the
        device and throttled rows once against each of stock's sensible ``fs_native`` settings
        (buffered, O_DIRECT: the same files), each row keeping stock's better one."""
        # first, while the prefill's chunks are still in LMCache's L1 (a chunk loaded from L2 is not kept there)
        floor_row = self._pairs("ssd, L1 floor", "warm from LMCache's L1 (not cleared): no L2 read, the floor under "
                                "every ssd row", prompt, None, from_l1=True)
        self.progress("restarting on the SSD tier")
        pair = [self.stock, self.ours]
        reconfigure(pair, [self._stock_ssd(), self._ours_ssd()], wipe=False)
        disks = [st.arrangement.disk for st in pair]
        out["device_read_gbps"] = dr.sequential_read_gbps(disks[0])
        rows = [self._pairs("ssd, page cache", "warm from SSD, files in the page cache (memory speed)", prompt, None,
                            cache=disks),
                floor_row]
        by_variant: dict[str, list[Row]] = {}
        for variant, odirect in (("buffered", False), ("O_DIRECT", True)):
            if odirect:
                reconfigure([self.stock], [self._stock_ssd(odirect=True)], wipe=False)
            by_variant[variant] = list(self._device_rows(prompt, disks, out["device_read_gbps"]))
        for candidates in zip(*by_variant.values()):
            medians = {v: statistics.median(x["ttft_s"] for x in row.stock) for v, row in zip(by_variant, candidates)}
            best = min(medians, key=medians.get)
            row = candidates[list(by_variant).index(best)]
            row.label += (f"; stock at its best: fs_native {best} (median " +
                          ", ".join(f"{v} {m:.2f} s" for v, m in medians.items()) + ")")
            row.stock_variants = {v: {"stock": r.stock, "ours": r.ours, "ratio": r.ratio, "verdict": r.verdict}
                                  for v, r in zip(by_variant, candidates) if v != best}
            rows.append(row)
            if row.name != "ssd, device":
                self.notes.append(read_bound_note(row, int(row.name.split()[1]) * 10**6))
        return rows

    def _device_rows(self, prompt: list[int], disks: list[Path], device_gbps: float) -> Iterator[Row]:
        pair = [self.stock, self.ours]
        yield self._pairs("ssd, device", f"warm from SSD, page cache dropped (disk reads {device_gbps:.2f} GB/s "
                          "sequentially)", prompt, SSD_DEVICE_TARGET, drop=disks)
        for mb_s in self.settings.throttle_mb_s:
            pids = [pid for st in pair for pid in _pids(st)]
            try:
                with dr.throttled_reads(disks[0], mb_s * 10**6, pids):
                    yield self._pairs(f"ssd, {mb_s} MB/s device", f"warm from SSD, cache dropped, both cache servers' "
                                      f"reads capped at {mb_s} MB/s (cgroup v1 blkio)", prompt, SSD_SLOW_TARGET,
                                      drop=disks)
            except dr.DeviceUnavailable as exc:
                if f"ssd, {mb_s} MB/s device: skipped ({exc})" not in self.notes:
                    self.notes.append(f"ssd, {mb_s} MB/s device: skipped ({exc})")

    def _resume_rows(self, prompt: list[int], out: dict[str, Any]) -> list[Row]:
        """KV Infinity on ours alone: the shipped default with idle demotion on (``idle_after_s``)
        and the prefetch-hint endpoint. Each step, in rotating order: the session's KV in our DRAM
        tier (a hint, waited for); resumed from SSD (demoted while idle, page cache dropped) with
        the hint sent ``hint_lead_s`` before the request; the same without a hint."""
        s, ours = self.settings, self.ours
        arrangement, url = with_hints_and_idle_demotion(
            self._ours_ssd(), self.model, s.idle_after_s, 0.25,
            TierPolicy(f"KVShrink: L1 {s.l1_mib:.0f} MiB (cleared) + shipped default store, "
                       f"idle_demotion.after_s {s.idle_after_s:g} + prefetch hints", "exclusive", s.l1_mib, False))
        self.progress("resume: restarting ours with hints and idle demotion")
        reconfigure([ours], [arrangement], wipe=False)
        chunks = len(prompt) // s.chunk_tokens
        samples: dict[str, list[dict[str, Any]]] = {"dram": [], "hint": [], "no hint": []}
        for step in range(s.pairs):
            for case in rotated(list(samples), step):
                self.progress(f"resume: {case} {step + 1}/{s.pairs}")
                self._wait_dram(lambda n: n == 0, "idle demotion to empty our DRAM tier")
                ours.clear_l1()
                if case == "dram":
                    send_hint(url, prompt)
                    self._wait_dram(lambda n: n >= chunks, f"the hint to bring {chunks} chunks to DRAM")
                else:
                    dr.drop_cached([arrangement.disk])
                    if case == "hint":
                        send_hint(url, prompt)
                        time.sleep(s.hint_lead_s)
                sample = self._request(ours, prompt)
                samples[case].append({**asdict(sample), "dram_chunks_after": self._dram_chunks()})
        out["prefetch_stats"] = prefetch_stats(url)
        policies = {"dram": vars(arrangement.policy), "ours": vars(arrangement.policy)}
        return [Row(f"resume, {case}", f"KV Infinity: session resumed from SSD (idle-demoted, page cache dropped) "
                    f"{'with a prefetch hint ' + format(s.hint_lead_s, 'g') + ' s ahead' if case == 'hint' else 'without a hint'}"
                    " / the same session with its KV in our DRAM tier (ours vs ours)",
                    samples["dram"], samples[case], RESUME_TARGET if case == "hint" else None, policies).settle()
                for case in ("hint", "no hint")]

    def _dram_chunks(self) -> int:
        from kvshrink.testing.mp_observe import adapter_status

        return int(adapter_status(self.ours.server.http_url)["store"]["tiers"]["dram"]["chunks"])

    def _wait_dram(self, ok: Callable[[int], bool], what: str, timeout: float = 60.0) -> None:
        from kvshrink.testing.polling import poll_until

        poll_until(lambda: ok(self._dram_chunks()), timeout, interval=0.1, what=what, error=E2EError)

    def _remote_row(self, prompt: list[int]) -> Row:
        """Stock restarted on its RESP adapter alone, against node B (Redis only)."""
        self.progress("remote tier")
        self.ours.close()  # done with node A: its cores go back to the other stacks
        reconfigure([self.stock], [self._remote(rl.stock_spec(self.redis[STOCK]), "stock")], wipe=False)
        return self._pairs_between("remote", f"warm from Redis across a {self.settings.link_mbit / 1000:g} Gbit/s "
                                   "link (ours: chunks node A stored; the Redis tier alone)", prompt, self.stock,
                                   self.node_b)

    def _pairs(self, name: str, label: str, prompt: list[int], target: float | None,
               drop: Sequence[Path] = (), from_l1: bool = False, cache: Sequence[Path] = ()) -> Row:
        return self._pairs_between(name, label, prompt, self.stock, self.ours, target, drop, from_l1, cache)

    def _pairs_between(self, name: str, label: str, prompt: list[int], stock: Stack, ours: Stack,
                       target: float | None = None, drop: Sequence[Path] = (), from_l1: bool = False,
                       cache: Sequence[Path] = ()) -> Row:
        """Pairs in alternating order, L1 cleared before each request (``from_l1``: kept, so every
        request loads from LMCache's L1 and checks that it did). Before each request the files
        under ``drop`` leave the page cache and those under ``cache`` are read into it."""
        samples: dict[str, list[dict[str, Any]]] = {stock.key: [], ours.key: []}
        cached = len(prompt) // self.settings.chunk_tokens * self.settings.chunk_tokens
        tier = "L1" if from_l1 else "L2"
        for st in (stock, ours):  # not measured: after a restart the first request also pays for lazy
            if not from_l1:       # imports and opens (read from the disk on a busy machine), and the
                st.clear_l1()     # page cache row needs the files read once
            self._request(st, prompt)
        for step in range(self.settings.pairs):
            self.progress(f"{name}: {step + 1}/{self.settings.pairs}")
            for st in rotated([stock, ours], step):
                if not from_l1:
                    st.clear_l1()
                if drop:
                    dr.drop_cached(drop)
                if cache:  # a warm-up request alone left a part of stock's files on the disk (CI, 2 MiB)
                    dr.read_into_cache(cache)
                before = _device_read_bytes(st)
                sample = self._request(st, prompt)
                record = {**asdict(sample), "device_read_bytes": _device_read_bytes(st) - before}
                loaded = sample.l1_hit_tokens if from_l1 else sample.l2_hit_tokens
                if loaded < cached - self.settings.chunk_tokens:
                    raise E2EError(f"{name}: {st.key} loaded {loaded:.0f} tokens from {tier}, not ~{cached}")
                samples[st.key].append(record)
        return Row(name, label, samples[stock.key], samples[ours.key], target, _policies(stock, ours)).settle()


def read_bound_note(row: Row, read_bps: float) -> str:
    """What reading fewer bytes can win on a throttled row at most: stock's median TTFT less the
    time the bytes ours does not read take at ``read_bps`` (decode counted as free), over stock's
    median. Where that exceeds the row's target, no read path can meet it on this engine."""
    stock_s = statistics.median(x["ttft_s"] for x in row.stock)
    saved = (statistics.median(x["device_read_bytes"] for x in row.stock)
             - statistics.median(x["device_read_bytes"] for x in row.ours))
    best = (stock_s - saved / read_bps) / stock_s
    return (f"{row.name}: reading {saved / 1e6:.1f} MB less saves at most {saved / read_bps * 1e3:.0f} ms of stock's "
            f"median {stock_s:.2f} s, so ours / stock >= {best:.3f} (target {row.target:g}) even with a free decode")


def _cross_node_interval(row: dict[str, Any], remote: Row, cold_s: float) -> None:
    """Node B's requests (its first, then the remote row's) over node A's cold TTFT: the median
    with a bootstrap interval over B's requests (the cold TTFT is one request)."""
    ttfts = [row["ours"][0]["ttft_s"]] + [x["ttft_s"] for x in remote.ours]
    r = paired_ratio(ttfts, [cold_s] * len(ttfts)).as_dict()
    row.update(ratio={**r, "first_request": ttfts[0] / cold_s}, verdict=verdict(r, CROSS_NODE_TARGET))


def lmcache_model_name(model: Path) -> str:
    """The model name LMCache's keys carry: vLLM's ``model_config.model``, the path it loaded (not
    ``--served-model-name``; LMCache's mp connector)."""
    return str(model)


def with_hints_and_idle_demotion(base: Arrangement, model: Path, idle_after_s: float, scan_interval_s: float,
                                 policy: TierPolicy) -> tuple[Arrangement, str]:
    """``base`` (ours) with idle demotion on in its store and the prefetch-hint server module on a
    free loopback port; returns the arrangement and the hint endpoint's base URL."""
    from kvshrink.storage_backends.serve_cache import HINTS_MODULE
    from kvshrink.testing.processes import free_port

    port = free_port()
    hints = {"module_path": HINTS_MODULE, "config": {"port": port, "model_name": lmcache_model_name(model)}}
    store = {**base.adapter["adapter_params"]["store"],
             "idle_demotion": {"after_s": idle_after_s, "scan_interval_s": scan_interval_s, "max_per_scan": 256}}
    arrangement = Arrangement(base.l1_mib, {**base.adapter, "adapter_params": {"store": store}}, policy,
                              shm_name=base.shm_name, disk=base.disk, l1_headroom_mib=base.l1_headroom_mib,
                              extra_args=("--server-module", json.dumps(hints)))
    return arrangement, f"http://127.0.0.1:{port}"


def prefetch_stats(url: str) -> dict[str, Any]:
    """The hint endpoint's counters and the store's ``prefetch_*`` counters."""
    return httpx.get(f"{url}/v1/prefetch/stats", timeout=10).json()


def send_hint(url: str, prompt: list[int], session_id: str = "bench") -> dict[str, Any]:
    """POST a prefetch hint to a cache server's hint endpoint; raises E2EError unless accepted."""
    reply = httpx.post(f"{url}/v1/prefetch", json={"token_ids": prompt, "session_id": session_id}, timeout=10)
    if reply.status_code != 202:
        raise E2EError(f"the prefetch hint was refused: {reply.status_code} {reply.text}")
    return reply.json()


def _policies(*stacks: Stack) -> dict[str, dict[str, Any]]:
    return {st.key: vars(st.arrangement.policy) for st in stacks}


def _pids(st: Stack) -> list[int]:
    from kvshrink.testing.processes import group_pids

    return group_pids(st.server.proc.pid)


def _device_read_bytes(st: Stack) -> int:
    """Bytes the cache server's processes have had read from storage (``/proc/<pid>/io``
    ``read_bytes``): shows that a "device" row read the device, and at what rate."""
    total = 0
    for pid in _pids(st):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                if line.startswith("read_bytes:"):
                    total += int(line.split()[1])
    return total
