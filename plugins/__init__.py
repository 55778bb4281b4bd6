"""vLLM, LMCache and router glue (installed as ``kvshrink.plugins``)."""
