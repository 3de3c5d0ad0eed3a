"""Multi-head attention with MHA/GQA/MQA, any registered encoding, and a KV cache for decoding.

B batch, L length (Lq new tokens, S cache length), Hq query heads, Hkv key/value heads, D head dim.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.attention_core import AttentionContext
from jaxpe.dropout import Dropout
from jaxpe.kv_cache import check_cache, update_cache
from jaxpe.registry import PEConfig, as_pe_config
from jaxpe.sharding import check_restored_params, partitioned
from jaxpe.softmax_attention import fold_padding, visibility_mask
from jaxpe.validation import (check_array, check_bool, check_float, check_float_dtype, check_fraction, check_impl,
                              check_int, check_padding_mask, check_segment_ids, check_window)


class Attention(nn.Module):
    """Self-attention x [B, L, d_model] -> [B, L, d_model], causal (a decoder) or, with causal=False, bidirectional
    (an encoder: every token sees every token of its document within the window, before and after it).

    `pe` is an encoding config (`jaxpe.pe_config(name, **options)`) or a name, which takes the default options. Every
    field is checked at construction (a ValueError names it and its value).
    With `decode=True` keys and values are cached: the first call (at `init`) must see an input of the full cache
    length S; later calls append their Lq tokens (prefill with many, then one at a time). Encodings whose positions
    depend on the query (CoPE, Co-RoPE) recompute them over the cached keys, O(S) per decoded token.
    Dropout is applied to the output projection (attention-probability dropout would defeat fused kernels); it is
    off when `deterministic` is True: the call's argument when given, else the field (None: True), as in
    `flax.linen.MultiHeadDotProductAttention`. Rematerialised, `nn.remat(Attention)` traces every argument it does
    not hold static: set `deterministic` as the field, or pass it positionally, `nn.remat(Attention,
    static_argnums=(2,))(...)(x, False)` (argument 0 is the module).
    Bidirectional layers (causal=False) take the encodings that run both ways (`PEConfig.causal_only` says why the
    others do not: a ValueError at construction) and do not decode.

    Stacks of layers: `nn.scan(..., variable_axes={"params": 0}, split_rngs={"params": True})` over a module calling
    Attention needs no `metadata_params` (jaxpe/sharding.py: the stacked axis is unnamed unless
    `metadata_params={nn.PARTITION_NAME: name}` names it). `apply` takes the parameters boxed (as `init` gives them)
    or unboxed (`flax.linen.meta.unbox`).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    pe: PEConfig | str
    max_len: int = 512
    dropout: float = 0.0
    impl: str = "auto"
    dtype: Any = jnp.float32
    window: int | None = None  # sliding window: each query sees itself and the window − 1 keys before it
    # the projections' weights; position parameters (tables, gate networks) stay float32 (float64 if this is)
    param_dtype: Any = jnp.float32
    check_inputs: bool = True  # False where the caller has checked inputs and parameters once (TransformerLM)
    causal: bool = True  # False: bidirectional attention (an encoder layer; no decoding)
    deterministic: bool | None = None  # dropout off; a call's `deterministic` overrides it; None: True

    def __post_init__(self) -> None:
        object.__setattr__(self, "pe", as_pe_config(self.pe))
        for name in ("num_heads", "num_kv_heads", "head_dim", "max_len"):
            check_int(name, getattr(self, name), 1)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        check_fraction("dropout", self.dropout, one=False)
        check_impl(self.impl)
        check_window(self.window)
        if self.window is not None:
            object.__setattr__(self, "window", int(self.window))  # NumPy ints too: the kernels take Python ints
        check_float_dtype("dtype", self.dtype)
        check_float_dtype("param_dtype", self.param_dtype)
        check_bool("causal", self.causal)
        if self.deterministic is not None:
            check_bool("deterministic", self.deterministic)
        self.pe.check_causal(self.causal)
        self.pe.check_layer(head_dim=self.head_dim, impl=self.impl, causal=self.causal)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool | None = None, *, decode: bool = False,
                 pos_emb: jax.Array | None = None, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, padding_mask: jax.Array | None = None) -> jax.Array:
        """x [B, L, d_model]; deterministic (dropout off; None: the field's) may be positional; positions [B, L]
        int (default: the index within each run of equal document ids; while decoding, a document the cache ends in
        goes on from its cached position, `decode_positions`) feed the index-based encodings; segment_ids [B, L]
        int (packed documents: no attention across ids); padding_mask [B, L] bool (False: padding, a key no real
        token sees)."""
        check_array("x", x, "B, L, d_model")
        if decode and not self.causal:
            raise ValueError("decode=True needs causal attention, but this layer has causal=False (bidirectional: "
                             "every token sees the tokens after it, which a decoder has not produced yet)")
        deterministic = resolve_deterministic(self.deterministic, deterministic)
        if x.ndim != 3:
            raise ValueError(f"x must have shape [B, L, d_model], got x.shape={tuple(x.shape)}")
        if decode:
            check_cache(self, x.shape[0], "cached_key")
        check_float("x", x)
        b, length, d_model = x.shape
        if self.check_inputs:
            if not self.is_initializing():
                params = self.variables.get("params", {})
                check_restored_params(params)
                check_width(params, d_model)
                self.pe.check_params(params.get("pe", {}), max_len=self.max_len)
            check_token_inputs(b, length, positions=positions, segment_ids=segment_ids, padding_mask=padding_mask)
        init = nn.initializers.lecun_normal()
        proj = lambda heads, axis, name: nn.DenseGeneral(
            (heads, self.head_dim), use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
            kernel_init=partitioned(init, "embed", axis, "head_dim"), name=name)(x)
        q = proj(self.num_heads, "heads", "query")  # [B, L, Hq, D]
        k = proj(self.num_kv_heads, "kv_heads", "key")  # [B, L, Hkv, D]
        v = proj(self.num_kv_heads, "kv_heads", "value")
        segments = fold_padding(segment_ids, padding_mask)
        q_pos = default_positions(positions, segments, b)
        ctx = AttentionContext(x=x, q_pos=q_pos, k_pos=q_pos, segment_ids=segments, window=self.window,
                               decode=decode, pos_emb=pos_emb, causal=self.causal,
                               table_dtype=jax.dtypes.canonicalize_dtype(jnp.promote_types(jnp.float32,
                                                                                           self.param_dtype)))
        if decode:
            k, v, ctx = self._with_cache(k, v, ctx, given=positions is not None)
        elif q_pos is None:
            q_pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
            ctx = dataclasses.replace(ctx, q_pos=q_pos, k_pos=q_pos, indexed=True)
        core = self.pe.core(head_dim=self.head_dim, max_len=self.max_len, impl=self.impl).clone(parent=self, name="pe")
        out = core(q, k, v, ctx)  # [B, Lq, Hq, D]
        out = nn.DenseGeneral(d_model, axis=(-2, -1), use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                              kernel_init=partitioned(init, "heads", "head_dim", "embed"), name="out")(out)
        return Dropout(self.dropout)(out, deterministic=deterministic)

    def _with_cache(self, k: jax.Array, v: jax.Array, ctx: AttentionContext, *, given: bool
                    ) -> tuple[jax.Array, jax.Array, AttentionContext]:
        """Write this call's keys, values, positions and document ids at the cache index; return the cached k, v
        [B, S, Hkv, D] and a context whose dense mask covers the cache. The initialising call (full length S) is
        ordinary self-attention. Positions not `given` by the caller go on from the cached ones (`decode_positions`).
        """
        b, length = k.shape[:2]
        initialised = self.has_variable("cache", "cache_index")
        index_var = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        index = index_var.value
        steps = index + jnp.arange(length, dtype=jnp.int32)
        if initialised and not given:
            last = jnp.maximum(index - 1, 0)
            cached = [jax.lax.dynamic_index_in_dim(self.get_variable("cache", name), last, axis=1, keepdims=False)
                      for name in ("cached_positions", "cached_segment_ids")]  # [B] each: the last cached token's
            q_pos = decode_positions(ctx.segment_ids, jnp.where(index > 0, cached[0] + 1, 0),
                                     jnp.where(index > 0, cached[1], 0), length)
        else:
            q_pos = jnp.broadcast_to(steps, (b, length)) if ctx.q_pos is None else ctx.q_pos
        segments = jnp.zeros((b, length), jnp.int32) if ctx.segment_ids is None else ctx.segment_ids
        k = update_cache(self, "cached_key", k, index)  # [B, S, Hkv, D]
        v = update_cache(self, "cached_value", v, index)
        k_pos = update_cache(self, "cached_positions", q_pos, index)  # [B, S]
        k_segments = update_cache(self, "cached_segment_ids", segments, index)
        ctx = dataclasses.replace(ctx, q_pos=q_pos, k_pos=k_pos, cache_index=index)
        if not initialised:
            return k, v, ctx
        index_var.value = index + length
        mask = visibility_mask(length, k.shape[1], segment_ids=k_segments, window=self.window, q_index=steps[None],
                               q_segments=segments)  # [B, Lq, S]
        return k, v, dataclasses.replace(ctx, mask=mask, segment_ids=None, cache_segment_ids=k_segments)


