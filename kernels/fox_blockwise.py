"""Forgetting attention (FoX; Lin et al., "Forgetting Transformer: Softmax Attention with a Forget Gate",
arXiv:2503.02130), blockwise in pure JAX: causal or bidirectional, GQA, packed documents, sliding windows, forward and
backward (custom VJP), O(L·block) memory.

Letters as in kernels/_key_blocks.py: B batch, L length (Lp padded), Hq query heads, Hkv key/value heads, G = Hq / Hkv,
D head dim, BS the side of a block of queries or keys, N = Lp / BS. Einsum subscripts: b batch, k kv head, g head of
its group, t query and s key positions, d head dim. Everything is computed in float32 (float64 for float64 inputs).

The maths: c the running sum over positions of the log forget gates (per query head), logits
s_ij = sm_scale·q_i·k_j + c_i − c_j for j ≤ i (bidirectional: c_j − c_i for j > i, the gates between key and query
either way), softmax over the visible keys, times v. The kernel takes c, not the gates: JAX differentiates the
running sum (its transpose is a reverse running sum).

Forward: for each query block (lax.map), the key blocks it can see (kernels/_key_blocks.walk), an online softmax
carrying the row maximum, the row sum and the output; it keeps out and the rows' log-sum-exps lse.
Backward (flash attention's): per query block, the same key blocks again, p = exp(s − lse), ds = p·(do·vᵀ − δ),
δ_i = do_i·out_i; dq from ds·k, dk and dv added into whole-length accumulators carried across query blocks, and the
bias's gradient dc_i += Σ_j ±ds_ij (query side), dc_j −= Σ_i ±ds_ij (key side), + for j ≤ i and − beyond.
Only [B, Hkv, G, BS, BS] tiles are built.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxpe.kernels import _key_blocks as kb
from jaxpe.base import check_positive_int, compute_dtype, scale_or_default
from jaxpe.kernels._common import MASK_VALUE, carry_init, vary_alike


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static settings of one call (hashable: the custom_vjp's non-differentiable argument)."""

    block: int  # BS, queries and keys per block
    causal: bool = True
    window: int | None = None  # sliding window W (< L), None: every key


