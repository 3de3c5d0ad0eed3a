"""Co-RoPE: rotary encoding driven by contextual mileage (PyTorch reference: github Superposition09m/Co-RoPE).

B batch, Lq/Lk query/key length, Hq query heads, Hkv key/value heads, G = Hq // Hkv, D head dim.
1. the leader of GQA group g is query head g·G; z_ij = sigmoid(sm_scale · q^leader_i·k_j), 0 for keys j that
   query i does not see (j > i; another document; i − j ≥ window), so Δ counts only its document's keys in the window;
2. mileage a_ij = Σ_{t≤j} z_it; Δ_ij = a_ii − a_ij = Σ_{t=j+1..i} z_it, shared by the heads of the group;
   bidirectional (causal=False): the keys j > i count too (key j visible iff same document and |i − j| < window)
   and Δ is signed, Δ_ij = −Σ_{t=i+1..j} z_it for j > i;
3. φ_ijd = Δ_ij·ω_d, ω_d = θ^(−2d/D) or the caller's `inv_freq` (RoPE scaling; zeros: pairs that do not rotate),
   d < D/2; q = [q1, q2], k = [k1, k2];
4. E_A = q1_d k1_d + q2_d k2_d, E_B = q2_d k1_d − q1_d k2_d, score_ij = sm_scale·Σ_d (E_A cos φ − E_B sin φ);
   softmax over the visible keys, times v.
With Δ_ij = i − j this is RoPE; with every z = c it is RoPE with every ω_d multiplied by c (bidirectional RoPE when
causal=False); with every ω_d = 0 it is plain attention.

What each impl supports beyond jit, vmap and grad: "reference" (dense autodiff, forward mode and higher orders as far
as `masked_softmax_attention` allows), "blockwise" (custom VJP: reverse mode, twice at a static length; no forward
mode) and "pallas" and "triton" (custom VJP: reverse mode once; float32, bfloat16 or float16, causal, static
shapes) all run
under shard_map (default checks), x64 mode and with a traced sm_scale (a learned temperature, differentiable);
"reference" and "blockwise" export with symbolic batch and length (jax.export).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpe.attention_core import AttentionContext
from jaxpe.dispatch import refusal, resolve_impl, run_chosen
from jaxpe.base import compute_dtype
from jaxpe.kernels._common import carry_init, sincos
from jaxpe.kernels.corope_blockwise import check_inv_freq, corope_attention_blockwise
from jaxpe.registry import PEConfig, register
from jaxpe.rope_scaling import check_rotary_dim, rope_frequencies, rope_scaling_dict
from jaxpe.softmax_attention import (fold_padding, masked_softmax_attention, qk_logits, resolve_sm_scale,
                                     reverse_cumsum, visibility_mask, warn_dense_logits)
from jaxpe.validation import (as_bool, check_attention_mask, check_corope_inputs, check_even_head_dim, check_impl,
                              check_padding_mask, check_positive_number, check_qkv, check_queries_last,
                              check_sm_scale, open_attention)


def corope_mileage(q: jax.Array, k: jax.Array, *, sm_scale: float | jax.Array | None = None,
                   mask: jax.Array | None = None, causal: bool = True) -> jax.Array:
    """Δ [B, Hkv, Lq, Lk] (float32; float64 from float64 inputs) = a_ii − a_ij, a_ij = Σ_{t≤j} z_it over the keys
    `mask` shows, z from the leader heads q[:, :, ::G]: Σ_{t=j+1..i} z_it for j < i; when causal, 0 for j ≥ i, else
    −Σ_{t=i+1..j} z_it for j > i.

    q [B, Lq, Hq, D], k [B, Lk, Hkv, D], mask [B|1, Lq, Lk] bool (None: causal, queries last, or every key when
    causal=False); causal=False is self-attention (Lq = Lk, query i at key position i).
    """
    check_qkv(q, k, k)
    check_sm_scale(sm_scale)
    check_attention_mask(mask, q.shape[0], q.shape[1], k.shape[1])
    check_queries_last(q, k, mask)
    causal = as_bool("causal", causal)
    if not causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal=False is self-attention: q and k must have the same length, got Lq={q.shape[1]}, "
                         f"Lk={k.shape[1]}")
    sm_scale = resolve_sm_scale(sm_scale, q)
    if mask is None:
        mask = visibility_mask(q.shape[1], k.shape[1], causal=causal)
    leaders = q[:, :, :: q.shape[2] // k.shape[2]]  # [B, Lq, Hkv, D]
    logits = sm_scale * qk_logits(leaders, k, gates=True)
    z = jnp.where(mask[:, None], jax.nn.sigmoid(logits), 0.0)  # [B, Hkv, Lq, Lk]
    after = _suffix_sums(z) - z  # Σ_{t>j} z_it = a_i,last − a_ij
    if causal:  # Σ_{t>i} z_it = 0: no key after the query is visible
        return after
    return after - jnp.sum(jnp.where(jnp.eye(q.shape[1], dtype=bool), after, 0.0), axis=-1, keepdims=True)


def _suffix_sums(z: jax.Array) -> jax.Array:
    """Σ_{t≥j} z[..., t] along the last axis, in `compute_dtype`: the associative scan at a static length;
    lax.cumsum at a symbolic one (jax.export), which the scan cannot split."""
    if isinstance(z.shape[-1], int):
        return reverse_cumsum(z)
    return lax.cumsum(z.astype(compute_dtype(z)), axis=z.ndim - 1, reverse=True)


def corope_scores(q: jax.Array, k: jax.Array, mileage: jax.Array, *, theta: float = 10000.0,
                  sm_scale: float | None = None, inv_freq: jax.Array | None = None) -> jax.Array:
    """Scores [B, Hq, Lq, Lk] = sm_scale·Σ_d (E_A cos φ − E_B sin φ), φ = mileage·ω_d, in `compute_dtype` (float32;
    float64 from float64 inputs).

    mileage [B, Hkv, Lq, Lk] is shared by the G heads of each group; ω = inv_freq [D/2] (a constant) or θ^(−2d/D).
    One frequency at a time (a rematerialised scan) so that memory stays O(L²), not O(L²·D); the sin and cos of each
    angle come once per group from `sincos` (max abs error 1e-7 against float64; jnp.sin/cos are several times
    slower on CPU), and the scores are checked against numpy float64 in the tests.
    """
    b, lq, hq, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    sm_scale = resolve_sm_scale(sm_scale, q)
    dtype = compute_dtype(q, k)
    q1, q2 = jnp.split(q.astype(dtype).reshape(b, lq, hkv, hq // hkv, d), 2, axis=-1)  # [B, Lq, Hkv, G, D/2]
    k1, k2 = jnp.split(k.astype(dtype), 2, axis=-1)  # [B, Lk, Hkv, D/2]

    @jax.checkpoint
    def one_frequency(acc: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, None]:
        omega, q1d, q2d, k1d, k2d = xs  # q·d [B, Lq, Hkv, G], k·d [B, Lk, Hkv]
        e_a = jnp.einsum("bqhg,bkh->bhgqk", q1d, k1d) + jnp.einsum("bqhg,bkh->bhgqk", q2d, k2d)
        e_b = jnp.einsum("bqhg,bkh->bhgqk", q2d, k1d) - jnp.einsum("bqhg,bkh->bhgqk", q1d, k2d)
        sin, cos = sincos(mileage * omega)  # [B, Hkv, Lq, Lk], once per group
        return acc + e_a * cos[:, :, None] - e_b * sin[:, :, None], None

    last_first = lambda x: jnp.moveaxis(x, -1, 0)
    omega = rope_frequencies(d, theta=theta, dtype=dtype)[0] if inv_freq is None else lax.stop_gradient(
        jnp.asarray(inv_freq, dtype))  # [D/2], the caller's a constant
    xs = (omega, last_first(q1), last_first(q2), last_first(k1), last_first(k2))
    acc0 = carry_init(0.0, (b, hkv, hq // hkv, lq, lk), dtype, q, k, mileage)
    scores, _ = jax.lax.scan(one_frequency, acc0, xs)
    return sm_scale * scores.reshape(b, hq, lq, lk)


def corope_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *, theta: float,
                               sm_scale: float | jax.Array, mask: jax.Array | None = None,
                               mileage: jax.Array | None = None, segment_ids: jax.Array | None = None,
                               window: int | None = None, inv_freq: jax.Array | None = None, causal: bool = True
                               ) -> jax.Array:
    """Dense Co-RoPE attention, the ground truth. Returns [B, Lq, Hq, D] in q's dtype.

    mask [B|1, Lq, Lk] bool: the keys each query sees (None: `visibility_mask` of segment_ids [B, L] and window, i.e.
    causal, same document, i − j < window; causal=False: bidirectional, same document, |i − j| < window, and
    a signed mileage); `mileage` [B, Hkv, Lq, Lk] overrides the contextual Δ (tests use it to fix Δ); inv_freq [D/2]
    replaces θ^(−2d/D) (a constant, not differentiated).
    """
    if not causal:
        visible = visibility_mask(q.shape[1], q.shape[1], segment_ids=segment_ids, window=window, causal=False)
        mask = visible if mask is None else mask & visible
    elif mask is None:
        mask = visibility_mask(q.shape[1], k.shape[1], segment_ids=segment_ids, window=window)
    elif segment_ids is not None or window is not None:
        mask = mask & visibility_mask(q.shape[1], k.shape[1], segment_ids=segment_ids, window=window)
    if mileage is None:
        mileage = corope_mileage(q, k, sm_scale=sm_scale, mask=mask, causal=causal)
    scores = corope_scores(q, k, mileage, theta=theta, sm_scale=sm_scale, inv_freq=inv_freq)
    return masked_softmax_attention(scores, v, mask).astype(q.dtype)


def corope_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, theta: float = 10000.0,
                     sm_scale: float | jax.Array | None = None, causal: bool = True,
                     segment_ids: jax.Array | None = None, window: int | None = None,
                     inv_freq: jax.Array | None = None, impl: str = "auto", padding_mask: jax.Array | None = None
                     ) -> jax.Array:
    """Co-RoPE attention. q [B, L, Hq, D], k/v [B, L, Hkv, D] -> [B, L, Hq, D].

    causal=False: bidirectional (every key of the document in the window, signed mileage; module docstring).
    segment_ids: int [B, L] document ids (packed documents): query i sees key j only with the same id.
    padding_mask: bool [B, L], False on padding: keys no real token sees (outputs at padding are meaningless).
    window: int >= 1, query i sees keys with i − window < j ≤ i (|i − j| < window when bidirectional). Invisible keys
    add nothing to the mileage. inv_freq: float32 [D/2] rotary frequencies replacing θ^(−2d/D) (scaled RoPE; zeros
    for the pairs that should not rotate), treated as a constant (not differentiated). sm_scale: a number, or a
    traced scalar (a learned temperature; differentiable) for every impl.
    impl: "reference" (dense), "blockwise" (pure JAX, O(L·block) memory), "pallas" (fused kernels in Pallas, lowered
    to Triton on GPU), "triton" (native Triton kernels through jax-triton, in Triton's interpreter on CPU;
    `pip install 'jaxpe[triton]'`) or "auto" (`jaxpe.dispatch.resolve_impl`: "triton" when jax-triton is installed,
    else "pallas", when lowered for CUDA; never "pallas" where jax-triton is installed); "auto" runs "blockwise" for
    inputs that fused path refuses.
    """
    causal = as_bool("causal", causal)
    check_corope_inputs(q, k, v, theta=theta, sm_scale=sm_scale)
    check_padding_mask(padding_mask, q.shape[0], q.shape[1])
    check_inv_freq(inv_freq, q.shape[3])
    _, segment_ids, window = open_attention(q, causal=causal, segment_ids=segment_ids, window=window)
    return _corope_attention(q, k, v, theta=theta, sm_scale=sm_scale, causal=causal,
                             segment_ids=fold_padding(segment_ids, padding_mask), window=window, inv_freq=inv_freq,
                             impl=impl)


class Call(NamedTuple):
    """A checked Co-RoPE call, as every path of jaxpe.dispatch.PATHS takes it: q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D],
    sm_scale (a number or a traced scalar) and the options of `corope_attention`; mask from the layer (dense
    only)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    theta: float
    sm_scale: float | jax.Array
    causal: bool
    segment_ids: jax.Array | None
    window: int | None
    inv_freq: jax.Array | None
    mask: jax.Array | None

    def options(self) -> dict:
        """The keyword arguments every path function takes."""
        return dict(theta=self.theta, sm_scale=self.sm_scale, causal=self.causal, segment_ids=self.segment_ids,
                    window=self.window, inv_freq=self.inv_freq)


