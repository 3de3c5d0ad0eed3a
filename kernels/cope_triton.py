"""Fused CoPE attention in native Triton (`triton.jit` kernels launched through `_triton_launch.launch`): a forward
kernel and one backward kernel, with packed documents and sliding windows. The algorithm is `cope_pallas.py`'s
(its docstring states the maths and the forward/backward decomposition); here it is written with explicit pointer
arithmetic and masks instead of BlockSpecs, so no input is padded: D is tiled at Dp, the next power of two (>= 16),
and loads and stores mask rows and keys past L (only when L is no multiple of the blocks) and columns past D (only
when D < Dp). jax-triton gives integer arguments no divisibility, so offsets are marked as multiples of D's largest
power-of-two factor (up to 16) for vectorised loads.

Letters (as in cope_pallas.py): B batch, L length, Hq query heads, Hkv key/value heads, G = Hq / Hkv, D head dim
(Dp its tile), P = npos table rows. Kernel tiles are [block_q, block_k]. CoPE: Golovneva et al., arXiv:2405.18719.

Numerics: logits and gates are computed in base 2, with log2(e) folded into the scale (exp2 only); the softmax
statistic saved for the backward is lse₂ = m + log2(l). Gate logits of float32 inputs are float32-accurate: three
TF32 dots of q's and the gate keys' TF32 parts, split once by XLA (`_tf32_parts`; the interpreter multiplies in IEEE
float32): a TF32 error in a gate shifts every position counted past it. The other float32 dots take Triton's default
(TF32 on the GPU). A tile's running sums over keys (the gates into positions, ∂L/∂p into the gates' gradient) are
tensor-core dots with a 0/1 triangle, their float32 operands split exactly into float16 or bfloat16 parts
(`_gate_sums`, `_running_sums`), not `tl.cumsum`'s shuffles.

Compiled for a GPU (FAST; not in Triton's interpreter), z's gathers and ∂L/∂z's scattered adds are inline PTX
(`ld.global.nc`, `red.global.add`) in the layout of the logits: as `tl.load`/`tl.atomic_add` they would get layouts of
their own from Triton's coalescing pass, and every address and value would cross shared memory twice. The adds are
in place only where the query block has 16 rows per warp (`_triton_memory.scatter_in_place`); a smaller one repeats
logits across warps, and there Triton's atomics mask the copies (`default_blocks` gives 16 rows a warp). The
interpreter runs the same kernels with `tl.load`/`tl.atomic_add` (and float32 running sums: its bfloat16 dots are
wrong), so the GPU tests (tests/test_gpu_long.py) are what check the compiled forms.

Forward: one program per (query block, batch, query head) walks key blocks in reverse from the diagonal carrying
the suffix sum R of the gates, until every live row's R reaches P − 1; the blocks left are clamped tiles (plain
attention plus z_i,P−1, no gates). It saves per row R where the walk stopped and e, the first key of the last block
it walked ([B, Hq, L] each).

Backward: one query-major program per (query block, batch, query head) walks key blocks forward, clamped tiles
(wholly before min_i e_i) first, rebuilding positions from the saved R. dq stays in registers; dk, dv (and d gate_k)
are relaxed atomic adds (no fences) into zero-initialised float32 [B, L, Hkv, D] outputs, ∂L/∂z atomic adds at
(i, ⌊p⌋) and (i, ⌈p⌉) into a zero-initialised float32 [B, Hq, L, P]. The table's gradient and z's share of dq are
XLA matmuls, as is z = q·e itself (memory O(L·P)).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from jaxpe.kernels._common import MASK_VALUE, filled, first_order_only, output_struct, tile_extent
from jaxpe.kernels._triton_launch import interpreted, launch
from jaxpe.kernels._triton_memory import gather_pair, scatter_add, scatter_in_place
from jaxpe.kernels._triton_rows import (add_rows, document_rows, first_key_block, load_rows, program_rows,
                                        store_rows, strides, visible)
from jaxpe.kernels.cope_pallas import BlockSizes, open_cope_fused

_LOG2E = tl.constexpr(math.log2(math.e))  # exp(x) = exp2(x·log2(e))
_MASK = tl.constexpr(MASK_VALUE)  # the logit of invisible keys (exp2 gives exactly 0)
_ACCURATE_CHUNK = 32  # head-dim columns per float32-accurate gate dot above Dp 64 (three whole dots there spill)


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static settings of one call, fitted to its shapes (hashable: the jit static argument and the custom_vjp's
    non-differentiable one)."""

    sm_scale: float
    npos: int  # P
    blocks: BlockSizes  # fitted to L, D, dtype and gate_k
    num_warps: int  # forward
    num_warps_bwd: int
    num_stages: int | None  # None: 2 in the forward, 1 in the backward
    window: int | None = None  # sliding window W (< L), None: the whole causal prefix


def default_num_warps(head_dim: int, dtype: jnp.dtype, *, backward: bool) -> int:
    """Warps per program of the native kernels: 4, one warpgroup (at 8, Hopper's warpgroup dots of 64-row tiles run
    in both warpgroups alike, and smaller tiles split each row's keys over more warps, whose row sums then cross
    shared memory: both cost more per logit on benchmarks/kernel_cost.py's model, and on an H200 8 warps took 1.7×
    the forward's time and 1.5× the backward's at D 64 and 128, bfloat16: results/bench/tiles_gpu_h200.md); 8 for
    the float32 forward at Dp 256, which spills at 4."""
    return 8 if jnp.dtype(dtype) == jnp.float32 and tile_extent(head_dim) >= 256 and not backward else 4


