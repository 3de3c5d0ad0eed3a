"""Position tables and the row lookups shared by the encodings that read them: the sinusoidal table (sinusoidal,
AM-SPE), the additive tables' rows at token positions (learned, sinusoidal, AM-SPE) and per-query logit rows at
integer indices (relative positions, CoPE), and the relative position logits q_i·r[clip(i − j, 0, npos − 1)] that the
relative encoding and CoPE's "cope+rel" add.

B batch, L length (Lq queries, Lk keys), H heads, P table rows, d the table's width.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.attention_core import AttentionContext
from jaxpe.base import compute_dtype, rotary_frequencies
from jaxpe.validation import (check_array, check_finite_number, check_float, check_float_dtype, check_positive,
                              check_rank, is_int)


def sinusoidal_table(length: int, dim: int, *, theta: float = 10000.0, scale: float = 1.0,
                     dtype: Any = jnp.float32) -> jax.Array:
    """[length, dim] in `dtype` (a floating dtype; computed in float32, or float64 for float64, then cast):
    PE[i, 2k] = sin(scale·i·θ^(−2k/dim)), PE[i, 2k+1] = cos(same angle).

    Odd `dim` keeps every sine column and drops the last cosine column.
    """
    for name, value in (("length", length), ("dim", dim)):
        if not is_int(value, 1):
            raise ValueError(f"{name}={value!r} must be a positive int")
    check_positive("theta", theta)
    check_finite_number("scale", scale)
    if dtype is None:
        raise TypeError("dtype=None must be a floating-point dtype (e.g. jnp.float32)")
    check_float_dtype("dtype", dtype)
    length, dim = int(length), int(dim)
    half = (dim + 1) // 2
    exact = jnp.promote_types(jnp.float32, dtype)  # 16-bit angles of far positions would be off by whole radians
    freqs = rotary_frequencies(dim, theta, pairs=jnp.arange(half), dtype=exact)  # [half]: θ^(−2k/dim)
    angles = scale * jnp.arange(length, dtype=exact)[:, None] * freqs[None, :]  # [L, half]
    table = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(length, 2 * half)
    return table[:, :dim].astype(dtype)


def gather_positions(table: jax.Array, positions: jax.Array | None, length: int) -> jax.Array:
    """Rows of `table` [max_len, d] at `positions` ([B, L] or [L]; None means 0..length-1) -> [B|1, L, d].

    Raises when a static length exceeds the table, or a symbolic one (jax.export) is not bounded by it, or concrete
    positions lie outside [0, max_len); traced positions outside it give NaN rows (a negative one too: never a row
    counted from the end).
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
    if not isinstance(positions, jax.core.Tracer) and positions.size:
        values = np.asarray(positions)  # on the host: a jax reduction of a concrete array is staged under jit
        low, high = int(values.min()), int(values.max())
        if low < 0 or high >= max_len:
            raise ValueError(f"positions must be in [0, max_len={max_len}) to read the position table, got positions "
                             f"from {low} to {high}")
    positions = jnp.asarray(positions)
    if positions.ndim == 1:
        positions = positions[None]
    outside = jnp.where(positions < 0, max_len, positions)  # jnp.take would read a negative one from the end
    return jnp.take(table, outside, axis=0, mode="fill", fill_value=jnp.nan)


def check_table_inputs(x: jax.Array, positions: jax.Array | None) -> None:
    """TypeError unless x is a floating-point array (an integer x would round the table's rows away) and positions
    None or an integer array; ValueError unless x is [B, L, d] and positions [B, L] or [L]."""
    check_rank("x", x, 3, "B L d")
    check_float("x", x)
    if positions is None:
        return
    check_array("positions", positions, "B L")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"positions must be an integer array [B, L], got positions.dtype={positions.dtype}")
    b, length = x.shape[:2]
    if tuple(positions.shape) not in ((b, length), (length,)):
        raise ValueError(f"positions must have shape [B={b}, L={length}] or [L], got "
                         f"positions.shape={tuple(positions.shape)}")


def add_table_rows(x: jax.Array, table: jax.Array, positions: jax.Array | None) -> jax.Array:
    """x [B, L, d] (floating) plus the rows of `table` [max_len, d] at `positions` ([B, L] or [L] int;
    `gather_positions`), in x's dtype."""
    check_table_inputs(x, positions)
    return x + gather_positions(table, positions, x.shape[1]).astype(x.dtype)


def _flat_row_index(z_shape: tuple[int, ...], index: jax.Array) -> jax.Array:
    """int32 [B, H·Lq·Lk]: where z[b, i, h, index[b, h, i, j]] sits in batch row b of z [B, Lq, H, P] read flat."""
    b, lq, h, size = z_shape
    start = (jnp.arange(lq, dtype=jnp.int32)[None, None, :, None] * h
             + jnp.arange(h, dtype=jnp.int32)[None, :, None, None]) * size  # [1, H, Lq, 1]: where z[b, i, h] starts
    return (start + index).reshape(b, h * lq * index.shape[-1])  # not -1: B may be 0


def _fits_int32(z_shape: tuple[int, ...]) -> bool:
    return z_shape[1] * z_shape[2] * z_shape[3] < 2**31


