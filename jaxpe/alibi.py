"""ALiBi: a linear bias −slope_h·(i − j) on attention logits, slopes 2^(−8h/H) for h = 1..H."""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.attention_core import AttentionContext
from jaxpe.registry import PEConfig, register
from jaxpe.softmax_attention import attend


def alibi_slopes(num_heads: int) -> jax.Array:
    """[H] float32, the standard geometric sequence 2^(−8h/H), h = 1..H."""
    if not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise ValueError(f"{num_heads=} must be a positive int")
    return 2.0 ** (-8.0 * jnp.arange(1, num_heads + 1, dtype=jnp.float32) / num_heads)


def alibi_bias(q_pos: jax.Array, k_len: int, num_heads: int, *, k_pos: jax.Array | None = None) -> jax.Array:
    """q_pos [B, Lq] or [Lq] -> bias [B|1, H, Lq, Lk] = −slope_h·(i − j), keys at k_pos [B, Lk] (default
    0..Lk−1)."""
    q_pos = jnp.asarray(q_pos)
    if q_pos.ndim == 1:
        q_pos = q_pos[None]
    if q_pos.ndim != 2:
        raise ValueError(f"q_pos must have shape [B, Lq] or [Lq], got q_pos.shape={tuple(q_pos.shape)}")
    k_pos = jnp.arange(k_len)[None] if k_pos is None else k_pos
    dist = (q_pos[:, :, None] - k_pos[:, None, :]).astype(jnp.float32)  # [B, Lq, Lk]
    return -alibi_slopes(num_heads)[None, :, None, None] * dist[:, None]


class ALiBiCore(nn.Module):
    """Causal softmax attention with the ALiBi bias."""

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttentionContext) -> jax.Array:
        bias = alibi_bias(ctx.q_pos, k.shape[1], q.shape[2], k_pos=ctx.k_pos)
        return attend(q, k, v, sm_scale=q.shape[-1] ** -0.5, mask=ctx.mask, bias=bias, segment_ids=ctx.segment_ids,
                      window=ctx.window)


@register("alibi")
@dataclasses.dataclass(frozen=True)
class ALiBiConfig(PEConfig):
    """Attention with linear biases (no parameters)."""

    def core(self, *, head_dim: int, max_len: int, impl: str) -> nn.Module:
        return ALiBiCore()
