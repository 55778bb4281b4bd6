"""keep_freed_memory: chunk-sized buffers freed by one put are reused warm by the next (counted
as page faults in a fresh process, since the setting is process-wide), and a user's own malloc
settings win."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

CHURN = """
import resource, sys, threading
from kvshrink.store.warm_heap import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "tuned" else None
from kvshrink.codec import encode
from kvshrink.testing.fixtures.real_kv import real_kv_chunks
chunks = real_kv_chunks(4, 256)
pages = 2 * sum(len(encode(c)) for c in chunks) // 4096  # of the frames one churn makes
def churn():  # what the put workers do: encode real chunks on two threads, frames freed at once
    threads = [threading.Thread(target=lambda: [encode(c) for c in chunks]) for _ in range(2)]
    for t in threads: t.start()
    for t in threads: t.join()
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(ROUNDS):
    churn()
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // ROUNDS, pages)
"""
ROUNDS = 4  # churns averaged after the warm-up: one churn's faults vary 0-2000 with thread interleaving


def _run(mode: str, **env: str) -> tuple[str, int, int]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run([sys.executable, "-c", f"ROUNDS = {ROUNDS}\n" + CHURN, mode], env={**environ, **env},
                         capture_output=True, text=True, timeout=60, check=True).stdout.split()
    return out[0], int(out[1]), int(out[2])


def test_freed_chunk_buffers_are_reused_without_page_faults():
    applied, faults, pages = _run("tuned")
    assert applied == "True"
    # 8 encodes of 5.9 MB chunks fault in thousands of fresh pages each when freed memory goes
    # back to the kernel (the warm-up churn: ~25,000); tuned, a churn after it reuses them warm:
    # on average under a quarter of the pages its frames take. (glibc's own dynamic mmap
    # threshold now keeps the same memory in this churn untuned, so the two are not compared:
    # one churn's faults varied 0-2,000 either way with the threads' interleaving.)
    assert faults * 4 < pages, (faults, pages)


def test_the_users_malloc_settings_win():
    applied, _, _ = _run("tuned", MALLOC_TRIM_THRESHOLD_="131072")
    assert applied == "False"
