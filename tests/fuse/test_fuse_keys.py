"""The fused namespace: fused KV never sits under an ordinary key."""

from __future__ import annotations

import pytest

from kvshrink.errors import ConfigError
from kvshrink.fuse.keys import FuseSettings, base_salt_of, fused_salt, is_fused_salt


def test_fused_salts_are_their_own_namespace_per_settings() -> None:
    s15, s05 = fused_salt(FuseSettings(0.15)), fused_salt(FuseSettings(0.05))
    assert s15 != "" and s15 != s05 and is_fused_salt(s15) and not is_fused_salt("")
    assert fused_salt(FuseSettings(0.15, check_layer=2)) != s15
    tenant = fused_salt(FuseSettings(0.15), "tenant-a")
    assert tenant != s15 and base_salt_of(tenant) == "tenant-a" and base_salt_of(s15) == ""
    assert not is_fused_salt("tenant-a") and base_salt_of("tenant-a") == "tenant-a"
    assert not is_fused_salt("kvfusex")


def test_a_salt_vllm_or_lmcache_would_refuse_is_refused() -> None:
    assert len(fused_salt(FuseSettings(0.15), "x" * 100)) <= 128
    for bad in ("x" * 120, "a@b", "a/b"):
        with pytest.raises(ConfigError, match="cache_salt"):
            fused_salt(FuseSettings(0.15), bad)


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="fuse.ratio"):
        FuseSettings(1.2)
    with pytest.raises(ConfigError, match="fuse.check_layer"):
        FuseSettings(0.1, check_layer=0)
