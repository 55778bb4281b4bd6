"""The MP L2 adapter's ``adapter_params``, validated before ``lmcache server`` starts.

LMCache finds :class:`KVShrinkL2AdapterConfig` by name in the adapter's module (the adapter's class
name + ``Config``), so :mod:`~kvshrink.storage_backends.mp_l2_adapter` re-exports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from kvshrink.errors import ConfigError
from kvshrink.storage_backends.store_setup import file_key_prefix, load_store_config
from kvshrink.storage_backends.tier_reporter import REPORTER_KEYS, ReporterSettings

if TYPE_CHECKING:
    from kvshrink.store import StoreConfig

PARAMS_PREFIX = "adapter_params."
DEFAULT_WORKERS = 4
_ALLOWED_PARAMS = {"config", "store", "workers", *REPORTER_KEYS}


class KVShrinkL2AdapterConfig(L2AdapterConfigBase):
    """Validated ``adapter_params``: where the store config comes from, worker threads, and
    which index to report tiers to (None: none)."""

    def __init__(self, store_source: "str | Mapping[str, Any]", store_config: "StoreConfig",
                 workers: int = DEFAULT_WORKERS, reporter: ReporterSettings | None = None) -> None:
        self.store_source = store_source
        self.store_config = store_config
        self.workers = workers
        self.reporter = reporter

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "KVShrinkL2AdapterConfig":
        from kvshrink.config_checks import mapping_value, workers_value

        d = mapping_value(d, PARAMS_PREFIX.rstrip("."), _ALLOWED_PARAMS)
        if ("config" in d) == ("store" in d):
            raise ConfigError(f"{PARAMS_PREFIX}config",
                              "give exactly one of 'config' (a store YAML path) or 'store' (the mapping inline)")
        if "config" in d:
            source = d["config"]
            if not isinstance(source, str) or not source:
                raise ConfigError(f"{PARAMS_PREFIX}config", f"expected a path to a store YAML file, got {source!r}")
            store_config = load_store_config(source, file_key_prefix(source), f"{PARAMS_PREFIX}config")
        else:
            source = d["store"]
            store_config = load_store_config(source, f"{PARAMS_PREFIX}store.", f"{PARAMS_PREFIX}store")
        workers = workers_value(d.get("workers", DEFAULT_WORKERS), f"{PARAMS_PREFIX}workers")
        return cls(source, store_config, workers, ReporterSettings.from_params(d, PARAMS_PREFIX))

    @classmethod
    def help(cls) -> str:
        return ("KVShrink L2 adapter params:\n"
                "- config (str): path to a KVShrink store YAML (tiers: dram / ssd / redis), or\n"
                "- store (dict): the same mapping inline\n"
                "- workers (int): threads running submitted tasks (default 4)\n"
                "- index_url (str): report each chunk's tier to this KVShrink index (default: off)\n"
                "- index_instance_id (str): the id the index knows this server's engine by (with index_url)\n"
                "- index_flush_interval (float): seconds between tier reports (default 0.5)\n"
                "- index_max_pending (int): chunks waiting to be reported before notices are dropped "
                "(default 65536)")
