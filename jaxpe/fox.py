"""Forgetting attention (FoX; Lin et al., "Forgetting Transformer: Softmax Attention with a Forget Gate",
arXiv:2503.02130): softmax attention whose logits are down-weighted by data-dependent forget gates.

B batch, Lq/Lk query/key length (L in self-attention), Hq query heads, Hkv key/value heads (G = Hq // Hkv), D head
dim. A forget gate f_t = σ(w·x_t + b) ∈ (0, 1) per query head and token; c_t = Σ_{l ≤ t} log f_l (the running sum,
float32); logits sm_scale·q_i·k_j + c_i − c_j = sm_scale·q_i·k_j + Σ_{l=j+1..i} log f_l for j ≤ i, softmax, times v.
Gates all 1 (log f = 0) give plain causal softmax attention. Bidirectional (causal=False): key j > i gets
c_j − c_i = Σ_{l=i+1..j} log f_l, the gates between key and query either way.

Packed documents and sliding windows: key j is visible to query i iff j ≤ i (either side when bidirectional), the
same document (segment_ids) and |i − j| < window. Documents are contiguous, so the gates between a query and a
visible key all belong to their document.

The layer ("fox" in the registry) projects the layer input to one gate logit per query head, a Dense with bias,
weights N(0, 0.02²) and bias 0 as the authors' code initialises it (github zhixuan-lin/forgetting-transformer), so
f = 1/2 at the start. While decoding, the keys' running sums c are cached: O(S) work per token.

Paths: the dense reference here, kernels/fox_blockwise.py (pure JAX, O(L·block) memory) and kernels/fox_pallas.py
(fused, causal; asked for by name only until compiled and timed on a GPU).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.attention_core import AttentionContext
from jaxpe.dispatch import Choice, resolve_unfused_impl, run_chosen
from jaxpe.base import compute_dtype
from jaxpe.kernels.fox_blockwise import forgetting_attention_blockwise
from jaxpe.kv_cache import update_cache
from jaxpe.registry import PEConfig, register
from jaxpe.sharding import partitioned
from jaxpe.softmax_attention import masked_softmax_attention, qk_logits, resolve_sm_scale, visibility_mask
from jaxpe.validation import as_bool, check_array, check_qkv, check_sm_scale, check_wide_float, open_attention


def check_log_fgate(log_fgate: jax.Array, q: jax.Array) -> None:
    """log_fgate: a float array [B, L, Hq] matching q [B, L, Hq, D]; where concrete, every entry <= 0 (the log of a
    gate in (0, 1]) and finite (a gate of 0, log −inf, makes the running sums' differences −inf − (−inf))."""
    check_array("log_fgate", log_fgate, "B L Hq")
    check_wide_float("log_fgate", log_fgate)
    if tuple(log_fgate.shape) != tuple(q.shape[:3]):
        raise ValueError(f"log_fgate must have shape [B, L, Hq]={tuple(q.shape[:3])}, got "
                         f"log_fgate.shape={tuple(log_fgate.shape)}")
    if isinstance(log_fgate, jax.core.Tracer) or not log_fgate.size:
        return
    values = np.asarray(log_fgate, np.float64)
    largest, smallest = float(np.max(values)), float(np.min(values))
    if not largest <= 0.0:
        raise ValueError(f"log_fgate must be <= 0 (the log of forget gates in (0, 1]), got max(log_fgate)={largest}")
    if not np.isfinite(smallest):
        raise ValueError(f"log_fgate must be finite (a forget gate of exactly 0 has no finite log; a very negative "
                         f"value, e.g. -1e4, forgets as completely), got min(log_fgate)={smallest}")


def forget_gate_cumsum(log_fgate: jax.Array) -> jax.Array:
    """c [B, L, H] = Σ_{l ≤ t} log_fgate[:, l] in `compute_dtype` (float32; float64 for float64 gates)."""
    return jnp.cumsum(log_fgate.astype(compute_dtype(log_fgate)), axis=1)


def forgetting_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, c_q: jax.Array, c_k: jax.Array, *,
                                   sm_scale: float | jax.Array, mask: jax.Array, causal: bool = True) -> jax.Array:
    """Dense forgetting attention, the ground truth: O(Lq·Lk) memory. Returns [B, Lq, Hq, D] in v's dtype.

    q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D]; c_q [B, Lq, Hq] and c_k [B, Lk, Hq] the running sums of the log gates at
    the queries and the keys; mask [B|1, Lq, Lk] bool, the visible keys. causal=False (Lq == Lk): keys after the
    query get c_j − c_i.
    """
    c_q, c_k = (jnp.swapaxes(c, 1, 2) for c in (c_q, c_k))  # [B, Hq, L]
    bias = c_q[..., :, None] - c_k[..., None, :]  # [B, Hq, Lq, Lk]
    if not causal:
        length = q.shape[1]
        after = jnp.arange(length)[None, :] > jnp.arange(length)[:, None]
        bias = jnp.where(after[None, None], -bias, bias)
    logits = sm_scale * qk_logits(q, k) + bias.astype(compute_dtype(q, k))
    return masked_softmax_attention(logits, v, mask)


