"""``kvshrink cache serve`` stops within ``server.shutdown_timeout_s`` and lets ``persist_on_close``
finish inside it: a real ``cache serve`` process over a DRAM tier that holds chunks the SSD does not.

The chunks are put into the DRAM arena before the server starts (a store closed without
``persist_on_close`` leaves them in /dev/shm, where the server's store finds them), so the test
needs no vLLM. First run: a bound too short for the close, so ``cache serve`` kills the server and says
in one line how many DRAM chunks may be left unpersisted; second run: a bound long enough, so every
chunk is on the SSD after a clean exit.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from kvshrink.store import TieredStore
from kvshrink.testing.derived_stores import derive_store
from kvshrink.testing.launch import free_port
from kvshrink.testing.polling import poll_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

CHUNKS = 12


def serve(config: Path, log: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvshrink.cli", "cache", "serve", "--config", str(config),
                             "--log-file", str(log.with_suffix(".lmcache.log")), *extra],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(proc: subprocess.Popen, log: Path) -> None:
    def ready() -> bool:
        assert proc.poll() is None, log.read_text()
        return "ready on" in log.read_text()

    poll_until(ready, 180, interval=0.5, what="cache serve to become ready",
               error=lambda message: AssertionError(f"{message}:\n{log.read_text()}"))


def stop(proc: subprocess.Popen, bound: float) -> tuple[int, float]:
    """SIGTERM, then the exit status and the seconds it took."""
    started = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    code = proc.wait(timeout=bound + 60)
    return code, time.monotonic() - started


def test_shutdown_waits_for_persist_on_close_within_its_bound(tmp_path, shm_name, real_chunks):
    store = derive_store(paths={"ssd": tmp_path / "ssd"}, shm_names={"dram": shm_name},
                         capacities={"dram": "128MiB", "ssd": "1GiB"})
    assert store["persist_on_close"] is True  # the shipped default's
    quiet = copy.deepcopy(store)
    quiet["persist_on_close"] = False
    keys = [uuid.uuid4().bytes for _ in range(CHUNKS)]
    with TieredStore.from_config(quiet) as writer:  # DRAM only: closed without persisting
        for i, key in enumerate(keys):
            assert writer.put(key, real_chunks[i % len(real_chunks)]).result()
        writer.flush()
        assert len(writer.keys("dram")) == CHUNKS and writer.keys("ssd") == []

    server = {"port": free_port(), "http_port": free_port(), "prometheus_port": free_port(), "l1_size_gb": 0.2,
              "shutdown_timeout_s": 0.1}  # far too short: the close is cut off
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"server": server, "store": store}))
    procs = []
    try:
        log = tmp_path / "cut-short.out"
        procs.append(proc := serve(config, log))
        wait_ready(proc, log)
        code, took = stop(proc, 0.1)
        assert code == 0 and took < 0.1 + 15, log.read_text()
        (line,) = [line for line in log.read_text().splitlines() if "still closing" in line]
        assert line.startswith("kvshrink cache serve: lmcache server still closing the store 0.1 s after SIGTERM")
        assert f"up to {CHUNKS} chunks held in DRAM at SIGTERM were not copied to the SSD" in line
        cut_short = sum(path.is_file() for path in (tmp_path / "ssd" / "chunks").rglob("*"))
        assert cut_short < CHUNKS  # the kill came first: what is on the SSD next, the second close copied

        log = tmp_path / "clean.out"
        procs.append(proc := serve(config, log, "--shutdown-timeout", "120"))  # the option overrides the file
        wait_ready(proc, log)
        code, took = stop(proc, 120)
        assert code == 0 and took < 120, log.read_text()
        assert "still closing" not in log.read_text()
        print(f"clean stop with {CHUNKS - cut_short} of {CHUNKS} chunks left to persist: {took:.1f} s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    with TieredStore.from_config(quiet) as reader:
        assert sorted(reader.keys("ssd")) == sorted(keys)  # every DRAM chunk persisted
        assert all(reader.get(key) is not None for key in keys)
