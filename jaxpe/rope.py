"""Rotary position embedding, half-split ("rotate half", NeoX) convention.

Dimension d pairs with d + D/2 and rotates by position·ω_d, ω_d = θ^(−2d/D). B batch, L length, H heads, D head dim.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpe.attention_core import AttentionContext
from jaxpe.kernels._common import rotary_frequencies
from jaxpe.registry import PEConfig, register
from jaxpe.softmax_attention import attend
from jaxpe.validation import check_even_head_dim, check_float, check_positive, check_rank


def apply_rope(x: jax.Array, positions: jax.Array, *, theta: float = 10000.0) -> jax.Array:
    """Rotate x [B, L, H, D] by positions [B, L] or [L] (ints or floats); returns x's dtype."""
    check_rank("x", x, 4, "B L H D")
    check_float("x", x)
    check_even_head_dim(x.shape[-1])
    check_positive("theta", theta)
    positions = jnp.asarray(positions)
    if positions.ndim not in (1, 2) or positions.shape[-1] != x.shape[1]:
        raise ValueError(f"positions must have shape [B, L] or [L] with L={x.shape[1]}, got {positions.shape=}")
    freqs = rotary_frequencies(x.shape[-1], theta)  # [D/2]
    if positions.ndim == 1:
        positions = positions[None]
    if positions.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"positions batch {positions.shape[0]} must be 1 or match x's batch B={x.shape[0]}")
    angles = positions.astype(jnp.float32)[:, :, None] * freqs[None, None, :]  # [B|1, L, D/2]
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]  # [B, L, 1, D/2]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class RoPECore(nn.Module):
    """Rotate q at its positions and k at 0..Lk-1, then causal softmax attention."""

    theta: float = 10000.0

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttentionContext) -> jax.Array:
        q = apply_rope(q, ctx.q_pos, theta=self.theta)
        k = apply_rope(k, jnp.arange(k.shape[1]), theta=self.theta)
        return attend(q, k, v, sm_scale=q.shape[-1] ** -0.5, mask=ctx.mask)


@register("rope")
@dataclasses.dataclass(frozen=True)
class RoPEConfig(PEConfig):
    """Rotary positions on queries and keys."""

    theta: float = 10000.0  # base of ω_d = θ^(−2d/D)

    def __post_init__(self) -> None:
        check_positive("theta", self.theta)

    def core(self, *, head_dim: int, max_len: int, impl: str) -> nn.Module:
        check_even_head_dim(head_dim)
        return RoPECore(theta=self.theta)
