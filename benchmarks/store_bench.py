"""``kvshrink store-bench``: the tiered store's targets, measured on real SmolLM2 KV.

1. **Bytes per token on the SSD tier** with compressed chunks (target: <= raw / 1.45), from the
   chunk files' real sizes on disk (apparent and allocated), plus the put path's caller time.
2. **Batched reads across tiers**: a 32-chunk batch, half in the DRAM arena and half on SSD,
   read with ``get_many`` (parallel reads and decodes into preallocated buffers) against the same
   chunks read one by one, tier after tier. The page cache is dropped before every timed read
   (``/proc/sys/vm/drop_caches``, needs root) so the SSD half really comes from the device; the
   report says whether that worked. Rounds alternate the two orders (ABBA) and keep medians.
3. **Reopen of a 100k-chunk SSD tier** (target < 1 s): small real-KV chunks, so the directory
   fits anywhere; the time is until the reopened tier knows every chunk (index replay), with the
   page cache dropped first. Twice: after a clean close (one snapshot to read) and after a writer
   was killed with SIGKILL just before its next index compaction (snapshot + ~25k records to
   replay; the background file scan that a crash triggers is timed separately).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np

BYTES_PER_TOKEN_TARGET = 1.45
REOPEN_TARGET_S = 1.0
CHUNK_TOKENS = 256
MiB = 2**20


def drop_page_cache() -> bool:
    """Write back dirty pages and drop clean ones; False when the kernel refuses (not root)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def _store_config(workdir: Path, shm_name: str, *, dram: int = 0, ssd: int = 64 << 30, write_back: bool = False,
                  promote: bool = False) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = []
    if dram:
        tiers.append({"kind": "dram", "capacity": dram, "shm_name": shm_name, "codec": "raw"})
    tiers.append({"kind": "ssd", "capacity": ssd, "path": str(workdir / "ssd"), "write_back": write_back and bool(dram),
                  "fsync": True})
    return {"tiers": tiers, "promote_on_hit": promote, "persist_on_close": False,
            "engine": {"staging_bytes": "1GiB", "put_queue": 64}}


def _chunk_files(root: Path) -> list[os.stat_result]:
    return [p.stat() for p in (root / "ssd" / "chunks").rglob("*.kvc")]


def measure_bytes_per_token(chunks: list[np.ndarray], workdir: Path, progress: Callable[[int], Any]) -> dict[str, Any]:
    """Put every chunk into a compressed SSD tier through the store; size the files."""
    from kvshrink.store import TieredStore

    raw_per_token = chunks[0].nbytes / chunks[0].shape[2]
    caller_s, caller_cpu_s, futures = [], [], []
    start = time.perf_counter()
    with TieredStore.from_config(_store_config(workdir, "")) as store:
        for i, chunk in enumerate(chunks):
            t0, c0 = time.perf_counter(), time.thread_time()
            futures.append(store.put(b"bpt-%d" % i, chunk))
            caller_s.append(time.perf_counter() - t0)
            caller_cpu_s.append(time.thread_time() - c0)
        stored = 0
        for future in futures:
            stored += bool(future.result())
            progress(1)
        elapsed = time.perf_counter() - start
        exact = all(np.array_equal(store.get(b"bpt-%d" % i), c) for i, c in enumerate(chunks))
    files = _chunk_files(workdir)
    tokens = sum(c.shape[2] for c in chunks)
    apparent = sum(s.st_size for s in files)
    allocated = sum(s.st_blocks * 512 for s in files)
    return {"chunks": len(chunks), "stored": stored, "tokens": tokens, "raw_bytes_per_token": raw_per_token,
            "stored_bytes_per_token": apparent / tokens, "allocated_bytes_per_token": allocated / tokens,
            "ratio": raw_per_token * tokens / apparent, "ratio_allocated": raw_per_token * tokens / allocated,
            "index_bytes": (workdir / "ssd" / "index.log").stat().st_size, "bit_exact": exact,
            "put_caller_ms_mean": 1e3 * statistics.mean(caller_s), "put_caller_ms_max": 1e3 * max(caller_s),
            "put_caller_cpu_ms_mean": 1e3 * statistics.mean(caller_cpu_s),
            "put_to_durable_gbps": sum(c.nbytes for c in chunks) / elapsed / 1e9, "fsync": True}


