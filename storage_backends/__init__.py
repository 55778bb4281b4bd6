"""LMCache storage backends (installed as ``kvshrink.storage_backends``)."""
