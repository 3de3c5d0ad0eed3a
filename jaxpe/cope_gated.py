"""CoPE with its gates from a network on the token embeddings instead of q·k, and its RoPE hybrid.

B batch, L length, H heads, D head dim, d_model width, max_pos table rows.
Gates come from the token embeddings, not from q·k: g_j = sigmoid(x_j W_g + b_g) per head; absolute soft positions
p_j = Σ_{t≤j} g_t (over j's document when documents are packed), clamped to [0, max_pos − 1]; e(p_j) interpolated
from a table [max_pos, D];
bias_ij = (W_q q_i)·e(p_j)/√D added to the scaled logits. `cope_rope` also rotates q and k (RoPE).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpe.attention_core import AttentionContext
from jaxpe.base import compute_dtype
from jaxpe.kernels._common import interpolate
from jaxpe.kv_cache import update_cache
from jaxpe.registry import PEConfig, register
from jaxpe.rope import apply_rope
from jaxpe.sharding import partitioned
from jaxpe.softmax_attention import attend, visibility_mask
from jaxpe.validation import check_even_head_dim, check_npos, check_positive_number


def interpolate_table(table: jax.Array, positions: jax.Array) -> jax.Array:
    """table [max_pos, D], positions [B, L, H] (clamped to [0, max_pos − 1]) -> [B, L, H, D] in `compute_dtype`,
    linear between rows ⌊p⌋ and ⌈p⌉ (gradient through the fraction, not the indices)."""
    max_pos = table.shape[0]
    positions = jnp.clip(positions, 0.0, max_pos - 1)[..., None]  # [B, L, H, 1]: w broadcasts over D
    table = table.astype(compute_dtype(table, positions))
    return interpolate(lambda index: table[index[..., 0]], positions, max_pos).value


def gated_cope_bias(q_pos_proj: jax.Array, key_emb: jax.Array) -> jax.Array:
    """q_pos_proj [B, Lq, H, D] (= W_q q), key_emb [B, Lk, H, D] (= e(p_j)) -> [B, H, Lq, Lk] / √D in
    `compute_dtype`."""
    d = q_pos_proj.shape[-1]
    return jnp.einsum("bqhd,bkhd->bhqk", q_pos_proj.astype(compute_dtype(q_pos_proj, key_emb)), key_emb) * d ** -0.5


def _soft_positions(gates: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """gates [B, L, H] -> p_j = Σ_{t≤j} g_t [B, L, H], summing only tokens of j's document (segment_ids [B, L])."""
    if segment_ids is None:
        return jnp.cumsum(gates, axis=1)
    same = visibility_mask(gates.shape[1], gates.shape[1], segment_ids=segment_ids)  # [B, L, L]: t ≤ j, same id
    return jnp.einsum("bjt,bth->bjh", same.astype(gates.dtype), gates)


class GatedCoPECore(nn.Module):
    """Attention with the gate-network CoPE bias; params "gate" (Dense d_model -> H), "pos_table" [max_pos, D],
    "pos_query" (D -> D, no bias). While decoding, the keys' soft positions are cached."""

    max_pos: int
    rope: bool = False
    theta: float = 10000.0

    @nn.compact
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttentionContext) -> jax.Array:
        hq, d = q.shape[2], q.shape[3]
        gate = nn.Dense(hq, kernel_init=partitioned(nn.initializers.normal(0.02), "embed", "gates"),
                        bias_init=partitioned(nn.initializers.zeros, "gates"), param_dtype=ctx.table_dtype,
                        name="gate")
        gate_logits = gate(ctx.x)  # [B, Lq, H]
        gates = jax.nn.sigmoid(gate_logits.astype(compute_dtype(gate_logits)))
        index = ctx.cache_index
        if ctx.decode and self.has_variable("cache", "gate_positions"):
            steps = self._continued_positions(gates, index, ctx.cache_segment_ids)
        else:
            steps = _soft_positions(gates, ctx.segment_ids)
        key_positions = update_cache(self, "gate_positions", steps, index) if ctx.decode else steps
        table = self.param("pos_table", partitioned(nn.initializers.normal(0.02), "positions", "head_dim"),
                           (self.max_pos, d), ctx.table_dtype)
        q_proj = nn.DenseGeneral(d, use_bias=False,
                                 kernel_init=partitioned(nn.initializers.normal(0.02), "head_dim", None),
                                 dtype=q.dtype, param_dtype=ctx.table_dtype, name="pos_query")(q)
        bias = gated_cope_bias(q_proj, interpolate_table(table, key_positions))
        if self.rope:
            q = apply_rope(q, ctx.q_pos, theta=self.theta)
            k = apply_rope(k, ctx.k_pos, theta=self.theta)
        return attend(q, k, v, sm_scale=d ** -0.5, mask=ctx.mask, bias=bias, segment_ids=ctx.segment_ids,
                      window=ctx.window, causal=ctx.causal)

    def _continued_positions(self, gates: jax.Array, index: jax.Array, cache_segments: jax.Array | None) -> jax.Array:
        """Soft positions [B, Lq, H] of the Lq tokens written at cache `index`: the sums of their gates within each
        document, plus the cached position of the token before them for those of its document. cache_segments
        [B, S] are the cached document ids (None: one document)."""
        prev_index = jnp.maximum(index - 1, 0)
        prev = jax.lax.dynamic_index_in_dim(self.get_variable("cache", "gate_positions"), prev_index, axis=1,
                                            keepdims=False)  # [B, H]
        if cache_segments is None:
            return _soft_positions(gates, None) + jnp.where(index > 0, prev, 0.0)[:, None]
        segments = jax.lax.dynamic_slice_in_dim(cache_segments, index, gates.shape[1], axis=1)  # [B, Lq]
        prev_segment = jax.lax.dynamic_index_in_dim(cache_segments, prev_index, axis=1)  # [B, 1]
        continues = (index > 0) & (segments == prev_segment)  # [B, Lq]: the document of the token before
        return _soft_positions(gates, segments) + jnp.where(continues[..., None], prev[:, None], 0.0)


@register("cope_gated")
@dataclasses.dataclass(frozen=True)
class GatedCoPEConfig(PEConfig):
    """Gate-network CoPE: absolute soft positions from per-token gates. Without `max_pos` the table has max_len + 1
    rows, so its shape follows max_len: parameters trained at one max_len load at another with max_pos set."""

    size_option: ClassVar[str] = "max_pos"
    tables: ClassVar[tuple[str, ...]] = ("pos_table",)
    max_pos: int | None = None  # interpolated table rows (int >= 2); None means max_len + 1

    def __post_init__(self) -> None:
        if self.max_pos is not None:
            check_npos(self.max_pos, "max_pos")

    def core(self, *, head_dim: int, max_len: int, impl: str) -> nn.Module:
        return GatedCoPECore(max_pos=self.table_rows(max_len))


@register("cope_rope")
@dataclasses.dataclass(frozen=True)
class GatedCoPERoPEConfig(GatedCoPEConfig):
    """RoPE on q and k plus the gate-network CoPE bias."""

    theta: float = 10000.0  # RoPE base (> 0)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_number("theta", self.theta)

    def check_layer(self, *, head_dim: int, impl: str, causal: bool = True) -> None:
        check_even_head_dim(head_dim)

    def core(self, *, head_dim: int, max_len: int, impl: str) -> nn.Module:
        self.check_layer(head_dim=head_dim, impl=impl)
        return GatedCoPECore(max_pos=self.table_rows(max_len), rope=True, theta=self.theta)