def default_blocks(head_dim: int, dtype: jnp.dtype, *, gate_k: bool, num_warps_bwd: int) -> BlockSizes:
    """The native kernels' tiles: `cope_pallas.BlockSizes.default`'s, with two changes where D is tiled at Dp <= 128
    without a separate gate_k. Forward tiles of 64 rows for 16-bit inputs at Dp <= 64 (an H100 ran the bfloat16
    forward at L 4096 in 0.17 ms against 0.38 at 32 rows: results/bench/tiles_gpu_h100.md). Backward query blocks of
    16 rows per warp (64 at 4 warps), so that ∂L/∂z's adds stay in place (`_triton_memory.scatter_in_place`); on
    benchmarks/kernel_cost.py's model they cost 0.81–3.1 clk/logit against 1.8–7.6 for 32 rows with Triton's atomics,
    at the price of 64–304 spilled bytes per thread (within the compile report's backward budget)."""
    blocks = BlockSizes.default(head_dim, dtype, gate_k=gate_k)
    if gate_k or tile_extent(head_dim) > 128:
        return blocks
    block_q = 64 if jnp.dtype(dtype).itemsize == 2 and tile_extent(head_dim) <= 64 else blocks.block_q
    return dataclasses.replace(blocks, block_q=block_q, block_q_bwd=max(blocks.block_q_bwd, 16 * num_warps_bwd))


# --- kernels ---------------------------------------------------------------------------------------------------------


@triton.jit
def _gate_logits(q, kg, q_hi, q_lo, qh_ptr, ql_ptr, kh_ptr, kl_ptr, rows, cols, dims, length, stride_ql, stride_kl,
                 ALIGN: tl.constexpr, EVEN_L: tl.constexpr, MASK_D: tl.constexpr, BLOCK_D: tl.constexpr,
                 GATE_CHUNK: tl.constexpr):
    """q·kgᵀ [block_q, block_k] float32. GATE_CHUNK 0: from the tiles q [block_q, Dp] and kg [block_k, Dp] at the
    dtype's default precision. Else float32-accurate (3xTF32): three TF32 dots hi·klᵀ + lo·khᵀ + hi·khᵀ of the
    operands' TF32 parts (`_tf32_parts`, split once outside the kernel, not in every tile as
    `input_precision="tf32x3"` would); GATE_CHUNK = Dp: whole tiles, q's parts the tiles q_hi, q_lo and kg's read at
    kh/kl_ptr; less: summed over chunks of GATE_CHUNK columns, all four read at qh/ql/kh/kl_ptr."""
    if GATE_CHUNK == 0:
        logits = tl.dot(q, tl.trans(kg))
    elif GATE_CHUNK == BLOCK_D:
        k_lo = load_rows(kl_ptr, cols, dims, length, stride_kl, ALIGN, EVEN_L, MASK_D)
        logits = tl.dot(q_hi, tl.trans(k_lo), input_precision="tf32")
        k_hi = load_rows(kh_ptr, cols, dims, length, stride_kl, ALIGN, EVEN_L, MASK_D)
        logits = tl.dot(q_lo, tl.trans(k_hi), logits, input_precision="tf32")
        logits = tl.dot(q_hi, tl.trans(k_hi), logits, input_precision="tf32")
    else:
        logits = tl.zeros([rows.shape[0], cols.shape[0]], tl.float32)
        for start in tl.static_range(0, BLOCK_D, GATE_CHUNK):
            chunk = start + tl.arange(0, GATE_CHUNK)
            hi = load_rows(qh_ptr, rows, chunk, length, stride_ql, ALIGN, EVEN_L, MASK_D)
            k_lo = load_rows(kl_ptr, cols, chunk, length, stride_kl, ALIGN, EVEN_L, MASK_D)
            logits = tl.dot(hi, tl.trans(k_lo), logits, input_precision="tf32")
            lo = load_rows(ql_ptr, rows, chunk, length, stride_ql, ALIGN, EVEN_L, MASK_D)
            k_hi = load_rows(kh_ptr, cols, chunk, length, stride_kl, ALIGN, EVEN_L, MASK_D)
            logits = tl.dot(lo, tl.trans(k_hi), logits, input_precision="tf32")
            logits = tl.dot(hi, tl.trans(k_hi), logits, input_precision="tf32")
    return logits


@triton.jit
def _query_operands(Q, K, V, KG, QH, QL, KH, KL, q_head, kv_head, rows, dims, length, stride_ql,
                    ALIGN: tl.constexpr, EVEN_L: tl.constexpr, MASK_D: tl.constexpr, BLOCK_D: tl.constexpr,
                    HAS_GATE_K: tl.constexpr, GATE_CHUNK: tl.constexpr):
    """A program's operands: (q_ptr, k_ptr, v_ptr, kg_ptr, qh_ptr, ql_ptr, kh_ptr, kl_ptr, q, q_hi, q_lo). Q, QH, QL
    at the query head, K, V, KH, KL at the KV head; kg_ptr KG's KV head with HAS_GATE_K, else the keys'; q the query
    block's tile [block_q, Dp]; q_hi, q_lo its TF32 parts read from QH, QL when GATE_CHUNK = Dp (`_gate_logits`),
    else q."""
    q_ptr, k_ptr, v_ptr = Q + q_head, K + kv_head, V + kv_head
    kg_ptr = KG + kv_head if HAS_GATE_K else k_ptr
    qh_ptr, ql_ptr, kh_ptr, kl_ptr = QH + q_head, QL + q_head, KH + kv_head, KL + kv_head
    q = load_rows(q_ptr, rows, dims, length, stride_ql, ALIGN, EVEN_L, MASK_D)
    q_hi, q_lo = q, q
    if GATE_CHUNK == BLOCK_D:
        q_hi = load_rows(qh_ptr, rows, dims, length, stride_ql, ALIGN, EVEN_L, MASK_D)
        q_lo = load_rows(ql_ptr, rows, dims, length, stride_ql, ALIGN, EVEN_L, MASK_D)
    return q_ptr, k_ptr, v_ptr, kg_ptr, qh_ptr, ql_ptr, kh_ptr, kl_ptr, q, q_hi, q_lo


