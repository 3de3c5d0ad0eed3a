"""CoPE, contextual position encoding (Golovneva et al., 2024, arXiv:2405.18719), as in the paper.

B batch, Lq/Lk query/key length, Hq query heads, Hkv key/value heads (G = Hq // Hkv), D head dim, npos table rows.
1. gates g_ij = sigmoid(sm_scale · q_i·kg_j), kg = k (default), a separate key projection or the values; 0 for j > i;
2. positions p_ij = Σ_{t=j..i} g_it (reverse cumulative sum over keys, diagonal included), clamped to npos − 1;
3. integer position logits z_ip = q_i·e[p] ([Lq, npos] matmul, never an embedding per (i, j) pair);
4. interpolation pos_ij = (1 − w)·z_i⌊p⌋ + w·z_i⌈p⌉, w = p − ⌊p⌋ (gradient through w only);
5. logits_ij = sm_scale·(q_i·k_j + pos_ij), causal softmax, times v.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpe.attention_core import AttentionContext
from jaxpe.dispatch import resolve_impl
from jaxpe.kernels._common import interpolate
from jaxpe.kernels.cope_blockwise import cope_attention_blockwise
from jaxpe.kv_cache import update_cache
from jaxpe.registry import PEConfig, pe_config, register
from jaxpe.relative import relative_logits
from jaxpe.softmax_attention import causal_mask, masked_softmax_attention, qk_logits, reverse_cumsum
from jaxpe.validation import check_cope_inputs, check_npos, check_qkv

GATE_SOURCES = ("keys", "sep_keys", "values")


def cope_positions(q: jax.Array, k: jax.Array, *, npos: int, sm_scale: float | None = None,
                   gate_k: jax.Array | None = None, mask: jax.Array | None = None) -> jax.Array:
    """Contextual positions p [B, Hq, Lq, Lk] float32, clamped to npos − 1 (0 where j > i).

    q [B, Lq, Hq, D]; k or gate_k [B, Lk, Hkv, D]; mask [B|1, Lq, Lk] bool, None for causal (queries last).
    """
    check_qkv(q, k, k)
    check_npos(npos)
    if gate_k is not None:
        check_qkv(q, gate_k, gate_k)
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    if mask is None:
        mask = causal_mask(q.shape[1], k.shape[1])
    gates = jax.nn.sigmoid(sm_scale * qk_logits(q, k if gate_k is None else gate_k))
    gates = jnp.where(mask[:, None], gates, 0.0)  # [B, Hq, Lq, Lk]
    return jnp.minimum(reverse_cumsum(gates), npos - 1)


def cope_position_logits(q: jax.Array, pos_emb: jax.Array, positions: jax.Array) -> jax.Array:
    """Interpolated position logits [B, Hq, Lq, Lk] float32 from q [B, Lq, Hq, D], pos_emb [npos, D] or
    [Hq, npos, D], positions [B, Hq, Lq, Lk] in [0, npos − 1]."""
    npos = pos_emb.shape[-2]
    spec = "bqhd,pd->bhqp" if pos_emb.ndim == 2 else "bqhd,hpd->bhqp"
    z = jnp.einsum(spec, q, pos_emb.astype(q.dtype), preferred_element_type=jnp.float32)  # [B, Hq, Lq, npos]
    return interpolate(lambda index: jnp.take_along_axis(z, index, axis=-1), positions, npos).value


def cope_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, pos_emb: jax.Array, *, sm_scale: float,
                             gate_k: jax.Array | None = None, mask: jax.Array | None = None,
                             extra_logits: jax.Array | None = None) -> jax.Array:
    """Dense CoPE attention, the ground truth: O(L²) memory. Returns [B, Lq, Hq, D] in q's dtype.

    mask [B|1, Lq, Lk] bool (None: causal, queries last); extra_logits [B, Hq, Lq, Lk] is added to q·k before
    scaling (the paper's "cope+rel" adds relative position logits here).
    """
    if mask is None:
        mask = causal_mask(q.shape[1], k.shape[1])
    positions = cope_positions(q, k, npos=pos_emb.shape[-2], sm_scale=sm_scale, gate_k=gate_k, mask=mask)
    logits = qk_logits(q, k) + cope_position_logits(q, pos_emb, positions)
    if extra_logits is not None:
        logits = logits + extra_logits
    return masked_softmax_attention(sm_scale * logits, v, mask).astype(q.dtype)


def cope_attention(q: jax.Array, k: jax.Array, v: jax.Array, pos_emb: jax.Array, *, sm_scale: float | None = None,
                   causal: bool = True, gate_k: jax.Array | None = None, impl: str = "auto") -> jax.Array:
    """CoPE attention. q [B, L, Hq, D], k/v [B, L, Hkv, D], pos_emb [npos, D] or [Hq, npos, D],
    gate_k [B, L, Hkv, D] (keys used for the gates; None means k) -> [B, L, Hq, D].

    impl: "reference" (dense), "blockwise" (pure JAX, O(L·block) memory), "pallas" (fused kernel) or "auto".
    """
    check_cope_inputs(q, k, v, pos_emb, gate_k, sm_scale=sm_scale)
    if not causal:
        raise ValueError("causal=False is not supported: CoPE counts gates from key j up to query i, "
                         "which only exists under a causal mask")
    if q.shape[1] == 0:  # no queries: an empty output, as jax.nn.dot_product_attention gives
        return jnp.zeros(q.shape, q.dtype)
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    impl = resolve_impl(impl, q.shape[1], q.shape[3])
    if impl == "reference":
        return cope_attention_reference(q, k, v, pos_emb, sm_scale=sm_scale, gate_k=gate_k)
    if impl == "blockwise":
        return cope_attention_blockwise(q, k, v, pos_emb, gate_k, sm_scale=sm_scale)
    from jaxpe.kernels.cope_attention import cope_attention_pallas  # Pallas loads only when the kernel runs
    return cope_attention_pallas(q, k, v, pos_emb, gate_k, sm_scale=sm_scale)


class CoPECore(nn.Module):
    """CoPE inside a layer: owns the position table (unless one shared by all layers is passed), the separate gate
    keys for "sep_keys", and the relative table for "cope+rel"."""

    npos: int
    gates: str = "keys"
    per_head: bool = False
    add_relative: bool = False
    impl: str = "auto"

    @nn.compact
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttentionContext) -> jax.Array:
        hq, d = q.shape[2], q.shape[3]
        pos_emb = ctx.pos_emb
        if pos_emb is None:
            shape = (hq, self.npos, d) if self.per_head else (self.npos, d)
            pos_emb = self.param("pos_emb", nn.initializers.normal(0.02), shape)
        gate_k = None
        if self.gates == "values":
            gate_k = v
        elif self.gates == "sep_keys":
            gate_k = nn.DenseGeneral((k.shape[2], d), use_bias=False, dtype=q.dtype, name="gate_key")(ctx.x)
            if ctx.decode:
                gate_k = update_cache(self, "gate_keys", gate_k, ctx.q_pos[0, 0])
        pos_emb = pos_emb.astype(q.dtype)
        sm_scale = d ** -0.5
        if ctx.mask is None and not self.add_relative:
            return cope_attention(q, k, v, pos_emb, sm_scale=sm_scale, gate_k=gate_k, impl=self.impl)
        extra = None
        if self.add_relative:
            table = self.param("rel_table", nn.initializers.normal(0.02), (self.npos, d))
            extra = relative_logits(q, table, ctx.q_pos, k.shape[1])
        return cope_attention_reference(q, k, v, pos_emb, sm_scale=sm_scale, gate_k=gate_k, mask=ctx.mask,
                                        extra_logits=extra)


@register("cope")
@dataclasses.dataclass(frozen=True)
class CoPEConfig(PEConfig):
    """CoPE with the paper's options."""

    npos: int | None = None  # position table rows; None means max_len + 1 (block size + 1, the paper's default)
    gates: str = "keys"  # gate keys: "keys" (q·k), "sep_keys" (a separate key projection) or "values" (q·v)
    per_head: bool = False  # one table per head [Hq, npos, D] instead of one shared by the heads [npos, D]
    shared_table: bool = False  # one table shared by all layers (owned by the model)
    add_relative: bool = False  # "cope+rel": add learned relative position logits
    every: int = 1  # older form of ModelConfig.layer_pe (which it maps to): CoPE on layers 0, every, 2·every, ...
    other_layers: str = "none"  # with `every`: encoding name of the layers without CoPE

    def __post_init__(self) -> None:
        if self.npos is not None:
            check_npos(self.npos)
        if self.gates not in GATE_SOURCES:
            raise ValueError(f"gates={self.gates!r} must be one of {GATE_SOURCES}")
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every={self.every!r} must be an int >= 1")
        if self.other_layers == "cope":
            raise ValueError("other_layers='cope' would make every layer CoPE; use every=1")
        pe_config(self.other_layers)

    def _npos(self, max_len: int) -> int:
        return self.npos if self.npos is not None else max_len + 1

    def core(self, *, head_dim: int, max_len: int, impl: str) -> nn.Module:
        return CoPECore(npos=self._npos(max_len), gates=self.gates, per_head=self.per_head,
                        add_relative=self.add_relative, impl=impl)

    def shared_table_shape(self, *, head_dim: int, num_heads: int, max_len: int) -> tuple[int, ...] | None:
        if not self.shared_table:
            return None
        npos = self._npos(max_len)
        return (num_heads, npos, head_dim) if self.per_head else (npos, head_dim)
