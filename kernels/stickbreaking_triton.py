"""Fused stick-breaking attention (Tan et al., arXiv:2410.17980) in native Triton (`triton.jit` kernels launched
through `_triton_launch.launch`): a forward kernel and one backward kernel, causal, GQA, packed documents and
sliding windows.

The algorithm is `stickbreaking_pallas.py`'s (its docstring states the maths, in base 2, and the reverse walk from the
diagonal); here it is written with explicit pointers and masks (`_triton_rows.py`), so no input is padded, and two
things differ:
- Inside a tile the suffix sums over keys are Triton's reverse running sums (`tl.cumsum(..., reverse=True)`) over
  keys in their order (the Pallas tiles hold their keys last first, for lack of a reverse running sum in Pallas):
  log2 A_ij = z2_ij − Σ_{attended t ≥ j in the tile} softplus2(z2_it) + r2_i.
- The backward's dk and dv are relaxed atomic adds (no fences: Pallas's atomics are acquire-release, each with a
  GPU-scope fence) into zero-initialised float32 [B, L, Hkv, D] outputs, from one query-major program per
  (query block, batch, query head): a key block's gradients need each row's R and S over the keys after it, which
  only the walk from the diagonal produces, so the deterministic split of forgetting attention's kernels does not
  carry over (and dk's and dv's last bits vary run to run).

Letters (as in stickbreaking_pallas.py): B batch, L length, Hq query heads, Hkv key/value heads, G = Hq / Hkv, D head
dim (Dp its tile). Kernel tiles are [block_q, block_k].

Compiled for a GPU (FAST), softplus2 and exp2 are the SFU's ex2/lg2 as inline PTX (kernels/_common.py's
SOFTPLUS2_PTX, EXP2_PTX); Triton's interpreter (not FAST) runs tl.exp2/tl.log2, and multiplies bfloat16 dots wrongly,
so its tests run float32 and float16.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from jaxpe.kernels._common import (EXP2_PTX, MASK_VALUE, SOFTPLUS2_PTX, first_order_only, output_struct, tile_extent,
                                   vary_alike)
from jaxpe.kernels._pallas_rows import RowConfig, open_rows
from jaxpe.kernels._triton_launch import interpreted, launch, require
from jaxpe.kernels._triton_rows import (add_rows, document_rows, first_key_block, load_rows, program_rows,
                                        store_rows, strides, visible)
from jaxpe.kernels.stickbreaking_pallas import BlockSizes, row_terms

_LOG2E = tl.constexpr(math.log2(math.e))
_LN2 = tl.constexpr(math.log(2.0))
_MASK = tl.constexpr(MASK_VALUE)  # the base-2 logit of keys not attended: softplus2 0, A 0
_SOFTPLUS2_PTX = tl.constexpr(SOFTPLUS2_PTX)
_EXP2_PTX = tl.constexpr(EXP2_PTX)


def default_blocks(head_dim: int, dtype: jnp.dtype) -> BlockSizes:
    """The native kernels' tiles, chosen on benchmarks/kernel_cost.py's model of an H100 (GQA 8/2, L 1024; clk/logit
    in bfloat16 / float32), every choice within the compile report's spill budgets: forward tiles of 128 × 64 up to
    Dp 128 at 8 warps (D 64: 0.19 / 0.25, D 128: 0.25 / 0.38, against 0.20 / 0.31 and 0.28 / 0.50 at 64 × 64 or
    64 × 32 and 4 warps), backward tiles of 64 × 32 at 4 warps; at Dp 256 forward tiles of 64 × 32 in 16 bits and
    64 × 16 in float32 (64 × 32 spills there), backward tiles of 32 × 32."""
    if tile_extent(head_dim) > 128:
        return BlockSizes(64, 32 if jnp.dtype(dtype).itemsize == 2 else 16, 32, 32)
    return BlockSizes(128, 64, 64, 32)


def default_num_warps(head_dim: int, dtype: jnp.dtype, *, backward: bool) -> int:
    """Warps per program: 8 in the forward (its 128-row tiles), 4 (one warpgroup) in the backward, 8 there for float32
    at Dp 256."""
    wide = jnp.dtype(dtype) == jnp.float32 and tile_extent(head_dim) >= 256
    return 8 if not backward or wide else 4


@dataclasses.dataclass(frozen=True)
class _Config(RowConfig):
    """RowConfig with stick-breaking's one option (`interpret`: Triton's interpreter runs the kernels)."""

    attend_current: bool = False  # the diagonal key takes part (j <= i) or not (j < i)


# --- kernels ---------------------------------------------------------------------------------------------------------


@triton.jit
def _softplus2(x, FAST: tl.constexpr):
    """log2(1 + 2^x) for float32 x: SOFTPLUS2_PTX compiled, else max(x, 0) + log2(1 + 2^−|x|)."""
    if FAST:
        y = tl.inline_asm_elementwise(_SOFTPLUS2_PTX, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = tl.maximum(x, 0.0) + tl.log2(1.0 + tl.exp2(-tl.abs(x)))
    return y


@triton.jit
def _exp2(x, FAST: tl.constexpr):
    """2^x for float32 x: EXP2_PTX compiled, else tl.exp2."""
    if FAST:
        y = tl.inline_asm_elementwise(_EXP2_PTX, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = tl.exp2(x)
    return y


@triton.jit
def _tile(q, k_ptr, index, rows, dims, live, r2, seg_rows, seg_ptr, length, qk_scale, stride_kl,
          BLOCK_K: tl.constexpr, ALIGN: tl.constexpr, EVEN_L: tl.constexpr, MASK_D: tl.constexpr,
          WINDOW: tl.constexpr, HAS_SEGMENTS: tl.constexpr, ATTEND_CURRENT: tl.constexpr, FAST: tl.constexpr,
          MASKED: tl.constexpr, MASK_DEAD: tl.constexpr):
    """Key block `index` against the rows: its keys' columns and k [block_k, Dp], z2 = z·log2 e (MASK where not
    attended; MASKED off: every key is attended by every row), softplus2(z2) (0 where not attended), A, and r2
    [block_q] (R / ln 2 over the keys after the tile) moved to the tile's first key."""
    cols = index * BLOCK_K + tl.arange(0, BLOCK_K)
    k = load_rows(k_ptr, cols, dims, length, stride_kl, ALIGN, EVEN_L, MASK_D)
    z2 = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        mask = visible(rows, cols, seg_rows, seg_ptr, length, WINDOW, HAS_SEGMENTS, MASK_DEAD, live)
        if not ATTEND_CURRENT:
            mask = mask & (cols[None, :] < rows[:, None])
        z2 = tl.where(mask, z2, _MASK)
    lost = _softplus2(z2, FAST)
    a = _exp2(z2 - tl.cumsum(lost, axis=1, reverse=True) + r2[:, None], FAST)
    return cols, k, z2, lost, a, r2 - tl.sum(lost, axis=1)


