"""Dense masked softmax attention with GQA, the shared core of every reference implementation.

B batch, Lq query length, Lk key length, Hq query heads, Hkv key/value heads, G = Hq // Hkv, D head dim.
Query head h reads key/value head h // G.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def repeat_kv(x: jax.Array, groups: int) -> jax.Array:
    """[B, L, Hkv, D] -> [B, L, Hkv·G, D], head h of the result is head h // G of `x`."""
    return x if groups == 1 else jnp.repeat(x, groups, axis=2)


def causal_mask(lq: int, lk: int) -> jax.Array:
    """[1, Lq, Lk] bool; queries are the last Lq of the Lk positions (bottom-right aligned)."""
    i = jnp.arange(lq)[:, None] + (lk - lq)
    j = jnp.arange(lk)[None, :]
    return (j <= i)[None]


PAD_SEGMENT = jnp.iinfo(jnp.int32).min  # the document id of padding: padded keys are invisible to real tokens


def fold_padding(segment_ids: jax.Array | None, padding_mask: jax.Array | None) -> jax.Array | None:
    """Document ids [B, L] int32 with padded tokens (padding_mask False) moved to PAD_SEGMENT; None when neither is
    given. A padded query then sees only padded keys, so its (ignored) output stays finite."""
    if padding_mask is None:
        return None if segment_ids is None else segment_ids.astype(jnp.int32)
    ids = jnp.zeros(padding_mask.shape, jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    return jnp.where(padding_mask, ids, PAD_SEGMENT)


def visibility_mask(lq: int, lk: int, *, segment_ids: jax.Array | None = None, window: int | None = None,
                    q_index: jax.Array | None = None, q_segments: jax.Array | None = None) -> jax.Array:
    """[B|1, Lq, Lk] bool, key j visible to query i: j <= i, same document, i − j < window.

    Queries sit at cache indices q_index [B|1, Lq] (default: the last Lq of Lk); segment_ids [B, Lk] are the keys'
    document ids and q_segments [B, Lq] the queries' (default: the last Lq of segment_ids).
    """
    i = (jnp.arange(lq) + (lk - lq))[None] if q_index is None else q_index  # [B|1, Lq]
    j = jnp.arange(lk)[None, None, :]
    mask = j <= i[:, :, None]
    if window is not None:
        mask &= i[:, :, None] - j < window
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
    attention through XLA's dot_product_attention lost ~8 % on CPU, so it does not use them."""
    blocks = QUERY_BLOCKS if length >= QUERY_BLOCKS_MIN_LENGTH else 1
    bounds = [round(length * n / blocks) for n in range(blocks + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def qk_logits(q: jax.Array, k: jax.Array) -> jax.Array:
    """q [B, Lq, Hq, D], k [B, Lk, Hkv, D] -> float32 q·k [B, Hq, Lq, Lk]."""
    k = repeat_kv(k, q.shape[2] // k.shape[2])
    return jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)


def masked_softmax_attention(logits: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """logits [B, Hq, Lq, Lk] (float32), v [B, Lk, Hkv, D], mask [B|1, Lq, Lk] -> [B, Lq, Hq, D] in v's dtype.

    Rows with no visible key give zeros.
    """
    logits = jnp.where(mask[:, None], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    v = repeat_kv(v, logits.shape[1] // v.shape[2])
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32))
    return out.astype(v.dtype)


def reverse_cumsum(x: jax.Array) -> jax.Array:
    """Suffix sums along the last axis: out[..., j] = Σ_{t≥j} x[..., t] (float32, associative scan)."""
    return jax.lax.associative_scan(jnp.add, x.astype(jnp.float32), axis=x.ndim - 1, reverse=True)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float, mask: jax.Array | None,
           bias: jax.Array | None = None, segment_ids: jax.Array | None = None, window: int | None = None
           ) -> jax.Array:
    """Softmax attention through `jax.nn.dot_product_attention` (cuDNN on GPU where it applies).

    q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D]; mask [B|1, Lq, Lk] bool, or None: causal with Lq == Lk, restricted to
    the same document (segment_ids [B, L]) and the last `window` keys; bias [B|1, Hq, Lq, Lk] is added to the scaled
    logits. Returns [B, Lq, Hq, D].
    """
    if mask is None and segment_ids is not None:
        mask = visibility_mask(q.shape[1], k.shape[1], segment_ids=segment_ids, window=window)
    if bias is not None:
        bias = bias.astype(q.dtype)
    if mask is not None:
        return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask[:, None], scale=sm_scale)
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, bias=bias, scale=sm_scale, is_causal=True, local_window_size=local)
