"""Dense masked softmax attention with GQA, the shared core of every reference implementation.

B batch, Lq query length, Lk key length, Hq query heads, Hkv key/value heads, G = Hq // Hkv, D head dim.
Query head h reads key/value head h // G.
"""
from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jaxpe.base import GATE_PRECISION, compute_dtype, document_ids, scale_or_default
from jaxpe.validation import check_qkv


def resolve_sm_scale(sm_scale: float | jax.Array | None, q: jax.Array) -> float | jax.Array:
    """sm_scale as a Python float (None: D^−½) where it is concrete, else the traced scalar in q's `compute_dtype`:
    float32 maths stay float32 under jax_enable_x64 whatever the scale's dtype (a NumPy float64 such as
    1 / np.sqrt(D) too), and float64 inputs keep float64 maths."""
    sm_scale = scale_or_default(sm_scale, q.shape[-1])
    try:
        return float(sm_scale)
    except jax.errors.ConcretizationTypeError:
        return jnp.asarray(sm_scale, compute_dtype(q))


def repeat_kv(x: jax.Array, groups: int) -> jax.Array:
    """[B, L, Hkv, D] -> [B, L, Hkv·G, D], head h of the result is head h // G of `x`."""
    return x if groups == 1 else jnp.repeat(x, groups, axis=2)


def causal_mask(lq: int, lk: int) -> jax.Array:
    """[1, Lq, Lk] bool; queries are the last Lq of the Lk positions (bottom-right aligned)."""
    i = jnp.arange(lq)[:, None] + (lk - lq)
    j = jnp.arange(lk)[None, :]
    return (j <= i)[None]


# A dense path whose [B, Hq, Lq, Lk] logits would take more than this (in float32) warns while it is traced: the
# array, and the few of its size that the backward keeps, rarely fit on one accelerator.
DENSE_WARN_BYTES = 4 * 2**30


def warn_dense_logits(batch: int, heads: int, lq: int, lk: int, what: str, advice: str) -> None:
    """Warn (RuntimeWarning, at trace time: before anything compiles) when `what`, a dense path, builds float32 logits
    [B, Hq, Lq, Lk] of more than DENSE_WARN_BYTES; the message names the size, the shape and `advice`. Symbolic
    sizes (jax.export) are not checked."""
    shape = (batch, heads, lq, lk)
    if not all(isinstance(n, int) for n in shape):
        return
    nbytes = 4 * math.prod(shape)
    if nbytes > DENSE_WARN_BYTES:
        warnings.warn(f"jaxpe: {what} builds dense [B, Hq, Lq, Lk] = {list(shape)} float32 logits of "
                      f"{nbytes / 2**30:.1f} GiB, more than {DENSE_WARN_BYTES // 2**30} GiB: {advice}",
                      RuntimeWarning, stacklevel=3)


PAD_SEGMENT = jnp.iinfo(jnp.int32).min  # the document id of padding: padded keys are invisible to real tokens


def fold_padding(segment_ids: jax.Array | None, padding_mask: jax.Array | None) -> jax.Array | None:
    """Document ids [B, L] int32 with padded tokens (padding_mask False) moved to PAD_SEGMENT; None when neither is
    given. A padded query then sees only padded keys, so its (ignored) output stays finite."""
    if padding_mask is None:
        return None if segment_ids is None else document_ids(segment_ids)
    ids = jnp.zeros(padding_mask.shape, jnp.int32) if segment_ids is None else document_ids(segment_ids)
    return jnp.where(padding_mask, ids, PAD_SEGMENT)


