"""Co-RoPE attention, blockwise in pure JAX: causal, GQA, packed documents, sliding windows, caller-given rotary
frequencies, forward and fused backward, any backend.

Letters (as gemma's): B batch, L length (Lp padded), N query heads, K key/value heads, G = N / K group size, D head
dim, Dh = D/2 rotary pairs, BK block size (queries and keys). Einsum subscripts are the lower-case letters, with t for
query and s for key positions. Internally heads are grouped: q [B, K, G, Lp, D], k/v [B, K, Lp, D]; head 0 of a
group is its leader.

The maths (SPEC §3): z_ij = sigmoid(sm_scale·q^leader_i·k_j) for j ≤ i, Δ_ij = Σ_{t=j+1..i} z_it,
φ_ijd = Δ_ij·ω_d, score_ij = sm_scale·Σ_d (E_A cos φ − E_B sin φ) = sm_scale·Σ_d q1 (k1 cos φ + k2 sin φ)
+ q2 (k2 cos φ − k1 sin φ). Tiles are frequency-major: a scan over the Dh frequencies computes one [BK, BK] plane
of sin/cos per step with `sincos` (a polynomial, vectorised by XLA; jnp.sin/cos are ~20× slower on CPU), shared by
the G heads of a group, and accumulates the scores. The backward computes a tile's sin/cos in its score pass and
again in its gradient pass (there in both orientations of the tile, see `_score_grads`): on CPU storing them
[Dh, BK, BK] between the passes, or transposing them, costs more memory traffic than the polynomial (measured).

Visibility (one definition in every implementation): key j is visible to query i iff j ≤ i, segment_ids[b, i] ==
segment_ids[b, j] (packed documents, padding as its own id; documents need not be contiguous) and i − j < window.
Gates of invisible keys are 0, so Δ counts only keys of the same document inside the window. ω_d = θ^(−2d/D) unless
the caller passes `inv_freq` (scaled RoPE frequencies; zeros for pairs that do not rotate, partial rotary).

Loop structure: query blocks in sequence; for each, key blocks walked in reverse from the diagonal carrying the
running suffix sum of z per row (one pass, causal early exit). With a window the walk stops at the first key block
that reaches into the window of the block's first row, so the work is O(L·window), not O(L²); documents are masked
per tile. Memory per step is O(B·N·BK²); nothing of size L×L is ever built, forward or backward.

Backward, per query block (reverse key walk again): with dS the softmax gradient of the scores,
dΔ_ij = sm_scale·Σ_d ω_d·Σ_h dS^h_ij (cos φ (q1^h k2 − q2^h k1) − sin φ (q1^h k1 + q2^h k2)), and the gate
gradient dz_it = Σ_{j<t} dΔ_ij = Tot_i − Suf_it, with Suf_it = Σ_{j≥t} dΔ_ij (carried) and Tot_i the row total,
known after the walk.
The −Suf part is applied during the walk; the Tot part by a second, cheap walk (gates only, no trig).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpe.kernels._checks import (check_corope_inputs, check_kernel_dtype, check_positive_int, check_segment_ids,
                                   check_window)
from jaxpe.kernels._common import MASK_VALUE, rotary_frequencies, sincos


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


def corope_frequencies(head_dim: int, theta: float, inv_freq: jax.Array | None = None) -> jax.Array:
    """ω [D/2] float32: θ^(−2d/D), or the caller's `inv_freq` (a constant: no gradient flows into it)."""
    if inv_freq is None:
        return rotary_frequencies(head_dim, theta)
    return caller_frequencies(inv_freq)


def caller_frequencies(inv_freq: jax.Array | None) -> jax.Array | None:
    """The caller's ω as float32 with no gradient (None stays None: the kernels then use θ^(−2d/D))."""
    return None if inv_freq is None else lax.stop_gradient(jnp.asarray(inv_freq, jnp.float32))