def check_width(params: Any, d_model: int) -> None:
    """ValueError unless the query projection in `params` (boxed or not) maps inputs of width d_model."""
    kernel = jax.tree.leaves(params.get("query", {}))
    if kernel and kernel[0].shape[0] != d_model:
        raise ValueError(f"x has d_model={d_model}, but the layer's parameters were made for "
                         f"d_model={kernel[0].shape[0]} (their query kernel is {tuple(kernel[0].shape)})")


def resolve_deterministic(field: bool | None, call: bool | None) -> bool:
    """Whether dropout is off: the call's `deterministic` when given, else the layer's field, else True. A traced
    value is a TypeError that says how to pass it under `nn.remat`; anything but a bool (NumPy's and a 0-d bool array
    too) is a TypeError naming it."""
    deterministic = True if field is None and call is None else (field if call is None else call)
    if isinstance(deterministic, jax.core.Tracer):
        raise TypeError("deterministic is traced (nn.remat/jax.checkpoint trace every argument they do not hold "
                        "static, keyword arguments included): set it as the layer's field, e.g. "
                        "Attention(..., deterministic=False), or pass it positionally and static, "
                        "nn.remat(Attention, static_argnums=(2,))(...)(x, False)")
    if not (isinstance(deterministic, (bool, np.bool_)) or getattr(deterministic, "dtype", None) == jnp.bool_
            and jnp.ndim(deterministic) == 0):
        raise TypeError(f"deterministic={deterministic!r} must be a bool")
    return bool(deterministic)


