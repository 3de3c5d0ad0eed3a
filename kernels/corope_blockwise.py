"""Co-RoPE attention, blockwise in pure JAX: causal or bidirectional, GQA, packed documents, sliding windows,
caller-given rotary frequencies, forward and fused backward, any backend and any floating dtype.

Letters (as in jaxpe/): B batch, L length (Lp padded), Hq query heads, Hkv key/value heads, G = Hq / Hkv group
size, D head dim, Dh = D/2 rotary pairs, BK block size (queries and keys). Einsum subscripts: b batch, k kv head
(Hkv), g head of its group (G), t query and s key positions, d head dim. Internally heads
are grouped: q [B, Hkv, G, Lp, D], k/v [B, Hkv, Lp, D]; head 0 of a group is its leader.

The maths (as jaxpe/corope.py states it): z_ij = sigmoid(sm_scale·q^leader_i·k_j), mileage a_ij = Σ_{t≤j} z_it,
Δ_ij = a_ii − a_ij, φ_ijd = Δ_ij·ω_d, score_ij = sm_scale·Σ_d (E_A cos φ − E_B sin φ) = sm_scale·Σ_d q1 (k1 cos φ + k2 sin φ)
+ q2 (k2 cos φ − k1 sin φ). Causal: Δ_ij = Σ_{t=j+1..i} z_it for the keys j ≤ i. Bidirectional (causal=False): every
visible key counts, and Δ is signed: Σ_{t=j+1..i} z_it for j ≤ i, −Σ_{t=i+1..j} z_it for j > i; with constant gates
it is bidirectional RoPE with scaled frequencies. The scores take q already multiplied by sm_scale (in the compute
dtype), so sm_scale appears nowhere else: it is an operand (traceable, a learned temperature) and its gradient is
Σ dq'·q.

Tiles are frequency-major: a scan over the Dh frequencies computes one [BK, BK] plane of sin/cos per step with
`sincos` (a polynomial, vectorised by XLA; jnp.sin/cos are ~20× slower on CPU), shared by the G heads of a group, and
accumulates the scores. The backward computes a tile's sin/cos in its score pass and again in its gradient pass
(there in both orientations of the tile, see `_score_grads`): on CPU storing them [Dh, BK, BK] between the passes, or
transposing them, costs more memory traffic than the polynomial (measured).

Visibility (one definition in every implementation): key j is visible to query i iff j ≤ i (causal; any j when
bidirectional), segment_ids[b, i] == segment_ids[b, j] (packed documents, padding as an id of its own; documents need
not be contiguous) and |i − j| < window. Gates of invisible keys are 0, so Δ counts only keys of the same document
inside the window. ω_d = θ^(−2d/D) unless the caller passes `inv_freq` (scaled RoPE frequencies; zeros for pairs that
do not rotate, partial rotary).

The walk: one loop over the visited (query block, key block) pairs, query blocks in order, each from its diagonal key
block down to the first that reaches into the window of the block's first row (causal early exit; O(L·window) work
with a window), carrying the running suffix sum of z per row; documents are masked per tile. With a static length
its trip count is static (a scan), so the custom VJP's own rules are reverse-differentiable (second order); with a
symbolic length (jax.export) it is a while loop over the query blocks. Memory per step is O(B·Hq·BK²); nothing of
size L×L is ever built, forward or backward.

Backward, the same walk: with dS the softmax gradient of the scores,
dΔ_ij = Σ_d ω_d·Σ_h dS^h_ij (cos φ (q1^h k2 − q2^h k1) − sin φ (q1^h k1 + q2^h k2)) (q scaled), and the gate
gradient dz_it = Σ_{j<t} dΔ_ij = Tot_i − Suf_it, with Suf_it = Σ_{j≥t} dΔ_ij (carried) and Tot_i the row total,
known after the row's walk (a strict walk: dz_it = Σ_{j≤t} dΔ_ij, Suf_it = Σ_{j>t} dΔ_ij). The −Suf part is
applied during the walk; the Tot part by a second, cheap walk (gates only, no trig). The row log-sum-exps are a
differentiable output: their cotangent dlse only shifts the softmax's row term, Σ_j P dP − dlse.

Bidirectional attention from two causal walks: the keys j ≤ i are the causal walk; the keys j > i are a strict walk
(key j visible iff j < i, Δ_ij = Σ_{t=j..i−1} z_it) over the time-reversed sequence with the second halves of q and k
negated: reversing turns −Σ_{t=i+1..j} z_it into that strict sum, and the negation flips the sign of E_B (so of sin φ)
while leaving E_A and the gate logits q·k unchanged. The two halves partition the keys, so their outputs combine
through their log-sum-exps with no cancellation.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpe.base import (GATE_PRECISION, check_corope_inputs, check_positive_int, compute_dtype, open_attention,
                        rotary_frequencies, scale_or_default)
from jaxpe.kernels._common import MASK_VALUE, carry_init, sincos, vary_alike


def check_inv_freq(inv_freq: jax.Array | None, head_dim: int) -> None:
    """Caller-given rotary frequencies: None, or a floating array [D/2] (finite, checked where it is concrete)."""
    if inv_freq is None:
        return
    dtype = jnp.asarray(inv_freq).dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"inv_freq must be a floating-point array [D/2], got inv_freq.dtype={dtype}")
    shape = tuple(jnp.shape(inv_freq))
    if shape != (head_dim // 2,):
        raise ValueError(f"inv_freq must have shape [D/2={head_dim // 2}], got inv_freq.shape={shape}")
    try:
        values = np.asarray(inv_freq, np.float32)
    except jax.errors.TracerArrayConversionError:  # traced (under jit): only its shape and dtype can be checked
        return
    if not np.all(np.isfinite(values)):
        raise ValueError(f"inv_freq must be finite, got inv_freq={values.tolist()}")


def caller_frequencies(inv_freq: jax.Array | None, dtype: jnp.dtype = jnp.float32) -> jax.Array | None:
    """The caller's ω in `dtype` with no gradient (None stays None: the kernels then use θ^(−2d/D))."""
    return None if inv_freq is None else lax.stop_gradient(jnp.asarray(inv_freq, dtype))


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static settings of one walk (hashable: the jit static argument and the custom_vjp's non-differentiable one)."""

    theta: float  # ω_d = θ^(−2d/D) unless the caller gives ω
    block: int  # BK, query rows and keys per block (at most L)
    window: int | None  # keys with i − j < window are visible; None: the whole prefix
    strict: bool = False  # keys j < i only and Δ_ij = Σ_{t=j..i−1} z_it (the reversed half of bidirectional attention)

    @property
    def lookback(self) -> int | None:
        """Key blocks a query block walks below its diagonal block (None: down to block 0)."""
        return None if self.window is None else -(-(self.window - 1) // self.block)


def _first_key_block(qb: jax.Array, config: _Config) -> jax.Array:
    """The last key block (the lowest) the walk of query block qb visits: the one holding key qb·BK − window + 1."""
    return jnp.zeros_like(qb) if config.lookback is None else jnp.maximum(qb - config.lookback, 0)


def _pair_count(num_blocks: int, config: _Config) -> int:
    """How many (query block, key block) pairs the walk visits at a static length."""
    return sum(qb + 1 if config.lookback is None else min(qb, config.lookback) + 1 for qb in range(num_blocks))


def _walk(visit: Callable[[jax.Array, jax.Array, Any], Any], init: Any, num_blocks: int, config: _Config) -> Any:
    """Carry `init` through visit(qb, kb, carry) over the visited pairs: query blocks qb in order, each from its
    diagonal key block kb = qb down to `_first_key_block`. A static trip count (a scan: reverse-differentiable) when
    num_blocks is an int, a while loop over the query blocks when it is symbolic (jax.export)."""
    def step(carry):
        qb, kb, inner = carry
        inner = visit(qb, kb, inner)
        row_done = kb == _first_key_block(qb, config)
        return jnp.where(row_done, qb + 1, qb), jnp.where(row_done, qb + 1, kb - 1), inner

    start = (jnp.int32(0), jnp.int32(0), init)
    if isinstance(num_blocks, int):
        return lax.fori_loop(0, _pair_count(num_blocks, config), lambda _, carry: step(carry), start)[2]
    return lax.while_loop(lambda carry: carry[0] < num_blocks, step, start)[2]


def _tile_mask(qb: jax.Array, kb: jax.Array, seg: jax.Array | None, config: _Config) -> jax.Array:
    """Mask [B|1, 1, BK, BK] of query block qb against key block kb: j ≤ i (j < i when strict), inside the window,
    same document (seg [B, Lp] or None)."""
    block = config.block
    rows = qb * block + jnp.arange(block, dtype=jnp.int32)
    cols = kb * block + jnp.arange(block, dtype=jnp.int32)
    mask = cols[None, :] < rows[:, None] if config.strict else cols[None, :] <= rows[:, None]
    if config.window is not None:
        mask = mask & (rows[:, None] - cols[None, :] < config.window)
    mask = mask[None, None]
    if seg is not None:
        seg_rows, seg_cols = _block(seg, qb, block, 1), _block(seg, kb, block, 1)  # [B, BK]
        mask = mask & (seg_rows[:, :, None] == seg_cols[:, None, :])[:, None]
    return mask


def _gates(q_lead: jax.Array, k: jax.Array, mask: jax.Array) -> jax.Array:
    """Gates of the scaled leader rows q_lead [B, Hkv, BK, D] and keys k [B, Hkv, BK, D] -> z [B, Hkv, BK, BK], 0 where
    `mask` [B|1, 1, BK, BK] is False."""
    logits = jnp.einsum("bktd,bksd->bkts", q_lead, k, precision=GATE_PRECISION)
    return jnp.where(mask, jax.nn.sigmoid(logits), 0.0)


def _mileage(z_suffix: jax.Array, z: jax.Array, config: _Config) -> jax.Array:
    """Δ [B, Hkv, BK, BK] of a tile from its gates z and z_suffix [B, Hkv, BK], the rows' sums of the gates of the key
    blocks walked before (right of this one): Σ_{t>j} z_it, or Σ_{t≥j} z_it when strict."""
    inclusive = z_suffix[..., None] + lax.cumsum(z, axis=3, reverse=True)
    return inclusive if config.strict else inclusive - z


def _by_frequency(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> its halves x1, x2 with the frequency first: [Dh, ...] with a size-1 axis inserted at `axis` of
    the rest (so that query rows [.., BK(t), 1] and keys [.., 1, BK(s)] broadcast into a [.., BK, BK] tile)."""
    x = jnp.expand_dims(jnp.moveaxis(x, -1, 0), axis)
    return jnp.split(x, 2, axis=0)


def _scores(q: jax.Array, k: jax.Array, delta: jax.Array, omega: jax.Array) -> jax.Array:
    """Scaled q [B, Hkv, G, BK, D], k [B, Hkv, BK, D], delta [B, Hkv, BK, BK] -> scores [B, Hkv, G, BK(t), BK(s)]
    = Σ_d q1 (k1 cos φ + k2 sin φ) + q2 (k2 cos φ − k1 sin φ): a scan over the frequencies, one [BK, BK] plane of
    sincos per step (shared by the G heads of a group) folded into the scores by one elementwise fusion."""
    q1, q2 = _by_frequency(q, -1)  # [Dh, B, Hkv, G, BK, 1]
    k1, k2 = _by_frequency(k[:, :, None], -2)  # [Dh, B, Hkv, 1, 1, BK]

    def one_frequency(acc, xs):
        w, a1, a2, b1, b2 = xs
        sin, cos = sincos(delta * w)  # [B, Hkv, BK, BK]
        sin_g, cos_g = sin[:, :, None], cos[:, :, None]
        return acc + a1 * (b1 * cos_g + b2 * sin_g) + a2 * (b2 * cos_g - b1 * sin_g), None

    init = carry_init(0.0, q.shape[:-1] + (k.shape[2],), q.dtype, q, k)
    return lax.scan(one_frequency, init, (omega, q1, q2, k1, k2))[0]


def _score_grads(q: jax.Array, k: jax.Array, delta: jax.Array, omega: jax.Array, ds: jax.Array
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The score's cotangent ds [B, Hkv, G, BK, BK] -> dq (scaled q) [B, Hkv, G, BK, D], dk [B, Hkv, BK, D],
    dΔ [B, Hkv, BK, BK].

    With X = ds·cos φ, Y = ds·sin φ: dq1 = Σ_s X k1 + Y k2, dq2 = Σ_s X k2 − Y k1, dk1 = Σ_gt X q1 − Y q2,
    dk2 = Σ_gt Y q1 + X q2, dΔ = Σ_d ω_d Σ_g X (q1 k2 − q2 k1) − Y (q1 k1 + q2 k2).
    A scan over the frequencies again. The contractions are einsums (XLA CPU runs them as dots, faster than its
    reductions of the same products); dk's contract t on a transposed tile with its own sincos (cheaper than the
    transposing copies XLA would make of X and Y at every frequency). Storing the score pass's sin/cos [Dh, BK, BK]
    instead of computing them again was slower on CPU (memory traffic costs more than the polynomial)."""
    q1, q2 = _by_frequency(q, -1)  # [Dh, B, Hkv, G, BK, 1]
    k1, k2 = _by_frequency(k[:, :, None], -2)  # [Dh, B, Hkv, 1, 1, BK]
    delta_t, ds_t = jnp.swapaxes(delta, -1, -2), jnp.swapaxes(ds, -1, -2)  # [B, Hkv, BK(s), BK(t)], [.., G, s, t]

    def one_frequency(d_delta, xs):
        w, a1, a2, b1, b2 = xs
        sin, cos = sincos(delta * w)  # [B, Hkv, BK(t), BK(s)]
        x, y = ds * cos[:, :, None], ds * sin[:, :, None]  # [B, Hkv, G, BK(t), BK(s)]
        sin_t, cos_t = sincos(delta_t * w)  # [B, Hkv, BK(s), BK(t)]
        x_t, y_t = ds_t * cos_t[:, :, None], ds_t * sin_t[:, :, None]
        b1, b2, a1, a2 = b1[:, :, 0, 0], b2[:, :, 0, 0], a1[..., 0], a2[..., 0]  # [B, Hkv, BK(s)], [B, Hkv, G, BK(t)]
        dq1 = jnp.einsum("bkgts,bks->bkgt", x, b1) + jnp.einsum("bkgts,bks->bkgt", y, b2)
        dq2 = jnp.einsum("bkgts,bks->bkgt", x, b2) - jnp.einsum("bkgts,bks->bkgt", y, b1)
        dk1 = jnp.einsum("bkgst,bkgt->bks", x_t, a1) - jnp.einsum("bkgst,bkgt->bks", y_t, a2)
        dk2 = jnp.einsum("bkgst,bkgt->bks", y_t, a1) + jnp.einsum("bkgst,bkgt->bks", x_t, a2)
        a1, a2 = a1[..., None], a2[..., None]
        b1, b2 = b1[:, :, None, None], b2[:, :, None, None]
        d_delta = d_delta + w * jnp.sum(x * (a1 * b2 - a2 * b1) - y * (a1 * b1 + a2 * b2), axis=2)
        return d_delta, (dq1, dq2, dk1, dk2)

    init = carry_init(0.0, delta.shape, delta.dtype, delta, ds)
    d_delta, (dq1, dq2, dk1, dk2) = lax.scan(one_frequency, init, (omega, q1, q2, k1, k2))
    last = lambda *parts: jnp.moveaxis(jnp.concatenate(parts, axis=0), 0, -1)
    return last(dq1, dq2), last(dk1, dk2), d_delta


def _block(x: jax.Array, index: jax.Array, size: int, axis: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, index * size, size, axis=axis)


def _add_block(x: jax.Array, update: jax.Array, index: jax.Array, size: int, axis: int) -> jax.Array:
    """x with `update` added to its block `index` (of `size` along `axis`)."""
    return lax.dynamic_update_slice_in_dim(x, _block(x, index, size, axis) + update, index * size, axis=axis)


def _padded_length(length: int, block: int) -> int:
    """L rounded up to a multiple of `block` (an expression a symbolic length divides by `block`)."""
    return block * ((length + block - 1) // block)


def _padded_segments(segment_ids: jax.Array | None, block: int) -> jax.Array | None:
    """[B, L] -> int32 [B, Lp] (padded rows see only padded keys: real rows never see them, being earlier)."""
    if segment_ids is None:
        return None
    length = segment_ids.shape[1]
    return jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, _padded_length(length, block) - length)])


def _group_queries(x: jax.Array, num_kv: int, block: int, dtype: jnp.dtype) -> jax.Array:
    """[B, L, Hq, D] -> [B, Hkv, G, Lp, D] in `dtype` (zero rows appended)."""
    b, length, n, d = x.shape
    padded = _padded_length(length, block)
    x = jnp.pad(x.astype(dtype), [(0, 0), (0, padded - length), (0, 0), (0, 0)])
    return x.reshape(b, padded, num_kv, n // num_kv, d).transpose(0, 2, 3, 1, 4)


def _group_keys(x: jax.Array, block: int, dtype: jnp.dtype) -> jax.Array:
    """[B, L, Hkv, D] -> [B, Hkv, Lp, D] in `dtype` (zero rows appended)."""
    length = x.shape[1]
    return jnp.pad(x.astype(dtype), [(0, 0), (0, _padded_length(length, block) - length), (0, 0), (0, 0)]
                   ).transpose(0, 2, 1, 3)


def _ungroup_queries(x: jax.Array, length: int) -> jax.Array:
    """[B, Hkv, G, Lp, D] -> [B, L, Hq, D]."""
    b, num_kv, g, padded, d = x.shape
    return lax.slice_in_dim(x.transpose(0, 3, 1, 2, 4).reshape(b, padded, num_kv * g, d), 0, length, axis=1)


def _ungroup_keys(x: jax.Array, length: int) -> jax.Array:
    """[B, Hkv, Lp, D] -> [B, L, Hkv, D]."""
    return lax.slice_in_dim(x.transpose(0, 2, 1, 3), 0, length, axis=1)


def _frequencies(head_dim: int, omega: jax.Array | None, config: _Config, dtype: jnp.dtype) -> jax.Array:
    """ω [Dh]: the caller's (already in `dtype`, `caller_frequencies`), else θ^(−2d/D) in `dtype`."""
    return rotary_frequencies(head_dim, config.theta, dtype=dtype) if omega is None else omega


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None, omega: jax.Array, config: _Config
             ) -> tuple[jax.Array, jax.Array]:
    """Grouped q (times sm_scale), k, v in `compute_dtype`, segment ids [B, Lp] or None, ω [Dh] -> o [B, Hkv, G, Lp, D],
    lse [B, Hkv, G, Lp] (MASK_VALUE, and o 0, for a row that sees no key: the first rows of a strict walk; finite, so
    that a user's jax.debug_infs does not stop at it)."""
    b, num_kv, g, length, d = q.shape
    block = config.block

    def visit(qb, kb, carry):
        # query block qb's rows: [B, Hkv, BK], [B, Hkv, G, BK] x2, [B, Hkv, G, BK, D]
        o, lse, z_suffix, m, l, acc = carry
        start = kb == qb  # the walk of query block qb starts at its diagonal block
        z_suffix, l, acc = (jnp.where(start, 0.0, x) for x in (z_suffix, l, acc))
        m = jnp.where(start, -jnp.inf, m)
        q_blk = _block(q, qb, block, 3)  # [B, Hkv, G, BK, D]
        k_blk, v_blk = _block(k, kb, block, 2), _block(v, kb, block, 2)
        mask = _tile_mask(qb, kb, seg, config)
        z = _gates(q_blk[:, :, 0], k_blk, mask)
        s = jnp.where(mask[:, :, None], _scores(q_blk, k_blk, _mileage(z_suffix, z, config), omega), MASK_VALUE)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask[:, :, None], jnp.exp(s - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        l = correction * l + p.sum(-1)
        acc = correction[..., None] * acc + jnp.einsum("bkgts,bksd->bkgtd", p, v_blk)
        empty = l == 0.0  # no visible key so far (NaN inputs stay NaN)
        l_or_1 = jnp.where(empty, 1.0, l)
        o = lax.dynamic_update_slice_in_dim(o, acc / l_or_1[..., None], qb * block, axis=3)
        row_lse = jnp.where(empty, MASK_VALUE, m_new + jnp.log(l_or_1))
        lse = lax.dynamic_update_slice_in_dim(lse, row_lse, qb * block, axis=3)
        return o, lse, z_suffix + z.sum(-1), m_new, l, acc

    zeros = lambda shape: carry_init(0.0, shape, q.dtype, q, k, v)
    rows = (b, num_kv, g, block)
    init = (zeros(q.shape), zeros(q.shape[:-1]), zeros((b, num_kv, block)),
            carry_init(-jnp.inf, rows, q.dtype, q, k, v), zeros(rows), zeros(rows + (d,)))
    o, lse = _walk(visit, init, length // block, config)[:2]
    return o, lse


def _backward(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None, omega: jax.Array, o: jax.Array,
              lse: jax.Array, do: jax.Array, dlse: jax.Array, config: _Config
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Grouped residuals in `compute_dtype` (q times sm_scale) and cotangents do [B, Hkv, G, Lp, D],
    dlse [B, Hkv, G, Lp] -> grouped dq (of the scaled q), dk, dv."""
    b, num_kv, g, length, d = q.shape
    block = config.block
    row_term = jnp.sum(do * o, axis=-1) - dlse  # [B, Hkv, G, Lp]: Σ_j P dP per row, less the lse's cotangent
    lse = jnp.where(lse == MASK_VALUE, 0.0, lse)  # a row that sees no key has P = 0 whatever its lse

    def visit(qb, kb, carry):
        dq, dk, dv, total, z_suffix, dd_suffix = carry  # total: Σ_j dΔ_ij per row [B, Hkv, Lp]
        start = kb == qb
        z_suffix, dd_suffix = (jnp.where(start, 0.0, x) for x in (z_suffix, dd_suffix))
        q_blk, do_blk = _block(q, qb, block, 3), _block(do, qb, block, 3)  # [B, Hkv, G, BK, D]
        lse_blk, row_blk = _block(lse, qb, block, 3), _block(row_term, qb, block, 3)  # [B, Hkv, G, BK]
        q_lead = q_blk[:, :, 0]  # [B, Hkv, BK, D]
        k_blk, v_blk = _block(k, kb, block, 2), _block(v, kb, block, 2)
        mask = _tile_mask(qb, kb, seg, config)
        z = _gates(q_lead, k_blk, mask)
        delta = _mileage(z_suffix, z, config)
        p = jnp.where(mask[:, :, None], jnp.exp(_scores(q_blk, k_blk, delta, omega) - lse_blk[..., None]), 0.0)
        dp = jnp.einsum("bkgtd,bksd->bkgts", do_blk, v_blk)
        ds = p * (dp - row_blk[..., None])
        dv_blk = jnp.einsum("bkgts,bkgtd->bksd", p, do_blk)
        dq_blk, dk_blk, d_delta = _score_grads(q_blk, k_blk, delta, omega, ds)
        suffix = dd_suffix[..., None] + lax.cumsum(d_delta, axis=3, reverse=True)  # Σ_{j≥t} dΔ_ij
        if config.strict:  # z_it reaches Δ_ij for j ≤ t: the rest of the row is Σ_{j>t}
            suffix = suffix - d_delta
        d_logit = -suffix * z * (1.0 - z)  # the −Suf part of dz, through the sigmoid
        dq_blk = dq_blk.at[:, :, 0].add(jnp.einsum("bkts,bksd->bktd", d_logit, k_blk))
        dk_blk = dk_blk + jnp.einsum("bkts,bktd->bksd", d_logit, q_lead)
        dd_suffix = dd_suffix + d_delta.sum(-1)
        return (_add_block(dq, dq_blk, qb, block, 3), _add_block(dk, dk_blk, kb, block, 2),
                _add_block(dv, dv_blk, kb, block, 2), lax.dynamic_update_slice_in_dim(total, dd_suffix, qb * block, 2),
                z_suffix + z.sum(-1), dd_suffix)

    zeros = lambda shape: carry_init(0.0, shape, q.dtype, q, k, v, do)
    row = (b, num_kv, block)
    dq, dk, dv, total, _, _ = _walk(visit, (zeros(q.shape), zeros(k.shape), zeros(v.shape), zeros(k.shape[:-1]),
                                            zeros(row), zeros(row)), length // block, config)

    def visit_gates(qb, kb, carry):  # the +Tot_i part of dz_it, gates only
        dq_lead, dk = carry  # [B, Hkv, Lp, D] x2
        q_lead, k_blk = _block(q, qb, block, 3)[:, :, 0], _block(k, kb, block, 2)
        z = _gates(q_lead, k_blk, _tile_mask(qb, kb, seg, config))
        d_logit = _block(total, qb, block, 2)[..., None] * z * (1.0 - z)
        return (_add_block(dq_lead, jnp.einsum("bkts,bksd->bktd", d_logit, k_blk), qb, block, 2),
                _add_block(dk, jnp.einsum("bkts,bktd->bksd", d_logit, q_lead), kb, block, 2))

    dq_lead, dk = _walk(visit_gates, (zeros(k.shape), dk), length // block, config)
    return dq.at[:, :, 0].add(dq_lead), dk, dv


def _corope_blockwise_fwd(q, k, v, sm_scale, segment_ids, omega, config: _Config):
    num_kv, length, dtype = k.shape[2], q.shape[1], sm_scale.dtype
    seg = _padded_segments(segment_ids, config.block)
    gq = _group_queries(q, num_kv, config.block, dtype) * sm_scale
    gk, gv = _group_keys(k, config.block, dtype), _group_keys(v, config.block, dtype)
    o, lse = _forward(gq, gk, gv, seg, _frequencies(q.shape[3], omega, config, dtype), config)
    outputs = _ungroup_queries(o, length), _ungroup_queries(lse[..., None], length)[..., 0]
    return outputs, (q, k, v, sm_scale, seg, omega, o, lse)


def _corope_blockwise_bwd(config: _Config, residuals, cotangents):
    q, k, v, sm_scale, seg, omega, o, lse = residuals
    do, dlse = cotangents
    num_kv, length, dtype = k.shape[2], q.shape[1], sm_scale.dtype
    gq = _group_queries(q, num_kv, config.block, dtype)
    gdo = _group_queries(do, num_kv, config.block, dtype)
    gdlse = _group_queries(dlse[..., None], num_kv, config.block, dtype)[..., 0]
    dq, dk, dv = _backward(gq * sm_scale, _group_keys(k, config.block, dtype), _group_keys(v, config.block, dtype),
                           seg, _frequencies(q.shape[3], omega, config, dtype), o, lse, gdo, gdlse, config)
    d_sm_scale = jnp.sum(dq * gq)  # the scores and gates take sm_scale·q
    return ((sm_scale * _ungroup_queries(dq, length)).astype(q.dtype), _ungroup_keys(dk, length).astype(k.dtype),
            _ungroup_keys(dv, length).astype(v.dtype), d_sm_scale.astype(sm_scale.dtype),
            None, None)  # segment ids are integers; ω is a constant (see caller_frequencies)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _corope_blockwise(q: jax.Array, k: jax.Array, v: jax.Array, sm_scale: jax.Array, segment_ids: jax.Array | None,
                      omega: jax.Array | None, config: _Config) -> tuple[jax.Array, jax.Array]:
    """One walk: o [B, L, Hq, D] and the rows' lse [B, L, Hq] in sm_scale's dtype (the compute dtype)."""
    return _corope_blockwise_fwd(q, k, v, sm_scale, segment_ids, omega, config)[0]


_corope_blockwise.defvjp(_corope_blockwise_fwd, _corope_blockwise_bwd)
_corope_blockwise_jit = jax.jit(_corope_blockwise, static_argnums=(6,))


def _reversed(x: jax.Array | None) -> jax.Array | None:
    """[B, L, ...] in reverse order along L."""
    return None if x is None else jnp.flip(x, axis=1)


def _negated_second_half(x: jax.Array) -> jax.Array:
    """[..., D] -> [x1, −x2]: flips the sign of E_B (so of sin φ) and keeps E_A and q·k."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1, -x2], axis=-1)


def _merge(o_a: jax.Array, lse_a: jax.Array, o_b: jax.Array, lse_b: jax.Array) -> jax.Array:
    """Softmax attention over two disjoint key sets from each one's output [B, L, Hq, D] and lse [B, L, Hq] (one of
    them finite in every row)."""
    m = lax.stop_gradient(jnp.maximum(lse_a, lse_b))
    w_a, w_b = jnp.exp(lse_a - m)[..., None], jnp.exp(lse_b - m)[..., None]
    return (w_a * o_a + w_b * o_b) / (w_a + w_b)


def corope_attention_blockwise(q: jax.Array, k: jax.Array, v: jax.Array, *, theta: float,
                               sm_scale: float | jax.Array | None, block_k: int = 128, causal: bool = True,
                               segment_ids: jax.Array | None = None, window: int | None = None,
                               inv_freq: jax.Array | None = None) -> jax.Array:
    """Co-RoPE attention in query/key blocks of `block_k`. q [B, L, Hq, D], k/v [B, L, Hkv, D] (any floating dtype)
    -> [B, L, Hq, D] in q's dtype.

    causal=False: bidirectional, every visible key counts and Δ_ij is signed (module docstring).
    segment_ids: int [B, L] document ids (packed documents; padding as an id of its own), None: one document.
    window: int >= 1, query i sees keys with |i − j| < window (key blocks outside it are never visited), None: all.
    inv_freq: float [D/2] rotary frequencies replacing θ^(−2d/D) (`theta` is then unused); a constant, not
    differentiated (its gradient is zero). sm_scale: None (D^−½), a number > 0 or a traced scalar (differentiable).
    Float32 gates, cumsums, trig and softmax statistics whatever the input dtype (float64 for float64 inputs:
    `compute_dtype`); differentiable in q, k, v and
    sm_scale (custom VJP, O(L·block_k·D) memory per step), twice at a static length. A symbolic length
    (jax.export) is padded to a multiple of block_k.
    """
    check_corope_inputs(q, k, v, theta=theta, sm_scale=sm_scale)
    check_positive_int("block_k", block_k)
    check_inv_freq(inv_freq, q.shape[3])
    empty, segment_ids, window = open_attention(q, causal=causal, segment_ids=segment_ids, window=window)
    if empty:
        return jnp.zeros(q.shape, q.dtype)
    length = q.shape[1]
    block = min(int(block_k), length) if isinstance(length, int) else int(block_k)
    config = _Config(float(theta), block, window)
    dtype = compute_dtype(q, k, v)
    q, k, v, sm_scale = vary_alike(q, k, v, jnp.asarray(scale_or_default(sm_scale, q.shape[3]), dtype))
    omega = caller_frequencies(inv_freq, dtype)
    o, lse = _corope_blockwise_jit(q, k, v, sm_scale, segment_ids, omega, config)
    if causal:
        return o.astype(q.dtype)
    o_rev, lse_rev = _corope_blockwise_jit(_reversed(_negated_second_half(q)), _reversed(_negated_second_half(k)),
                                           _reversed(v), sm_scale, _reversed(segment_ids), omega,
                                           dataclasses.replace(config, strict=True))
    return _merge(o, lse, _reversed(o_rev), _reversed(lse_rev)).astype(q.dtype)
