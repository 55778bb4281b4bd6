"""Apply decoded vLLM KV events of one publisher to the index.

What is indexed: full blocks of the plain-prompt cache (no LoRA, no multimodal / cache-salt extra
keys, KV-cache group 0 or unspecified, full attention), since a ``/lookup`` carries plain token ids
and could never match the others. Everything skipped is counted with its reason. Data-parallel
ranks of one instance are separate streams (their own sequence numbers) but share the instance's
bit: any rank's cache makes the instance a good target.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvshrink.errors import CorruptDataError
from kvshrink.index.block_index import TIER_INDEX, Feed
from kvshrink.index.events import AllBlocksCleared, BlockRemoved, BlockStored, DecodedBatch
from kvshrink.index.hashing import chain_hashes, root_hash, token_bytes
from kvshrink.index.registry import Instance
from kvshrink.index.state import IndexState

logger = logging.getLogger(__name__)
SOURCE = "vllm"


def feed_name(dp_rank: int | None) -> str:
    return f"vllm/dp{dp_rank}" if dp_rank else "vllm"


@dataclass
class ApplyCounts:
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n


def apply_batch(state: IndexState, inst: Instance, model: str, batch: DecodedBatch) -> ApplyCounts:
    """Apply every event of ``batch`` in order. Caller holds ``state.lock``."""
    counts = ApplyCounts()
    for reason in batch.dropped:
        counts.drop(reason.split(":", 1)[0])
    name = feed_name(batch.data_parallel_rank)
    feed = state.feed(inst, name)
    for event in batch.events:
        if isinstance(event, BlockStored):
            _apply_stored(state, feed, model, event, counts)
        elif isinstance(event, BlockRemoved):
            tier = _tier(state, event.medium, counts)
            if tier is not None and event.group_idx in (None, 0):
                removed, unknown = state.index.remove(feed, event.block_hashes, tier)
                counts.removed_blocks += removed
                counts.drop("remove_unknown_block", unknown)
        elif isinstance(event, AllBlocksCleared):
            state.reset_feed(inst, name, "all_blocks_cleared")
            counts.cleared += 1
    _publish(state, counts)
    return counts


def _apply_stored(state: IndexState, feed: Feed, model: str, ev: BlockStored, counts: ApplyCounts) -> None:
    n = len(ev.block_hashes)
    if ev.lora_name or ev.lora_id:
        return counts.drop("lora", n)
    if ev.extra_keys and any(k is not None for k in ev.extra_keys):
        return counts.drop("extra_keys", n)
    if ev.group_idx not in (None, 0) or ev.kv_cache_spec_kind not in (None, "full_attention"):
        return counts.drop("other_kv_group", n)
    tier = _tier(state, ev.medium, counts, n)
    if tier is None:
        return None
    bs = ev.block_size
    if len(ev.token_ids) != n * bs:
        return counts.drop("token_count_mismatch", n)
    root = root_hash(model, bs)
    if ev.parent_block_hash is None:
        parent = root
    else:
        parent = state.index.block_hash_of(feed, ev.parent_block_hash)
        if parent is None:
            return counts.drop("unknown_parent", n)
    try:
        data = token_bytes(ev.token_ids)
    except CorruptDataError:
        return counts.drop("bad_token_ids", n)
    hashes = chain_hashes(data, bs, parent)
    outcome = state.index.store(feed, ev.block_hashes, hashes, tier)
    if outcome.conflicts:
        logger.warning("%s: %d engine block hashes re-stored with other tokens (hash seed or algorithm changed "
                       "inside one publisher?)", feed.name, outcome.conflicts)
        counts.drop("hash_conflict", outcome.conflicts)
    counts.stored_blocks += outcome.stored
    state.note_block_size(model, bs)
    if bs == state.chunk_size and ev.parent_block_hash is None:
        state.learn_positions(data, bs, root, hashes)
    return None


def _tier(state: IndexState, medium: str | None, counts: ApplyCounts, n: int = 1) -> int | None:
    tier_name = state.config.vllm_media.get((medium or "GPU").lower())
    if tier_name is None:
        counts.drop("unknown_medium", n)
        return None
    return TIER_INDEX[tier_name]


def _publish(state: IndexState, counts: ApplyCounts) -> None:
    m = state.metrics
    if counts.stored_blocks:
        m.block_ops.labels(SOURCE, "store").inc(counts.stored_blocks)
    if counts.removed_blocks:
        m.block_ops.labels(SOURCE, "remove").inc(counts.removed_blocks)
    if counts.cleared:
        m.events.labels(SOURCE, "all_blocks_cleared").inc(counts.cleared)
    for reason, n in counts.dropped.items():
        m.drop(SOURCE, reason, n)
    state.sync_eviction_metric()
