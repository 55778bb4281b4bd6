"""Keep LMCache's chunk keys equal across vLLM's processes (and restarts): a fixed ``PYTHONHASHSEED``.

LMCache's default chunk hash (``pre_caching_hash_algorithm: builtin``) is Python's ``hash()``, and
its chain starts from vLLM's ``NONE_HASH``, the ``hash()`` of a string. String hashes are salted
per process unless ``PYTHONHASHSEED`` is set when the interpreter starts, so vLLM's scheduler and
worker processes would key the same tokens differently and nothing would ever hit (nor would a
persisted cache survive a restart). A process cannot re-seed itself; its children inherit the
environment, though, and vLLM loads plugins in its first process before it spawns the engine core
and the workers. Hence two steps:

- :func:`seed_children` in that first process sets ``PYTHONHASHSEED=0`` if it is unset and an
  LMCache config file is named (``LMCACHE_CONFIG_FILE``, how the in-process connector is
  configured). Only then: a fixed seed also gives up Python's hash-flooding protection (and vLLM's
  random seed for xxhash block hashes), which is LMCache's requirement, not every vLLM user's.
- :func:`check_process_hash_seed`, called by our KV connector
  (:class:`~kvshrink.plugins.vllm.lmcache_cpu_connector.KVShrinkLMCacheConnector`) before LMCache starts,
  refuses a process that is still unseeded: no config file named, or the engine core run inside the
  first process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

from kvshrink.errors import KVShrinkError

logger = logging.getLogger(__name__)

HASH_SEED_ENV = "PYTHONHASHSEED"
CHILD_HASH_SEED = "0"
LMCACHE_CONFIG_ENV = "LMCACHE_CONFIG_FILE"
SEED_DEPENDENT_ALGORITHMS = ("builtin",)

# This process's seed as the interpreter saw it; read at import, before seed_children() can run.
SEED_AT_START = os.environ.get(HASH_SEED_ENV)


class HashSeedError(KVShrinkError, RuntimeError):
    """LMCache would key chunks with a per-process random hash seed, so no request could hit."""


def seed_children(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set ``PYTHONHASHSEED`` for the processes started from here if LMCache is configured and the
    seed is unset; True if it did."""
    if environ.get(HASH_SEED_ENV) is not None or LMCACHE_CONFIG_ENV not in environ:
        return False
    environ[HASH_SEED_ENV] = CHILD_HASH_SEED
    logger.warning("%s was unset and %s is set: set %s=%s for the vLLM processes started from pid %d, so that "
                   "LMCache's scheduler and workers key chunks alike; export it yourself to choose the value",
                   HASH_SEED_ENV, LMCACHE_CONFIG_ENV, HASH_SEED_ENV, CHILD_HASH_SEED, os.getpid())
    return True


def process_hash_is_seeded(seed_at_start: str | None = SEED_AT_START) -> bool:
    """Whether ``hash(str)`` here equals that of every process started with the same seed."""
    if seed_at_start is None or not seed_at_start.isdigit():
        return False  # unset, or "random"
    # With PYTHONHASHSEED=0 the interpreter disables salting; if it did not, the variable came later.
    return seed_at_start != "0" or sys.flags.hash_randomization == 0


def check_process_hash_seed(hash_algorithm: str, seed_at_start: str | None = SEED_AT_START) -> None:
    """Raise :class:`HashSeedError` if LMCache keys chunks with an unseeded ``hash()`` in this process."""
    if hash_algorithm not in SEED_DEPENDENT_ALGORITHMS or process_hash_is_seeded(seed_at_start):
        return
    raise HashSeedError(
        f"LMCache's in-process connector is starting in process {os.getpid()}, which started without a fixed "
        f"{HASH_SEED_ENV} (it was {seed_at_start!r}), and LMCache keys chunks with Python's hash() "
        f"(pre_caching_hash_algorithm: {hash_algorithm}): its keys would differ from the other vLLM processes' and "
        f"from the next run's, so nothing would ever hit. Export {HASH_SEED_ENV}=0 before starting vLLM (the kvshrink "
        f"plugin does that for vLLM's child processes when {LMCACHE_CONFIG_ENV} is set), or set "
        "pre_caching_hash_algorithm: sha256_cbor in the LMCache config.")
