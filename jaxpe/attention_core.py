"""The interface of an encoding's attention core, declared once, and the plain core (no positional term).

B batch, Lq query length, Lk key length (the cache length S while decoding), Hq query heads, Hkv key/value heads,
D head dim. `PEConfig.core` builds a linen module answering `AttentionCore`; `jaxpe.Attention` projects q, k, v,
builds one `AttentionContext` and calls `core(q, k, v, ctx)`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpe.softmax_attention import attend, visibility_mask


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionContext:
    """What a core may read besides q, k, v; a pytree (arrays are leaves, `decode` is static)."""

    x: jax.Array  # [B, Lq, d_model] the layer input (gate networks, separate gate keys)
    q_pos: jax.Array | None  # [B, Lq] int32 query positions (the caller's, else 0, 1, ... continuing the cache)
    k_pos: jax.Array | None = None  # [B, Lk] int32 key positions; None: q_pos, or 0..Lk−1 under a mask (decoding)
    mask: jax.Array | None = None  # [B, Lq, Lk] bool, everything included (decoding); None: see segment_ids, window
    segment_ids: jax.Array | None = None  # [B, L] int32 document ids, padding folded in (PAD_SEGMENT); None: one
    window: int | None = dataclasses.field(default=None, metadata=dict(static=True))  # sliding window, None: all
    decode: bool = dataclasses.field(default=False, metadata=dict(static=True))  # keys come from the KV cache
    cache_index: jax.Array | None = None  # int32 scalar: where this call's keys go in the cache; None: q_pos[0, 0]
    # [B, S] int32 document ids of the cached keys, this call's included (decoding; padding folded in); None: one
    cache_segment_ids: jax.Array | None = None
    pos_emb: jax.Array | None = None  # a position table shared by all layers (owned by the model), or None
    # True when q_pos and k_pos are known to be 0..L−1 in every row (no caller positions, documents or cache)
    indexed: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # the dtype of the position parameters a core owns (tables, gate networks): float32, float64 when the layer's
    # param_dtype is float64
    table_dtype: Any = dataclasses.field(default=jnp.float32, metadata=dict(static=True))
    # False: bidirectional self-attention (an encoder), every key of the query's document within the window
    causal: bool = dataclasses.field(default=True, metadata=dict(static=True))

    def __post_init__(self) -> None:
        if self.k_pos is None and self.q_pos is not None:
            b = self.q_pos.shape[0]
            k_pos = self.q_pos if self.mask is None else jnp.broadcast_to(
                jnp.arange(self.mask.shape[-1], dtype=jnp.int32), (b, self.mask.shape[-1]))
            object.__setattr__(self, "k_pos", k_pos)
        if self.decode and self.cache_index is None and self.q_pos is not None:  # positions 0, 1, ... index the cache
            first = self.q_pos[0, 0] if self.q_pos.size else jnp.zeros((), jnp.int32)  # an empty batch writes nothing
            object.__setattr__(self, "cache_index", first)

    @property
    def plain_causal(self) -> bool:
        """True when key j is visible to query i exactly when j <= i (Lq == Lk): no mask, documents or window."""
        return self.causal and self.mask is None and self.segment_ids is None and self.window is None

    def dense_mask(self, lq: int, lk: int) -> jax.Array:
        """[B|1, Lq, Lk] bool: key j visible to query i. Without `mask` (self-attention, Lq == Lk): causal (both ways
        when not `causal`), same document, and |i − j| < window."""
        if self.mask is not None:
            return self.mask
        return visibility_mask(lq, lk, segment_ids=self.segment_ids, window=self.window, causal=self.causal)


class AttentionCore(Protocol):
    """An encoding's attention: (q [B, Lq, Hq, D], k, v [B, Lk, Hkv, D], ctx) -> [B, Lq, Hq, D]."""

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttentionContext) -> jax.Array: ...


class PlainCore(nn.Module):
    """Softmax attention with no positional term (NoPE, and the additive encodings inside attention)."""

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttentionContext) -> jax.Array:
        return attend(q, k, v, sm_scale=q.shape[-1] ** -0.5, mask=ctx.mask, segment_ids=ctx.segment_ids,
                      window=ctx.window, causal=ctx.causal)