def visibility_mask(lq: int, lk: int, *, segment_ids: jax.Array | None = None, window: int | None = None,
                    q_index: jax.Array | None = None, q_segments: jax.Array | None = None,
                    causal: bool = True) -> jax.Array:
    """[B|1, Lq, Lk] bool, key j visible to query i: j <= i, same document, i − j < window; causal=False
    (bidirectional): same document, |i − j| < window.

    Queries sit at cache indices q_index [B|1, Lq] (default: the last Lq of Lk); segment_ids [B, Lk] are the keys'
    document ids and q_segments [B, Lq] the queries' (default: the last Lq of segment_ids).
    """
    i = (jnp.arange(lq) + (lk - lq))[None] if q_index is None else q_index  # [B|1, Lq]
    j = jnp.arange(lk)[None, None, :]
    distance = i[:, :, None] - j  # [B|1, Lq, Lk]
    mask = distance >= 0 if causal else jnp.ones(distance.shape, jnp.bool_)
    if window is not None:
        mask &= jnp.abs(distance) < window
    if segment_ids is not None:
        q_segments = segment_ids[:, lk - lq:] if q_segments is None else q_segments
        mask &= q_segments[:, :, None] == segment_ids[:, None, :]
    return mask


QUERY_BLOCKS = 3  # dense causal CoPE runs as this many query blocks ...
QUERY_BLOCKS_MIN_LENGTH = 48  # ... from this length on (below it the extra ops cost more than the skipped scores)