@triton.jit
def _scores_and_gates(q, k, q_hi, q_lo, kg_ptr, qh_ptr, ql_ptr, kh_ptr, kl_ptr, rows, cols, dims, mask, qk_scale,
                      length, stride_ql, stride_kl, ALIGN: tl.constexpr, EVEN_L: tl.constexpr, MASK_D: tl.constexpr,
                      BLOCK_D: tl.constexpr, HAS_GATE_K: tl.constexpr, GATE_CHUNK: tl.constexpr,
                      WHOLE_KG: tl.constexpr):
    """s = q·kᵀ and the gates g = σ(sm_scale·q·kgᵀ) (0 where masked), both [block_q, block_k] float32, and the gate
    keys' tile kg [block_k, Dp] (k without HAS_GATE_K; loaded whole only when a dot or WHOLE_KG needs it, else k).
    kg_ptr points at the kv head's rows of KG (of K without HAS_GATE_K), qh/ql/kh/kl_ptr at those of the TF32
    parts of q and kg, q_hi, q_lo: q's parts as `_gate_logits` takes them; qk_scale is sm_scale·log2(e)."""
    kg = k
    if HAS_GATE_K:
        if WHOLE_KG or GATE_CHUNK == 0:
            kg = load_rows(kg_ptr, cols, dims, length, stride_kl, ALIGN, EVEN_L, MASK_D)
        s = tl.dot(q, tl.trans(k))
        logits = _gate_logits(q, kg, q_hi, q_lo, qh_ptr, ql_ptr, kh_ptr, kl_ptr, rows, cols, dims, length, stride_ql,
                              stride_kl, ALIGN, EVEN_L, MASK_D, BLOCK_D, GATE_CHUNK)
    else:
        s = _gate_logits(q, k, q_hi, q_lo, qh_ptr, ql_ptr, kh_ptr, kl_ptr, rows, cols, dims, length, stride_ql,
                         stride_kl, ALIGN, EVEN_L, MASK_D, BLOCK_D, GATE_CHUNK)
        logits = s
    g = 1.0 / (1.0 + tl.exp2(-qk_scale * logits))
    if mask is not None:
        g = tl.where(mask, g, 0.0)
    return s, g, kg


@triton.jit
def _interpolation(z_rows, p, npos, FAST: tl.constexpr):
    """lo, hi (int32), w, z_lo, z_hi [block_q, block_k] for positions p in [0, P − 1] (z(p) = z_lo + w·(z_hi − z_lo)),
    gathered from the rows of z (pointers z_rows [block_q], every row a valid one). lo in [0, P − 2] and hi = lo + 1
    (P >= 2; p = P − 1 is lo = P − 2 at w = 1), so both come from one address (`gather_pair`)."""
    lo = tl.minimum(tl.maximum(tl.floor(p), 0.0), npos - 2.0)
    lo_index = lo.to(tl.int32)
    z_lo, z_hi = gather_pair(z_rows[:, None] + lo_index, FAST)
    return lo_index, lo_index + 1, p - lo, z_lo, z_hi


@triton.jit
def _gate_sums(g, init, tri):
    """init[:, None] + g·tri [block_q, block_k] float32 for gates g in [0, 1] and a 0/±1 float16 matrix tri
    [block_k, block_k] (a triangle: sums over later or earlier keys), as two float16 tensor-core dots: g = hi + lo
    in float16, 22 of g's 24 bits, the products exact and summed in float32."""
    hi = g.to(tl.float16)
    lo = (g - hi.to(tl.float32)).to(tl.float16)
    return tl.dot(hi, tri, tl.dot(lo, tri, tl.zeros(g.shape, tl.float32) + init[:, None]))


@triton.jit
def _running_sums(x, init, tri, FAST: tl.constexpr):
    """init[:, None] + x·tri [block_q, block_k] float32 for any float32 x and a 0/1 triangle tri. FAST (compiled for
    a GPU; tri bfloat16): three bfloat16 tensor-core dots, x = hi + mid + lo in bfloat16 (24 bits, float32's range).
    Else (Triton's interpreter, whose bfloat16 tiles are wrong; tri float32): one float32 dot."""
    acc = tl.zeros(x.shape, tl.float32) + init[:, None]
    if FAST:
        hi = x.to(tl.bfloat16)
        rest = x - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(hi, tri, tl.dot(mid, tri, tl.dot(lo, tri, acc)))
    else:
        acc = tl.dot(x, tri, acc, input_precision="ieee")
    return acc


@triton.jit
def _online_softmax(m, l, acc, s, mask, v, qk_scale):
    """One tile of the online softmax in base 2: (m, l, acc) updated with logits qk_scale·s where visible (mask
    None: everywhere)."""
    t = s * qk_scale
    if mask is not None:
        t = tl.where(mask, t, _MASK)
    m_new = tl.maximum(m, tl.max(t, 1))
    alpha = tl.exp2(m - m_new)
    probs = tl.exp2(t - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v)
    return m_new, l * alpha + tl.sum(probs, 1), acc


