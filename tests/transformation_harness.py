"""What the transformation tests share (test_transformations_cope.py, test_transformations_corope.py): float64 copies
of the inputs for the NumPy restatements, the probe for float64 values in a jaxpr (x64 mode), and the two pieces of
bidirectional attention that do not depend on the encoding: which keys a query sees, and the softmax over them.

B batch, L length.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from kernel_harness import equations


def float64(*arrays: jax.Array) -> tuple[np.ndarray, ...]:
    """Each array as a float64 NumPy array (the float32 values, exactly)."""
    return tuple(np.asarray(x, np.float64) for x in arrays)


def float64_values(fn: Callable, *args: jax.Array) -> list[str]:
    """The float64 values anywhere in fn's jaxpr (nested jaxprs included), as strings."""
    return [str(var.aval) for eqn in equations(jax.make_jaxpr(fn)(*args).jaxpr) for var in eqn.outvars
            if getattr(var.aval, "dtype", None) == jnp.float64]


def bidirectional_visibility(batch: int, length: int, *, segment_ids: np.ndarray | None = None,
                             window: int | None = None) -> np.ndarray:
    """bool [B, L, L]: key j is visible to query i iff both are in the same document (segment_ids [B, L]; None: one
    document) and |i − j| < window (None: no window), written one (b, i, j) at a time."""
    visible = np.zeros((batch, length, length), bool)
    for b in range(batch):
        for i in range(length):
            for j in range(length):
                same = segment_ids is None or segment_ids[b, i] == segment_ids[b, j]
                visible[b, i, j] = same and (window is None or abs(i - j) < window)
    return visible


def softmax_average(logits: list[float], values: np.ndarray) -> np.ndarray:
    """Σ_j softmax(logits)_j · values[j]: logits [K] of the visible keys, values [K, D] -> [D]."""
    weights = np.exp(np.array(logits) - max(logits))
    return (weights / weights.sum()) @ values
