"""A fresh machine, for real: ``scripts/setup.sh`` takes its apt-get branch when redis-server or
redis-cli is missing, and a non-editable install finds the shipped default store from any folder.

Both run real processes (bash, apt-get, pip, the ``kvshrink`` console script) and stay off the
repository's state: setup.sh runs against the repository's ``.venv`` only when its install stamp
matches (it then only runs apt-get and the model fixture; a stale stamp would mean a reinstall, so
the test skips), and the install goes into a venv of its own from a copy of the checkout. That
venv borrows the dependencies of the repository's ``.venv`` through a ``.pth`` line (a plain path:
the editable finder of the repository's own kvshrink is not run), so nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
SETUP = ROOT / "scripts" / "setup.sh"
APT_DIRS = ("/usr/local/sbin", "/usr/sbin", "/sbin")  # apt-get and dpkg want these on PATH


def setup_stamp() -> Path:
    """The stamp file setup.sh leaves once .venv matches setup.cfg, pyproject.toml and the extras."""
    default = re.search(r"extras=\$\{KVSHRINK_EXTRAS:-([^}]*)\}", SETUP.read_text())
    assert default, "setup.sh no longer reads its extras from KVSHRINK_EXTRAS"
    extras = os.environ.get("KVSHRINK_EXTRAS") or default.group(1)
    digest = hashlib.sha256((ROOT / "setup.cfg").read_bytes() + (ROOT / "pyproject.toml").read_bytes()).hexdigest()
    return VENV / f".kvshrink-installed-{digest[:16]}-{extras.replace(',', '_')}"


def path_without(command: str, into: Path) -> str:
    """A PATH (one folder of symlinks) with every command of this PATH and the sbin folders but
    ``command``: the machine as if that package were not installed."""
    into.mkdir()
    for folder in [*os.environ["PATH"].split(os.pathsep), *APT_DIRS]:
        if not Path(folder).is_dir():
            continue
        for entry in Path(folder).iterdir():
            link = into / entry.name
            if entry.name != command and not link.exists() and not link.is_symlink():
                link.symlink_to(entry)
    return str(into)


@pytest.mark.parametrize("missing", ["redis-server", "redis-cli"])  # redis-cli: the Redis Cluster fixture's
def test_setup_sh_installs_a_missing_redis_server_with_apt_get(tmp_path: Path, missing: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("setup.sh runs apt-get through sudo when not root; this test needs root, not a password")
    if shutil.which("apt-get") is None:
        pytest.skip("no apt-get: setup.sh installs redis-server from the Debian package")
    stamp = setup_stamp()
    if not stamp.is_file():
        pytest.skip(f"{VENV} does not match setup.cfg ({stamp.name} missing): setup.sh would reinstall every "
                    "dependency; run scripts/setup.sh (or make test) first")
    env = {**os.environ, "PATH": path_without(missing, tmp_path / "bin")}
    env.pop("VIRTUAL_ENV", None)
    result = subprocess.run(["bash", str(SETUP)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "setup: installing redis-server" in result.stdout, out  # the apt-get branch ran
    assert "installing kvshrink" not in result.stdout, out  # and .venv was left as it was
    assert result.stdout.rstrip().endswith("setup: ready"), out
    assert stamp.is_file()
    for package in ("redis-server", "redis-tools"):
        status = subprocess.run(["dpkg-query", "-W", "-f", "${Status}", package], capture_output=True, text=True)
        assert status.stdout == "install ok installed", status
    assert shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


def _checkout_copy(into: Path) -> Path:
    """The files git would commit (tracked and new, not ignored), copied: the wheel is built from
    them and not in the checkout, whose build/ folder other runs may be using."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():  # a file deleted in the work tree is still listed until committed
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into


def _in_private_shm(argv: list[str], needed: int) -> list[str]:
    """``argv`` as is when /dev/shm has room for ``needed`` bytes, else under ``unshare -m`` on a
    private tmpfs /dev/shm large enough (a size limit: nothing is allocated)."""
    if shutil.disk_usage("/dev/shm").free >= needed:
        return argv
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"/dev/shm is smaller than the default DRAM tier and unshare -m is refused: {probe.stderr!r}")
    size = f"{(needed >> 20) * 2}m"
    return ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"', "sh", *argv]


def test_a_wheel_install_finds_the_shipped_default_from_any_folder(tmp_path: Path) -> None:
    source = _checkout_copy(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "wheel"), str(source)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "wheel").glob("kvshrink-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}  # this (repository) venv's
    (site / "kvshrink-test-deps.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    elsewhere, home = tmp_path / "elsewhere", tmp_path / "home"
    elsewhere.mkdir()
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HOME=str(home), PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", LMCACHE_LOG_LEVEL="ERROR")

    def run(*argv: str) -> str:
        result = subprocess.run(list(argv), cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"{argv}: {result.stdout}\n{result.stderr}"
        return result.stdout

    where = json.loads(run(str(python), "-c", "import json, kvshrink, kvshrink.configs as c; "
                           "from kvshrink.store import StoreConfig; print(json.dumps([kvshrink.__file__, "
                           "str(c.default_store_path()), "
                           "StoreConfig.load(c.default_store_path()).tiers[0].capacity]))"))
    package, default_store, dram_bytes = Path(where[0]), Path(where[1]), where[2]
    assert site in package.parents and ROOT not in package.parents  # the wheel's copy, not the checkout
    assert default_store == site / "kvshrink" / "configs" / "store-default.yaml"
    assert default_store.read_bytes() == (ROOT / "configs" / "store-default.yaml").read_bytes()
    kvshrink = str(venv / "bin" / "kvshrink")
    assert str(default_store) in "".join(run(kvshrink, "bench", "--help").split())  # argparse wraps lines
    check = run(*_in_private_shm([kvshrink, "cache", "serve", "--check"], dram_bytes))
    assert "lmcache.cli.main server" in check and f'"config": "{default_store}"' in check, check
    # the default's SSD tier is checked writable, and --check creates nothing (storage_backends/store_setup.py)
    assert not (home / ".cache" / "kvshrink" / "store-ssd").exists()
