"""Re-rotation of post-RoPE keys to new positions.

RoPE rotates each pair of key channels by ``position * inv_freq[i]``; rotations compose, so a key
computed at position ``p`` becomes the key at ``q`` by one more rotation by ``q - p``. Values carry
no position and are never touched. The pairing is the Hugging Face / vLLM "neox" one (channel ``i``
with channel ``i + head_dim/2``), what Llama checkpoints use, SmolLM2 included.

Only RoPE variants whose angle is linear in the position can be re-rotated this way (``default``,
``linear`` and ``llama3`` scaling: fixed, possibly rescaled, frequencies). Dynamic variants (NTK,
YaRN with a length-dependent factor) are refused with a ConfigError.

Math runs in float32, like the model's own RoPE; the result has the input's dtype. The caller's
tensor is never modified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvshrink.errors import ConfigError

_LINEAR_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    """The rotary frequencies of one model: ``inv_freq`` is float32 of length ``head_dim // 2``."""

    head_dim: int
    inv_freq: torch.Tensor

    def __post_init__(self) -> None:
        if self.head_dim % 2 or self.inv_freq.shape != (self.head_dim // 2,):
            raise ConfigError("head_dim", f"inv_freq of shape {tuple(self.inv_freq.shape)} does not fit "
                              f"head_dim {self.head_dim}")

    @classmethod
    def default(cls, head_dim: int, rope_theta: float) -> "RopeSpec":
        inv = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return cls(head_dim, inv.float())

    @classmethod
    def from_model(cls, model: Any) -> "RopeSpec":
        """The frequencies a transformers Llama-family model actually uses (its ``rotary_emb``)."""
        config = model.config
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in _LINEAR_ROPE_TYPES:
            raise ConfigError("rope_parameters.rope_type", f"{rope_type!r} is not linear in the position; "
                              f"only {_LINEAR_ROPE_TYPES} can be re-rotated")
        rotary = model.model.rotary_emb
        if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
            raise ConfigError("rope_parameters", "RoPE with attention scaling is not supported")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(int(head_dim), rotary.inv_freq.detach().float().clone())

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape ``[len(positions), head_dim]`` (float32), as the model computes them."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[..., T, heads, head_dim]`` by per-token ``cos``/``sin`` ``[T, head_dim]``."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def rerotate(keys: torch.Tensor, delta: int | torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Keys computed at positions ``p`` re-rotated to ``p + delta``.

    ``keys`` is ``[..., T, heads * head_dim]`` (LMCache's token-major layout) or ``[..., T, heads,
    head_dim]``; ``delta`` an int or a ``[T]`` tensor of per-token shifts. Returns a new tensor of the
    same shape and dtype.
    """
    packed = keys.shape[-1] != rope.head_dim or keys.dim() < 3
    shape = keys.shape
    x = keys.reshape(*shape[:-1], -1, rope.head_dim) if packed else keys  # [..., T, H, D]
    tokens = x.shape[-3]
    if isinstance(delta, int):
        if delta == 0:
            return keys.clone()
        delta = torch.full((tokens,), delta, dtype=torch.int64)
    if delta.shape != (tokens,):
        raise ValueError(f"delta of shape {tuple(delta.shape)} for {tokens} tokens")
    cos, sin = rope.cos_sin(delta)
    out = apply_rope(x.float(), cos, sin).to(keys.dtype)
    return out.reshape(shape)