def forgetting_attention(q: jax.Array, k: jax.Array, v: jax.Array, log_fgate: jax.Array, *,
                         sm_scale: float | jax.Array | None = None, causal: bool = True,
                         segment_ids: jax.Array | None = None, window: int | None = None,
                         impl: str = "auto") -> jax.Array:
    """Forgetting attention. q [B, L, Hq, D], k/v [B, L, Hkv, D] (GQA: Hkv divides Hq), log_fgate [B, L, Hq] (the
    log of the forget gates, <= 0) -> [B, L, Hq, D] in q's dtype.

    sm_scale: None (D^−½), a number > 0 or a traced scalar (differentiable). causal=False: bidirectional (module
    docstring). segment_ids [B, L] int: packed documents; window: each query sees itself and the window − 1 keys
    before it (and after it when bidirectional). impl: "reference" (dense, the ground truth), "blockwise" (pure
    JAX, O(L·block) memory, custom VJP), "pallas" (fused kernels, causal; interpret mode off GPU; not yet compiled
    on a GPU) or "auto" (the dense path for short sequences, "blockwise" from
    jaxpe.dispatch.UNFUSED_BLOCKWISE_MIN_LENGTH on; never "pallas" yet); "triton" is refused.
    """
    check_qkv(q, k, v)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must have the same length, got Lq={q.shape[1]}, Lk={k.shape[1]}")
    check_log_fgate(log_fgate, q)
    check_sm_scale(sm_scale)
    causal = as_bool("causal", causal)
    empty, segment_ids, window = open_attention(q, causal=causal, segment_ids=segment_ids, window=window)
    impl = resolve_unfused_impl(impl, q.shape[1], encoding="fox", batch_heads=q.shape[0] * q.shape[2], causal=causal)
    if empty:
        return jnp.zeros(q.shape, q.dtype)
    return _forgetting_attention(q, k, v, forget_gate_cumsum(log_fgate), sm_scale=sm_scale, causal=causal,
                                 segment_ids=segment_ids, window=window, impl=impl)


