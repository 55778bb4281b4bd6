"""Router integration (installed as ``kvshrink.plugins.router``): production-stack's ``vllm_router``
with KVShrink's tier- and load-aware routing logic (``router_logic``), which asks the global KV index
(``kvshrink.index``) over HTTP, and ``router_launcher`` (``kvshrink router``), which installs it.
Imports nothing of vLLM or LMCache."""
