"""Learned absolute positions: a trained table [max_len, d_model] added to token embeddings."""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax

from jaxpe.registry import PEConfig, register
from jaxpe.sinusoidal import gather_positions


class LearnedPE(nn.Module):
    """x [B, L, d] -> x + table[positions]; param "table" [max_len, d]."""

    max_len: int
    init_std: float = 0.02

    @nn.compact
    def __call__(self, x: jax.Array, *, positions: jax.Array | None = None) -> jax.Array:
        table = self.param("table", nn.initializers.normal(self.init_std), (self.max_len, x.shape[-1]))
        return x + gather_positions(table, positions, x.shape[1]).astype(x.dtype)


@register("learned")
@dataclasses.dataclass(frozen=True)
class LearnedConfig(PEConfig):
    """A trained absolute position table; lengths beyond max_len are an error."""

    init_std: float = 0.02  # standard deviation of the table's normal initialiser

    def embedding(self, *, d_model: int, max_len: int) -> nn.Module:
        return LearnedPE(max_len=max_len, init_std=self.init_std)
