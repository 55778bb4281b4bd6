"""The installed layout: everything under the ``kvshrink`` namespace, nothing left out (the shipped
YAML files included), and no requirement that nothing imports."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDER_TO_PACKAGE = {"kvshrink": "kvshrink", "storage_backends": "kvshrink.storage_backends",
                     "plugins": "kvshrink.plugins", "benchmarks": "kvshrink.benchmarks", "configs": "kvshrink.configs"}
PRODUCT_FOLDERS = ("kvshrink", "storage_backends", "plugins")
IMPORT_NAMES = {"pyyaml": "yaml", "pyzmq": "zmq"}  # distribution -> module, where they differ


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def _declared_packages() -> set[str]:
    return {line.strip() for line in _setup_cfg()["options"]["packages"].splitlines() if line.strip()}


def _modules(requirements: str) -> list[str]:
    names = [re.match(r"[A-Za-z0-9_.-]+", line.strip()).group(0).lower() for line in requirements.splitlines()
             if line.strip()]
    return [IMPORT_NAMES.get(name, name.replace("-", "_")) for name in names]


def _imported(module: str, folders: tuple[str, ...]) -> bool:
    """Whether any source file in ``folders`` imports ``module`` (directly or via bench_extra.require)."""
    pattern = re.compile(rf"^\s*(?:import|from)\s+{re.escape(module)}\b|require\(\"{re.escape(module)}\b", re.M)
    return any(pattern.search(path.read_text()) for folder in folders for path in (ROOT / folder).rglob("*.py"))


def _source_packages() -> set[str]:
    found = set()
    for folder, package in FOLDER_TO_PACKAGE.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *relative.parts]))
    return found


def test_every_package_folder_is_declared() -> None:
    assert _source_packages() == _declared_packages()


def test_every_requirement_is_imported_where_it_is_declared() -> None:
    options = _setup_cfg()["options"]
    unused = [m for m in _modules(options["install_requires"]) if not _imported(m, PRODUCT_FOLDERS)]
    assert unused == [], "install_requires entries no product module imports (benchmark-only: the bench extra)"
    bench = _modules(_setup_cfg()["options.extras_require"]["bench"])
    assert bench and [m for m in bench if not _imported(m, ("benchmarks",))] == []
    assert [m for m in bench if _imported(m, PRODUCT_FOLDERS)] == [], "the product must install without the bench extra"


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
    shipped = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    assert "store-default.yaml" in shipped
    assert [n for n in shipped if f"kvshrink/configs/{n}" not in names] == []


def test_console_script_runs() -> None:
    result = subprocess.run([str(Path(sys.executable).parent / "kvshrink"), "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "fixture" in result.stdout