@triton.jit
def _cut_by_mask(unclamped, index, row0, BLOCK_K: tl.constexpr, MASK_ALL: tl.constexpr):
    """Whether the forward walks key block `index` next as a masked tile: it walks on (unclamped) and MASK_ALL or
    the block reaches past the query block's first row."""
    if MASK_ALL:
        cut = unclamped
    else:
        cut = unclamped & (index * BLOCK_K + BLOCK_K - 1 > row0)
    return cut


@triton.jit
def _positions_tile(q, q_hi, q_lo, m, l, acc, r, index, rows, dims, live, seg_rows, seg_ptr, later, z_rows, k_ptr,
                    v_ptr, q_ptr, kg_ptr, qh_ptr, ql_ptr, kh_ptr, kl_ptr, length, npos, clamp, qk_scale, stride_ql,
                    stride_kl, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, MASK_D: tl.constexpr,
                    EVEN_L: tl.constexpr, ALIGN: tl.constexpr, WINDOW: tl.constexpr, HAS_GATE_K: tl.constexpr,
                    HAS_SEGMENTS: tl.constexpr, GATE_CHUNK: tl.constexpr, FAST: tl.constexpr,
                    MASKED: tl.constexpr):
    """The forward's key block `index` with positions from its gates: (m, l, acc) of the online softmax and the
    gates' suffix sum r, updated. MASKED: keys masked by `_visible`; else every key of the tile is visible (a tile
    wholly below the diagonal, no window, no documents), and the two selects per logit go."""
    cols = index * BLOCK_K + tl.arange(0, BLOCK_K)
    if MASKED:
        mask = visible(rows, cols, seg_rows, seg_ptr, length, WINDOW, HAS_SEGMENTS, False, live)
    else:
        mask = None
    k = load_rows(k_ptr, cols, dims, length, stride_kl, ALIGN, EVEN_L, MASK_D)
    if BLOCK_D >= 256:  # q held across the walk as a dot operand (whole, in every warp) spills: re-read it
        q = load_rows(q_ptr, rows, dims, length, stride_ql, ALIGN, EVEN_L, MASK_D)
    s, g, _ = _scores_and_gates(q, k, q_hi, q_lo, kg_ptr, qh_ptr, ql_ptr, kh_ptr, kl_ptr, rows, cols, dims, mask,
                                qk_scale, length, stride_ql, stride_kl, ALIGN, EVEN_L, MASK_D, BLOCK_D, HAS_GATE_K,
                                GATE_CHUNK, False)
    total = tl.sum(g, 1)
    p = tl.minimum(_gate_sums(g, r, later), clamp)
    _, _, w, z_lo, z_hi = _interpolation(z_rows, p, npos, FAST)
    v = load_rows(v_ptr, cols, dims, length, stride_kl, ALIGN, EVEN_L, MASK_D)
    m, l, acc = _online_softmax(m, l, acc, s + z_lo + w * (z_hi - z_lo), mask, v, qk_scale)
    return m, l, acc, r + total


