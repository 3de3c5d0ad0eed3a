"""Fused Co-RoPE attention in native Triton (`triton.language`, launched through `_triton_launch`): causal, GQA,
packed documents, sliding windows, caller-given rotary frequencies, a concrete or traced sm_scale, fwd + bwd.

The algorithm of `corope_pallas.py` (Co-RoPE: https://github.com/Superposition09m/Co-RoPE), written with explicit
pointers, strides and masks, and with the rotary score computed on vectorised tiles.

Letters (as in corope_pallas.py): B batch, L length, Hq query heads, Hkv key/value heads, G = Hq / Hkv group size,
D head dim (DP: the next power of two >= max(D, 16)), Dh = D/2 rotary pairs. Tiles: BQ query rows × BK keys; the
rotary pairs are walked in BD-wide chunks; H query heads of one group per program, stacked as the H·BQ rows of the
programs' 2-D tiles (row r: head r // BQ, query row r % BQ).

Maths (as jaxpe/corope.py states it): z_ij = sigmoid(sm_scale·q^leader_i·k_j) (j ≤ i), Δ_ij = Σ_{t=j+1..i} z_it,
φ_ijd = Δ_ij·ω_d; kc = k1 cos φ + k2 sin φ, ks = k2 cos φ − k1 sin φ, score_ij = sm_scale·Σ_d (q1·kc + q2·ks),
∂kc/∂φ = ks, ∂ks/∂φ = −kc. Visibility: key j is visible to query i < L iff j ≤ i, same document and i − j < window;
invisible gates are 0. Every walk visits only the key blocks that reach into the window (O(L·window) work).

The rotary score of a tile: per chunk of BD pairs, the phases [BD, BQ, BK] = ω[:, None, None]·Δ, their sin and cos
(`_sincos`: compiled, a reduction to [−π, π] and the SFU's sin.approx/cos.approx; interpreted, a Cody–Waite
reduction and two polynomials), the keys rotated once for the H heads (kc, ks [BD, BQ, BK]), and q1·kc + q2·ks of
each head accumulated in a [BD, H, BQ, BK] float32 tile (two FMAs per element), summed over the pairs once after
the last chunk. The chunks' q, k and ω load straight from memory (L1-resident; Triton cannot slice registers).
The cost per logit of each kernel, read from its SASS, is in docs/kernel_cost.md. Gate logits
are float32-accurate for float32 inputs (TF32×3 dots); the softmax runs in base 2 (log2 e folded into sm_scale; the
saved row statistic is lse·log2 e).

Kernels (every matrix product a `tl.dot` with sides >= 16):
- forward, grid (⌈L/BQ⌉, B, Hq/H), the longest rows first: walks key blocks in reverse from the diagonal carrying
  the per-row suffix sum of z, online softmax over the stacked [H·BQ, BK] scores, PV as one [H·BQ, BK]×[BK, DP] dot;
  writes o and the rows' lse·log2 e.
- backward, the same grid, one kernel for dq, dk and dv: the same reverse walk. Per tile: the gates, the scores
  (first trig pass), P, dV += Pᵀ dO and dP = dO Vᵀ (one dot each for the H heads), dS; a second trig pass adds
  sm_scale·Σ_j dS (kc, ks) to dq (the sums over keys as tensor-core products with 0/1 selectors, where tl.sum would
  shuffle across the lanes that hold the keys: `_add_key_sums`), the keys' share (summed over the H heads) to dk,
  and accumulates
  dΔ_ij = sm_scale·Σ_d ω_d Σ_h dS^h (q1^h ks − q2^h kc). The gate gradient dz_it = Tot_i − Suf_it with
  Suf_it = Σ_{j≥t} dΔ_ij (carried along the walk) and Tot_i = Σ_j dΔ_ij, known at the walk's end. The −Suf part:
  dk per tile, dq^leader −= sm_scale·S with S = Σ_t Suf_it z'_it k_t accumulated in registers and added after the
  walk; the Tot part from a second, gates-only walk over the same key blocks (per tile the logit dot, the dk dot and
  U += z'·k, no trig), dq^leader += sm_scale·Tot·U at its end. These gate products are float32-accurate (TF32×3):
  the two parts may nearly cancel.
  dq, dk, dv are zero-initialised float32 outputs that the programs add to with relaxed atomics (no fences): the heads
  of a group share dk, dv and their leader's dq, so float32 sums are not bitwise reproducible on a GPU.
Memory: O(L) per head — o, the row statistics and the float32 gradients; no L×L array anywhere. Speed (H200,
bfloat16, B 1, Hq 8, Hkv 2, results/bench/bench_gpu_h200_native_4096.md): at L 4096 the forward took 1.5 ms at D 64
and 2.7 at D 128, forward + backward 13.6 and 27.8, against the Pallas kernels' 4.7, 10.9, 46.5 and 95.7 (before
the backward's key sums moved to the tensor cores).
A traced sm_scale is a [1] float32 input of the kernels; its gradient is Σ dq·q / sm_scale (the attention depends on q
and sm_scale only through sm_scale·q).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl
from triton.language.extra import libdevice

from jaxpe.base import rotary_frequencies, scale_or_default
from jaxpe.kernels._checks import open_corope_fused
from jaxpe.kernels._common import (MASK_VALUE, _COS_COEFFS, _PIO2_1, _PIO2_2, _PIO2_3, _SIN_COEFFS, _TWO_OVER_PI,
                                   check_block_sizes, filled, first_order_only, next_power_of_two, output_struct,
                                   tile_extent, vary_alike)
from jaxpe.kernels._triton_launch import interpreted, launch, require
from jaxpe.kernels._triton_memory import scatter_add, scatter_in_place
from jaxpe.kernels.corope_blockwise import caller_frequencies


_LOG2E = tl.constexpr(1.4426950408889634)
_MASK = tl.constexpr(MASK_VALUE)  # a finite logit (base 2) for invisible keys
_ACCURATE = tl.constexpr("tf32x3")  # float32-accurate tensor-core products (three TF32 dots)
_TWO_OVER_PI_C = tl.constexpr(_TWO_OVER_PI)
_PIO2_1_C, _PIO2_2_C, _PIO2_3_C = tl.constexpr(_PIO2_1), tl.constexpr(_PIO2_2), tl.constexpr(_PIO2_3)
_S1, _S2, _S3 = (tl.constexpr(c) for c in _SIN_COEFFS)
_C1, _C2, _C3 = (tl.constexpr(c) for c in _COS_COEFFS)
_INV_TWO_PI = tl.constexpr(0.15915494309189535)
_ROUNDER = tl.constexpr(12582912.0)  # 1.5·2²³: adding and subtracting it rounds |y| < 2²² to an integer
_TWO_PI_HI = tl.constexpr(6.2831854820251465)  # float32(2π)
_TWO_PI_LO = tl.constexpr(-1.7484556e-07)  # 2π − float32(2π)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the forward and of the backward kernel; None: the default (`BlockSizes.default`). Rows and keys
    are powers of two >= 16 (Triton dots), block_d a power of two >= 1, block_h and block_h_bwd positive ints (the
    largest power of two not above them that divides G is used: H·BQ is a dot's side); blocks larger than the problem
    shrink (`fitted`).

    The rotary temporaries are [block_d, block_q, block_k] float32, the per-head products
    [block_d, block_h, block_q, block_k]: keep their product small (registers).
    """

    block_q: int | None = None  # forward: query rows per program
    block_k: int | None = None  # forward: keys per step of the reverse walk
    block_q_bwd: int | None = None  # backward: query rows per program
    block_k_bwd: int | None = None  # backward: keys per step
    block_d: int | None = None  # forward: rotary pairs per chunk (and the backward's when block_d_bwd is None)
    block_h: int | None = None  # forward: query heads of one group per program (they share the trig)
    block_h_bwd: int | None = None  # backward: the same
    block_d_bwd: int | None = None  # backward: rotary pairs per chunk (None: block_d if given, else the default)

    def __post_init__(self) -> None:
        check_block_sizes(self)

    @classmethod
    def default(cls, head_dim: int, dtype: jnp.dtype = jnp.bfloat16) -> BlockSizes:
        """16 query rows × 32 keys per forward tile with up to 4 heads and chunks of 4 rotary pairs (2 heads and 2
        pairs at D > 128, 1 head in float32 there: the TF32×3 gate dot keeps split copies of the [·, DP] tiles);
        backward tiles of 16 rows × 32 keys with up to 4 heads and 1 pair per chunk (16 keys and 2 pairs at D > 128).
        The forward's were chosen from ptxas's register reports for sm_90 (tools/compile_report.py: no spills in any
        forward kernel) and timings on an H200 (`default_num_warps`): at D 128, bfloat16, chunks of 8 pairs took it
        from 4.2 to 4.0 ms but the backward of that time from 51 to 61 ms; 64 keys per forward tile, 5.0 ms. The
        backward's from benchmarks/kernel_cost.py's model at GQA 8/2 (more heads per program share each phase's sine
        and cosine; smaller chunks keep the larger tile in registers), then timed on an H200 (benchmarks/tiles.py,
        results/bench/tiles_gpu_h200.md; bfloat16, L 4096, GQA 8/2): 12.5 ms at D 64 and 25.4 at D 128 against 1.5×
        that for 2 heads, 2.0× for 2 pairs, 1.2× for 16 keys and 2.0× for the earlier 2 heads, 4 pairs and 8 warps."""
        if head_dim > 128:
            heads = 1 if jnp.dtype(dtype).itemsize > 2 else 2
            return cls(block_q=16, block_k=32, block_q_bwd=16, block_k_bwd=16, block_d=2, block_h=heads,
                       block_h_bwd=4, block_d_bwd=2)
        return cls(block_q=16, block_k=32, block_q_bwd=16, block_k_bwd=32, block_d=4, block_h=4, block_h_bwd=4,
                   block_d_bwd=1)

    def fitted(self, *, length: int, head_dim: int, groups: int, dtype: jnp.dtype = jnp.bfloat16) -> BlockSizes:
        """Every size given (None: `default`'s for head_dim and dtype; block_d_bwd None: block_d when that is given),
        rows and keys capped at the next power of two >= length (and >= 16), the chunks at the next power of two
        >= D/2, the head blocks at the largest power of two dividing G not above them."""
        given = self if self.block_d_bwd is not None or self.block_d is None else dataclasses.replace(
            self, block_d_bwd=self.block_d)
        sizes = filled(given, BlockSizes.default(head_dim, dtype))
        cap, half = tile_extent(length), next_power_of_two(head_dim // 2)

        def heads(name: str) -> int:
            return max(h for h in (1, 2, 4, 8, 16, 32, 64) if h <= sizes[name] and groups % h == 0)

        return BlockSizes(block_q=min(sizes["block_q"], cap), block_k=min(sizes["block_k"], cap),
                          block_q_bwd=min(sizes["block_q_bwd"], cap), block_k_bwd=min(sizes["block_k_bwd"], cap),
                          block_d=min(sizes["block_d"], half), block_h=heads("block_h"),
                          block_h_bwd=heads("block_h_bwd"), block_d_bwd=min(sizes["block_d_bwd"], half))


DEFAULT_NUM_STAGES = 2


def default_num_warps(head_dim: int, *, backward: bool) -> int:
    """Warps per program: 4 for D <= 128, else 8, in both kernels. The forward's timed on an H200 (Triton 3.6; B 1,
    L 4096, Hq 8, Hkv 2, D 128, bfloat16, default blocks): 4.2 ms at 4 warps and 12.0 at 8 (the Pallas kernel 11.8).
    The backward's from benchmarks/kernel_cost.py's model at its default blocks (GQA 8/2, bf16/f32 clk/logit): 14.2/
    12.8 at D 64 and 28/25 at D 128 against 16.2/15.1 and 32/30 at 8 warps (4 heads of 64 stacked rows make one
    warpgroup's dot; at 8 warps both warpgroups compute it), spilling at most 136 bytes; at D 256 4 warps spill
    kilobytes."""
    return 4 if head_dim <= 128 else 8


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static settings of one call, fitted to its shapes (hashable: the jit static argument and the custom_vjp's
    non-differentiable one)."""

    groups: int  # G
    blocks: BlockSizes  # fitted to L, D, G and dtype
    num_warps: int  # forward
    num_warps_bwd: int
    num_stages: int
    window: int | None  # keys i − window < j ≤ i are visible; None: the whole causal prefix


# --- device code -----------------------------------------------------------------------------------------------------


@triton.jit
def _sincos(x, FAST: tl.constexpr):
    """(sin x, cos x) of float32 x. FAST (compiled for a GPU): x reduced to [−π, π] (k = x/2π rounded by the
    1.5·2²³ trick, r = x − k·2π in two fused multiply-adds), then the SFU's sin.approx/cos.approx (absolute error
    about 2⁻²⁰ there): two MUFU and four FMA-pipe instructions. Else (Triton's interpreter, which has no libdevice),
    as `_common.sincos`: k = round(x·2/π), r = x − k·π/2 in three exact parts, Cephes polynomials on [−π/4, π/4],
    quadrant selects."""
    if FAST:
        k = (x * _INV_TWO_PI + _ROUNDER) - _ROUNDER
        r = tl.fma(k, -_TWO_PI_LO, tl.fma(k, -_TWO_PI_HI, x))
        return libdevice.fast_sinf(r), libdevice.fast_cosf(r)
    k = tl.floor(x * _TWO_OVER_PI_C + 0.5)
    r = x - k * _PIO2_1_C - k * _PIO2_2_C - k * _PIO2_3_C
    r2 = r * r
    sin_r = r * r2 * ((_S3 * r2 + _S2) * r2 + _S1) + r
    cos_r = r2 * r2 * ((_C3 * r2 + _C2) * r2 + _C1) + (1.0 - 0.5 * r2)
    n = k.to(tl.int32)
    odd = (n & 1) != 0
    sin_x = tl.where(odd, cos_r, sin_r)
    cos_x = tl.where(odd, sin_r, cos_r)
    return tl.where((n & 2) != 0, -sin_x, sin_x), tl.where(((n + 1) & 2) != 0, -cos_x, cos_x)


@triton.jit
def _visible(seg_base, rows, cols, length, window, HAS_SEG: tl.constexpr):
    """Mask [R, BK] of rows [R] and cols [BK]: causal, a real row (< L), inside the window, the same document
    (segment ids at seg_base [L], read only with HAS_SEG)."""
    r = rows[:, None]
    c = cols[None, :]
    mask = (c <= r) & (r < length) & (r - c < window)
    if HAS_SEG:
        seg_rows = tl.load(seg_base + rows, mask=rows < length, other=-1)
        seg_cols = tl.load(seg_base + cols, mask=cols < length, other=-2)
        mask = mask & (seg_rows[:, None] == seg_cols[None, :])
    return mask


@triton.jit
def _gates(lead, k_base, cols, mask, gate_scale, length, stride_k, D: tl.constexpr, DP: tl.constexpr,
           PRECISION: tl.constexpr):
    """lead [BQ, DP] (the leader's rows), the keys cols [BK] of k_base -> (gates z [BQ, BK], 0 where `mask` is
    False; the keys kᵀ [DP, BK]). gate_scale = sm_scale·log2 e."""
    d = tl.arange(0, DP)
    kt = tl.load(k_base + cols[None, :] * stride_k + d[:, None], mask=(cols < length)[None, :] & (d < D)[:, None],
                 other=0.0)
    logits = tl.dot(lead, kt, input_precision=PRECISION)
    return tl.where(mask, 1.0 / (1.0 + tl.exp2(-gate_scale * logits)), 0.0), kt


@triton.jit
def _rotated(delta, freq_ptr, k_base, cols, lo, length, stride_k, DH: tl.constexpr, BD: tl.constexpr,
             FAST: tl.constexpr):
    """The chunk of pairs lo .. lo + BD − 1 for Δ [BQ, BK]: ω [BD], cos φ, sin φ, kc, ks [BD, BQ, BK]."""
    d = lo + tl.arange(0, BD)
    omega = tl.load(freq_ptr + d, mask=d < DH, other=0.0)
    sin, cos = _sincos(omega[:, None, None] * delta[None, :, :], FAST)
    at = k_base + d[:, None, None] + cols[None, None, :] * stride_k
    inside = (d < DH)[:, None, None] & (cols < length)[None, None, :]
    k1 = tl.load(at, mask=inside, other=0.0).to(tl.float32)  # [BD, 1, BK]
    k2 = tl.load(at + DH, mask=inside, other=0.0).to(tl.float32)
    return omega, cos, sin, k1 * cos + k2 * sin, k2 * cos - k1 * sin


@triton.jit
def _query_chunk(q_base, rows, lo, length, stride_q, H: tl.constexpr, DH: tl.constexpr, BD: tl.constexpr):
    """(q1, q2) [BD, H, BQ, 1] float32 of the H heads from q_base (the first one's column 0) at the pairs
    lo .. lo + BD − 1."""
    d = lo + tl.arange(0, BD)
    heads = tl.arange(0, H)
    at = q_base + d[:, None, None, None] + heads[None, :, None, None] * (2 * DH) + rows[None, None, :, None] * stride_q
    inside = (d < DH)[:, None, None, None] & (rows < length)[None, None, :, None]
    return (tl.load(at, mask=inside, other=0.0).to(tl.float32),
            tl.load(at + DH, mask=inside, other=0.0).to(tl.float32))


@triton.jit
def _scores(delta, q_base, k_base, freq_ptr, rows, cols, length, stride_q, stride_k, H: tl.constexpr,
            BQ: tl.constexpr, BK: tl.constexpr, DH: tl.constexpr, BD: tl.constexpr, FAST: tl.constexpr):
    """Raw scores [H·BQ, BK] Σ_d (q1·kc + q2·ks) of the H heads (without sm_scale) for Δ [BQ, BK]."""
    acc = tl.zeros((BD, H, BQ, BK), tl.float32)
    for lo in range(0, DH, BD):
        _, _, _, kc, ks = _rotated(delta, freq_ptr, k_base, cols, lo, length, stride_k, DH, BD, FAST)
        q1, q2 = _query_chunk(q_base, rows, lo, length, stride_q, H, DH, BD)
        acc += q1 * kc[:, None, :, :]
        acc += q2 * ks[:, None, :, :]
    return tl.reshape(tl.sum(acc, 0), (H * BQ, BK))


@triton.jit
def _computed_once(x, FAST: tl.constexpr):
    """x, which Triton may not recompute in another layout (compiled: behind a move it cannot see through). The key
    sums' tensor-core operands would otherwise have the whole rotary chain, sine and cosine included, computed again
    in their layout."""
    if FAST:
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1)
    return x


@triton.jit
def _sum_columns(x, selector, PRECISION: tl.constexpr):
    """x [M, K] float32 @ selector [K, N] of zeros and ones on the tensor cores (the selector is exact in TF32). With
    PRECISION "tf32x3", float32-accurate: x split into its TF32 part and the rest (exact in float32), two products;
    else one TF32 product (x rounded to 11 bits, finer than the 16-bit gradient it goes into)."""
    if PRECISION == "tf32x3":
        hi = (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        total = tl.dot(hi, selector, input_precision="tf32") + tl.dot(x - hi, selector, input_precision="tf32")
    else:
        total = tl.dot(x, selector, input_precision="tf32")
    return total


@triton.jit
def _add_key_sums(ds4, kc, ks, dq_base, lo, first_row, rows, length, stride_q, sm_scale, H: tl.constexpr,
                  BQ: tl.constexpr, BK: tl.constexpr, DH: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
                  MMA_SUMS: tl.constexpr, FAST: tl.constexpr):
    """Adds sm_scale·Σ_j dS (kc, ks) ([BD, H, BQ] each; dS ds4 [1, H, BQ, BK], kc, ks [BD, BQ, BK]) to dq's pairs
    lo .. lo + BD − 1 at dq_base (the first head's column 0). MMA_SUMS: as products with 0/1 selectors
    [BD·H·BQ, BK] @ [BK, 16] (selector c puts Σ_j into column c), the sums over keys without the shuffles across
    lanes that tl.sum needs (Triton puts the keys across a warp's lanes), added in place when compiled (FAST: the
    launch sets MMA_SUMS only where `scatter_in_place` holds for those rows); else tl.sum."""
    if MMA_SUMS:
        kc, ks = _computed_once(kc, FAST), _computed_once(ks, FAST)
        m = tl.arange(0, BD * H * BQ)  # the sums' rows: pair, head, query row
        pair_m, rows_m, part = lo + m // (H * BQ), first_row + m % BQ, tl.arange(0, 16)
        keys = tl.zeros((BK, 1), tl.float32)
        pairs = (_sum_columns(tl.reshape(ds4 * kc[:, None, :, :], (BD * H * BQ, BK)),
                              keys + (part == 0).to(tl.float32)[None, :], PRECISION)
                 + _sum_columns(tl.reshape(ds4 * ks[:, None, :, :], (BD * H * BQ, BK)),
                                keys + (part == 1).to(tl.float32)[None, :], PRECISION))  # columns 0, 1: the sums
        dq_at = (dq_base + pair_m[:, None] + ((m // BQ) % H)[:, None] * (2 * DH) + rows_m[:, None] * stride_q
                 + part[None, :] * DH)
        inside = (pair_m < DH)[:, None] & (rows_m < length)[:, None] & (part < 2)[None, :]
        scatter_add(dq_at, sm_scale * pairs, inside, FAST)
    else:
        d = lo + tl.arange(0, BD)
        heads = tl.arange(0, H)
        dq_at = dq_base + d[:, None, None] + heads[None, :, None] * (2 * DH) + rows[None, None, :] * stride_q
        inside = (d < DH)[:, None, None] & (rows < length)[None, None, :]
        tl.atomic_add(dq_at, sm_scale * tl.sum(ds4 * kc[:, None, :, :], 3), mask=inside, sem="relaxed")
        tl.atomic_add(dq_at + DH, sm_scale * tl.sum(ds4 * ks[:, None, :, :], 3), mask=inside, sem="relaxed")


@triton.jit
def _rotary_backward(ds, delta, q_base, dq_base, k_base, dk_base, freq_ptr, rows, first_row, cols, length, stride_q,
                     stride_k, sm_scale, H: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, DH: tl.constexpr,
                     BD: tl.constexpr, PRECISION: tl.constexpr, MMA_SUMS: tl.constexpr, FAST: tl.constexpr):
    """The second trig pass of a tile, dS [H·BQ, BK]: adds sm_scale·Σ_j dS (kc, ks) to dq at dq_base (the first
    head's column 0; `_add_key_sums`) and the keys' share to dk at dk_base; returns
    Σ_d ω_d Σ_h dS^h (q1^h ks − q2^h kc) [BQ, BK]."""
    ds4 = tl.reshape(ds, (H, BQ, BK))[None, :, :, :]
    d_delta = tl.zeros((BQ, BK), tl.float32)
    for lo in range(0, DH, BD):
        omega, cos, sin, kc, ks = _rotated(delta, freq_ptr, k_base, cols, lo, length, stride_k, DH, BD, FAST)
        q1, q2 = _query_chunk(q_base, rows, lo, length, stride_q, H, DH, BD)
        _add_key_sums(ds4, kc, ks, dq_base, lo, first_row, rows, length, stride_q, sm_scale, H, BQ, BK, DH, BD,
                      PRECISION, MMA_SUMS, FAST)
        d = lo + tl.arange(0, BD)
        dsq1 = tl.sum(ds4 * q1, 1)  # Σ_h dS^h q1^h, [BD, BQ, BK]
        dsq2 = tl.sum(ds4 * q2, 1)
        dk_at = dk_base + d[:, None] + cols[None, :] * stride_k
        dk_inside = (d < DH)[:, None] & (cols < length)[None, :]
        tl.atomic_add(dk_at, sm_scale * tl.sum(dsq1 * cos - dsq2 * sin, 1), mask=dk_inside, sem="relaxed")
        tl.atomic_add(dk_at + DH, sm_scale * tl.sum(dsq1 * sin + dsq2 * cos, 1), mask=dk_inside, sem="relaxed")
        d_delta += tl.sum((dsq1 * ks - dsq2 * kc) * omega[:, None, None], 0)
    return d_delta


@triton.jit
def _key_blocks(qb, window, BQ: tl.constexpr, BK: tl.constexpr):
    """(last, count): query block qb walks key blocks last, last − 1, ..., last − count + 1, from the one holding its
    last row's diagonal down to the one holding key qb·BQ − window + 1 (key 0 without a window: window = L)."""
    last = ((qb + 1) * BQ - 1) // BK
    return last, last + 1 - tl.maximum(qb * BQ - window + 1, 0) // BK


@triton.jit
def _program_block(length, num_heads, D: tl.constexpr, BQ: tl.constexpr, H: tl.constexpr, G: tl.constexpr):
    """This program's place: (qb, b, head0, kv_head, stride_q, stride_k, q_at, k_at, rows, rows_s, heads_s). Query
    block qb (the longest walks start first) of batch b, query heads head0 .. head0 + H − 1 of KV head kv_head; the
    row strides of q and k; q_at, k_at: the offsets of batch b's q rows and of its k/v rows at kv_head; rows [BQ] the
    block's query rows; rows_s, heads_s [H·BQ]: the query row and head of each of the heads' stacked rows."""
    qb = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    head0 = tl.program_id(2) * H
    kv_head = head0 // G
    stride_q, stride_k = num_heads * D, (num_heads // G) * D
    stacked = tl.arange(0, H * BQ)
    return (qb, b, head0, kv_head, stride_q, stride_k, b * length * stride_q, b * length * stride_k + kv_head * D,
            qb * BQ + tl.arange(0, BQ), qb * BQ + stacked % BQ, head0 + stacked // BQ)


@triton.jit
def _forward_kernel(q_ptr, k_ptr, v_ptr, freq_ptr, seg_ptr, scale_ptr, length, window, num_heads, o_ptr, lse_ptr,
                    D: tl.constexpr, DP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
                    H: tl.constexpr, G: tl.constexpr, HAS_SEG: tl.constexpr, PRECISION: tl.constexpr,
                    FAST: tl.constexpr):
    """q [B, L, Hq, D], k/v [B, L, Hkv, D], ω [Dh] float32, segment ids [B, L] int32 (read with HAS_SEG), sm_scale
    [1] float32 -> o [B, L, Hq, D], lse·log2 e [B, Hq, L] float32. window = L when there is none."""
    qb, b, head0, kv_head, stride_q, stride_k, q_at, k_at, rows, rows_s, heads_s = _program_block(
        length, num_heads, D, BQ, H, G)
    q_base, k_base, v_base, seg_base = q_ptr + q_at, k_ptr + k_at, v_ptr + k_at, seg_ptr + b * length
    sm_scale = tl.load(scale_ptr)
    d = tl.arange(0, DP)
    lead = tl.load(q_base + rows[:, None] * stride_q + kv_head * G * D + d[None, :],
                   mask=(rows < length)[:, None] & (d < D)[None, :], other=0.0)
    last, steps = _key_blocks(qb, window, BQ, BK)
    z_suffix = tl.zeros((BQ,), tl.float32)
    m = tl.full((H * BQ,), float("-inf"), tl.float32)
    l = tl.zeros((H * BQ,), tl.float32)
    acc = tl.zeros((H * BQ, DP), tl.float32)
    for step in range(0, steps):
        cols = (last - step) * BK + tl.arange(0, BK)
        mask = _visible(seg_base, rows, cols, length, window, HAS_SEG)
        z, _ = _gates(lead, k_base, cols, mask, sm_scale * _LOG2E, length, stride_k, D, DP, PRECISION)
        delta = z_suffix[:, None] + tl.cumsum(z, 1, reverse=True) - z
        raw = _scores(delta, q_base + head0 * D, k_base, freq_ptr, rows, cols, length, stride_q, stride_k, H, BQ,
                      BK, D // 2, BD, FAST)
        visible = _visible(seg_base, rows_s, cols, length, window, HAS_SEG)
        s = tl.where(visible, raw * (sm_scale * _LOG2E), _MASK)
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.where(visible, tl.exp2(s - m_new[:, None]), 0.0)
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_k + d[None, :], mask=(cols < length)[:, None] & (d < D)[None, :],
                    other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
        z_suffix += tl.sum(z, 1)
    l = tl.where(l > 0.0, l, 1.0)  # padding rows (>= L) see no key
    real = rows_s < length
    tl.store(o_ptr + q_at + rows_s[:, None] * stride_q + heads_s[:, None] * D + d[None, :],
             (acc / l[:, None]).to(o_ptr.dtype.element_ty), mask=real[:, None] & (d < D)[None, :])
    tl.store(lse_ptr + (b * num_heads + heads_s) * length + rows_s, m + tl.log2(l), mask=real)


@triton.jit
def _backward_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, row_dot_ptr, freq_ptr, seg_ptr, scale_ptr, length, window,
                     num_heads, dq_ptr, dk_ptr, dv_ptr, D: tl.constexpr, DP: tl.constexpr, BQ: tl.constexpr,
                     BK: tl.constexpr, BD: tl.constexpr, H: tl.constexpr, G: tl.constexpr, HAS_SEG: tl.constexpr,
                     PRECISION: tl.constexpr, MMA_SUMS: tl.constexpr, FAST: tl.constexpr):
    """q/do [B, L, Hq, D], k/v [B, L, Hkv, D], lse·log2 e and row_dot = Σ_d dO·O [B, Hq, L] float32, ω, segment ids,
    sm_scale as in the forward -> dq [B, L, Hq, D], dk, dv [B, L, Hkv, D] float32 (zeros in, added to)."""
    qb, b, head0, kv_head, stride_q, stride_k, q_at, k_at, rows, rows_s, heads_s = _program_block(
        length, num_heads, D, BQ, H, G)
    q_base, dq_base, k_base, v_base = q_ptr + q_at, dq_ptr + q_at, k_ptr + k_at, v_ptr + k_at
    dk_base, dv_base, seg_base = dk_ptr + k_at, dv_ptr + k_at, seg_ptr + b * length
    sm_scale = tl.load(scale_ptr)
    d = tl.arange(0, DP)
    columns = (d < D)[None, :]
    lead = tl.load(q_base + rows[:, None] * stride_q + kv_head * G * D + d[None, :],
                   mask=(rows < length)[:, None] & columns, other=0.0)
    lead32 = lead.to(tl.float32)
    real = rows_s < length
    do = tl.load(do_ptr + q_at + rows_s[:, None] * stride_q + heads_s[:, None] * D + d[None, :],
                 mask=real[:, None] & columns, other=0.0)
    stats = (b * num_heads + heads_s) * length + rows_s
    lse = tl.load(lse_ptr + stats, mask=real, other=0.0)
    row_dot = tl.load(row_dot_ptr + stats, mask=real, other=0.0)
    last, steps = _key_blocks(qb, window, BQ, BK)
    gate_scale = sm_scale * _LOG2E
    z_suffix = tl.zeros((BQ,), tl.float32)
    dd_suffix = tl.zeros((BQ,), tl.float32)
    s_acc = tl.zeros((BQ, DP), tl.float32)  # Σ_t Suf_it z'_it k_t
    for step in range(0, steps):
        cols = (last - step) * BK + tl.arange(0, BK)
        keys = (cols < length)[:, None] & columns
        mask = _visible(seg_base, rows, cols, length, window, HAS_SEG)
        z, kt = _gates(lead, k_base, cols, mask, gate_scale, length, stride_k, D, DP, PRECISION)
        delta = z_suffix[:, None] + tl.cumsum(z, 1, reverse=True) - z
        raw = _scores(delta, q_base + head0 * D, k_base, freq_ptr, rows, cols, length, stride_q, stride_k, H, BQ,
                      BK, D // 2, BD, FAST)
        visible = _visible(seg_base, rows_s, cols, length, window, HAS_SEG)
        p = tl.where(visible, tl.exp2(raw * gate_scale - lse[:, None]), 0.0)  # [H·BQ, BK]
        vt = tl.load(v_base + cols[None, :] * stride_k + d[:, None], mask=(cols < length)[None, :] & (d < D)[:, None],
                     other=0.0)
        tl.atomic_add(dv_base + cols[:, None] * stride_k + d[None, :], tl.dot(tl.trans(p.to(do.dtype)), do),
                      mask=keys, sem="relaxed")
        ds = p * (tl.dot(do, vt) - row_dot[:, None])
        d_delta = sm_scale * _rotary_backward(ds, delta, q_base + head0 * D, dq_base + head0 * D, k_base, dk_base,
                                              freq_ptr, rows, qb * BQ, cols, length, stride_q, stride_k, sm_scale, H,
                                              BQ, BK, D // 2, BD, PRECISION, MMA_SUMS, FAST)
        suffix = dd_suffix[:, None] + tl.cumsum(d_delta, 1, reverse=True)  # Suf_it = Σ_{j≥t} dΔ_ij
        weight = suffix * z * (1.0 - z)  # z' = z(1 − z) is 0 where invisible
        s_acc += tl.dot(weight, tl.trans(kt).to(tl.float32), input_precision=_ACCURATE)
        tl.atomic_add(dk_base + cols[:, None] * stride_k + d[None, :],
                      -sm_scale * tl.dot(tl.trans(weight), lead32, input_precision=_ACCURATE), mask=keys,
                      sem="relaxed")
        z_suffix += tl.sum(z, 1)
        dd_suffix += tl.sum(d_delta, 1)
    dq_lead = dq_base + rows[:, None] * stride_q + kv_head * G * D + d[None, :]
    lead_rows = (rows < length)[:, None] & columns
    tl.atomic_add(dq_lead, -sm_scale * s_acc, mask=lead_rows, sem="relaxed")
    total = dd_suffix  # Tot_i = Σ_j dΔ_ij
    u = tl.zeros((BQ, DP), tl.float32)  # Σ_t z'_it k_t
    for step in range(0, steps):  # the Tot part: the gates again, no trig
        cols = (last - step) * BK + tl.arange(0, BK)
        mask = _visible(seg_base, rows, cols, length, window, HAS_SEG)
        z, kt = _gates(lead, k_base, cols, mask, gate_scale, length, stride_k, D, DP, PRECISION)
        z_prime = z * (1.0 - z)
        u += tl.dot(z_prime, tl.trans(kt).to(tl.float32), input_precision=_ACCURATE)
        tl.atomic_add(dk_base + cols[:, None] * stride_k + d[None, :],
                      sm_scale * tl.dot(tl.trans(total[:, None] * z_prime), lead32, input_precision=_ACCURATE),
                      mask=(cols < length)[:, None] & columns, sem="relaxed")
    tl.atomic_add(dq_lead, sm_scale * total[:, None] * u, mask=lead_rows, sem="relaxed")


# --- host code -------------------------------------------------------------------------------------------------------


def _kernel_settings(config: _Config, q: jax.Array, segment_ids: jax.Array | None, *, backward: bool) -> dict:
    """The launch's grid and keyword arguments for q [B, L, Hq, D]."""
    batch, length, num_heads, d = q.shape
    blocks = config.blocks
    bq, bk, h = ((blocks.block_q_bwd, blocks.block_k_bwd, blocks.block_h_bwd) if backward
                 else (blocks.block_q, blocks.block_k, blocks.block_h))
    settings = dict(grid=(-(-length // bq), batch, num_heads // h),
                    num_warps=config.num_warps_bwd if backward else config.num_warps,
                    num_stages=config.num_stages, D=d, DP=tile_extent(d), BQ=bq, BK=bk,
                    BD=blocks.block_d_bwd if backward else blocks.block_d, H=h,
                    G=config.groups, HAS_SEG=segment_ids is not None,
                    PRECISION="tf32x3" if q.dtype == jnp.float32 else "tf32", FAST=not interpreted())
    if backward:  # the key sums on the tensor cores where they fill a warpgroup's 64 rows (fewer: MHA, the shuffles
        # cost less) and give each warp 16 rows (their adds in place count each sum once), but for float32 at Dp 256,
        # where their operands spill a kilobyte
        rows = h * bq * blocks.block_d_bwd
        settings["MMA_SUMS"] = (rows >= 64 and scatter_in_place(rows, settings["num_warps"])
                                and (q.dtype != jnp.float32 or tile_extent(d) <= 128))
    return settings


def _scalars(q: jax.Array, config: _Config) -> list[int]:
    """length, window (L when there is none), Hq: the kernels' integer parameters."""
    return [q.shape[1], config.window or q.shape[1], q.shape[2]]


def _segments(segment_ids: jax.Array | None) -> jax.Array:
    """The segment-id operand: the ids [B, L] int32, or a placeholder the kernels never read."""
    return jnp.zeros((1,), jnp.int32) if segment_ids is None else segment_ids


def _forward_call(config: _Config, q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array,
                  segment_ids: jax.Array | None, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q [B, L, Hq, D], k/v [B, L, Hkv, D], ω [Dh], segment ids [B, L] or None, sm_scale [1] -> o [B, L, Hq, D],
    lse·log2 e [B, Hq, L] float32."""
    batch, length, num_heads, _ = q.shape
    o, lse = launch(_forward_kernel, [q, k, v, omega, _segments(segment_ids), scale, *_scalars(q, config)],
                    out_shapes=[output_struct(q.shape, q.dtype, q),
                                output_struct((batch, num_heads, length), jnp.float32, q)],
                    name="corope_triton_forward", **_kernel_settings(config, q, segment_ids, backward=False))
    return o, lse


def _backward_call(config: _Config, q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array,
                   row_dot: jax.Array, omega: jax.Array, segment_ids: jax.Array | None, scale: jax.Array
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The forward's inputs, do [B, L, Hq, D], lse·log2 e and row_dot [B, Hq, L] -> dq [B, L, Hq, D], dk, dv
    [B, L, Hkv, D] float32. q and k go in as float32 copies (the same values: the gate dot's TF32 products of them
    are exact): the rotary passes read them once per chunk and tile, and 16-bit elements cost each load an unpacking
    shift (bf16 D 64 on benchmarks/kernel_cost.py's model: 12.7 clk/logit against 14.2)."""
    wide_q, wide_k = q.astype(jnp.float32), k.astype(jnp.float32)
    dq, dk, dv = launch(_backward_kernel,
                        [wide_q, wide_k, v, do, lse, row_dot, omega, _segments(segment_ids), scale,
                         *_scalars(q, config)],
                        out_shapes=[output_struct(x.shape, jnp.float32, q) for x in (q, k, v)], zeroed=(0, 1, 2),
                        name="corope_triton_backward", **_kernel_settings(config, q, segment_ids, backward=True))
    return dq, dk, dv


def _corope_triton_fwd(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, omega: jax.Array,
                       scale: jax.Array, config: _Config) -> tuple[jax.Array, tuple]:
    o, lse = first_order_only("triton", functools.partial(_forward_call, config), q, k, v, omega, segment_ids, scale)
    return o, (q, k, v, o, lse, omega, segment_ids, scale)


def _corope_triton_bwd(config: _Config, residuals: tuple, do: jax.Array) -> tuple:
    q, k, v, o, lse, omega, segment_ids, scale = residuals
    do = do.astype(o.dtype)
    row_dot = jnp.einsum("btnd,btnd->bnt", o.astype(jnp.float32), do.astype(jnp.float32))  # Σ_d dO·O
    dq, dk, dv = first_order_only("triton", functools.partial(_backward_call, config), q, k, v, do, lse, row_dot,
                                  omega, segment_ids, scale)
    d_scale = jnp.reshape(jnp.sum(dq * q.astype(jnp.float32)), (1,)) / scale
    # Segment ids are integers; ω is a constant (see caller_frequencies).
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, d_scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _corope_triton(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, omega: jax.Array,
                   scale: jax.Array, config: _Config) -> jax.Array:
    return _corope_triton_fwd(q, k, v, segment_ids, omega, scale, config)[0]


_corope_triton.defvjp(_corope_triton_fwd, _corope_triton_bwd)
_corope_triton_jit = jax.jit(_corope_triton, static_argnums=(6,))


def corope_attention_triton(q: jax.Array, k: jax.Array, v: jax.Array, *, theta: float = 10000.0,
                            sm_scale: float | jax.Array | None, block_sizes: BlockSizes | None = None,
                            num_warps: int | None = None, num_stages: int | None = None,
                            segment_ids: jax.Array | None = None, window: int | None = None,
                            inv_freq: jax.Array | None = None, causal: bool = True) -> jax.Array:
    """Fused causal Co-RoPE attention in Triton. q [B, L, Hq, D], k/v [B, L, Hkv, D] (float32, bfloat16 or float16,
    D even and at most 256) -> [B, L, Hq, D].

    sm_scale: a number or a traced scalar (a learned temperature, differentiated); None: D^−½.
    segment_ids: int [B, L] document ids (packed documents; padding as an id of its own), None: one document.
    window: int >= 1, query i sees keys i − window < j ≤ i (tiles outside it are never visited), None: all.
    inv_freq: float [D/2] rotary frequencies replacing θ^(−2d/D) (`theta` is then unused); a constant, not
    differentiated. Differentiable once in q, k, v and sm_scale (one fused backward kernel). block_sizes (None
    fields: `BlockSizes.default`), num_warps (both kernels; default `default_num_warps`) and num_stages (default 2)
    tune the compiled kernels; on CPU they run in Triton's interpreter (TRITON_INTERPRET=1 before triton is
    imported). causal=False, other dtypes and symbolic shapes raise (`fused_refusal`).
    """
    empty, segment_ids, window = open_corope_fused(
        q, k, v, impl="triton", theta=theta, sm_scale=sm_scale, inv_freq=inv_freq, causal=causal, window=window,
        segment_ids=segment_ids, block_sizes=block_sizes, kind=BlockSizes, num_warps=num_warps, num_stages=num_stages)
    if empty:
        return jnp.zeros(q.shape, q.dtype)
    require()
    groups = q.shape[2] // k.shape[2]
    config = _Config(groups=groups, blocks=(block_sizes or BlockSizes()).fitted(
        length=q.shape[1], head_dim=q.shape[3], groups=groups, dtype=q.dtype),
        num_warps=num_warps or default_num_warps(q.shape[3], backward=False),
        num_warps_bwd=num_warps or default_num_warps(q.shape[3], backward=True),
        num_stages=num_stages or DEFAULT_NUM_STAGES, window=window)
    scale = jnp.reshape(jnp.asarray(scale_or_default(sm_scale, q.shape[3]), jnp.float32), (1,))
    q, k, v, scale = vary_alike(q, k, v, scale)  # one manual-axis type inside the kernels under shard_map
    omega = caller_frequencies(inv_freq)
    if omega is None:
        omega = rotary_frequencies(q.shape[3], theta)
    return _corope_triton_jit(q, k, v, segment_ids, omega, scale, config)
