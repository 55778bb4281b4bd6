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


class StoreClosedError(KVShrinkError, RuntimeError):
    """An operation on a store (or a part of it) after ``close()``: a caller's lifecycle bug."""


class ConfigError(KVShrinkError, ValueError):
    """A configuration value is wrong. ``key`` is the setting to fix as the operator spells it
    (``store.tiers[1].path``; None when no single setting is to blame, e.g. an unreadable file
    before a caller names the setting that holds its path); ``reason`` says what is wrong with it.
    Callers that re-home a key (a store inside a serve-cache file) build a new error from these two
    fields, never from the message."""

    def __init__(self, key: str | None, reason: str) -> None:
        super().__init__(reason if key is None else f"config key {key!r}: {reason}")
        self.key = key
        self.reason = reason

    def __reduce__(self) -> tuple:  # survive pickling (process pools) with both fields
        return (type(self), (self.key, self.reason))


class InvalidKeyError(KVShrinkError, TypeError, ValueError):
    """A store key is not bytes, or is empty or too long: a caller bug, raised by the call itself
    (never through a Future). Both a TypeError and a ValueError, as the two checks were before."""


class MissingExtraError(KVShrinkError, ImportError):
    """An optional dependency is not installed: ``what`` (``kvshrink cache serve``) needs ``module``,
    which the setup.cfg extra ``extra`` installs. The message is the whole fix, one line:
    ``kvshrink cache serve needs lmcache: pip install 'kvshrink[lmcache]'``. An ImportError too, so
    code that already treats a missing import as "feature unavailable" keeps doing so."""

    def __init__(self, module: str, extra: str, what: str) -> None:
        super().__init__(f"{what} needs {module}: pip install 'kvshrink[{extra}]'", name=module)
        self.module = module
        self.extra = extra
        self.what = what

    def __reduce__(self) -> tuple:  # survive pickling (process pools) with all three fields
        return (type(self), (self.module, self.extra, self.what))
