"""``kvshrink cache serve --check`` against a /dev/shm too small for the DRAM tier: a private mount
namespace with a small tmpfs on /dev/shm (the host's is untouched)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvshrink.testing.launch import free_port

MiB = 2**20
SHM_NAME = "kvshrink-check-shm"


def check_with_small_shm(tmp_path: Path, capacity: str, before: str = "") -> subprocess.CompletedProcess:
    """Run ``kvshrink cache serve --check`` on an 8 MiB /dev/shm after the shell line ``before``; the last
    stdout line lists that tmpfs with allocated KiB (``ls -s``)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"this machine refuses a private mount namespace with a tmpfs: {probe.stderr.strip()}")
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"port": free_port(), "http_port": free_port(), "l1_size_gb": 0.2},
        "store": {"tiers": [{"kind": "dram", "capacity": capacity, "shm_name": SHM_NAME},
                            {"kind": "ssd", "path": str(tmp_path / "ssd"), "capacity": "1GiB"}]}}))
    shell = (f"mount -t tmpfs -o size=8m tmpfs /dev/shm || exit 99; {before}\n"
             f'"$0" -m kvshrink.cli cache serve --config "$1" --check; rc=$?; '
             'echo "shm: $(ls -s1A /dev/shm | tail -n +2 | tr "\\n" " ")"; exit $rc')
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", shell, sys.executable, str(config)],
                          capture_output=True, text=True, timeout=120)


def test_check_fails_naming_the_sizes_and_creates_nothing(tmp_path):
    done = check_with_small_shm(tmp_path, "64MiB")
    assert done.returncode == 2, done.stdout + done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("kvshrink cache serve: ") and "'store.tiers[0].capacity'" in line
    assert f"/dev/shm/{SHM_NAME} needs {64 * MiB} bytes (64.0 MiB)" in line
    assert f"{8 * MiB} bytes (8.0 MiB) free" in line
    assert done.stdout.splitlines()[-1].strip() == "shm:"


def test_check_does_not_count_a_sparse_arena_file_as_room(tmp_path):
    """A 64 MiB file with no pages behind it is no room at all: the store's reservation would
    fail, so the check must fail too (it used to count the file's length)."""
    done = check_with_small_shm(tmp_path, "64MiB", before=f"truncate -s 64M /dev/shm/{SHM_NAME}")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{8 * MiB} bytes (8.0 MiB) free" in done.stderr
    assert done.stdout.splitlines()[-1].split() == ["shm:", "0", SHM_NAME]  # left as it was, still sparse


def test_check_passes_when_the_tier_fits_and_creates_nothing(tmp_path):
    done = check_with_small_shm(tmp_path, "4MiB")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "lmcache.cli.main server" in done.stdout
    assert done.stdout.splitlines()[-1].strip() == "shm:"
