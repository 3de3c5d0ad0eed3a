"""The tiling that the blockwise paths of forgetting attention and stick-breaking attention share: square blocks of
queries and keys over a zero-padded length, grouped GQA heads, the visibility of a key block from a query block and
the static walk over the key blocks a query block can see.

Letters: B batch, L length (Lp padded to a multiple of the block), Hq query heads, Hkv key/value heads, G = Hq / Hkv,
D head dim, N = Lp / BS blocks of BS rows (queries) or columns (keys). Grouped layouts: queries [B, Hkv, G, Lp, ...],
keys [B, Hkv, Lp, D]; per query block [N, B, Hkv, G, BS, ...] (blocks first, for lax.map and lax.scan).

Visibility (one definition everywhere): key j is visible to query i iff j < L (not padding), j ≤ i (any j when
bidirectional), segment_ids[b, i] == segment_ids[b, j] (when given) and |i − j| < window (when given).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def tiling(length: int, block: int) -> tuple[int, int]:
    """(block side BS ≤ L, padded length Lp, a multiple of BS)."""
    size = min(block, length)
    return size, -(-length // size) * size


def padded(x: jax.Array, length: int) -> jax.Array:
    """[B, L, ...] zero-padded to [B, Lp, ...]."""
    return jnp.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def group_queries(x: jax.Array, num_kv: int, length: int, size: int) -> jax.Array:
    """[B, L, Hq, ...] -> [N, B, Hkv, G, BS, ...], padded to Lp = `length`: query head n is head n % G of group
    n // G."""
    b, _, n, *rest = x.shape
    x = padded(x, length).reshape(b, length // size, size, num_kv, n // num_kv, *rest)
    return jnp.moveaxis(x, (1, 2), (0, 4))


def ungroup_queries(x: jax.Array, length: int) -> jax.Array:
    """Inverse of `group_queries`: [N, B, Hkv, G, BS, ...] -> [B, L, Hq, ...]."""
    blocks, b, num_kv, g, size, *rest = x.shape
    x = jnp.moveaxis(x, (0, 4), (1, 2))
    return x.reshape(b, blocks * size, num_kv * g, *rest)[:, :length]


def group_keys(x: jax.Array, length: int) -> jax.Array:
    """[B, L, Hkv, D] -> [B, Hkv, Lp, D], padded to Lp = `length`."""
    return jnp.swapaxes(padded(x, length), 1, 2)


def ungroup_keys(x: jax.Array, length: int) -> jax.Array:
    """Inverse of `group_keys`: [B, Hkv, Lp, D] -> [B, L, Hkv, D]."""
    return jnp.swapaxes(x, 1, 2)[:, :length]


def segment_blocks(segment_ids: jax.Array | None, length: int, size: int
                   ) -> tuple[jax.Array | None, jax.Array | None]:
    """Document ids [B, L] -> (every key's [B, Lp], the rows' per query block [N, B, BS]); (None, None) without."""
    if segment_ids is None:
        return None, None
    seg = padded(segment_ids, length)
    return seg, jnp.moveaxis(seg.reshape(seg.shape[0], length // size, size), 1, 0)


def key_block(x: jax.Array, index: jax.Array, size: int, axis: int) -> jax.Array:
    """The key block `index` of x along `axis`."""
    return lax.dynamic_slice_in_dim(x, index * size, size, axis=axis)


def add_key_block(total: jax.Array, part: jax.Array, index: jax.Array, axis: int) -> jax.Array:
    """total[..., index·BS : (index + 1)·BS, ...] += part along `axis`."""
    size = part.shape[axis]
    start = index * size
    return lax.dynamic_update_slice_in_dim(
        total, lax.dynamic_slice_in_dim(total, start, size, axis=axis) + part, start, axis=axis)


def visible(rows: jax.Array, index: jax.Array, size: int, *, length: int, causal: bool, window: int | None,
            seg_rows: jax.Array | None, seg: jax.Array | None) -> jax.Array:
    """Mask [B|1, 1, 1, BS, BS]: key j = index·BS + c visible from row i (module docstring). rows [BS] int32;
    seg_rows [B, BS] are the rows' document ids, seg [B, Lp] every key's."""
    cols = index * size + jnp.arange(size, dtype=jnp.int32)
    mask = (cols < length)[None, :] & jnp.ones((rows.shape[0], 1), jnp.bool_)
    if causal:
        mask &= cols[None, :] <= rows[:, None]
    if window is not None:
        mask &= jnp.abs(rows[:, None] - cols[None, :]) < window
    mask = mask[None, None, None]
    if seg_rows is not None:
        seg_keys = lax.dynamic_slice_in_dim(seg, index * size, size, axis=1)  # [B, BS]
        mask = mask & (seg_rows[:, :, None] == seg_keys[:, None, :])[:, None, None]
    return mask


def walked_blocks(blocks: int, size: int, *, causal: bool, window: int | None) -> int:
    """The static number of key blocks one query block walks: all N (bidirectional), the diagonal and those before
    it (causal), and under a window only the 1 + ⌈(W − 1) / BS⌉ blocks it can reach on each side that it looks."""
    if window is None:
        return blocks
    reach = -(-(window - 1) // size)
    return min(blocks, 1 + reach if causal else 1 + 2 * reach)


def walk(visit: Callable[[jax.Array, Any], Any], init: Any, block: jax.Array, *, blocks: int, walked: int,
         causal: bool) -> Any:
    """carry = visit(index, carry) over the key blocks that query block `block` may see: causal, from the diagonal
    back (index = block, block − 1, ...; suffix sums over keys accumulate in that order); bidirectional, from the
    first block that the window reaches forward. Blocks outside [0, N) are skipped (lax.cond): the trip count is
    static, `walked`."""
    if causal:
        first, step = block, -1
    else:
        first, step = (0 if walked == blocks else block - (walked - 1) // 2), 1

    def one(carry, t):
        index = first + step * t
        inside = (index >= 0) & (index < blocks)
        return lax.cond(inside, functools.partial(visit, index), lambda c: c, carry), None

    return lax.scan(one, init, jnp.arange(walked, dtype=jnp.int32))[0]
