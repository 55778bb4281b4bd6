"""Tier kinds by name: what ``kind:`` in a store YAML may say, and which class serves it.

Why a registry: the config parser and the store must not name a kind, or adding one means edits
wherever they do. A kind is one module holding its :class:`~kvshrink.store.tier_base.Tier`
subclass, whose ``config_class`` (a :class:`~kvshrink.store.config.TierConfig` subclass) holds and
checks the kind's own keys, plus one registration line: an entry in :data:`BUILT_IN` here, or a
:func:`register_tier` call. Built-in kinds are registered by dotted path and imported when a
config first names them (as in fsspec's ``known_implementations``), so a kind whose dependencies
are missing costs nothing until it is used.

Contract: registering the same class (or path) again is a no-op, as a plugin may be loaded twice;
another class under a taken kind needs ``clobber=True``. Lookups raise
:class:`~kvshrink.errors.ConfigError` under the key that named the kind, listing the registered
kinds. Threads: register at import time; lookups may come from any thread (dict reads, and an
import under Python's import lock). Buffers: none.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable

from kvshrink.config_checks import one_of
from kvshrink.errors import ConfigError

if TYPE_CHECKING:
    from kvshrink.store.config import TierConfig
    from kvshrink.store.tier_base import Tier

BUILT_IN: dict[str, str] = {  # kind -> "module:Class", imported on first use
    "dram": "kvshrink.store.dram:DramTier",
    "ssd": "kvshrink.store.ssd:SsdTier",
    "redis": "kvshrink.store.redis_tier:RedisTier",
}
_kinds: dict[str, "str | type[Tier]"] = dict(BUILT_IN)


def register_tier(kind: str, tier: "str | type[Tier]", *, clobber: bool = False) -> None:
    """Make ``kind`` name ``tier``: a Tier subclass, or its ``"module:Class"`` path (imported
    when a config names the kind). Raises ValueError when ``kind`` is taken by another class
    and ``clobber`` is false."""
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"a tier kind is a non-empty string, got {kind!r}")
    known = _kinds.get(kind)
    if known is not None and known != tier and not clobber:
        raise ValueError(f"tier kind {kind!r} is registered already ({_label(known)}); pass clobber=True "
                         f"to replace it with {_label(tier)}")
    _kinds[kind] = tier


def registered_kinds() -> tuple[str, ...]:
    """Every kind a store YAML may name, sorted."""
    return tuple(sorted(_kinds))


def tier_class(kind: Any, key: str = "kind") -> "type[Tier]":
    """The Tier subclass registered for ``kind``, imported on first use. ConfigError under
    ``key`` for an unknown kind, or for a registered path that does not import."""
    one_of(kind, registered_kinds(), key)
    found = _kinds[kind]
    if isinstance(found, str):
        module, _, name = found.partition(":")
        try:
            found = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(key, f"tier kind {kind!r} is registered as {found}, which cannot be loaded: "
                                   f"{exc}") from exc
        _kinds[kind] = found
    return found


def config_class(kind: Any, key: str = "kind") -> "type[TierConfig]":
    """The config class of ``kind``'s keys (see :func:`tier_class` for errors)."""
    return tier_class(kind, key).config_class


def build_tier(config: "TierConfig", is_pinned: Callable[[bytes], bool]) -> "Tier":
    """Open the tier ``config`` describes (``is_pinned``: keys its eviction must skip). The
    tier's own errors propagate (StoreUnavailableError, CorruptDataError, ...); callers find the
    failing tier by this frame's ``config`` (storage_backends.store_setup), so keep the name."""
    return tier_class(config.kind)(config, is_pinned)


def _label(tier: "str | type") -> str:
    return tier if isinstance(tier, str) else f"{tier.__module__}:{tier.__qualname__}"
