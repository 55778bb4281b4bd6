"""Re-rotation: keys computed at one position, rotated to another, are the keys computed there."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvshrink.errors import ConfigError
from kvshrink.fuse.rope import RopeSpec, rerotate


def _bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within bf16 rounding. A rotation mixes the two channels of a pair, so each channel's error is
    bounded by the pair's magnitude: two roundings (stored at p, result) of 2^-9 relative each, and
    the same for the keys computed at q, with a factor 2 of slack: 2^-6 of the pair's magnitude."""
    got, want = got.float().unflatten(-1, (-1, 64)), want.float().unflatten(-1, (-1, 64))
    pair = (want[..., :32] ** 2 + want[..., 32:] ** 2).sqrt().repeat(1, 1, 2)
    excess = float(((got - want).abs() - pair * 2 ** -6).max())
    assert excess <= 0, f"re-rotated keys differ beyond bf16 rounding by {excess}"
    relative = float(((got - want).norm() / want.norm()))
    assert relative < 2 ** -8, relative


@pytest.mark.parametrize("p, q", [(7, 700), (650, 40)])
def test_layer0_keys_rerotated_to_q_equal_keys_computed_at_q(model: Any, hf_kv: Any, prose_ids: list[int],
                                                             p: int, q: int) -> None:
    """The real model (SmolLM2, its own forward): a 96-token segment after ``p`` and after ``q``
    other tokens; layer 0's keys depend only on token and position."""
    segment = prose_ids[3000:3096]
    at_p = hf_kv(prose_ids[:p] + segment)[0, 0, p:].to(torch.bfloat16)  # as the store keeps them
    at_q = hf_kv(prose_ids[100:100 + q] + segment)[0, 0, q:].to(torch.bfloat16)
    moved = rerotate(at_p, q - p, RopeSpec.from_model(model))
    assert moved.dtype == torch.bfloat16 and moved.shape == at_q.shape
    _bf16_close(moved, at_q)
    assert not torch.equal(at_p, at_q)  # the positions did matter


def test_rerotation_composes_and_leaves_its_input_alone(model: Any) -> None:
    rope = RopeSpec.from_model(model)
    assert torch.allclose(rope.inv_freq, RopeSpec.default(64, 1e5).inv_freq)
    keys = torch.randn(2, 30, 40, 3 * 64)
    before = keys.clone()
    there = rerotate(keys, 1234, rope)
    assert torch.equal(keys, before)
    assert torch.allclose(rerotate(there, -1234, rope), keys, atol=1e-4)
    per_token = rerotate(keys, torch.full((40,), 1234), rope)
    assert torch.equal(per_token, there)
    heads = rerotate(keys.view(2, 30, 40, 3, 64), 1234, rope)  # [.., T, H, D] gives the same
    assert torch.equal(heads.view_as(there), there)
    assert torch.equal(rerotate(keys, 0, rope), keys)


def test_dynamic_rope_is_refused(model: Any) -> None:
    class Fake:
        config = type("C", (), {"rope_parameters": {"rope_type": "dynamic"}})()

    with pytest.raises(ConfigError, match="rope_type"):
        RopeSpec.from_model(Fake())


def test_keys_of_a_whole_context_shifted_by_delta_rerotate_exactly_in_every_layer(model: Any, prose_ids: list[int]) -> None:
    """RoPE models are shift-invariant: the same tokens with the same context, all ``delta``
    positions later, have the same hidden states, so every layer's keys differ by exactly one
    rotation by ``delta`` and values not at all (float32, no bf16 rounding involved)."""
    ids = prose_ids[:160]

    def kv(shift: int) -> torch.Tensor:
        with torch.inference_mode():
            cache = model(torch.tensor([ids]), position_ids=torch.arange(shift, shift + len(ids))[None],
                          use_cache=True).past_key_values
        return torch.stack([torch.stack([layer.keys[0].transpose(0, 1).reshape(len(ids), -1),
                                         layer.values[0].transpose(0, 1).reshape(len(ids), -1)])
                            for layer in cache.layers], dim=1)

    at0, at900 = kv(0), kv(900)
    moved = rerotate(at0[0], 900, RopeSpec.from_model(model))
    assert float((moved - at900[0]).abs().max()) < 1e-3 * float(at900[0].abs().max())
    assert float((at0[1] - at900[1]).abs().max()) < 1e-3 * float(at900[1].abs().max())