def _corope_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, theta: float, sm_scale: float | jax.Array | None,
                      causal: bool, segment_ids: jax.Array | None, window: int | None, inv_freq: jax.Array | None,
                      impl: str, mask: jax.Array | None = None) -> jax.Array:
    """`corope_attention` on checked inputs, and the layer's calls: mask [B|1, Lq, Lk] (keys from a decoding cache,
    everything folded in) runs densely. The impl is chosen here, once, and run through jaxpe.dispatch.PATHS."""
    if q.shape[1] == 0 or q.shape[0] == 0:  # no queries: an empty output, as jax.nn.dot_product_attention gives
        return jnp.zeros(q.shape, q.dtype)
    call = Call(q, k, v, theta, resolve_sm_scale(sm_scale, q), causal, segment_ids, window, inv_freq, mask)
    choice = resolve_impl(impl, q.shape[1], q.shape[3], encoding="corope", batch_heads=q.shape[0] * q.shape[2],
                          causal=causal, dense=mask is not None,
                          kernel_refusal=lambda fused: refusal(fused, call))
    return run_chosen("corope", choice, call)


def reference_path(call: Call, compiled: bool) -> jax.Array:
    """The dense ground truth; on the layer's mask (which already holds the documents and the window) when given."""
    if call.mask is not None:
        return corope_attention_reference(call.q, call.k, call.v, theta=call.theta, sm_scale=call.sm_scale,
                                          mask=call.mask, inv_freq=call.inv_freq)
    warn_dense_logits(call.q.shape[0], call.q.shape[2], call.q.shape[1], call.k.shape[1],
                      "Co-RoPE's 'reference' path", "impl='auto' or 'blockwise' runs Co-RoPE in O(L·block) memory")
    return corope_attention_reference(call.q, call.k, call.v, **call.options())


