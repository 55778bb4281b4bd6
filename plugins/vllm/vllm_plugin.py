"""vLLM general plugin ``kvshrink``: a fixed hash seed for the processes vLLM starts, our log lines in its log.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), possibly
more than once; it is idempotent and imports neither LMCache nor torch. What it is for:

- :func:`~kvshrink.plugins.vllm.hash_seed.seed_children` in vLLM's first process: with ``LMCACHE_CONFIG_FILE``
  set and ``PYTHONHASHSEED`` unset, the engine core and workers vLLM spawns get ``PYTHONHASHSEED=0``,
  so that LMCache's scheduler and workers key chunks alike. Only a plugin runs early enough for that:
  a KV connector is built in the engine core and the workers, after they have started.
- :func:`log_through_vllm`: ``kvshrink.*`` log lines go to vLLM's handlers (the server log).

The CPU connector is not installed here: vLLM loads it as a KV connector,
:class:`~kvshrink.plugins.vllm.lmcache_cpu_connector.KVShrinkLMCacheConnector` (``kv_connector_module_path``).
An earlier version of this plugin swapped LMCache's ``CreateGPUConnector`` from an import hook, for
``kv_connector: LMCacheConnectorV1``; that path is gone (on vLLM CPU, LMCache then logs ``No supported
cpu connector found`` and runs without a cache).
"""

from __future__ import annotations

import logging

from kvshrink.plugins.vllm.hash_seed import seed_children


def register() -> None:
    """``vllm.general_plugins`` entry point. Idempotent; imports neither LMCache nor torch."""
    log_through_vllm()
    seed_children()


def log_through_vllm() -> None:
    """Send our log lines to vLLM's handlers so they land in the server log next to LMCache's."""
    ours = logging.getLogger("kvshrink")
    vllm_logger = logging.getLogger("vllm")
    if ours.handlers or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False
