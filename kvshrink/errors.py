"""One exception family for the whole project.

Callers at LMCache / vLLM boundaries catch ``KVShrinkError`` (log, count, convert to the booleans
or bitmaps those APIs expect); everything else lets it propagate with its message intact.
"""

from __future__ import annotations


class KVShrinkError(Exception):
    """Base of every error KVShrink raises on purpose."""


class CorruptDataError(KVShrinkError, ValueError):
    """Stored or received bytes are corrupt, truncated, foreign or hostile."""


class StoreUnavailableError(KVShrinkError, ConnectionError):
    """A storage tier (disk, Redis, ...) cannot be reached or refuses the operation."""


class ConfigError(KVShrinkError, ValueError):
    """A configuration value is wrong; the message names the key to fix."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config key {key!r}: {message}")
        self.key = key


class InvalidKeyError(KVShrinkError, TypeError, ValueError):
    """A store key is not bytes, or is empty or too long: a caller bug, raised by the call itself
    (never through a Future). Both a TypeError and a ValueError, as the two checks were before."""
