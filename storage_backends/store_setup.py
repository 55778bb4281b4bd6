"""Open the tiered store for an LMCache plugin, loudly.

LMCache swallows a failing in-process storage plugin (one log line) and a failing L2 adapter
takes the whole cache server down with a deep traceback. Either way the operator needs one
sentence naming the setting to fix, so the checks that depend on the machine rather than on the
YAML (is the SSD directory writable, does the DRAM tier fit in ``/dev/shm``, does Redis answer)
run here, before the store is built, and every failure is a :class:`ConfigError` whose key is
spelled the way the operator wrote it (``store.tiers[1].path``, ``kvshrink.config``, ...).

Runtime outages stay the store's business (a Redis that goes away later is a miss, not an
error); only the start-up state is checked.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from kvshrink.errors import ConfigError, KVShrinkError

if TYPE_CHECKING:
    from kvshrink.store import StoreConfig, TieredStore
    from kvshrink.store.config import TierConfig

log = logging.getLogger(__name__)

REDIS_PROBE_TIMEOUT_S = 2.0


def load_store_config(source: "str | Path | Mapping[str, Any] | StoreConfig", key_prefix: str,
                      source_key: str = "<store>") -> "StoreConfig":
    """Parse a store config (YAML path or mapping). A bad value names ``key_prefix`` + its store key
    (``store.tiers[0].capacity``); an unreadable file names ``source_key``, the setting that holds
    the path (``kvshrink.config``)."""
    from kvshrink.store import StoreConfig

    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if not path.is_file():
            raise ConfigError(source_key, f"store config file {str(path)!r} does not exist")
    try:
        return StoreConfig.load(source)
    except ConfigError as exc:  # re-home the key: None is the file itself, named by source_key
        raise ConfigError(source_key if exc.key is None else f"{key_prefix}{exc.key}", exc.reason) from exc


def file_key_prefix(path: "str | Path") -> str:
    """Key prefix for settings that live in a store YAML file: ``/etc/store.yaml:tiers[1].path``."""
    return f"{path}:"


def preflight(config: "StoreConfig", key_prefix: str) -> None:
    """Check what the YAML cannot: SSD directories are writable and their disks have room for the
    tiers' capacities, DRAM tiers fit in /dev/shm, Redis answers. Reads only: no directory, arena
    or key is created. (Codec methods and levels are checked when the YAML is parsed, by
    ``kvshrink.store.config``.)"""
    dram_tiers: list["TierConfig"] = []
    ssd_tiers: list["TierConfig"] = []
    for index, tier in enumerate(config.tiers):
        key = f"{key_prefix}tiers[{index}]"
        if tier.kind == "ssd":
            _check_directory(Path(tier.path), f"{key}.path")
            ssd_tiers.append(tier)
            _check_disk_room(ssd_tiers, f"{key}.capacity")
        elif tier.kind == "dram":
            dram_tiers.append(tier)
            _check_shm_room(dram_tiers, f"{key}.capacity")
        elif tier.kind == "redis":
            _check_redis(tier.url, tier.cluster, f"{key}.url")


def open_store(source: "str | Path | Mapping[str, Any] | StoreConfig", key_prefix: str,
               source_key: str = "<store>") -> "TieredStore":
    """Load, preflight and open a :class:`TieredStore`; every failure names the key to fix."""
    from kvshrink.store import TieredStore

    config = load_store_config(source, key_prefix, source_key)
    preflight(config, key_prefix)
    try:
        return TieredStore(config)
    except (KVShrinkError, OSError) as exc:
        index = _failed_tier(exc, config)
        key = f"{key_prefix}tiers[{index}]" if index is not None else key_prefix.rstrip(".:") or source_key
        raise ConfigError(key, f"cannot open the store: {exc}") from exc


def _failed_tier(exc: BaseException, config: "StoreConfig") -> int | None:
    """Index of the tier whose opening raised ``exc``: TieredStore opens tiers one at a time with
    ``build_tier(tier_config, ...)``, so the innermost such call in the traceback holds the exact
    TierConfig (an object, not a name guessed from the message). None: the store failed elsewhere."""
    from kvshrink.store.tier_registry import build_tier

    found = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is build_tier.__code__:
            found = tb.tb_frame.f_locals.get("config")
        tb = tb.tb_next
    for index, tier in enumerate(config.tiers):
        if tier is found:
            return index
    return None


def _check_directory(path: Path, key: str) -> None:
    """The store can create or use ``path``: it is a writable directory, or the nearest existing
    folder above it is. Creates nothing (``cache serve --check`` must leave the machine as it was);
    the SSD tier makes its directories when it opens."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = f"{str(existing)!r} exists and is not a directory"
        raise ConfigError(key, what if existing == path else f"cannot create directory {str(path)!r}: {what}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(key, f"directory {str(existing)!r} is not writable by this user"
                               + ("" if existing == path else f", so {str(path)!r} cannot be created"))


