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


def gather_table_rows(z: jax.Array, index: jax.Array) -> jax.Array:
    """z [B, Lq, H, P] (query i's logit for each table row in head h), index int32 [B, H, Lq, Lk] in [0, P) ->
    [B, H, Lq, Lk], z[b, i, h, index[b, h, i, j]].

    Each batch row reads its own flat [Lq·H·P] slice of z: one gather with the batch as its only batch dimension,
    on CPU ~10× cheaper than take_along_axis over [B, H, Lq]; z stays in the layout its matmul writes (no transposes
    of z or of its gradient), the backward is one plain scatter-add, and a batch sharded over devices stays sharded
    (an index into all of z would make every device gather all of it). Rows of more than 2³¹ entries gather by
    take_along_axis.
    """
    b, lq, h, size = z.shape
    if lq * h * size >= 2**31:  # int32 flat indices
        return jnp.take_along_axis(jnp.transpose(z, (0, 2, 1, 3)), index, axis=-1)
    start = (jnp.arange(lq, dtype=jnp.int32)[None, None, :, None] * h
             + jnp.arange(h, dtype=jnp.int32)[None, :, None, None]) * size  # [1, H, Lq, 1]: where z[b, i, h] starts
    flat = (start + index).reshape(b, -1)
    return jnp.take_along_axis(z.reshape(b, -1), flat, axis=1, mode="clip").reshape(index.shape)


def relative_logits(q: jax.Array, table: jax.Array, q_pos: jax.Array, k_pos: jax.Array | int) -> jax.Array:
    """q [B, Lq, H, D], table [npos, D], q_pos [B, Lq], k_pos [B, Lk] (or an int Lk: keys at 0..Lk−1)
    -> [B, H, Lq, Lk] float32 q_i·r[clip(i − j, 0, npos − 1)]."""
    npos = table.shape[0]
    k_pos = jnp.arange(k_pos)[None] if isinstance(k_pos, int) else k_pos
    b, lq, h = q.shape[:3]
    rel = jnp.clip(q_pos[:, :, None] - k_pos[:, None, :], 0, npos - 1)  # [B, Lq, Lk]
    z = jnp.einsum("bqhd,pd->bqhp", q, table.astype(q.dtype), preferred_element_type=jnp.float32)
    return gather_table_rows(z, jnp.broadcast_to(rel[:, None], (b, h) + rel.shape[1:]).astype(jnp.int32))


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