def measure_batched_reads(chunks: list[np.ndarray], workdir: Path, rounds: int, drop: bool,
                          progress: Callable[[int], Any]) -> dict[str, Any]:
    """get_many over DRAM + SSD vs one-by-one, tier after tier; same chunks, same buffers."""
    from kvshrink.store import TieredStore

    half = len(chunks) // 2
    shm_name = f"kvshrink-bench-{uuid.uuid4().hex[:8]}"
    dram = int(chunks[0].nbytes * (half + 0.5))  # room for half the batch (frame headers are ~300 B)
    store = TieredStore.from_config(_store_config(workdir, shm_name, dram=dram))
    try:
        keys = [b"batch-%d" % i for i in range(len(chunks))]
        for key, chunk in zip(keys, chunks):
            assert store.put(key, chunk).result(), "benchmark put was dropped"
        store.flush()
        layout = [store.where(k) for k in keys]
        outs = [np.empty_like(c) for c in chunks]

        def batched() -> None:
            store.get_many(keys, outs)

        def one_by_one() -> None:
            for key, out in zip(keys, outs):
                for tier in store.tiers:
                    if tier.get(key, out) is not None:
                        break

        times: dict[str, list[float]] = {"get_many": [], "one_by_one": []}
        dropped: list[bool] = []
        order = [("one_by_one", one_by_one), ("get_many", batched)]
        for r in range(rounds):
            for name, fn in order if r % 2 == 0 else order[::-1]:
                dropped.append(drop_page_cache() if drop else False)
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                for out, chunk in zip(outs, chunks):
                    assert np.array_equal(out, chunk), f"{name} returned wrong bytes"
                    out.fill(0)
                progress(1)
        batch_bytes = sum(c.nbytes for c in chunks)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        return {"chunks": len(chunks), "in_dram": layout.count("dram"), "on_ssd": layout.count("ssd"),
                "batch_mb": batch_bytes / 1e6, "rounds": rounds, "page_cache_dropped": all(dropped) and bool(dropped),
                "get_many_s": med["get_many"], "one_by_one_s": med["one_by_one"],
                "get_many_gbps": batch_bytes / med["get_many"] / 1e9,
                "one_by_one_gbps": batch_bytes / med["one_by_one"] / 1e9,
                "speedup": med["one_by_one"] / med["get_many"], "all_times": times,
                "read_workers": store.config.engine.read_workers}
    finally:
        store.close()
        store.tiers[0].path.unlink(missing_ok=True)


