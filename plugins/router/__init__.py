"""Router integration (installed as ``kvshrink.plugins.router``): production-stack's ``vllm_router``
with KVShrink's tier- and load-aware routing logic (``router_logic``), which asks the global KV index
(``kvshrink.index``) over HTTP, and ``router_launcher`` (``kvshrink router serve``), which installs it.
Imports nothing of vLLM or LMCache.

Needs the ``router`` extra (httpx, msgspec; ``vllm_router`` itself is installed from production-stack's
source, scripts/setup-router.sh): without it, importing this package raises
:class:`~kvshrink.errors.MissingExtraError` with the ``pip install`` line.
"""

from kvshrink.extras import check

check("router")
