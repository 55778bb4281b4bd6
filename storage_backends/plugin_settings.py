"""Settings of the in-process storage plugin, read from LMCache's ``extra_config``.

Our keys sit next to LMCache's loader keys in ``extra_config`` and are all named ``kvshrink.*``:

* ``kvshrink.config`` — path of a store YAML (relative: to the LMCache YAML's folder), or
* ``kvshrink.store`` — the same mapping inline;
* ``kvshrink.read_workers`` — threads that read and decode chunks (default 2).

Every problem raises :class:`ConfigError` naming the key as it appears in the LMCache YAML.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from kvshrink.config_checks import reject_unknown, workers_value
from kvshrink.errors import ConfigError
from kvshrink.storage_backends.store_setup import file_key_prefix, load_store_config

if TYPE_CHECKING:
    from lmcache.v1.memory_management import MemoryFormat

    from kvshrink.store import StoreConfig

PREFIX = "kvshrink."
CONFIG_KEY = f"{PREFIX}config"
STORE_KEY = f"{PREFIX}store"
READ_WORKERS_KEY = f"{PREFIX}read_workers"
KNOWN_KEYS = {CONFIG_KEY, STORE_KEY, READ_WORKERS_KEY}


@dataclass(frozen=True)
class PluginSettings:
    store_source: "str | StoreConfig"
    key_prefix: str  # how store keys are spelled in error messages
    source_key: str
    memory_format: "MemoryFormat"
    read_workers: int = 2

    @classmethod
    def from_engine(cls, config: Any, metadata: Any, local_cpu_backend: Any) -> "PluginSettings":
        """Validate LMCache's engine config for this plugin; raise ConfigError on anything wrong."""
        if config is None or metadata is None:
            raise ConfigError("storage_plugins", "the plugin needs LMCache's config and metadata; "
                                                 "load it through storage_plugins, not by hand")
        if local_cpu_backend is None:
            raise ConfigError("max_local_cpu_size", "must be > 0 with local_cpu: true: read buffers come from "
                                                    "LMCache's LocalCPUBackend (scheduler-side lookups are "
                                                    "not supported)")
        extra: Mapping[str, Any] = config.extra_config or {}
        reject_unknown([k for k in extra if str(k).startswith(PREFIX)], KNOWN_KEYS, "extra_config")  # ours only
        has_path, has_inline = CONFIG_KEY in extra, STORE_KEY in extra
        if has_path == has_inline:
            raise ConfigError(f"extra_config.{CONFIG_KEY}", f"set exactly one of {CONFIG_KEY} (a store YAML path) "
                                                            f"or {STORE_KEY} (the store mapping inline)")
        if has_path:
            path = extra[CONFIG_KEY]
            if not isinstance(path, (str, Path)) or not str(path):
                raise ConfigError(f"extra_config.{CONFIG_KEY}", f"expected a path to a store YAML file, got {path!r}")
            path = resolve_config_path(path)
            store = load_store_config(path, file_key_prefix(path), f"extra_config.{CONFIG_KEY}")
            key_prefix, source_key = file_key_prefix(path), f"extra_config.{CONFIG_KEY}"
        else:
            key_prefix, source_key = f"extra_config.{STORE_KEY}.", f"extra_config.{STORE_KEY}"
            store = load_store_config(extra[STORE_KEY], key_prefix, source_key)
        read_workers = workers_value(extra.get(READ_WORKERS_KEY, 2), f"extra_config.{READ_WORKERS_KEY}")
        return cls(store_source=store, key_prefix=key_prefix, source_key=source_key,
                   memory_format=expected_memory_format(config, metadata), read_workers=read_workers)


def resolve_config_path(path: "str | Path") -> Path:
    """A relative ``kvshrink.config`` is relative to the LMCache YAML that names it
    (``LMCACHE_CONFIG_FILE``), so a config directory can be moved as a whole; else to the CWD."""
    path = Path(path).expanduser()
    lmcache_file = os.environ.get("LMCACHE_CONFIG_FILE")
    if path.is_absolute() or not lmcache_file:
        return path
    return Path(lmcache_file).expanduser().resolve().parent / path


def expected_memory_format(config: Any, metadata: Any) -> "MemoryFormat":
    """The format LMCache's engine puts chunks in for this configuration (cache_engine.py):
    MLA models use KV_MLA_FMT; layerwise storage uses KV_T2D (KV_2TD with blending); else KV_2LTD.
    A frame stores dtype and shape but not this, so reads rebuild it from the config."""
    from lmcache.v1.memory_management import MemoryFormat

    if getattr(metadata, "use_mla", False):
        return MemoryFormat.KV_MLA_FMT
    if getattr(config, "use_layerwise", False):
        return MemoryFormat.KV_2TD if getattr(config, "enable_blending", False) else MemoryFormat.KV_T2D
    return MemoryFormat.KV_2LTD