def small_real_chunks(count: int) -> list[np.ndarray]:
    """``count`` distinct small chunks cut from real KV ([2, 2, 1, 64] uint16: 512 bytes each)."""
    from kvshrink.testing.fixtures.real_kv import real_kv

    kv = real_kv("code", 2048)
    per_token = (kv.shape[1] // 2) * (kv.shape[3] // 64)
    out = []
    for i in range(count):
        token, rest = divmod(i, per_token)
        layer, head = divmod(rest, kv.shape[3] // 64)
        out.append(np.ascontiguousarray(kv[:, 2 * layer : 2 * layer + 2, token % kv.shape[2] : token % kv.shape[2] + 1,
                                           64 * head : 64 * head + 64]))
    return out


def lmcache_like_key(i: int) -> bytes:
    """A key of the length LMCache plugins use (model name + hash)."""
    return f"o1@HuggingFaceTB/SmolLM2-135M-Instruct@0@0@{hashlib.sha256(str(i).encode()).hexdigest()}".encode()


def measure_reopen(count: int, workdir: Path, repeats: int, drop: bool, progress: Callable[[int], Any]) -> dict[str, Any]:
    """Fill an SSD tier with ``count`` small chunks, close it, time ``repeats`` cold reopens.

    Wall time is what a restart waits; the process CPU time of the open is reported beside it
    because on a shared, loaded machine the wall time mostly measures the neighbours."""
    from kvshrink.codec import encode
    from kvshrink.store.ssd import SsdTier

    config = reopen_tier_config(workdir / "reopen")
    pool = small_real_chunks(min(count, 4096))
    frames = [encode(c) for c in pool]
    tier = SsdTier(config)
    for i in range(count):
        tier.write_frame(lmcache_like_key(i), frames[i % len(frames)])
        if i % 1000 == 999:
            progress(1000)
    progress(count % 1000)
    tier.close()
    index_bytes = (workdir / "reopen" / "index.log").stat().st_size
    walls, cpus, known, dropped = [], [], [], []
    for _ in range(repeats):
        dropped.append(drop_page_cache() if drop else False)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        reopened = SsdTier(config)
        walls.append(time.perf_counter() - wall0)
        cpus.append(time.process_time() - cpu0)
        known.append(len(reopened.keys()))
        step = max(1, count // 100)
        sample = range(0, count, step)
        exact = all(np.array_equal(reopened.get(lmcache_like_key(i)), pool[i % len(pool)]) for i in sample)
        reopened.close()
    crash = measure_crash_reopen(config, count, drop)
    return {"chunks": count, "chunk_raw_bytes": pool[0].nbytes, "index_mb": index_bytes / 1e6, "repeats": repeats,
            "page_cache_dropped": all(dropped) and bool(dropped), "reopen_s": statistics.median(walls),
            "reopen_all_s": walls, "reopen_cpu_s": statistics.median(cpus), "chunks_known_after_reopen": min(known),
            "sample_reads": len(sample), "sample_bit_exact": exact, "clean_start": reopened.clean_start,
            "after_crash": crash}


def reopen_tier_config(path: Path | str) -> Any:
    """The SSD tier the reopen measurements fill: compressed, 64 GiB, no fsync (what is timed is
    the reopen, not the writes), parsed by the store's own config parser."""
    from kvshrink.store.config import parse_store_config

    tier = {"kind": "ssd", "name": "ssd", "capacity": 64 << 30, "compressed": True, "path": str(path), "fsync": False}
    return parse_store_config({"tiers": [tier]}).tiers[0]


CRASH_WRITER = """
import sys
from kvshrink.benchmarks.store_bench import lmcache_like_key, reopen_tier_config, small_real_chunks
from kvshrink.codec import encode
from kvshrink.store.ssd import SsdTier
start, tail = int(sys.argv[2]), int(sys.argv[3])
frames = [encode(c) for c in small_real_chunks(256)]
tier = SsdTier(reopen_tier_config(sys.argv[1]))
for i in range(start, start + tail):
    tier.write_frame(lmcache_like_key(i), frames[i % len(frames)])
print("written", flush=True)
sys.stdin.read()  # wait for SIGKILL: no close, no compaction, no clean marker
"""


def measure_crash_reopen(config: Any, count: int, drop: bool) -> dict[str, Any]:
    """A writer adds chunks (up to just below the compaction threshold, the worst case for the
    record-by-record replay) and is killed with SIGKILL; time the reopen and the background scan."""
    import subprocess
    import sys

    from kvshrink.store.ssd import SsdTier

    tail = max(0, count // 4 - 1)
    writer = subprocess.Popen([sys.executable, "-c", CRASH_WRITER, config.path, str(count), str(tail)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready = writer.stdout.readline().strip() == "written"
    finally:
        writer.kill()
        writer.wait()
    if not ready:
        raise RuntimeError("crash writer failed before it was killed")
    dropped = drop_page_cache() if drop else False
    wall0, cpu0 = time.perf_counter(), time.process_time()
    tier = SsdTier(config)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    known = len(tier.keys())
    tier._reconciler.join()
    scanned = time.perf_counter() - wall0
    total = len(tier.keys())
    tier.close()
    return {"records_after_snapshot": tail, "page_cache_dropped": dropped, "reopen_s": wall, "reopen_cpu_s": cpu,
            "chunks_known_after_reopen": known, "chunks_expected": count + tail, "reconcile_done_s": scanned,
            "chunks_after_reconcile": total, "clean_start": False}


def _remove_tree(path: Path) -> None:
    """rm -r with a progress bar: 100k unlinks take minutes on a disk mounted with ``discard``."""
    from tqdm import tqdm

    files = [p for p in path.rglob("*") if not p.is_dir()]
    for file in tqdm(files, desc="clean up", unit="file", leave=False):
        file.unlink()
    shutil.rmtree(path, ignore_errors=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunks", type=int, default=32, help="real 256-token chunks per batch (default 32)")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds of the batch read (median kept)")
    parser.add_argument("--reopen-chunks", type=int, default=100_000, help="chunks in the reopen test (default 100k)")
    parser.add_argument("--reopen-repeats", type=int, default=3, help="cold reopens timed (median kept)")
    parser.add_argument("--workdir", type=Path, default=None, help="directory on the disk to test (default: a temp dir)")
    parser.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache before timed reads")
    parser.add_argument("--quick", action="store_true", help="16 chunks, 2 rounds, 10k-chunk reopen")
    parser.add_argument("--json", type=Path, help="write every figure to this JSON file")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvshrink.testing.fixtures.real_kv import real_kv_chunks

    chunks_n, rounds, reopen_n = (16, 2, 10_000) if args.quick else (args.chunks, args.rounds, args.reopen_chunks)
    drop = not args.no_drop_caches
    chunks = real_kv_chunks(chunks_n, CHUNK_TOKENS)
    workdir = Path(tempfile.mkdtemp(prefix="kvshrink-store-bench-", dir=args.workdir))
    load_before = os.getloadavg()
    try:
        with tqdm(total=len(chunks), desc="bytes/token (SSD puts)", unit="chunk") as bar:
            bpt = measure_bytes_per_token(chunks, workdir / "bpt", bar.update)
        with tqdm(total=2 * rounds, desc="get_many vs one by one", unit="read") as bar:
            reads = measure_batched_reads(chunks, workdir / "reads", rounds, drop, bar.update)
        with tqdm(total=reopen_n, desc="fill SSD tier for reopen", unit="chunk") as bar:
            reopen = measure_reopen(reopen_n, workdir / "reopen", args.reopen_repeats, drop, bar.update)
    except BaseException:
        _remove_tree(workdir)
        raise
    report = {"machine": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
              "bytes_per_token": bpt, "batched_reads": reads, "reopen": reopen}
    report["targets"] = {
        f"SSD bytes/token <= raw / {BYTES_PER_TOKEN_TARGET}": bpt["ratio"] >= BYTES_PER_TOKEN_TARGET,
        "get_many faster than one by one": reads["speedup"] > 1.0,
        f"reopen of {reopen['chunks']} chunks < {REOPEN_TARGET_S} s": reopen["reopen_s"] < REOPEN_TARGET_S
        and reopen["chunks_known_after_reopen"] == reopen["chunks"],
        f"reopen after kill -9 < {REOPEN_TARGET_S} s, every chunk found": reopen["after_crash"]["reopen_s"] < REOPEN_TARGET_S
        and reopen["after_crash"]["chunks_known_after_reopen"] == reopen["after_crash"]["chunks_expected"],
        "bit-exact": bpt["bit_exact"] and reopen["sample_bit_exact"],
    }
    print(_table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    _remove_tree(workdir)
    return 0 if all(report["targets"].values()) else 1


def chunk_mb(bpt: dict[str, Any]) -> float:
    return bpt["raw_bytes_per_token"] * bpt["tokens"] / bpt["chunks"] / 1e6


def _table(report: dict[str, Any]) -> str:
    b, r, o = report["bytes_per_token"], report["batched_reads"], report["reopen"]
    c = o["after_crash"]
    lines = [
        f"SSD tier, {b['chunks']} real chunks ({b['tokens']} tokens): {b['stored_bytes_per_token']:.0f} B/token stored "
        f"({b['allocated_bytes_per_token']:.0f} allocated) vs {b['raw_bytes_per_token']:.0f} raw -> ratio "
        f"{b['ratio']:.3f} ({b['ratio_allocated']:.3f} allocated); index {b['index_bytes']} B",
        f"  put: caller {b['put_caller_ms_mean']:.2f} ms mean / {b['put_caller_ms_max']:.2f} ms max wall, "
        f"{b['put_caller_cpu_ms_mean']:.2f} ms CPU (the staging copy of {chunk_mb(b):.1f} MB); "
        f"{b['put_to_durable_gbps']:.3f} GB/s raw to durable (compress + fsync)",
        f"get_many of {r['chunks']} chunks ({r['in_dram']} DRAM + {r['on_ssd']} SSD, {r['batch_mb']:.0f} MB), "
        f"page cache dropped: {'yes' if r['page_cache_dropped'] else 'NO'}, median of {r['rounds']}:",
        f"  get_many {r['get_many_s'] * 1e3:.0f} ms ({r['get_many_gbps']:.2f} GB/s) vs one by one "
        f"{r['one_by_one_s'] * 1e3:.0f} ms ({r['one_by_one_gbps']:.2f} GB/s) -> {r['speedup']:.2f}x",
        f"reopen of {o['chunks']} chunks ({o['chunk_raw_bytes']} B raw each, index {o['index_mb']:.1f} MB, page cache "
        f"dropped: {'yes' if o['page_cache_dropped'] else 'NO'}), median of {o['repeats']}: "
        f"{o['reopen_s'] * 1e3:.0f} ms wall ({o['reopen_cpu_s'] * 1e3:.0f} ms CPU), "
        f"{o['chunks_known_after_reopen']} chunks known from the index (clean start: {o['clean_start']})",
        f"  after kill -9 with {c['records_after_snapshot']} records past the snapshot: {c['reopen_s'] * 1e3:.0f} ms wall "
        f"({c['reopen_cpu_s'] * 1e3:.0f} ms CPU), {c['chunks_known_after_reopen']}/{c['chunks_expected']} chunks known; "
        f"background file scan done at {c['reconcile_done_s']:.2f} s",
        f"load average before/after: {report['machine']['loadavg_before'][0]:.2f} / "
        f"{report['machine']['loadavg_after'][0]:.2f}",
    ]
    lines += [f"  [{'ok' if ok else 'MISSED'}] {name}" for name, ok in report["targets"].items()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