@triton.jit
def _key_range(row0, length, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, WINDOW: tl.constexpr,
               MASK_ALL: tl.constexpr):
    """(first, below, end): the rows row0 .. see key blocks [first, end); those in [below, end) need the mask, those
    before `below` (wholly before row0, without a window or documents) do not."""
    first = first_key_block(row0, WINDOW, BLOCK_K)
    end = tl.cdiv(tl.minimum(row0 + BLOCK_Q, length), BLOCK_K)
    below = first
    if not MASK_ALL:
        below = row0 // BLOCK_K
    return first, below, end


@triton.jit
def _forward_kernel(Q, K, V, SEG, sm_scale, length,
                    stride_qb, stride_ql, stride_qh, stride_kb, stride_kl, stride_kh, stride_sb, stride_sh,
                    stride_segb,
                    O, R,
                    GROUPS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                    MASK_D: tl.constexpr, EVEN_L: tl.constexpr, ALIGN: tl.constexpr, WINDOW: tl.constexpr,
                    HAS_SEGMENTS: tl.constexpr, ATTEND_CURRENT: tl.constexpr, MASK_ALL: tl.constexpr,
                    FAST: tl.constexpr):
    """One query block of one (batch, query head), key blocks in reverse from the diagonal. Q/O [B, L, Hq, D],
    K/V [B, L, Hkv, D], SEG [B, L] int32 (read only with HAS_SEGMENTS); output R [B, Hq, L] float32. Constexprs:
    BLOCK_D = Dp; MASK_D = D when D < Dp, else 0; EVEN_L: L a multiple of both blocks; ALIGN a power of two dividing
    D (<= 16); WINDOW 0: none; MASK_ALL (a window or documents): every tile masked."""
    b, h, row0, rows, dims, live, q_head, kv_head = program_rows(length, stride_qb, stride_qh, stride_kb, stride_kh,
                                                                 GROUPS, BLOCK_Q, BLOCK_D, ALIGN)
    k_ptr, v_ptr = K + kv_head, V + kv_head
    q = load_rows(Q + q_head, rows, dims, length, stride_ql, ALIGN, EVEN_L, MASK_D)
    seg_ptr, seg_rows = document_rows(SEG, b, stride_segb, rows, live, HAS_SEGMENTS)
    qk_scale = tl.cast(sm_scale, tl.float32) * _LOG2E  # jax-triton passes Python floats as float64

    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    r2 = tl.zeros([BLOCK_Q], tl.float32)
    first, below, end = _key_range(row0, length, BLOCK_Q, BLOCK_K, WINDOW, MASK_ALL)
    for i in range(0, end - below):  # rows past L are never stored: no mask for them
        cols, k, z2, lost, a, r2 = _tile(q, k_ptr, end - 1 - i, rows, dims, live, r2, seg_rows, seg_ptr, length,
                                         qk_scale, stride_kl, BLOCK_K, ALIGN, EVEN_L, MASK_D, WINDOW, HAS_SEGMENTS,
                                         ATTEND_CURRENT, FAST, True, False)
        v = load_rows(v_ptr, cols, dims, length, stride_kl, ALIGN, EVEN_L, MASK_D)
        acc = tl.dot(a.to(v.dtype), v, acc)
    for i in range(0, below - first):
        cols, k, z2, lost, a, r2 = _tile(q, k_ptr, below - 1 - i, rows, dims, live, r2, seg_rows, seg_ptr, length,
                                         qk_scale, stride_kl, BLOCK_K, ALIGN, EVEN_L, MASK_D, WINDOW, HAS_SEGMENTS,
                                         ATTEND_CURRENT, FAST, False, False)
        v = load_rows(v_ptr, cols, dims, length, stride_kl, ALIGN, EVEN_L, MASK_D)
        acc = tl.dot(a.to(v.dtype), v, acc)

    store_rows(O + q_head, rows, dims, acc.to(O.dtype.element_ty), length, stride_ql, ALIGN, EVEN_L, MASK_D)
    tl.store(R + b * stride_sb + h * stride_sh + rows, r2 * _LN2, mask=live)


