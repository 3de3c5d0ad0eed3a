"""Stick-breaking attention (Tan et al., "Scaling Stick-Breaking Attention", arXiv:2410.17980): each query breaks a
stick from the most recent key backwards, with no softmax and no positional encoding.

B batch, Lq/Lk query/key length (L in self-attention), Hq query heads, Hkv key/value heads (G = Hq // Hkv), D head
dim. z_ij = sm_scale·q_i·k_j, β_ij = σ(z_ij); over the attended keys (j < i, or j ≤ i with attend_current)
A_ij = β_ij·Π_{attended k, j < k} (1 − β_ik); out_i = Σ_j A_ij v_j, and the remainder 1 − Σ_j A_ij = Π_k (1 − β_ik)
is what the stick has left. Computed in log space: log A_ij = log σ(z_ij) + Σ_{k > j} log σ(−z_ik), the sums in
float32.

Packed documents and sliding windows: key j is attended by query i iff it is visible (the same document, i − j <
window) and j < i (j ≤ i with attend_current); keys that are not break nothing.

The layer ("stickbreaking" in the registry) adds the remainder times a learned per-head vector to the output, as the
authors' layer does (github shawntan/stickbreaking-attention), zero at the start. While decoding, the dense
reference runs over the cached keys: O(S) work per token.

Paths: the dense reference here, kernels/stickbreaking_blockwise.py (pure JAX, O(L·block) memory) and
kernels/stickbreaking_pallas.py and kernels/stickbreaking_triton.py (fused, Pallas and native Triton; asked for by
name only until timed on a GPU).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpe.attention_core import AttentionContext
from jaxpe.dispatch import Choice, resolve_unfused_impl, run_chosen
from jaxpe.base import compute_dtype
from jaxpe.kernels.stickbreaking_blockwise import stickbreaking_attention_blockwise, suffix_sums
from jaxpe.registry import PEConfig, register
from jaxpe.sharding import partitioned
from jaxpe.softmax_attention import qk_logits, repeat_kv, resolve_sm_scale, visibility_mask
from jaxpe.validation import as_bool, check_bool, check_qkv, check_sm_scale, open_attention


def stickbreaking_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float | jax.Array,
                                      mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dense stick-breaking attention, the ground truth: O(Lq·Lk) memory.

    q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D]; mask [B|1, Lq, Lk] bool, the attended keys (diagonal included or not as
    the caller wants). Returns (out [B, Lq, Hq, D], remainder [B, Lq, Hq]) in `compute_dtype`.
    """
    z = sm_scale * qk_logits(q, k)  # [B, Hq, Lq, Lk]
    attended = mask[:, None]
    log_keep = jnp.where(attended, jax.nn.log_sigmoid(-z), 0.0)
    after = suffix_sums(log_keep) - log_keep  # Σ_{k > j} log σ(−z_ik)
    weights = jnp.where(attended, jnp.exp(jax.nn.log_sigmoid(z) + after), 0.0)
    v = repeat_kv(v, q.shape[2] // v.shape[2]).astype(weights.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return out, jnp.swapaxes(jnp.exp(jnp.sum(log_keep, axis=3)), 1, 2)


def stickbreaking_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float | jax.Array | None = None,
                            attend_current: bool = False, segment_ids: jax.Array | None = None,
                            window: int | None = None, impl: str = "auto", return_remainder: bool = False
                            ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Stick-breaking attention. q [B, L, Hq, D], k/v [B, L, Hkv, D] (GQA: Hkv divides Hq) -> out [B, L, Hq, D], or
    with return_remainder (out, remainder [B, L, Hq]), both in q's dtype.

    sm_scale: None (D^−½), a number > 0 or a traced scalar (differentiable). attend_current: query i attends key i
    too. segment_ids [B, L] int: packed documents; window: each query sees itself and the window − 1 keys before
    it. impl: "reference" (dense, the ground truth), "blockwise" (pure JAX, O(L·block) memory, custom VJP),
    "pallas" (fused kernels; interpret mode off GPU), "triton" (native Triton kernels through jax-triton,
    `jaxpe[triton]`; Triton's interpreter off GPU with TRITON_INTERPRET=1; float32, bfloat16 and float16) or "auto"
    (the dense path for short sequences, "blockwise" from jaxpe.dispatch.UNFUSED_BLOCKWISE_MIN_LENGTH on; never a
    fused path yet: neither is timed on a GPU).
    """
    check_qkv(q, k, v)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must have the same length, got Lq={q.shape[1]}, Lk={k.shape[1]}")
    check_sm_scale(sm_scale)
    attend_current = as_bool("attend_current", attend_current)
    return_remainder = as_bool("return_remainder", return_remainder)
    empty, segment_ids, window = open_attention(q, causal=True, segment_ids=segment_ids, window=window)
    impl = resolve_unfused_impl(impl, q.shape[1], encoding="stickbreaking", batch_heads=q.shape[0] * q.shape[2])
    if empty:
        out, remainder = jnp.zeros(q.shape, q.dtype), jnp.ones(q.shape[:3], q.dtype)
    else:
        out, remainder = _stickbreaking_attention(q, k, v, sm_scale=sm_scale, attend_current=attend_current,
                                                  segment_ids=segment_ids, window=window, impl=impl)
    return (out, remainder) if return_remainder else out


def attended_mask(visible: jax.Array, q_index: jax.Array, *, attend_current: bool) -> jax.Array:
    """The keys a query breaks the stick on: visible [B|1, Lq, Lk] and before the query (at key index q_index
    [B|1, Lq]), or at it too with attend_current."""
    j = jnp.arange(visible.shape[-1], dtype=jnp.int32)
    return visible & (j[None, None, :] < q_index[:, :, None] + int(attend_current))


class Call(NamedTuple):
    """A checked stick-breaking call, as every path of jaxpe.dispatch.PATHS takes it: self-attention q [B, L, Hq, D],
    k/v [B, L, Hkv, D] and the options of `stickbreaking_attention`. Paths return (out, remainder) in q's dtype."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    sm_scale: float | jax.Array
    attend_current: bool
    segment_ids: jax.Array | None
    window: int | None

    def options(self) -> dict:
        """The keyword arguments the blockwise and Pallas paths take."""
        return dict(sm_scale=self.sm_scale, attend_current=self.attend_current, segment_ids=self.segment_ids,
                    window=self.window)


def _stickbreaking_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float | jax.Array | None,
                             attend_current: bool, segment_ids: jax.Array | None, window: int | None, impl: str
                             ) -> tuple[jax.Array, jax.Array]:
    """`stickbreaking_attention` on checked self-attention inputs and a resolved impl, run through
    jaxpe.dispatch.PATHS: (out, remainder) in q's dtype."""
    call = Call(q, k, v, resolve_sm_scale(sm_scale, q), attend_current, segment_ids, window)
    return run_chosen("stickbreaking", Choice(impl, impl), call)


def reference_path(call: Call, compiled: bool) -> tuple[jax.Array, jax.Array]:
    """The dense ground truth."""
    length = call.q.shape[1]
    visible = visibility_mask(length, length, segment_ids=call.segment_ids, window=call.window)
    mask = attended_mask(visible, jnp.arange(length, dtype=jnp.int32)[None], attend_current=call.attend_current)
    out, remainder = stickbreaking_attention_reference(call.q, call.k, call.v, sm_scale=call.sm_scale, mask=mask)
    return out.astype(call.q.dtype), remainder.astype(call.q.dtype)


def blockwise_path(call: Call, compiled: bool) -> tuple[jax.Array, jax.Array]:
    """kernels/stickbreaking_blockwise.py: O(L·block) memory."""
    return stickbreaking_attention_blockwise(call.q, call.k, call.v, **call.options())


def pallas_path(call: Call, compiled: bool) -> tuple[jax.Array, jax.Array]:
    """kernels/stickbreaking_pallas.py, loaded when it first runs; interpreted off a GPU unless `compiled`."""
    from jaxpe.kernels.stickbreaking_pallas import stickbreaking_attention_pallas  # loads Pallas

    out, remainder = stickbreaking_attention_pallas(call.q, call.k, call.v, **call.options(),
                                                    interpret=False if compiled else None)
    return out, remainder.astype(call.q.dtype)


def triton_path(call: Call, compiled: bool) -> tuple[jax.Array, jax.Array]:
    """kernels/stickbreaking_triton.py through jax-triton (Triton's interpreter off a GPU), loaded when it first runs."""
    from jaxpe.kernels._triton_launch import require  # the extra to install, in words

    require()
    from jaxpe.kernels.stickbreaking_triton import stickbreaking_attention_triton  # loads Triton

    out, remainder = stickbreaking_attention_triton(call.q, call.k, call.v, **call.options())
    return out, remainder.astype(call.q.dtype)


class StickBreakingCore(nn.Module):
    """Stick-breaking attention inside a layer: out + remainder·head_bias, head_bias [Hq, D] learned (zeros at
    init). While decoding (`ctx.mask` given) the dense reference runs on the cached keys."""

    attend_current: bool = False
    impl: str = "auto"

    @nn.compact
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttentionContext) -> jax.Array:
        hq, d = q.shape[2], q.shape[3]
        head_bias = self.param("head_bias", partitioned(nn.initializers.zeros, "heads", "head_dim"), (hq, d),
                               ctx.table_dtype)
        if ctx.mask is not None:  # keys from the cache, documents and window folded into the mask
            lq, lk = q.shape[1], k.shape[1]
            first = ctx.cache_index if ctx.decode else lk - lq
            q_index = (first + jnp.arange(lq, dtype=jnp.int32))[None]
            mask = attended_mask(ctx.mask, q_index, attend_current=self.attend_current)
            out, remainder = stickbreaking_attention_reference(q, k, v, sm_scale=d ** -0.5, mask=mask)
        else:
            impl = resolve_unfused_impl(self.impl, q.shape[1], encoding="stickbreaking", batch_heads=q.shape[0] * hq)
            out, remainder = _stickbreaking_attention(q, k, v, sm_scale=None, attend_current=self.attend_current,
                                                      segment_ids=ctx.segment_ids, window=ctx.window, impl=impl)
        dtype = compute_dtype(q)
        out = out.astype(dtype) + remainder.astype(dtype)[..., None] * head_bias.astype(dtype)[None, None]
        return out.astype(q.dtype)


@register("stickbreaking")
@dataclasses.dataclass(frozen=True)
class StickBreakingConfig(PEConfig):
    """Stick-breaking attention (no softmax, no position tables) with a learned remainder bias per head."""

    attend_current: bool = False  # query i breaks the stick on its own key too

    def __post_init__(self) -> None:
        check_bool("attend_current", self.attend_current)

    def check_layer(self, *, head_dim: int, impl: str, causal: bool = True) -> None:
        # refuses impls it has no path of
        resolve_unfused_impl(impl, 1, encoding="stickbreaking", batch_heads=1, causal=causal)

    def core(self, *, head_dim: int, max_len: int, impl: str) -> nn.Module:
        self.check_layer(head_dim=head_dim, impl=impl)
        return StickBreakingCore(attend_current=self.attend_current, impl=impl)

    def causal_only(self) -> str | None:
        return "each query breaks the stick over the keys before it, nearest first"
