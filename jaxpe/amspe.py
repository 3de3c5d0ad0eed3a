"""AM-SPE: adaptive blend of a coarse and a detailed sinusoidal table (seeds/amspe.md).

out = x + α·coarse[:L] + (1 − α)·detail_level·detail[:L],  α = sigmoid(alpha), alpha a learned scalar initialised to 0,
coarse = sinusoidal table with every angle times `coarse_scale`, detail = the plain sinusoidal table.
This is what the seed's Python and MATLAB code compute; the seed README's formula swaps α and 1 − α and has no
detail_level — we follow the code.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax

from jaxpe.registry import PEConfig, register
from jaxpe.sinusoidal import gather_positions, sinusoidal_table


class AMSPE(nn.Module):
    """x [B, L, d_model] -> x + adaptive PE; param "alpha" of shape (1,)."""

    d_model: int
    max_len: int = 5000
    coarse_scale: float = 10.0

    @nn.compact
    def __call__(self, x: jax.Array, detail_level: float = 0.5, *, positions: jax.Array | None = None) -> jax.Array:
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape [B, L, d_model={self.d_model}], got x.shape={tuple(x.shape)}")
        alpha = jax.nn.sigmoid(self.param("alpha", nn.initializers.zeros, (1,)))[0]
        coarse = sinusoidal_table(self.max_len, self.d_model, scale=self.coarse_scale)
        detail = sinusoidal_table(self.max_len, self.d_model)
        pe = alpha * coarse + (1.0 - alpha) * detail_level * detail  # [max_len, d_model]
        return x + gather_positions(pe, positions, x.shape[1]).astype(x.dtype)


@register("amspe")
@dataclasses.dataclass(frozen=True)
class AMSPEConfig(PEConfig):
    """Adaptive multi-scale sinusoidal positions added to token embeddings."""

    coarse_scale: float = 10.0  # angle multiplier of the coarse table
    detail_level: float = 0.5  # weight of the detailed table (the seed's default)

    def embedding(self, *, d_model: int, max_len: int) -> nn.Module:
        return _AMSPEAtLevel(d_model=d_model, max_len=max_len, coarse_scale=self.coarse_scale,
                             detail_level=self.detail_level)


class _AMSPEAtLevel(nn.Module):
    """AMSPE with its detail level fixed by the config (what a model layer uses)."""

    d_model: int
    max_len: int
    coarse_scale: float
    detail_level: float

    @nn.compact
    def __call__(self, x: jax.Array, *, positions: jax.Array | None = None) -> jax.Array:
        amspe = AMSPE(self.d_model, self.max_len, self.coarse_scale, name="amspe")
        return amspe(x, self.detail_level, positions=positions)