@triton.jit
def _backward_tile(q, do, before, dq, r2, s, k_ptr, v_ptr, dk_ptr, dv_ptr, index, rows, dims, live, seg_rows,
                   seg_ptr, length, sm_scale, qk_scale, stride_kl, BLOCK_K: tl.constexpr, ALIGN: tl.constexpr,
                   EVEN_L: tl.constexpr, MASK_D: tl.constexpr, WINDOW: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
                   ATTEND_CURRENT: tl.constexpr, FAST: tl.constexpr, MASKED: tl.constexpr):
    """One tile of the backward: dq, r2 and s (the suffix sum of A·(do·vᵀ) over the keys after the tile) carried,
    dk and dv added. ∂L/∂z_ij = A_ij·w_ij·σ(−z_ij) − σ(z_ij)·(before_i − S_ij) with w = do·vᵀ and S_ij the suffix
    sum from key j on; σ(−z) = 2^−softplus2(z2), σ(z) = 2^(z2 − softplus2(z2)). Rows past L are masked (MASKED) or
    have q, do and `before` 0 (every tile), so they add nothing."""
    cols, k, z2, lost, a, r2 = _tile(q, k_ptr, index, rows, dims, live, r2, seg_rows, seg_ptr, length, qk_scale,
                                     stride_kl, BLOCK_K, ALIGN, EVEN_L, MASK_D, WINDOW, HAS_SEGMENTS, ATTEND_CURRENT,
                                     FAST, MASKED, not EVEN_L)
    v = load_rows(v_ptr, cols, dims, length, stride_kl, ALIGN, EVEN_L, MASK_D)
    aw = a * tl.dot(do, tl.trans(v))
    from_key = s[:, None] + tl.cumsum(aw, axis=1, reverse=True)
    s = s + tl.sum(aw, axis=1)
    dz = (aw * _exp2(-lost, FAST) - _exp2(z2 - lost, FAST) * (before[:, None] - from_key)) * sm_scale
    dq = tl.dot(dz.to(k.dtype), k, dq)
    add_rows(dk_ptr, cols, dims, tl.dot(tl.trans(dz.to(q.dtype)), q), length, stride_kl, ALIGN, EVEN_L, MASK_D)
    add_rows(dv_ptr, cols, dims, tl.dot(tl.trans(a.to(do.dtype)), do), length, stride_kl, ALIGN, EVEN_L, MASK_D)
    return dq, r2, s


