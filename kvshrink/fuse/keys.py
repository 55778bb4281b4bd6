"""The fused namespace: fused KV is never stored where exact KV is looked up.

A fused prompt KV is an approximation of the exact KV of the same tokens. It is stored under the
prompt's own chunk hashes (so that a repeat of the fused prompt is an ordinary prefix hit) but with
a **cache salt of its own**, :func:`fused_salt`: LMCache's ``ObjectKey`` carries ``cache_salt``
(vLLM passes the request's ``cache_salt`` through), our L2 key encoding ends with it
(``o1@model@rank@group@hash@salt``, storage_backends/keys.py), and an ordinary request (salt ``""``)
can therefore never read a fused chunk. The salt also names the settings that made the KV, so KV
fused at 5 % never answers a request that asked for 15 %, and a change of method (FUSE_VERSION)
orphans old fused chunks instead of serving them. Fusion can be switched off (no request carries a
fused salt), measured (count keys by salt) and evicted on its own (drop keys whose salt
:func:`is_fused_salt`), with no flag inside the stored frame.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshrink.errors import ConfigError

FUSE_VERSION = 1  # bump whenever fused KV for the same settings changes
_PREFIX = "kvfuse"
# vLLM's request validation and LMCache's ObjectKey both refuse these in a salt, and longer ones
_SALT_FORBIDDEN = frozenset("@/\\\x00")
SALT_MAX_LEN = 128


@dataclass(frozen=True)
class FuseSettings:
    """What decides the bytes of a fused KV (besides the model and the reused segments)."""

    ratio: float = 0.15
    check_layer: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ConfigError("fuse.ratio", f"{self.ratio} is not in [0, 1]")
        if self.check_layer < 1:
            raise ConfigError("fuse.check_layer", "must be at least 1")


def fused_salt(settings: FuseSettings, base_salt: str = "") -> str:
    """The cache salt fused chunks are stored under; ``base_salt`` (the request's own, e.g. a
    tenant's) is kept, so fusion never mixes tenants either."""
    tag = f"{_PREFIX}{FUSE_VERSION}-r{round(settings.ratio * 1000):04d}-c{settings.check_layer}"
    salt = tag if not base_salt else f"{tag}.{base_salt}"
    if len(salt) > SALT_MAX_LEN or _SALT_FORBIDDEN & set(salt):
        raise ConfigError("cache_salt", f"{base_salt!r} makes a fused salt vLLM and LMCache refuse "
                          f"(at most {SALT_MAX_LEN} characters, none of @ / \\ NUL)")
    return salt


def is_fused_salt(salt: str) -> bool:
    return salt.startswith(_PREFIX) and salt[len(_PREFIX):len(_PREFIX) + 1].isdigit()


def base_salt_of(salt: str) -> str:
    """The request's own salt inside a fused salt (``""`` when there was none)."""
    if not is_fused_salt(salt):
        return salt
    return salt.partition(".")[2]
