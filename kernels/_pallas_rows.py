"""What the Pallas kernels of forgetting attention and stick-breaking attention share: one program per (query block,
batch, query head), its BlockSpecs, the key blocks a query block walks and the query blocks a key block's gradients
walk (each split where whole tiles are visible and need no mask); and the visibility of a tile, which CoPE's Pallas
kernels use too.

Letters: B batch, L length (Lp padded), Hq query heads, Hkv key/value heads, G = Hq / Hkv, D head dim (Dp padded to
a power of two). Tiles are [block_q, block_k].
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxpe.kernels._checks import check_fused, fused_refusal
from jaxpe.kernels._common import BlockSizes, filled, fold_scale, resolve_interpret, tile_extent, triton_compiler_params


@dataclasses.dataclass(frozen=True)
class RowConfig:
    """Static settings of one call, fitted to its shapes (hashable: the jit static argument, the custom_vjp's
    non-differentiable one and the kernels' keyword argument); a kernel adds its own options in a subclass."""

    sm_scale: float
    length: int  # L, before padding
    blocks: BlockSizes
    interpret: bool
    num_warps: int  # the forward's
    num_warps_bwd: int  # the backward's
    num_stages: int | None  # None: 2 in the forward, 1 in the backward
    window: int | None = None  # sliding window W (< L), None: the whole causal prefix

    def compiler_params(self, *, backward: bool) -> Any:
        return triton_compiler_params(num_warps=self.num_warps_bwd if backward else self.num_warps,
                                      num_stages=self.num_stages or (1 if backward else 2))


@dataclasses.dataclass(frozen=True)
class RowSpecs:
    """BlockSpecs of a kernel with one program per (query block of `bq` rows, batch, query head): grid
    (Lp / bq, B, Hq)."""

    row: pl.BlockSpec  # [bq, Dp] of a [B, Lp, Hq, Dp] array
    row_full: pl.BlockSpec  # [Lp, Dp] of a [B, Lp, Hq, Dp] array, head n
    kv_full: pl.BlockSpec  # [Lp, Dp] of a [B, Lp, Hkv, Dp] array, kv head n // G
    stat: pl.BlockSpec  # [bq] of [B, Hq, Lp]
    stat_full: pl.BlockSpec  # [Lp] of [B, Hq, Lp]
    grid: tuple[int, int, int]
    seg_rows: pl.BlockSpec  # [bq] of document ids [B, Lp]
    seg_keys: pl.BlockSpec  # [Lp] of document ids [B, Lp]

    def segments(self, seg: jax.Array | None) -> list[pl.BlockSpec | None]:
        """The specs of the rows' and the keys' document ids (two Nones without documents)."""
        return [self.seg_rows, self.seg_keys] if seg is not None else [None, None]


def row_specs(q: jax.Array, k: jax.Array, bq: int) -> RowSpecs:
    """The specs for q [B, Lp, Hq, Dp] and k [B, Lp, Hkv, Dp] with query blocks of `bq` rows."""
    batch, padded, num_heads, dp = q.shape
    groups = num_heads // k.shape[2]
    return RowSpecs(
        row=pl.BlockSpec((None, bq, None, dp), lambda i, b, h: (b, i, h, 0)),
        row_full=pl.BlockSpec((None, padded, None, dp), lambda i, b, h: (b, 0, h, 0)),
        kv_full=pl.BlockSpec((None, padded, None, dp), lambda i, b, h: (b, 0, h // groups, 0)),
        stat=pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
        stat_full=pl.BlockSpec((None, None, padded), lambda i, b, h: (b, h, 0)),
        grid=(padded // bq, batch, num_heads),
        seg_rows=pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
        seg_keys=pl.BlockSpec((None, padded), lambda i, b, h: (b, 0)),
    )


def open_rows(q: jax.Array, *, sm_scale: float | jax.Array, block_sizes: BlockSizes | None, blocks_type: type,
              default_warps: Callable[..., int], interpret: bool | None, num_warps: int | None,
              num_stages: int | None, impl: str = "pallas", defaults: BlockSizes | None = None
              ) -> tuple[jax.Array, dict[str, Any]]:
    """The opening of a row kernel's entry (its operation's checks already made): the fused path `impl`'s refusals
    and tuning checks, then (q, the `RowConfig` fields but the window) with a traced sm_scale folded into q
    (`fold_scale`), blocks fitted to the length (None fields: `defaults`, else `blocks_type.default` for D and
    dtype) and num_warps (both kernels') by default the kernel's `default_warps(D, dtype, backward=...)`."""
    check_fused(q, fused_refusal(q, impl=impl), block_sizes=block_sizes,
                blocks_type=blocks_type, num_warps=num_warps, num_stages=num_stages)
    q, sm_scale = fold_scale(q, sm_scale)
    blocks = block_sizes or blocks_type()
    if defaults is not None:
        blocks = blocks_type(**filled(blocks, defaults))
    blocks = blocks.fitted(length=q.shape[1], head_dim=q.shape[3], dtype=q.dtype)
    return q, dict(sm_scale=sm_scale, length=q.shape[1], blocks=blocks, interpret=resolve_interpret(interpret),
                   num_warps=num_warps or default_warps(q.shape[3], q.dtype, backward=False),
                   num_warps_bwd=num_warps or default_warps(q.shape[3], q.dtype, backward=True), num_stages=num_stages)


def padded_inputs(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, multiple: int
                  ) -> tuple[jax.Array, ...]:
    """q, k, v with L zero-padded to a multiple of `multiple` and D to a power of two; document ids [B, Lp] (padded
    keys take id 0: no real row sees a padded key, which is after it) or None."""
    length, d = q.shape[1], q.shape[3]
    padded, dp = -(-length // multiple) * multiple, tile_extent(d)
    pad = [(0, 0), (0, padded - length), (0, 0), (0, dp - d)]
    seg = None if segment_ids is None else jnp.pad(segment_ids, [(0, 0), (0, padded - length)])
    return (*(jnp.pad(x, pad) for x in (q, k, v)), seg)


def visible(rows: jax.Array, cols: jax.Array, window: int | None, seg_rows: jax.Array | None,
            seg_cols: jax.Array | None) -> jax.Array:
    """Mask [block_q, block_k]: key `cols` visible from row `rows` (causal, inside the window, same document)."""
    mask = cols[None, :] <= rows[:, None]
    if window is not None:
        mask &= rows[:, None] - cols[None, :] < window
    if seg_rows is not None:
        mask &= seg_rows[:, None] == seg_cols[None, :]
    return mask


def key_blocks(row0: jax.Array, block_q: int, block_k: int, window: int | None, has_segments: bool, *,
               diagonal: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(first, below, end): the rows row0 .. row0 + block_q − 1 see key blocks [first, end); without a window or
    documents those before `below` hold only keys every row sees (keys <= row0 with `diagonal`, keys < row0
    without), so their tiles need no mask; with either, below = first (every tile masked)."""
    first = 0 if window is None else jnp.maximum(row0 - (window - 1), 0) // block_k
    below = first if window is not None or has_segments else (row0 + int(diagonal)) // block_k
    return first, below, (row0 + block_q + block_k - 1) // block_k


def query_blocks(col0: jax.Array, block_k: int, block_q: int, window: int | None, padded: int, has_segments: bool
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(first, after, end): query blocks [first, end) (of block_q rows, Lp = padded) hold a row that can see a key
    of col0 .. col0 + block_k − 1; without a window or documents those from `after` on hold only rows at or after the
    block's last key, which see every key of it, so their tiles need no mask; with either, after = end (every tile
    masked)."""
    first, end = col0 // block_q, padded // block_q
    if window is not None:
        end = jnp.minimum(end, (col0 + block_k - 1 + window - 1) // block_q + 1)
    if window is not None or has_segments:
        return first, end, end
    return first, jnp.clip((col0 + block_k - 1 + block_q - 1) // block_q, first, end), end