@triton.jit
def _backward_kernel(Q, K, V, SEG, DO, BEFORE, sm_scale, length,
                     stride_qb, stride_ql, stride_qh, stride_kb, stride_kl, stride_kh, stride_sb, stride_sh,
                     stride_segb,
                     DQ, DK, DV,
                     GROUPS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                     MASK_D: tl.constexpr, EVEN_L: tl.constexpr, ALIGN: tl.constexpr, WINDOW: tl.constexpr,
                     HAS_SEGMENTS: tl.constexpr, ATTEND_CURRENT: tl.constexpr, MASK_ALL: tl.constexpr,
                     FAST: tl.constexpr):
    """One query block of one (batch, query head), the forward's walk. Inputs as the forward's, plus DO
    [B, L, Hq, D] and BEFORE (do·o + ρ) [B, Hq, L]; outputs float32 DQ [B, L, Hq, D] (stored), DK, DV
    [B, L, Hkv, D] (relaxed atomic adds into zeros)."""
    b, h, row0, rows, dims, live, q_head, kv_head = program_rows(length, stride_qb, stride_qh, stride_kb, stride_kh,
                                                                 GROUPS, BLOCK_Q, BLOCK_D, ALIGN)
    k_ptr, v_ptr, dk_ptr, dv_ptr = K + kv_head, V + kv_head, DK + kv_head, DV + kv_head
    q = load_rows(Q + q_head, rows, dims, length, stride_ql, ALIGN, EVEN_L, MASK_D)
    do = load_rows(DO + q_head, rows, dims, length, stride_ql, ALIGN, EVEN_L, MASK_D)
    before = tl.load(BEFORE + b * stride_sb + h * stride_sh + rows, mask=live, other=0.0)
    seg_ptr, seg_rows = document_rows(SEG, b, stride_segb, rows, live, HAS_SEGMENTS)
    sm_scale = tl.cast(sm_scale, tl.float32)  # jax-triton passes Python floats as float64
    qk_scale = sm_scale * _LOG2E

    dq = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    r2 = tl.zeros([BLOCK_Q], tl.float32)
    s = tl.zeros([BLOCK_Q], tl.float32)
    first, below, end = _key_range(row0, length, BLOCK_Q, BLOCK_K, WINDOW, MASK_ALL)
    for i in range(0, end - below):
        dq, r2, s = _backward_tile(q, do, before, dq, r2, s, k_ptr, v_ptr, dk_ptr, dv_ptr, end - 1 - i, rows, dims,
                                   live, seg_rows, seg_ptr, length, sm_scale, qk_scale, stride_kl, BLOCK_K, ALIGN,
                                   EVEN_L, MASK_D, WINDOW, HAS_SEGMENTS, ATTEND_CURRENT, FAST, True)
    for i in range(0, below - first):
        dq, r2, s = _backward_tile(q, do, before, dq, r2, s, k_ptr, v_ptr, dk_ptr, dv_ptr, below - 1 - i, rows,
                                   dims, live, seg_rows, seg_ptr, length, sm_scale, qk_scale, stride_kl, BLOCK_K,
                                   ALIGN, EVEN_L, MASK_D, WINDOW, HAS_SEGMENTS, ATTEND_CURRENT, FAST, False)
    store_rows(DQ + q_head, rows, dims, dq, length, stride_ql, ALIGN, EVEN_L, MASK_D)


# --- launches ------------------------------------------------------------------------------------------------------


def _common_args(config: _Config, q: jax.Array, k: jax.Array, seg: jax.Array | None) -> tuple[list, dict]:
    """The scalar arguments both kernels take (sm_scale, L, strides) and their constexprs."""
    length, num_heads, dim = q.shape[1], q.shape[2], q.shape[3]
    block_d = tile_extent(dim)
    scalars = [config.sm_scale, length, *strides(q)[:3], *strides(k)[:3], num_heads * length, length, length]
    constexprs = dict(GROUPS=num_heads // k.shape[2], BLOCK_D=block_d, MASK_D=dim if dim < block_d else 0,
                      ALIGN=min(dim & -dim, 16), WINDOW=config.window or 0, HAS_SEGMENTS=seg is not None,
                      ATTEND_CURRENT=config.attend_current, MASK_ALL=seg is not None or bool(config.window),
                      FAST=not config.interpret)
    return scalars, constexprs


