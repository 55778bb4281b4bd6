"""Store / load GB/s through an LMCache MP L2 adapter: ours vs LMCache's stock ``fs`` adapter.

Adapters are built exactly as ``lmcache server`` / ``lmcache bench l2`` build them (the
``--l2-adapter`` JSON through ``parse_args_to_l2_adapters_config`` and ``create_l2_adapter``) and
timed with ``lmcache bench l2``'s own round runners (``bench_store`` / ``bench_load``). What we
change is the data: ``lmcache bench l2`` fills each object with one repeated byte, which any
compressor shrinks to nothing, so here every object holds a real SmolLM2 KV chunk (bf16
[2, 30, 256, 192]) and every load is checked bit-exact against what was stored.

Ours is always the shipped default store (``configs/store-default.yaml``, or ``--store-config``),
changed by :func:`kvshrink.testing.derived_stores.derive_store` only in paths, arena name and capacities, which
pick the tier that serves: "dram" = stock ``fs`` on ``/dev/shm`` (tmpfs) vs our store with room
for every chunk in its DRAM tier (shm arena); "ssd" = stock ``fs`` on a local directory vs our
store with a DRAM tier of one chunk, so every store passes through DRAM on to the SSD tier
(exclusive tiers: the chunk the next store evicts is demoted there, and ``persist_on_close`` moves
the last one) and loads come from the SSD tier (neither fsyncs per chunk as shipped; SSD reads right after
writes come from the page cache on both sides). "threads" = concurrent submits (``in_flight``) for
both sides, and our adapter's worker threads: not cores, so each side also reports the CPU seconds
its stores and loads took per GB (:class:`AdapterCpu`). Our side records the store file it used.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Sequence

from kvshrink.benchmarks.capacity_replay import ChunkPool
from kvshrink.benchmarks.comparison import OURS, STOCK, SideRun, TierPolicy, Workload, digest
from kvshrink.benchmarks.paired_stats import paired_ratio
from kvshrink.testing.derived_stores import derive_store, store_record
from kvshrink.errors import CorruptDataError, KVShrinkError

if TYPE_CHECKING:
    import torch

ADAPTER_MODULE = "kvshrink.storage_backends.mp_l2_adapter"
ADAPTER_CLASS = "KVShrinkL2Adapter"
TIERS = ("dram", "ssd")
ONE_CHUNK_SLACK = 1 << 20  # a DRAM tier of one chunk + this holds one compressed frame, never two


@dataclass(frozen=True)
class ThroughputSettings:
    keys_per_submit: int = 8
    rounds: int = 3
    warmup_rounds: int = 1


def stock_adapter_spec(tier: str, workdir: Path) -> dict[str, Any]:
    base = Path("/dev/shm") / workdir.name if tier == "dram" else workdir / "fs"
    return {"type": "fs", "base_path": str(base)}


def ours_adapter_spec(tier: str, workdir: Path, threads: int, capacity_bytes: int, chunk_bytes: int,
                      template: Path | None = None) -> dict[str, Any]:
    """Our adapter (``threads`` workers) over the store config (default: the shipped default) in
    private paths, sized so that ``tier`` serves: DRAM with room for ``capacity_bytes``, or DRAM of
    one chunk in front of an SSD tier of ``capacity_bytes``."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}")
    dram = capacity_bytes if tier == "dram" else chunk_bytes + ONE_CHUNK_SLACK
    store = derive_store(template, paths={"ssd": workdir / "kvshrink-ssd"},
                         shm_names={"dram": f"kvshrink-l2bench-{workdir.name}"},
                         capacities={"dram": dram, "ssd": capacity_bytes})
    return {"type": "plugin", "module_path": ADAPTER_MODULE, "class_name": ADAPTER_CLASS,
            "adapter_params": {"store": store, "workers": threads}}


@contextlib.contextmanager
def l2_adapter(spec: dict[str, Any], l1_buffer: "torch.Tensor") -> Iterator[Any]:
    """The adapter LMCache would build from ``--l2-adapter spec``."""
    from lmcache.cli.commands.bench.l2_adapter_bench.data import create_l1_memory_desc
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)]))
    adapter = create_l2_adapter(config.adapters[0], l1_memory_desc=create_l1_memory_desc(l1_buffer))
    try:
        yield adapter
    finally:
        adapter.close()


def kv_objects(buffer: "torch.Tensor", pool: Sequence["torch.Tensor"], count: int, offset: int,
               first_chunk: int | None) -> list[Any]:
    """``count`` bf16 KV MemoryObjs backed by ``buffer`` (the registered L1), filled from ``pool``
    starting at chunk ``first_chunk`` (``None``: left as is, for load targets)."""
    import torch
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    size = pool[0].numel() * pool[0].element_size()
    objs = []
    for i in range(count):
        start = offset + i * size
        raw = buffer[start:start + size]
        if raw.numel() != size:
            raise ValueError(f"L1 buffer too small for object {i}")
        if first_chunk is not None:
            raw.view(torch.int16).copy_(pool[(first_chunk + i) % len(pool)].reshape(-1).view(torch.int16))
        meta = MemoryObjMetadata(shape=pool[0].shape, dtype=torch.bfloat16, address=start, phy_size=size,
                                 fmt=MemoryFormat.KV_2LTD, ref_count=1)
        objs.append(TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None))
    return objs


