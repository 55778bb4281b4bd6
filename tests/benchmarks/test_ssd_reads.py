"""benchmarks/ssd_reads.py: the store's SSD-tier loads, cold and throttled, measured in one run.

Not timing targets: the throttled test compares a read with the bytes it moved and the decode
measured in the same run (a ratio with a 2x margin), so a slow or busy machine passes alike."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from kvshrink.benchmarks import device_reads as dr
from kvshrink.benchmarks import ssd_reads as sr
from kvshrink.testing.fixtures.real_kv import real_kv_chunks

CHUNKS = 8
THROTTLE_MB_S = 200


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sr.SsdReadBench]:
    bench = sr.SsdReadBench(tmp_path_factory.mktemp("ssd-reads"), real_kv_chunks(CHUNKS))
    yield bench
    bench.close()


def _reads_storage(folder: Path) -> bool:
    """Whether a read of a dropped file under ``folder`` shows in /proc/self/io (not tmpfs)."""
    probe = folder / "probe" / "file"
    probe.parent.mkdir(exist_ok=True)
    probe.write_bytes(os.urandom(1 << 20))
    dr.drop_cached([probe.parent])
    before = sr.proc_read_bytes()
    probe.read_bytes()
    probe.unlink()
    return sr.proc_read_bytes() - before >= 1 << 19


def test_the_chunks_are_on_the_ssd_tier_compressed_and_load_bit_exact(bench: sr.SsdReadBench) -> None:
    assert bench.ssd.usage()[1] == CHUNKS
    assert bench.stored < 0.8 * bench.raw  # compressed on the SSD
    for out in bench.outs:
        out.fill(0)
    bench.get_many()
    for chunk, out in zip(bench.chunks, bench.outs):
        assert (chunk == out).all()


def test_a_cold_load_reads_each_stored_byte_from_the_device_once(bench: sr.SsdReadBench) -> None:
    if not _reads_storage(bench.workdir):
        pytest.skip(f"reads under {bench.workdir} are not block I/O here (no read_bytes in /proc/self/io)")
    _, device_bytes = bench.timed(bench.get_many, cold=True)
    assert bench.stored <= device_bytes <= bench.stored * 1.05 + (1 << 20)
    _, cached_bytes = bench.timed(bench.get_many, cold=False)
    assert cached_bytes == 0


def test_a_throttled_cold_load_costs_the_bytes_it_moved_plus_the_decode(bench: sr.SsdReadBench) -> None:
    if os.geteuid() != 0 or not (dr.BLKIO / "blkio.throttle.read_bps_device").exists():
        pytest.skip("needs root and the cgroup v1 blkio controller (/sys/fs/cgroup/blkio) to throttle reads")
    decode_s = bench.decode_alone_s(3)
    rate = THROTTLE_MB_S * 10**6
    with dr.throttled_reads(bench.workdir, rate):
        seconds = min(bench.timed(bench.get_many, cold=True)[0] for _ in range(2))
    assert seconds <= 2 * (bench.stored / rate + decode_s), (seconds, bench.stored / rate, decode_s)


def test_report_lines_name_every_condition_and_the_ideal() -> None:
    row = {"condition": "500 MB/s device", "ideal_ms": 127.0,
           "get_many": {"ms": 103.0, "all_ms": [103.0], "device_bytes": 63.6e6, "raw_gbps": 0.92},
           "plain read": {"ms": 111.0, "all_ms": [111.0], "device_bytes": 63.6e6, "raw_gbps": None}}
    result = {"chunks": 16, "raw_bytes": 94.4e6, "stored_bytes": 63.6e6, "device_read_gbps": 2.2,
              "decode_alone_ms": 51.0, "read_workers": 4, "rows": [row], "notes": ["250 MB/s device: skipped (x)"],
              "machine": {"cpu": "AMD EPYC", "cpus": 2, "simd": ["avx2"], "load_avg": [1.2, 1, 1],
                          "load_avg_after": [1.4, 1, 1]}}
    text = "\n".join(sr.report_lines(result))
    assert "500 MB/s device" in text and "127" in text and "0.92" in text and "skipped" in text
