"""The interface of an encoding's attention core, declared once, and the plain core (no positional term).

B batch, Lq query length, Lk key length (the cache length S while decoding), Hq query heads, Hkv key/value heads,
D head dim. `PEConfig.core` builds a linen module answering `AttentionCore`; `jaxpe.Attention` projects q, k, v,
builds one `AttentionContext` and calls `core(q, k, v, ctx)`.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import flax.linen as nn
import jax

from jaxpe.softmax_attention import attend


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionContext:
    """What a core may read besides q, k, v; a pytree (arrays are leaves, `decode` is static)."""

    x: jax.Array  # [B, Lq, d_model] the layer input (gate networks, separate gate keys)
    q_pos: jax.Array  # [B, Lq] int32 absolute query positions
    mask: jax.Array | None = None  # None: causal over the full sequence (Lq == Lk, the fast path); [B, Lq, Lk] bool
    decode: bool = dataclasses.field(default=False, metadata=dict(static=True))  # keys come from the KV cache
    pos_emb: jax.Array | None = None  # a position table shared by all layers (owned by the model), or None


class AttentionCore(Protocol):
    """An encoding's attention: (q [B, Lq, Hq, D], k, v [B, Lk, Hkv, D], ctx) -> [B, Lq, Hq, D]."""

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttentionContext) -> jax.Array: ...


class PlainCore(nn.Module):
    """Causal softmax attention with no positional term (NoPE, and the additive encodings inside attention)."""

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttentionContext) -> jax.Array:
        return attend(q, k, v, sm_scale=q.shape[-1] ** -0.5, mask=ctx.mask)
