"""CoPE, contextual position encoding (Golovneva et al., 2024, arXiv:2405.18719), as in the paper.

B batch, Lq/Lk query/key length, Hq query heads, Hkv key/value heads (G = Hq // Hkv), D head dim, npos table rows.
1. gates g_ij = sigmoid(sm_scale · q_i·kg_j), kg = k (default), a separate key projection or the values; 0 for j > i;
2. positions p_ij = Σ_{t=j..i} g_it (reverse cumulative sum over keys, diagonal included), clamped to npos − 1;
3. integer position logits z_ip = q_i·e[p] ([Lq, npos] matmul, never an embedding per (i, j) pair);
4. interpolation pos_ij = (1 − w)·z_i⌊p⌋ + w·z_i⌈p⌉, w = p − ⌊p⌋ (gradient through w only);
5. logits_ij = sm_scale·(q_i·k_j + pos_ij), causal softmax, times v.

Bidirectional attention (causal=False, "reference" and "blockwise"; x-transformers' data-dependent ALiBi counts the
same way): the gates cover every visible key, g_it = sigmoid(sm_scale·q_i·kg_t), and positions count them from the
query to the key in either direction, p_ij = Σ_{t=j..i} g_it for j ≤ i and p_ij = Σ_{t=i..j} g_it for j ≥ i (the
diagonal once: p_ii = g_ii), clamped to npos − 1; steps 3-5 as above, with an unmasked softmax.

Packed documents and sliding windows (every impl): key j is visible to query i iff j ≤ i (either side when
bidirectional), segment_ids[b, i] == segment_ids[b, j] (when given; padding is a document id of its own) and
|i − j| < window (when given). Invisible keys have gate 0, so positions count only keys of the query's document
inside its window: they restart at each document.

sm_scale may be a traced scalar (a learned temperature, differentiable) in every impl; its value is checked only
where it is concrete.

x-transformers' CoPE variants (off by default; dense, so impl "auto" runs the reference and "blockwise", "pallas"
and "triton" refuse them):
- soft one-hot readout (`soft_onehot_temp`): pos_ij = Σ_p softmax_p(−|p_ij − p| / temp)·z_ip over p = 0..npos − 1
  instead of the linear interpolation (an [L, L, npos] tensor per head);
- talking heads (`talking_heads`, a learned [Hq, Hq] matrix W, identity at init): the gate logits
  s_ij = sm_scale·q_i·kg_j are mixed across heads, s'_hij = Σ_h' W_hh'·s_h'ij, before the sigmoid (x-transformers'
  1×1 Conv2d over heads without bias); invisible keys still get gate 0. It couples the heads.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpe.attention_core import AttentionContext
from jaxpe.dispatch import refusal, resolve_impl, run_chosen
from jaxpe.base import compute_dtype
from jaxpe.kernels.cope_blockwise import cope_attention_blockwise
from jaxpe.kv_cache import update_cache
from jaxpe.registry import PEConfig, pe_config, pe_names, register
from jaxpe.sharding import partitioned
from jaxpe.softmax_attention import (causal_mask, causal_query_blocks, fold_padding, masked_softmax_attention,
                                    qk_logits, resolve_sm_scale, reverse_cumsum, visibility_mask, warn_dense_logits)
from jaxpe.tables import context_relative_logits, gather_table_row_pairs
from jaxpe.validation import (as_bool, check_array, check_attention_mask, check_bool, check_choice,
                              check_cope_inputs, check_gate_k, check_impl, check_int, check_npos,
                              check_padding_mask, check_pos_emb, check_positive_number, check_qkv,
                              check_queries_last, check_sm_scale, open_attention)

GATE_SOURCES = ("keys", "sep_keys", "values")


def check_talking_heads(talking_heads: jax.Array | None, num_heads: int) -> None:
    """The talking-heads mix is None or a float [Hq, Hq] matrix."""
    if talking_heads is None:
        return
    check_array("talking_heads", talking_heads, "Hq Hq")
    if talking_heads.shape != (num_heads, num_heads) or not jnp.issubdtype(talking_heads.dtype, jnp.floating):
        raise ValueError(f"talking_heads must be a float [Hq={num_heads}, Hq={num_heads}] matrix, got "
                         f"talking_heads.shape={tuple(talking_heads.shape)} dtype={talking_heads.dtype}")


def check_soft_onehot_temp(soft_onehot_temp: float | None) -> None:
    """The soft one-hot temperature is None (linear interpolation) or a number > 0, finite (Python's or NumPy's)."""
    if soft_onehot_temp is not None:
        check_positive_number("soft_onehot_temp", soft_onehot_temp)


def check_dense_impl(impl: str) -> None:
    """The soft one-hot readout and talking heads run only densely: impl must be "auto" or "reference"."""
    check_impl(impl)
    if impl not in ("auto", "reference"):
        raise ValueError(f"impl={impl!r} cannot run CoPE's soft one-hot readout or talking heads: the soft one-hot "
                         f"readout weighs every table row for every (query, key) pair (O(L²·npos)) and talking "
                         f"heads mix the gate logits of all heads, so both are dense only; use impl='auto' or "
                         f"'reference'")


def cope_positions(q: jax.Array, k: jax.Array, *, npos: int, sm_scale: float | jax.Array | None = None,
                   gate_k: jax.Array | None = None, mask: jax.Array | None = None,
                   talking_heads: jax.Array | None = None, causal: bool = True) -> jax.Array:
    """Contextual positions p [B, Hq, Lq, Lk] (float32; float64 from float64 inputs), clamped to npos − 1 (0 where
    j > i when causal).

    q [B, Lq, Hq, D]; k or gate_k [B, Lk, Hkv, D]; mask [B|1, Lq, Lk] bool, None: causal (queries last), or every
    key when causal=False (positions then count gates both ways, see the module docstring); talking_heads [Hq, Hq]
    mixes the gate logits across heads before the sigmoid (x-transformers).
    """
    causal = as_bool("causal", causal)
    _check_position_inputs(q, k, gate_k, npos=npos, talking_heads=talking_heads, mask=mask, causal=causal,
                           sm_scale=sm_scale)
    sm_scale = resolve_sm_scale(sm_scale, q)
    if mask is None:
        mask = _default_mask(q.shape[1], k.shape[1], causal)
    logits = qk_logits(q, k if gate_k is None else gate_k, gates=True)
    return _positions_from_logits(sm_scale * logits, mask, npos=npos, talking_heads=talking_heads, causal=causal)


def _default_mask(lq: int, lk: int, causal: bool) -> jax.Array:
    """[1, Lq, Lk] bool: causal (queries last), or every key."""
    return causal_mask(lq, lk) if causal else jnp.ones((1, lq, lk), jnp.bool_)


def _check_position_inputs(q: jax.Array, k: jax.Array, gate_k: jax.Array | None, *, npos: int,
                           talking_heads: jax.Array | None, mask: jax.Array | None, causal: bool,
                           sm_scale: float | jax.Array | None) -> None:
    """ValueError/TypeError naming the argument unless q, k (and gate_k), npos, talking_heads, the mask, causal and
    sm_scale fit together."""
    check_qkv(q, k, k)
    check_npos(npos)
    if gate_k is not None:
        check_gate_k(gate_k, k)
    check_talking_heads(talking_heads, q.shape[2])
    check_attention_mask(mask, q.shape[0], q.shape[1], k.shape[1])
    check_queries_last(q, k, mask)
    check_bool("causal", causal)
    check_sm_scale(sm_scale)


def _positions_from_logits(logits: jax.Array, mask: jax.Array, *, npos: int, talking_heads: jax.Array | None,
                           causal: bool = True) -> jax.Array:
    """`cope_positions` from the scaled gate logits [B, Hq, Lq, Lk] and mask [B|1, Lq, Lk]."""
    if talking_heads is not None:
        logits = jnp.einsum("hg,bgqk->bhqk", talking_heads.astype(logits.dtype), jnp.where(mask[:, None], logits, 0.0))
    gates = jnp.where(mask[:, None], jax.nn.sigmoid(logits), 0.0)  # [B, Hq, Lq, Lk]
    if causal:
        positions = reverse_cumsum_keys(gates)
    else:  # Σ_{t=j..i} g_it for the keys up to the query, Σ_{t=i..j} g_it for those from it on
        lq, lk = logits.shape[-2:]
        i = jnp.arange(lq)[:, None] + (lk - lq)  # queries are the last Lq of the Lk positions
        j = jnp.arange(lk)[None, :]
        up_to_query, from_query = j <= i, j >= i  # [Lq, Lk]
        positions = jnp.where(up_to_query, reverse_cumsum_keys(jnp.where(up_to_query, gates, 0.0)),
                              _cumsum_keys(jnp.where(from_query, gates, 0.0), reverse=False))
    lk = logits.shape[-1]
    if isinstance(lk, int) and lk < npos - 1:  # gates are <= 1, so p <= Lk < npos − 1: the clamp never binds
        return positions
    return jnp.minimum(positions, npos - 1)


CUMSUM_MATMUL_MAX_LENGTH = 256  # up to this many keys the gate sums are a triangular matmul, beyond it a scan


def reverse_cumsum_keys(gates: jax.Array) -> jax.Array:
    """Suffix sums over keys, gates [..., Lk] -> [..., Lk] (float32, float64 for float64 gates),
    out[..., j] = Σ_{t≥j} gates[..., t].

    Up to CUMSUM_MATMUL_MAX_LENGTH keys a product with the triangular [Lk, Lk] matrix [t ≥ j] (exact products,
    2·Lk flops per sum, one matmul forward and one backward), which on CPU costs a fraction of the associative
    scan's ~2·log2(Lk) passes of pads and slices; beyond it the scan (O(Lk) per row).
    """
    return _cumsum_keys(gates, reverse=True)


def _cumsum_keys(gates: jax.Array, *, reverse: bool) -> jax.Array:
    """Sums over keys, gates [..., Lk] -> [..., Lk] in `compute_dtype`: Σ_{t≥j} (reverse) or Σ_{t≤j} gates[..., t], as
    `reverse_cumsum_keys` computes them; at a symbolic length (jax.export), where neither the size test nor the
    associative scan can run, lax.cumsum."""
    lk = gates.shape[-1]
    gates = gates.astype(compute_dtype(gates))
    if not isinstance(lk, int):
        return jax.lax.cumsum(gates, axis=gates.ndim - 1, reverse=reverse)
    if lk > CUMSUM_MATMUL_MAX_LENGTH:
        return reverse_cumsum(gates) if reverse else jax.lax.cumsum(gates, axis=gates.ndim - 1)
    t, j = jnp.arange(lk)[:, None], jnp.arange(lk)[None, :]
    triangle = (t >= j if reverse else t <= j).astype(gates.dtype)  # [t, j]
    return jnp.matmul(gates, triangle, precision=jax.lax.Precision.HIGHEST)


def interpolate_table_rows(z: jax.Array, positions: jax.Array) -> jax.Array:
    """z [B, Lq, Hq, P] (query i's logit for each table row), positions [B, Hq, Lq, Lk] in [0, P − 1] ->
    [B, Hq, Lq, Lk] in z's dtype, position p of query i in head h read as `interpolate` of z[b, i, h] does
    (gradient through w and z), in the form z[lo] + w·(z[hi] − z[lo]) so that one gather reads both terms
    (`gather_table_row_pairs`); at w = 0 the step to a non-finite next row adds nothing. Symbolic shapes
    (jax.export), whose flat indices cannot be sized when tracing, read each table by take_along_axis."""
    lo = jax.lax.stop_gradient(jnp.floor(positions))
    w = positions - lo
    step = jnp.concatenate([z[..., 1:], z[..., -1:]], axis=-1) - z  # z[min(k + 1, P − 1)] − z[k]
    index = lo.astype(jnp.int32)
    if all(isinstance(size, int) for size in z.shape):
        at_lo, step_at_lo = gather_table_row_pairs(z, step, index)
    else:
        at_lo, step_at_lo = (jnp.take_along_axis(jnp.swapaxes(t, 1, 2), index, axis=-1) for t in (z, step))
    return at_lo + w * jnp.where((w > 0.0) | jnp.isfinite(step_at_lo), step_at_lo, 0.0)


def cope_position_logits(q: jax.Array, pos_emb: jax.Array, positions: jax.Array, *,
                         soft_onehot_temp: float | None = None) -> jax.Array:
    """Position logits [B, Hq, Lq, Lk] (in q's `compute_dtype`) from q [B, Lq, Hq, D], pos_emb [npos, D] or
    [Hq, npos, D], positions [B, Hq, Lq, Lk] in [0, npos − 1]: interpolated, or with soft_onehot_temp the soft
    one-hot readout Σ_p softmax_p(−|positions − p| / temp)·z_p (x-transformers; builds [B, Hq, Lq, Lk, npos])."""
    npos = pos_emb.shape[-2]
    if soft_onehot_temp is None:
        spec = "bqhd,pd->bqhp" if pos_emb.ndim == 2 else "bqhd,hpd->bqhp"
        z = jnp.einsum(spec, q, pos_emb.astype(q.dtype), preferred_element_type=compute_dtype(q))  # [B, Lq, Hq, P]
        return interpolate_table_rows(z, positions)
    spec = "bqhd,pd->bhqp" if pos_emb.ndim == 2 else "bqhd,hpd->bhqp"
    z = jnp.einsum(spec, q, pos_emb.astype(q.dtype), preferred_element_type=compute_dtype(q))  # [B, Hq, Lq, P]
    table_rows = jnp.arange(npos, dtype=z.dtype).reshape((1,) * positions.ndim + (npos,))
    distance = jnp.abs(positions[..., None] - table_rows)  # [B, Hq, Lq, Lk, npos]
    weights = jax.nn.softmax(-distance / soft_onehot_temp, axis=-1)
    return jnp.einsum("bhqkp,bhqp->bhqk", weights, z)


def cope_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, pos_emb: jax.Array, *,
                             sm_scale: float | jax.Array, gate_k: jax.Array | None = None,
                             mask: jax.Array | None = None, extra_logits: jax.Array | None = None,
                             soft_onehot_temp: float | None = None, talking_heads: jax.Array | None = None,
                             causal: bool = True) -> jax.Array:
    """Dense CoPE attention, the ground truth: O(L²) memory. Returns [B, Lq, Hq, D] in q's dtype.

    mask [B|1, Lq, Lk] bool (None: causal, queries last, or every key when causal=False); causal=False counts
    positions both ways from the query (module docstring); extra_logits [B, Hq, Lq, Lk] is added to q·k before
    scaling (the paper's "cope+rel" adds relative position logits here); soft_onehot_temp and talking_heads
    [Hq, Hq] select x-transformers' variants (see the module docstring). sm_scale may be a traced scalar.
    """
    check_qkv(q, k, v)
    check_pos_emb(pos_emb, q.shape[2], q.shape[3])
    _check_position_inputs(q, k, gate_k, npos=pos_emb.shape[-2], talking_heads=talking_heads, mask=mask,
                           causal=causal, sm_scale=sm_scale)
    return _cope_dense(q, k, v, pos_emb, sm_scale=sm_scale, gate_k=gate_k, mask=mask, extra_logits=extra_logits,
                       soft_onehot_temp=soft_onehot_temp, talking_heads=talking_heads, causal=causal)


def _cope_dense(q: jax.Array, k: jax.Array, v: jax.Array, pos_emb: jax.Array, *, sm_scale: float | jax.Array,
                gate_k: jax.Array | None, mask: jax.Array | None, extra_logits: jax.Array | None,
                soft_onehot_temp: float | None, talking_heads: jax.Array | None, causal: bool = True) -> jax.Array:
    """`cope_attention_reference` on inputs already checked."""
    if mask is None:
        mask = _default_mask(q.shape[1], k.shape[1], causal)
    # One q·k for the gates (when they read k) and the logits: one backward through it.
    content = qk_logits(q, k, gates=gate_k is None)
    gate_logits = content if gate_k is None else qk_logits(q, gate_k, gates=True)
    positions = _positions_from_logits(sm_scale * gate_logits, mask, npos=pos_emb.shape[-2],
                                       talking_heads=talking_heads, causal=causal)
    if soft_onehot_temp is None and isinstance(k.shape[1], int):  # gates are <= 1, so p <= Lk: rows past Lk + 1
        pos_emb = pos_emb[..., :min(pos_emb.shape[-2], k.shape[1] + 2), :]  # are never read (the readout is)
    logits = content + cope_position_logits(q, pos_emb, positions, soft_onehot_temp=soft_onehot_temp)
    if extra_logits is not None:
        logits = logits + extra_logits
    return masked_softmax_attention(sm_scale * logits, v, mask).astype(q.dtype)


def cope_attention_causal(q: jax.Array, k: jax.Array, v: jax.Array, pos_emb: jax.Array, *, sm_scale: float,
                          gate_k: jax.Array | None = None, mask: jax.Array | None = None,
                          extra_logits: jax.Array | None = None, soft_onehot_temp: float | None = None,
                          talking_heads: jax.Array | None = None) -> jax.Array:
    """`cope_attention_reference` for self-attention (Lq == Lk = L) under a causal mask (None, or [B|1, L, L] that
    hides every j > i), run by `causal_query_blocks`: block [s, e) against keys [0, e), whose gates are all that its
    positions sum. The same result with a third fewer [B, H, L, L] entries in every dense pass (longer sequences).
    Inputs are trusted (the entry points check them)."""
    outputs = []
    # the blocks' products read q, k, v heads first: cut there, a block is a slice, not a slice and a transpose
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    tokens = lambda x, start, end: jnp.swapaxes(x[:, :, start:end], 1, 2)
    for start, end in causal_query_blocks(q.shape[2]):
        outputs.append(_cope_dense(
            tokens(q, start, end), tokens(k, 0, end), tokens(v, 0, end), pos_emb, sm_scale=sm_scale,
            gate_k=None if gate_k is None else gate_k[:, :end], mask=None if mask is None else mask[:, start:end, :end],
            extra_logits=None if extra_logits is None else extra_logits[:, :, start:end, :end],
            soft_onehot_temp=soft_onehot_temp, talking_heads=talking_heads))
    return outputs[0] if len(outputs) == 1 else jnp.concatenate(outputs, axis=1)


def cope_attention(q: jax.Array, k: jax.Array, v: jax.Array, pos_emb: jax.Array, *,
                   sm_scale: float | jax.Array | None = None, causal: bool = True, gate_k: jax.Array | None = None,
                   segment_ids: jax.Array | None = None, window: int | None = None,
                   soft_onehot_temp: float | None = None, talking_heads: jax.Array | None = None,
                   impl: str = "auto", padding_mask: jax.Array | None = None) -> jax.Array:
    """CoPE attention. q [B, L, Hq, D], k/v [B, L, Hkv, D], pos_emb [npos, D] or [Hq, npos, D],
    gate_k [B, L, Hkv, D] (keys used for the gates; None means k) -> [B, L, Hq, D].

    sm_scale: None (D^−½), a number > 0, or a traced scalar (a learned temperature: differentiable in every impl).
    causal=False: bidirectional attention, positions counted from the query to the key in either direction (module
    docstring); impl "reference" and "blockwise" ("auto" picks one of them), not "pallas" or "triton".
    segment_ids [B, L] int: packed documents (keys visible only from queries with the same id; positions restart at
    each document); padding_mask bool [B, L], False on padding: keys no real token sees, no gate either (outputs at
    padding are meaningless); window: each query sees itself and the window − 1 keys before it (and after it when
    bidirectional; blocks outside are skipped by "blockwise" and the fused kernels). soft_onehot_temp (> 0) and
    talking_heads [Hq, Hq]: x-transformers' variants, dense only (the reference path).
    impl: "reference" (dense, the ground truth), "blockwise" (pure JAX, O(L·block) memory), "pallas" (fused kernels
    in Pallas, lowered to Triton on GPU), "triton" (native Triton kernels through jax-triton, in Triton's interpreter
    on CPU; `pip install 'jaxpe[triton]'`) or "auto" (`jaxpe.dispatch.resolve_impl`: "triton" when jax-triton is
    installed, else "pallas", when lowered for CUDA, and "blockwise" for inputs that one refuses; dense ones run by
    causal query blocks, `cope_attention_causal`: the same result up to float rounding, which can move a position
    across an integer and so pick the other one-sided slope of the interpolation).
    A symbolic length (jax.export) runs "reference" in one block, or "blockwise".
    """
    causal = as_bool("causal", causal)
    check_cope_inputs(q, k, v, pos_emb, gate_k, sm_scale=sm_scale)
    check_padding_mask(padding_mask, q.shape[0], q.shape[1])
    _, segment_ids, window = open_attention(q, causal=causal, segment_ids=segment_ids, window=window)
    check_soft_onehot_temp(soft_onehot_temp)
    check_talking_heads(talking_heads, q.shape[2])
    if soft_onehot_temp is not None or talking_heads is not None:
        check_dense_impl(impl)
    return _cope_attention(q, k, v, pos_emb, sm_scale=sm_scale, causal=causal, gate_k=gate_k,
                           segment_ids=fold_padding(segment_ids, padding_mask), window=window,
                           soft_onehot_temp=soft_onehot_temp, talking_heads=talking_heads, impl=impl)


class Call(NamedTuple):
    """A checked CoPE call, as every path of jaxpe.dispatch.PATHS takes it: q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D],
    pos_emb, gate_k, sm_scale (a Python float or a traced scalar) and the options of `cope_attention`; mask and
    extra_logits from the layer (dense only); impl as asked (the reference path runs by query blocks unless asked by
    name)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    pos_emb: jax.Array
    gate_k: jax.Array | None
    sm_scale: float | jax.Array
    causal: bool
    segment_ids: jax.Array | None
    window: int | None
    impl: str
    soft_onehot_temp: float | None
    talking_heads: jax.Array | None
    mask: jax.Array | None
    extra_logits: jax.Array | None

    @property
    def dense_only(self) -> bool:
        """Whether an option only the dense path has is set."""
        return any(x is not None for x in (self.soft_onehot_temp, self.talking_heads, self.mask, self.extra_logits))


def _cope_attention(q: jax.Array, k: jax.Array, v: jax.Array, pos_emb: jax.Array, *,
                    sm_scale: float | jax.Array | None, causal: bool, gate_k: jax.Array | None,
                    segment_ids: jax.Array | None, window: int | None, impl: str,
                    soft_onehot_temp: float | None = None, talking_heads: jax.Array | None = None,
                    mask: jax.Array | None = None, extra_logits: jax.Array | None = None) -> jax.Array:
    """`cope_attention` on checked inputs, and the layer's calls: mask [B|1, Lq, Lk] (keys from a decoding cache,
    everything folded in) and extra_logits [B, Hq, Lq, Lk] ("cope+rel") run densely. The impl is chosen here, once,
    and run through jaxpe.dispatch.PATHS."""
    if q.shape[1] == 0 or q.shape[0] == 0:  # no queries: an empty output, as jax.nn.dot_product_attention gives
        return jnp.zeros(q.shape, q.dtype)
    call = Call(q, k, v, pos_emb, gate_k, resolve_sm_scale(sm_scale, q), causal, segment_ids, window, impl,
                soft_onehot_temp, talking_heads, mask, extra_logits)
    choice = resolve_impl(impl, q.shape[1], q.shape[3], encoding="cope", batch_heads=q.shape[0] * q.shape[2],
                          causal=causal, dense=call.dense_only,
                          kernel_refusal=lambda fused: refusal(fused, call))
    return run_chosen("cope", choice, call)


def reference_path(call: Call, compiled: bool) -> jax.Array:
    """The dense path: causal self-attention by query blocks (`cope_attention_causal`) unless impl="reference" was
    asked for by name or a mask is given, else the one-block ground truth."""
    q, k, length = call.q, call.k, call.q.shape[1]
    warn_dense_logits(q.shape[0], q.shape[2], length, k.shape[1], "CoPE's 'reference' path",
                      "impl='auto' or 'blockwise' runs CoPE in O(L·block) memory" if not call.dense_only else
                      "the options asked for (soft one-hot, talking heads, cope+rel, a decoding cache) need it")
    by_blocks = call.impl != "reference" and call.causal and isinstance(length, int) and call.mask is None
    visible = call.mask
    if call.mask is None and (not call.causal or call.segment_ids is not None or call.window is not None):
        visible = visibility_mask(length, length, segment_ids=call.segment_ids, window=call.window,
                                  causal=call.causal)
    options = dict(sm_scale=call.sm_scale, gate_k=call.gate_k, mask=visible, extra_logits=call.extra_logits,
                   soft_onehot_temp=call.soft_onehot_temp, talking_heads=call.talking_heads)
    if by_blocks:
        return cope_attention_causal(q, k, call.v, call.pos_emb, **options)
    return _cope_dense(q, k, call.v, call.pos_emb, causal=call.causal, **options)


def blockwise_path(call: Call, compiled: bool) -> jax.Array:
    """kernels/cope_blockwise.py: O(L·block) memory, either direction."""
    return cope_attention_blockwise(call.q, call.k, call.v, call.pos_emb, call.gate_k, sm_scale=call.sm_scale,
                                    causal=call.causal, segment_ids=call.segment_ids, window=call.window)


def pallas_path(call: Call, compiled: bool) -> jax.Array:
    """kernels/cope_pallas.py, loaded when it first runs; interpreted off a GPU unless `compiled`."""
    from jaxpe.kernels.cope_pallas import cope_attention_pallas  # Pallas loads only when this path runs

    return cope_attention_pallas(call.q, call.k, call.v, call.pos_emb, call.gate_k, sm_scale=call.sm_scale,
                                 segment_ids=call.segment_ids, window=call.window,
                                 interpret=False if compiled else None)


def triton_path(call: Call, compiled: bool) -> jax.Array:
    """kernels/cope_triton.py through jax-triton (Triton's interpreter off a GPU), loaded when it first runs."""
    from jaxpe.kernels._triton_launch import require  # the extra to install, in words

    require()
    from jaxpe.kernels.cope_triton import cope_attention_triton  # Triton loads only when this path runs

    return cope_attention_triton(call.q, call.k, call.v, call.pos_emb, call.gate_k, sm_scale=call.sm_scale,
                                 segment_ids=call.segment_ids, window=call.window)


class CoPECore(nn.Module):
    """CoPE inside a layer: owns the position table (unless one shared by all layers is passed), the separate gate
    keys for "sep_keys", the relative table for "cope+rel" and the talking-heads matrix [Hq, Hq]."""

    npos: int
    gates: str = "keys"
    per_head: bool = False
    add_relative: bool = False
    impl: str = "auto"
    soft_onehot: bool = False
    soft_onehot_temp: float = 0.05
    talking_heads: bool = False
    shared_table: bool = False  # the table is shared by all layers: the caller passes it as ctx.pos_emb

    @nn.compact
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttentionContext) -> jax.Array:
        hq, d = q.shape[2], q.shape[3]
        pos_emb = ctx.pos_emb
        shape, names = ((hq, self.npos, d), ("heads", "positions", "head_dim")) if self.per_head else (
            (self.npos, d), ("positions", "head_dim"))
        if pos_emb is not None:  # a table shared by all layers, passed in by the caller
            check_pos_emb(pos_emb, hq, d)
            if self.shared_table and tuple(pos_emb.shape) != shape:
                raise ValueError(f"pos_emb.shape={tuple(pos_emb.shape)}, but this CoPE (shared_table=True, "
                                 f"npos={self.npos}, per_head={self.per_head}) reads a shared table of shape {shape}")
        elif self.shared_table:
            raise ValueError(f"pos_emb is None, but this CoPE (shared_table=True) shares one position table {shape} "
                             "across layers, owned by the model: pass it as pos_emb")
        else:
            pos_emb = self.param("pos_emb", partitioned(nn.initializers.normal(0.02), *names), shape,
                                 ctx.table_dtype)
        gate_k = None
        if self.gates == "values":
            gate_k = v
        elif self.gates == "sep_keys":
            gate_k = nn.DenseGeneral((k.shape[2], d), use_bias=False, dtype=q.dtype, param_dtype=ctx.table_dtype,
                                     name="gate_key",
                                     kernel_init=partitioned(nn.initializers.lecun_normal(), "embed", "kv_heads",
                                                             "head_dim"))(ctx.x)
            if ctx.decode:
                gate_k = update_cache(self, "gate_keys", gate_k, ctx.cache_index)
        pos_emb = pos_emb.astype(q.dtype)
        talking = None
        if self.talking_heads:  # starts as plain CoPE
            identity = lambda key, shape, dtype=jnp.float32: jnp.eye(shape[0], dtype=dtype)  # noqa: E731
            talking = self.param("talking_heads", partitioned(identity, None, None), (hq, hq),  # couples all heads
                                 ctx.table_dtype)
        extra = None
        if self.add_relative:
            table = self.param("rel_table", partitioned(nn.initializers.normal(0.02), "positions", "head_dim"),
                               (self.npos, d), ctx.table_dtype)
            extra = context_relative_logits(q, table, ctx)
        return _cope_attention(q, k, v, pos_emb, sm_scale=d ** -0.5, causal=ctx.causal, gate_k=gate_k,
                               segment_ids=ctx.segment_ids, window=ctx.window, impl=self.impl,
                               soft_onehot_temp=self.soft_onehot_temp if self.soft_onehot else None,
                               talking_heads=talking, mask=ctx.mask, extra_logits=extra)


@register("cope")
@dataclasses.dataclass(frozen=True)
class CoPEConfig(PEConfig):
    """CoPE with the paper's options.

    `npos` defaults to the block size + 1, max_len + 1 (the paper's default): no position inside a block is clamped.
    That default ties the position tables' shape to max_len: parameters trained at one max_len load into a model of
    another only with npos set to their tables' rows (loading them otherwise is an error that says so). Positions
    beyond npos − 1 are clamped, so a smaller npos works at any length.
    """

    size_option: ClassVar[str] = "npos"
    tables: ClassVar[tuple[str, ...]] = ("pos_emb", "rel_table", "shared_pos_emb")
    npos: int | None = None  # position table rows (int >= 2); None: max_len + 1, so the tables' shape follows max_len
    gates: str = "keys"  # gate keys: "keys" (q·k), "sep_keys" (a separate key projection) or "values" (q·v)
    per_head: bool = False  # one table per head [Hq, npos, D] instead of one shared by the heads [npos, D]
    shared_table: bool = False  # one table shared by all layers (owned by the model)
    add_relative: bool = False  # "cope+rel": add learned relative position logits
    every: int = 1  # older form of ModelConfig.layer_pe (which it maps to): CoPE on layers 0, every, 2·every, ...
    other_layers: str = "none"  # with `every`: encoding name of the layers without CoPE
    # x-transformers' variants (dense only: impl "auto" runs the reference path, the others refuse them).
    soft_onehot: bool = False  # position logit Σ_p softmax_p(−|p_ij − p| / temp)·z_ip instead of interpolation
    soft_onehot_temp: float = 0.05  # temp of the soft one-hot readout (> 0; small is close to rounding p)
    talking_heads: bool = False  # mix the gate logits across heads with a learned [Hq, Hq] matrix (identity at init)

    def __post_init__(self) -> None:
        if self.npos is not None:
            check_npos(self.npos)
        check_choice("gates", self.gates, GATE_SOURCES)
        for name in ("per_head", "shared_table", "add_relative", "soft_onehot", "talking_heads"):
            check_bool(name, getattr(self, name))
        check_int("every", self.every, 1)
        check_choice("other_layers", self.other_layers, pe_names())
        if self.other_layers == "cope":
            raise ValueError("other_layers='cope' would make every layer CoPE; use every=1")
        if pe_config(self.other_layers).additive:
            raise ValueError(f"other_layers={self.other_layers!r} names additive encoding {self.other_layers!r}, "
                             "which acts on the token embeddings, not inside a layer: the layers without CoPE would "
                             "get no positions; use 'none' or an encoding that acts in attention")
        check_positive_number("soft_onehot_temp", self.soft_onehot_temp)

    def check_layer(self, *, head_dim: int, impl: str, causal: bool = True) -> None:
        check_impl(impl, causal=causal)
        if self.soft_onehot or self.talking_heads:
            check_dense_impl(impl)

    def core(self, *, head_dim: int, max_len: int, impl: str) -> nn.Module:
        self.check_layer(head_dim=head_dim, impl=impl)
        return CoPECore(npos=self.table_rows(max_len), gates=self.gates, per_head=self.per_head,
                        add_relative=self.add_relative, impl=impl, soft_onehot=self.soft_onehot,
                        soft_onehot_temp=self.soft_onehot_temp, talking_heads=self.talking_heads,
                        shared_table=self.shared_table)

    def causal_only(self) -> str | None:
        if self.add_relative:
            return "its 'cope+rel' term (add_relative=True) reads relative logits of keys at or before the query"
        return None

    def shared_table_shape(self, *, head_dim: int, num_heads: int, max_len: int) -> tuple[int, ...] | None:
        if not self.shared_table:
            return None
        npos = self.table_rows(max_len)
        return (num_heads, npos, head_dim) if self.per_head else (npos, head_dim)
