"""Fused forgetting attention (FoX; Lin et al., arXiv:2503.02130) in Pallas (Triton lowering on GPU, interpret mode
elsewhere): a forward kernel and one backward kernel, causal, GQA, packed documents and sliding windows.

Letters (as in jaxpe/): B batch, L length (Lp padded), Hq query heads, Hkv key/value heads, G = Hq / Hkv group
size, D head dim (Dp padded to a power of two). Kernel tiles are [block_q, block_k].

The maths: c the running sum over positions of the log forget gates (per query head, computed outside, float32),
logits_ij = sm_scale·q_i·k_j + c_i − c_j for visible j ≤ i, softmax, times v: flash attention with a rank-one bias.

Forward: one program per (query block, batch, head) walks the key blocks from the first one its window reaches to
the diagonal with an online softmax; it keeps out and the rows' log-sum-exps lse [B, Hq, Lp]. Without a window or
documents the key blocks wholly at or below the block's first row, which every row sees, skip the mask (a loop
of their own, as CoPE's native forward splits its tiles). Its softmax runs in base 2 (log2 e folded into sm_scale
and c: a multiply-add and a subtraction a logit, and exp2, the SFU's own, not exp's longer libdevice sequence).
Backward: no atomics, so its gradients are the same bits run to run. One program per (block, batch, head) computes,
in two loops over the same recomputed tiles (p = exp(s − lse), ds = p·(do·vᵀ − δ) with δ = rowsum(o·do), in base
2 as the forward), the gradients of its block as keys (dk, dv, and −Σ_i ds_ij for c_j) walking the query blocks
that see it, then of its block as rows (dq, and Σ_j ds_ij for c_i) walking the key blocks it sees, each in
registers and stored once, as jax's Pallas flash attention does: seven products a tile against five for one
query-major walk with atomic adds of dk and dv, whose GPU-scope fences cost more (benchmarks/kernel_cost.py:
0.44 / 0.89 clk/logit at D 64 in bfloat16 / float32 against 0.68 / 1.47). dk and dv come per query head, float32
[B, Lp, Hq, Dp], summed over each group's heads outside (G times the kv heads' size, for the backward's duration).
The key blocks wholly before a query block and the query blocks wholly after a key block skip the mask, as in the
forward. Compiled for sm_90a without a GPU (tools/compile_report.py), not yet timed on one: `impl="auto"` does not
pick it.

Documents and windows: key j is visible to query i iff j ≤ i, segment_ids[b, i] == segment_ids[b, j] (when given)
and i − j < window (when given); a window bounds both loops, so the work is O(L·(W + block)).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxpe.kernels._common import BlockSizes as SharedBlockSizes
from jaxpe.kernels._common import (MASK_VALUE, dot, first_order_only, fori_loop32, output_struct, tile_extent,
                                   vary_alike)
from jaxpe.kernels._pallas_rows import (RowConfig, key_blocks, open_rows, padded_inputs, query_blocks, row_specs,
                                       visible)


class BlockSizes(SharedBlockSizes):
    """FoX's tile sizes (`default`)."""

    @classmethod
    def default(cls, head_dim: int, dtype: jnp.dtype) -> BlockSizes:
        """Chosen on benchmarks/kernel_cost.py's model of an H100 (L 1024, GQA 8/2, 8 warps; clk/logit in bfloat16 /
        float32), every choice within the compile report's spill budgets. Forward tiles up to Dp = 128: 128 × 64
        (D 64: 0.21 / 0.30 against 0.26 / 0.41 at 64 × 32; D 128: 0.23 / 0.39 against 0.56 / 0.93); at Dp = 256:
        128 × 32 in 16 bits (0.34 against 1.35 at 64 × 16), 64 × 16 in float32 (larger ones spill). Backward blocks
        (block_q_bwd rows or keys a program, walking blocks of block_k_bwd): 128 and 32 up to Dp = 128 (D 64: 0.44
        / 0.89 against 0.76 / 1.40 at 64 and 64), but 64 and 16 in float32 at Dp = 128 (3.56; 64 and 32 spill
        1.6 KiB), 64 and 16 in 16 bits at Dp = 256 (4.41 against 9.63 at 32 and 16), 32 and 16 in float32 there."""
        half, extent = jnp.dtype(dtype).itemsize == 2, tile_extent(head_dim)
        if extent <= 128:
            return cls(128, 64, *((128, 32) if half or extent <= 64 else (64, 16)))
        return cls(128, 32, 64, 16) if half else cls(64, 16, 32, 16)