def _check_shm_room(tiers: "list[TierConfig]", key: str) -> None:
    """An arena reserves all its pages when the store opens it, so a /dev/shm too small fails
    there; say so here first, creating nothing: the DRAM tiers so far must fit in the free space
    plus what their existing arena files already hold (an arena reopens in place)."""
    from kvshrink.store.shm_file import describe_size
    from kvshrink.store.dram import arena_path

    path = arena_path(tiers[-1])
    directory = path.parent
    if not directory.is_dir():
        raise ConfigError(key, f"{directory} does not exist; the DRAM tier's arena {path} lives there")
    page = os.sysconf("SC_PAGE_SIZE")
    needed = sum(-(-t.capacity // page) * page for t in tiers)
    held = sum(_allocated_bytes(arena_path(t)) for t in tiers)
    vfs = os.statvfs(directory)
    free = vfs.f_bavail * vfs.f_frsize
    if needed > free + held:
        raise ConfigError(key, f"the DRAM arena {path} needs {describe_size(tiers[-1].capacity)}"
                               + (f" ({describe_size(needed)} with the DRAM tiers before it)" if len(tiers) > 1 else "")
                               + f" but {directory} has {describe_size(free)} free"
                               + (f" and {describe_size(held)} in existing arena files" if held else "")
                               + f"; lower the capacity or enlarge {directory}")


def _check_disk_room(tiers: "list[TierConfig]", key: str) -> None:
    """An SSD tier fills its disk up to its capacity; a disk that cannot hold it would fail puts
    with a full disk later, after its other users had run short. Say so now: the SSD tiers so far
    on the last one's file system must fit in its free space plus what their existing files
    already hold (a tier reopens its files in place)."""
    from kvshrink.store.shm_file import describe_size

    def on_disk(path: Path) -> Path:  # the nearest existing folder (_check_directory passed)
        while not path.exists() and path != path.parent:
            path = path.parent
        return path

    last = on_disk(Path(tiers[-1].path))
    device = os.stat(last).st_dev
    same = [t for t in tiers if os.stat(on_disk(Path(t.path))).st_dev == device]
    needed = sum(t.capacity for t in same)
    held = sum(_tree_bytes(Path(t.path)) for t in same)
    vfs = os.statvfs(last)
    free = vfs.f_bavail * vfs.f_frsize
    if needed > free + held:
        raise ConfigError(key, f"the SSD tier at {tiers[-1].path} may fill {describe_size(tiers[-1].capacity)}"
                               + (f" ({describe_size(needed)} with the SSD tiers before it on that disk)"
                                  if len(same) > 1 else "")
                               + f" but the disk holding {last} has {describe_size(free)} free"
                               + (f" and {describe_size(held)} in the tier's existing files" if held else "")
                               + "; lower the capacity or choose a larger disk")


def _tree_bytes(path: Path) -> int:
    """Bytes the files under ``path`` hold on disk; 0 when it does not exist."""
    if not path.is_dir():
        return 0
    return sum(_allocated_bytes(Path(root) / name) for root, _, names in os.walk(path) for name in names)


def _allocated_bytes(path: Path) -> int:
    """Bytes of memory a (possibly sparse) existing file holds; 0 when there is none."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def _check_redis(url: str, cluster: bool, key: str) -> None:
    import redis
    from redis.exceptions import RedisError

    try:
        if cluster:
            from redis.cluster import RedisCluster

            client: Any = RedisCluster.from_url(url, socket_connect_timeout=REDIS_PROBE_TIMEOUT_S,
                                                socket_timeout=REDIS_PROBE_TIMEOUT_S)
        else:
            client = redis.Redis.from_url(url, socket_connect_timeout=REDIS_PROBE_TIMEOUT_S,
                                          socket_timeout=REDIS_PROBE_TIMEOUT_S)
        try:
            client.ping()
        finally:
            client.close()
    except (RedisError, OSError) as exc:
        raise ConfigError(key, f"cannot reach Redis at {url}: {exc}") from exc


def warm_codec(config: "StoreConfig") -> None:
    """Run the codec once per method the tiers use, so that loading its compiled kernels (about a
    second in a fresh process) happens at start-up and not inside the first request's TTFT."""
    import torch

    from kvshrink.codec import decode, encode

    sample = torch.randn(2, 4, 256, 64).to(torch.bfloat16)
    for method in sorted({t.method if t.compressed else "raw" for t in config.tiers}):
        frame = encode(sample, method=method)
        decode(frame, out=torch.empty_like(sample))
