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
Backward: one query-major program per (query block, batch, head) walks the same key blocks: p = exp(s − lse),
ds = p·(do·vᵀ − δ) with δ = rowsum(o·do); dq stays in registers, dk, dv are atomic adds into float32 zero-initialised
outputs spanning the kv head's rows, and the bias's gradient is Σ_j ds_ij for c_i (kept per row) and −Σ_i ds_ij for
c_j (atomic adds into the head's [Lp] row). The float32 atomics make the gradients' summation order (so their last
bits) vary run to run. Compiled for sm_90a without a GPU (tools/compile_report.py), not yet timed on one:
`impl="auto"` does not pick it.

Documents and windows: key j is visible to query i iff j ≤ i, segment_ids[b, i] == segment_ids[b, j] (when given)
and i − j < window (when given); a window bounds both loops, so the work is O(L·(W + block)).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxpe.kernels._common import BlockSizes as SharedBlockSizes
from jaxpe.kernels._common import MASK_VALUE, dot, first_order_only, output_struct, tile_extent, vary_alike
from jaxpe.kernels._pallas_rows import RowConfig, key_blocks, open_rows, padded_inputs, row_specs, visible


class BlockSizes(SharedBlockSizes):
    """FoX's tile sizes (`default`)."""

    @classmethod
    def default(cls, head_dim: int, dtype: jnp.dtype) -> BlockSizes:
        """Chosen on benchmarks/kernel_cost.py's model of an H100 (L 1024, GQA 8/2, 8 warps; clk/logit in bfloat16 /
        float32), every choice within the compile report's spill budgets. Up to Dp = 128: forward tiles of 128 × 64
        (D 64: 0.21 / 0.30 against 0.26 / 0.41 at 64 × 32; D 128: 0.23 / 0.39 against 0.56 / 0.93), backward tiles
        of 64 × 64 in 16 bits and 64 × 32 in float32 (D 64: 0.68 / 1.47 against 1.01 / 1.76 at 32 × 32; D 128:
        1.00 / 2.22 against 2.65 / 4.77): larger query blocks make fewer atomic adds of dk and dv per logit. At
        Dp = 256: 128 × 32 forward tiles in 16 bits (0.34 against 1.35 at 64 × 16), 64 × 16 in float32 (larger
        ones spill), 32 × 16 backward tiles."""
        half = jnp.dtype(dtype).itemsize == 2
        if tile_extent(head_dim) <= 128:
            return cls(128, 64, 64, 64 if half else 32)
        return cls(128 if half else 64, 32 if half else 16, 32, 16)


def default_num_warps(head_dim: int, dtype: jnp.dtype, *, backward: bool) -> int:
    """Warps per program: 8 for every head dim, dtype and kernel (at 4, the float32 forward's 128 × 64 tiles spill at
    D 64)."""
    del head_dim, dtype, backward
    return 8


_LOG2E, _LN2 = math.log2(math.e), math.log(2.0)


def _logits(q, k, c_rows, c_keys, mask, sm_scale):
    """sm_scale·q·kᵀ + c_i − c_j [block_q, block_k] float32, MASK_VALUE where masked."""
    s = sm_scale * dot(q, k, trans_b=True) + (c_rows[:, None] - c_keys[None, :])
    return jnp.where(mask, s, MASK_VALUE)


def _forward_kernel(q_ref, k_ref, v_ref, c_q_ref, c_k_ref, seg_q_ref, seg_k_ref, o_ref, lse_ref, *,
                    config: RowConfig):
    """One query block against the key blocks it sees. Refs: q/o [bq, Dp], k/v [Lp, Dp], c_q [bq], c_k [Lp], row ids
    seg_q [bq] and key ids seg_k [Lp] (None without documents), lse [bq]."""
    block_q, block_k = q_ref.shape[0], config.blocks.block_k
    row0 = pl.program_id(0) * block_q
    rows = row0 + jnp.arange(block_q)
    seg_rows = None if seg_q_ref is None else seg_q_ref[...]
    q, c2_rows = q_ref[...], c_q_ref[...] * _LOG2E
    scale2 = config.sm_scale * _LOG2E

    def tile(index, carry, masked: bool):
        m, l, acc = carry
        keys = pl.ds(index * block_k, block_k)
        # base 2 (the logits times log2 e): one multiply-add and one subtraction a logit, and exp2 is the SFU's
        logits = (scale2 * dot(q, k_ref[keys, :], trans_b=True) + c2_rows[:, None]) - (c_k_ref[keys] * _LOG2E)[None, :]
        if masked:
            mask = visible(rows, index * block_k + jnp.arange(block_k), config.window, seg_rows,
                           None if seg_k_ref is None else seg_k_ref[keys])
            logits = jnp.where(mask, logits, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        correction = jnp.exp2(m - m_new)
        probs = jnp.exp2(logits - m_new[:, None])
        probs = jnp.where(mask, probs, 0.0) if masked else probs
        v = v_ref[keys, :]
        return m_new, l * correction + jnp.sum(probs, axis=1), acc * correction[:, None] + dot(probs.astype(v.dtype), v)

    first, end = key_blocks(row0, block_q, block_k, config.window)
    # Without a window or documents the key blocks wholly at or below row0 are seen by every row: no mask there.
    below = first if config.window is not None or seg_rows is not None else (row0 + 1) // block_k
    init = (jnp.full((block_q,), MASK_VALUE, jnp.float32), jnp.zeros((block_q,), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    carry = lax.fori_loop(first, below, functools.partial(tile, masked=False), init)
    m, l, acc = lax.fori_loop(below, end, functools.partial(tile, masked=True), carry)
    l = jnp.where(l > 0, l, 1.0)  # padded rows see nothing
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = (m + jnp.log2(l)) * _LN2  # the natural log-sum-exp, as the backward reads it


def _backward_kernel(q_ref, k_ref, v_ref, c_q_ref, c_k_ref, seg_q_ref, seg_k_ref, do_ref, lse_ref, delta_ref,
                     dk_in_ref, dv_in_ref, dck_in_ref, dq_ref, dcq_ref, dk_ref, dv_ref, dck_ref, *, config: RowConfig):
    """One query block against the key blocks it sees. Refs as the forward's, do/dq [bq, Dp], lse/delta/dcq [bq], the
    zeros aliased to the outputs (the *_in refs, unread), dk/dv [Lp, Dp] and dck [Lp] (atomic adds)."""
    del dk_in_ref, dv_in_ref, dck_in_ref  # the same buffers as dk_ref, dv_ref, dck_ref
    block_q, block_k, sm_scale = q_ref.shape[0], config.blocks.block_k_bwd, config.sm_scale
    row0 = pl.program_id(0) * block_q
    rows = row0 + jnp.arange(block_q)
    seg_rows = None if seg_q_ref is None else seg_q_ref[...]
    q, do, c_rows, lse, delta = q_ref[...], do_ref[...], c_q_ref[...], lse_ref[...], delta_ref[...]

    def tile(index, carry):
        dq, dc_rows = carry
        keys = pl.ds(index * block_k, block_k)
        mask = visible(rows, index * block_k + jnp.arange(block_k), config.window, seg_rows,
                        None if seg_k_ref is None else seg_k_ref[keys])
        k, v = k_ref[keys, :], v_ref[keys, :]
        probs = jnp.where(mask, jnp.exp(_logits(q, k, c_rows, c_k_ref[keys], mask, sm_scale) - lse[:, None]), 0.0)
        ds = probs * (dot(do, v, trans_b=True) - delta[:, None])  # ∂L/∂logits
        jax.ref.addupdate(dk_ref, (keys, slice(None)), sm_scale * dot(ds.astype(q.dtype), q, trans_a=True))
        jax.ref.addupdate(dv_ref, (keys, slice(None)), dot(probs.astype(do.dtype), do, trans_a=True))
        jax.ref.addupdate(dck_ref, (keys,), -jnp.sum(ds, axis=0))
        return dq + sm_scale * dot(ds.astype(k.dtype), k), dc_rows + jnp.sum(ds, axis=1)

    first, end = key_blocks(row0, block_q, block_k, config.window)
    dq, dc_rows = lax.fori_loop(first, end, tile, (jnp.zeros(q.shape, jnp.float32), jnp.zeros((block_q,),
                                                                                               jnp.float32)))
    dq_ref[...] = dq
    dcq_ref[...] = dc_rows


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
    """dq [B, Lp, Hq, Dp], d c (query side) [B, Hq, Lp], dk, dv [B, Lp, Hkv, Dp], d c (key side) [B, Hq, Lp], all
    float32."""
    specs = row_specs(q, k, config.blocks.block_q_bwd)
    segs = specs.segments(seg)
    zeros = [jnp.zeros_like(k, jnp.float32), jnp.zeros_like(k, jnp.float32), jnp.zeros_like(c, jnp.float32)]
    inputs = [q, k, v, c, c, seg, seg, do, lse, delta]
    accumulated = [specs.kv_full, specs.kv_full, specs.stat_full]
    aliased_from = len(jax.tree.leaves(inputs))  # the flat index of the first zeros (None inputs are no operand)
    return pl.pallas_call(
        functools.partial(_backward_kernel, config=config), grid=specs.grid,
        in_specs=[specs.row, specs.kv_full, specs.kv_full, specs.stat, specs.stat_full, *segs, specs.row,
                  specs.stat, specs.stat, *accumulated],
        out_specs=[specs.row, specs.stat, *accumulated],
        out_shape=[output_struct(q.shape, jnp.float32, q), output_struct(c.shape, jnp.float32, q),
                   *(output_struct(x.shape, x.dtype, q) for x in zeros)],
        input_output_aliases={aliased_from + i: 2 + i for i in range(len(zeros))},
        compiler_params=config.compiler_params(backward=True), interpret=config.interpret, name="fox_backward",
    )(*inputs, *zeros)


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
    dq, dc_q, dk, dv, dc_k = first_order_only("pallas", functools.partial(_backward_call, config), qp, kp, vp, cp,
                                              seg, do.astype(q.dtype), lse, delta)
    length, d = config.length, q.shape[3]
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
                                sm_scale: float | jax.Array, block_sizes: BlockSizes | None = None,
                                interpret: bool | None = None, num_warps: int | None = None,
                                num_stages: int | None = None, segment_ids: jax.Array | None = None,
                                window: int | None = None) -> jax.Array:
    """Causal forgetting attention, fused kernels with a fused backward (custom VJP).

    q [B, L, Hq, D], k/v [B, L, Hkv, D] (Hkv divides Hq) float32, bfloat16 or float16, log_fgate_cumsum [B, L, Hq]
    the running sum of the log forget gates -> [B, L, Hq, D] in q's dtype. block_sizes: None fields take
    `BlockSizes.default(D, dtype)`; interpret: the Pallas interpreter (default: unless the backend is a GPU);
    num_warps (default `default_num_warps`) / num_stages tune the Triton lowering. segment_ids [B, L] int32: packed
    documents; window: i − j < window. sm_scale: a number > 0, or a traced scalar, which then multiplies q before the
    kernels. Differentiable once; static shapes only. Inputs are otherwise trusted (jaxpe.fox checks them).
    """
    q, settings = open_rows(q, sm_scale=sm_scale, block_sizes=block_sizes, blocks_type=BlockSizes,
                            default_warps=default_num_warps, interpret=interpret, num_warps=num_warps,
                            num_stages=num_stages)
    config = RowConfig(**settings, window=window)
    q, k, v, log_fgate_cumsum, segment_ids = vary_alike(q, k, v, log_fgate_cumsum, segment_ids)
    return _fox_pallas_jit(q, k, v, log_fgate_cumsum, segment_ids, config)
