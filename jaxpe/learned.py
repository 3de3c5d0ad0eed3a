"""Learned absolute positions: a trained table [max_len, d_model] added to token embeddings, and the row lookup
every additive table (learned, sinusoidal, AM-SPE) uses."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpe.registry import PEConfig, register
from jaxpe.sharding import partitioned
from jaxpe.validation import check_positive_number


def gather_positions(table: jax.Array, positions: jax.Array | None, length: int) -> jax.Array:
    """Rows of `table` [max_len, d] at `positions` ([B, L] or [L]; None means 0..length-1) -> [B|1, L, d].

    Raises when a static length exceeds the table, or a symbolic one (jax.export) is not bounded by it; traced
    positions beyond it give NaN rows.
    """
    max_len = table.shape[0]
    if positions is None:
        try:
            too_long = length > max_len
        except jax.errors.InconclusiveDimensionOperation:  # a symbolic length (jax.export) with no bound
            raise ValueError(f"a symbolic sequence length L={length} may exceed the position table's max_len={max_len}: "
                             f"bound it when exporting, e.g. jax.export.symbolic_shape('b, {length}', "
                             f"constraints=('{length} <= {max_len}',))") from None
        if too_long:
            raise ValueError(f"sequence length L={length} exceeds the position table's max_len={max_len}")
        return table[None, :length]
    positions = jnp.asarray(positions)
    if positions.ndim == 1:
        positions = positions[None]
    return jnp.take(table, positions, axis=0, mode="fill", fill_value=jnp.nan)


class LearnedPE(nn.Module):
    """x [B, L, d] -> x + table[positions]; param "table" [max_len, d]."""

    max_len: int
    init_std: float = 0.02

    @nn.compact
    def __call__(self, x: jax.Array, *, positions: jax.Array | None = None) -> jax.Array:
        table = self.param("table", partitioned(nn.initializers.normal(self.init_std), "positions", "embed"),
                           (self.max_len, x.shape[-1]))
        return x + gather_positions(table, positions, x.shape[1]).astype(x.dtype)


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
