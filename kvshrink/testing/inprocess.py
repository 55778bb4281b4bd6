"""vLLM with LMCache's in-process runtime through KVShrink's connector, for the end-to-end tests.

:func:`in_process_server` starts it (a :class:`~kvshrink.testing.launch.VLLMServer`, not started
yet); :class:`LMCacheActivity` reads what LMCache's own log lines say it stored and retrieved,
rather than inferring hits from timing; :func:`prompt_token_ids` and :func:`greedy_token_ids` give
a real-text prompt and the exact greedy output, as token ids, to compare against plain vLLM.
TTFT is not measured here: the benchmark's figures come from the multiprocess runtime
(``benchmarks/e2e_paired.py``). Nothing here keeps state or threads; errors: a corpus shorter than
the prompt asked for is a :class:`CorpusTooShortError`, HTTP errors are httpx's own.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from kvshrink.configs import shipped_path
from kvshrink.errors import KVShrinkError

if TYPE_CHECKING:
    from kvshrink.testing.launch import VLLMServer

# KVShrink's LMCache connector, loaded by vLLM by module path: LMCache's in-process connector with
# our CPU connector in LMCache's engine (kvshrink.plugins.vllm.lmcache_cpu_connector).
IN_PROCESS_CONNECTOR = {"kv_connector": "KVShrinkLMCacheConnector",
                        "kv_connector_module_path": "kvshrink.plugins.vllm.lmcache_cpu_connector",
                        "kv_role": "kv_both"}
DEFAULT_CONFIG = shipped_path("lmcache-inprocess-cpu.yaml")  # installed with the package

_LOOKUP = re.compile(r"Total tokens (\d+), Inference Engine computed tokens: (\d+), LMCache hit tokens: (\d+)")
_RETRIEVED = re.compile(r"Retrieved (\d+) out of (\d+) required tokens")
_STORED = re.compile(r"Stored (\d+) out of total (\d+) tokens")


class CorpusTooShortError(KVShrinkError, ValueError):
    """The text corpus has fewer tokens than the prompt asked for."""


@dataclass
class LMCacheActivity:
    """What LMCache's own log lines say happened, request by request, in order."""

    hit_tokens: list[int] = field(default_factory=list)  # scheduler lookups
    retrieved_tokens: list[int] = field(default_factory=list)  # worker loads
    stored_tokens: list[int] = field(default_factory=list)  # worker stores

    @classmethod
    def from_log(cls, text: str) -> "LMCacheActivity":
        return cls(hit_tokens=[int(m.group(3)) for m in _LOOKUP.finditer(text)],
                   retrieved_tokens=[int(m.group(1)) for m in _RETRIEVED.finditer(text)],
                   stored_tokens=[int(m.group(1)) for m in _STORED.finditer(text)])


def prompt_token_ids(num_tokens: int, corpus: str = "code") -> list[int]:
    """``num_tokens`` token ids of real text; "code" is the corpus of the real-KV fixture."""
    from transformers import AutoTokenizer

    from kvshrink.testing.fixtures.real_kv import corpus_text
    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    ids = AutoTokenizer.from_pretrained(ensure_checkpoint())(corpus_text(corpus)).input_ids
    if len(ids) < num_tokens:
        raise CorpusTooShortError(f"the {corpus} corpus has only {len(ids)} tokens, not {num_tokens}")
    return list(ids[:num_tokens])


def greedy_token_ids(base_url: str, model: str, prompt: Sequence[int], max_tokens: int = 16,
                     timeout: float = 600.0) -> list[int]:
    """Greedy completion of a token-id prompt, returned as token ids (exact, unlike decoded text)."""
    body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1,
            "return_tokens_as_token_ids": True}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=timeout)
    response.raise_for_status()
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]
    return [int(token.removeprefix("token_id:")) for token in tokens]


def in_process_server(model: Path | str, config_file: Path | str, *, seed: str | None = "0",
                      log_path: Path | None = None, env: Mapping[str, str] | None = None) -> "VLLMServer":
    """A ``VLLMServer`` (not started) running LMCache in-process from ``config_file`` through
    :data:`IN_PROCESS_CONNECTOR`.

    ``VLLM_PLUGINS=kvshrink`` loads only our general plugin, which seeds the hash of vLLM's child
    processes; ``seed=None`` leaves ``PYTHONHASHSEED`` unset so that it has to.
    """
    from kvshrink.testing.launch import VLLMServer

    server = VLLMServer(model, kv_transfer_config=IN_PROCESS_CONNECTOR, log_path=log_path,
                        env={"LMCACHE_CONFIG_FILE": str(config_file), "VLLM_PLUGINS": "kvshrink",
                             # LMCacheActivity reads LMCache's INFO lines, whatever level this process uses
                             "LMCACHE_LOG_LEVEL": "INFO", **(env or {})})
    if seed is None:
        server.env.pop("PYTHONHASHSEED", None)
    else:
        server.env["PYTHONHASHSEED"] = seed
    return server
