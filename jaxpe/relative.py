"""Learned relative position logits, the CoPE paper's "relative PE" baseline.

bias_ij = q_i · r[min(i − j, npos − 1)], r a table [npos, D]; logits = sm_scale·(q_i·k_j + bias_ij).
B batch, Lq/Lk query/key length, H heads, D head dim.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpe.attention_core import AttentionContext
from jaxpe.registry import PEConfig, register
from jaxpe.sharding import partitioned
from jaxpe.softmax_attention import attend
from jaxpe.validation import check_npos


def relative_logits(q: jax.Array, table: jax.Array, q_pos: jax.Array, k_pos: jax.Array | int) -> jax.Array:
    """q [B, Lq, H, D], table [npos, D], q_pos [B, Lq], k_pos [B, Lk] (or an int Lk: keys at 0..Lk−1)
    -> [B, H, Lq, Lk] float32 q_i·r[clip(i − j, 0, npos − 1)]."""
    npos = table.shape[0]
    k_pos = jnp.arange(k_pos)[None] if isinstance(k_pos, int) else k_pos
    b, lq, h = q.shape[:3]
    rel = jnp.clip(q_pos[:, :, None] - k_pos[:, None, :], 0, npos - 1)  # [B, Lq, Lk]
    if b * lq * h * npos >= 2**31:  # int32 flat indices
        z = jnp.einsum("bqhd,pd->bhqp", q, table.astype(q.dtype), preferred_element_type=jnp.float32)
        return jnp.take_along_axis(z, jnp.broadcast_to(rel[:, None], z.shape[:3] + (rel.shape[-1],)), axis=-1)
    # A gather from the flat table z [B, Lq, H, npos], in the layout its matmul writes: on CPU ~10× cheaper than
    # take_along_axis's batched gather, and its backward is one plain scatter-add with no transposes.
    z = jnp.einsum("bqhd,pd->bqhp", q, table.astype(q.dtype), preferred_element_type=jnp.float32)
    start = ((jnp.arange(b, dtype=jnp.int32)[:, None, None] * lq + jnp.arange(lq, dtype=jnp.int32)[None, None, :]) * h
             + jnp.arange(h, dtype=jnp.int32)[None, :, None]) * npos  # [B, H, Lq]
    index = start[..., None] + rel[:, None]  # [B, H, Lq, Lk]
    return z.reshape(-1).at[index].get(mode="clip")


class RelativeCore(nn.Module):
    """Causal softmax attention with learned relative position logits; param "rel_table" [npos, D]."""

    npos: int

    @nn.compact
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttentionContext) -> jax.Array:
        table = self.param("rel_table", partitioned(nn.initializers.normal(0.02), "positions", "head_dim"),
                           (self.npos, q.shape[-1]))
        sm_scale = q.shape[-1] ** -0.5
        bias = sm_scale * relative_logits(q, table, ctx.q_pos, ctx.k_pos)
        return attend(q, k, v, sm_scale=sm_scale, mask=ctx.mask, bias=bias, segment_ids=ctx.segment_ids,
                      window=ctx.window)


@register("relative")
@dataclasses.dataclass(frozen=True)
class RelativeConfig(PEConfig):
    """Learned relative position logits clipped at npos − 1."""

    npos: int | None = None  # table size; None means max_len + 1

    def core(self, *, head_dim: int, max_len: int, impl: str) -> nn.Module:
        npos = self.npos if self.npos is not None else max_len + 1
        check_npos(npos)
        return RelativeCore(npos=npos)