@triton.jit
def _forward_kernel(Q, K, V, KG, SEG, Z, QH, QL, KH, KL, sm_scale, length, npos,
                    stride_qb, stride_ql, stride_qh, stride_kb, stride_kl, stride_kh, stride_zb, stride_zh, stride_zl,
                    stride_sb, stride_sh, stride_segb,
                    O, LSE, R, E,
                    GROUPS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                    MASK_D: tl.constexpr, EVEN_L: tl.constexpr, ALIGN: tl.constexpr, WINDOW: tl.constexpr,
                    HAS_GATE_K: tl.constexpr, HAS_SEGMENTS: tl.constexpr, GATE_CHUNK: tl.constexpr,
                    FAST: tl.constexpr, MASK_ALL: tl.constexpr):
    """One query block of one (batch, query head). Q/O [B, L, Hq, D], K/V/KG [B, L, Hkv, D] (KG read only with
    HAS_GATE_K), SEG [B, L] int32 (read only with HAS_SEGMENTS), Z [B, Hq, L, P] float32; outputs LSE (lse₂), R
    float32 and E int32, each [B, Hq, L]. Constexprs: BLOCK_D = Dp; MASK_D = D when D < Dp (columns past it
    masked), else 0; EVEN_L: L a multiple of BLOCK_Q and BLOCK_K (no row masks); ALIGN a power of two dividing D
    (<= 16); WINDOW 0: none; GATE_CHUNK as `_gate_logits` takes it; MASK_ALL (a window or documents): every tile
    masked."""
    b, h, row0, rows, dims, live, q_head, kv_head = program_rows(length, stride_qb, stride_qh, stride_kb, stride_kh,
                                                                 GROUPS, BLOCK_Q, BLOCK_D, ALIGN)
    q_ptr, k_ptr, v_ptr, kg_ptr, qh_ptr, ql_ptr, kh_ptr, kl_ptr, q, q_hi, q_lo = _query_operands(
        Q, K, V, KG, QH, QL, KH, KL, q_head, kv_head, rows, dims, length, stride_ql, ALIGN, EVEN_L, MASK_D, BLOCK_D,
        HAS_GATE_K, GATE_CHUNK)
    z_rows = Z + b * stride_zb + h * stride_zh + tl.minimum(rows, length - 1) * stride_zl  # rows past L read L − 1's
    seg_ptr, seg_rows = document_rows(SEG, b, stride_segb, rows, live, HAS_SEGMENTS)
    sm_scale = tl.cast(sm_scale, tl.float32)  # jax-triton passes Python floats as float64
    qk_scale = sm_scale * _LOG2E
    clamp = npos - 1.0

    m = tl.full([BLOCK_Q], _MASK, tl.float32)
    l = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    r = tl.zeros([BLOCK_Q], tl.float32)
    keys = tl.arange(0, BLOCK_K)
    later = (keys[:, None] >= keys[None, :]).to(tl.float16)  # [j', j]: key j' counts into key j's position
    first = first_key_block(row0, WINDOW, BLOCK_K)
    index = tl.minimum(tl.cdiv(row0 + BLOCK_Q, BLOCK_K), tl.cdiv(length, BLOCK_K)) - 1
    unclamped = index >= first
    # Full tiles, from the diagonal back: those the causal mask cuts (or all, with a window or documents) masked,
    # then, wholly below the diagonal, the same tile without a mask (every key visible; rows past L are never stored).
    while _cut_by_mask(unclamped, index, row0, BLOCK_K, MASK_ALL):
        m, l, acc, r = _positions_tile(q, q_hi, q_lo, m, l, acc, r, index, rows, dims, live, seg_rows, seg_ptr, later,
                                       z_rows, k_ptr, v_ptr, q_ptr, kg_ptr, qh_ptr, ql_ptr, kh_ptr, kl_ptr, length,
                                       npos, clamp, qk_scale, stride_ql, stride_kl, BLOCK_K, BLOCK_D, MASK_D, EVEN_L,
                                       ALIGN, WINDOW, HAS_GATE_K, HAS_SEGMENTS, GATE_CHUNK, FAST, True)
        index -= 1
        unclamped = (index >= first) & (tl.min(tl.where(live, r, clamp)) < clamp)
    if not MASK_ALL:
        while unclamped:
            m, l, acc, r = _positions_tile(q, q_hi, q_lo, m, l, acc, r, index, rows, dims, live, seg_rows, seg_ptr,
                                           later, z_rows, k_ptr, v_ptr, q_ptr, kg_ptr, qh_ptr, ql_ptr, kh_ptr, kl_ptr,
                                           length, npos, clamp, qk_scale, stride_ql, stride_kl, BLOCK_K, BLOCK_D,
                                           MASK_D, EVEN_L, ALIGN, WINDOW, HAS_GATE_K, HAS_SEGMENTS, GATE_CHUNK, FAST,
                                           False)
            index -= 1
            unclamped = (index >= first) & (tl.min(tl.where(live, r, clamp)) < clamp)
    z_last = tl.load(z_rows + (npos - 1), mask=live, other=0.0)
    for clamped in range(first, index + 1):  # every row's position is P − 1: no gates
        cols = clamped * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = visible(rows, cols, seg_rows, seg_ptr, length, WINDOW, HAS_SEGMENTS, False, live)
        k = load_rows(k_ptr, cols, dims, length, stride_kl, ALIGN, EVEN_L, MASK_D)
        v = load_rows(v_ptr, cols, dims, length, stride_kl, ALIGN, EVEN_L, MASK_D)
        m, l, acc = _online_softmax(m, l, acc, tl.dot(q, tl.trans(k)) + z_last[:, None], mask, v, qk_scale)

    out = (acc / l[:, None]).to(O.dtype.element_ty)
    store_rows(O + q_head, rows, dims, out, length, stride_ql, ALIGN, EVEN_L, MASK_D)
    stat = b * stride_sb + h * stride_sh + rows
    tl.store(LSE + stat, m + tl.log2(l), mask=live)
    tl.store(R + stat, r, mask=live)
    tl.store(E + stat, tl.full([BLOCK_Q], 0, tl.int32) + (index + 1) * BLOCK_K, mask=live)


