"""``kvshrink codec-bench``: the KV Shrink codec against the usual suspects, on real SmolLM2 KV.

Every codec is timed in the same run, on the same samples, round robin (so a noisy neighbour
slows all of them alike), keeping each one's best of ``repeats`` per sample; every round trip is
checked bit-exact. Speeds are GB/s of *uncompressed* bytes. "threads" columns use each codec's own
per-call parallelism (ours: block-parallel; zstd: its compression workers; ZipNN: its threads);
"n/a" where a codec has none. A GIL-free reference (zstd on independent blocks) is timed on 1 and
N threads in the same run, to show how much parallel capacity the machine had at that moment.
"kvshrink fast" decodes into a preallocated buffer (``decode(out=...)``, what a cache load does), and
"plain copy" copies each sample into a new array and back into a preallocated one: the memory-speed
limit of any codec, measured in the same run.

The measuring functions (``load_samples``, ``contenders``, ``measure``, ``entropy_bounds``,
``parallel_capacity``) are importable for the larger benchmark suite.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np

RATIO_TARGET = 1.45
SCALING_TARGET = 1.8  # 2 threads against 1, encode and decode, both methods (issue 27; was 1.6)
DENSE_RATIO_TARGET = 1.48  # the dense method (zstd, issue 27): ratio on every sample, GB/s on one core
DENSE_DECODE_TARGET = 3.5
DENSE_ENCODE_TARGET = 1.5
FAST_RATIO_TARGET = 1.33  # the fast method (issue 27): ratio on every sample, GB/s on one core, scaling
FAST_DECODE_TARGET = 6.0
FAST_ENCODE_TARGET = 3.0
FAST_SCALING_TARGET = 1.8


@dataclass
class Contender:
    """One codec configuration: ``compress(array) -> blob``, ``decompress(blob) -> bytes-like``."""

    name: str
    compress: Callable[[np.ndarray], Any]
    decompress: Callable[[Any], Any]
    threads: int = 1
    prepare: Callable[[np.ndarray], Any] | None = None  # untimed per-call input copy (ZipNN rewrites its input)


@dataclass
class Result:
    """Per-sample sizes and best times of one contender."""

    name: str
    threads: int
    raw_sizes: list[int]
    packed_sizes: list[int] = field(default_factory=list)
    compress_s: list[float] = field(default_factory=list)
    decompress_s: list[float] = field(default_factory=list)
    exact: bool = True

    @property
    def ratios(self) -> list[float]:
        return [r / p for r, p in zip(self.raw_sizes, self.packed_sizes)]

    @property
    def ratio(self) -> float:
        return sum(self.raw_sizes) / sum(self.packed_sizes)

    @property
    def compress_gbps(self) -> float:
        return sum(self.raw_sizes) / sum(self.compress_s) / 1e9

    @property
    def decompress_gbps(self) -> float:
        return sum(self.raw_sizes) / sum(self.decompress_s) / 1e9

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "threads": self.threads, "ratio": self.ratio, "ratio_min": min(self.ratios),
                "ratio_max": max(self.ratios), "compress_gbps": self.compress_gbps,
                "decompress_gbps": self.decompress_gbps, "exact": self.exact, "per_sample_ratio": self.ratios,
                "per_sample_compress_s": self.compress_s, "per_sample_decompress_s": self.decompress_s}


def load_samples(count: int) -> list[tuple[str, np.ndarray]]:
    """``count`` real KV chunks [2, 30, 256, 192] (bf16 as uint16), alternating the two corpora."""
    from kvshrink.testing.fixtures.real_kv import CORPORA, real_kv_chunks

    chunks = real_kv_chunks(count, 256)
    return [(f"{CORPORA[i % len(CORPORA)]}#{i // len(CORPORA)}", c) for i, c in enumerate(chunks)]


def contenders(threads: int, include_zipnn: bool = True) -> list[Contender]:
    """Ours (zstd and qat methods, 1 and ``threads`` threads) and the baselines."""
    import zstandard

    from kvshrink.benchmarks.bench_extra import require
    from kvshrink.codec import Codec
    from kvshrink.codec.qat import software_deflate_name

    lz4_frame, numcodecs = require("lz4.frame"), require("numcodecs")
    out: list[Contender] = []
    for method in ("zstd", "qat"):
        label = "kvshrink zstd" if method == "zstd" else f"kvshrink qat ({_qat_path_label(software_deflate_name())})"
        for t in sorted({1, threads}):
            codec = Codec(method=method, threads=t)
            out.append(Contender(label, codec.encode, _into_out(codec), t))
    for t in sorted({1, threads}):
        codec = Codec(method="fast", threads=t)
        out.append(Contender("kvshrink fast", codec.encode, _into_out(codec), t))
    for t in sorted({1, threads}):  # a demotion from a fast tier to a dense one: the fast frame is made untimed
        codec = Codec(method="fast", threads=t)
        out.append(Contender("kvshrink fast->dense transcode", partial(codec.transcode, method="zstd"),
                             _into_out(codec), t, prepare=codec.encode))
    copy_into = _into_out(None)
    out.append(Contender("plain copy (numpy)", np.copy, copy_into))
    for t in sorted({1, threads}):
        cctx = zstandard.ZstdCompressor(level=1, threads=0 if t == 1 else t)
        dctx = zstandard.ZstdDecompressor()
        out.append(Contender("zstd-1 raw bytes", cctx.compress, dctx.decompress, t))
    shuffle, zstd1 = numcodecs.Shuffle(elementsize=2), numcodecs.Zstd(level=1)
    out.append(Contender("numcodecs Shuffle(2)+Zstd(1)", lambda x: zstd1.encode(shuffle.encode(x)),
                         lambda b: shuffle.decode(zstd1.decode(b))))
    out.append(Contender("lz4 raw bytes", lambda x: lz4_frame.compress(x), lz4_frame.decompress))
    out.append(Contender("deflate-1 raw bytes (zlib)", lambda x: _zlib1(x), _unzlib))
    if include_zipnn:
        zipnn = require("zipnn")
        for t in sorted({1, threads}):
            z = zipnn.ZipNN(bytearray_dtype="bfloat16", threads=t)
            out.append(Contender("ZipNN bf16", z.compress, z.decompress, t, prepare=lambda x: bytearray(x.tobytes())))
    return out


def measure(samples: list[tuple[str, np.ndarray]], codecs: list[Contender], repeats: int,
            progress: Callable[[], None] = lambda: None) -> list[Result]:
    """Best-of-``repeats`` compress and decompress time per (codec, sample), codecs round robin."""
    results = [Result(c.name, c.threads, [x.nbytes for _, x in samples]) for c in codecs]
    best_c = np.full((len(codecs), len(samples)), np.inf)
    best_d = np.full((len(codecs), len(samples)), np.inf)
    sizes = np.zeros((len(codecs), len(samples)), dtype=np.int64)
    for _ in range(repeats):
        for ci, codec in enumerate(codecs):
            for si, (_, x) in enumerate(samples):
                arg = codec.prepare(x) if codec.prepare else x
                t0 = time.perf_counter()
                blob = codec.compress(arg)
                t1 = time.perf_counter()
                back = codec.decompress(blob)
                t2 = time.perf_counter()
                best_c[ci, si] = min(best_c[ci, si], t1 - t0)
                best_d[ci, si] = min(best_d[ci, si], t2 - t1)
                sizes[ci, si] = len(memoryview(blob).cast("B"))
                if not _same_bytes(back, x):
                    results[ci].exact = False
            progress()
    for ci, result in enumerate(results):
        result.packed_sizes = sizes[ci].tolist()
        result.compress_s, result.decompress_s = best_c[ci].tolist(), best_d[ci].tolist()
    return results


def entropy_bounds(x: np.ndarray) -> dict[str, float]:
    """Order-0 bounds for one KV chunk: of the plain high/low bytes over the whole chunk, and of
    the rotated bytes per (K/V, layer) plane (what per-block entropy coding can approach)."""
    from kvshrink.codec.byteplanes import split
    from kvshrink.codec.entropy import entropy_bits, order0_bound

    rows = x.reshape(-1).view(np.uint8).reshape(-1, x.dtype.itemsize)
    planes = x.reshape(x.shape[0] * x.shape[1], -1) if x.ndim >= 3 else x.reshape(1, -1)
    plane_bits = [sum(entropy_bits(s) for s in split(p.view(np.uint8).reshape(-1, x.dtype.itemsize), True,
                                                     x.dtype.itemsize)) for p in planes]
    return {"order0": order0_bound(rows), "order0_rotated": order0_bound(rows, rotate=True),
            "order0_rotated_per_plane": 8.0 * x.dtype.itemsize / float(np.mean(plane_bits))}


def parallel_capacity(x: np.ndarray, threads: int, repeats: int = 5) -> dict[str, float]:
    """1-thread vs ``threads``-thread time of a GIL-free job (zstd-1 on 512 KiB blocks of ``x``)."""
    from concurrent.futures import ThreadPoolExecutor

    from kvshrink.codec.backends import zstd_compress
    from kvshrink.codec.blocks import run_blocks

    flat = x.reshape(-1).view(np.uint8)
    blocks = [flat[i:i + (512 << 10)] for i in range(0, flat.size, 512 << 10)]
    times = {}
    with ThreadPoolExecutor(max(1, threads - 1)) as pool:
        for t in (1, threads):
            best = np.inf
            for _ in range(repeats):
                t0 = time.perf_counter()
                run_blocks(len(blocks), lambda b: zstd_compress(blocks[b], 1, None), pool, t)
                best = min(best, time.perf_counter() - t0)
            times[t] = best
    return {"threads": threads, "speedup": times[1] / times[threads]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=8, help="real KV chunks to measure (default 8: 4 per corpus)")
    # 15: on a shared 2-core VM the second core is often busy for a moment; with best of 5 the
    # 2-thread figures moved by 0.1-0.3x from run to run, with 15 they settle (same code, same hour)
    parser.add_argument("--repeats", type=int, default=15, help="timed round trips per codec and sample (best is kept)")
    parser.add_argument("--threads", type=int, default=None, help="the 'all threads' count (default: CPU count)")
    parser.add_argument("--quick", action="store_true", help="4 samples, 2 repeats")
    parser.add_argument("--no-zipnn", action="store_true", help="leave ZipNN out")
    parser.add_argument("--json", type=Path, help="write every figure to this JSON file")
    parser.add_argument("--plot", type=Path, help="write a PNG of ratio vs speed")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvshrink.codec import jit_status, qat_status

    count, repeats = (4, 2) if args.quick else (args.samples, args.repeats)
    threads = args.threads or os.cpu_count() or 1
    load_before = os.getloadavg()
    samples = load_samples(count)
    codecs = contenders(threads, include_zipnn=not args.no_zipnn)
    codecs[0].compress(samples[0][1])  # warm up (numba kernels, contexts) before timing
    with tqdm(total=repeats * len(codecs), desc="codec-bench", unit="codec") as bar:
        results = measure(samples, codecs, repeats, progress=bar.update)
    bounds = [entropy_bounds(x) for _, x in samples]
    capacity = parallel_capacity(samples[0][1], threads, repeats)
    report = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg()},
        "codec_paths": {"jit": jit_status(), "qat": qat_status()},
        "samples": [{"name": n, "shape": list(x.shape), "nbytes": x.nbytes, **b} for (n, x), b in zip(samples, bounds)],
        "repeats": repeats, "threads": threads, "parallel_capacity": capacity,
        "codecs": [r.summary() for r in results],
    }
    report["targets"] = _targets(results, threads)
    print(_table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    if args.plot:
        _plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _into_out(codec: Any) -> Callable[[Any], np.ndarray]:
    """decompress(blob) into one preallocated array per (shape, dtype), reused across calls; with
    ``codec`` None the "blob" is the array itself and is copied (the plain-copy contender)."""
    buffers: dict[tuple, np.ndarray] = {}

    def decompress(blob: Any) -> np.ndarray:
        if codec is None:
            key = (blob.shape, blob.dtype.str)
        else:
            h = codec.read_header(blob)
            key = (h.shape, h.dtype)
        out = buffers.get(key)
        if out is None:
            out = buffers[key] = np.empty(key[0], dtype=np.dtype(key[1]))
        if codec is None:
            np.copyto(out, blob)
            return out
        return codec.decode(blob, out=out)

    return decompress


def _fast_targets(by: dict[tuple[str, int], Result], threads: int) -> dict[str, bool]:
    one, many = by.get(("kvshrink fast", 1)), by.get(("kvshrink fast", threads))
    if one is None:
        return {}
    checks = {
        f"fast: ratio >= {FAST_RATIO_TARGET} on every sample": min(one.ratios) >= FAST_RATIO_TARGET,
        f"fast: 1-thread decompress >= {FAST_DECODE_TARGET} GB/s": one.decompress_gbps >= FAST_DECODE_TARGET,
        f"fast: 1-thread compress >= {FAST_ENCODE_TARGET} GB/s": one.compress_gbps >= FAST_ENCODE_TARGET,
    }
    if threads > 1 and many is not None:
        for direction in ("compress", "decompress"):
            checks[f"fast: {threads} threads >= {FAST_SCALING_TARGET}x 1 thread ({direction})"] = \
                getattr(many, f"{direction}_gbps") >= FAST_SCALING_TARGET * getattr(one, f"{direction}_gbps")
    return checks


def _dense_targets(one: Result) -> dict[str, bool]:
    return {
        f"dense (zstd): ratio >= {DENSE_RATIO_TARGET} on every sample": min(one.ratios) >= DENSE_RATIO_TARGET,
        f"dense (zstd): 1-thread decompress >= {DENSE_DECODE_TARGET} GB/s": one.decompress_gbps >= DENSE_DECODE_TARGET,
        f"dense (zstd): 1-thread compress >= {DENSE_ENCODE_TARGET} GB/s": one.compress_gbps >= DENSE_ENCODE_TARGET,
    }


def _targets(results: list[Result], threads: int) -> dict[str, Any]:
    by = {(r.name, r.threads): r for r in results}
    ours1, oursn = by[("kvshrink zstd", 1)], by[("kvshrink zstd", threads)]
    ref = by[("numcodecs Shuffle(2)+Zstd(1)", 1)]
    checks = {
        f"ratio >= {RATIO_TARGET} on every sample": min(ours1.ratios) >= RATIO_TARGET,
        "1-thread compress >= numcodecs": ours1.compress_gbps >= ref.compress_gbps,
        "1-thread decompress >= numcodecs": ours1.decompress_gbps >= ref.decompress_gbps,
        "bit-exact (all codecs)": all(r.exact for r in results),
    }
    if threads > 1:
        checks[f"{threads} threads >= {SCALING_TARGET}x 1 thread (compress)"] = \
            oursn.compress_gbps >= SCALING_TARGET * ours1.compress_gbps
        checks[f"{threads} threads >= {SCALING_TARGET}x 1 thread (decompress)"] = \
            oursn.decompress_gbps >= SCALING_TARGET * ours1.decompress_gbps
    checks.update(_dense_targets(ours1))
    checks.update(_fast_targets(by, threads))
    return checks


def _table(report: dict[str, Any]) -> str:
    threads = report["threads"]
    rows: dict[str, dict[int, dict]] = {}
    for c in report["codecs"]:
        rows.setdefault(c["name"], {})[c["threads"]] = c
    many_c, many_d = f"C {threads}t", f"D {threads}t"
    head = f"{'codec':36s} {'ratio':>6s} {'min':>6s} {'C 1t':>6s} {'D 1t':>6s} {many_c:>6s} {many_d:>6s}  exact"
    shape = report["samples"][0]["shape"]
    lines = [f"real SmolLM2 KV: {len(report['samples'])} chunks of {shape} bf16, best of {report['repeats']}; "
             "GB/s of uncompressed bytes", head, "-" * len(head)]
    for name, by_t in rows.items():
        one = by_t.get(1) or next(iter(by_t.values()))
        many = by_t.get(threads) if threads > 1 else None
        speeds = [_gbps(one, "compress"), _gbps(one, "decompress"), _gbps(many, "compress"), _gbps(many, "decompress")]
        lines.append(f"{name:36s} {one['ratio']:6.3f} {one['ratio_min']:6.3f} {' '.join(speeds)}  "
                     f"{'yes' if one['exact'] else 'NO'}")
    lines.append("order-0 entropy bound: hi/lo bytes per chunk " + _span(report, "order0") +
                 "; rotated bytes per K/V-layer plane " + _span(report, "order0_rotated_per_plane"))
    cap, load = report["parallel_capacity"], report["machine"]
    lines.append(f"machine parallel capacity now (GIL-free zstd blocks, {cap['threads']} vs 1 thread): "
                 f"{cap['speedup']:.2f}x; load average before/after: "
                 f"{load['loadavg_before'][0]:.2f} / {load['loadavg_after'][0]:.2f}")
    lines.append(f"paths: numba kernels {report['codec_paths']['jit']}; {report['codec_paths']['qat']}")
    lines += [f"  [{'PASS' if ok else 'FAIL'}] {name}" for name, ok in report["targets"].items()]
    return "\n".join(lines)


def _gbps(result: dict | None, direction: str) -> str:
    return "   n/a" if result is None else f"{result[f'{direction}_gbps']:6.2f}"


def _span(report: dict[str, Any], key: str) -> str:
    values = [s[key] for s in report["samples"]]
    return f"{min(values):.3f}-{max(values):.3f}"


def _plot(report: dict[str, Any], path: Path) -> None:
    from kvshrink.benchmarks.bench_extra import pyplot

    plt = pyplot()
    names = list(dict.fromkeys(c["name"] for c in report["codecs"]))
    colors = {n: plt.cm.tab10(i % 10) for i, n in enumerate(names)}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
    for ax, key, label in ((axes[0], "compress_gbps", "compress"), (axes[1], "decompress_gbps", "decompress")):
        for c in report["codecs"]:
            ours = c["name"].startswith("kvshrink")
            ax.scatter(c[key], c["ratio"], color=colors[c["name"]], marker="o" if c["threads"] == 1 else "^",
                       s=90 if ours else 45, edgecolors="black" if ours else "none",
                       label=f"{c['name']} ({c['threads']}t)")
        ax.axhline(RATIO_TARGET, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(f"{label} GB/s of uncompressed bytes")
        ax.set_xscale("log")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("compression ratio")
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"KV codecs on real SmolLM2 KV ({len(report['samples'])} chunks; o 1 thread, "
                 f"^ {report['threads']} threads; dotted: target {RATIO_TARGET})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _zlib1(x: np.ndarray) -> bytes:
    import zlib

    return zlib.compress(x, 1)


def _unzlib(blob: bytes) -> bytes:
    import zlib

    return zlib.decompress(blob)


def _qat_path_label(software: str) -> str:
    from kvshrink.codec.qat import library

    return "libqatzip" if library() is not None else f"{software} deflate-1"


def _same_bytes(back: Any, x: np.ndarray) -> bool:
    if hasattr(back, "dtype") and back.dtype == x.dtype and back.shape == x.shape:
        return bool(np.array_equal(back, x))
    return bytes(memoryview(back).cast("B")) == x.tobytes()