def gather_table_rows(z: jax.Array, index: jax.Array) -> jax.Array:
    """z [B, Lq, H, P] (query i's logit for each table row in head h), index int32 [B, H, Lq, Lk] in [0, P) ->
    [B, H, Lq, Lk], z[b, i, h, index[b, h, i, j]].

    Each batch row reads its own flat [Lq·H·P] slice of z: one gather with the batch as its only batch dimension,
    on CPU ~10× cheaper than take_along_axis over [B, H, Lq]; z stays in the layout its matmul writes (no transposes
    of z or of its gradient), the backward is one plain scatter-add, and a batch sharded over devices stays sharded
    (an index into all of z would make every device gather all of it). Rows of more than 2³¹ entries gather by
    take_along_axis.
    """
    if not _fits_int32(z.shape):  # int32 flat indices
        return jnp.take_along_axis(jnp.transpose(z, (0, 2, 1, 3)), index, axis=-1)
    flat = _flat_row_index(z.shape, index)
    rows = z.reshape(z.shape[0], math.prod(z.shape[1:]))  # [B, Lq·H·P]; not -1: B may be 0
    return jnp.take_along_axis(rows, flat, axis=1, mode="clip").reshape(index.shape)


def gather_table_row_pairs(z: jax.Array, y: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`gather_table_rows` of two tables at the same index, (z[..index..], y[..index..]) in `compute_dtype`, in one
    gather: the pair travels as one complex64 (complex128 in float64; real z, imaginary y), so the per-entry cost of
    XLA's CPU gather, which does not depend on the entry's width, is paid once instead of twice. Plain ops, linear in
    (z, y): forward mode is the same gather of the tangents, and JAX's transpose of it is one complex scatter-add."""
    if not _fits_int32(z.shape):
        return gather_table_rows(z, index), gather_table_rows(y, index)
    dtype = compute_dtype(z, y)
    rows = lambda t: t.astype(dtype).reshape(t.shape[0], math.prod(t.shape[1:]))  # noqa: E731  [B, Lq·H·P]
    flat = _flat_row_index(z.shape, index)  # [B, H·Lq·Lk]
    got = jnp.take_along_axis(jax.lax.complex(rows(z), rows(y)), flat, axis=1, mode="clip")
    return jnp.real(got).reshape(index.shape), jnp.imag(got).reshape(index.shape)


def relative_logits(q: jax.Array, table: jax.Array, q_pos: jax.Array, k_pos: jax.Array | int) -> jax.Array:
    """q [B, Lq, H, D], table [npos, D], q_pos [B, Lq], k_pos [B, Lk] (or an int Lk: keys at 0..Lk−1)
    -> [B, H, Lq, Lk] q_i·r[clip(i − j, 0, npos − 1)] in `compute_dtype`."""
    npos = table.shape[0]
    k_pos = jnp.arange(k_pos)[None] if isinstance(k_pos, int) else k_pos
    b, lq, h = q.shape[:3]
    rel = jnp.clip(q_pos[:, :, None] - k_pos[:, None, :], 0, npos - 1)  # [B, Lq, Lk]
    z = jnp.einsum("bqhd,pd->bqhp", q, table.astype(q.dtype), preferred_element_type=compute_dtype(q))
    return gather_table_rows(z, jnp.broadcast_to(rel[:, None], (b, h) + rel.shape[1:]).astype(jnp.int32))


def relative_logits_indexed(q: jax.Array, table: jax.Array) -> jax.Array:
    """q [B, L, H, D], table [npos, D] -> [B, H, L, L] in `compute_dtype`, `relative_logits` with queries and keys
    at 0..L − 1 (q_i·r[clip(i − j, 0, npos − 1)]) without a gather: Music Transformer's skew (Huang et al., 2018).

    x[b, h, i, c] = q_i·r[clip(L − c, 0, npos − 1)] for c = 0..L, [B, H, L, L + 1]; read flat, row i's entries
    start i·(L + 1) apart, so the L·L window starting at L puts x[i, j + L − i] (distance i − j) at (i, j) for j ≤ i.
    Past the diagonal it reads the next row, so those entries are set to distance 0 as `relative_logits` gives.
    Forward and backward are a matmul, slices, pads and reshapes (on CPU several times cheaper than a gather of
    every entry and its scatter-add).
    """
    b, length, h, _ = q.shape
    distance = jnp.clip(length - jnp.arange(length + 1), 0, table.shape[0] - 1)  # [L + 1]
    heads_first = jnp.swapaxes(q, 1, 2)  # [B, H, L, D]: the [B, H, L, L + 1] product and its cotangent stay in place
    x = jnp.einsum("bhqd,cd->bhqc", heads_first, table[distance].astype(q.dtype),
                   preferred_element_type=compute_dtype(q))
    flat = x.reshape(b, h, length * (length + 1))
    skewed = flat[..., length:length + length * length].reshape(b, h, length, length)
    causal = jnp.arange(length)[None, :] <= jnp.arange(length)[:, None]  # [L, L]
    return jnp.where(causal, skewed, x[..., length:])  # x[..., L] is distance 0


def context_relative_logits(q: jax.Array, table: jax.Array, ctx: AttentionContext) -> jax.Array:
    """q [B, Lq, H, D], table [npos, D] -> [B, H, Lq, Lk] relative logits (`compute_dtype`) at the context's
    positions: the skew (`relative_logits_indexed`) when they are 0..L − 1 on both sides, else the gather
    (`relative_logits`)."""
    if ctx.indexed and ctx.k_pos is not None and ctx.k_pos.shape[1] == q.shape[1]:
        return relative_logits_indexed(q, table)
    return relative_logits(q, table, ctx.q_pos, ctx.k_pos)
