"""vLLM integration (installed as ``kvshrink.plugins.vllm``): what vLLM loads in its own processes.

``vllm_plugin`` is the ``vllm.general_plugins`` entry point (it seeds the hash of vLLM's child
processes, ``hash_seed``); ``lmcache_cpu_connector`` is the ``kv_connector_module_path`` that runs
LMCache's in-process engine on vLLM CPU, with ``cpu_connector`` + ``cpu_kv_layout`` in place of the
GPU connector LMCache ships. Importing this package imports none of them (vLLM calls the entry point
in every process, before its CPU workers start)."""