def default_num_warps(head_dim: int, dtype: jnp.dtype, *, backward: bool) -> int:
    """Warps per program: 8 for every head dim, dtype and kernel (at 4, the float32 forward's 128 × 64 tiles spill at
    D 64)."""
    del head_dim, dtype, backward
    return 8


_LOG2E = math.log2(math.e)


def _logits2(q, k, c2_rows, c_ref, keys, scale2):
    """The logits in base 2, (sm_scale·q·kᵀ + c_i − c_j)·log2 e [rows, keys] float32, from scale2 = sm_scale·log2 e,
    c2_rows = c_i·log2 e and c_ref[keys] = c_j: one multiply-add and one subtraction a logit, and exp2 is the SFU's
    own instruction. (c_j is read after the product: read before it, ptxas spills the float32 forward at D 128.)"""
    s2 = scale2 * dot(q, k, trans_b=True) + c2_rows[:, None]
    return s2 - (c_ref[keys] * _LOG2E)[None, :]


def _forward_kernel(q_ref, k_ref, v_ref, c_q_ref, c_k_ref, seg_q_ref, seg_k_ref, o_ref, lse_ref, *,
                    config: RowConfig):
    """One query block against the key blocks it sees. Refs: q/o [bq, Dp], k/v [Lp, Dp], c_q [bq], c_k [Lp], row ids
    seg_q [bq] and key ids seg_k [Lp] (None without documents), lse [bq]."""
    block_q, block_k = q_ref.shape[0], config.blocks.block_k
    row0 = pl.program_id(0) * block_q
    rows = row0 + jnp.arange(block_q, dtype=jnp.int32)
    seg_rows = None if seg_q_ref is None else seg_q_ref[...]
    q, c2_rows = q_ref[...], c_q_ref[...] * _LOG2E
    scale2 = config.sm_scale * _LOG2E

    def tile(index, carry, masked: bool):
        m, l, acc = carry
        keys = pl.ds(index * block_k, block_k)
        logits = _logits2(q, k_ref[keys, :], c2_rows, c_k_ref, keys, scale2)
        if masked:
            mask = visible(rows, index * block_k + jnp.arange(block_k, dtype=jnp.int32), config.window, seg_rows,
                           None if seg_k_ref is None else seg_k_ref[keys])
            logits = jnp.where(mask, logits, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        correction = jnp.exp2(m - m_new)
        probs = jnp.exp2(logits - m_new[:, None])
        probs = jnp.where(mask, probs, 0.0) if masked else probs
        v = v_ref[keys, :]
        return m_new, l * correction + jnp.sum(probs, axis=1), acc * correction[:, None] + dot(probs.astype(v.dtype), v)

    first, below, end = key_blocks(row0, block_q, block_k, config.window, seg_rows is not None, diagonal=True)
    init = (jnp.full((block_q,), MASK_VALUE, jnp.float32), jnp.zeros((block_q,), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    carry = fori_loop32(first, below, functools.partial(tile, masked=False), init)
    m, l, acc = fori_loop32(below, end, functools.partial(tile, masked=True), carry)
    l = jnp.where(l > 0, l, 1.0)  # padded rows see nothing
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log2(l)  # the log-sum-exp in base 2, as the backward reads it


def _backward_kernel(q_ref, k_ref, v_ref, c_ref, seg_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref,
                     dcq_ref, dck_ref, *, config: RowConfig):
    """Program n: the gradients of key block n (dk, dv and the keys' part of dc) over the query blocks that see it,
    then those of query block n (dq and the rows' part of dc) over the key blocks it sees; M = block_q_bwd rows or
    keys, walking blocks of block_k_bwd. Refs: q/do [Lp, Dp] of the head, k/v [Lp, Dp] of its kv head, c, lse (base
    2), delta [Lp] of the head, document ids seg [Lp] (None without documents); outputs dq/dk/dv [M, Dp] and
    dcq/dck [M]."""
    major, minor, padded = config.blocks.block_q_bwd, config.blocks.block_k_bwd, q_ref.shape[0]
    scale2 = config.sm_scale * _LOG2E
    start = pl.program_id(0) * major
    span, own = start + jnp.arange(major, dtype=jnp.int32), pl.ds(start, major)

    def grads(q, k, v, do, at_rows, at_keys, rows, cols, masked: bool):
        """p and ds = ∂L/∂logits [rows, keys] of a tile (0 where masked)."""
        p = jnp.exp2(_logits2(q, k, c_ref[at_rows] * _LOG2E, c_ref, at_keys, scale2)
                     - lse_ref[at_rows][:, None])
        if masked:
            seg_rows, seg_cols = (None, None) if seg_ref is None else (seg_ref[at_rows], seg_ref[at_keys])
            p = jnp.where(visible(rows, cols, config.window, seg_rows, seg_cols), p, 0.0)
        return p, p * (dot(do, v, trans_b=True) - delta_ref[at_rows][:, None])

    k, v = k_ref[own, :], v_ref[own, :]

    def key_side(index, carry, masked: bool):
        dk, dv, dck = carry
        at_rows = pl.ds(index * minor, minor)
        q, do = q_ref[at_rows, :], do_ref[at_rows, :]
        p, ds = grads(q, k, v, do, at_rows, own, index * minor + jnp.arange(minor, dtype=jnp.int32), span, masked)
        return (dk + config.sm_scale * dot(ds.astype(q.dtype), q, trans_a=True),
                dv + dot(p.astype(do.dtype), do, trans_a=True), dck - jnp.sum(ds, axis=0))

    first, after, end = query_blocks(start, major, minor, config.window, padded, seg_ref is not None)
    zeros = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32), jnp.zeros((major,), jnp.float32)
    carry = fori_loop32(first, after, functools.partial(key_side, masked=True), zeros)
    dk, dv, dck = fori_loop32(after, end, functools.partial(key_side, masked=False), carry)
    dk_ref[...], dv_ref[...], dck_ref[...] = dk, dv, dck

    q, do = q_ref[own, :], do_ref[own, :]

    def row_side(index, carry, masked: bool):
        dq, dcq = carry
        at_keys = pl.ds(index * minor, minor)
        k, v = k_ref[at_keys, :], v_ref[at_keys, :]
        _, ds = grads(q, k, v, do, own, at_keys, span, index * minor + jnp.arange(minor, dtype=jnp.int32), masked)
        return dq + config.sm_scale * dot(ds.astype(k.dtype), k), dcq + jnp.sum(ds, axis=1)

    first, below, end = key_blocks(start, major, minor, config.window, seg_ref is not None, diagonal=True)
    carry = fori_loop32(first, below, functools.partial(row_side, masked=False),
                        (jnp.zeros(q.shape, jnp.float32), jnp.zeros((major,), jnp.float32)))
    dq, dcq = fori_loop32(below, end, functools.partial(row_side, masked=True), carry)
    dq_ref[...], dcq_ref[...] = dq, dcq


def _forward_call(config: RowConfig, q, k, v, c, seg):
    """o [B, Lp, Hq, Dp] and lse [B, Hq, Lp]; seg may be None."""
    batch, padded, num_heads, _ = q.shape
    specs = row_specs(q, k, config.blocks.block_q)
    segs = specs.segments(seg)
    return pl.pallas_call(
        functools.partial(_forward_kernel, config=config), grid=specs.grid,
        in_specs=[specs.row, specs.kv_full, specs.kv_full, specs.stat, specs.stat_full, *segs],
        out_specs=[specs.row, specs.stat],
        out_shape=[output_struct(q.shape, q.dtype, q), output_struct((batch, num_heads, padded), jnp.float32, q)],
        compiler_params=config.compiler_params(backward=False), interpret=config.interpret, name="fox_forward",
    )(q, k, v, c, c, seg, seg)


def _backward_call(config: RowConfig, q, k, v, c, seg, do, lse, delta):
    """dq, dk, dv [B, Lp, Hq, Dp] (dk and dv per query head), d c from the rows and from the keys [B, Hq, Lp], all
    float32."""
    specs = row_specs(q, k, config.blocks.block_q_bwd)
    per_head = output_struct(q.shape, jnp.float32, q)
    return pl.pallas_call(
        functools.partial(_backward_kernel, config=config), grid=specs.grid,
        in_specs=[specs.row_full, specs.kv_full, specs.kv_full, specs.stat_full,
                  None if seg is None else specs.seg_keys, specs.row_full, specs.stat_full, specs.stat_full],
        out_specs=[specs.row, specs.row, specs.row, specs.stat, specs.stat],
        out_shape=[per_head, per_head, per_head, *[output_struct(c.shape, jnp.float32, q)] * 2],
        compiler_params=config.compiler_params(backward=True), interpret=config.interpret, name="fox_backward",
    )(q, k, v, c, seg, do, lse, delta)


def _padded(q, k, v, c, segment_ids, blocks: BlockSizes):
    """`padded_inputs` to a multiple of every block; c [B, L, Hq] -> [B, Hq, Lp] float32."""
    q, k, v, seg = padded_inputs(q, k, v, segment_ids, max(dataclasses.astuple(blocks)))
    c = jnp.swapaxes(c.astype(jnp.float32), 1, 2)
    return q, k, v, jnp.pad(c, [(0, 0), (0, 0), (0, q.shape[1] - c.shape[2])]), seg


def _fox_pallas_fwd(q, k, v, c, segment_ids, config: RowConfig):
    qp, kp, vp, cp, seg = _padded(q, k, v, c, segment_ids, config.blocks)
    out, lse = first_order_only("pallas", functools.partial(_forward_call, config), qp, kp, vp, cp, seg)
    return out[:, :config.length, :, :q.shape[3]], (q, k, v, c, segment_ids, out, lse)


def _fox_pallas_bwd(config: RowConfig, residuals, dout):
    q, k, v, c, segment_ids, out, lse = residuals
    qp, kp, vp, cp, seg = _padded(q, k, v, c, segment_ids, config.blocks)
    do = jnp.pad(dout, [(0, 0), (0, out.shape[1] - dout.shape[1]), (0, 0), (0, out.shape[3] - dout.shape[3])])
    delta = jnp.einsum("btnd,btnd->bnt", out.astype(jnp.float32), do.astype(jnp.float32))
    dq, dk, dv, dc_q, dc_k = first_order_only("pallas", functools.partial(_backward_call, config), qp, kp, vp, cp,
                                              seg, do.astype(q.dtype), lse, delta)
    length, d = config.length, q.shape[3]
    batch, padded, num_kv, dp = kp.shape
    dk, dv = (x.reshape(batch, padded, num_kv, -1, dp).sum(axis=3) for x in (dk, dv))  # over each group's heads
    dc = jnp.swapaxes((dc_q + dc_k)[:, :, :length], 1, 2)
    return (dq[:, :length, :, :d].astype(q.dtype), dk[:, :length, :, :d].astype(k.dtype),
            dv[:, :length, :, :d].astype(v.dtype), dc.astype(c.dtype), None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fox_pallas(q: jax.Array, k: jax.Array, v: jax.Array, c: jax.Array, segment_ids: jax.Array | None,
                config: RowConfig) -> jax.Array:
    return _fox_pallas_fwd(q, k, v, c, segment_ids, config)[0]


_fox_pallas.defvjp(_fox_pallas_fwd, _fox_pallas_bwd)
_fox_pallas_jit = jax.jit(_fox_pallas, static_argnums=(5,))


def forgetting_attention_pallas(q: jax.Array, k: jax.Array, v: jax.Array, log_fgate_cumsum: jax.Array, *,
                                sm_scale: float | jax.Array | None, block_sizes: BlockSizes | None = None,
                                interpret: bool | None = None, num_warps: int | None = None,
                                num_stages: int | None = None, segment_ids: jax.Array | None = None,
                                window: int | None = None) -> jax.Array:
    """Causal forgetting attention, fused kernels with a fused backward (custom VJP).

    q [B, L, Hq, D], k/v [B, L, Hkv, D] (Hkv divides Hq) float32, bfloat16 or float16, log_fgate_cumsum [B, L, Hq]
    the running sum of the log forget gates -> [B, L, Hq, D] in q's dtype. block_sizes: None fields take
    `BlockSizes.default(D, dtype)`; interpret: the Pallas interpreter (default: unless the backend is a GPU);
    num_warps (default `default_num_warps`) / num_stages tune the Triton lowering. segment_ids [B, L] int32: packed
    documents; window: i − j < window. sm_scale: None (D^−½), a number > 0 or a traced scalar, which then multiplies
    q before the kernels. Differentiable once; static shapes only. Inputs are otherwise trusted (jaxpe.fox checks them).
    """
    q, settings = open_rows(q, sm_scale=sm_scale, block_sizes=block_sizes, blocks_type=BlockSizes,
                            default_warps=default_num_warps, interpret=interpret, num_warps=num_warps,
                            num_stages=num_stages)
    config = RowConfig(**settings, window=window)
    q, k, v, log_fgate_cumsum, segment_ids = vary_alike(q, k, v, log_fgate_cumsum, segment_ids)
    return _fox_pallas_jit(q, k, v, log_fgate_cumsum, segment_ids, config)
