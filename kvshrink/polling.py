"""Moved to :mod:`kvshrink.testing.polling`; this re-export keeps callers that were not yet updated working."""
from kvshrink.testing.polling import *  # noqa: F401,F403  # moved to kvshrink.testing.polling; shim removed once every caller is updated
