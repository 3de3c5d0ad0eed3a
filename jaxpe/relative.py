"""Learned relative position logits, the CoPE paper's "relative PE" baseline.

bias_ij = q_i · r[min(i − j, npos − 1)], r a table [npos, D]; logits = sm_scale·(q_i·k_j + bias_ij).
B batch, Lq/Lk query/key length, H heads, D head dim. The logits themselves (`relative_logits`, the skewed
`relative_logits_indexed`, `context_relative_logits`) live in jaxpe/tables.py beside the other table reads, since
CoPE's "cope+rel" adds them too.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax

from jaxpe.attention_core import AttentionContext
from jaxpe.registry import PEConfig, register
from jaxpe.sharding import partitioned
from jaxpe.softmax_attention import attend
from jaxpe.tables import context_relative_logits
from jaxpe.validation import check_npos


class RelativeCore(nn.Module):
    """Causal softmax attention with learned relative position logits; param "rel_table" [npos, D]."""

    npos: int

    @nn.compact
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttentionContext) -> jax.Array:
        table = self.param("rel_table", partitioned(nn.initializers.normal(0.02), "positions", "head_dim"),
                           (self.npos, q.shape[-1]), ctx.table_dtype)
        sm_scale = q.shape[-1] ** -0.5
        bias = sm_scale * context_relative_logits(q, table, ctx)
        return attend(q, k, v, sm_scale=sm_scale, mask=ctx.mask, bias=bias, segment_ids=ctx.segment_ids,
                      window=ctx.window)


@register("relative")
@dataclasses.dataclass(frozen=True)
class RelativeConfig(PEConfig):
    """Learned relative position logits clipped at npos − 1. Without `npos` the table has max_len + 1 rows, so its
    shape follows max_len: parameters trained at one max_len load at another with npos set to their rows."""

    size_option: ClassVar[str] = "npos"
    tables: ClassVar[tuple[str, ...]] = ("rel_table",)
    npos: int | None = None  # table rows (int >= 2): distances >= npos − 1 share the last; None: max_len + 1

    def __post_init__(self) -> None:
        if self.npos is not None:
            check_npos(self.npos)

    def core(self, *, head_dim: int, max_len: int, impl: str) -> nn.Module:
        return RelativeCore(npos=self.table_rows(max_len))

    def causal_only(self) -> str | None:
        return "its table r[min(i − j, npos − 1)] holds distances to keys at or before the query (j ≤ i)"
