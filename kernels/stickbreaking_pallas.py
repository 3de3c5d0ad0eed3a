"""Fused stick-breaking attention (Tan et al., arXiv:2410.17980) in Pallas (Triton lowering on GPU, interpret mode
elsewhere): a forward kernel and one backward kernel, causal, GQA, packed documents and sliding windows.

Letters (as in jaxpe/): B batch, L length (Lp padded), Hq query heads, Hkv key/value heads, G = Hq / Hkv group
size, D head dim (Dp padded to a power of two). Kernel tiles are [block_q, block_k].

The maths, in log space (kernels/stickbreaking_blockwise.py has the derivation): z = sm_scale·q·kᵀ over the attended
keys (visible and j < i, or j ≤ i with attend_current), log A_ij = log σ(z_ij) + Σ_{attended k > j} log σ(−z_ik),
out_i = Σ_j A_ij v_j, remainder exp(R_i), R_i = Σ_k log σ(−z_ik).

Forward: one program per (query block, batch, head) walks the key blocks in reverse from the diagonal, carrying R
(the suffix sum over the keys already walked); a tile holds its keys in reverse order (loaded from the last key
down), so that the suffix sums over keys inside it are running sums (Pallas-Triton lowers a running sum, not a
reverse one), and R grows by the tile's row sums. Without a window or documents, the key blocks wholly before the
query block, which every row attends in full, run without the mask (a loop of their own, as forgetting attention's
forward splits its tiles). The logarithms are to base 2 (log2 e folded into sm_scale; exp2 and, compiled for a GPU,
the softplus's ex2 and lg2 are the SFU's own instructions, where exp and log1p compile to long libdevice sequences).
It keeps out and R [B, Hq, Lp].
Backward: the same reverse walk and split, carrying R and S_i (the suffix sum of A·(do·vᵀ) over the keys walked):
∂L/∂z_ij = A_ij·w_ij·σ(−z_ij) − σ(z_ij)·(do_i·o_i + ρ_i − S_ij), w = do·vᵀ, ρ_i the remainder's cotangent times
it, σ(±z) powers of 2 of the tile's logarithms. dq stays in registers; dk, dv are atomic adds into float32
zero-initialised outputs spanning the kv head's rows (so their last bits vary run to run, and Pallas' atomics add
GPU-scope fences). Forgetting attention's split into a pass per key block and one per query block, which needs no
atomics, does not carry over: a key block's gradients need each row's R and S over the keys after it, which only
the walk from the diagonal produces; kept per key block they would take O(L²/block_k) memory. Compiled for sm_90a
without a GPU (tools/compile_report.py), not yet timed on one: `impl="auto"` does not pick it.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxpe.kernels._common import BlockSizes as SharedBlockSizes
from jaxpe.kernels._common import (EXP2_PTX, MASK_VALUE, SOFTPLUS2_PTX, dot, first_order_only, fori_loop32,
                                   output_struct, tile_extent, vary_alike)
from jaxpe.kernels._pallas_rows import RowConfig, key_blocks, open_rows, padded_inputs, row_specs, visible


_LOG2E, _LN2 = math.log2(math.e), math.log(2.0)


class BlockSizes(SharedBlockSizes):
    """Stick-breaking's tile sizes (`default`)."""

    @classmethod
    def default(cls, head_dim: int, dtype: jnp.dtype) -> BlockSizes:
        """Chosen on benchmarks/kernel_cost.py's model of an H100 (L 1024, GQA 8/2; clk/logit in bfloat16 / float32),
        every choice within the compile report's spill budgets. Up to Dp = 128: forward tiles of 128 × 64 in 16 bits
        and 128 × 32 in float32 at 8 warps (D 64: 0.20 / 0.34, D 128: 0.25 / 0.56, against 0.23 / 0.44 and 0.31 /
        0.75 at 64 × 32 and 4 warps; float32's 128 × 64 spill at D 128), backward tiles of 64 × 32 (D 64: 0.73 /
        1.13, D 128: 1.06 / 2.50 against 1.28 / 2.03 and 2.03 / 3.28 at 32 × 32). At Dp = 256: 64 × 16 forward
        tiles and 32 × 16 backward ones (larger ones spill)."""
        if tile_extent(head_dim) > 128:
            return cls(64, 16, 32, 16)
        return cls(128, 64 if jnp.dtype(dtype).itemsize == 2 else 32, 64, 32)


def default_num_warps(head_dim: int, dtype: jnp.dtype, *, backward: bool) -> int:
    """Warps per program (benchmarks/kernel_cost.py's model, as `BlockSizes.default`): 8 in the forward (its 128-row
    tiles); 4 in the backward up to Dp = 128 (D 64: 0.73 / 1.13 clk/logit against 1.23 / 1.88 at 8 warps), but 8 for
    float32 at Dp = 128 (at 4 its 64 × 32 tiles spill 1 KiB) and at Dp = 256."""
    wide = tile_extent(head_dim) > 128 or (tile_extent(head_dim) == 128 and jnp.dtype(dtype).itemsize == 4)
    return 8 if not backward or wide else 4