def effective_window(window: int | None, length: int) -> int | None:
    """The window that restricts anything at this length: None when it covers every causal key."""
    return None if window is None or window >= length else window


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static settings of one call (hashable: the jit static argument and the custom_vjp's non-differentiable one)."""

    theta: float  # ω_d = θ^(−2d/D) unless the caller gives ω
    sm_scale: float
    block: int  # BK, query rows and keys per block (at most L)
    window: int | None  # keys i − window < j ≤ i are visible; None: the whole causal prefix


def _first_key_block(qb: jax.Array, config: _Config) -> jax.Array | int:
    """The first key block the walk of query block qb must visit: the one holding key qb·BK − window + 1."""
    if config.window is None:
        return 0
    return jnp.maximum(qb * config.block - config.window + 1, 0) // config.block


def _key_steps(qb: jax.Array, config: _Config) -> jax.Array:
    """How many key blocks query block qb walks, from its diagonal block down to `_first_key_block`."""
    return qb + 1 if config.window is None else qb + 1 - _first_key_block(qb, config)


def _visible(rows: jax.Array, cols: jax.Array, seg_rows: jax.Array | None, seg_cols: jax.Array | None,
             window: int | None) -> jax.Array:
    """Mask [B|1, 1, BK, BK]: causal, inside the window, same document (seg_rows/seg_cols [B, BK] or None)."""
    mask = cols[None, :] <= rows[:, None]
    if window is not None:
        mask = mask & (rows[:, None] - cols[None, :] < window)
    mask = mask[None, None]
    if seg_rows is not None:
        mask = mask & (seg_rows[:, :, None] == seg_cols[:, None, :])[:, None]
    return mask


def _gates(q_lead: jax.Array, k: jax.Array, mask: jax.Array, sm_scale: float) -> jax.Array:
    """Gates q_lead [B, K, BK, D], k [B, K, BK, D] -> z [B, K, BK, BK], 0 where `mask` [B|1, 1, BK, BK] is False."""
    z = jax.nn.sigmoid(sm_scale * jnp.einsum("bktd,bksd->bkts", q_lead, k))
    return jnp.where(mask, z, 0.0)


def _by_frequency(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> its halves x1, x2 with the frequency first: [Dh, ...] with a size-1 axis inserted at `axis` of
    the rest (so that query rows [.., BK(t), 1] and keys [.., 1, BK(s)] broadcast into a [.., BK, BK] tile)."""
    x = jnp.expand_dims(jnp.moveaxis(x, -1, 0), axis)
    return jnp.split(x, 2, axis=0)


def _scores(q: jax.Array, k: jax.Array, delta: jax.Array, omega: jax.Array, config: _Config) -> jax.Array:
    """q [B, K, G, BK, D], k [B, K, BK, D], delta [B, K, BK, BK] -> scores [B, K, G, BK(t), BK(s)]
    = sm_scale·Σ_d q1 (k1 cos φ + k2 sin φ) + q2 (k2 cos φ − k1 sin φ): a scan over the frequencies, one
    [BK, BK] plane of sincos per step (shared by the G heads of a group) folded into the scores by one elementwise
    fusion."""
    q1, q2 = _by_frequency(q, -1)  # [Dh, B, K, G, BK, 1]
    k1, k2 = _by_frequency(k[:, :, None], -2)  # [Dh, B, K, 1, 1, BK]

    def one_frequency(acc, xs):
        w, a1, a2, b1, b2 = xs
        sin, cos = sincos(delta * w)  # [B, K, BK, BK]
        sin_g, cos_g = sin[:, :, None], cos[:, :, None]
        return acc + a1 * (b1 * cos_g + b2 * sin_g) + a2 * (b2 * cos_g - b1 * sin_g), None

    init = jnp.zeros(q.shape[:-1] + (k.shape[2],), jnp.float32)
    acc, _ = lax.scan(one_frequency, init, (omega, q1, q2, k1, k2))
    return config.sm_scale * acc


def _score_grads(q: jax.Array, k: jax.Array, delta: jax.Array, omega: jax.Array, ds: jax.Array, config: _Config
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The score's cotangent ds [B, K, G, BK, BK] -> dq [B, K, G, BK, D], dk [B, K, BK, D], dΔ [B, K, BK, BK].

    With X = ds·cos φ, Y = ds·sin φ: dq1 = Σ_s X k1 + Y k2, dq2 = Σ_s X k2 − Y k1, dk1 = Σ_gt X q1 − Y q2,
    dk2 = Σ_gt Y q1 + X q2, dΔ = Σ_d ω_d Σ_g X (q1 k2 − q2 k1) − Y (q1 k1 + q2 k2), all times sm_scale.
    A scan over the frequencies again. The contractions are einsums (XLA CPU runs them as dots, faster than its
    reductions of the same products); dk's contract t on a transposed tile with its own sincos (cheaper than the
    transposing copies XLA would make of X and Y at every frequency). Storing the score pass's sin/cos [Dh, BK, BK]
    instead of computing them again was slower on CPU (memory traffic costs more than the polynomial)."""
    q1, q2 = _by_frequency(q, -1)  # [Dh, B, K, G, BK, 1]
    k1, k2 = _by_frequency(k[:, :, None], -2)  # [Dh, B, K, 1, 1, BK]
    delta_t, ds_t = jnp.swapaxes(delta, -1, -2), jnp.swapaxes(ds, -1, -2)  # [B, K, BK(s), BK(t)], [.., G, s, t]

    def one_frequency(d_delta, xs):
        w, a1, a2, b1, b2 = xs
        sin, cos = sincos(delta * w)  # [B, K, BK(t), BK(s)]
        x, y = ds * cos[:, :, None], ds * sin[:, :, None]  # [B, K, G, BK(t), BK(s)]
        sin_t, cos_t = sincos(delta_t * w)  # [B, K, BK(s), BK(t)]
        x_t, y_t = ds_t * cos_t[:, :, None], ds_t * sin_t[:, :, None]
        b1, b2, a1, a2 = b1[:, :, 0, 0], b2[:, :, 0, 0], a1[..., 0], a2[..., 0]  # [B, K, BK(s)], [B, K, G, BK(t)]
        dq1 = jnp.einsum("bkgts,bks->bkgt", x, b1) + jnp.einsum("bkgts,bks->bkgt", y, b2)
        dq2 = jnp.einsum("bkgts,bks->bkgt", x, b2) - jnp.einsum("bkgts,bks->bkgt", y, b1)
        dk1 = jnp.einsum("bkgst,bkgt->bks", x_t, a1) - jnp.einsum("bkgst,bkgt->bks", y_t, a2)
        dk2 = jnp.einsum("bkgst,bkgt->bks", y_t, a1) + jnp.einsum("bkgst,bkgt->bks", x_t, a2)
        a1, a2 = a1[..., None], a2[..., None]
        b1, b2 = b1[:, :, None, None], b2[:, :, None, None]
        d_delta = d_delta + w * jnp.sum(x * (a1 * b2 - a2 * b1) - y * (a1 * b1 + a2 * b2), axis=2)
        return d_delta, (dq1, dq2, dk1, dk2)

    d_delta, (dq1, dq2, dk1, dk2) = lax.scan(one_frequency, jnp.zeros_like(delta), (omega, q1, q2, k1, k2))
    last = lambda *parts: config.sm_scale * jnp.moveaxis(jnp.concatenate(parts, axis=0), 0, -1)
    return last(dq1, dq2), last(dk1, dk2), config.sm_scale * d_delta


def _block(x: jax.Array, index: jax.Array, size: int, axis: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, index * size, size, axis=axis)


def _padded_segments(segment_ids: jax.Array | None, block: int) -> jax.Array | None:
    """[B, L] -> int32 [B, Lp] (padded rows see only their own, causally unreachable, keys)."""
    if segment_ids is None:
        return None
    return jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, -segment_ids.shape[1] % block)])


