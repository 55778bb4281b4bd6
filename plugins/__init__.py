"""Engine integration (installed as ``kvshrink.plugins``), one subpackage per host program:
``vllm`` (vLLM's general plugin and LMCache's in-process runtime on vLLM CPU) and ``router``
(production-stack's ``vllm_router`` with KVShrink's routing logic). The two never import each other
(tests/test_architecture.py)."""