def causal_query_blocks(length: int) -> list[tuple[int, int]]:
    """[start, end) query blocks for dense causal self-attention over `length` tokens. Queries in [s, e) see no key
    at or past e, so each block runs against keys [0, e) only: with QUERY_BLOCKS = 3 that skips a third of the
    L × L scores (all of them masked) in every [B, H, L, L] pass, forward and backward. One block when short.
    CoPE's dense path gains (~15 % of the counting step at L = 80, benchmarks/train_step.py); plain softmax
    attention, with few [B, H, L, L] passes to skip, lost 2–10 % on CPU, so it does not use them."""
    blocks = QUERY_BLOCKS if length >= QUERY_BLOCKS_MIN_LENGTH else 1
    bounds = [round(length * n / blocks) for n in range(blocks + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def qk_logits(q: jax.Array, k: jax.Array, *, gates: bool = False) -> jax.Array:
    """q [B, Lq, Hq, D], k [B, Lk, Hkv, D] -> q·k [B, Hq, Lq, Lk] in `compute_dtype` (float32; float64 from float64
    inputs); `gates`: logits of gates, float32-accurate at least (`GATE_PRECISION`: not TF32 on a GPU)."""
    k = repeat_kv(k, q.shape[2] // k.shape[2])
    return jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=compute_dtype(q, k),
                      precision=GATE_PRECISION if gates else None)


def _exp_and_inverse_sum(logits: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The softmax's unnormalised weights e [B, Hq, Lq, Lk] (0 where masked) and 1 / Σ_k e [B, Hq, Lq, 1] (1 for a
    row with no visible key, or no key at all). The row maximum is a constant to autodiff: the softmax does not depend
    on it. No intermediate is infinite (a user's jax.debug_infs would stop there): masked logits are the row maximum
    before the exp, the lowest finite value in a row with no visible key, and their weights are then zeroed."""
    lowest = jnp.finfo(logits.dtype).min
    visible = jnp.broadcast_to(mask[:, None], logits.shape)
    m = jax.lax.stop_gradient(jnp.max(jnp.where(visible, logits, lowest), axis=-1, keepdims=True, initial=lowest))
    e = jnp.where(visible, jnp.exp(jnp.where(visible, logits, m) - m), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    return e, 1.0 / jnp.where(denom > 0, denom, 1.0)


def _weighted_values(e: jax.Array, inverse_sum: jax.Array, v: jax.Array) -> jax.Array:
    """Σ_k e[b, h, q, k] v[b, k, h // G] / Σ_k e: [B, Lq, Hq, D] in e's dtype. The normalisation is applied to the
    D outputs of a row, not to its Lk weights."""
    v = repeat_kv(v, e.shape[1] // v.shape[2]).astype(e.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", e, v) * _swap_heads_and_queries(inverse_sum)


def _swap_heads_and_queries(x: jax.Array) -> jax.Array:
    """[B, Hq, Lq, 1] <-> [B, Lq, Hq, 1]."""
    return jnp.swapaxes(x, 1, 2)


@jax.custom_jvp
def masked_softmax_attention(logits: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """logits [B, Hq, Lq, Lk] (float32, or float64), v [B, Lk, Hkv, D], mask [B|1, Lq, Lk] -> [B, Lq, Hq, D] in v's
    dtype.

    Rows with no visible key give zeros (and zero derivatives). Differentiated through a tangent rule
    (`_masked_softmax_attention_jvp`) that is linear in the tangents and made of plain jnp ops, so forward mode,
    reverse mode (JAX transposes the rule) and higher orders all work. Its transpose is flash attention's backward:
    with p = e / Σe and out = p·v, d logits = p ⊙ (dout·vᵀ − δ), δ_q = dout_q · out_q a D-long sum, so no
    [B, H, Lq, Lk] pass is spent on the softmax's own reduction or on normalising p; reverse mode keeps e, the only
    [B, H, Lq, Lk] array, and D-long rows (out, 1 / Σe, v).
    """
    e, inverse_sum = _exp_and_inverse_sum(logits, mask)
    return _weighted_values(e, inverse_sum, v).astype(v.dtype)


def _masked_softmax_attention_jvp(primals: tuple[jax.Array, jax.Array, jax.Array],
                                  tangents: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """out = (e·v) / Σe with e = exp(logits − max):
    d out = (de·v + e·dv) / Σe − out · Σ_k de / Σe, de = e ⊙ d logits.

    The normalisation is applied to D-long rows: the only [B, Hq, Lq, Lk] tangent pass is de (and, transposed,
    e ⊙ (dout·vᵀ − δ)). Zero tangents (SymbolicZero: the mask always, logits or v when not differentiated) cost
    nothing."""
    (logits, v, mask), (d_logits, d_v, _) = primals, tangents
    e, inverse_sum = _exp_and_inverse_sum(logits, mask)
    out = _weighted_values(e, inverse_sum, v)  # [B, Lq, Hq, D] in the logits' dtype
    terms = []  # at least one: JAX calls the rule only when logits or v has a tangent
    if not isinstance(d_logits, SymbolicZero):
        d_e = e * d_logits.astype(e.dtype)
        terms.append(_weighted_values(d_e, inverse_sum, v)
                     - out * _swap_heads_and_queries(jnp.sum(d_e, axis=-1, keepdims=True) * inverse_sum))
    if not isinstance(d_v, SymbolicZero):
        terms.append(_weighted_values(e, inverse_sum, d_v))
    return out.astype(v.dtype), sum(terms[1:], terms[0]).astype(v.dtype)


masked_softmax_attention.defjvp(_masked_softmax_attention_jvp, symbolic_zeros=True)


def reverse_cumsum(x: jax.Array) -> jax.Array:
    """Suffix sums along the last axis: out[..., j] = Σ_{t≥j} x[..., t] (in `compute_dtype`, associative scan)."""
    return jax.lax.associative_scan(jnp.add, x.astype(compute_dtype(x)), axis=x.ndim - 1, reverse=True)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float, mask: jax.Array | None,
           bias: jax.Array | None = None, segment_ids: jax.Array | None = None, window: int | None = None,
           causal: bool = True) -> jax.Array:
    """Dense softmax attention (`masked_softmax_attention`'s lean backward).

    q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D]; mask [B|1, Lq, Lk] bool, or None: `visibility_mask` (causal, queries
    last, or bidirectional with causal=False), restricted to the same document (segment_ids [B, Lk]) and the
    `window`; bias [B|1, Hq, Lq, Lk] is added to the scaled logits. Returns [B, Lq, Hq, D] in v's dtype.
    """
    check_qkv(q, k, v)
    warn_dense_logits(q.shape[0], q.shape[2], q.shape[1], k.shape[1], "softmax attention",
                      "this encoding's attention is dense at every impl; CoPE and Co-RoPE run in O(L·block) memory "
                      "with impl='auto' or 'blockwise'")
    if mask is None:
        mask = visibility_mask(q.shape[1], k.shape[1], segment_ids=segment_ids, window=window, causal=causal)
    logits = sm_scale * qk_logits(q, k)
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)
    return masked_softmax_attention(logits, v, mask)
