"""TTFT of LMCache's in-process runtime on vLLM CPU (the kvshrink plugin), cold vs warm, vs plain vLLM.

Starts plain vLLM, then vLLM with ``LMCacheConnectorV1`` + the kvshrink plugin + an LMCache YAML,
one after the other (never both: the machine's cores are shared). Each first gets one request with
another prompt (a process's one-time start-up costs, reported apart), then the same token-id prompt
several times: the first of those is a cache miss (cold), the rest can hit (warm). Prints streaming
TTFT, the tokens LMCache stored and retrieved (read from its log lines, not inferred from timing)
and whether the greedy outputs agree. Run::

    python -m kvshrink.benchmarks.inprocess_cpu --prompt-tokens 2200 --requests 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvshrink.configs import shipped_path

# KVShrink's LMCache connector, loaded by vLLM by module path (kvshrink.plugins.lmcache_cpu_connector):
# LMCache's in-process connector with our CPU connector in LMCache's engine.
IN_PROCESS_CONNECTOR = {"kv_connector": "KVShrinkLMCacheConnector",
                        "kv_connector_module_path": "kvshrink.plugins.lmcache_cpu_connector", "kv_role": "kv_both"}
DEFAULT_CONFIG = shipped_path("lmcache-inprocess-cpu.yaml")  # installed with the package

_LOOKUP = re.compile(r"Total tokens (\d+), Inference Engine computed tokens: (\d+), LMCache hit tokens: (\d+)")
_RETRIEVED = re.compile(r"Retrieved (\d+) out of (\d+) required tokens")
_STORED = re.compile(r"Stored (\d+) out of total (\d+) tokens")


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
        raise ValueError(f"the {corpus} corpus has only {len(ids)} tokens")
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
                      log_path: Path | None = None, env: Mapping[str, str] | None = None):
    """A ``VLLMServer`` running LMCache in-process from ``config_file`` through :data:`IN_PROCESS_CONNECTOR`.

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


def _measure(server: Any, prompt: list[int], warmup: list[int], requests: int, max_tokens: int) -> dict[str, Any]:
    """First a different prompt (the process's one-time start-up costs), then ``prompt`` ``requests`` times."""
    from kvshrink.testing.streaming_client import stream_completion

    with server:
        server.start()
        first = stream_completion(server.url, server.served_model_name, warmup, max_tokens=max_tokens)
        runs = [stream_completion(server.url, server.served_model_name, prompt, max_tokens=max_tokens)
                for _ in range(requests)]
        token_ids = greedy_token_ids(server.url, server.served_model_name, prompt, max_tokens)
    return {"first_request_ttft_s": round(first.ttft_s, 3), "ttft_s": [round(r.ttft_s, 3) for r in runs],
            "texts": [r.text for r in runs], "token_ids": token_ids}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", type=int, default=2200)
    parser.add_argument("--requests", type=int, default=3, help="identical requests per server (first is cold)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="LMCache YAML for the in-process run")
    parser.add_argument("--reserved-cpus", type=int, default=1,
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU for both servers (vLLM reserves one more core when a KV "
                             "connector is set; on a 2-core machine it then runs its threads on both cores); "
                             "0 keeps vLLM's own choice")
    parser.add_argument("--lmcache-first", action="store_true",
                        help="run the LMCache server before plain vLLM (on a shared machine, swap to see drift)")
    parser.add_argument("--json", type=Path, help="write the figures here")


def run(args: argparse.Namespace) -> int:
    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint
    from kvshrink.testing.launch import VLLMServer

    model = ensure_checkpoint()
    prompt = prompt_token_ids(args.prompt_tokens)
    warmup = prompt_token_ids(args.prompt_tokens, corpus="prose")
    log_path = Path(tempfile.mkstemp(prefix="kvshrink-inprocess-", suffix=".log")[1])
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus)} if args.reserved_cpus else {}
    servers = {"plain": VLLMServer(model, env=env),
               "lmcache": in_process_server(model, args.config, log_path=log_path, env=env)}
    order = ["lmcache", "plain"] if args.lmcache_first else ["plain", "lmcache"]
    figures = {name: _measure(servers[name], prompt, warmup, args.requests, args.max_tokens) for name in order}
    plain, cached = figures["plain"], figures["lmcache"]
    activity = LMCacheActivity.from_log(log_path.read_text(errors="replace"))
    result = {
        "prompt_tokens": len(prompt), "config": str(args.config), "log": str(log_path), "env": env,
        "plain_vllm_first_request_ttft_s": plain["first_request_ttft_s"],
        "lmcache_first_request_ttft_s": cached["first_request_ttft_s"],
        "plain_vllm_ttft_s": plain["ttft_s"], "lmcache_ttft_s": cached["ttft_s"],
        "lmcache_cold_ttft_s": cached["ttft_s"][0],
        "lmcache_warm_ttft_s_median": statistics.median(cached["ttft_s"][1:]) if args.requests > 1 else None,
        "lmcache": asdict(activity),
        "same_greedy_tokens": plain["token_ids"] == cached["token_ids"],
        "same_text_every_request": len(set(plain["texts"] + cached["texts"])) == 1,
    }
    print(f"prompt {len(prompt)} tokens, {args.requests} identical requests after one other prompt, "
          f"{args.max_tokens} output tokens")
    print(f"  first request after start (s):  plain {plain['first_request_ttft_s']}, "
          f"LMCache {cached['first_request_ttft_s']}")
    print(f"  plain vLLM CPU TTFT (s):        {plain['ttft_s']}")
    print(f"  LMCache in-process TTFT (s):    {cached['ttft_s']}  (first = cold: cache miss)")
    print(f"  LMCache hit tokens per lookup:  {activity.hit_tokens}  (first = the other prompt)")
    print(f"  LMCache retrieved / stored:     {activity.retrieved_tokens} / {activity.stored_tokens}")
    print(f"  same greedy tokens as plain:    {result['same_greedy_tokens']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["same_greedy_tokens"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