def blockwise_path(call: Call, compiled: bool) -> jax.Array:
    """kernels/corope_blockwise.py: O(L·block) memory, either direction."""
    return corope_attention_blockwise(call.q, call.k, call.v, **call.options())


def pallas_path(call: Call, compiled: bool) -> jax.Array:
    """kernels/corope_pallas.py, loaded when it first runs; interpreted off a GPU unless `compiled`."""
    from jaxpe.kernels.corope_pallas import corope_attention_pallas  # Pallas loads only when this path runs

    return corope_attention_pallas(call.q, call.k, call.v, **call.options(), interpret=False if compiled else None)


def triton_path(call: Call, compiled: bool) -> jax.Array:
    """kernels/corope_triton.py through jax-triton (Triton's interpreter off a GPU), loaded when it first runs."""
    from jaxpe.kernels._triton_launch import require  # the extra to install, in words

    require()
    from jaxpe.kernels.corope_triton import corope_attention_triton  # Triton loads only when this path runs

    return corope_attention_triton(call.q, call.k, call.v, **call.options())


class CoRoPECore(nn.Module):
    """Co-RoPE inside a layer (no parameters). Documents and the window come from the context; while decoding
    (`ctx.mask` given) the dense reference runs on that mask."""

    theta: float = 10000.0
    impl: str = "auto"
    inv_freq: tuple[float, ...] | None = None  # ω_d for d < D/2 replacing θ^(−2d/D) (scaled / partial rotary)

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttentionContext) -> jax.Array:
        inv_freq = None if self.inv_freq is None else jnp.asarray(self.inv_freq, compute_dtype(q))
        return _corope_attention(q, k, v, theta=self.theta, sm_scale=None, causal=ctx.causal,
                                 segment_ids=ctx.segment_ids, window=ctx.window, inv_freq=inv_freq, impl=self.impl,
                                 mask=ctx.mask)


