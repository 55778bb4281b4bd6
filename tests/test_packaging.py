"""The installed layout: everything under the ``kvshrink`` namespace, nothing left out."""

from __future__ import annotations

import configparser
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDER_TO_PACKAGE = {"kvshrink": "kvshrink", "storage_backends": "kvshrink.storage_backends",
                     "plugins": "kvshrink.plugins", "benchmarks": "kvshrink.benchmarks"}


def _declared_packages() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return {line.strip() for line in cfg["options"]["packages"].splitlines() if line.strip()}


def _source_packages() -> set[str]:
    found = set()
    for folder, package in FOLDER_TO_PACKAGE.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *relative.parts]))
    return found


def test_every_package_folder_is_declared() -> None:
    assert _source_packages() == _declared_packages()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(ROOT)], check=True)
    (built,) = out.glob("kvshrink-*.whl")
    return built


def test_wheel_keeps_everything_under_kvshrink(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    modules = [n for n in names if n.endswith(".py")]
    assert modules, "wheel has no modules"
    stray = [n for n in modules if not n.startswith("kvshrink/")]
    assert stray == []
    for package in _declared_packages():
        assert package.replace(".", "/") + "/__init__.py" in names


def test_console_script_runs() -> None:
    result = subprocess.run([str(Path(sys.executable).parent / "kvshrink"), "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "fixture" in result.stdout
