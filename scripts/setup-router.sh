#!/usr/bin/env bash
# Idempotent: .venv-router/, a Python >= 3.12 environment with production-stack's router
# (`vllm_router`, from the vendored tests/vendor/production-stack-*.tar.gz: it is not on the package
# registry) and this project (editable, with its `router` extra: all that kvshrink.plugins.router
# needs). tests/index/test_index_vllm_e2e.py runs the real router from it.
# Called by scripts/setup.sh. Without a Python >= 3.12 (pyenv's ~/.pyenv/versions/3.12*, or
# python3.12 / python3.13 on PATH, or $KVSHRINK_ROUTER_BASE_PYTHON) it says so and skips; so do the
# router tests.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-router
tarball=$(ls tests/vendor/production-stack-*.tar.gz | head -n 1)
stamp="$venv/.router-installed-$(cat "$tarball" scripts/setup-router.sh setup.cfg pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi

base=""
for candidate in ${KVSHRINK_ROUTER_BASE_PYTHON:-} "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python \
    "$(command -v python3.12 || true)" "$(command -v python3.13 || true)"; do
  if [ -n "$candidate" ] && [ -x "$candidate" ] &&
      "$candidate" -c 'import sys, venv; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    base=$candidate; break
  fi
done
if [ -z "$base" ]; then
  echo "setup: no Python >= 3.12 found (pyenv ~/.pyenv/versions/3.12*, python3.12 on PATH):" \
       "skipping the production-stack router venv; its test will skip"
  exit 0
fi

echo "setup: building $venv (production-stack router from $tarball) with $base (~2-3 min)"
rm -rf "$venv"
"$base" -m venv "$venv"
src="$venv/src"
log="$venv/setup.log"
mkdir -p "$src"
tar -xzf "$tarball" -C "$src" --strip-components=1
pip=("$venv/bin/python" -m pip install --disable-pip-version-check)
if ! { SETUPTOOLS_SCM_PRETEND_VERSION=0.0.0 "${pip[@]}" "$src" &&
       "${pip[@]}" -e '.[router]' &&
       "$venv/bin/python" -c 'import vllm_router.app, kvshrink.plugins.router.router_launcher'; } >"$log" 2>&1; then
  tail -n 30 "$log" >&2
  echo "setup: building $venv failed (full log: $log)" >&2
  exit 1
fi
touch "$stamp"
