"""Stick-breaking attention (Tan et al., "Scaling Stick-Breaking Attention", arXiv:2410.17980), blockwise in pure JAX:
causal, GQA, packed documents, sliding windows, forward and backward (custom VJP), O(L·block) memory.

Letters as in kernels/_key_blocks.py: B batch, L length (Lp padded), Hq query heads, Hkv key/value heads, G = Hq / Hkv,
D head dim, BS the side of a block of queries or keys, N = Lp / BS. Einsum subscripts: b batch, k kv head, g head of
its group, t query and s key positions, d head dim. Everything is computed in float32 (float64 for float64 inputs).

The maths, in log space: z_ij = sm_scale·q_i·k_j over the attended keys (visible and j < i, or j ≤ i with
attend_current), log A_ij = log σ(z_ij) + Σ_{attended k > j} log σ(−z_ik), out_i = Σ_j A_ij v_j, and the remainder
1 − Σ_j A_ij = Π_k σ(−z_ik) = exp(R_i), R_i = Σ_{attended k} log σ(−z_ik) (the stick left after every break: the
same number, without the cancellation of 1 − Σ).

Forward: for each query block (lax.map), key blocks walked in reverse from the diagonal, carrying the suffix sum R of
log σ(−z) over the keys seen so far; inside a block the keys after j add their reverse running sum. No softmax:
A ≤ 1, no maximum to carry. Keeps out and R.

Backward, with w_ij = do_i·v_j and ρ_i = drem_i·exp(R_i) (the remainder's cotangent times it):
∂L/∂z_ij = A_ij·w_ij·σ(−z_ij) − σ(z_ij)·(Σ_{attended j' < j} A_ij'·w_ij' + ρ_i), and
Σ_{j' < j} A_ij'·w_ij' = do_i·out_i − S_ij with S_ij = Σ_{j' ≥ j} A_ij'·w_ij', a suffix sum: the backward walks the
same key blocks in the same reverse order, carrying R (to rebuild A) and S, never an [L, L] array. dq, dk from
∂L/∂z; dv_j = Σ_i A_ij·do_i; dk, dv added into whole-length accumulators carried across query blocks.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxpe.kernels import _key_blocks as kb
from jaxpe.base import check_positive_int, compute_dtype, scale_or_default
from jaxpe.kernels._common import carry_init, vary_alike


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static settings of one call (hashable: the custom_vjp's non-differentiable argument)."""

    block: int  # BS, queries and keys per block
    attend_current: bool = False  # the query's own key is attended (j ≤ i) as well
    window: int | None = None  # sliding window W (< L), None: every earlier key


def _prepare(q, k, v, sm_scale, segment_ids, config: _Config):
    """Grouped, padded operands in `compute_dtype`: q times sm_scale per block [N, B, Hkv, G, BS, D], k/v
    [B, Hkv, Lp, D], document ids."""
    length, num_kv = q.shape[1], k.shape[2]
    size, padded = kb.tiling(length, config.block)
    dtype = compute_dtype(q, k, v)
    qs = kb.group_queries(q.astype(dtype) * sm_scale, num_kv, padded, size)
    kt, vt = (kb.group_keys(x.astype(dtype), padded) for x in (k, v))
    seg, seg_rows = kb.segment_blocks(segment_ids, padded, size)
    return size, padded, qs, kt, vt, seg, seg_rows


def _tile(q_b, k_b, rows, index, size, seg_b, seg, r, length: int, config: _Config):
    """One tile [B, Hkv, G, BS, BS]: the attended mask, z, A (0 where not attended) and the tile's log σ(−z) row
    totals; r [B, Hkv, G, BS] is the suffix sum of log σ(−z) over the keys after the block."""
    mask = kb.visible(rows, index, size, length=length, causal=True, window=config.window, seg_rows=seg_b, seg=seg)
    cols = index * size + jnp.arange(size, dtype=jnp.int32)
    mask &= (cols[None, :] < rows[:, None] + int(config.attend_current))[None, None, None]
    z = jnp.einsum("bkgtd,bksd->bkgts", q_b, k_b)
    log_keep = jnp.where(mask, jax.nn.log_sigmoid(-z), 0.0)
    suffix = suffix_sums(log_keep)
    log_a = jax.nn.log_sigmoid(z) + r[..., None] + (suffix - log_keep)
    return mask, z, jnp.where(mask, jnp.exp(log_a), 0.0), suffix[..., 0]


def suffix_sums(x: jax.Array) -> jax.Array:
    """Σ_{j' ≥ j} x[..., j'] along the last axis (a reverse running sum: each sum is as accurate as its own terms,
    where total − cumsum would lose the small ones to the total's rounding)."""
    return lax.cumsum(x, axis=x.ndim - 1, reverse=True)


def _sb_fwd(q, k, v, sm_scale, segment_ids, config: _Config):
    length = q.shape[1]
    size, padded, qs, kt, vt, seg, seg_rows = _prepare(q, k, v, sm_scale, segment_ids, config)
    blocks = padded // size
    walked = kb.walked_blocks(blocks, size, causal=True, window=config.window)

    def one_block(xs):
        q_b, block, seg_b = xs
        rows = block * size + jnp.arange(size, dtype=jnp.int32)

        def visit(index, carry):
            acc, r = carry
            k_b, v_b = kb.key_block(kt, index, size, 2), kb.key_block(vt, index, size, 2)
            _, _, a, total = _tile(q_b, k_b, rows, index, size, seg_b, seg, r, length, config)
            return acc + jnp.einsum("bkgts,bksd->bkgtd", a, v_b), r + total

        init = (carry_init(0.0, q_b.shape, q_b.dtype, q_b), carry_init(0.0, q_b.shape[:-1], q_b.dtype, q_b))
        return kb.walk(visit, init, block, blocks=blocks, walked=walked, causal=True)

    out, r = lax.map(one_block, (qs, jnp.arange(blocks, dtype=jnp.int32), seg_rows))
    outputs = (kb.ungroup_queries(out, length), kb.ungroup_queries(jnp.exp(r), length))
    return outputs, (q, k, v, sm_scale, segment_ids, out, r)


