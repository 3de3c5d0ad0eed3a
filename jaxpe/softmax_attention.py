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
           bias: jax.Array | None = None) -> jax.Array:
    """Softmax attention through `jax.nn.dot_product_attention` (cuDNN on GPU where it applies).

    q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D]; mask None means causal with Lq == Lk, else [B|1, Lq, Lk] bool;
    bias [B|1, Hq, Lq, Lk] is added to the scaled logits. Returns [B, Lq, Hq, D].
    """
    if mask is not None:
        mask = mask[:, None]
    if bias is not None:
        bias = bias.astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=sm_scale, is_causal=mask is None)
