"""Moved to :mod:`kvshrink.testing.mp_observe`; this re-export keeps callers that were not yet updated working."""
from kvshrink.testing.mp_observe import *  # noqa: F401,F403  # moved to kvshrink.testing.mp_observe; shim removed once every caller is updated