def _sb_bwd(config: _Config, residuals, cotangents):
    q, k, v, sm_scale, segment_ids, out, r_rows = residuals
    dout, drem = cotangents
    length, num_kv = q.shape[1], k.shape[2]
    size, padded, qs, kt, vt, seg, seg_rows = _prepare(q, k, v, sm_scale, segment_ids, config)
    blocks = padded // size
    walked = kb.walked_blocks(blocks, size, causal=True, window=config.window)
    do = kb.group_queries(dout.astype(qs.dtype), num_kv, padded, size)
    rho = kb.group_queries(drem.astype(qs.dtype), num_kv, padded, size) * jnp.exp(r_rows)
    before = jnp.sum(out * do, axis=-1) + rho  # Σ_j A_ij·w_ij + ρ_i: [N, B, Hkv, G, BS]

    def one_block(totals, xs):
        q_b, do_b, before_b, block, seg_b = xs
        rows = block * size + jnp.arange(size, dtype=jnp.int32)

        def visit(index, carry):
            dq, r, s, (dk, dv) = carry
            k_b, v_b = kb.key_block(kt, index, size, 2), kb.key_block(vt, index, size, 2)
            mask, z, a, total = _tile(q_b, k_b, rows, index, size, seg_b, seg, r, length, config)
            aw = a * jnp.einsum("bkgtd,bksd->bkgts", do_b, v_b)
            in_block = suffix_sums(aw)
            from_j = s[..., None] + in_block  # S_ij = Σ_{j' ≥ j} A·w
            dz = jnp.where(mask, aw * jax.nn.sigmoid(-z) - jax.nn.sigmoid(z) * (before_b[..., None] - from_j), 0.0)
            dk = kb.add_key_block(dk, jnp.einsum("bkgts,bkgtd->bksd", dz, q_b), index, 2)
            dv = kb.add_key_block(dv, jnp.einsum("bkgts,bkgtd->bksd", a, do_b), index, 2)
            return dq + jnp.einsum("bkgts,bksd->bkgtd", dz, k_b), r + total, s + in_block[..., 0], (dk, dv)

        rowshape = q_b.shape[:-1]
        init = (carry_init(0.0, q_b.shape, q_b.dtype, q_b), carry_init(0.0, rowshape, q_b.dtype, q_b),
                carry_init(0.0, rowshape, q_b.dtype, q_b), totals)
        dq, _, _, totals = kb.walk(visit, init, block, blocks=blocks, walked=walked, causal=True)
        return totals, dq

    totals = (carry_init(0.0, kt.shape, kt.dtype, kt), carry_init(0.0, vt.shape, vt.dtype, vt))
    (dk, dv), dq = lax.scan(one_block, totals, (qs, do, before, jnp.arange(blocks, dtype=jnp.int32), seg_rows))
    # dq is with respect to sm_scale·q
    d_scale = jnp.sum(dq * kb.group_queries(q.astype(dq.dtype), num_kv, padded, size))
    dq = kb.ungroup_queries(dq, length) * sm_scale
    return (dq.astype(q.dtype), kb.ungroup_keys(dk, length).astype(k.dtype),
            kb.ungroup_keys(dv, length).astype(v.dtype), d_scale.astype(sm_scale.dtype), None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _sb_blockwise(q: jax.Array, k: jax.Array, v: jax.Array, sm_scale: jax.Array, segment_ids: jax.Array | None,
                  config: _Config) -> tuple[jax.Array, jax.Array]:
    """out [B, L, Hq, D] and remainder [B, L, Hq], in `compute_dtype`."""
    return _sb_fwd(q, k, v, sm_scale, segment_ids, config)[0]


_sb_blockwise.defvjp(_sb_fwd, _sb_bwd)
_sb_blockwise_jit = jax.jit(_sb_blockwise, static_argnums=(5,))  # eager calls reuse one compiled program


def stickbreaking_attention_blockwise(q: jax.Array, k: jax.Array, v: jax.Array, *,
                                      sm_scale: float | jax.Array | None, attend_current: bool = False,
                                      block: int = 128, segment_ids: jax.Array | None = None,
                                      window: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Stick-breaking attention in O(L·block) memory, differentiable (custom VJP).

    q [B, L, Hq, D], k/v [B, L, Hkv, D] (Hkv divides Hq) -> (out [B, L, Hq, D], remainder [B, L, Hq]), both in q's
    dtype. sm_scale: None (D^−½), a number > 0 or a traced scalar. attend_current: key i is attended by query i
    too. block: queries and keys per block. segment_ids [B, L] int32: packed documents; window: i − j < window.
    Inputs are trusted (jaxpe.stickbreaking checks them).
    """
    check_positive_int("block", block)
    scale = jnp.asarray(scale_or_default(sm_scale, q.shape[3]), compute_dtype(q, k, v))
    operands = vary_alike(q, k, v, scale, segment_ids)
    out, remainder = _sb_blockwise_jit(*operands, _Config(int(block), attend_current, window))
    return out.astype(q.dtype), remainder.astype(q.dtype)