COROPE_SCALING = ("linear", "llama3")


@register("corope")
@dataclasses.dataclass(frozen=True)
class CoRoPEConfig(PEConfig):
    """Contextual rotary positions (leader-head mileage), with RoPE's frequency options where they make sense.

    rotary_dim R < D: the first R/2 frequency pairs rotate, ω_d = θ^(−2d/R) (pairs (d, d + D/2) as everywhere in
    Co-RoPE, which equals Hugging Face's partial layout up to a fixed permutation of the head dims that the learned
    projections absorb); the other pairs pass through (ω = 0). scaling: a Hugging Face rope_scaling dict of type
    "linear" or "llama3", which rescale ω. "dynamic" (NTK) is refused: it rescales by the current position, and Co-RoPE
    has mileage instead of positions; so is "yarn", whose attention factor would also scale Co-RoPE's gates.
    """

    theta: float = 10000.0  # base of ω_d = θ^(−2d/R) (> 0)
    rotary_dim: int | None = None  # R, the rotated dims (pairs d < R/2); None: D
    scaling: Mapping | tuple | None = None  # HF rope_scaling ("linear" or "llama3"), stored as sorted pairs

    def __post_init__(self) -> None:
        check_positive_number("theta", self.theta)
        if self.rotary_dim is not None:
            check_rotary_dim(self.rotary_dim)
        spec = rope_scaling_dict(self.scaling)
        if spec is not None and spec["rope_type"] not in COROPE_SCALING:
            raise ValueError(f"scaling rope_type={spec['rope_type']!r} is not supported by Co-RoPE (choose from "
                             f"{COROPE_SCALING}): dynamic NTK rescales by position and Co-RoPE has mileage; YaRN's "
                             "attention factor would also scale the gates")
        object.__setattr__(self, "scaling", None if spec is None else tuple(sorted(spec.items())))

    def check_layer(self, *, head_dim: int, impl: str, causal: bool = True) -> None:
        check_impl(impl, causal=causal)
        check_even_head_dim(head_dim)
        if self.rotary_dim is not None:
            check_rotary_dim(self.rotary_dim, head_dim)

    def core(self, *, head_dim: int, max_len: int, impl: str) -> nn.Module:
        self.check_layer(head_dim=head_dim, impl=impl)
        if self.rotary_dim is None and self.scaling is None:
            return CoRoPECore(theta=self.theta, impl=impl)
        rotary_dim = head_dim if self.rotary_dim is None else self.rotary_dim
        with jax.ensure_compile_time_eval():  # concrete numbers even when a model is built under jit
            freqs, _ = rope_frequencies(rotary_dim, theta=self.theta, scaling=self.scaling)
        freqs = np.concatenate([np.asarray(freqs, np.float64), np.zeros((head_dim - rotary_dim) // 2)])
        return CoRoPECore(theta=self.theta, impl=impl, inv_freq=tuple(float(f) for f in freqs))