def _bias(c_rows: jax.Array, c_cols: jax.Array, rows: jax.Array, cols: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The forget-gate bias [B, Hkv, G, BS, BS] of rows c_rows [B, Hkv, G, BS] against keys c_cols, and its sign
    [1, 1, 1, BS, BS]: c_i − c_j for j ≤ i, c_j − c_i beyond (bidirectional)."""
    sign = jnp.where(cols[None, :] <= rows[:, None], 1.0, -1.0).astype(c_rows.dtype)[None, None, None]
    return sign * (c_rows[..., :, None] - c_cols[..., None, :]), sign


def _prepare(q, k, v, c, sm_scale, segment_ids, config: _Config):
    """Grouped, padded operands in `compute_dtype`: q times sm_scale per block [N, B, Hkv, G, BS, D], c per block
    [N, B, Hkv, G, BS] and whole [B, Hkv, G, Lp], k/v [B, Hkv, Lp, D], document ids."""
    length, num_kv = q.shape[1], k.shape[2]
    size, padded = kb.tiling(length, config.block)
    dtype = compute_dtype(q, k, v)
    qs = kb.group_queries(q.astype(dtype) * sm_scale, num_kv, padded, size)
    c_blocks = kb.group_queries(c.astype(dtype), num_kv, padded, size)
    c_all = jnp.moveaxis(c_blocks, 0, 3).reshape(*c_blocks.shape[1:4], padded)
    kt, vt = (kb.group_keys(x.astype(dtype), padded) for x in (k, v))
    seg, seg_rows = kb.segment_blocks(segment_ids, padded, size)
    return size, padded, qs, c_blocks, c_all, kt, vt, seg, seg_rows


def _fox_fwd(q, k, v, c, sm_scale, segment_ids, config: _Config):
    length = q.shape[1]
    size, padded, qs, c_blocks, c_all, kt, vt, seg, seg_rows = _prepare(q, k, v, c, sm_scale, segment_ids, config)
    blocks = padded // size
    walked = kb.walked_blocks(blocks, size, causal=config.causal, window=config.window)

    def one_block(xs):
        q_b, c_b, block, seg_b = xs
        rows = block * size + jnp.arange(size, dtype=jnp.int32)

        def visit(index, carry):
            m, l, acc = carry
            k_b, v_b = kb.key_block(kt, index, size, 2), kb.key_block(vt, index, size, 2)
            cols = index * size + jnp.arange(size, dtype=jnp.int32)
            mask = kb.visible(rows, index, size, length=length, causal=config.causal, window=config.window,
                              seg_rows=seg_b, seg=seg)
            bias, _ = _bias(c_b, kb.key_block(c_all, index, size, 3), rows, cols)
            s = jnp.where(mask, jnp.einsum("bkgtd,bksd->bkgts", q_b, k_b) + bias, MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            probs = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            return (m_new, l * correction + jnp.sum(probs, axis=-1),
                    acc * correction[..., None] + jnp.einsum("bkgts,bksd->bkgtd", probs, v_b))

        rowshape = q_b.shape[:-1]
        init = (carry_init(MASK_VALUE, rowshape, q_b.dtype, q_b), carry_init(0.0, rowshape, q_b.dtype, q_b),
                carry_init(0.0, q_b.shape, q_b.dtype, q_b))
        m, l, acc = kb.walk(visit, init, block, blocks=blocks, walked=walked, causal=config.causal)
        l = jnp.where(l > 0, l, 1.0)  # padded rows see nothing
        return acc / l[..., None], m + jnp.log(l)

    out, lse = lax.map(one_block, (qs, c_blocks, jnp.arange(blocks, dtype=jnp.int32), seg_rows))
    return kb.ungroup_queries(out, length), (q, k, v, c, sm_scale, segment_ids, out, lse)


def _fox_bwd(config: _Config, residuals, dout):
    q, k, v, c, sm_scale, segment_ids, out, lse = residuals
    length, num_kv = q.shape[1], k.shape[2]
    size, padded, qs, c_blocks, c_all, kt, vt, seg, seg_rows = _prepare(q, k, v, c, sm_scale, segment_ids, config)
    blocks = padded // size
    walked = kb.walked_blocks(blocks, size, causal=config.causal, window=config.window)
    do = kb.group_queries(dout.astype(qs.dtype), num_kv, padded, size)
    delta = jnp.sum(out * do, axis=-1)  # [N, B, Hkv, G, BS]

    def one_block(totals, xs):
        q_b, c_b, do_b, lse_b, delta_b, block, seg_b = xs
        rows = block * size + jnp.arange(size, dtype=jnp.int32)

        def visit(index, carry):
            dq, dc_rows, (dk, dv, dc_keys) = carry
            k_b, v_b = kb.key_block(kt, index, size, 2), kb.key_block(vt, index, size, 2)
            cols = index * size + jnp.arange(size, dtype=jnp.int32)
            mask = kb.visible(rows, index, size, length=length, causal=config.causal, window=config.window,
                              seg_rows=seg_b, seg=seg)
            bias, sign = _bias(c_b, kb.key_block(c_all, index, size, 3), rows, cols)
            s = jnp.einsum("bkgtd,bksd->bkgts", q_b, k_b) + bias
            probs = jnp.where(mask, jnp.exp(jnp.where(mask, s, MASK_VALUE) - lse_b[..., None]), 0.0)
            ds = probs * (jnp.einsum("bkgtd,bksd->bkgts", do_b, v_b) - delta_b[..., None])
            dk = kb.add_key_block(dk, jnp.einsum("bkgts,bkgtd->bksd", ds, q_b), index, 2)
            dv = kb.add_key_block(dv, jnp.einsum("bkgts,bkgtd->bksd", probs, do_b), index, 2)
            dc_keys = kb.add_key_block(dc_keys, -jnp.sum(ds * sign, axis=-2), index, 3)
            return (dq + jnp.einsum("bkgts,bksd->bkgtd", ds, k_b), dc_rows + jnp.sum(ds * sign, axis=-1),
                    (dk, dv, dc_keys))

        init = (carry_init(0.0, q_b.shape, q_b.dtype, q_b), carry_init(0.0, q_b.shape[:-1], q_b.dtype, q_b), totals)
        dq, dc_rows, totals = kb.walk(visit, init, block, blocks=blocks, walked=walked, causal=config.causal)
        return totals, (dq, dc_rows)

    totals = (carry_init(0.0, kt.shape, kt.dtype, kt), carry_init(0.0, vt.shape, vt.dtype, vt),
              carry_init(0.0, c_all.shape, c_all.dtype, c_all))
    (dk, dv, dc_keys), (dq, dc_rows) = lax.scan(
        one_block, totals, (qs, c_blocks, do, lse, delta, jnp.arange(blocks, dtype=jnp.int32), seg_rows))
    # dq is with respect to sm_scale·q
    dc = kb.ungroup_queries(dc_rows, length) + kb.ungroup_queries(
        jnp.moveaxis(dc_keys.reshape(*dc_keys.shape[:3], blocks, size), 3, 0), length)
    d_scale = jnp.sum(dq * kb.group_queries(q.astype(dq.dtype), num_kv, padded, size))
    dq = kb.ungroup_queries(dq, length) * sm_scale
    return (dq.astype(q.dtype), kb.ungroup_keys(dk, length).astype(k.dtype),
            kb.ungroup_keys(dv, length).astype(v.dtype), dc.astype(c.dtype), d_scale.astype(sm_scale.dtype), None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _fox_blockwise(q: jax.Array, k: jax.Array, v: jax.Array, c: jax.Array, sm_scale: jax.Array,
                   segment_ids: jax.Array | None, config: _Config) -> jax.Array:
    """out [B, L, Hq, D] in `compute_dtype`."""
    return _fox_fwd(q, k, v, c, sm_scale, segment_ids, config)[0]


_fox_blockwise.defvjp(_fox_fwd, _fox_bwd)
_fox_blockwise_jit = jax.jit(_fox_blockwise, static_argnums=(6,))  # eager calls reuse one compiled program


def forgetting_attention_blockwise(q: jax.Array, k: jax.Array, v: jax.Array, log_fgate_cumsum: jax.Array, *,
                                   sm_scale: float | jax.Array | None, causal: bool = True, block: int = 128,
                                   segment_ids: jax.Array | None = None, window: int | None = None) -> jax.Array:
    """Forgetting attention in O(L·block) memory, differentiable (custom VJP).

    q [B, L, Hq, D], k/v [B, L, Hkv, D] (Hkv divides Hq), log_fgate_cumsum [B, L, Hq] the running sum over positions
    of the log forget gates (float32) -> [B, L, Hq, D] in q's dtype. sm_scale: None (D^−½), a number > 0 or a traced
    scalar. causal=False: bidirectional (the gates between key and query, either way). block: queries and keys per
    block. segment_ids [B, L] int32: packed documents; window: |i − j| < window. Inputs are trusted (jaxpe.fox
    checks them).
    """
    check_positive_int("block", block)
    scale = jnp.asarray(scale_or_default(sm_scale, q.shape[3]), compute_dtype(q, k, v))
    operands = vary_alike(q, k, v, log_fgate_cumsum, scale, segment_ids)
    return _fox_blockwise_jit(*operands, _Config(int(block), causal, window)).astype(q.dtype)
