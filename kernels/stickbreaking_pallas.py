"""Fused stick-breaking attention (Tan et al., arXiv:2410.17980) in Pallas (Triton lowering on GPU, interpret mode
elsewhere): a forward kernel and one backward kernel, causal, GQA, packed documents and sliding windows.

Letters (as in jaxpe/): B batch, L length (Lp padded), Hq query heads, Hkv key/value heads, G = Hq / Hkv group
size, D head dim (Dp padded to a power of two). Kernel tiles are [block_q, block_k].

The maths, in log space (kernels/stickbreaking_blockwise.py has the derivation): z = sm_scale·q·kᵀ over the attended
keys (visible and j < i, or j ≤ i with attend_current), log A_ij = log σ(z_ij) + Σ_{attended k > j} log σ(−z_ik),
out_i = Σ_j A_ij v_j, remainder exp(R_i), R_i = Σ_k log σ(−z_ik).

Forward: one program per (query block, batch, head) walks the key blocks in reverse from the diagonal, carrying R
(the suffix sum over the keys already walked); inside a tile the suffix sums over keys are one product with the
constant triangular matrix [t ≥ j] (Pallas-Triton cannot lower a reverse cumsum), float32-accurate, and R grows by
the tile's row sums. It keeps out and R [B, Hq, Lp].
Backward: the same reverse walk, carrying R and S_i (the suffix sum of A·(do·vᵀ) over the keys walked):
∂L/∂z_ij = A_ij·w_ij·σ(−z_ij) − σ(z_ij)·(do_i·o_i + ρ_i − S_ij), w = do·vᵀ, ρ_i the remainder's cotangent times
it. dq stays in registers; dk, dv are atomic adds into float32 zero-initialised outputs spanning the kv head's rows
(so their last bits vary run to run). Compiled for sm_90a without a GPU (tools/compile_report.py), not yet timed
on one: `impl="auto"` does not pick it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxpe.kernels._common import dot, first_order_only, output_struct, tile_extent, vary_alike
from jaxpe.kernels._pallas_rows import BlockSizes, RowConfig, key_blocks, open_rows, padded_inputs, row_specs, visible


def default_num_warps(head_dim: int) -> int:
    """Warps per program: 4 up to Dp = 128, 8 at 256. On benchmarks/kernel_cost.py's model of an H100 (L 1024, GQA
    8/2, default blocks; clk/logit, bfloat16 / float32), 8 warps double the issue-bound forward's cost at D 128 (1.50
    / 1.83 against 0.73 / 0.97 at 4) and cost the backward more (3.94 / 6.06 against 2.41 / 3.66); at D 256 float32
    spills more than the compile report's budgets at 4 warps (288 bytes in the forward, 528 in the backward)."""
    return 4 if tile_extent(head_dim) <= 128 else 8


@dataclasses.dataclass(frozen=True)
class _Config(RowConfig):
    """RowConfig with stick-breaking's one option."""

    attend_current: bool = False  # the diagonal key takes part (j <= i) or not (j < i)


def _suffix_sums(x: jax.Array, config: _Config) -> jax.Array:
    """Σ_{t ≥ j} x[:, t] for x [block_q, block_k]: x times the triangular [t ≥ j] matrix, float32-accurate."""
    size = x.shape[1]
    triangle = (jnp.arange(size)[:, None] >= jnp.arange(size)[None, :]).astype(jnp.float32)
    return dot(x, triangle, accurate=True, interpret=config.interpret)


def _tile(q, k, rows, index, block_k, r, seg_rows, seg_k_ref, config: _Config):
    """One tile: the attended mask, z, A (0 where not attended) and log σ(−z) (0 where not attended); r [block_q] is
    R over the keys after the tile."""
    cols = index * block_k + jnp.arange(block_k)
    keys = pl.ds(index * block_k, block_k)
    mask = visible(rows, cols, config.window, seg_rows, None if seg_k_ref is None else seg_k_ref[keys])
    mask &= cols[None, :] < rows[:, None] + int(config.attend_current)
    z = config.sm_scale * dot(q, k, trans_b=True)
    log_keep = jnp.where(mask, jnp.minimum(-z, 0.0) - jnp.log1p(jnp.exp(-jnp.abs(z))), 0.0)  # log σ(−z), finite
    suffix = _suffix_sums(log_keep, config)
    a = jnp.where(mask, jnp.exp(z + r[:, None] + suffix), 0.0)  # log σ(z) = z + log σ(−z): one exp, one log1p
    return mask, z, a, log_keep


