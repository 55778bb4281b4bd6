"""README's shell blocks that can run on a CPU machine, run against the real ``lmcache server`` +
KVShrink + vLLM CPU, so that README cannot drift from the code.

A block right after ``<!-- readme-test: cpu -->`` runs as one bash script (``set -euo pipefail``)
and must exit 0; after ``<!-- readme-test: cpu server -->`` it is one long-running command, run as
``exec <block>`` in the background until the test sends it SIGTERM (then it must exit 0). Before
running them, the test makes README's defaults private to itself, and changes nothing else:

- the ports 5555 (cache server), 8080 (its HTTP) and 8000 (vLLM) become free loopback ports;
- each ``kvshrink cache serve`` gets ``--config`` with a serve-cache file that is the default
  (no file) on those ports, with a 0.5 GB L1, over the shipped default store moved into the
  test's folder and a private /dev/shm name (DRAM 256 MiB, SSD 1 GiB);
- ``kvshrink`` is this interpreter's console script (PATH), temp files go to the test's folder.

vLLM is the one part not taken from README, whose command is for a GPU: vLLM CPU serving SmolLM2
(:class:`~kvshrink.testing.launch.VLLMServer`, vLLM's prefix cache on, as ``vllm serve`` has it)
under README's model name, attached with the ``--kv-transfer-config`` line the server block
printed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvshrink.testing.derived_stores import derive_store
from kvshrink.testing.launch import VLLMServer, free_port
from kvshrink.testing.polling import poll_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^<!-- readme-test: (cpu|cpu server) -->\n```bash\n(.*?)^```$", re.M | re.S)
README_PORTS = {"cache": 5555, "http": 8080, "vllm": 8000}
MODEL_IN_README = re.compile(r'\\"model\\": \\"([^"\\]+)\\"')


def readme_blocks() -> list[tuple[str, str]]:
    """(kind, text) of every marked block, in README's order."""
    return [(kind, text) for kind, text in BLOCK.findall(README.read_text())]


def private(text: str, ports: dict[str, int], config: Path) -> str:
    for name, port in README_PORTS.items():
        text = re.sub(rf"\b{port}\b", str(ports[name]), text)
    return re.sub(r"\bkvshrink cache serve\b", f"kvshrink cache serve --config {config}", text)


def run_script(text: str, env: dict[str, str], timeout: float) -> str:
    done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + text], capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert done.returncode == 0, f"README block failed ({done.returncode}):\n{text}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_readme_cpu_blocks_run_against_the_real_servers(tmp_path, shm_name, model):
    blocks = readme_blocks()
    assert [kind for kind, _ in blocks] == ["cpu", "cpu server", "cpu"], "README's marked blocks changed"
    (_, check), (_, serve), (_, request) = blocks
    assert "kvshrink cache serve --check" in check and serve.split("#")[0].strip() == "kvshrink cache serve"
    assert "/metrics" in request and (found := MODEL_IN_README.search(request)), request
    model_name = found.group(1)

    ports = {name: free_port() for name in README_PORTS}
    store = derive_store(paths={"ssd": tmp_path / "ssd"}, shm_names={"dram": shm_name},
                         capacities={"dram": "256MiB", "ssd": "1GiB"})
    config = tmp_path / "serve-cache.yaml"
    config.write_text(yaml.safe_dump({"server": {"port": ports["cache"], "http_port": ports["http"],
                                                 "prometheus_port": free_port(), "l1_size_gb": 0.5},
                                      "store": store}))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "TMPDIR": str(tmp_path)}

    printed = run_script(private(check, ports, config), env, 120)
    assert "lmcache.cli.main server" in printed and f"--port {ports['cache']}" in printed

    log = tmp_path / "serve.out"
    server = subprocess.Popen(["bash", "-c", "exec " + private(serve, ports, config).strip()], env=env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    vllm = None
    try:
        def connector() -> dict | None:
            assert server.poll() is None, log.read_text()
            line = re.search(r"^vLLM --kv-transfer-config '(.*)'$", log.read_text(), re.M)
            return json.loads(line.group(1)) if line else None

        kv_transfer_config = poll_until(connector, 180, interval=0.5, what="the cache server to print vLLM's line",
                                        error=lambda message: AssertionError(f"{message}:\n{log.read_text()}"))
        vllm = VLLMServer(model, port=ports["vllm"], served_model_name=model_name,
                          kv_transfer_config=kv_transfer_config, prefix_caching=True,
                          log_path=tmp_path / "vllm.log")
        vllm.start()
        metrics = run_script(private(request, ports, config), env, 300)
        print(metrics)
        values = {line.split("{")[0].split()[0]: float(line.split()[-1]) for line in metrics.splitlines()}
        assert values.get("lmcache_mp_lookup_hit_tokens_total", 0) > 0, metrics
        assert "kvshrink_store_tier_puts_total" in values, metrics
        vllm.stop()
        os.kill(server.pid, signal.SIGTERM)
        assert server.wait(timeout=180) == 0, log.read_text()
    finally:
        if vllm is not None:
            vllm.stop()
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