def _grouped(q: jax.Array, k: jax.Array, v: jax.Array, block: int
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[B, L, N|K, D] inputs -> float32 q [B, K, G, Lp, D], k/v [B, K, Lp, D], Lp = L rounded up to `block`."""
    b, length, n, d = q.shape
    num_kv = k.shape[2]
    pad = [(0, 0), (0, -length % block), (0, 0), (0, 0)]
    q = jnp.pad(q.astype(jnp.float32), pad).reshape(b, -1, num_kv, n // num_kv, d).transpose(0, 2, 3, 1, 4)
    k, v = (jnp.pad(x.astype(jnp.float32), pad).transpose(0, 2, 1, 3) for x in (k, v))
    return q, k, v


def _ungrouped(x: jax.Array, length: int) -> jax.Array:
    """[B, K, G, Lp, D] -> [B, L, N, D]."""
    b, num_kv, g, _, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, -1, num_kv * g, d)[:, :length]


def _frequencies(head_dim: int, omega: jax.Array | None, config: _Config) -> jax.Array:
    """ω [Dh] float32: the caller's, else θ^(−2d/D)."""
    return rotary_frequencies(head_dim, config.theta) if omega is None else omega


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None, omega: jax.Array | None,
             config: _Config) -> tuple[jax.Array, jax.Array]:
    """Grouped float32 q, k, v, segment ids [B, Lp] or None, ω [Dh] or None -> o [B, K, G, Lp, D],
    lse [B, K, G, Lp]."""
    b, num_kv, g, length, d = q.shape
    block, sm_scale = config.block, config.sm_scale
    omega = _frequencies(d, omega, config)

    def query_block(qb, outputs):
        o, lse = outputs
        q_blk = _block(q, qb, block, 3)  # [B, K, G, BK, D]
        rows = qb * block + jnp.arange(block)
        seg_rows = None if seg is None else _block(seg, qb, block, 1)  # [B, BK]

        def key_block(step, carry):
            z_suffix, m, l, acc = carry  # [B, K, BK], [B, K, G, BK] x2, [B, K, G, BK, D]
            kb = qb - step
            k_blk, v_blk = _block(k, kb, block, 2), _block(v, kb, block, 2)
            seg_cols = None if seg is None else _block(seg, kb, block, 1)
            mask = _visible(rows, kb * block + jnp.arange(block), seg_rows, seg_cols, config.window)
            z = _gates(q_blk[:, :, 0], k_blk, mask, sm_scale)
            delta = z_suffix[..., None] + lax.cumsum(z, axis=3, reverse=True) - z
            s = jnp.where(mask[:, :, None], _scores(q_blk, k_blk, delta, omega, config), MASK_VALUE)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            correction = jnp.exp(m - m_new)
            acc = correction[..., None] * acc + jnp.einsum("bkgts,bksd->bkgtd", p, v_blk)
            return z_suffix + z.sum(-1), m_new, correction * l + p.sum(-1), acc

        init = (jnp.zeros((b, num_kv, block)), jnp.full((b, num_kv, g, block), -jnp.inf),
                jnp.zeros((b, num_kv, g, block)), jnp.zeros((b, num_kv, g, block, d)))
        _, m, l, acc = lax.fori_loop(0, _key_steps(qb, config), key_block, init)
        o = lax.dynamic_update_slice_in_dim(o, acc / l[..., None], qb * block, axis=3)
        lse = lax.dynamic_update_slice_in_dim(lse, m + jnp.log(l), qb * block, axis=3)
        return o, lse

    init = (jnp.zeros_like(q), jnp.zeros((b, num_kv, g, length)))
    return lax.fori_loop(0, length // block, query_block, init)


def _backward(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None, omega: jax.Array | None,
              o: jax.Array, lse: jax.Array, do: jax.Array, config: _Config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Grouped float32 residuals and output cotangent do [B, K, G, Lp, D] -> grouped dq, dk, dv."""
    b, num_kv, g, length, d = q.shape
    block, sm_scale = config.block, config.sm_scale
    omega = _frequencies(d, omega, config)
    row_dot = jnp.sum(do * o, axis=-1)  # [B, K, G, Lp], Σ_j P dP per row

    def query_block(qb, grads):
        dq, dk, dv = grads
        q_blk, do_blk = _block(q, qb, block, 3), _block(do, qb, block, 3)  # [B, K, G, BK, D]
        lse_blk, row_dot_blk = _block(lse, qb, block, 3), _block(row_dot, qb, block, 3)  # [B, K, G, BK]
        q_lead = q_blk[:, :, 0]  # [B, K, BK, D]
        rows = qb * block + jnp.arange(block)
        seg_rows = None if seg is None else _block(seg, qb, block, 1)

        def mask_of(kb):
            seg_cols = None if seg is None else _block(seg, kb, block, 1)
            return _visible(rows, kb * block + jnp.arange(block), seg_rows, seg_cols, config.window)

        def key_block(step, carry):
            z_suffix, dd_suffix, dq_blk, dk, dv = carry
            kb = qb - step
            k_blk, v_blk = _block(k, kb, block, 2), _block(v, kb, block, 2)
            mask = mask_of(kb)
            z = _gates(q_lead, k_blk, mask, sm_scale)
            delta = z_suffix[..., None] + lax.cumsum(z, axis=3, reverse=True) - z
            s = jnp.where(mask[:, :, None], _scores(q_blk, k_blk, delta, omega, config), MASK_VALUE)
            p = jnp.exp(s - lse_blk[..., None])  # [B, K, G, BK, BK]
            dp = jnp.einsum("bkgtd,bksd->bkgts", do_blk, v_blk)
            ds = p * (dp - row_dot_blk[..., None])
            dv_blk = jnp.einsum("bkgts,bkgtd->bksd", p, do_blk)
            dq_tile, dk_blk, d_delta = _score_grads(q_blk, k_blk, delta, omega, ds, config)
            dq_blk = dq_blk + dq_tile
            suffix = dd_suffix[..., None] + lax.cumsum(d_delta, axis=3, reverse=True)  # Σ_{j≥t} dΔ_ij
            d_logit = -sm_scale * suffix * z * (1.0 - z)  # the −Suf part of dz, through the sigmoid
            dq_blk = dq_blk.at[:, :, 0].add(jnp.einsum("bkts,bksd->bktd", d_logit, k_blk))
            dk_blk = dk_blk + jnp.einsum("bkts,bktd->bksd", d_logit, q_lead)
            dk = lax.dynamic_update_slice_in_dim(dk, _block(dk, kb, block, 2) + dk_blk, kb * block, axis=2)
            dv = lax.dynamic_update_slice_in_dim(dv, _block(dv, kb, block, 2) + dv_blk, kb * block, axis=2)
            return z_suffix + z.sum(-1), dd_suffix + d_delta.sum(-1), dq_blk, dk, dv

        zeros_row = jnp.zeros((b, num_kv, block))
        _, d_delta_total, dq_blk, dk, dv = lax.fori_loop(
            0, _key_steps(qb, config), key_block, (zeros_row, zeros_row, jnp.zeros_like(q_blk), dk, dv))

        def total_part(kb, carry):  # the +Tot_i part of dz_it, gates only
            dq_lead, dk = carry
            k_blk = _block(k, kb, block, 2)
            z = _gates(q_lead, k_blk, mask_of(kb), sm_scale)
            d_logit = sm_scale * d_delta_total[..., None] * z * (1.0 - z)
            dk_blk = _block(dk, kb, block, 2) + jnp.einsum("bkts,bktd->bksd", d_logit, q_lead)
            dq_lead = dq_lead + jnp.einsum("bkts,bksd->bktd", d_logit, k_blk)
            return dq_lead, lax.dynamic_update_slice_in_dim(dk, dk_blk, kb * block, axis=2)

        dq_lead, dk = lax.fori_loop(_first_key_block(qb, config), qb + 1, total_part, (dq_blk[:, :, 0], dk))
        dq_blk = dq_blk.at[:, :, 0].set(dq_lead)
        return lax.dynamic_update_slice_in_dim(dq, dq_blk, qb * block, axis=3), dk, dv

    return lax.fori_loop(0, length // block, query_block, (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)))


def _corope_blockwise_fwd(q, k, v, segment_ids, omega, config: _Config):
    seg = _padded_segments(segment_ids, config.block)
    o, lse = _forward(*_grouped(q, k, v, config.block), seg, omega, config)
    return _ungrouped(o, q.shape[1]).astype(q.dtype), (q, k, v, seg, omega, o, lse)


def _corope_blockwise_bwd(config: _Config, residuals, do):
    q, k, v, seg, omega, o, lse = residuals
    gq, gk, gv = _grouped(q, k, v, config.block)
    gdo = _grouped(do, k, v, config.block)[0]
    dq, dk, dv = _backward(gq, gk, gv, seg, omega, o, lse, gdo, config)
    length = q.shape[1]
    return (_ungrouped(dq, length).astype(q.dtype),
            dk.transpose(0, 2, 1, 3)[:, :length].astype(k.dtype),
            dv.transpose(0, 2, 1, 3)[:, :length].astype(v.dtype),
            None, None)  # segment ids are integers; ω is a constant (see caller_frequencies)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _corope_blockwise(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None,
                      omega: jax.Array | None, config: _Config) -> jax.Array:
    return _corope_blockwise_fwd(q, k, v, segment_ids, omega, config)[0]


_corope_blockwise.defvjp(_corope_blockwise_fwd, _corope_blockwise_bwd)
_corope_blockwise_jit = jax.jit(_corope_blockwise, static_argnums=(5,))


def corope_attention_blockwise(q: jax.Array, k: jax.Array, v: jax.Array, *, theta: float, sm_scale: float,
                               block_k: int = 128, segment_ids: jax.Array | None = None, window: int | None = None,
                               inv_freq: jax.Array | None = None) -> jax.Array:
    """Causal Co-RoPE attention in query/key blocks of `block_k`. q [B, L, N, D], k/v [B, L, K, D] (float32 or
    bfloat16) -> [B, L, N, D] in q's dtype.

    segment_ids: int [B, L] document ids (packed documents; padding as an id of its own), None: one document.
    window: int >= 1, query i sees keys i − window < j ≤ i (key blocks outside it are never visited), None: all.
    inv_freq: float [D/2] rotary frequencies replacing θ^(−2d/D) (`theta` is then unused); a constant, not
    differentiated (its gradient is zero).
    Float32 gates, cumsums, trig and softmax statistics whatever the input dtype; differentiable in q, k, v (custom
    VJP, O(L·block_k·D) memory per step).
    """
    check_corope_inputs(q, k, v, theta=theta, sm_scale=sm_scale)
    check_kernel_dtype(q)
    check_positive_int("block_k", block_k)
    check_segment_ids(segment_ids, q.shape[0], q.shape[1])
    check_window(window)
    check_inv_freq(inv_freq, q.shape[3])
    if q.shape[1] == 0:  # no queries: an empty output, as jax.nn.dot_product_attention gives
        return jnp.zeros(q.shape, q.dtype)
    config = _Config(float(theta), float(sm_scale), min(block_k, q.shape[1]), effective_window(window, q.shape[1]))
    return _corope_blockwise_jit(q, k, v, segment_ids, caller_frequencies(inv_freq), config)
