"""The ``fuse`` section of the serve-cache YAML, validated.

Kept apart from the module that loads LMCache so that ``kvshrink cache serve --check`` validates
the section (and names a bad key) without importing LMCache, torch or the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from kvshrink.config_checks import bool_value, int_value, mapping_value, number_value
from kvshrink.errors import ConfigError
from kvshrink.fuse.keys import FuseSettings

SECTION = "fuse"
SETTING_KEYS = ("enabled", "ratio", "check_layer", "model_path", "threads", "timeout_s", "max_pending",
                "min_reuse_chunks", "max_indexed_chunks", "anchor")
MAX_TIMEOUT_S = 290.0  # LMCache's clients give up after 300 s


@dataclass(frozen=True)
class FuseModuleSettings:
    """KV Fuse's settings: the serve-cache YAML's ``fuse`` section, which is also the server
    module's ``config``.

    ``ratio`` / ``check_layer``: CacheBlend's recompute fraction and check layer (they name the fused
    salt). ``model_path``: the bf16 checkpoint vLLM serves (the same weights; required when
    enabled). ``threads``: torch threads of the server process (0: torch's default). ``timeout_s``:
    a job still running after this writes nothing and falls back. ``max_pending``: fusion jobs
    queued or running; a lookup beyond them is not fused. ``min_reuse_chunks``: fewer reusable
    chunks than this is not worth fusing. ``max_indexed_chunks``: the index forgets the oldest
    beyond this (about 1 KiB each). ``anchor``: tokens the index looks up at each offset.
    """

    enabled: bool = False
    ratio: float = 0.15
    check_layer: int = 1
    model_path: str | None = None
    threads: int = 0
    timeout_s: float = 120.0
    max_pending: int = 4
    min_reuse_chunks: int = 1
    max_indexed_chunks: int = 65536
    anchor: int = 16

    @property
    def fuse(self) -> FuseSettings:
        """The settings that name the fused cache salt."""
        return FuseSettings(ratio=self.ratio, check_layer=self.check_layer)

    @classmethod
    def from_config(cls, data: Mapping[str, Any] | None, where: str = SECTION) -> "FuseModuleSettings":
        """Validate a ``fuse`` mapping (None: every default, fusion off). ConfigError names the key
        (``fuse.ratio``): an unknown key, a wrong type or a value out of range."""
        data = mapping_value(data, where, SETTING_KEYS)
        d = cls()

        def get(name: str) -> Any:
            return data.get(name, getattr(d, name))

        enabled = bool_value(get("enabled"), f"{where}.enabled")
        model_path = get("model_path")
        if model_path is not None and (not isinstance(model_path, str) or not model_path):
            raise ConfigError(f"{where}.model_path", f"expected a checkpoint directory, got {model_path!r}")
        if enabled and model_path is None:
            raise ConfigError(f"{where}.model_path", "required when fusion is enabled: the checkpoint vLLM serves")
        return cls(enabled=enabled, model_path=model_path,
                   ratio=number_value(get("ratio"), f"{where}.ratio", maximum=1.0),
                   check_layer=int_value(get("check_layer"), f"{where}.check_layer", minimum=1),
                   threads=int_value(get("threads"), f"{where}.threads", minimum=0, maximum=1024),
                   timeout_s=number_value(get("timeout_s"), f"{where}.timeout_s", above=True, maximum=MAX_TIMEOUT_S),
                   max_pending=int_value(get("max_pending"), f"{where}.max_pending", minimum=1),
                   min_reuse_chunks=int_value(get("min_reuse_chunks"), f"{where}.min_reuse_chunks", minimum=1),
                   max_indexed_chunks=int_value(get("max_indexed_chunks"), f"{where}.max_indexed_chunks", minimum=1),
                   anchor=int_value(get("anchor"), f"{where}.anchor", minimum=1))
