"""The one check that stored KV is what it claims to be: its layer-0 keys against the model's.

Layer 0's keys depend only on the tokens and their positions, so the fusion engine recomputes
them cheaply. A chunk in the wrong layout, of another model or with damaged bytes is far off;
bf16 storage and another engine's kernels stay well within :data:`KEY_CHECK_TOLERANCE`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch

    from kvshrink.fuse.engine import FuseEngine

# A stored chunk's layer-0 keys must match a fresh computation within this relative error (per
# token, worst token): bf16 storage and another engine's kernels stay well below it (measured
# here: under 1e-2), a wrong layout, another model or damaged bytes are far above it (~1.4)
KEY_CHECK_TOLERANCE = 0.1


def layer0_key_error(engine: "FuseEngine", tokens: Sequence[int], start: int, kv: "torch.Tensor") -> float:
    """Worst per-token relative error of ``kv``'s layer-0 keys (``kv`` ``[2, L, T, H*D]``, read
    only) against the model's own for ``tokens`` at positions ``start...``; infinite when any value
    of ``kv`` is not finite. Runs the model's layer 0: call it from the fusion thread."""
    import torch

    if not bool(torch.isfinite(kv).all()):
        return float("inf")
    fresh = engine.layer0_keys(tokens, range(start, start + len(tokens)))
    stored = kv[0, 0].float()
    err = (stored - fresh).norm(dim=-1) / fresh.norm(dim=-1).clamp_min(1e-6)
    value = float(err.max())
    return value if value == value else float("inf")  # NaN (non-finite bytes): never within tolerance
