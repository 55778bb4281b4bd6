"""Moved to :mod:`kvshrink.testing.streaming_client`; this re-export keeps callers that were not yet updated working."""
from kvshrink.testing.streaming_client import *  # noqa: F401,F403  # moved to kvshrink.testing.streaming_client; shim removed once every caller is updated
