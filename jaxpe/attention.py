"""Multi-head attention with MHA/GQA/MQA, any registered encoding, and a KV cache for decoding.

B batch, L length (Lq new tokens, S cache length), Hq query heads, Hkv key/value heads, D head dim.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpe.attention_core import AttentionContext
from jaxpe.kv_cache import update_cache
from jaxpe.registry import PEConfig


class Attention(nn.Module):
    """Causal self-attention x [B, L, d_model] -> [B, L, d_model].

    With `decode=True` keys and values are cached: the first call (at `init`) must see an input of the full cache
    length S; later calls append their Lq tokens (prefill with many, then one at a time). Encodings whose positions
    depend on the query (CoPE, Co-RoPE) recompute them over the cached keys, O(S) per decoded token.
    Dropout is applied to the output projection (attention-probability dropout would defeat fused kernels).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    pe: PEConfig
    max_len: int = 512
    dropout: float = 0.0
    impl: str = "auto"
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool = True, decode: bool = False,
                 pos_emb: jax.Array | None = None) -> jax.Array:
        if x.ndim != 3:
            raise ValueError(f"x must have shape [B, L, d_model], got x.shape={tuple(x.shape)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        b, length, d_model = x.shape
        proj = lambda heads, name: nn.DenseGeneral((heads, self.head_dim), use_bias=False, dtype=self.dtype,
                                                   name=name)(x)
        q = proj(self.num_heads, "query")  # [B, L, Hq, D]
        k = proj(self.num_kv_heads, "key")  # [B, L, Hkv, D]
        v = proj(self.num_kv_heads, "value")
        q_pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
        mask = None
        if decode:
            initialised = self.has_variable("cache", "cache_index")
            index_var = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
            index = index_var.value
            k = update_cache(self, "cached_key", k, index)  # [B, S, Hkv, D]
            v = update_cache(self, "cached_value", v, index)
            if initialised:
                q_pos = q_pos + index
                mask = jnp.arange(k.shape[1])[None, None, :] <= q_pos[:, :, None]  # [B, Lq, S]
                index_var.value = index + length
        core = self.pe.core(head_dim=self.head_dim, max_len=self.max_len, impl=self.impl).clone(parent=self, name="pe")
        ctx = AttentionContext(x=x, q_pos=q_pos, mask=mask, decode=decode, pos_emb=pos_emb)
        out = core(q, k, v, ctx)  # [B, Lq, Hq, D]
        out = nn.DenseGeneral(d_model, axis=(-2, -1), use_bias=False, dtype=self.dtype, name="out")(out)
        return nn.Dropout(self.dropout)(out, deterministic=deterministic)
