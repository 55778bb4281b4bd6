"""The per-layer forward that fuses: a Llama-family model run layer by layer over a KV buffer.

One primitive, :meth:`FuseEngine.run`, serves every use: a prompt's KV buffer ``[2, L, T, H*D]`` is
given with some positions already filled (reused, re-rotated KV; or an exact prefix), and a set of
positions to compute. The computed positions' hidden states go through every layer; at each layer
their new K/V overwrite the buffer at their positions and their queries attend causally over the
*whole* buffer (reused entries included: a mask ``key position <= query position``). So:

* full prefill = every position computed (``ratio = 1``), the same math as an ordinary forward;
* continuation / decoding = the buffer is a prefix plus new slots, only the new slots computed;
* CacheBlend's selective recompute (:meth:`FuseEngine.fuse`) = layers before ``check_layer``
  compute every non-prefix token; at ``check_layer`` each reused token's deviation
  ``||k_new - k_reused||^2`` is measured, the top ``ratio`` of reused tokens (plus every gap
  token, which has no reused KV) are kept, and only those are computed in the later layers.
  ``ratio = 0`` skips the check: reused KV is kept as re-rotated, only gap tokens are computed.
  A caller may rank the reused tokens itself (``priority``: a score per position, e.g. a
  benchmark's oracle that knows the full prefill's KV); the check layer then keeps its top ``ratio``
  instead of the most deviating ones, at the same cost.

Precision: the weights are the model's (bf16 on disk) held in float32, the math runs in float32 (bf16
matmuls are slow on CPUs without AVX512-BF16 / AMX), and every K/V written to the buffer is rounded
to ``kv_dtype`` (bf16: what the serving engine stores) before any query reads it; ``kv_dtype=None``
keeps float32 (what an ordinary float32 forward does; the tests compare against that).

Threads: an engine holds no per-call state; calls may come from any thread but compete for the same
cores (torch's intra-op threads are the caller's setting).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from kvshrink.errors import ConfigError
from kvshrink.fuse.rope import RopeSpec, apply_rope, rerotate


@dataclass(frozen=True)
class ReusedSegment:
    """KV of ``kv.shape[2]`` tokens computed earlier at positions ``source_start...``, to be placed
    at ``start...`` of the new prompt. ``kv`` is ``[2, L, n, H*D]`` (LMCache layout), K post-RoPE."""

    start: int
    source_start: int
    kv: torch.Tensor


@dataclass
class FuseResult:
    """A prompt's KV ``[2, L, T, H*D]`` in ``kv_dtype`` and what it cost.

    ``exact`` is True only when no reused KV was kept as is (every position computed, or an exact
    prefix): anything else is an approximation and must live in the fused namespace
    (:mod:`kvshrink.fuse.keys`), never under the prompt's ordinary keys.
    """

    kv: torch.Tensor
    logits: torch.Tensor | None  # [len(logits_at), vocab] float32, for the positions asked for
    computed_tokens: int  # tokens whose hidden state went through every layer
    reused_tokens: int  # tokens whose reused KV was placed in the buffer
    recomputed_tokens: int  # of those, recomputed in every layer after the check layer
    exact: bool
    token_layers: int = 0  # sum over layers of the tokens computed there (the FLOP proxy)
    selected: list[int] = field(default_factory=list)


class FuseEngine:
    """Wraps a transformers ``LlamaForCausalLM`` (or a Llama-shaped model) for layer-by-layer runs.

    ``model`` is used read-only; its weights are copied to float32 once if they are not already.
    """

    def __init__(self, model: Any, kv_dtype: torch.dtype | None = torch.bfloat16) -> None:
        config = model.config
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            raise ConfigError("model", "models with attention or MLP biases are not supported")
        if next(model.parameters()).dtype != torch.float32:
            model = _float32_copy(model)
        self.model = model.eval()
        self.config = config
        self.kv_dtype = kv_dtype
        self.rope = RopeSpec.from_model(model)
        self.num_layers = int(config.num_hidden_layers)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = self.rope.head_dim
        self.kv_width = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim ** -0.5
        self._layers = list(model.model.layers)

    @classmethod
    def from_pretrained(cls, path: str, kv_dtype: torch.dtype | None = torch.bfloat16) -> "FuseEngine":
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise ConfigError("model_path", f"cannot load a model from {path!r}: {exc}") from exc
        return cls(model, kv_dtype)

    # ------------------------------------------------------------------ public entry points
    def empty_kv(self, tokens: int) -> torch.Tensor:
        return torch.zeros(2, self.num_layers, tokens, self.kv_width, dtype=self.kv_dtype or torch.float32)

    def prefill(self, token_ids: Sequence[int], logits_at: Sequence[int] = (-1,)) -> FuseResult:
        """The ordinary full prefill (every position computed)."""
        n = len(token_ids)
        return self.run(token_ids, self.empty_kv(n), list(range(n)), logits_at=logits_at)

    def extend(self, kv: torch.Tensor, token_ids: Sequence[int], logits_at: Sequence[int] | None = None) -> FuseResult:
        """``kv`` (a prefix of ``kv.shape[2]`` tokens) followed by ``token_ids``, computed; logits
        for every new token unless ``logits_at`` (indices into the new tokens) says otherwise."""
        start = kv.shape[2]
        full = torch.cat([kv.to(self.kv_dtype or torch.float32), self.empty_kv(len(token_ids))], dim=2)
        at = range(len(token_ids)) if logits_at is None else logits_at
        positions = list(range(start, start + len(token_ids)))
        ids = [0] * start + list(token_ids)
        return self.run(ids, full, positions, logits_at=[start + (i % len(token_ids)) for i in at])

    def fuse(self, token_ids: Sequence[int], segments: Sequence[ReusedSegment], ratio: float,
             check_layer: int = 1, prefix_kv: torch.Tensor | None = None,
             logits_at: Sequence[int] = (-1,), priority: torch.Tensor | None = None) -> FuseResult:
        """CacheBlend: the prompt's KV from reused segments (re-rotated here) and recomputation.

        ``prefix_kv``, when given, is the exact KV of the prompt's first ``prefix_kv.shape[2]``
        tokens (an ordinary prefix hit); it is never recomputed. Segments must not overlap each
        other or the prefix. ``ratio`` in [0, 1] is the fraction of reused tokens recomputed after
        ``check_layer`` (1 = full prefill of everything after the prefix). ``priority`` (float
        ``[len(token_ids)]``), when given, picks those reused tokens (highest first) instead of the
        check layer's K deviation; it is read, not kept.
        """
        if not 0.0 <= ratio <= 1.0:
            raise ConfigError("ratio", f"{ratio} is not in [0, 1]")
        if not 1 <= check_layer < self.num_layers:
            raise ConfigError("check_layer", f"{check_layer} is not in [1, {self.num_layers - 1}]")
        n = len(token_ids)
        if priority is not None and tuple(priority.shape) != (n,):
            raise ValueError(f"priority has shape {tuple(priority.shape)}, expected ({n},)")
        kv = self.empty_kv(n)
        reused = torch.zeros(n, dtype=torch.bool)
        prefix = 0
        if prefix_kv is not None:
            prefix = prefix_kv.shape[2]
            kv[:, :, :prefix] = prefix_kv.to(kv.dtype)
        for seg in segments:
            length = seg.kv.shape[2]
            if seg.start < prefix or seg.start + length > n or reused[seg.start:seg.start + length].any():
                raise ValueError(f"segment at {seg.start} (+{length}) overlaps the prefix, another segment "
                                 f"or the prompt's end ({n})")
            kv[0, :, seg.start:seg.start + length] = rerotate(seg.kv[0], seg.start - seg.source_start, self.rope).to(kv.dtype)
            kv[1, :, seg.start:seg.start + length] = seg.kv[1].to(kv.dtype)
            reused[seg.start:seg.start + length] = True
        todo = torch.ones(n, dtype=torch.bool)
        todo[:prefix] = False
        gaps = todo & ~reused
        n_reused = int(reused.sum())
        if ratio == 0.0 or n_reused == 0:
            return self.run(token_ids, kv, _indices(gaps), logits_at=logits_at, reused_tokens=n_reused)
        if ratio == 1.0:
            result = self.run(token_ids, kv, _indices(todo), logits_at=logits_at, reused_tokens=n_reused)
            result.recomputed_tokens, result.exact = n_reused, True
            return result
        keep = max(1, int(math.ceil(ratio * n_reused)))
        return self.run(token_ids, kv, _indices(todo), logits_at=logits_at, reused_tokens=n_reused,
                        check=(check_layer, reused, keep, priority))

    @torch.inference_mode()
    def layer0_keys(self, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Post-RoPE layer-0 keys ``[T, H*D]`` (float32) of ``token_ids`` at ``positions``.

        They depend on the tokens and positions only (no attention has mixed anything in yet), so
        KV stored by another engine can be checked against them: a wrong layout, another model or
        damaged bytes deviate by far more than bf16 rounding."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
        layer = self._layers[0]
        x = layer.input_layernorm(self.model.model.embed_tokens(ids).float())
        cos, sin = self.rope.cos_sin(torch.as_tensor(list(positions), dtype=torch.int64))
        k = apply_rope(layer.self_attn.k_proj(x).view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        return k.reshape(len(ids), -1)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Queries ``[S, H_q, D]`` over buffer rows ``[T, H_kv*D]`` -> ``[S, H_q*D]``.

        Grouped-query attention without repeating the KV heads: the ``group`` query heads that share
        a KV head are laid out as ``group * S`` query rows of that head (the mask repeated to match).
        A float 4-D mask takes torch's fused CPU attention kernel; a boolean or 3-D one falls back to
        the unfused math path, several times slower here.
        """
        s, group = q.shape[0], self.num_heads // self.num_kv_heads
        k = keys.float().view(-1, self.num_kv_heads, self.head_dim).transpose(0, 1)[None]
        v = values.float().view(-1, self.num_kv_heads, self.head_dim).transpose(0, 1)[None]
        rows = q.view(s, self.num_kv_heads, group, self.head_dim).permute(1, 2, 0, 3).reshape(1, self.num_kv_heads, group * s, self.head_dim)
        out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=self.scaling)
        return out.view(self.num_kv_heads, group, s, self.head_dim).permute(2, 0, 1, 3).reshape(s, -1)

    # ------------------------------------------------------------------ the loop
    @torch.inference_mode()
    def run(self, token_ids: Sequence[int], kv: torch.Tensor, positions: Sequence[int],
            logits_at: Sequence[int] = (-1,), reused_tokens: int = 0,
            check: tuple[int, torch.Tensor, int, torch.Tensor | None] | None = None) -> FuseResult:
        """Compute ``positions`` of the prompt over ``kv`` (modified in place and returned).

        ``check = (layer, reused_mask, keep, priority)``: at ``layer``, narrow the computed positions
        to the non-reused ones plus the ``keep`` reused ones whose new K deviates most from the
        buffer's (or, when ``priority`` is not None, whose priority is highest).
        """
        n = kv.shape[2]
        logits_at = [p % n for p in logits_at]
        sel = torch.as_tensor(list(positions), dtype=torch.int64)
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
        h = self.model.model.embed_tokens(ids[sel]).float() if len(sel) else torch.zeros(0, self.config.hidden_size)
        cos, sin = self.rope.cos_sin(sel)
        token_layers, computed, recomputed = 0, len(sel), 0
        mask = None  # rebuilt when the computed positions change
        for index, layer in enumerate(self._layers):
            if not len(sel):
                break
            x = layer.input_layernorm(h)
            attn = layer.self_attn
            k = apply_rope(attn.k_proj(x).view(-1, self.num_kv_heads, self.head_dim), cos, sin)
            if check is not None and index == check[0]:
                reused_mask, keep, priority = check[1], check[2], check[3]
                is_reused = reused_mask[sel]
                if priority is None:
                    old = kv[0, index, sel].float().view(-1, self.num_kv_heads, self.head_dim)
                    deviation = ((k - old) ** 2).sum(dim=(1, 2))
                else:
                    deviation = priority[sel].float().clone()
                deviation[~is_reused] = float("inf")  # gap tokens are always computed
                n_gap = int((~is_reused).sum())
                chosen = torch.topk(deviation, k=min(len(sel), n_gap + keep)).indices.sort().values
                recomputed = len(chosen) - n_gap
                sel, h, x, k = sel[chosen], h[chosen], x[chosen], k[chosen]
                cos, sin = cos[chosen], sin[chosen]
                computed, mask = len(sel), None
            token_layers += len(sel)
            q = apply_rope(attn.q_proj(x).view(-1, self.num_heads, self.head_dim), cos, sin)
            v = attn.v_proj(x)
            kv[0, index, sel] = k.reshape(len(sel), -1).to(kv.dtype)
            kv[1, index, sel] = v.to(kv.dtype)
            end = int(sel.max()) + 1
            if mask is None:
                mask = _causal_mask(sel, end, self.num_heads // self.num_kv_heads)
            out = self._attend(q, kv[0, index, :end], kv[1, index, :end], mask)
            h = h + attn.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = None
        if logits_at:
            where = {int(p): i for i, p in enumerate(sel.tolist())}
            missing = [p for p in logits_at if p not in where]
            if missing:
                raise ValueError(f"logits asked for positions {missing} that were not computed to the last layer")
            rows = h[[where[p] for p in logits_at]]
            logits = self.model.lm_head(self.model.model.norm(rows)).float()
        return FuseResult(kv=kv, logits=logits, computed_tokens=computed, reused_tokens=reused_tokens,
                          recomputed_tokens=recomputed, exact=recomputed == reused_tokens,
                          token_layers=token_layers, selected=sel.tolist())


def _causal_mask(sel: torch.Tensor, end: int, group: int) -> torch.Tensor | None:
    """Additive float mask ``[1, 1, group * len(sel), end]`` (query rows as :meth:`FuseEngine._attend`
    lays them out): query ``i`` (at ``sel[i]``) sees keys ``<= sel[i]``; None when every query sees
    every key (one decoding step)."""
    allowed = torch.arange(end)[None, :] <= sel[:, None]
    if bool(allowed.all()):
        return None
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    return mask.repeat(group, 1)[None, None]


def _indices(mask: torch.Tensor) -> list[int]:
    return torch.nonzero(mask).flatten().tolist()


def _float32_copy(model: Any) -> Any:
    import copy

    return copy.deepcopy(model).float()
