"""Reading stored chunks out of LMCache's storage manager and writing fused ones in.

Both go through the storage manager's public calls, as LMCache's own handlers do: a read is one
prefetch into L1 (L2 loads included) and copies taken under read locks that are always released;
a write reserves L1 objects, fills them and admits only what was filled.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

from .chunk_codec import ChunkCodec
from .outcomes import FuseFallback

if TYPE_CHECKING:
    import torch

READ_TIMEOUT_S = 60.0  # one read of stored chunks (L2 loads included)


class ChunkIO:
    """Reads and writes of whole chunks through ``ctx.storage_manager`` (``ctx``: LMCache's server
    context, borrowed). Stateless; called from the fusion thread. Missing or unreadable chunks
    are data (None), not errors; FuseFallback only where the read itself did not finish."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx

    def read(self, keys: Sequence[Any], layout: Any, request_id: str,
             deadline: float) -> "list[torch.Tensor | None]":
        """Copies of the stored chunks ``keys`` (owned by the caller; None where one is not stored,
        not readable or not of ``layout``'s shape), read locks released before returning.
        FuseFallback("fallback_timeout") when the read outlasts ``deadline`` (monotonic) or
        :data:`READ_TIMEOUT_S`."""
        from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec

        if not keys:
            return []
        unique = list(dict.fromkeys(keys))
        sm = self._ctx.storage_manager
        spec = PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=unique, object_group_id=0, layout_desc=layout)],
                                num_kv_readers=1, fetching_policy="full")
        handle = sm.submit_prefetch_task(spec, external_request_id=f"kvfuse-{request_id}")
        if not sm.wait_prefetch_status(handle, min(READ_TIMEOUT_S, max(1.0, deadline - time.monotonic()))):
            raise FuseFallback("fallback_timeout", "reading stored chunks timed out")
        result = sm.query_prefetch_status(handle)
        if result is None:
            raise FuseFallback("fallback_missing", "the read's result was taken by someone else")
        bits = result.hit_cells[0] if result.hit_cells else None
        hit = [k for i, k in enumerate(unique) if bits is not None and bits.test(i)]
        owners = result.l1_owners or None
        copies: dict[Any, Any] = {}
        if hit:
            try:
                with sm.read_prefetched_results(hit, l1_owners=owners) as objs:
                    for obj_key, obj in zip(hit, objs or ()):
                        if obj is not None and obj.tensor is not None:
                            copies[obj_key] = obj.tensor.detach().clone()
            finally:
                sm.finish_read_prefetched(hit, read_locks=1, l1_owners=owners)
        want = tuple(layout.shapes[0])
        return [copies[k] if k in copies and tuple(copies[k].shape) == want else None for k in keys]

    def write(self, keys: Sequence[Any], kv: "torch.Tensor", layout: Any, codec: ChunkCodec,
              size: int) -> tuple[int, int]:
        """Write chunk ``i`` of ``kv`` (``[2, L, T, H*D]``, read only) under ``keys[i]``, encoded by
        ``codec``; (written, not written). A key that is already stored (or cannot be reserved)
        keeps what it holds."""
        sm = self._ctx.storage_manager
        reserved = sm.reserve_write(keys, layout)
        written = {}
        try:
            for i, obj_key in enumerate(keys):
                obj = reserved.get(obj_key)
                if obj is None or obj.tensor is None:
                    continue
                obj.tensor.copy_(codec.encode(kv[:, :, i * size:(i + 1) * size]))
                written[obj_key] = obj
        finally:
            if written:  # as LMCache's own engine-driven store: only what was copied in is admitted
                sm.finish_write_by_owner(sm.prepare_write_completion(written))
        return len(written), len(keys) - len(written)
