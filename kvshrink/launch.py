"""Moved to :mod:`kvshrink.testing.launch`; this re-export keeps callers that were not yet updated working."""
from kvshrink.testing.launch import *  # noqa: F401,F403  # moved to kvshrink.testing.launch; shim removed once every caller is updated
