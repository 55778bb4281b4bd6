"""SSD-tier loads at store level, no vLLM: one ``get_many`` of a 4K-token prompt's chunks (16
real KV chunks of 256 tokens) from the SSD tier of the shipped default store, from the page cache,
from the device and from a throttled device, beside a plain read of the same files.

Why: ``tier_ttft`` showed ours paying far more than the bytes it reads when the device is cold or
slow. This isolates the store's read path: the chunks are put through the shipped default
(``configs/store-default.yaml``: compressed DRAM arena + compressed SSD tier), the store is closed
(a clean close copies DRAM down to the SSD) and its arena deleted, so the reopened store reads its
SSD tier as the cache server does after a restart. Conditions, each in ``--reps`` rounds, ``get_many``
and the plain read in rotating order within a round (so a busy machine weighs on both alike):

* ``page cache`` -- the files were just read (memory speed);
* ``device`` -- files dropped from the page cache before each read (``device_reads.drop_cached``);
* ``<N> MB/s device`` -- the same under a cgroup v1 blkio read throttle of this process
  (``device_reads.throttled_reads``; skipped with the reason where it cannot be set up).

The plain read: one read of the same files per chunk in 4 MiB reads, nothing
decoded (what LMCache's ``fs_native`` does); once per run: the decode alone (frames in memory,
``read_workers`` threads) and the ideal I/O time, stored bytes over the device's rate (its
measured sequential speed, or the throttle). ``--busy N`` adds a pass with N processes spinning
beside the reads (a serving engine on the same cores). Per condition: median ms per ``get_many``,
raw KV GB/s it delivers, bytes read from the device (``/proc/self/io``), and the ideal.

Found with it (issue 14, 2-core EPYC VM, virtio disk): cold and throttled ``get_many`` cost about
the larger of the I/O and the decode plus one chunk, i.e. the read path overlaps I/O with decode;
at 500 MB/s it ran at or under the ideal (blkio lets a short burst through). Queueing the later
files' I/O up front (``POSIX_FADV_WILLNEED``, all at once or one file ahead per read) did not
help: the first chunks' reads then shared the device with the read-ahead and decoding started
later. The TTFT gap seen through vLLM is not in this path.

    sudo python experiments/ssd_reads.py [--reps 7] [--throttle-mb-s 500 250] [--busy 0 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from kvshrink.benchmarks import device_reads as dr

PLAIN_BLOCK = 4 << 20


def proc_read_bytes() -> int:
    """Bytes this process has had read from storage (``/proc/self/io`` ``read_bytes``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def machine_notes() -> dict[str, Any]:
    flags = set()
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
        elif line.startswith("model name") and not model:
            model = line.split(":", 1)[1].strip()
    return {"cpu": model, "cpus": len(os.sched_getaffinity(0)), "load_avg": [round(x, 2) for x in os.getloadavg()],
            "simd": sorted(f for f in flags if f in ("avx2", "avx512f", "avx512bw", "bmi2"))}


@contextlib.contextmanager
def busy_cpus(count: int) -> Iterator[None]:
    """``count`` processes spinning at this process's niceness while inside: a serving engine
    busy on the same cores (vLLM's CPU worker), so a thread that waited for the disk waits for a
    core too."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


class SsdReadBench:
    """The store with ``chunks`` on its SSD tier (see the module docstring), under ``workdir``."""

    def __init__(self, workdir: Path, chunks: Sequence[np.ndarray]) -> None:
        from kvshrink.testing.derived_stores import derive_store
        from kvshrink.store import TieredStore

        self.workdir, self.chunks = Path(workdir), list(chunks)
        self.config = derive_store(paths={"ssd": self.workdir / "ssd"},
                                   shm_names={"dram": f"kvshrink-ssd-reads-{uuid.uuid4().hex[:8]}"})
        self.keys = [b"ssd-reads-%03d" % i for i in range(len(self.chunks))]
        with TieredStore.from_config(self.config) as store:
            for future in [store.put(k, c) for k, c in zip(self.keys, self.chunks)]:
                if not future.result():
                    raise RuntimeError("a put was dropped")
        self._drop_arena()
        self.store = TieredStore.from_config(self.config)
        self.ssd = next(t for t in self.store.tiers if t.kind == "ssd")
        if self.ssd.usage()[1] != len(self.keys) or any(t.usage()[1] for t in self.store.tiers if t is not self.ssd):
            raise RuntimeError(f"the chunks are not all on the SSD tier alone: {[t.usage() for t in self.store.tiers]}")
        self.files = [self.ssd.path_for(k) for k in self.keys]
        self.stored = sum(p.stat().st_size for p in self.files)
        self.raw = sum(c.nbytes for c in self.chunks)
        self.outs = [np.empty_like(c) for c in self.chunks]
        self.store.get_many(self.keys, self.outs)  # first touch of the outputs, lazy imports

    def _drop_arena(self) -> None:
        for tier in self.config["tiers"]:
            if tier["kind"] == "dram":
                Path("/dev/shm", tier["shm_name"]).unlink(missing_ok=True)

    def close(self) -> None:
        self.store.close()
        self._drop_arena()

    # -- what is timed ---------------------------------------------------------------------------
    def get_many(self) -> None:
        got = self.store.get_many(self.keys, self.outs)
        if any(g is None for g in got):
            raise RuntimeError("a chunk was missed")

    def plain_read(self) -> None:
        """One file per chunk, read in 4 MiB reads, nothing decoded (``fs_native``'s way)."""
        for path in self.files:
            with open(path, "rb", buffering=0) as f:
                while f.read(PLAIN_BLOCK):
                    pass

    def decode_alone_s(self, reps: int) -> float:
        """Median seconds to decode every frame (in memory) on ``read_workers`` threads."""
        from kvshrink.codec import decode

        frames = [self.ssd.read_frame(k) for k in self.keys]
        with ThreadPoolExecutor(self.store.config.engine.read_workers) as pool:
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                list(pool.map(lambda fo: decode(fo[0], out=fo[1]), zip(frames, self.outs)))
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    def timed(self, run: Callable[[], None], cold: bool) -> tuple[float, int]:
        if cold:
            dr.drop_cached([self.ssd.chunks_dir])
        before = proc_read_bytes()
        start = time.perf_counter()
        run()
        return time.perf_counter() - start, proc_read_bytes() - before

    def condition(self, name: str, cold: bool, reps: int, ideal_s: float | None) -> dict[str, Any]:
        runs: dict[str, Callable[[], None]] = {"get_many": self.get_many, "plain read": self.plain_read}
        samples: dict[str, list[tuple[float, int]]] = {k: [] for k in runs}
        order = list(runs)
        for step in range(reps):
            for what in order[step % len(order):] + order[: step % len(order)]:
                samples[what].append(self.timed(runs[what], cold))
        row: dict[str, Any] = {"condition": name, "ideal_ms": None if ideal_s is None else ideal_s * 1e3}
        for what, got in samples.items():
            seconds = statistics.median(s for s, _ in got)
            row[what] = {"ms": seconds * 1e3, "all_ms": [round(s * 1e3, 1) for s, _ in got],
                         "device_bytes": statistics.median(b for _, b in got),
                         "raw_gbps": None if what == "plain read" else self.raw / seconds / 1e9}
        return row


def run(workdir: Path, reps: int = 7, throttle_mb_s: Sequence[int] = (500,), num_chunks: int = 16,
        busy: Sequence[int] = (0,), progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    from kvshrink.testing.fixtures.real_kv import real_kv_chunks

    bench = SsdReadBench(workdir, real_kv_chunks(num_chunks))
    try:
        out: dict[str, Any] = {"machine": machine_notes(), "chunks": num_chunks, "raw_bytes": bench.raw,
                               "stored_bytes": bench.stored, "read_workers": bench.store.config.engine.read_workers,
                               "rows": [], "notes": []}
        progress("device speed")
        device_gbps = dr.sequential_read_gbps(workdir, 256 << 20)
        out["device_read_gbps"] = device_gbps
        out["decode_alone_ms"] = bench.decode_alone_s(reps) * 1e3
        for spinners in busy:
            with busy_cpus(spinners):
                out["rows"] += _conditions(bench, reps, throttle_mb_s, device_gbps, spinners, out["notes"], progress)
        out["machine"]["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
        return out
    finally:
        bench.close()


def _conditions(bench: SsdReadBench, reps: int, throttle_mb_s: Sequence[int], device_gbps: float, spinners: int,
                notes: list[str], progress: Callable[[str], None]) -> list[dict[str, Any]]:
    suffix = f", {spinners} busy" if spinners else ""
    rows = []
    progress(f"page cache{suffix}")
    rows.append(bench.condition(f"page cache{suffix}", False, reps, None))
    progress(f"device{suffix}")
    rows.append(bench.condition(f"device{suffix}", True, reps, bench.stored / (device_gbps * 1e9)))
    for mb_s in throttle_mb_s:
        progress(f"{mb_s} MB/s device{suffix}")
        try:
            with dr.throttled_reads(bench.workdir, mb_s * 10**6):
                rows.append(bench.condition(f"{mb_s} MB/s device{suffix}", True, reps, bench.stored / (mb_s * 1e6)))
        except dr.DeviceUnavailable as exc:
            if f"{mb_s} MB/s device: skipped ({exc})" not in notes:
                notes.append(f"{mb_s} MB/s device: skipped ({exc})")
    return rows


def report_lines(result: dict[str, Any]) -> list[str]:
    m = result["machine"]
    lines = [f"{result['chunks']} chunks: raw {result['raw_bytes'] / 1e6:.1f} MB, stored {result['stored_bytes'] / 1e6:.1f} MB; "
             f"device reads {result['device_read_gbps']:.2f} GB/s sequentially; decode alone "
             f"{result['decode_alone_ms']:.0f} ms on {result['read_workers']} threads",
             f"CPU {m['cpu']} x{m['cpus']} ({' '.join(m['simd']) or 'no AVX2'}), load average {m['load_avg'][0]:.2f} "
             f"before, {m.get('load_avg_after', ['?'])[0]} after",
             f"{'condition':<26}{'path':<16}{'ms/get_many':>12}{'raw GB/s':>10}{'device MB':>11}{'ideal ms':>10}"]
    for row in result["rows"]:
        ideal = "" if row["ideal_ms"] is None else f"{row['ideal_ms']:.0f}"
        for what in ("get_many", "plain read"):
            r = row[what]
            gbps = "" if r["raw_gbps"] is None else f"{r['raw_gbps']:.2f}"
            lines.append(f"{row['condition']:<26}{what:<16}{r['ms']:>12.0f}{gbps:>10}{r['device_bytes'] / 1e6:>11.1f}{ideal:>10}")
    lines += result["notes"]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--throttle-mb-s", type=int, nargs="*", default=[500])
    parser.add_argument("--busy", type=int, nargs="*", default=[0, len(os.sched_getaffinity(0))],
                        help="spinning processes beside the reads, one pass each (default: none, then one per CPU)")
    parser.add_argument("--workdir", type=Path, default=None, help="a folder on the disk to measure (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="kvshrink-ssd-reads-", dir=args.workdir))
    try:
        result = run(workdir, args.reps, args.throttle_mb_s, args.chunks, args.busy, progress=lambda s: print(f"... {s}", flush=True))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n".join(report_lines(result)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
