"""The layout of docs/architecture.md, enforced: imports run one way, and the product never imports
the harness (``kvshrink.testing``) or the benchmarks (``kvshrink.benchmarks``).

Every product module (kvshrink/ without kvshrink/testing, storage_backends/, plugins/, configs/) is
parsed, never imported, so a module whose dependencies are missing here is checked too. Every
``import``/``from ... import`` counts, at module level or inside a function (a lazy import is
still a dependency), and so does ``importlib.import_module("literal")``. A violation names the
file and line. The product's own command line (kvshrink/cli.py) names the benchmark and fixture
commands by dotted path only; that is not an import, and the last test checks that a product
install without the bench and test extras imports and serves.
"""

from __future__ import annotations

import ast
import configparser
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Layer -> the layers it may import (besides itself and FOUNDATION). docs/architecture.md draws it:
#   vllm integration (plugins/vllm/) -> storage_backends (LMCache) -> configs -> store -> codec; the
#   index and the router integration (plugins/router/) beside that stack: the router may use the
#   index, neither uses the stack, and the two plugins/ subpackages never import each other.
# the error family, config parsing, the extras check
FOUNDATION = ("kvshrink.errors", "kvshrink.config_checks", "kvshrink.extras", "kvshrink")
LAYERS: dict[str, str] = {  # module prefix -> layer (longest prefix wins)
    "kvshrink.codec": "codec",
    "kvshrink.store": "store",
    "kvshrink.configs": "configs",
    "kvshrink.index": "index",
    "kvshrink.cascade": "cascade",
    "kvshrink.fuse": "fuse",
    "kvshrink.storage_backends": "backends",
    "kvshrink.storage_backends.kv_fuse": "fuse_glue",  # KV Fuse's lmcache server module
    "kvshrink.plugins": "plugins",  # the package of the two below; its __init__ imports nothing
    "kvshrink.plugins.vllm": "vllm",
    "kvshrink.plugins.vllm.cpu_kv_layout": "vllm_layout",  # vLLM CPU's paged KV layout, probed: a leaf
    "kvshrink.plugins.router": "router",
    "kvshrink.cli": "cli",
    "kvshrink.testing": "harness",
    "kvshrink.benchmarks": "benchmarks",
}
ALLOWED: dict[str, set[str]] = {
    "foundation": set(),
    "codec": set(),
    "store": {"codec"},
    "configs": {"store"},
    "index": set(),
    "cascade": {"store"},  # a TieredStore may keep condensations
    "fuse": set(),  # torch + transformers only
    "backends": {"configs", "store", "codec", "fuse_glue"},  # cache serve validates KV Fuse's settings
    "fuse_glue": {"fuse", "vllm_layout"},  # the fusion, and how vLLM CPU lays out the chunks it fuses
    "plugins": set(),
    "vllm": {"backends", "configs", "store", "codec", "vllm_layout"},
    "vllm_layout": set(),
    "router": {"index"},
    "cli": set(),  # dispatches by dotted path (COMMANDS), imports none of the commands
}
# LMCache's API is used only where LMCache loads us: everything else (the store, the codec, the
# fusion engine) runs without it, and its internals change between LMCache releases.
LMCACHE_LAYERS = {"backends", "fuse_glue", "vllm"}
# Every product module stays small (product_files(): the harness is not product): a module over
# MAX_MODULE_LINES lines or a class with more than MAX_CLASS_METHODS methods does more than one job.
MAX_MODULE_LINES = 400
MAX_CLASS_METHODS = 25
# Old module paths that re-export their new home in the harness until every caller is updated.
# Each may import exactly that module and nothing else; delete the file, then its line here.
TEMPORARY_SHIMS: dict[str, str] = {}  # old module path -> its new home, while callers move