def _forward_kernel(q_ref, k_ref, v_ref, seg_q_ref, seg_k_ref, o_ref, r_ref, *, config: _Config):
    """One query block, key blocks in reverse from the diagonal. Refs: q/o [bq, Dp], k/v [Lp, Dp], row ids seg_q
    [bq] and key ids seg_k [Lp] (None without documents), r [bq]."""
    block_q, block_k = q_ref.shape[0], config.blocks.block_k
    row0 = pl.program_id(0) * block_q
    rows = row0 + jnp.arange(block_q)
    seg_rows = None if seg_q_ref is None else seg_q_ref[...]
    q = q_ref[...]
    first, end = key_blocks(row0, block_q, block_k, config.window)

    def tile(i, carry):
        acc, r = carry
        index = end - 1 - i
        keys = pl.ds(index * block_k, block_k)
        _, _, a, log_keep = _tile(q, k_ref[keys, :], rows, index, block_k, r, seg_rows, seg_k_ref, config)
        v = v_ref[keys, :]
        return acc + dot(a.astype(v.dtype), v), r + log_keep.sum(axis=1)

    acc, r = lax.fori_loop(0, end - first, tile, (jnp.zeros(q.shape, jnp.float32), jnp.zeros((block_q,),
                                                                                                jnp.float32)))
    o_ref[...] = acc.astype(o_ref.dtype)
    r_ref[...] = r


