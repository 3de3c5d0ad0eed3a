"""Fused CoPE attention in Pallas (Triton lowering on GPU, interpret mode elsewhere): forward, dq and dk/dv kernels,
with packed documents and sliding windows.

Letters (as gemma's): B batch, L length (Lp padded), N query heads, K key/value heads, G = N / K group size, D head
dim (Dp padded to a power of two), P = npos table rows (Pp padded), NK = Lp / block_k key blocks. Einsum subscripts
are the lower-case letters, with t for query and s for key positions. Kernel tiles are [block_q, block_k].

The maths (SPEC §3): g_ij = sigmoid(sm_scale·q_i·kg_j) for j ≤ i, p_ij = min(Σ_{t=j..i} g_it, P − 1),
z_ip = q_i·e_p (one XLA matmul outside the kernels), pos_ij = (1 − w)·z_i,lo + w·z_i,hi with lo = ⌊p⌋,
hi = min(lo + 1, P − 1), w = p − lo; logits_ij = sm_scale·(q_i·k_j + pos_ij), causal softmax, times v.

Forward: one program per (query block, batch, head) walks key blocks in reverse from the diagonal, carrying the
suffix sum R_i of the gates; inside a tile p = R + (rowtotal − cumsum + g). Triton cannot gather along a tile
axis, so pos is Σ_c z_ic·max(0, 1 − |p − c|) over the table rows c the tile's positions reach (a short loop
of column loads). Once every row's R reaches P − 1, the remaining tiles are plain attention plus the per-row
constant z_i,P−1: a second loop with no gate work. When differentiating, the forward also saves R_i before each
key block ([B, N, NK, Lp] float32: L·L/block_k values, never L×L).

Backward: with ds = ∂L/∂(q·k + pos), ∂L/∂p_ij = ds_ij·(z_i,hi − z_i,lo) (0 once clamped) and the gate gradient
dg_it = Σ_{j≤t} ∂L/∂p_ij is a prefix sum over keys. The dq kernel walks key blocks forward from 0, reading the
saved R (so p is rebuilt exactly) and carrying that prefix sum, which it also saves per key block for the
dk/dv kernel. The dk/dv kernel (one program per key block and kv head, looping over the group's query heads and
the query blocks below the diagonal) then has every term locally: no atomics. ∂L/∂z comes out of the dq
kernel; the table gradient and its share of dq are XLA matmuls.

Documents and windows: key j is visible to query i iff j ≤ i, segment_ids[b, i] == segment_ids[b, j] (when given)
and i − j < window (when given); invisible keys have gate 0. The document ids are an extra int32 input [B, Lp],
passed only when given (one block of row ids and the key ids of the batch row per program), compared per tile.
A window bounds every loop: the forward and dq kernels start at the key block of key i0 − W + 1 (i0 the block's
first row), the dk/dv kernel stops at the query block of row j1 + W − 1 (j1 the block's last key), so the work is
O(L·(W + block)). Every (query block, key block) pair the backward visits was visited by the forward.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxpe.kernels._checks import check_cope_inputs, check_pallas_settings, check_segment_ids, check_window
from jaxpe.kernels._common import (MASK_VALUE, check_block_sizes, check_head_dim, dot, next_power_of_two,
                                   resolve_interpret, tile_extent, triton_compiler_params)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two >= 16). block_k is shared by all three kernels: the backward reads the gate sums
    that the forward saved per key block. Blocks larger than the (padded) sequence are shrunk to fit."""

    block_q: int = 64  # query rows per forward program
    block_k: int = 64  # keys per tile, every kernel
    block_q_dq: int = 64  # query rows per dq program
    block_q_dkv: int = 64  # query rows per tile of the dk/dv kernel

    def __post_init__(self) -> None:
        check_block_sizes(self)

    def fitted(self, length: int) -> BlockSizes:
        """The same sizes, each capped at the next power of two >= length (and >= 16)."""
        cap = tile_extent(length)
        return BlockSizes(*(min(getattr(self, f.name), cap) for f in dataclasses.fields(self)))


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static settings of one call, fitted to its shapes (hashable: the jit static argument, the custom_vjp's
    non-differentiable one and the kernels' keyword argument)."""

    sm_scale: float
    npos: int  # P
    length: int  # L, before padding
    blocks: BlockSizes  # fitted to L
    interpret: bool
    num_warps: int
    num_stages: int
    window: int | None = None  # sliding window W (< L), None: the whole causal prefix
    segments: bool = False  # document ids are an input of every kernel

    def compiler_params(self):
        """Triton settings for every kernel of the call."""
        return triton_compiler_params(num_warps=self.num_warps, num_stages=self.num_stages)


def _config(q: jax.Array, pos_emb: jax.Array, *, sm_scale: float, block_sizes: BlockSizes, interpret: bool,
            num_warps: int | None, num_stages: int | None, window: int | None = None,
            segments: bool = False) -> _Config:
    """The static settings for q [B, L, N, D] and a table of P rows: blocks fitted to L, 4 warps up to D = 64 and 8
    above, 2 stages (unless given)."""
    return _Config(sm_scale=float(sm_scale), npos=pos_emb.shape[-2], length=q.shape[1],
                   blocks=block_sizes.fitted(q.shape[1]), interpret=interpret,
                   num_warps=num_warps or (4 if tile_extent(q.shape[3]) <= 64 else 8), num_stages=num_stages or 2,
                   window=window, segments=segments)


def _visible(rows: jax.Array, cols: jax.Array, window: int | None, seg_rows: jax.Array | None,
             seg_cols: jax.Array | None) -> jax.Array:
    """Mask [block_q, block_k]: key `cols` visible from row `rows` (causal, inside the window, same document)."""
    mask = cols[None, :] <= rows[:, None]
    if window is not None:
        mask &= rows[:, None] - cols[None, :] < window
    if seg_rows is not None:
        mask &= seg_rows[:, None] == seg_cols[None, :]
    return mask


def _first_key_block(row0: jax.Array, window: int | None, block_k: int) -> jax.Array | int:
    """The first key block that row `row0` (or any later row) can see: 0 without a window."""
    if window is None:
        return 0
    return lax.div(jnp.maximum(row0 - (window - 1), 0), block_k)


def _segment_refs(refs: tuple, segments: bool) -> tuple:
    """Split a kernel's trailing refs into (row ids, key ids) — both None without documents — and the rest."""
    if not segments:
        return None, None, refs
    return refs[0], refs[1], refs[2:]


def _gates(q: jax.Array, kg: jax.Array, mask: jax.Array, sm_scale: float) -> jax.Array:
    """g [block_q, block_k] float32, zero where masked."""
    return jnp.where(mask, jax.nn.sigmoid(sm_scale * dot(q, kg, trans_b=True)), 0.0)


def _suffix_positions(g: jax.Array, r: jax.Array, npos: int) -> jax.Array:
    """p_ij = min(R_i + Σ_{t ≥ j in tile} g_it, P − 1), the in-tile suffix sum as rowtotal − cumsum + g."""
    total = jnp.sum(g, axis=1)
    return jnp.minimum(r[:, None] + total[:, None] - jnp.cumsum(g, axis=1) + g, npos - 1)


def _position_range(p: jax.Array, valid: jax.Array, npos: int) -> tuple[jax.Array, jax.Array]:
    """First and last table rows (int32 scalars) that the valid positions of a tile interpolate between."""
    lo = jnp.floor(jnp.min(jnp.where(valid, p, npos - 1.0)))
    hi = jnp.minimum(jnp.floor(jnp.max(jnp.where(valid, p, 0.0))) + 1.0, npos - 1.0)
    return lo.astype(jnp.int32), hi.astype(jnp.int32)


def _interpolate(column, p: jax.Array, lo: jax.Array, hi: jax.Array, *, slope: bool):
    """pos [block_q, block_k] = Σ_c z_c·max(0, 1 − |p − c|) for c in [lo, hi]; with slope, also ∂pos/∂p
    (z_hi − z_lo: −z_c where 0 ≤ p − c < 1, +z_c where −1 ≤ p − c < 0). `column(c)` loads z[:, c] as [block_q, 1]."""

    def body(c, acc):
        z_c = column(c)
        x = p - c.astype(jnp.float32)
        weight = 1.0 - jnp.abs(x)
        pos = acc[0] + jnp.where(weight > 0.0, weight * z_c, 0.0)  # rows out of reach add nothing, even NaN
        if not slope:
            return (pos,)
        d = jnp.where((x >= 0.0) & (x < 1.0), -z_c, jnp.where((x >= -1.0) & (x < 0.0), z_c, 0.0))
        return pos, acc[1] + d

    init = (jnp.zeros(p.shape, jnp.float32),) * (2 if slope else 1)
    return lax.fori_loop(lo, hi + 1, body, init)


def _softmax_grads(s, mask, lse, delta, do, v, sm_scale):
    """probs and ds = ∂L/∂(q·k + pos) for one tile, from the saved lse and delta = rowsum(o·do)."""
    probs = jnp.exp(jnp.where(mask, sm_scale * s, MASK_VALUE) - lse[:, None])
    ds = sm_scale * probs * (dot(do, v, trans_b=True) - delta[:, None])
    return probs, ds


def _forward_kernel(q_ref, k_ref, v_ref, kg_ref, z_ref, *refs, config: _Config):
    """One query block: key blocks in reverse from the diagonal, full tiles until every row is clamped, then
    clamped tiles. Refs: q/o [bq, Dp], k/v/kg [Lp, Dp], z [bq, Pp], (with documents: row ids [bq], key ids [Lp]),
    lse [bq], optional r [NK, bq] (saved R)."""
    seg_q_ref, seg_k_ref, (o_ref, lse_ref, *r_ref) = _segment_refs(refs, config.segments)
    sm_scale, npos, length, block_k = config.sm_scale, config.npos, config.length, config.blocks.block_k
    block_q = q_ref.shape[0]
    rows = pl.program_id(0) * block_q + jnp.arange(block_q)
    live = rows < length
    seg_rows = None if seg_q_ref is None else seg_q_ref[...]
    q = q_ref[...]
    z_last = z_ref[:, pl.ds(npos - 1, 1)]  # [bq, 1]

    def column(c):
        return z_ref[:, pl.ds(c, 1)]

    def tile(index, carry, full: bool):
        m, l, acc, r = carry
        keys = pl.ds(index * block_k, block_k)
        mask = _visible(rows, index * block_k + jnp.arange(block_k), config.window, seg_rows,
                        None if seg_k_ref is None else seg_k_ref[keys])
        s = dot(q, k_ref[keys, :], trans_b=True)  # [bq, bk]
        if r_ref:
            r_ref[0][pl.ds(index, 1), :] = r[None, :]
        if full:
            g = _gates(q, kg_ref[keys, :], mask, sm_scale)
            p = _suffix_positions(g, r, npos)
            lo, hi = _position_range(p, mask, npos)
            s = s + _interpolate(column, p, lo, hi, slope=False)[0]
            r = r + jnp.sum(g, axis=1)
        else:
            s = s + z_last
        logits = jnp.where(mask, sm_scale * s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        correction = jnp.exp(m - m_new)
        probs = jnp.exp(logits - m_new[:, None])
        v = v_ref[keys, :]
        acc = acc * correction[:, None] + dot(probs.astype(v.dtype), v)
        return m_new, l * correction + jnp.sum(probs, axis=1), acc, r

    first = _first_key_block(pl.program_id(0) * block_q, config.window, block_k)

    def unclamped(state):
        index, carry = state
        return jnp.logical_and(index >= first, jnp.min(jnp.where(live, carry[3], jnp.inf)) < npos - 1)

    init = (jnp.full((block_q,), MASK_VALUE, jnp.float32), jnp.zeros((block_q,), jnp.float32),
            jnp.zeros(q.shape, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    last = lax.div((pl.program_id(0) + 1) * block_q + block_k - 1, block_k) - 1
    index, carry = lax.while_loop(unclamped, lambda st: (st[0] - 1, tile(st[0], st[1], True)), (last, init))
    walked = index + 1 if config.window is None else index + 1 - first  # the clamped blocks left
    m, l, acc, _ = lax.fori_loop(0, walked, lambda i, c: tile(index - i, c, False), carry)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dq_kernel(q_ref, k_ref, v_ref, kg_ref, z_ref, do_ref, lse_ref, delta_ref, r_ref, *refs, config: _Config):
    """One query block: key blocks forward from the first the forward walked (0 without a window) to the diagonal,
    clamped tiles first. Carries the prefix sum of ∂L/∂p and saves it per key block. Refs: q/do/dq [bq, Dp],
    k/v/kg [Lp, Dp], z/dz [bq, Pp], lse/delta [bq], r/pdp [NK, bq], with documents row ids [bq] and key ids [Lp]."""
    seg_q_ref, seg_k_ref, (dq_ref, dz_ref, pdp_ref) = _segment_refs(refs, config.segments)
    sm_scale, npos, length, block_k = config.sm_scale, config.npos, config.length, config.blocks.block_k
    block_q = q_ref.shape[0]
    rows = pl.program_id(0) * block_q + jnp.arange(block_q)
    seg_rows = None if seg_q_ref is None else seg_q_ref[...]
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    table_rows = jnp.arange(dz_ref.shape[1])[None, :]

    def column(c):
        return z_ref[:, pl.ds(c, 1)]

    def saved_r(index):
        seen = (rows >= index * block_k) & (rows < length)  # rows the forward wrote R for
        return seen, jnp.where(seen, r_ref[index, :], 0.0)

    def tile(index, carry, full: bool):
        dq, dz, dp_before = carry
        keys = pl.ds(index * block_k, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        mask = _visible(rows, index * block_k + jnp.arange(block_k), config.window, seg_rows,
                        None if seg_k_ref is None else seg_k_ref[keys])
        pdp_ref[pl.ds(index, 1), :] = dp_before[None, :]
        s = dot(q, k, trans_b=True)
        if not full:
            probs, ds = _softmax_grads(s + z_ref[:, pl.ds(npos - 1, 1)], mask, lse, delta, do, v, sm_scale)
            dz = dz + jnp.sum(ds, axis=1, keepdims=True) * (table_rows == npos - 1)
            return dq + dot(ds.astype(k.dtype), k), dz, dp_before
        kg = kg_ref[keys, :]
        g = _gates(q, kg, mask, sm_scale)
        p = _suffix_positions(g, saved_r(index)[1], npos)
        lo, hi = _position_range(p, mask, npos)
        pos, slope = _interpolate(column, p, lo, hi, slope=True)
        probs, ds = _softmax_grads(s + pos, mask, lse, delta, do, v, sm_scale)
        dp = jnp.where(p < npos - 1, ds * slope, 0.0)
        dgate = sm_scale * (dp_before[:, None] + jnp.cumsum(dp, axis=1)) * g * (1.0 - g)
        dq = dq + dot(ds.astype(k.dtype), k) + dot(dgate.astype(kg.dtype), kg)

        def dz_column(c, dz):
            weight = jnp.maximum(0.0, 1.0 - jnp.abs(p - c.astype(jnp.float32)))
            return dz + jnp.sum(ds * weight, axis=1, keepdims=True) * (table_rows == c)

        return dq, lax.fori_loop(lo, hi + 1, dz_column, dz), dp_before + jnp.sum(dp, axis=1)

    num_blocks = lax.div((pl.program_id(0) + 1) * block_q + block_k - 1, block_k)

    def clamped(state):
        index = state[0]
        seen, r = saved_r(jnp.minimum(index, num_blocks - 1))
        return jnp.logical_and(index < num_blocks, jnp.min(jnp.where(seen, r, jnp.inf)) >= npos - 1)

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(dz_ref.shape, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    first = _first_key_block(pl.program_id(0) * block_q, config.window, block_k)
    index, carry = lax.while_loop(clamped, lambda st: (st[0] + 1, tile(st[0], st[1], False)), (first, init))
    dq, dz, _ = lax.fori_loop(index, num_blocks, lambda i, c: tile(i, c, True), carry)
    dq_ref[...] = dq
    dz_ref[...] = dz


def _dkv_kernel(q_ref, k_ref, v_ref, kg_ref, z_ref, do_ref, lse_ref, delta_ref, r_ref, pdp_ref, *refs,
                config: _Config):
    """One key block of one kv head: loops over the G query heads of the group and the query blocks from the
    diagonal down (to the last one inside the window). Refs: k/v/kg/dk/dv/dkg [bk, Dp], q/do [Lp, G, Dp],
    z [G, Lp, Pp], lse/delta [G, Lp], r/pdp [G, NK, Lp], with documents row ids [Lp] and key ids [bk]."""
    seg_q_ref, seg_k_ref, (dk_ref, dv_ref, dkg_ref) = _segment_refs(refs, config.segments)
    sm_scale, npos, length, block_q = config.sm_scale, config.npos, config.length, config.blocks.block_q_dkv
    block_k = k_ref.shape[0]
    index = pl.program_id(0)
    k, v, kg = k_ref[...], v_ref[...], kg_ref[...]
    cols = index * block_k + jnp.arange(block_k)
    seg_cols = None if seg_k_ref is None else seg_k_ref[...]

    def tile(qb, carry, head):
        dk, dv, dkg = carry
        span = pl.ds(qb * block_q, block_q)
        rows = qb * block_q + jnp.arange(block_q)
        q, do = q_ref[span, head, :], do_ref[span, head, :]
        lse, delta = lse_ref[head, span], delta_ref[head, span]
        seen = (rows >= index * block_k) & (rows < length)
        r = jnp.where(seen, r_ref[head, index, span], 0.0)
        mask = _visible(rows, cols, config.window, None if seg_q_ref is None else seg_q_ref[span], seg_cols)
        s = dot(q, k, trans_b=True)

        def attention(s):
            probs, ds = _softmax_grads(s, mask, lse, delta, do, v, sm_scale)
            return (ds, dk + dot(ds.astype(q.dtype), q, trans_a=True),
                    dv + dot(probs.astype(do.dtype), do, trans_a=True))

        def at_clamp():
            _, dk_new, dv_new = attention(s + z_ref[head, span, pl.ds(npos - 1, 1)])
            return dk_new, dv_new, dkg

        def full():
            g = _gates(q, kg, mask, sm_scale)
            p = _suffix_positions(g, r, npos)
            lo, hi = _position_range(p, mask, npos)
            pos, slope = _interpolate(lambda c: z_ref[head, span, pl.ds(c, 1)], p, lo, hi, slope=True)
            ds, dk_new, dv_new = attention(s + pos)
            dp = jnp.where(p < npos - 1, ds * slope, 0.0)
            dp_before = jnp.where(seen, pdp_ref[head, index, span], 0.0)
            dgate = sm_scale * (dp_before[:, None] + jnp.cumsum(dp, axis=1)) * g * (1.0 - g)
            return dk_new, dv_new, dkg + dot(dgate.astype(q.dtype), q, trans_a=True)

        return lax.cond(jnp.min(jnp.where(seen, r, jnp.inf)) >= npos - 1, at_clamp, full)

    first = lax.div(index * block_k, block_q)
    num_q_blocks = q_ref.shape[0] // block_q
    if config.window is not None:  # the last query block with a row that sees this key block
        num_q_blocks = jnp.minimum(num_q_blocks, lax.div((index + 1) * block_k + config.window - 2, block_q) + 1)

    def head_loop(head, carry):
        return lax.fori_loop(first, num_q_blocks, lambda qb, c: tile(qb, c, head), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv, dkg = lax.fori_loop(0, q_ref.shape[1], head_loop, (zeros, zeros, zeros))
    dk_ref[...] = dk
    dv_ref[...] = dv
    dkg_ref[...] = dkg


def _padded(q, k, v, kg, pos_emb, blocks: BlockSizes):
    """Zero-pad L to a multiple of every block and D to a power of two; z [B, N, Lp, Pp] float32 = q·e."""
    length, d = q.shape[1], q.shape[3]
    multiple = max(blocks.block_q, blocks.block_k, blocks.block_q_dq, blocks.block_q_dkv)
    padded, dp = -(-length // multiple) * multiple, tile_extent(d)
    pad = [(0, 0), (0, padded - length), (0, 0), (0, dp - d)]
    q, k, v, kg = (jnp.pad(x, pad) for x in (q, k, v, kg))
    e = jnp.pad(pos_emb.astype(q.dtype), [(0, 0)] * (pos_emb.ndim - 1) + [(0, dp - d)])
    spec = "btnd,pd->bntp" if e.ndim == 2 else "btnd,npd->bntp"
    z = jnp.einsum(spec, q, e, preferred_element_type=jnp.float32)
    npos = pos_emb.shape[-2]
    z = jnp.pad(z, [(0, 0), (0, 0), (0, 0), (0, next_power_of_two(npos) - npos)])
    return q, k, v, kg, e, z


@dataclasses.dataclass(frozen=True)
class _RowSpecs:
    """BlockSpecs of a kernel with one program per (query block of `bq` rows, batch, query head): grid
    (Lp / bq, B, N). Every key/value row of the head's kv head is visible; z, statistics and the per-key-block
    row sums are blocked by rows."""

    row: pl.BlockSpec  # [bq, Dp] of a [B, Lp, N, Dp] array
    kv_full: pl.BlockSpec  # [Lp, Dp] of a [B, Lp, K, Dp] array, kv head n // G
    z: pl.BlockSpec  # [bq, Pp] of z [B, N, Lp, Pp]
    stat: pl.BlockSpec  # [bq] of [B, N, Lp]
    per_key_block: pl.BlockSpec  # [NK, bq] of [B, N, NK, Lp]
    grid: tuple[int, int, int]
    seg_rows: pl.BlockSpec  # [bq] of document ids [B, Lp]
    seg_keys: pl.BlockSpec  # [Lp] of document ids [B, Lp]


def _row_specs(q: jax.Array, k: jax.Array, z: jax.Array, bq: int, bk: int) -> _RowSpecs:
    batch, padded, num_heads, dp = q.shape
    groups = num_heads // k.shape[2]
    return _RowSpecs(
        row=pl.BlockSpec((None, bq, None, dp), lambda i, b, h: (b, i, h, 0)),
        kv_full=pl.BlockSpec((None, padded, None, dp), lambda i, b, h: (b, 0, h // groups, 0)),
        z=pl.BlockSpec((None, None, bq, z.shape[-1]), lambda i, b, h: (b, h, i, 0)),
        stat=pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
        per_key_block=pl.BlockSpec((None, None, padded // bk, bq), lambda i, b, h: (b, h, 0, i)),
        grid=(padded // bq, batch, num_heads),
        seg_rows=pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
        seg_keys=pl.BlockSpec((None, padded), lambda i, b, h: (b, 0)),
    )


def _forward_call(config: _Config, q, k, v, kg, z, seg, *, save_r: bool):
    batch, padded, num_heads, _ = q.shape
    bk = config.blocks.block_k
    specs = _row_specs(q, k, z, config.blocks.block_q, bk)
    segments = () if seg is None else (seg, seg)
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, num_heads, padded), jnp.float32)]
    out_specs = [specs.row, specs.stat]
    if save_r:
        out_shape.append(jax.ShapeDtypeStruct((batch, num_heads, padded // bk, padded), jnp.float32))
        out_specs.append(specs.per_key_block)
    return pl.pallas_call(
        functools.partial(_forward_kernel, config=config), grid=specs.grid,
        in_specs=[specs.row, specs.kv_full, specs.kv_full, specs.kv_full, specs.z,
                  *([specs.seg_rows, specs.seg_keys] if segments else [])],
        out_specs=out_specs, out_shape=out_shape, compiler_params=config.compiler_params(),
        interpret=config.interpret, name="cope_forward",
    )(q, k, v, kg, z, *segments)


def _dq_call(config: _Config, q, k, v, kg, z, do, lse, delta, r, seg):
    specs = _row_specs(q, k, z, config.blocks.block_q_dq, config.blocks.block_k)
    segments = () if seg is None else (seg, seg)
    return pl.pallas_call(
        functools.partial(_dq_kernel, config=config), grid=specs.grid,
        in_specs=[specs.row, specs.kv_full, specs.kv_full, specs.kv_full, specs.z, specs.row, specs.stat,
                  specs.stat, specs.per_key_block, *([specs.seg_rows, specs.seg_keys] if segments else [])],
        out_specs=[specs.row, specs.z, specs.per_key_block],
        out_shape=[jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(z.shape, jnp.float32),
                   jax.ShapeDtypeStruct(r.shape, jnp.float32)],
        compiler_params=config.compiler_params(), interpret=config.interpret, name="cope_backward_dq",
    )(q, k, v, kg, z, do, lse, delta, r, *segments)


def _dkv_call(config: _Config, q, k, v, kg, z, do, lse, delta, r, pdp, seg):
    batch, padded, num_heads, dp = q.shape
    num_kv = k.shape[2]
    groups = num_heads // num_kv
    bk = config.blocks.block_k
    num_k = padded // bk
    key_block = pl.BlockSpec((None, bk, None, dp), lambda i, b, h: (b, i, h, 0))
    q_group = pl.BlockSpec((None, padded, groups, dp), lambda i, b, h: (b, 0, h, 0))
    stat_group = pl.BlockSpec((None, groups, padded), lambda i, b, h: (b, h, 0))
    per_key_block = pl.BlockSpec((None, groups, num_k, padded), lambda i, b, h: (b, h, 0, 0))
    segments = () if seg is None else (seg, seg)
    seg_specs = [pl.BlockSpec((None, padded), lambda i, b, h: (b, 0)),  # every row's id
                 pl.BlockSpec((None, bk), lambda i, b, h: (b, i))] if segments else []  # the key block's
    out = jax.ShapeDtypeStruct(k.shape, jnp.float32)
    return pl.pallas_call(
        functools.partial(_dkv_kernel, config=config), grid=(num_k, batch, num_kv),
        in_specs=[q_group, key_block, key_block, key_block,
                  pl.BlockSpec((None, groups, padded, z.shape[-1]), lambda i, b, h: (b, h, 0, 0)),
                  q_group, stat_group, stat_group, per_key_block, per_key_block, *seg_specs],
        out_specs=[key_block] * 3, out_shape=[out] * 3,
        compiler_params=config.compiler_params(), interpret=config.interpret, name="cope_backward_dkv",
    )(q, k, v, kg, z, do, lse, delta, r, pdp, *segments)


def _padded_segments(segment_ids: jax.Array | None, padded: int) -> jax.Array | None:
    """Document ids [B, L] -> [B, Lp] (padded rows and keys take id 0: no real row sees a padded key)."""
    if segment_ids is None:
        return None
    return jnp.pad(segment_ids, [(0, 0), (0, padded - segment_ids.shape[1])])


def _cope_pallas_fwd(q, k, v, kg, pos_emb, segment_ids, config: _Config):
    qp, kp, vp, kgp, _, z = _padded(q, k, v, kg, pos_emb, config.blocks)
    seg = _padded_segments(segment_ids, qp.shape[1])
    out, lse, r = _forward_call(config, qp, kp, vp, kgp, z, seg, save_r=True)
    return out[:, :config.length, :, :q.shape[3]], (q, k, v, kg, pos_emb, segment_ids, out, lse, r)


def _cope_pallas_bwd(config: _Config, residuals, dout):
    q, k, v, kg, pos_emb, segment_ids, out, lse, r = residuals
    qp, kp, vp, kgp, e, z = _padded(q, k, v, kg, pos_emb, config.blocks)
    seg = _padded_segments(segment_ids, qp.shape[1])
    do = jnp.pad(dout, [(0, 0), (0, out.shape[1] - dout.shape[1]), (0, 0), (0, out.shape[3] - dout.shape[3])])
    delta = jnp.einsum("btnd,btnd->bnt", out.astype(jnp.float32), do.astype(jnp.float32))
    do = do.astype(q.dtype)
    dq, dz, pdp = _dq_call(config, qp, kp, vp, kgp, z, do, lse, delta, r, seg)
    dk, dv, dkg = _dkv_call(config, qp, kp, vp, kgp, z, do, lse, delta, r, pdp, seg)
    dz = dz[..., :config.npos]
    if e.ndim == 2:
        dq = dq + jnp.einsum("bntp,pd->btnd", dz, e.astype(jnp.float32))
        de = jnp.einsum("bntp,btnd->pd", dz, qp.astype(jnp.float32))
    else:
        dq = dq + jnp.einsum("bntp,npd->btnd", dz, e.astype(jnp.float32))
        de = jnp.einsum("bntp,btnd->npd", dz, qp.astype(jnp.float32))
    length, d = config.length, q.shape[3]
    return (dq[:, :length, :, :d].astype(q.dtype), dk[:, :length, :, :d].astype(k.dtype),
            dv[:, :length, :, :d].astype(v.dtype), dkg[:, :length, :, :d].astype(kg.dtype),
            de[..., :d].astype(pos_emb.dtype), None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _cope_pallas(q: jax.Array, k: jax.Array, v: jax.Array, kg: jax.Array, pos_emb: jax.Array,
                 segment_ids: jax.Array | None, config: _Config) -> jax.Array:
    qp, kp, vp, kgp, _, z = _padded(q, k, v, kg, pos_emb, config.blocks)
    out = _forward_call(config, qp, kp, vp, kgp, z, _padded_segments(segment_ids, qp.shape[1]), save_r=False)[0]
    return out[:, :config.length, :, :q.shape[3]]


_cope_pallas.defvjp(_cope_pallas_fwd, _cope_pallas_bwd)
_cope_pallas_jit = jax.jit(_cope_pallas, static_argnums=(6,))


def cope_attention_pallas(q: jax.Array, k: jax.Array, v: jax.Array, pos_emb: jax.Array,
                          gate_k: jax.Array | None = None, *, sm_scale: float, block_sizes: BlockSizes | None = None,
                          interpret: bool | None = None, num_warps: int | None = None,
                          num_stages: int | None = None, segment_ids: jax.Array | None = None,
                          window: int | None = None) -> jax.Array:
    """Causal CoPE attention, fused kernels with a fused backward (custom VJP).

    q [B, L, N, D], k/v [B, L, K, D] (K divides N), pos_emb [P, D] or [N, P, D], gate_k [B, L, K, D] or None
    (gates from k) -> [B, L, N, D] in q's dtype.
    interpret: run the kernels in the Pallas interpreter (default: unless the backend is a GPU);
    num_warps/num_stages tune the Triton lowering (defaults: 4 warps up to D = 64, else 8; 2 stages).
    segment_ids [B, L] int: packed documents (a key is visible only from queries with the same id; positions
    restart at each document); window: each query sees itself and the window − 1 keys before it (key blocks
    outside are skipped).
    """
    check_cope_inputs(q, k, v, pos_emb, gate_k, sm_scale=sm_scale)
    check_head_dim(q.shape[3])
    check_pallas_settings(block_sizes, BlockSizes, num_warps=num_warps, num_stages=num_stages)
    check_segment_ids(segment_ids, q.shape[0], q.shape[1])
    check_window(window)
    if q.shape[1] == 0:  # no queries: an empty output, as jax.nn.dot_product_attention gives
        return jnp.zeros(q.shape, q.dtype)
    if window is not None and window >= q.shape[1]:  # every causal key is inside the window
        window = None
    config = _config(q, pos_emb, sm_scale=sm_scale, block_sizes=block_sizes or BlockSizes(),
                     interpret=resolve_interpret(interpret), num_warps=num_warps, num_stages=num_stages,
                     window=window, segments=segment_ids is not None)
    segment_ids = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    return _cope_pallas_jit(q, k, v, k if gate_k is None else gate_k, pos_emb, segment_ids, config)
