"""Poll each instance's Prometheus ``/metrics``: load, liveness and restarts.

vLLM publishes KV events only when its cache changes, so an idle engine is silent; a successful
scrape keeps it alive in the registry. ``vllm:num_requests_running + vllm:num_requests_waiting``
is the instance's load when the caller of ``/lookup`` does not pass one. A changed
``process_start_time_seconds`` means the engine restarted (its cache is gone) even if no event
showed it: its vLLM streams are reset.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvshrink.index.state import IndexState

logger = logging.getLogger(__name__)

LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def parse_metrics(text: str) -> tuple[float | None, float | None]:
    """(load, process start time) from a Prometheus exposition; ``None`` where absent."""
    load = None
    start = None
    for family in text_string_to_metric_families(text):
        if family.name in LOAD_METRICS:
            load = (load or 0.0) + sum(sample.value for sample in family.samples if sample.name == family.name)
        elif family.name == "process_start_time_seconds":
            start = min((s.value for s in family.samples), default=None)
    return load, start


async def scrape_once(state: IndexState, client: httpx.AsyncClient, timeout_s: float) -> int:
    """Scrape every instance that has a URL; returns how many answered."""
    with state.lock:
        targets = [(inst.instance_id, inst.url) for inst in state.registry if inst.url]
    results = await asyncio.gather(*(_fetch(client, url, timeout_s) for _, url in targets))
    answered = 0
    for (instance_id, _), text in zip(targets, results):
        if text is None:
            continue
        try:
            load, start = parse_metrics(text)
        except ValueError as exc:
            logger.debug("unparsable /metrics from %s: %s", instance_id, exc)
            state.metrics.drop("scrape", "bad_metrics")
            continue
        answered += 1
        with state.lock:
            inst = state.registry.get(instance_id)
            if inst is None:
                continue
            state.registry.seen(inst)
            if load is not None:
                inst.load = load
            if start is not None:
                if inst.process_start is not None and abs(start - inst.process_start) > 1.0:
                    for name in [n for n in inst.feeds if n.startswith("vllm")]:
                        state.reset_feed(inst, name, "process_restart")
                    state.vllm_seq.forget_matching(lambda key: key[0] == instance_id)
                inst.process_start = start
    return answered


async def _fetch(client: httpx.AsyncClient, url: str, timeout_s: float) -> str | None:
    try:
        resp = await client.get(f"{url}/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return resp.text if resp.status_code == 200 else None


async def scrape_forever(state: IndexState, interval_s: float, timeout_s: float) -> None:
    async with httpx.AsyncClient() as client:
        while True:
            await scrape_once(state, client, timeout_s)
            await asyncio.sleep(interval_s)
