"""Which of vLLM CPU's attention ISAs this machine can lay KV out in, asked in a child process.

vLLM CPU's cache writer (``cpu_attn_reshape_and_cache``) packs pages per ISA ("amx", "vec",
"vec16"). Packing needs no AMX tiles, so the AMX layout can be checked on a CPU without them; but
a writer compiled for instructions this CPU lacks would kill the process with SIGILL, not raise.
So the first call per ISA runs the layout probe in a child process and remembers the answer.
"""

from __future__ import annotations

import functools
import subprocess
import sys

_PROBE = """
import sys, torch
from kvshrink.plugins.vllm.cpu_kv_layout import probe_paged_layout
probe_paged_layout(3, 128, 64, torch.bfloat16, sys.argv[1])
"""


@functools.lru_cache(maxsize=None)
def isa_unavailable(isa: str) -> str | None:
    """None when vLLM's cache writer lays out pages for ``isa`` on this CPU; else why not."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, isa], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return f"probing vLLM's cache writer with isa={isa} took over 300 s"
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return f"vLLM's cache writer cannot lay out isa={isa} here (exit {done.returncode}): " + (
        lines[-1] if lines else "no output")
