"""AM-SPE: adaptive blend of a coarse and a detailed sinusoidal table.

out = x + amplitude·(α·coarse[:L] + (1 − α)·detail_level·detail[:L]),
α = sigmoid(alpha), alpha a learned scalar initialised to 0,
coarse = sinusoidal table with every angle times `coarse_scale`, detail = the plain sinusoidal table.
α weighs the coarse table and 1 − α the detailed one, which `detail_level` scales further; `amplitude` scales the
whole blend, as for `sinusoidal` (1.0 adds the tables at their own size).
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpe.base import compute_dtype
from jaxpe.registry import PEConfig, register
from jaxpe.sharding import partitioned
from jaxpe.tables import add_table_rows, sinusoidal_table
from jaxpe.validation import check_array, check_fraction, check_int, check_positive, check_positive_number


def check_detail_level(detail_level: float | jax.Array) -> None:
    """The detail level is a real scalar (a Python or NumPy number, or a 0-d array; TypeError otherwise); a concrete
    one must lie in [0, 1] (a traced one is used as given)."""
    scalar = isinstance(detail_level, numbers.Real) or hasattr(detail_level, "ndim")
    if isinstance(detail_level, bool) or not scalar:
        raise TypeError(f"{detail_level=} must be a real number in [0, 1]")
    if jnp.ndim(detail_level) != 0:
        raise ValueError(f"detail_level must be a scalar, got shape {jnp.shape(detail_level)}")
    if isinstance(detail_level, jax.core.Tracer):
        return
    if not 0.0 <= float(detail_level) <= 1.0:
        raise ValueError(f"{detail_level=} must be in [0, 1]")


class AMSPE(nn.Module):
    """x [B, L, d_model] -> x + adaptive PE; param "alpha" of shape (1,)."""

    d_model: int
    max_len: int = 5000
    coarse_scale: float = 10.0
    amplitude: float = 1.0

    @nn.compact
    def __call__(self, x: jax.Array, detail_level: float = 0.5, *, positions: jax.Array | None = None) -> jax.Array:
        check_int("d_model", self.d_model, 1)
        check_int("max_len", self.max_len, 1)
        check_array("x", x, f"B, L, d_model={self.d_model}")
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape [B, L, d_model={self.d_model}], got x.shape={tuple(x.shape)}")
        check_positive_number("coarse_scale", self.coarse_scale)
        check_positive("amplitude", self.amplitude)
        check_detail_level(detail_level)
        alpha_param = self.param("alpha", partitioned(nn.initializers.zeros, None), (1,), jnp.float32)
        alpha = jax.nn.sigmoid(alpha_param)[0]
        dtype = compute_dtype(x)
        coarse = sinusoidal_table(self.max_len, self.d_model, scale=self.coarse_scale, dtype=dtype)
        detail = sinusoidal_table(self.max_len, self.d_model, dtype=dtype)
        pe = self.amplitude * (alpha * coarse + (1.0 - alpha) * detail_level * detail)  # [max_len, d_model]
        return add_table_rows(x, pe, positions)


@register("amspe")
@dataclasses.dataclass(frozen=True)
class AMSPEConfig(PEConfig):
    """Adaptive multi-scale sinusoidal positions added to token embeddings."""

    additive: ClassVar[bool] = True
    coarse_scale: float = 10.0  # angle multiplier of the coarse table (> 0)
    detail_level: float = 0.5  # weight of the detailed table, in [0, 1]
    amplitude: float = 0.02  # multiplies the blend, matched to the token embeddings (see SinusoidalConfig; > 0)

    def __post_init__(self) -> None:
        check_positive_number("coarse_scale", self.coarse_scale)
        check_fraction("detail_level", self.detail_level, one=True)
        check_positive_number("amplitude", self.amplitude)

    def embedding(self, *, d_model: int, max_len: int) -> nn.Module:
        return _AMSPEAtLevel(d_model=d_model, max_len=max_len, coarse_scale=self.coarse_scale,
                             detail_level=self.detail_level, amplitude=self.amplitude)


class _AMSPEAtLevel(nn.Module):
    """AMSPE with its detail level fixed by the config (what a model layer uses)."""

    d_model: int
    max_len: int
    coarse_scale: float
    detail_level: float
    amplitude: float

    @nn.compact
    def __call__(self, x: jax.Array, *, positions: jax.Array | None = None) -> jax.Array:
        amspe = AMSPE(self.d_model, self.max_len, self.coarse_scale, self.amplitude, name="amspe")
        return amspe(x, self.detail_level, positions=positions)
