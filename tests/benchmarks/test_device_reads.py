"""benchmarks/device_reads.py on this machine's disk: reads throttled to a device class, and the
process back in its own group afterwards."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from kvshrink.benchmarks import device_reads as dr


def _blkio_group() -> str:
    return next(line for line in Path("/proc/self/cgroup").read_text().splitlines() if "blkio" in line)


def test_reads_are_capped_inside_and_not_after(tmp_path: Path) -> None:
    home = _blkio_group()
    try:
        with dr.throttled_reads(tmp_path, 100 * 10**6) as device:
            assert device == dr.device_of(tmp_path)
            capped = dr.sequential_read_gbps(tmp_path, 64 << 20)
    except dr.DeviceUnavailable as exc:
        pytest.skip(f"no blkio throttling here: {exc}")
    assert capped <= 0.125, capped  # 100 MB/s, a quarter over at most for the first burst
    assert _blkio_group() == home
    assert not list(dr.BLKIO.glob("kvshrink-*"))  # the group is gone (how fast reads are after it
    # depends on what else uses the disk: not asserted)


def _resident_pages(path: Path) -> int:
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "PAGES", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


@pytest.mark.skipif(shutil.which("fincore") is None, reason="fincore (util-linux) is not installed")
def test_every_file_under_the_folders_leaves_the_page_cache(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    files = [tmp_path / "a", tmp_path / "sub" / "b"]
    for path in files:
        path.write_bytes(b"x" * (1 << 20))  # dirty pages: dropped only after the fsync drop_cached does
    assert all(_resident_pages(p) > 0 for p in files)
    assert dr.drop_cached([tmp_path]) == 2
    assert [_resident_pages(p) for p in files] == [0, 0]
