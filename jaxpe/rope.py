"""Rotary position embedding as models configure it: half-split (NeoX, Hugging Face) or interleaved (GPT-J, the
original RoFormer, Meta's Llama checkpoints) pairs, partial rotary, and Hugging Face `rope_scaling`.

B batch, L length, H heads, D head dim, R rotary dim (the first R dims of each head rotate, R <= D; the other D − R
pass through unchanged, as transformers' `partial_rotary_factor` = R/D). Half-split pairs dim d with d + R/2,
interleaved pairs 2d with 2d + 1; pair d turns by position·ω_d, ω_d = θ^(−2d/R) unless a scaling changes it
(`jaxpe.rope_scaling`). The two layouts differ only by a fixed permutation of the first R dims.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpe.attention_core import AttentionContext
from jaxpe.base import compute_dtype
from jaxpe.registry import PEConfig, register
from jaxpe.rope_scaling import check_rotary_dim, rope_frequencies, rope_scaling_dict
from jaxpe.softmax_attention import attend
from jaxpe.validation import (as_positions, check_bool, check_even_head_dim, check_positive_number, check_rank,
                              check_wide_float)


def apply_rope(x: jax.Array, positions: jax.Array, *, theta: float = 10000.0, rotary_dim: int | None = None,
               interleaved: bool = False, scaling: Mapping | tuple | None = None,
               length: jax.Array | int | None = None) -> jax.Array:
    """Rotate x [B, L, H, D] by positions [B, L] or [L] (ints or floats); returns x's dtype.

    rotary_dim: R, None for D. interleaved: pairs (2d, 2d + 1) instead of (d, d + R/2). scaling: a Hugging Face
    `rope_scaling` dict (or its (key, value) pairs, hashable for jit's static arguments); YaRN also scales cos and
    sin. length: the sequence length dynamic NTK scales by; None: max(positions) + 1, as transformers does."""
    check_rank("x", x, 4, "B L H D")
    check_wide_float("x", x)
    if rotary_dim is None:
        check_even_head_dim(x.shape[-1])
    else:
        check_rotary_dim(rotary_dim, x.shape[-1])
    if not isinstance(interleaved, bool):
        raise ValueError(f"{interleaved=} must be a bool")
    positions = as_positions("positions", positions)
    if positions.ndim not in (1, 2) or positions.shape[-1] != x.shape[1]:
        raise ValueError(f"positions must have shape [B, L] or [L] with L={x.shape[1]}, got {positions.shape=}")
    if positions.ndim == 1:
        positions = positions[None]
    if positions.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"positions batch {positions.shape[0]} must be 1 or match x's batch B={x.shape[0]}")
    if length is not None and (isinstance(length, bool) or not isinstance(length, numbers.Real) and not (
            hasattr(length, "dtype") and jnp.ndim(length) == 0 and jnp.issubdtype(length.dtype, jnp.number))):
        raise TypeError(f"length={length!r} must be None or a number (a scalar, may be traced)")
    spec = rope_scaling_dict(scaling)
    if length is None and spec is not None and spec["rope_type"] == "dynamic":
        length = jnp.max(positions) + 1
    freqs, attention_factor = rope_frequencies(rotary_dim or x.shape[-1], theta=theta, scaling=spec, length=length,
                                               dtype=compute_dtype(x))
    cos, sin = rope_angles(positions, freqs, attention_factor)
    return rotate(x, cos, sin, interleaved=interleaved)


def rope_angles(positions: jax.Array, freqs: jax.Array, attention_factor: float = 1.0
                ) -> tuple[jax.Array, jax.Array]:
    """cos and sin [B|1, L, R/2] in freqs' dtype of positions [B|1, L] times freqs [R/2], both times
    attention_factor."""
    angles = positions.astype(freqs.dtype)[:, :, None] * freqs[None, None, :]  # [B|1, L, R/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interleaved: bool = False) -> jax.Array:
    """Turn the first R = 2·cos.shape[-1] dims of x [B, L, H, D] by cos, sin [B|1, L, R/2]; the rest pass through."""
    r = 2 * cos.shape[-1]
    xf = x.astype(compute_dtype(x, cos))
    rot, rest = xf[..., :r], xf[..., r:]  # [B, L, H, R], [B, L, H, D − R]
    cos, sin = cos[:, :, None], sin[:, :, None]  # [B|1, L, 1, R/2]
    if interleaved:
        pairs = rot.reshape(*rot.shape[:-1], r // 2, 2)  # [B, L, H, R/2, 2]
        x1, x2 = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(rot.shape)
    else:
        x1, x2 = jnp.split(rot, 2, axis=-1)
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    if rest.shape[-1]:
        out = jnp.concatenate([out, rest], axis=-1)
    return out.astype(x.dtype)


class RoPECore(nn.Module):
    """Rotate q at ctx.q_pos and k at ctx.k_pos, then softmax attention (causal or both ways, documents, window or
    mask)."""

    theta: float = 10000.0
    rotary_dim: int | None = None
    interleaved: bool = False
    scaling: tuple[tuple[str, Any], ...] | None = None  # a rope_scaling dict as sorted (key, value) pairs

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttentionContext) -> jax.Array:
        length = None
        if self.scaling is not None and dict(self.scaling)["rope_type"] == "dynamic":
            length = jnp.max(ctx.k_pos) + 1  # one length for q and k: their frequencies must agree
        options = dict(theta=self.theta, rotary_dim=self.rotary_dim, interleaved=self.interleaved,
                       scaling=self.scaling, length=length)
        q = apply_rope(q, ctx.q_pos, **options)
        k = apply_rope(k, ctx.k_pos, **options)
        return attend(q, k, v, sm_scale=q.shape[-1] ** -0.5, mask=ctx.mask, segment_ids=ctx.segment_ids,
                      window=ctx.window, causal=ctx.causal)


@register("rope")
@dataclasses.dataclass(frozen=True)
class RoPEConfig(PEConfig):
    """Rotary positions on queries and keys. `jaxpe.rope_scaling.hf_rope_options(config_json)` gives these options
    for a Hugging Face model."""

    theta: float = 10000.0  # base of ω_d = θ^(−2d/R)
    rotary_dim: int | None = None  # R: rotate the first R dims of each head (HF: partial_rotary_factor·D); None: D
    interleaved: bool = False  # pairs (2d, 2d + 1) (GPT-J, RoFormer, Meta Llama) instead of (d, d + R/2) (NeoX, HF)
    scaling: Mapping | tuple | None = None  # an HF rope_scaling dict, stored as sorted (key, value) pairs; None: none

    def __post_init__(self) -> None:
        check_positive_number("theta", self.theta)
        if self.rotary_dim is not None:
            check_rotary_dim(self.rotary_dim)
        check_bool("interleaved", self.interleaved)
        spec = rope_scaling_dict(self.scaling)
        object.__setattr__(self, "scaling", None if spec is None else tuple(sorted(spec.items())))
        if spec is not None and spec["rope_type"] == "dynamic" and self.rotary_dim == 2:
            raise ValueError(f"rotary_dim={self.rotary_dim} must be > 2 for dynamic NTK scaling")

    def check_layer(self, *, head_dim: int, impl: str, causal: bool = True) -> None:
        if self.rotary_dim is None:
            check_even_head_dim(head_dim)
        else:
            check_rotary_dim(self.rotary_dim, head_dim)
        if self.scaling is not None and dict(self.scaling)["rope_type"] == "dynamic" and (self.rotary_dim or
                                                                                           head_dim) == 2:
            raise ValueError(f"rotary_dim=2 (head dim D={head_dim}) must be > 2 for dynamic NTK scaling")

    def core(self, *, head_dim: int, max_len: int, impl: str) -> nn.Module:
        self.check_layer(head_dim=head_dim, impl=impl)
        return RoPECore(theta=self.theta, rotary_dim=self.rotary_dim, interleaved=self.interleaved,
                        scaling=self.scaling)