@triton.jit
def _backward_kernel(Q, K, V, KG, SEG, Z, QH, QL, KH, KL, DO, LSE, DELTA, R, E, sm_scale, length, npos,
                     stride_qb, stride_ql, stride_qh, stride_kb, stride_kl, stride_kh, stride_zb, stride_zh,
                     stride_zl, stride_sb, stride_sh, stride_segb,
                     DQ, DZ, DK, DV, DKG,
                     GROUPS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                     MASK_D: tl.constexpr, EVEN_L: tl.constexpr, ALIGN: tl.constexpr, WINDOW: tl.constexpr,
                     HAS_GATE_K: tl.constexpr, HAS_SEGMENTS: tl.constexpr, GATE_CHUNK: tl.constexpr,
                     FAST: tl.constexpr, SCATTER_IN_PLACE: tl.constexpr):
    """One query block of one (batch, query head): key blocks forward from the first visible one to the diagonal,
    clamped tiles first. Inputs as the forward's, plus DO [B, L, Hq, D] and LSE (lse₂), DELTA = rowsum(o·do), R, E
    [B, Hq, L]; outputs float32 DQ [B, L, Hq, D] (stored), DZ [B, Hq, L, P], DK, DV, DKG [B, L, Hkv, D] (atomic adds
    into zeros; DKG written only with HAS_GATE_K)."""
    b, h, row0, rows, dims, live, q_head, kv_head = program_rows(length, stride_qb, stride_qh, stride_kb, stride_kh,
                                                                 GROUPS, BLOCK_Q, BLOCK_D, ALIGN)
    q_ptr, k_ptr, v_ptr, kg_ptr, qh_ptr, ql_ptr, kh_ptr, kl_ptr, q, q_hi, q_lo = _query_operands(
        Q, K, V, KG, QH, QL, KH, KL, q_head, kv_head, rows, dims, length, stride_ql, ALIGN, EVEN_L, MASK_D, BLOCK_D,
        HAS_GATE_K, GATE_CHUNK)
    do = load_rows(DO + q_head, rows, dims, length, stride_ql, ALIGN, EVEN_L, MASK_D)
    z_head = b * stride_zb + h * stride_zh
    z_rows = Z + z_head + tl.minimum(rows, length - 1) * stride_zl  # rows past L read L − 1's
    dz_rows = DZ + z_head + rows * stride_zl
    stat = b * stride_sb + h * stride_sh + rows
    lse = tl.load(LSE + stat, mask=live, other=0.0)
    delta = tl.load(DELTA + stat, mask=live, other=0.0)
    r = tl.load(R + stat, mask=live, other=0.0)
    e = tl.load(E + stat, mask=live, other=length)
    seg_ptr, seg_rows = document_rows(SEG, b, stride_segb, rows, live, HAS_SEGMENTS)
    sm_scale = tl.cast(sm_scale, tl.float32)  # jax-triton passes Python floats as float64
    qk_scale = sm_scale * _LOG2E
    clamp = npos - 1.0

    dq = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    dz_last = tl.zeros([BLOCK_Q], tl.float32)
    c = tl.zeros([BLOCK_Q], tl.float32)  # the gates of keys >= e in the blocks walked
    dp_before = tl.zeros([BLOCK_Q], tl.float32)  # Σ ∂L/∂p over the keys walked
    keys = tl.arange(0, BLOCK_K)
    before = -(keys[:, None] < keys[None, :]).to(tl.float16)  # [j', j]: key j' < j, negated
    through = (keys[:, None] <= keys[None, :]).to(tl.bfloat16 if FAST else tl.float32)  # [j', j]: key j' <= j
    first = first_key_block(row0, WINDOW, BLOCK_K)
    num_blocks = tl.minimum(tl.cdiv(row0 + BLOCK_Q, BLOCK_K), tl.cdiv(length, BLOCK_K))
    clamped_end = tl.minimum(tl.maximum(first, tl.min(e) // BLOCK_K), num_blocks)
    z_last = tl.load(z_rows + (npos - 1), mask=live, other=0.0)
    for index in range(first, clamped_end):  # clamped tiles: every position is P − 1
        cols = index * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = visible(rows, cols, seg_rows, seg_ptr, length, WINDOW, HAS_SEGMENTS, not EVEN_L, live)
        k = load_rows(k_ptr, cols, dims, length, stride_kl, ALIGN, EVEN_L, MASK_D)
        v = load_rows(v_ptr, cols, dims, length, stride_kl, ALIGN, EVEN_L, MASK_D)
        t = tl.where(mask, (tl.dot(q, tl.trans(k)) + z_last[:, None]) * qk_scale, _MASK)
        probs = tl.exp2(t - lse[:, None])
        ds = sm_scale * probs * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dz_last += tl.sum(ds, 1)
        dq += tl.dot(ds.to(k.dtype), k)
        add_rows(DK + kv_head, cols, dims, tl.dot(tl.trans(ds.to(q.dtype)), q), length, stride_kl, ALIGN, EVEN_L,
                  MASK_D)
        add_rows(DV + kv_head, cols, dims, tl.dot(tl.trans(probs.to(do.dtype)), do), length, stride_kl, ALIGN,
                  EVEN_L, MASK_D)
    for index in range(clamped_end, num_blocks):  # positions rebuilt from the saved R
        cols = index * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = visible(rows, cols, seg_rows, seg_ptr, length, WINDOW, HAS_SEGMENTS, not EVEN_L, live)
        k = load_rows(k_ptr, cols, dims, length, stride_kl, ALIGN, EVEN_L, MASK_D)
        v = load_rows(v_ptr, cols, dims, length, stride_kl, ALIGN, EVEN_L, MASK_D)
        s, g, kg = _scores_and_gates(q, k, q_hi, q_lo, kg_ptr, qh_ptr, ql_ptr, kh_ptr, kl_ptr, rows, cols, dims, mask,
                                     qk_scale, length, stride_ql, stride_kl, ALIGN, EVEN_L, MASK_D, BLOCK_D, HAS_GATE_K,
                                     GATE_CHUNK, True)
        walked = cols[None, :] >= e[:, None]  # keys whose gates the forward counted into R
        g = tl.where(walked, g, 0.0)
        p = tl.minimum(tl.maximum(_gate_sums(g, r - c, before), 0.0), clamp)
        p = tl.where(walked, p, clamp)
        lo, hi, w, z_lo, z_hi = _interpolation(z_rows, p, npos, FAST)
        t = tl.where(mask, (s + z_lo + w * (z_hi - z_lo)) * qk_scale, _MASK)
        probs = tl.exp2(t - lse[:, None])
        ds = sm_scale * probs * (tl.dot(do, tl.trans(v)) - delta[:, None])
        scatter_add(dz_rows[:, None] + lo, ds - ds * w, mask, SCATTER_IN_PLACE)
        scatter_add(dz_rows[:, None] + hi, ds * w, mask & (w != 0.0), SCATTER_IN_PLACE)
        dp = tl.where(p < clamp, ds * (z_hi - z_lo), 0.0)
        dgate = sm_scale * _running_sums(dp, dp_before, through, FAST) * (g - g * g)
        c += tl.sum(g, 1)
        dp_before += tl.sum(dp, 1)
        if HAS_GATE_K:
            dscore = ds
            dq += tl.dot(dgate.to(kg.dtype), kg)
            add_rows(DKG + kv_head, cols, dims, tl.dot(tl.trans(dgate.to(q.dtype)), q), length, stride_kl, ALIGN,
                      EVEN_L, MASK_D)
        else:
            dscore = ds + dgate
        dq += tl.dot(dscore.to(k.dtype), k)
        add_rows(DK + kv_head, cols, dims, tl.dot(tl.trans(dscore.to(q.dtype)), q), length, stride_kl, ALIGN,
                  EVEN_L, MASK_D)
        add_rows(DV + kv_head, cols, dims, tl.dot(tl.trans(probs.to(do.dtype)), do), length, stride_kl, ALIGN,
                  EVEN_L, MASK_D)

    store_rows(DQ + q_head, rows, dims, dq, length, stride_ql, ALIGN, EVEN_L, MASK_D)
    tl.atomic_add(dz_rows + (npos - 1), dz_last, mask=live, sem="relaxed")


# --- launches ------------------------------------------------------------------------------------------------------


def _tf32_parts(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(hi, lo) of float32 x, both exact in TF32 (10 stored mantissa bits), hi = x rounded to nearest and lo = x − hi
    rounded to nearest: hi·b + lo·b carries x·b to about 2⁻²² (3xTF32; Ootomo & Yokota, arXiv:2203.03341). Non-finite
    x (and |x| too near float32's largest to round up) keep hi = x, lo = 0."""

    def rounded(y: jax.Array) -> jax.Array:
        bits = jax.lax.bitcast_convert_type(y, jnp.uint32)
        return jax.lax.bitcast_convert_type((bits + 0x1000) & jnp.uint32(0xFFFFE000), jnp.float32)

    hi = rounded(x)
    hi = jnp.where(jnp.isfinite(hi), hi, x)
    rest = jnp.where(jnp.isfinite(x), x - hi, 0.0)
    return hi, rounded(rest)


def _gate_parts(q: jax.Array, k: jax.Array, kg: jax.Array | None) -> list[jax.Array]:
    """The TF32 parts of q and of the gate keys (kg, else k) [q_hi, q_lo, k_hi, k_lo] for float32 inputs, whose gate
    logits are float32-accurate; else q, q, k, k (unread)."""
    if q.dtype != jnp.float32:
        return [q, q, k, k]
    return [*_tf32_parts(q), *_tf32_parts(k if kg is None else kg)]


def _common_args(config: _Config, q, k, kg, z, seg) -> tuple[list, dict]:
    """The scalar arguments shared by both kernels (sm_scale, L, P, strides) and their constexprs."""
    length, num_heads, dim = q.shape[1], q.shape[2], q.shape[3]
    sq, sk, sz = strides(q), strides(k), strides(z)
    stat = (num_heads * length, length)  # per-row values [B, Hq, L]
    scalars = [config.sm_scale, length, config.npos, *sq[:3], *sk[:3], *sz[:3], *stat, length]
    block_d = tile_extent(dim)
    constexprs = dict(GROUPS=q.shape[2] // k.shape[2], BLOCK_D=block_d, MASK_D=dim if dim < block_d else 0,
                      ALIGN=min(dim & -dim, 16),
                      WINDOW=config.window or 0, HAS_GATE_K=kg is not None, HAS_SEGMENTS=seg is not None,
                      GATE_CHUNK=(block_d if block_d <= 64 else _ACCURATE_CHUNK) if q.dtype == jnp.float32 else 0,
                      FAST=not interpreted())
    return scalars, constexprs


def _forward_call(config: _Config, q, k, v, kg, z, seg) -> list[jax.Array]:
    """o [B, L, Hq, D] and lse₂, R (float32), e (int32), each [B, Hq, L]; kg and seg may be None."""
    batch, length, num_heads, _ = q.shape
    block_q, block_k = config.blocks.block_q, config.blocks.block_k
    scalars, constexprs = _common_args(config, q, k, kg, z, seg)
    stat = output_struct((batch, num_heads, length), jnp.float32, q)
    out_shapes = [output_struct(q.shape, q.dtype, q), stat, stat, output_struct(stat.shape, jnp.int32, q)]
    return launch(_forward_kernel, [q, k, v, q if kg is None else kg, q if seg is None else seg, z,
                                    *_gate_parts(q, k, kg), *scalars],
                  out_shapes=out_shapes, grid=(triton.cdiv(length, block_q), batch, num_heads),
                  num_warps=config.num_warps, num_stages=config.num_stages or 2, name="cope_triton_forward",
                  BLOCK_Q=block_q, BLOCK_K=block_k, EVEN_L=length % block_q == 0 and length % block_k == 0,
                  MASK_ALL=seg is not None or bool(config.window), **constexprs)


def _backward_call(config: _Config, q, k, v, kg, z, seg, do, lse, delta, r, e) -> list[jax.Array]:
    """dq [B, L, Hq, D], dz [B, Hq, L, P], dk, dv, dkg [B, L, Hkv, D] (dkg [1] without kg), all float32."""
    batch, length, num_heads, _ = q.shape
    block_q, block_k = config.blocks.block_q_bwd, config.blocks.block_k_bwd
    scalars, constexprs = _common_args(config, q, k, kg, z, seg)
    kv = output_struct(k.shape, jnp.float32, q)
    out_shapes = [output_struct(q.shape, jnp.float32, q), output_struct(z.shape, jnp.float32, q), kv, kv,
                  kv if kg is not None else output_struct((1,), jnp.float32, q)]
    return launch(_backward_kernel, [q, k, v, q if kg is None else kg, q if seg is None else seg, z,
                                     *_gate_parts(q, k, kg), do, lse, delta, r, e, *scalars],
                  out_shapes=out_shapes, grid=(triton.cdiv(length, block_q), batch, num_heads),
                  num_warps=config.num_warps_bwd, num_stages=config.num_stages or 1, name="cope_triton_backward",
                  zeroed=(1, 2, 3, 4) if kg is not None else (1, 2, 3), BLOCK_Q=block_q, BLOCK_K=block_k,
                  EVEN_L=length % block_q == 0 and length % block_k == 0,
                  SCATTER_IN_PLACE=scatter_in_place(block_q, config.num_warps_bwd), **constexprs)


def _position_logits(q: jax.Array, pos_emb: jax.Array) -> jax.Array:
    """z [B, Hq, L, P] float32 = q·e for a shared [P, D] or per-head [Hq, P, D] table."""
    spec = "btnd,pd->bntp" if pos_emb.ndim == 2 else "btnd,npd->bntp"
    return jnp.einsum(spec, q, pos_emb.astype(q.dtype), preferred_element_type=jnp.float32)


def _cope_triton_fwd(q, k, v, gate_k, pos_emb, segment_ids, config: _Config):
    z = _position_logits(q, pos_emb)
    out, lse, r, e = first_order_only("triton", functools.partial(_forward_call, config), q, k, v, gate_k, z,
                                      segment_ids)
    return out, (q, k, v, gate_k, pos_emb, segment_ids, out, lse, r, e)


def _cope_triton_bwd(config: _Config, residuals, dout):
    q, k, v, gate_k, pos_emb, segment_ids, out, lse, r, e = residuals
    z = _position_logits(q, pos_emb)
    delta = jnp.einsum("btnd,btnd->bnt", out.astype(jnp.float32), dout.astype(jnp.float32))
    dq, dz, dk, dv, dkg = first_order_only("triton", functools.partial(_backward_call, config), q, k, v, gate_k, z,
                                            segment_ids, dout.astype(q.dtype), lse, delta, r, e)
    table = pos_emb.astype(q.dtype).astype(jnp.float32)
    if pos_emb.ndim == 2:
        dq = dq + jnp.einsum("bntp,pd->btnd", dz, table)
        de = jnp.einsum("bntp,btnd->pd", dz, q.astype(jnp.float32))
    else:
        dq = dq + jnp.einsum("bntp,npd->btnd", dz, table)
        de = jnp.einsum("bntp,btnd->npd", dz, q.astype(jnp.float32))
    dgate_k = None if gate_k is None else dkg.astype(gate_k.dtype)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dgate_k, de.astype(pos_emb.dtype), None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _cope_triton(q: jax.Array, k: jax.Array, v: jax.Array, gate_k: jax.Array | None, pos_emb: jax.Array,
                 segment_ids: jax.Array | None, config: _Config) -> jax.Array:
    return _forward_call(config, q, k, v, gate_k, _position_logits(q, pos_emb), segment_ids)[0]


_cope_triton.defvjp(_cope_triton_fwd, _cope_triton_bwd)
_cope_triton_jit = jax.jit(_cope_triton, static_argnums=(6,))


def cope_attention_triton(q: jax.Array, k: jax.Array, v: jax.Array, pos_emb: jax.Array,
                          gate_k: jax.Array | None = None, *, sm_scale: float | jax.Array | None,
                          block_sizes: BlockSizes | None = None, num_warps: int | None = None,
                          num_stages: int | None = None, segment_ids: jax.Array | None = None,
                          window: int | None = None) -> jax.Array:
    """Causal CoPE attention, native Triton kernels with a fused backward (custom VJP).

    q [B, L, Hq, D], k/v [B, L, Hkv, D] (Hkv divides Hq), pos_emb [P, D] or [Hq, P, D], gate_k [B, L, Hkv, D] or None
    (gates from k) -> [B, L, Hq, D] in q's dtype (float32, bfloat16 or float16; D <= 256).
    block_sizes: `cope_pallas.BlockSizes`, None fields (or None) taking `default_blocks` for D, dtype and gate_k;
    num_warps/num_stages tune Triton's compilation of both kernels (defaults: `default_num_warps`; 2 stages in the
    forward, 1 in the backward). Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 set
    before triton is imported).
    segment_ids [B, L] int: packed documents (a key is visible only from queries with the same id; positions
    restart at each document); window: each query sees itself and the window − 1 keys before it (key blocks
    outside are skipped).
    sm_scale: None (D^−½), a number > 0 or a traced scalar, which then multiplies q before the kernels (in q's dtype).
    Differentiable once (jax.grad, not jax.grad of jax.grad nor jax.jvp); static shapes only.
    """
    opened = open_cope_fused(q, k, v, pos_emb, gate_k, impl="triton", sm_scale=sm_scale, block_sizes=block_sizes,
                             num_warps=num_warps, num_stages=num_stages, segment_ids=segment_ids, window=window)
    if opened is None:
        return jnp.zeros(q.shape, q.dtype)
    q, sm_scale, segment_ids, window = opened
    num_warps_bwd = num_warps or default_num_warps(q.shape[3], q.dtype, backward=True)
    defaults = default_blocks(q.shape[3], q.dtype, gate_k=gate_k is not None, num_warps_bwd=num_warps_bwd)
    blocks = BlockSizes(**filled(block_sizes or BlockSizes(), defaults)).fitted(
        length=q.shape[1], head_dim=q.shape[3], dtype=q.dtype, gate_k=gate_k is not None)
    config = _Config(sm_scale=sm_scale, npos=pos_emb.shape[-2], blocks=blocks,
                     num_warps=num_warps or default_num_warps(q.shape[3], q.dtype, backward=False),
                     num_warps_bwd=num_warps_bwd, num_stages=num_stages, window=window)
    return _cope_triton_jit(q, k, v, gate_k, pos_emb, segment_ids, config)