def default_positions(positions: jax.Array | None, segment_ids: jax.Array | None, batch: int) -> jax.Array | None:
    """Token positions int32 [B, L]: the caller's ([B, L] or [L]); else, with document ids [B, L], each token's
    index within its run of equal ids (packed documents and left padding start at 0); else None (0, 1, ...)."""
    if positions is not None:
        positions = jnp.asarray(positions, jnp.int32)
        return jnp.broadcast_to(positions, (batch, positions.shape[-1]))
    if segment_ids is None:
        return None
    index = jnp.broadcast_to(jnp.arange(segment_ids.shape[1], dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
                             axis=1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def decode_positions(segment_ids: jax.Array | None, next_position: jax.Array, last_segment: jax.Array, length: int
                     ) -> jax.Array:
    """Default positions int32 [B, L] of a decoding call's L tokens: each token's index within its run of equal
    document ids (segment_ids [B, L], padding folded in; None: one document, id 0), the first run going on from
    next_position [B] when it continues the document the previous call ended in (last_segment [B])."""
    b = next_position.shape[0]
    index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], (b, length))
    ids = jnp.zeros((b, length), jnp.int32) if segment_ids is None else segment_ids
    within = index if segment_ids is None else default_positions(None, segment_ids, b)
    continues = (within == index) & (ids == last_segment[:, None])  # [B, L]
    return within + jnp.where(continues, next_position[:, None], 0)


def check_token_inputs(batch: int, length: int, *, positions: jax.Array | None = None,
                       segment_ids: jax.Array | None = None, padding_mask: jax.Array | None = None) -> None:
    """ValueError/TypeError unless positions ([B, L] or [L], integer), segment_ids ([B, L] integer) and padding_mask
    ([B, L] bool) fit a batch of B sequences of L tokens."""
    check_segment_ids(segment_ids, batch, length)
    if positions is not None:
        positions = jnp.asarray(positions)
        if not jnp.issubdtype(positions.dtype, jnp.integer):
            raise TypeError(f"positions must be an integer array [B, L], got positions.dtype={positions.dtype}")
        if positions.shape not in ((batch, length), (length,)):
            raise ValueError(f"positions must have shape [B={batch}, L={length}] or [L], "
                             f"got positions.shape={tuple(positions.shape)}")
    check_padding_mask(padding_mask, batch, length)