def _backward_kernel(q_ref, k_ref, v_ref, seg_q_ref, seg_k_ref, do_ref, before_ref, dk_in_ref, dv_in_ref, dq_ref,
                     dk_ref, dv_ref, *, config: _Config):
    """One query block, key blocks in reverse from the diagonal. Refs as the forward's, do/dq [bq, Dp],
    before [bq] (do·o + ρ), the zeros aliased to the outputs (the *_in refs, unread), dk/dv [Lp, Dp] (atomic
    adds)."""
    del dk_in_ref, dv_in_ref  # the same buffers as dk_ref, dv_ref
    block_q, block_k, sm_scale = q_ref.shape[0], config.blocks.block_k_bwd, config.sm_scale
    row0 = pl.program_id(0) * block_q
    rows = row0 + jnp.arange(block_q)
    seg_rows = None if seg_q_ref is None else seg_q_ref[...]
    q, do, before = q_ref[...], do_ref[...], before_ref[...]
    first, end = key_blocks(row0, block_q, block_k, config.window)

    def tile(i, carry):
        dq, r, s = carry
        index = end - 1 - i
        keys = pl.ds(index * block_k, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        mask, z, a, log_keep = _tile(q, k, rows, index, block_k, r, seg_rows, seg_k_ref, config)
        aw = a * dot(do, v, trans_b=True)
        in_tile = _suffix_sums(aw, config)
        dz = jnp.where(mask, aw * jax.nn.sigmoid(-z) - jax.nn.sigmoid(z) * (before[:, None] - s[:, None] - in_tile),
                       0.0)
        jax.ref.addupdate(dk_ref, (keys, slice(None)), sm_scale * dot(dz.astype(q.dtype), q, trans_a=True))
        jax.ref.addupdate(dv_ref, (keys, slice(None)), dot(a.astype(do.dtype), do, trans_a=True))
        return dq + sm_scale * dot(dz.astype(k.dtype), k), r + log_keep.sum(axis=1), s + aw.sum(axis=1)

    zeros = jnp.zeros((block_q,), jnp.float32)
    dq, _, _ = lax.fori_loop(0, end - first, tile, (jnp.zeros(q.shape, jnp.float32), zeros, zeros))
    dq_ref[...] = dq


def _forward_call(config: _Config, q, k, v, seg):
    """o [B, Lp, Hq, Dp] and R [B, Hq, Lp] float32; seg may be None."""
    batch, padded, num_heads, _ = q.shape
    specs = row_specs(q, k, config.blocks.block_q)
    return pl.pallas_call(
        functools.partial(_forward_kernel, config=config), grid=specs.grid,
        in_specs=[specs.row, specs.kv_full, specs.kv_full, *specs.segments(seg)],
        out_specs=[specs.row, specs.stat],
        out_shape=[output_struct(q.shape, q.dtype, q), output_struct((batch, num_heads, padded), jnp.float32, q)],
        compiler_params=config.compiler_params(backward=False), interpret=config.interpret,
        name="stickbreaking_forward",
    )(q, k, v, seg, seg)


def _backward_call(config: _Config, q, k, v, seg, do, before):
    """dq [B, Lp, Hq, Dp], dk, dv [B, Lp, Hkv, Dp], all float32."""
    specs = row_specs(q, k, config.blocks.block_q_bwd)
    zeros = [jnp.zeros_like(k, jnp.float32), jnp.zeros_like(k, jnp.float32)]
    inputs = [q, k, v, seg, seg, do, before]
    aliased_from = len(jax.tree.leaves(inputs))  # the flat index of the first zeros (None inputs are no operand)
    return pl.pallas_call(
        functools.partial(_backward_kernel, config=config), grid=specs.grid,
        in_specs=[specs.row, specs.kv_full, specs.kv_full, *specs.segments(seg), specs.row, specs.stat,
                  specs.kv_full, specs.kv_full],
        out_specs=[specs.row, specs.kv_full, specs.kv_full],
        out_shape=[output_struct(q.shape, jnp.float32, q), *(output_struct(x.shape, x.dtype, q) for x in zeros)],
        input_output_aliases={aliased_from + i: 1 + i for i in range(len(zeros))},
        compiler_params=config.compiler_params(backward=True), interpret=config.interpret,
        name="stickbreaking_backward",
    )(*inputs, *zeros)


def _sb_pallas_fwd(q, k, v, segment_ids, config: _Config):
    qp, kp, vp, seg = padded_inputs(q, k, v, segment_ids, max(dataclasses.astuple(config.blocks)))
    out, r = first_order_only("pallas", functools.partial(_forward_call, config), qp, kp, vp, seg)
    length, d = config.length, q.shape[3]
    remainder = jnp.swapaxes(jnp.exp(r[:, :, :length]), 1, 2)
    return (out[:, :length, :, :d], remainder), (q, k, v, segment_ids, out, r)


def _sb_pallas_bwd(config: _Config, residuals, cotangents):
    q, k, v, segment_ids, out, r = residuals
    dout, drem = cotangents
    qp, kp, vp, seg = padded_inputs(q, k, v, segment_ids, max(dataclasses.astuple(config.blocks)))
    length, d = config.length, q.shape[3]
    do = jnp.pad(dout, [(0, 0), (0, out.shape[1] - length), (0, 0), (0, out.shape[3] - d)])
    rho = jnp.pad(jnp.swapaxes(drem.astype(jnp.float32), 1, 2), [(0, 0), (0, 0), (0, out.shape[1] - length)])
    before = jnp.einsum("btnd,btnd->bnt", out.astype(jnp.float32), do.astype(jnp.float32)) + rho * jnp.exp(r)
    dq, dk, dv = first_order_only("pallas", functools.partial(_backward_call, config), qp, kp, vp, seg,
                                  do.astype(q.dtype), before)
    return (dq[:, :length, :, :d].astype(q.dtype), dk[:, :length, :, :d].astype(k.dtype),
            dv[:, :length, :, :d].astype(v.dtype), None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sb_pallas(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, config: _Config
               ) -> tuple[jax.Array, jax.Array]:
    return _sb_pallas_fwd(q, k, v, segment_ids, config)[0]


_sb_pallas.defvjp(_sb_pallas_fwd, _sb_pallas_bwd)
_sb_pallas_jit = jax.jit(_sb_pallas, static_argnums=(4,))


def stickbreaking_attention_pallas(q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float | jax.Array,
                                   attend_current: bool = False, block_sizes: BlockSizes | None = None,
                                   interpret: bool | None = None, num_warps: int | None = None,
                                   num_stages: int | None = None, segment_ids: jax.Array | None = None,
                                   window: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Stick-breaking attention, fused kernels with a fused backward (custom VJP).

    q [B, L, Hq, D], k/v [B, L, Hkv, D] (Hkv divides Hq) float32, bfloat16 or float16 -> (out [B, L, Hq, D] in q's
    dtype, remainder [B, L, Hq] float32). block_sizes: None fields take `BlockSizes.default(D, dtype)`; interpret:
    the Pallas interpreter (default: unless the backend is a GPU); num_warps (default `default_num_warps(D)`) /
    num_stages tune the Triton lowering. segment_ids [B, L] int32: packed documents; window: i − j < window.
    sm_scale: a number > 0, or a traced scalar, which then multiplies q before the kernels. Differentiable once;
    static shapes only. Inputs are otherwise trusted (jaxpe.stickbreaking checks them).
    """
    q, settings = open_rows(q, sm_scale=sm_scale, block_sizes=block_sizes, blocks_type=BlockSizes,
                            default_warps=default_num_warps, interpret=interpret, num_warps=num_warps,
                            num_stages=num_stages)
    config = _Config(**settings, attend_current=attend_current, window=window)
    q, k, v, segment_ids = vary_alike(q, k, v, segment_ids)
    return _sb_pallas_jit(q, k, v, segment_ids, config)