def measure(spec: dict[str, Any], pool: Sequence["torch.Tensor"], threads: int,
            settings: ThroughputSettings,
            load_phase: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> dict[str, float]:
    """Store then load GB/s of ``rounds`` waves of ``threads`` x ``keys_per_submit`` real chunks;
    the loads run inside ``load_phase()`` (e.g. the page cache dropped, reads throttled)."""
    import torch
    from lmcache.cli.commands.bench.l2_adapter_bench.data import make_object_keys
    from lmcache.cli.commands.bench.l2_adapter_bench.runner import bench_load, bench_store

    size = pool[0].numel() * pool[0].element_size()
    wave = threads * settings.keys_per_submit
    buffer = torch.empty(2 * wave * size, dtype=torch.uint8)
    rounds = settings.warmup_rounds + settings.rounds

    def keys_for(r: int) -> list[list[Any]]:
        return [make_object_keys(settings.keys_per_submit, key_offset=r * wave + i * settings.keys_per_submit)
                for i in range(threads)]

    def store_objs(r: int) -> list[list[Any]]:
        return [kv_objects(buffer, pool, settings.keys_per_submit, i * settings.keys_per_submit * size,
                           r * wave + i * settings.keys_per_submit) for i in range(threads)]

    load_views: list[list[Any]] = []

    def load_objs(r: int) -> list[list[Any]]:
        load_views[:] = [kv_objects(buffer, pool, settings.keys_per_submit,
                                    (wave + i * settings.keys_per_submit) * size, None) for i in range(threads)]
        return load_views

    quiet = (lambda _msg: None)
    verified = 0
    cpu = AdapterCpu()
    with l2_adapter(spec, buffer) as adapter:
        store, store_cpu_s, store_wall_s = cpu.of(lambda: bench_store(
            adapter, threads, settings.keys_per_submit, size, rounds, keys_for, cpu.harness(store_objs), quiet))
        _check_complete("store", store)
        with load_phase():
            load, load_cpu_s, load_wall_s = cpu.of(lambda: bench_load(
                adapter, threads, settings.keys_per_submit, size, rounds, keys_for, cpu.harness(load_objs), quiet))
        _check_complete("load", load)
        # every round loads into the same buffers: check the last round's chunks bit-exact
        for i, objs in enumerate(load_views):
            for j, obj in enumerate(objs):
                expect = pool[((rounds - 1) * wave + i * settings.keys_per_submit + j) % len(pool)]
                if not torch.equal(obj.raw_data.view(torch.int16), expect.reshape(-1).view(torch.int16)):
                    raise CorruptDataError(f"{spec['type']} adapter loaded wrong bytes for key {j} of submit {i}")
                verified += 1
    measured_store = store.round_durations[settings.warmup_rounds:]
    measured_load = load.round_durations[settings.warmup_rounds:]
    wave_bytes = wave * size
    moved_gb = wave_bytes * rounds / 1e9  # the CPU figures count every round, the warm-up too
    return {"store_gbps": wave_bytes * len(measured_store) / sum(measured_store) / 1e9,
            "load_gbps": wave_bytes * len(measured_load) / sum(measured_load) / 1e9,
            "store_cpu_s_per_gb": store_cpu_s / moved_gb,
            "load_cpu_s_per_gb": load_cpu_s / moved_gb,
            "store_cores_busy": store_cpu_s / store_wall_s,
            "load_cores_busy": load_cpu_s / load_wall_s,
            "verified_chunks": float(verified)}


def median_run(runs: Sequence[SideRun]) -> SideRun:
    """One side's repeats of a case as one run: the median of each figure over ``runs`` (the same
    side, workload and policy). Why: one store or load of a few hundred MB on a shared 2-core VM
    swings by up to 1.5x from one run to the next; rows show the median, targets an interval
    (:func:`paired_ratios`)."""
    first = runs[0]
    if any((r.side, r.workload, r.policy) != (first.side, first.workload, first.policy) for r in runs):
        raise ValueError("median_run: repeats of different sides, workloads or policies")
    figures = {name: float(statistics.median(r.figures[name] for r in runs)) for name in first.figures}
    return SideRun(first.side, first.workload, figures, first.details, first.policy)


def paired_ratios(stock: Sequence[SideRun], ours: Sequence[SideRun],
                  metrics: Sequence[str] = ("load_gbps", "store_gbps")) -> dict[str, dict[str, float]]:
    """Per metric, the median of ours / stock over repeats measured back to back, with its 95 %
    bootstrap interval (``paired_stats.paired_ratio``): what a target's verdict rests on."""
    return {m: paired_ratio([o.figures[m] for o in ours], [s.figures[m] for s in stock]).as_dict() for m in metrics}


class AdapterCpu:
    """CPU seconds the adapter costs this process (every thread: its workers, LMCache's own)
    while the rounds run, and the wall time they run, both less the harness's filling of each
    round's objects between rounds.

    Why: a side whose one "thread" keeps two cores busy cannot get faster with a second thread,
    and GB/s alone does not show it; CPU seconds per GB moved does, and it is what the host of a
    GPU server pays per GB of KV. Threads: use from the benchmark's thread only."""

    def __init__(self) -> None:
        self._harness = (0.0, 0.0)  # (CPU, wall) seconds in harness calls so far

    def harness(self, make: Callable[[int], Any]) -> Callable[[int], Any]:
        """``make`` (a round's objects), its CPU and wall time left out of :meth:`of`."""
        def made(r: int) -> Any:
            cpu, wall = time.process_time(), time.monotonic()
            try:
                return make(r)
            finally:
                self._harness = (self._harness[0] + time.process_time() - cpu,
                                 self._harness[1] + time.monotonic() - wall)
        return made

    def of(self, run: Callable[[], Any]) -> tuple[Any, float, float]:
        """``run()``'s result, and the process CPU seconds and wall seconds it took, harness calls
        excluded."""
        cpu, wall, harness = time.process_time(), time.monotonic(), self._harness
        result = run()
        return (result, time.process_time() - cpu - (self._harness[0] - harness[0]),
                time.monotonic() - wall - (self._harness[1] - harness[1]))


def _check_complete(op: str, result: Any) -> None:
    expected = result.in_flight * result.num_keys
    if result.timed_out_rounds or any(n != expected for n in result.success_counts):
        raise KVShrinkError(f"{op}: {result.timed_out_rounds} rounds timed out, successes per round "
                            f"{result.success_counts} of {expected}; no throughput reported for a partial run")


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


READS = ("page cache", "device")  # where an SSD load reads from; or a device class: "500 MB/s device"


def load_phase(reads: str, workdir: Path) -> Callable[[], ContextManager[Any]]:
    """What the loads of an SSD case read from: ``page cache`` (what was just written), ``device``
    (every file under ``workdir`` dropped from the cache first) or ``<N> MB/s device`` (dropped, and
    this process's reads of that device throttled to N MB/s: a slower device class)."""
    from kvshrink.benchmarks import device_reads

    if reads == "page cache":
        return contextlib.nullcontext
    rate = None if reads == "device" else int(reads.removesuffix(" MB/s device")) * 10**6

    @contextlib.contextmanager
    def phase() -> Iterator[None]:
        device_reads.drop_cached([workdir])
        with device_reads.throttled_reads(workdir, rate) if rate else contextlib.nullcontext():
            yield

    return phase


def run_side(side: str, tier: str, threads: int, pool: ChunkPool,
             settings: ThroughputSettings, template: Path | None = None, reads: str = "page cache") -> SideRun:
    """One side of one case; ``reads`` (SSD only): see :func:`load_phase`."""
    if reads != "page cache" and tier != "ssd":
        raise ValueError(f"reads={reads!r} is for the ssd tier only")
    workdir = Path(tempfile.mkdtemp(prefix="kvshrink-l2bench-"))
    size = pool[0].numel() * pool[0].element_size()
    stored_bytes = (settings.warmup_rounds + settings.rounds) * threads * settings.keys_per_submit * size
    try:
        if side == STOCK:
            spec = stock_adapter_spec(tier, workdir)
        elif side == OURS:
            spec = ours_adapter_spec(tier, workdir, threads, capacity_bytes=2 * stored_bytes + (256 << 20),
                                     chunk_bytes=size, template=template)
        else:
            raise ValueError(f"unknown side {side!r}")
        figures = measure(spec, pool, threads, settings, load_phase(reads, workdir))
        if tier == "ssd":
            on_disk = _tree_bytes(workdir)
            tokens = stored_bytes // size * pool[0].shape[2]
            figures["bytes_per_token_on_disk"] = on_disk / tokens
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(Path("/dev/shm") / workdir.name, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (Path("/dev/shm") / f"kvshrink-l2bench-{workdir.name}").unlink()
    workload = Workload(trace=digest("l2-waves", settings.keys_per_submit, settings.rounds, settings.warmup_rounds),
                        model=pool.fingerprint, budget={"tier": tier, "threads": threads, "reads": reads})
    details: dict[str, Any] = {"adapter": spec["type"]}
    if side == OURS:
        details.update(adapter=ADAPTER_CLASS, store=spec["adapter_params"]["store"],
                       store_config=store_record(template))
    policy = (TierPolicy("KVShrink L2 adapter, shipped default store", "exclusive", 0.0, False) if side == OURS
              else TierPolicy("LMCache fs L2 adapter (raw files)", "single", 0.0, False))
    return SideRun(side, workload, figures, details, policy)
