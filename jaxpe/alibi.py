"""ALiBi (Press et al., "Train Short, Test Long", arXiv:2108.12409): a linear bias −slope_h·(i − j) on attention
logits, one slope per head h = 1..H.

Slopes follow the paper's rule for any head count: for H a power of two, the geometric sequence 2^(−8h/H);
otherwise the H' = 2^⌊log2 H⌋ slopes of that power of two, 2^(−8h/H') for h = 1..H', then every other slope of the
next power of two 2H', 2^(−8h/(2H')) for odd h = 1, 3, 5, ..., until there are H.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.attention_core import AttentionContext
from jaxpe.base import compute_dtype
from jaxpe.registry import PEConfig, register
from jaxpe.softmax_attention import attend
from jaxpe.validation import as_positions, check_float_dtype, is_int


def alibi_slopes(num_heads: int, dtype: Any = jnp.float32) -> jax.Array:
    """[H] in `dtype`: 2^(−8h/H) for H a power of two; else the slopes of H' = 2^⌊log2 H⌋ heads followed by the
    H − H' first odd-indexed slopes 2^(−8h/(2H')), h = 1, 3, 5, ... of 2H' heads (see the module docstring)."""
    if not is_int(num_heads, 1):
        raise ValueError(f"{num_heads=} must be a positive int")
    if dtype is None:
        raise TypeError("dtype=None must be a floating-point dtype (e.g. jnp.float32)")
    check_float_dtype("dtype", dtype)  # an integer dtype would round every slope (all < 1) to 0
    low = 1 << (int(num_heads).bit_length() - 1)  # H', the largest power of two <= H
    base = 2.0 ** (-8.0 * np.arange(1, low + 1) / low)
    extra = 2.0 ** (-8.0 * np.arange(1, 2 * (num_heads - low), 2) / (2 * low))
    return jnp.asarray(np.concatenate([base, extra]), dtype)


def alibi_bias(q_pos: jax.Array, k_len: int, num_heads: int, *, k_pos: jax.Array | None = None,
               dtype: Any = jnp.float32) -> jax.Array:
    """q_pos [B, Lq] or [Lq] -> bias [B|1, H, Lq, Lk] in `dtype` = −slope_h·(i − j), keys at k_pos [B, Lk] (default
    0..Lk−1)."""
    if not (is_int(k_len, 0) or jax.export.is_symbolic_dim(k_len)):  # a symbolic length under jax.export
        raise ValueError(f"{k_len=} must be an int >= 0 (the number of keys)")
    q_pos = as_positions("q_pos", q_pos)
    if q_pos.ndim == 1:
        q_pos = q_pos[None]
    if q_pos.ndim != 2:
        raise ValueError(f"q_pos must have shape [B, Lq] or [Lq], got q_pos.shape={tuple(q_pos.shape)}")
    if k_pos is None:
        k_pos = jnp.arange(k_len)[None]
    else:
        k_pos = as_positions("k_pos", k_pos)
        if k_pos.ndim != 2 or k_pos.shape[1] != k_len or len({k_pos.shape[0], q_pos.shape[0]} - {1}) > 1:
            raise ValueError(f"k_pos must have shape [B|1, Lk={k_len}] with B={q_pos.shape[0]} (q_pos's batch), got "
                             f"k_pos.shape={tuple(k_pos.shape)}")
    dist = (q_pos[:, :, None] - k_pos[:, None, :]).astype(dtype)  # [B, Lq, Lk]
    return -alibi_slopes(num_heads, dtype)[None, :, None, None] * dist[:, None]


class ALiBiCore(nn.Module):
    """Causal softmax attention with the ALiBi bias."""

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttentionContext) -> jax.Array:
        bias = alibi_bias(ctx.q_pos, k.shape[1], q.shape[2], k_pos=ctx.k_pos, dtype=compute_dtype(q, k))
        return attend(q, k, v, sm_scale=q.shape[-1] ** -0.5, mask=ctx.mask, bias=bias, segment_ids=ctx.segment_ids,
                      window=ctx.window)


@register("alibi")
@dataclasses.dataclass(frozen=True)
class ALiBiConfig(PEConfig):
    """Attention with linear biases (no parameters)."""

    def core(self, *, head_dim: int, max_len: int, impl: str) -> nn.Module:
        return ALiBiCore()

    def causal_only(self) -> str | None:
        return "its bias −slope·(i − j) is defined for keys at or before the query (j ≤ i)"
