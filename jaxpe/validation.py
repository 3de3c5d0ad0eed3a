"""Input checks of jaxpe's public entry points. The checks of arrays and sizes live at the bottom layer,
`jaxpe.base`, shared with the kernels (one wording everywhere), and are re-exported here; the choice of
implementation and the checks of config options (each error names the option and its value) are jaxpe's own."""
from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.base import (bidirectional_refusal, check_array, check_attention_mask, check_cope_inputs,
                        check_corope_inputs, check_even_head_dim, check_float, check_gate_k, check_npos,
                        check_padding_mask, check_pos_emb, check_positive, check_qkv, check_rank, check_segment_ids,
                        check_sm_scale, check_wide_float, check_window, is_int, open_attention)

__all__ = ["FUSED_IMPLS", "IMPLS", "as_bool", "as_positions", "check_array", "check_attention_mask", "check_bool",
           "check_choice", "check_cope_inputs", "check_corope_inputs", "check_even_head_dim", "check_finite_number",
           "check_float", "check_float_dtype", "check_fraction", "check_gate_k", "check_impl", "check_int",
           "check_npos", "check_optional_int", "check_padding_mask", "check_pos_emb", "check_positive", "check_positive_number",
           "check_qkv", "check_queries_last", "check_rank", "check_segment_ids", "check_sm_scale", "check_token_ids",
           "check_wide_float", "check_window", "is_finite_number", "is_int", "open_attention"]

IMPLS = ("auto", "reference", "blockwise", "pallas", "triton")
FUSED_IMPLS = ("pallas", "triton")  # the fused kernels, Pallas lowered to Triton and native Triton: causal only


def check_impl(impl: str, *, causal: bool = True) -> None:
    """Raise ValueError unless `impl` names an implementation that runs attention in this direction (`causal`)."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"{impl=} must be one of {IMPLS}")
    if not causal and impl in FUSED_IMPLS:
        raise bidirectional_refusal(impl)


def check_bool(name: str, value: Any) -> None:
    """Raise ValueError unless `value` is a bool (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be a bool")


def as_bool(name: str, value: Any) -> bool:
    """`value` as a Python bool where it is a bool or NumPy's bool (a flag taken from a NumPy grid or array), as a
    size may be a NumPy integer; ValueError otherwise (not 0/1, not a string, not a jax array, which may be traced)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}={value!r} must be a bool")
    return bool(value)


def as_positions(name: str, positions: Any) -> jax.Array:
    """`positions` (an array, or nested lists of numbers) as a jax array; TypeError naming it unless its entries are
    integers or floats (a bool, a string or a complex number is no position)."""
    dtype = positions.dtype if hasattr(positions, "dtype") else np.asarray(positions).dtype
    if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
        raise TypeError(f"{name} must be an integer or floating-point array, got {name}.dtype={dtype}")
    return jnp.asarray(positions)


def check_int(name: str, value: Any, minimum: int) -> None:
    """Raise ValueError unless `value` is an int >= `minimum` (a bool is not an int here)."""
    if not is_int(value, minimum):
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


def check_queries_last(q: jax.Array, k: jax.Array, mask: jax.Array | None) -> None:
    """Without a mask the Lq queries are the last Lq of the Lk key positions: ValueError unless Lq <= Lk."""
    if mask is None and q.shape[1] > k.shape[1]:
        raise ValueError(f"q has more tokens than k (Lq={q.shape[1]} > Lk={k.shape[1]}): without a mask the queries "
                         "are the last Lq of the Lk key positions; pass k of every position, or a mask [B|1, Lq, Lk]")


def check_optional_int(name: str, value: Any, minimum: int) -> None:
    """Raise ValueError unless `value` is None or an int >= `minimum`."""
    if value is not None and not is_int(value, minimum):
        raise ValueError(f"{name}={value!r} must be None or an int >= {minimum}")


def is_finite_number(value: Any) -> bool:
    """A finite real number: an int or a float, not a bool, not nan or inf."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_positive_number(name: str, value: Any) -> None:
    """Raise ValueError unless `value` is a number > 0 and finite (a bool or a string is not)."""
    if not is_finite_number(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be > 0 and finite")


def check_finite_number(name: str, value: Any) -> None:
    """Raise ValueError unless `value` is a finite real number (Python's or NumPy's; a bool or a string is not)."""
    if not is_finite_number(value):
        raise ValueError(f"{name}={value!r} must be a finite number")


def check_fraction(name: str, value: Any, *, one: bool) -> None:
    """Raise ValueError unless `value` is a number in [0, 1] (`one`) or in [0, 1)."""
    if not is_finite_number(value) or not (0 <= value <= 1 if one else 0 <= value < 1):
        raise ValueError(f"{name}={value!r} must be in [0, {'1]' if one else '1)'}")


def check_float_dtype(name: str, value: Any) -> None:
    """Raise TypeError unless `value` names a floating-point dtype (jnp.bfloat16, "float32", np.float16, ...) or is
    None (flax's convention: the inputs' dtype)."""
    if value is None:
        return
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name}={value!r} must be a floating-point dtype (e.g. jnp.float32, jnp.bfloat16)")


def check_token_ids(name: str, ids: Any, vocab_size: int) -> None:
    """Raise ValueError unless the ids of a concrete int array are in [0, vocab_size); a traced array (under jit) is
    used as given: there an id >= vocab_size embeds as NaN and a negative one counts from the end (flax's Embed)."""
    if isinstance(ids, jax.core.Tracer) or not ids.size:
        return
    values = np.asarray(ids)
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{name} ids must be in [0, vocab_size={vocab_size}), got ids from {low} to {high} (under "
                         "jit, unchecked, an id >= vocab_size embeds as NaN and a negative one counts from the end)")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise ValueError unless `value` is one of the strings `choices`."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}={value!r} must be one of {choices}")