@dataclasses.dataclass(frozen=True)
class _Config(RowConfig):
    """RowConfig with stick-breaking's one option."""

    attend_current: bool = False  # the diagonal key takes part (j <= i) or not (j < i)


def _asm(ptx: str, x: jax.Array) -> jax.Array:
    """One float32 PTX sequence per element of x ($1 the element, $0 the result), compiled for a GPU."""
    [y] = plt.elementwise_inline_asm(ptx, args=[x], constraints="=f,f", pack=1,
                                     result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return y


def _softplus2(x: jax.Array, interpret: bool) -> jax.Array:
    """log2(1 + 2^x) = −log2 σ(−x·ln 2) for float32 x: SOFTPLUS2_PTX compiled for a GPU (the log and division under
    jnp.log2 and libdevice's log1p are long sequences); interpreted: logaddexp2."""
    return jnp.logaddexp2(x, 0.0) if interpret else _asm(SOFTPLUS2_PTX, x)


def _exp2(x: jax.Array, interpret: bool) -> jax.Array:
    """2^x for float32 x: EXP2_PTX compiled for a GPU (jnp.exp2 compiles to libdevice's, which scales around the SFU
    for results below 2^−126); interpreted: jnp.exp2."""
    return jnp.exp2(x) if interpret else _asm(EXP2_PTX, x)


def _reversed_keys(index: jax.Array, block_k: int) -> jax.Array:
    """The keys of key block `index`, last first [block_k] int32: the order a tile holds them in."""
    return (index + 1) * block_k - 1 - jnp.arange(block_k, dtype=jnp.int32)


def _tile(q, k, rows, cols, r2, seg_rows, seg_k_ref, config: _Config, masked: bool):
    """One tile in base 2 (log2 e folded into the scale), its keys `cols` last first (`_reversed_keys`; k [block_k,
    Dp] in that order): z2 = z·log2 e (MASK_VALUE where not attended; `masked` off: every key of the tile is attended
    by every row), A, −log2 σ(−z) = softplus2(z2) (A and softplus2 0 where not attended) and R / ln 2 over the keys
    from the tile's first on; r2 [block_q] is R / ln 2 over the keys after the tile.

    log2 A_j = log2 σ(z_j) + Σ_{t > j} log2 σ(−z_t) + r2 = z2_j − Σ_{t ≥ j} softplus2(z2_t) + r2, the sum a running
    sum along the reversed tile: as accurate as its own terms (the tile's total less a running sum in key order
    would lose float32 ulps of the total, large where the logits are)."""
    z2 = (config.sm_scale * _LOG2E) * dot(q, k, trans_b=True)
    if masked:  # a key not attended breaks nothing: z2 = MASK_VALUE gives softplus2 0 and A 0
        mask = visible(rows, cols, config.window, seg_rows, None if seg_k_ref is None else seg_k_ref[cols])
        z2 = jnp.where(mask & (cols[None, :] < rows[:, None] + int(config.attend_current)), z2, MASK_VALUE)
    lost = _softplus2(z2, config.interpret)
    a = _exp2(z2 - jnp.cumsum(lost, axis=1) + r2[:, None], config.interpret)
    return z2, a, lost, r2 - lost.sum(axis=1)


def _walk(tile, init, row0, block_q: int, block_k: int, config: _Config, has_segments: bool):
    """`tile(index, carry, masked)` over the key blocks the rows row0 .. row0 + block_q − 1 see, in reverse from the
    diagonal: first the blocks with a masked key, then (without a window or documents) the blocks wholly before
    row0, which every row attends in full, without the mask."""
    first, below, end = key_blocks(row0, block_q, block_k, config.window, has_segments, diagonal=False)

    def reverse(hi, masked):
        return lambda i, carry: tile(hi - 1 - i, carry, masked)

    carry = fori_loop32(0, end - below, reverse(end, True), init)
    return fori_loop32(0, below - first, reverse(below, False), carry)


def _forward_kernel(q_ref, k_ref, v_ref, seg_q_ref, seg_k_ref, o_ref, r_ref, *, config: _Config):
    """One query block, key blocks in reverse from the diagonal. Refs: q/o [bq, Dp], k/v [Lp, Dp], row ids seg_q
    [bq] and key ids seg_k [Lp] (None without documents), r [bq]."""
    block_q, block_k = q_ref.shape[0], config.blocks.block_k
    row0 = pl.program_id(0) * block_q
    rows = row0 + jnp.arange(block_q, dtype=jnp.int32)
    seg_rows = None if seg_q_ref is None else seg_q_ref[...]
    q = q_ref[...]

    def tile(index, carry, masked):
        acc, r2 = carry
        cols = _reversed_keys(index, block_k)
        _, a, _, r2 = _tile(q, k_ref[cols, :], rows, cols, r2, seg_rows, seg_k_ref, config, masked)
        v = v_ref[cols, :]
        return acc + dot(a.astype(v.dtype), v), r2

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    acc, r2 = _walk(tile, init, row0, block_q, block_k, config, seg_rows is not None)
    o_ref[...] = acc.astype(o_ref.dtype)
    r_ref[...] = r2 * _LN2


def _backward_kernel(q_ref, k_ref, v_ref, seg_q_ref, seg_k_ref, do_ref, before_ref, dk_in_ref, dv_in_ref, dq_ref,
                     dk_ref, dv_ref, *, config: _Config):
    """One query block, key blocks in reverse from the diagonal. Refs as the forward's, do/dq [bq, Dp],
    before [bq] (do·o + ρ), the zeros aliased to the outputs (the *_in refs, unread), dk/dv [Lp, Dp] (atomic
    adds)."""
    del dk_in_ref, dv_in_ref  # the same buffers as dk_ref, dv_ref
    block_q, block_k, sm_scale = q_ref.shape[0], config.blocks.block_k_bwd, config.sm_scale
    row0 = pl.program_id(0) * block_q
    rows = row0 + jnp.arange(block_q, dtype=jnp.int32)
    seg_rows = None if seg_q_ref is None else seg_q_ref[...]
    q, do, before = q_ref[...], do_ref[...], before_ref[...]

    def tile(index, carry, masked):
        dq, r2, s = carry
        cols = _reversed_keys(index, block_k)
        k, v = k_ref[cols, :], v_ref[cols, :]
        z2, a, lost, r2 = _tile(q, k, rows, cols, r2, seg_rows, seg_k_ref, config, masked)
        aw = a * dot(do, v, trans_b=True)
        # S_ij = Σ_{j' ≥ j} A_ij'·w_ij' (with the keys after the tile: s), a running sum along the reversed tile
        from_key = s[:, None] + jnp.cumsum(aw, axis=1)
        # σ(−z) = 2^−softplus2(z2), σ(z) = 2^(z2 − softplus2(z2))
        dz = (aw * _exp2(-lost, config.interpret)
              - _exp2(z2 - lost, config.interpret) * (before[:, None] - from_key))  # 0 where not attended
        jax.ref.addupdate(dk_ref, (cols, slice(None)), sm_scale * dot(dz.astype(q.dtype), q, trans_a=True))
        jax.ref.addupdate(dv_ref, (cols, slice(None)), dot(a.astype(do.dtype), do, trans_a=True))
        return dq + sm_scale * dot(dz.astype(k.dtype), k), r2, s + aw.sum(axis=1)

    zeros = jnp.zeros((block_q,), jnp.float32)
    dq, _, _ = _walk(tile, (jnp.zeros(q.shape, jnp.float32), zeros, zeros), row0, block_q, block_k, config,
                     seg_rows is not None)
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


def row_terms(out: jax.Array, do: jax.Array, drem: jax.Array, r: jax.Array) -> jax.Array:
    """The backward's per-row term do_i·o_i + ρ_i [B, Hq, L] float32, ρ_i = drem_i·exp(R_i) (the remainder's
    cotangent times it): out, do [B, L, Hq, D], drem [B, L, Hq], r (R) [B, Hq, L]."""
    rho = jnp.swapaxes(drem.astype(jnp.float32), 1, 2) * jnp.exp(r)
    return jnp.einsum("btnd,btnd->bnt", out.astype(jnp.float32), do.astype(jnp.float32)) + rho


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
    before = row_terms(out, do, jnp.pad(drem, [(0, 0), (0, out.shape[1] - length), (0, 0)]), r)
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


def stickbreaking_attention_pallas(q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float | jax.Array | None,
                                   attend_current: bool = False, block_sizes: BlockSizes | None = None,
                                   interpret: bool | None = None, num_warps: int | None = None,
                                   num_stages: int | None = None, segment_ids: jax.Array | None = None,
                                   window: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Stick-breaking attention, fused kernels with a fused backward (custom VJP).

    q [B, L, Hq, D], k/v [B, L, Hkv, D] (Hkv divides Hq) float32, bfloat16 or float16 -> (out [B, L, Hq, D] in q's
    dtype, remainder [B, L, Hq] float32). block_sizes: None fields take `BlockSizes.default(D, dtype)`; interpret:
    the Pallas interpreter (default: unless the backend is a GPU); num_warps (default `default_num_warps`) /
    num_stages tune the Triton lowering. segment_ids [B, L] int32: packed documents; window: i − j < window.
    sm_scale: None (D^−½), a number > 0 or a traced scalar, which then multiplies q before the kernels.
    Differentiable once; static shapes only. Inputs are otherwise trusted (jaxpe.stickbreaking checks them).
    """
    q, settings = open_rows(q, sm_scale=sm_scale, block_sizes=block_sizes, blocks_type=BlockSizes,
                            default_warps=default_num_warps, interpret=interpret, num_warps=num_warps,
                            num_stages=num_stages)
    config = _Config(**settings, attend_current=attend_current, window=window)
    q, k, v, segment_ids = vary_alike(q, k, v, segment_ids)
    return _sb_pallas_jit(q, k, v, segment_ids, config)