def _forward_call(config: _Config, q, k, v, seg) -> list[jax.Array]:
    """o [B, L, Hq, D] in q's dtype and R [B, Hq, L] float32; seg may be None."""
    batch, length, num_heads, _ = q.shape
    block_q, block_k = config.blocks.block_q, config.blocks.block_k
    scalars, constexprs = _common_args(config, q, k, seg)
    out_shapes = [output_struct(q.shape, q.dtype, q), output_struct((batch, num_heads, length), jnp.float32, q)]
    return launch(_forward_kernel, [q, k, v, q if seg is None else seg, *scalars], out_shapes=out_shapes,
                  grid=(triton.cdiv(length, block_q), batch, num_heads), num_warps=config.num_warps,
                  num_stages=config.num_stages or 2, name="stickbreaking_triton_forward", BLOCK_Q=block_q,
                  BLOCK_K=block_k, EVEN_L=length % block_q == 0 and length % block_k == 0, **constexprs)


def _backward_call(config: _Config, q, k, v, seg, do, before) -> list[jax.Array]:
    """dq [B, L, Hq, D], dk, dv [B, L, Hkv, D], all float32."""
    length = q.shape[1]
    block_q, block_k = config.blocks.block_q_bwd, config.blocks.block_k_bwd
    scalars, constexprs = _common_args(config, q, k, seg)
    kv = output_struct(k.shape, jnp.float32, q)
    return launch(_backward_kernel, [q, k, v, q if seg is None else seg, do, before, *scalars],
                  out_shapes=[output_struct(q.shape, jnp.float32, q), kv, kv],
                  grid=(triton.cdiv(length, block_q), q.shape[0], q.shape[2]), num_warps=config.num_warps_bwd,
                  num_stages=config.num_stages or 1, name="stickbreaking_triton_backward", zeroed=(1, 2),
                  BLOCK_Q=block_q, BLOCK_K=block_k, EVEN_L=length % block_q == 0 and length % block_k == 0,
                  **constexprs)


def _remainder(r: jax.Array) -> jax.Array:
    """exp(R) [B, L, Hq] from R [B, Hq, L]."""
    return jnp.swapaxes(jnp.exp(r), 1, 2)


def _sb_triton_fwd(q, k, v, segment_ids, config: _Config):
    out, r = first_order_only("triton", functools.partial(_forward_call, config), q, k, v, segment_ids)
    return (out, _remainder(r)), (q, k, v, segment_ids, out, r)


def _sb_triton_bwd(config: _Config, residuals, cotangents):
    q, k, v, segment_ids, out, r = residuals
    dout, drem = cotangents
    before = row_terms(out, dout, drem, r)
    dq, dk, dv = first_order_only("triton", functools.partial(_backward_call, config), q, k, v, segment_ids,
                                  dout.astype(q.dtype), before)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sb_triton(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, config: _Config
               ) -> tuple[jax.Array, jax.Array]:
    out, r = _forward_call(config, q, k, v, segment_ids)
    return out, _remainder(r)


_sb_triton.defvjp(_sb_triton_fwd, _sb_triton_bwd)
_sb_triton_jit = jax.jit(_sb_triton, static_argnums=(4,))


def stickbreaking_attention_triton(q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float | jax.Array | None,
                                   attend_current: bool = False, block_sizes: BlockSizes | None = None,
                                   num_warps: int | None = None, num_stages: int | None = None,
                                   segment_ids: jax.Array | None = None, window: int | None = None
                                   ) -> tuple[jax.Array, jax.Array]:
    """Stick-breaking attention, native Triton kernels with a fused backward (custom VJP).

    q [B, L, Hq, D], k/v [B, L, Hkv, D] (Hkv divides Hq) float32, bfloat16 or float16 (D <= 256) -> (out
    [B, L, Hq, D] in q's dtype, remainder [B, L, Hq] float32). block_sizes: `stickbreaking_pallas.BlockSizes`, None
    fields (or None) taking `default_blocks(D, dtype)`; num_warps (default `default_num_warps`) / num_stages (2 in
    the forward, 1 in the backward) tune Triton's compilation. Without a GPU the kernels run in Triton's interpreter
    (TRITON_INTERPRET=1 set before triton is imported). segment_ids [B, L] int32: packed documents; window:
    i − j < window. sm_scale: None (D^−½), a number > 0 or a traced scalar, which then multiplies q before the kernels.
    Differentiable once; static shapes only. Inputs are otherwise trusted (jaxpe.stickbreaking checks them).
    """
    require()
    q, settings = open_rows(q, sm_scale=sm_scale, block_sizes=block_sizes, blocks_type=BlockSizes,
                            default_warps=default_num_warps, interpret=interpreted(), num_warps=num_warps,
                            num_stages=num_stages, impl="triton", defaults=default_blocks(q.shape[3], q.dtype))
    config = _Config(**settings, attend_current=attend_current, window=window)
    q, k, v, segment_ids = vary_alike(q, k, v, segment_ids)
    return _sb_triton_jit(q, k, v, segment_ids, config)
