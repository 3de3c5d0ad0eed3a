"""Learned absolute positions: a trained table [max_len, d_model] added to token embeddings (its rows read by
`jaxpe.tables.add_table_rows`)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpe.registry import PEConfig, register
from jaxpe.sharding import partitioned
from jaxpe.tables import add_table_rows
from jaxpe.validation import check_positive_number


class LearnedPE(nn.Module):
    """x [B, L, d] -> x + table[positions]; param "table" [max_len, d]."""

    max_len: int
    init_std: float = 0.02

    @nn.compact
    def __call__(self, x: jax.Array, *, positions: jax.Array | None = None) -> jax.Array:
        table = self.param("table", partitioned(nn.initializers.normal(self.init_std), "positions", "embed"),
                           (self.max_len, x.shape[-1]), jnp.float32)
        return add_table_rows(x, table, positions)


@register("learned")
@dataclasses.dataclass(frozen=True)
class LearnedConfig(PEConfig):
    """A trained absolute position table; lengths beyond max_len are an error."""

    additive: ClassVar[bool] = True
    init_std: float = 0.02  # standard deviation of the table's normal initialiser (> 0)

    def __post_init__(self) -> None:
        check_positive_number("init_std", self.init_std)

    def embedding(self, *, d_model: int, max_len: int) -> nn.Module:
        return LearnedPE(max_len=max_len, init_std=self.init_std)
