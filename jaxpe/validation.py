"""Input checks shared by the public entry points. Each raises with the argument's name and value."""
from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("auto", "reference", "blockwise", "pallas")


def check_float(name: str, x: jax.Array) -> None:
    """Raise TypeError unless `x` is a floating-point array."""
    if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype={jnp.asarray(x).dtype}")


def check_rank(name: str, x: jax.Array, rank: int, dims: str) -> None:
    """Raise ValueError unless `x` has `rank` axes (`dims` names them, e.g. "B L H D")."""
    if x.ndim != rank:
        raise ValueError(f"{name} must have shape [{dims}], got {name}.shape={tuple(x.shape)}")


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[int, int]:
    """Validate q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D]; return (Hkv, G = Hq // Hkv)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_rank(name, x, 4, "B L H D")
        check_float(name, x)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k.shape={k.shape}, v.shape={v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must share batch and head dim, got q.shape={q.shape}, k.shape={k.shape}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype=}, {k.dtype=}, {v.dtype=}")
    hq, hkv = q.shape[2], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads must be a multiple of key/value heads, got Hq={hq}, Hkv={hkv}")
    return hkv, hq // hkv


def check_impl(impl: str) -> None:
    """Raise ValueError unless `impl` names an implementation."""
    if impl not in IMPLS:
        raise ValueError(f"{impl=} must be one of {IMPLS}")


def check_even_head_dim(d: int) -> None:
    """Rotary encodings pair dimension d with d + D/2."""
    if d % 2:
        raise ValueError(f"head dim D={d} must be even for rotary encodings")


def check_positive(name: str, value: float) -> None:
    """Raise ValueError unless `value` > 0."""
    if not value > 0:
        raise ValueError(f"{name}={value!r} must be > 0")