class Call(NamedTuple):
    """A checked forgetting-attention call, as every path of jaxpe.dispatch.PATHS takes it: q [B, L, Hq, D], k/v
    [B, L, Hkv, D], the gates' running sums c [B, L, Hq] and the options of `forgetting_attention`."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    c: jax.Array
    sm_scale: float | jax.Array
    causal: bool
    segment_ids: jax.Array | None
    window: int | None


def _forgetting_attention(q: jax.Array, k: jax.Array, v: jax.Array, c: jax.Array, *,
                          sm_scale: float | jax.Array | None, causal: bool, segment_ids: jax.Array | None,
                          window: int | None, impl: str) -> jax.Array:
    """`forgetting_attention` on checked inputs with the running sums c [B, L, Hq] and a resolved impl, run through
    jaxpe.dispatch.PATHS."""
    call = Call(q, k, v, c, resolve_sm_scale(sm_scale, q), causal, segment_ids, window)
    return run_chosen("fox", Choice(impl, impl), call)


def reference_path(call: Call, compiled: bool) -> jax.Array:
    """The dense ground truth."""
    length = call.q.shape[1]
    mask = visibility_mask(length, length, segment_ids=call.segment_ids, window=call.window, causal=call.causal)
    return forgetting_attention_reference(call.q, call.k, call.v, call.c, call.c, sm_scale=call.sm_scale, mask=mask,
                                          causal=call.causal)


def blockwise_path(call: Call, compiled: bool) -> jax.Array:
    """kernels/fox_blockwise.py: O(L·block) memory, either direction."""
    return forgetting_attention_blockwise(call.q, call.k, call.v, call.c, sm_scale=call.sm_scale, causal=call.causal,
                                          segment_ids=call.segment_ids, window=call.window)


def pallas_path(call: Call, compiled: bool) -> jax.Array:
    """kernels/fox_pallas.py (causal), loaded when it first runs; interpreted off a GPU unless `compiled`."""
    from jaxpe.kernels.fox_pallas import forgetting_attention_pallas  # Pallas loads only when this path runs

    return forgetting_attention_pallas(call.q, call.k, call.v, call.c, sm_scale=call.sm_scale,
                                       segment_ids=call.segment_ids, window=call.window,
                                       interpret=False if compiled else None)


class FoXCore(nn.Module):
    """Forgetting attention inside a layer: owns the forget-gate projection "fgate" (Dense d_model -> Hq, with bias).
    While decoding (`ctx.mask` given) the running sums of the cached keys come from the cache "fgate_cumsum"
    [B, S, Hq] and the dense reference runs on the mask: O(S) per token."""

    impl: str = "auto"

    @nn.compact
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttentionContext) -> jax.Array:
        hq = q.shape[2]
        gate = nn.Dense(hq, kernel_init=partitioned(nn.initializers.normal(0.02), "embed", "heads"),
                        bias_init=partitioned(nn.initializers.zeros, "heads"), param_dtype=ctx.table_dtype,
                        name="fgate")
        logits = gate(ctx.x)  # [B, Lq, Hq]
        c = forget_gate_cumsum(jax.nn.log_sigmoid(logits.astype(compute_dtype(logits))))
        c_k = c
        if ctx.decode:
            index = ctx.cache_index
            if self.has_variable("cache", "fgate_cumsum"):  # continue the running sum of the cached tokens
                cached = self.get_variable("cache", "fgate_cumsum")  # [B, S, Hq]
                prev = jax.lax.dynamic_index_in_dim(cached, jnp.maximum(index - 1, 0), axis=1, keepdims=False)
                c = c + jnp.where(index > 0, prev, 0.0)[:, None]
            c_k = update_cache(self, "fgate_cumsum", c, index)
        if ctx.mask is not None:  # keys from the cache, documents and window folded into the mask
            return forgetting_attention_reference(q, k, v, c, c_k, sm_scale=q.shape[-1] ** -0.5, mask=ctx.mask)
        impl = resolve_unfused_impl(self.impl, q.shape[1], encoding="fox", batch_heads=q.shape[0] * hq,
                                    causal=ctx.causal)
        return _forgetting_attention(q, k, v, c, sm_scale=None, causal=ctx.causal, segment_ids=ctx.segment_ids,
                                     window=ctx.window, impl=impl)


@register("fox")
@dataclasses.dataclass(frozen=True)
class FoXConfig(PEConfig):
    """Forgetting attention: a per-head forget gate σ(w·x + b) from the layer input (no position tables)."""

    def check_layer(self, *, head_dim: int, impl: str, causal: bool = True) -> None:
        resolve_unfused_impl(impl, 1, encoding="fox", batch_heads=1, causal=causal)  # refuses "triton"

    def core(self, *, head_dim: int, max_len: int, impl: str) -> nn.Module:
        self.check_layer(head_dim=head_dim, impl=impl)
        return FoXCore(impl=impl)