def _package_dirs() -> dict[str, str]:
    """Source folder -> installed package, from setup.cfg's ``package_dir`` (one source of truth)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    pairs = [line.split("=") for line in cfg["options"]["package_dir"].splitlines() if "=" in line]
    return {folder.strip(): package.strip() for package, folder in pairs}


def module_name(path: Path) -> str:
    relative = path.relative_to(ROOT)
    package = _package_dirs()[relative.parts[0]]
    parts = [*relative.parts[1:-1], *([] if relative.stem == "__init__" else [relative.stem])]
    return ".".join([package, *parts])


def layer_of(module: str) -> str | None:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    if best is not None:
        return LAYERS[best]
    return "foundation" if module in FOUNDATION else None


def product_files() -> list[Path]:
    harness = {ROOT / "kvshrink" / "testing"}
    files = [p for folder in ("kvshrink", "storage_backends", "plugins", "configs") for p in (ROOT / folder).rglob("*.py")]
    return sorted(p for p in files if not harness & set(p.parents))


def imports(path: Path, module: str, root: str = "kvshrink") -> list[tuple[int, str]]:
    """(line, imported module) for every import of ``root`` (a top-level package) in ``path``;
    relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # ``from kvshrink import testing`` / ``from kvshrink.plugins import vllm`` import a layer
            # through its parent package: count the layer imported, not the parent's
            found += [(node.lineno, f"{base}.{alias.name}"
                       if layer_of(f"{base}.{alias.name}") not in (None, layer_of(base)) else base)
                      for alias in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return [(line, name) for line, name in found if name == root or name.startswith(root + ".")]


def violations(files: list[tuple[Path, str]]) -> list[str]:
    """One line per import that runs against ALLOWED: ``file:line: importer (layer) -> imported (layer)``."""
    out = []
    for path, module in files:
        shown = path.relative_to(ROOT) if ROOT in path.parents else path
        source = layer_of(module)
        shim_target = TEMPORARY_SHIMS.get(str(shown))
        if shim_target is not None:
            out += [f"{shown}:{line}: temporary shim imports {name}, not {shim_target}"
                    for line, name in imports(path, module) if name != shim_target]
            continue
        if source not in ALLOWED:
            out.append(f"{shown}: module {module} is in no product layer (add it to LAYERS / ALLOWED and to "
                       f"docs/architecture.md)")
            continue
        for line, name in imports(path, module):
            target = layer_of(name)
            if target in ("foundation", source) or target in ALLOWED[source]:
                continue
            out.append(f"{shown}:{line}: {module} ({source}) imports {name} ({target or 'unknown layer'})")
    return out


def lmcache_violations(files: list[tuple[Path, str]]) -> list[str]:
    """One line per LMCache import outside LMCACHE_LAYERS: ``file:line: importer (layer) imports name``."""
    out = []
    for path, module in files:
        source = layer_of(module)
        if source in LMCACHE_LAYERS:
            continue
        shown = path.relative_to(ROOT) if ROOT in path.parents else path
        out += [f"{shown}:{line}: {module} ({source}) imports {name}"
                for line, name in imports(path, module, "lmcache")]
    return out


def test_product_imports_run_one_way() -> None:
    found = violations([(p, module_name(p)) for p in product_files()])
    assert found == [], "imports against docs/architecture.md:\n" + "\n".join(found)


def test_the_check_names_the_offending_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\ndef f():\n    from kvshrink.storage_backends import keys\n"
                   "    from ..testing import launch\n    from kvshrink import benchmarks\n"
                   "    importlib.import_module('kvshrink.plugins.vllm.vllm_plugin')\n")
    assert violations([(bad, "kvshrink.store.bad")]) == [
        f"{bad}:4: kvshrink.store.bad (store) imports kvshrink.storage_backends (backends)",
        f"{bad}:5: kvshrink.store.bad (store) imports kvshrink.testing (harness)",
        f"{bad}:6: kvshrink.store.bad (store) imports kvshrink.benchmarks (benchmarks)",
        f"{bad}:7: kvshrink.store.bad (store) imports kvshrink.plugins.vllm.vllm_plugin (vllm)"]
    router = tmp_path / "router_bad.py"
    router.write_text("from kvshrink.index import client\nfrom kvshrink.plugins import vllm\n"
                      "from ..vllm.hash_seed import seed_children\n")
    assert violations([(router, "kvshrink.plugins.router.router_bad")]) == [
        f"{router}:2: kvshrink.plugins.router.router_bad (router) imports kvshrink.plugins.vllm (vllm)",
        f"{router}:3: kvshrink.plugins.router.router_bad (router) imports kvshrink.plugins.vllm.hash_seed (vllm)"]
    ok = tmp_path / "ok.py"
    ok.write_text("from kvshrink.codec import encode\nfrom kvshrink.errors import ConfigError\nfrom . import config\n")
    assert violations([(ok, "kvshrink.store.ok")]) == []


def test_only_the_lmcache_glue_imports_lmcache(tmp_path: Path) -> None:
    found = lmcache_violations([(p, module_name(p)) for p in product_files()])
    assert found == [], "LMCache imported outside storage_backends/ and plugins/vllm/:\n" + "\n".join(found)
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n\ndef f():\n"
                   "    from lmcache.v1.multiprocess.request_handler import request_handler\n")
    assert lmcache_violations([(bad, "kvshrink.fuse.bad")]) == [
        f"{bad}:4: kvshrink.fuse.bad (fuse) imports lmcache.v1.multiprocess.request_handler"]
    assert lmcache_violations([(bad, "kvshrink.storage_backends.kv_fuse.bad")]) == []


