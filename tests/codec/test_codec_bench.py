"""codec-bench's measuring functions work and report what they measured (no speed is asserted here)."""

from __future__ import annotations

import argparse
import json

import numpy as np
from kvshrink.benchmarks import codec_bench


def test_measure_and_report(real_chunks, tmp_path):
    samples = [("code#0", np.ascontiguousarray(real_chunks[0][:, :8]))]
    contenders = [c for c in codec_bench.contenders(threads=2, include_zipnn=False)
                  if c.name.startswith(("kvshrink zstd", "numcodecs"))]
    results = codec_bench.measure(samples, contenders, repeats=1)
    assert [r.name for r in results] == ["kvshrink zstd", "kvshrink zstd", "numcodecs Shuffle(2)+Zstd(1)"]
    assert all(r.exact for r in results)
    ours = results[0].summary()
    assert ours["ratio"] > 1.4 and ours["compress_gbps"] > 0 and ours["decompress_gbps"] > 0
    bounds = codec_bench.entropy_bounds(samples[0][1])
    assert 1.4 < bounds["order0"] < bounds["order0_rotated_per_plane"] < 1.6
    cap = codec_bench.parallel_capacity(samples[0][1], threads=2, repeats=1)
    assert cap["speedup"] > 0

    report = {"machine": {"loadavg_before": (0.0,), "loadavg_after": (0.0,)}, "threads": 2, "repeats": 1,
              "codec_paths": {"jit": "on", "qat": "q"}, "parallel_capacity": cap,
              "samples": [{"name": "code#0", "shape": [2, 8, 256, 192], **bounds}],
              "codecs": [r.summary() for r in results]}
    report["targets"] = codec_bench._targets(results, 2)
    table = codec_bench._table(report)
    assert "kvshrink zstd" in table and "numcodecs" in table and "order-0" in table
    codec_bench._plot(report, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    json.dumps(report)


def test_cli_is_wired():
    from kvshrink.cli import COMMANDS, build_parser

    assert COMMANDS["codec-bench"][0] == "kvshrink.benchmarks.codec_bench"
    args = build_parser().parse_args(["codec-bench", "--quick", "--json", "x.json"])
    assert args.quick and str(args.json) == "x.json"
    parser = argparse.ArgumentParser()
    codec_bench.add_arguments(parser)
    assert parser.parse_args([]).samples == 8


def test_fast_mode_and_plain_copy_are_measured(real_chunks):
    samples = [("code#0", np.ascontiguousarray(real_chunks[0][:, :4]))]
    contenders = [c for c in codec_bench.contenders(threads=2, include_zipnn=False)
                  if c.name.startswith(("kvshrink fast", "plain copy", "kvshrink zstd", "numcodecs"))]
    results = codec_bench.measure(samples, contenders, repeats=1)
    by = {(r.name, r.threads): r for r in results}
    assert {("kvshrink fast", 1), ("kvshrink fast", 2), ("plain copy (numpy)", 1)} <= set(by)
    assert all(r.exact for r in results)
    assert by[("kvshrink fast", 1)].ratio >= 1.33 and by[("plain copy (numpy)", 1)].ratio == 1.0
    targets = codec_bench._targets(results, 2)
    assert sum(name.startswith("fast:") for name in targets) == 5
