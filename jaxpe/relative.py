"""Learned relative position logits, the CoPE paper's "relative PE" baseline.

bias_ij = q_i · r[min(i − j, npos − 1)], r a table [npos, D]; logits = sm_scale·(q_i·k_j + bias_ij).
B batch, Lq/Lk query/key length, H heads, D head dim.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpe.attention_core import AttentionContext
from jaxpe.registry import PEConfig, register
from jaxpe.sharding import partitioned
from jaxpe.softmax_attention import attend
from jaxpe.tables import gather_table_rows
from jaxpe.validation import check_npos


def relative_logits(q: jax.Array, table: jax.Array, q_pos: jax.Array, k_pos: jax.Array | int) -> jax.Array:
    """q [B, Lq, H, D], table [npos, D], q_pos [B, Lq], k_pos [B, Lk] (or an int Lk: keys at 0..Lk−1)
    -> [B, H, Lq, Lk] float32 q_i·r[clip(i − j, 0, npos − 1)]."""
    npos = table.shape[0]
    k_pos = jnp.arange(k_pos)[None] if isinstance(k_pos, int) else k_pos
    b, lq, h = q.shape[:3]
    rel = jnp.clip(q_pos[:, :, None] - k_pos[:, None, :], 0, npos - 1)  # [B, Lq, Lk]
    z = jnp.einsum("bqhd,pd->bqhp", q, table.astype(q.dtype), preferred_element_type=jnp.float32)
    return gather_table_rows(z, jnp.broadcast_to(rel[:, None], (b, h) + rel.shape[1:]).astype(jnp.int32))


def relative_logits_indexed(q: jax.Array, table: jax.Array) -> jax.Array:
    """q [B, L, H, D], table [npos, D] -> [B, H, L, L] float32, `relative_logits` with queries and keys at 0..L − 1
    (q_i·r[clip(i − j, 0, npos − 1)]) without a gather: Music Transformer's skew (Huang et al., 2018).

    x[b, h, i, c] = q_i·r[clip(L − c, 0, npos − 1)] for c = 0..L, [B, H, L, L + 1]; read flat, row i's entries
    start i·(L + 1) apart, so the L·L window starting at L puts x[i, j + L − i] (distance i − j) at (i, j) for j ≤ i.
    Past the diagonal it reads the next row, so those entries are set to distance 0 as `relative_logits` gives.
    Forward and backward are a matmul, slices, pads and reshapes (on CPU several times cheaper than a gather of
    every entry and its scatter-add).
    """
    b, length, h, _ = q.shape
    distance = jnp.clip(length - jnp.arange(length + 1), 0, table.shape[0] - 1)  # [L + 1]
    heads_first = jnp.swapaxes(q, 1, 2)  # [B, H, L, D]: the [B, H, L, L + 1] product and its cotangent stay in place
    x = jnp.einsum("bhqd,cd->bhqc", heads_first, table[distance].astype(q.dtype), preferred_element_type=jnp.float32)
    flat = x.reshape(b, h, length * (length + 1))
    skewed = flat[..., length:length + length * length].reshape(b, h, length, length)
    causal = jnp.arange(length)[None, :] <= jnp.arange(length)[:, None]  # [L, L]
    return jnp.where(causal, skewed, x[..., length:])  # x[..., L] is distance 0


def context_relative_logits(q: jax.Array, table: jax.Array, ctx: AttentionContext) -> jax.Array:
    """q [B, Lq, H, D], table [npos, D] -> [B, H, Lq, Lk] float32 relative logits at the context's positions: the
    skew (`relative_logits_indexed`) when they are 0..L − 1 on both sides, else the gather (`relative_logits`)."""
    if ctx.indexed and ctx.k_pos is not None and ctx.k_pos.shape[1] == q.shape[1]:
        return relative_logits_indexed(q, table)
    return relative_logits(q, table, ctx.q_pos, ctx.k_pos)


class RelativeCore(nn.Module):
    """Causal softmax attention with learned relative position logits; param "rel_table" [npos, D]."""

    npos: int

    @nn.compact
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttentionContext) -> jax.Array:
        table = self.param("rel_table", partitioned(nn.initializers.normal(0.02), "positions", "head_dim"),
                           (self.npos, q.shape[-1]))
        sm_scale = q.shape[-1] ** -0.5
        bias = sm_scale * context_relative_logits(q, table, ctx)
        return attend(q, k, v, sm_scale=sm_scale, mask=ctx.mask, bias=bias, segment_ids=ctx.segment_ids,
                      window=ctx.window)


@register("relative")
@dataclasses.dataclass(frozen=True)
class RelativeConfig(PEConfig):
    """Learned relative position logits clipped at npos − 1. Without `npos` the table has max_len + 1 rows, so its
    shape follows max_len: parameters trained at one max_len load at another with npos set to their rows."""

    size_option: ClassVar[str] = "npos"
    tables: ClassVar[tuple[str, ...]] = ("rel_table",)
    npos: int | None = None  # table rows (int >= 2): distances >= npos − 1 share the last; None: max_len + 1

    def __post_init__(self) -> None:
        if self.npos is not None:
            check_npos(self.npos)

    def core(self, *, head_dim: int, max_len: int, impl: str) -> nn.Module:
        return RelativeCore(npos=self.table_rows(max_len))
