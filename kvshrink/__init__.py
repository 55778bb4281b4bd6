"""KVShrink: lossless KV-cache compression and tiered KV storage for LMCache and vLLM."""

__version__ = "0.1.0"