def test_modules_and_classes_stay_small() -> None:
    found = []
    for path in product_files():
        shown = path.relative_to(ROOT)
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found.append(f"{shown}: {len(text.splitlines())} lines > {MAX_MODULE_LINES}")
        for node in ast.walk(ast.parse(text, str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if len(methods) > MAX_CLASS_METHODS:
                found.append(f"{shown}:{node.lineno}: class {node.name} has {len(methods)} methods "
                             f"> {MAX_CLASS_METHODS}")
    assert found == [], "split these by job:\n" + "\n".join(found)


def test_the_benchmark_tree_holds_the_main_job_only() -> None:
    """``benchmarks/`` is what ``kvshrink bench``, ``store-bench`` and ``index-bench`` run: at most a
    third of the product's lines (one-off studies live outside the package, or in git)."""
    def lines(paths: list[Path]) -> int:
        return sum(len(p.read_text().splitlines()) for p in paths)

    bench, product = lines(sorted((ROOT / "benchmarks").rglob("*.py"))), lines(product_files())
    assert bench <= product / 3, f"benchmarks/ has {bench} lines, over a third of the product's {product}"


def test_temporary_shims_only_re_export_their_new_home() -> None:
    for shim, target in TEMPORARY_SHIMS.items():
        path = ROOT / shim
        assert path.is_file(), f"{shim} is gone: remove its line from TEMPORARY_SHIMS"
        body = [n for n in ast.parse(path.read_text()).body if not isinstance(n, ast.Expr)]  # skip the docstring
        assert [ast.unparse(n) for n in body] == [f"from {target} import *"], f"{shim} is more than a shim"


def test_the_harness_does_not_import_the_benchmarks() -> None:
    found = [f"{p.relative_to(ROOT)}:{line}: {name}" for p in (ROOT / "kvshrink" / "testing").rglob("*.py")
             for line, name in imports(p, module_name(p)) if layer_of(name) == "benchmarks"]
    assert found == []


def _extra_modules(*extras: str) -> list[str]:
    """Import names of what ``extras`` add beyond install_requires (from setup.cfg)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")

    def names(text: str) -> set[str]:
        return {re.match(r"[A-Za-z0-9_.-]+", line.strip()).group(0).lower().replace("-", "_")
                for line in text.splitlines() if line.strip()}

    base = names(cfg["options"]["install_requires"])
    return sorted(set().union(*(names(cfg["options.extras_require"][e]) for e in extras)) - base)


def test_a_product_install_without_bench_and_test_extras_imports_and_serves(tmp_path: Path) -> None:
    """``kvshrink cache serve --check`` with every bench / test extra module, the harness and the
    benchmarks unimportable, as on a machine where only the product is installed."""
    blocked = [*_extra_modules("bench", "test"), "kvshrink.testing", "kvshrink.benchmarks"]
    assert {"tqdm", "matplotlib", "numcodecs", "pytest"} <= set(blocked)
    config = tmp_path / "serve-cache.yaml"
    config.write_text(textwrap.dedent(f"""\
        store:
          tiers:
            - {{kind: dram, name: dram, capacity: 16MiB, put: true, shm_name: kvshrink-archtest-{tmp_path.name}}}
            - {{kind: ssd, name: ssd, path: {tmp_path / 'ssd'}, capacity: 64MiB, write_back: true}}
        """))
    script = textwrap.dedent(f"""\
        import sys
        BLOCKED = {blocked!r}

        class Uninstalled:
            def find_spec(self, name, path=None, target=None):
                if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                    raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)

        sys.meta_path.insert(0, Uninstalled())
        from kvshrink.cli import main
        code = main(["cache", "serve", "--config", {str(config)!r}, "--check"])
        loaded = sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED))
        print("LOADED", loaded)
        sys.exit(code)
        """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "lmcache.cli.main server" in result.stdout and "LOADED []" in result.stdout, result.stdout


def test_a_benchmark_command_without_its_extra_says_how_to_install_it(tmp_path: Path) -> None:
    """Installed metadata (a dist-info folder first on sys.path) whose bench extra lists a missing
    distribution: ``kvshrink bench`` stops before running, naming it and the pip line (``--help``
    still works: the check runs after parsing)."""
    info = tmp_path / "kvshrink-0.0.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: kvshrink\nVersion: 0.0\n"
                                         "Requires-Dist: numpy\n"
                                         "Requires-Dist: numpy; extra == \"bench\"\n"
                                         "Requires-Dist: kvshrink-no-such-dist>=1; extra == \"bench\"\n"
                                         "Requires-Dist: kvshrink-no-such-test-dist; extra == \"test\"\n")
    script = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from kvshrink.cli import main; "
              "main(['bench', '--readme-from', '/nonexistent'])")  # were the check missing: a harmless error
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == ("kvshrink bench needs the bench extra (kvshrink-no-such-dist "
                                                      "not installed): pip install 'kvshrink[bench]'")
