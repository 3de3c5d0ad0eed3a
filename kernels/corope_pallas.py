"""Fused Co-RoPE attention in Pallas (Triton lowering on GPU, interpret mode on CPU): causal, GQA, packed documents,
sliding windows, caller-given rotary frequencies, fwd + bwd.

Letters (as in jaxpe/): B batch, L length (Lp padded), Hq query heads, Hkv key/value heads, G = Hq / Hkv group
size, D head dim, Dh = D/2 rotary pairs (Dp/2 padded). Einsum subscripts: b batch, t query positions, n query head
(Hq), d head dim. Tiles: BQ query rows × BK keys; the rotary pairs are walked in BD-wide chunks (BD is elementwise
only, not a dot dimension: 1 to 8 keeps the [BQ, BK, BD] temporaries in registers).

Maths (as jaxpe/corope.py states it): z_ij = sigmoid(sm_scale·q^leader_i·k_j) (j ≤ i), Δ_ij = Σ_{t=j+1..i} z_it,
φ_ijd = Δ_ij·ω_d.
With the rotated keys kc = k1 cos φ + k2 sin φ, ks = k2 cos φ − k1 sin φ ([BQ, BK, BD] per chunk),
score_ij = sm_scale·Σ_d (q1·kc + q2·ks) — elementwise work, not a matmul — and ∂kc/∂φ = ks, ∂ks/∂φ = −kc.

Visibility (as in corope_blockwise): key j is visible to query i iff j ≤ i, same document (segment ids, optional)
and i − j < window (optional); invisible gates are 0. Every walk below covers only the key blocks that reach into
the window, so the work with a window is O(L·window); documents are masked per tile. ω [Dp/2] (θ^(−2d/D) or the
caller's, zero-padded) is an input of every kernel.

One program per H query heads of one group (grid (Lp/BQ, B, Hq/H); H = block_h, a divisor of G, 4 or fewer by
default, so MQA and batch 1 still have Hq/H programs per row block); the gates come from the group's leader query
head (read through a second view of q), so Δ and cos/sin are shared by the H heads: G/H× the trig of sharing it
across the whole group, in exchange for only H heads' accumulators in registers whatever G is. cos/sin are a
polynomial `_common.sincos` (no libdevice). The chunks are a `lax.fori_loop` over dynamic ref slices (no
Python unrolling), as are the dots over the head dim in DC = 64 wide column slices (gates, dP, the gradients).

Kernels:
- forward, grid (Lp/BQ, B, Hq/H): walks key blocks in reverse from the diagonal carrying the per-row suffix sum of z
  (one pass, causal early exit), online softmax; writes o and the per-row logsumexp.
- backward, grid (Lp/BQ, B, Hq/H_bwd), one kernel for dq, dk and dv: the same reverse walk. Per tile it recomputes
  the scores (one trig pass), P and dS, then a second trig pass adds sm_scale·Σ_s dS (kc, ks) to dq, the keys'
  share (summed over the H heads) to dk, and accumulates dΔ_ij = sm_scale·Σ_d ω_d Σ_h dS^h (q1^h ks − q2^h kc);
  dV += Σ_h Pᵀ dO. Two trig passes per tile in all (separate dq and dk/dv kernels would take two each): the scores
  must be complete before dS exists, and a tile's cos/sin ([BQ, BK, Dh]) fit neither registers nor shared memory.
  The gate gradient dz_it = Σ_{j<t} dΔ_ij = Tot_i − Suf_it with Suf_it = Σ_{j≥t} dΔ_ij (carried along the
  walk): the −Suf part is added at once (dq^leader −= sm_scale·(Suf·z')·k, dk −= sm_scale·(Suf·z')ᵀ·q^leader);
  the Tot part, known only at the walk's end, by a second gates-only walk over the same key blocks (the gate
  logits again, two dots per tile, no trig). dq, dk, dv are float32 accumulators (zeros in, aliased out) that every
  program adds to atomically: the heads of a group share dk, dv and the leader's dq (so their float32 sums are not bitwise
  reproducible from run to run on a GPU).
Memory: O(L) per head — o, lse and the float32 gradient accumulators; no carries between kernels, no L×L or
L×L×D array anywhere. Extra work against a two-kernel backward with saved carries: the gates-only walk (per tile
one accurate [BQ, Dp]×[Dp, BK] gate dot and two gradient dots) and the float32 atomic adds.

Triton restrictions respected: block sizes of rows and keys powers of two ≥ 16 (dots), no reverse cumsum
(rowtotal − cumsum), no gathers, no slicing or concatenation of in-register tiles (chunks load straight from the
refs), static shapes; the head dim's halves are zero-padded to a power of two outside, and chunks past D/2 are
never visited.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxpe.base import rotary_frequencies
from jaxpe.kernels._checks import open_corope_fused
from jaxpe.kernels._common import (MASK_VALUE, check_block_sizes, dot, filled, first_order_only, fold_scale,
                                   output_struct, fori_loop32, resolve_interpret, sincos, tile_extent,
                                   triton_compiler_params, vary_alike)
from jaxpe.kernels.corope_blockwise import caller_frequencies


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the forward and of the backward kernel, which need not match; None: the default for the problem
    (`BlockSizes.default`). Rows and keys are powers of two >= 16 (Triton dots), block_d a power of two >= 1, block_h
    and block_h_bwd positive ints; blocks larger than the padded problem shrink (`fitted`).

    A tile's temporaries are [block_q, block_k, block_d] float32, held in registers, and a program carries block_h
    heads' [block_q, Dp] accumulators: keep those small.
    """

    block_q: int | None = None  # forward: query rows per program
    block_k: int | None = None  # forward: keys per step of the reverse walk
    block_q_bwd: int | None = None  # backward: query rows per program
    block_k_bwd: int | None = None  # backward: keys per step
    block_d: int | None = None  # rotary pairs per chunk (both kernels)
    block_h: int | None = None  # forward: query heads of one group per program (they share the trig)
    block_h_bwd: int | None = None  # backward: the same

    def __post_init__(self) -> None:
        check_block_sizes(self)

    @classmethod
    def default(cls, head_dim: int, dtype: jnp.dtype, *, groups: int) -> BlockSizes:
        """The defaults, chosen with the compile report (H100, 8 warps: no spills in any kernel for D 64-256, float32
        and bfloat16, GQA 8/2 and MHA): tiles of 32 keys, chunks of 4 rotary pairs; up to 4 heads of a group per
        forward program and 2 per backward program (their trig shared), 16 query rows per tile — 32 in a forward
        program of one head while a row of q is at most 512 bytes."""
        block_h = max(h for h in range(1, 5) if groups % h == 0)
        block_q = 32 if block_h == 1 and head_dim * jnp.dtype(dtype).itemsize <= 512 else 16
        return cls(block_q=block_q, block_k=32, block_q_bwd=16, block_k_bwd=32, block_d=4, block_h=block_h,
                   block_h_bwd=2)

    def fitted(self, *, length: int, head_dim: int, dtype: jnp.dtype, groups: int) -> BlockSizes:
        """Every size given (None: `default`'s for D, dtype and G), the row and key blocks capped at the next power
        of two >= length (and >= 16), block_d at the padded D/2, the head blocks at the largest divisor of G not
        above them."""
        sizes = filled(self, BlockSizes.default(head_dim, dtype, groups=groups))
        cap, half = tile_extent(length), tile_extent(head_dim // 2)
        heads = lambda name: max(h for h in range(1, min(sizes[name], groups) + 1) if groups % h == 0)  # noqa: E731
        return BlockSizes(block_q=min(sizes["block_q"], cap), block_k=min(sizes["block_k"], cap),
                          block_q_bwd=min(sizes["block_q_bwd"], cap), block_k_bwd=min(sizes["block_k_bwd"], cap),
                          block_d=min(sizes["block_d"], half), block_h=heads("block_h"),
                          block_h_bwd=heads("block_h_bwd"))


def default_num_warps(head_dim: int) -> int:
    """Warps per program: 8 for every head dim (see `BlockSizes.default`)."""
    del head_dim
    return 8


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static settings of one call, fitted to its shapes (hashable: the jit static argument, the custom_vjp's
    non-differentiable one and the kernels' keyword argument)."""

    sm_scale: float
    head_dim: int  # D, the caller's
    groups: int  # G, the query heads sharing one k/v head
    padded: int  # Lp, a multiple of every block
    half: int  # padded D/2, a power of two >= 16
    blocks: BlockSizes  # fitted to L, D and dtype
    interpret: bool
    num_warps: int
    num_stages: int
    window: int | None = None  # keys i − window < j ≤ i are visible; None: the whole causal prefix

    @property
    def chunks(self) -> int:
        """BD-wide chunks of rotary pairs that hold any of the D/2 real ones (the rest are zero padding)."""
        return -(-(self.head_dim // 2) // self.blocks.block_d)

    @property
    def dot_chunk(self) -> int:
        """DC, the head-dim columns per step of the backward's and the gates' dots."""
        return min(2 * self.half, 64)

    @property
    def compiler_params(self):
        return triton_compiler_params(num_warps=self.num_warps, num_stages=self.num_stages)


def _config(q: jax.Array, k: jax.Array, *, sm_scale: float, block_sizes: BlockSizes, interpret: bool,
            num_warps: int | None, num_stages: int | None, window: int | None) -> _Config:
    """The static settings for q [B, L, Hq, D], k [B, L, Hkv, D]: blocks fitted, L padded to a multiple of every block,
    each half of D to a power of two >= 16."""
    length, d = q.shape[1], q.shape[3]
    half = tile_extent(d // 2)
    blocks = block_sizes.fitted(length=length, head_dim=d, dtype=q.dtype, groups=q.shape[2] // k.shape[2])
    multiple = max(blocks.block_q, blocks.block_k, blocks.block_q_bwd, blocks.block_k_bwd)
    return _Config(sm_scale=float(sm_scale), head_dim=d, groups=q.shape[2] // k.shape[2],
                   padded=-(-length // multiple) * multiple, half=half, blocks=blocks, interpret=interpret,
                   num_warps=num_warps or default_num_warps(d), num_stages=num_stages or 2,
                   window=window)


def _visible(rows: jax.Array, cols: jax.Array, seg_rows: jax.Array | None, seg_cols: jax.Array | None,
             config: _Config) -> jax.Array:
    """Mask [BQ, BK]: causal, inside the window, same document (seg_rows [BQ], seg_cols [BK], or None)."""
    mask = cols[None, :] <= rows[:, None]
    if config.window is not None:
        mask = mask & (rows[:, None] - cols[None, :] < config.window)
    if seg_rows is not None:
        mask = mask & (seg_rows[:, None] == seg_cols[None, :])
    return mask


def _key_blocks(qb: jax.Array, block_q: int, block_k: int, config: _Config) -> tuple[jax.Array, jax.Array]:
    """(last, count): query block qb walks key blocks last, last − 1, ..., last − count + 1: from the one holding the
    diagonal of its last row down to the one holding key qb·BQ − window + 1 (key 0 without a window)."""
    last = lax.div((qb + 1) * block_q - 1, jnp.int32(block_k))
    if config.window is None:
        return last, last + 1
    return last, last + 1 - lax.div(jnp.maximum(qb * block_q - config.window + 1, 0), jnp.int32(block_k))


def _column_chunks(config: _Config, body: Callable[[pl.Slice, Any], Any], init: Any) -> Any:
    """fori_loop of body(columns, carry) over the head dim in DC-wide slices (the dots' operands stay small)."""
    dc = config.dot_chunk
    return fori_loop32(0, 2 * config.half // dc, lambda c, carry: body(pl.ds(pl.multiple_of(c * dc, dc), dc), carry),
                       init)


def _gates(lead_ref, k_ref, keys: pl.Slice, mask: jax.Array, config: _Config) -> jax.Array:
    """lead_ref [BQ, Dp] (the leader's rows), k_ref [Lp, Dp] at `keys` -> gates z [BQ, BK], 0 where `mask` is
    False. The logits are float32-accurate (TF32×3 on the GPU)."""
    def chunk(cols, logits):
        return logits + dot(lead_ref[:, cols], k_ref[keys, cols], trans_b=True, accurate=True,
                            interpret=config.interpret)

    logits = _column_chunks(config, chunk, jnp.zeros(mask.shape, jnp.float32))
    return jnp.where(mask, jax.nn.sigmoid(config.sm_scale * logits), 0.0)


def _suffix_exclusive(x: jax.Array) -> jax.Array:
    """[BQ, BK] -> Σ_{t>j} x[:, t], as rowtotal − cumsum (Triton cannot lower a reverse cumsum)."""
    return jnp.sum(x, axis=1, keepdims=True) - jnp.cumsum(x, axis=1)


class _Tile:
    """One tile's rotary pieces: the program's H query heads' rows q_ref [BQ, H, Dp], the keys' rows k_ref at
    `keys`, ω and Δ [BQ, BK]."""

    def __init__(self, delta: jax.Array, q_ref, k_ref, keys: pl.Slice, freq_ref, config: _Config):
        self.delta, self.q_ref, self.k_ref, self.keys, self.freq_ref = delta, q_ref, k_ref, keys, freq_ref
        self.config, self.heads = config, q_ref.shape[1]

    def queries(self, head: int, lo: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(q1, q2) [BQ, 1, BD] of one head for the chunk of pairs from lo, float32."""
        bd, half = self.config.blocks.block_d, self.config.half
        load = lambda at: self.q_ref[:, head, pl.ds(at, bd)].astype(jnp.float32)[:, None, :]
        return load(lo), load(half + lo)

    def rotated(self, c: jax.Array) -> tuple[jax.Array, ...]:
        """Chunk c: its first pair lo, ω [BD], cos φ, sin φ, kc, ks [BQ, BK, BD] (shared by the H heads)."""
        bd, half = self.config.blocks.block_d, self.config.half
        lo = pl.multiple_of(c * bd, bd)
        omega = self.freq_ref[pl.ds(lo, bd)]
        sin, cos = sincos(self.delta[:, :, None] * omega[None, None, :])
        load = lambda at: self.k_ref[self.keys, pl.ds(at, bd)].astype(jnp.float32)[None]  # [1, BK, BD]
        k1, k2 = load(lo), load(half + lo)
        return lo, omega, cos, sin, k1 * cos + k2 * sin, k2 * cos - k1 * sin

    def scores(self) -> list[jax.Array]:
        """H scores [BQ, BK] sm_scale·Σ_d (q1·kc + q2·ks)."""
        def chunk(c, acc):
            lo, _, _, _, kc, ks = self.rotated(c)
            return tuple(a + jnp.sum(q1 * kc + q2 * ks, axis=2)
                         for a, (q1, q2) in zip(acc, (self.queries(h, lo) for h in range(self.heads))))

        zeros = tuple(jnp.zeros(self.delta.shape, jnp.float32) for _ in range(self.heads))
        return [self.config.sm_scale * a for a in fori_loop32(0, self.config.chunks, chunk, zeros)]


def _key_tile(kb: jax.Array, rows: jax.Array, seg_rows: jax.Array | None, seg_k_ref, config: _Config, block_k: int
              ) -> tuple[pl.Slice, jax.Array]:
    """Key block kb: its slice of the keys and the visibility mask [BQ, BK] of the rows."""
    keys = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
    cols = kb * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    return keys, _visible(rows, cols, seg_rows, None if seg_k_ref is None else seg_k_ref[keys], config)


def _forward_kernel(q_ref, lead_ref, k_ref, v_ref, freq_ref, seg_q_ref, seg_k_ref, o_ref, lse_ref, *,
                    config: _Config):
    """q_ref [BQ, H, Dp] (the program's heads' rows), lead_ref [BQ, Dp] (their group leader's), k_ref/v_ref
    [Lp, Dp], freq_ref [Dp/2], seg_q_ref [BQ] and seg_k_ref [Lp] (None without documents) -> o_ref [BQ, H, Dp],
    lse_ref [H, BQ]."""
    block_q, block_k, heads = config.blocks.block_q, config.blocks.block_k, q_ref.shape[1]
    qb = pl.program_id(0)
    rows = qb * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    seg_rows = None if seg_q_ref is None else seg_q_ref[...]
    last_kb, key_steps = _key_blocks(qb, block_q, block_k, config)

    def body(step, carry):
        z_suffix, m, l, acc = carry  # [BQ]; H × [BQ]; H × [BQ]; H × [BQ, Dp]
        keys, mask = _key_tile(last_kb - step, rows, seg_rows, seg_k_ref, config, block_k)
        z = _gates(lead_ref, k_ref, keys, mask, config)
        delta = z_suffix[:, None] + _suffix_exclusive(z)  # [BQ, BK]
        scores = _Tile(delta, q_ref, k_ref, keys, freq_ref, config).scores()
        v = v_ref[keys, :]
        new_m, new_l, new_acc = [], [], []
        for s, m_h, l_h, acc_h in zip(scores, m, l, acc):
            s = jnp.where(mask, s, MASK_VALUE)
            new_m.append(jnp.maximum(m_h, jnp.max(s, axis=1)))
            p = jnp.exp(s - new_m[-1][:, None])
            correction = jnp.exp(m_h - new_m[-1])
            new_l.append(correction * l_h + jnp.sum(p, axis=1))
            new_acc.append(correction[:, None] * acc_h + dot(p.astype(v.dtype), v))
        return z_suffix + jnp.sum(z, axis=1), new_m, new_l, new_acc

    row = jnp.zeros((block_q,), jnp.float32)
    init = (row, [jnp.full((block_q,), -jnp.inf, jnp.float32)] * heads, [row] * heads,
            [jnp.zeros((block_q, o_ref.shape[2]), jnp.float32)] * heads)
    _, m, l, acc = lax.fori_loop(0, key_steps, body, init)
    for h in range(heads):
        o_ref[:, h, :] = (acc[h] / l[h][:, None]).astype(o_ref.dtype)
        lse_ref[h, :] = m[h] + jnp.log(l[h])


def _backward_kernel(q_ref, lead_ref, k_ref, v_ref, do_ref, lse_ref, row_dot_ref, freq_ref, seg_q_ref, seg_k_ref,
                     dq_in_ref, dk_in_ref, dv_in_ref, dq_ref, dk_ref, dv_ref, *, config: _Config):
    """q_ref/do_ref [BQ, H, Dp] (the program's heads' rows), lead_ref [BQ, Dp] (their group leader's), k_ref/v_ref
    [Lp, Dp], lse_ref/row_dot_ref [H, BQ], freq_ref [Dp/2], seg_q_ref [BQ] and seg_k_ref [Lp] (None without
    documents), the zeros aliased to the outputs (the *_in refs, unread) -> dq_ref [BQ, G, Dp], dk_ref/dv_ref
    [Lp, Dp] float32, added to."""
    del dq_in_ref, dk_in_ref, dv_in_ref  # the same buffers as dq_ref, dk_ref, dv_ref
    block_q, block_k, block_d = config.blocks.block_q_bwd, config.blocks.block_k_bwd, config.blocks.block_d
    half, sm_scale, heads = config.half, config.sm_scale, q_ref.shape[1]
    qb = pl.program_id(0)
    first = lax.rem(pl.program_id(2) * heads, jnp.int32(config.groups))  # the program's first head in its group
    rows = qb * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    all_rows = pl.ds(jnp.int32(0), block_q)  # slice(None) would start at an int64 0 under jax_enable_x64
    seg_rows = None if seg_q_ref is None else seg_q_ref[...]
    last_kb, key_steps = _key_blocks(qb, block_q, block_k, config)

    def gate_grads(weight: jax.Array, keys: pl.Slice) -> None:
        """dq^leader += sm_scale·weight·k, dk += sm_scale·weightᵀ·q^leader for gate-logit weights [BQ, BK]; float32-
        accurate products, since the Tot and −Suf parts of dz, added apart, may nearly cancel."""
        def chunk(cols, carry):
            k, lead = k_ref[keys, cols].astype(jnp.float32), lead_ref[:, cols].astype(jnp.float32)
            plt.atomic_add(dq_ref, (all_rows, jnp.int32(0), cols),
                           sm_scale * dot(weight, k, accurate=True, interpret=config.interpret))
            plt.atomic_add(dk_ref, (keys, cols),
                           sm_scale * dot(weight, lead, trans_a=True, accurate=True, interpret=config.interpret))
            return carry

        _column_chunks(config, chunk, 0)

    def body(step, carry):
        z_suffix, dd_suffix = carry  # suffix sums of z and of dΔ right of this key block, [BQ]
        keys, mask = _key_tile(last_kb - step, rows, seg_rows, seg_k_ref, config, block_k)
        z = _gates(lead_ref, k_ref, keys, mask, config)
        delta = z_suffix[:, None] + _suffix_exclusive(z)
        tile = _Tile(delta, q_ref, k_ref, keys, freq_ref, config)
        p = [jnp.where(mask, jnp.exp(s - lse_ref[h, :][:, None]), 0.0) for h, s in enumerate(tile.scores())]

        def values(cols, dp):  # dV += Σ_h Pᵀ·dO; dP = dO·Vᵀ per head
            do = [do_ref[:, h, cols] for h in range(heads)]
            plt.atomic_add(dv_ref, (keys, cols), sum(dot(p_h.astype(do_h.dtype), do_h, trans_a=True)
                                                     for p_h, do_h in zip(p, do)))
            v = v_ref[keys, cols]
            return tuple(dp_h + dot(do_h, v, trans_b=True) for dp_h, do_h in zip(dp, do))

        dp = _column_chunks(config, values, tuple(jnp.zeros(mask.shape, jnp.float32) for _ in range(heads)))
        ds = [(p_h * (dp_h - row_dot_ref[h, :][:, None]))[:, :, None] for h, (p_h, dp_h) in enumerate(zip(p, dp))]

        def chunk(c, d_delta):  # the rotary backward of chunk c: dq, dk; dΔ accumulated
            lo, omega, cos, sin, kc, ks = tile.rotated(c)
            dsq1 = dsq2 = jnp.zeros(kc.shape, jnp.float32)  # Σ_h dS^h q1^h, Σ_h dS^h q2^h, [BQ, BK, BD]
            for h, ds_h in enumerate(ds):
                q1, q2 = tile.queries(h, lo)
                dsq1, dsq2 = dsq1 + ds_h * q1, dsq2 + ds_h * q2
                plt.atomic_add(dq_ref, (all_rows, first + h, pl.ds(lo, block_d)),
                               sm_scale * jnp.sum(ds_h * kc, axis=1))
                plt.atomic_add(dq_ref, (all_rows, first + h, pl.ds(half + lo, block_d)),
                               sm_scale * jnp.sum(ds_h * ks, axis=1))
            plt.atomic_add(dk_ref, (keys, pl.ds(lo, block_d)), sm_scale * jnp.sum(dsq1 * cos - dsq2 * sin, axis=0))
            plt.atomic_add(dk_ref, (keys, pl.ds(half + lo, block_d)),
                           sm_scale * jnp.sum(dsq1 * sin + dsq2 * cos, axis=0))
            return d_delta + jnp.sum((dsq1 * ks - dsq2 * kc) * omega[None, None, :], axis=2)

        d_delta = sm_scale * fori_loop32(0, config.chunks, chunk, jnp.zeros(mask.shape, jnp.float32))
        suffix = dd_suffix[:, None] + _suffix_exclusive(d_delta) + d_delta  # Σ_{j≥t} dΔ_ij, [BQ, BK]
        gate_grads(-suffix * z * (1.0 - z), keys)  # z' = z(1 − z) is 0 where invisible
        return z_suffix + jnp.sum(z, axis=1), dd_suffix + jnp.sum(d_delta, axis=1)

    row = jnp.zeros((block_q,), jnp.float32)
    _, total = lax.fori_loop(0, key_steps, body, (row, row))  # total: Tot_i = Σ_j dΔ_ij

    def gates_only(step, carry):  # dz_it's Tot_i part
        keys, mask = _key_tile(last_kb - step, rows, seg_rows, seg_k_ref, config, block_k)
        z = _gates(lead_ref, k_ref, keys, mask, config)
        gate_grads(total[:, None] * z * (1.0 - z), keys)
        return carry

    lax.fori_loop(0, key_steps, gates_only, 0)


def _pad(x: jax.Array, config: _Config) -> jax.Array:
    """[B, L, H, D] -> [B, Lp, H, 2·half]: zero rows at the end, each rotary half zero-padded to `half`."""
    pad = [(0, 0), (0, config.padded - x.shape[1]), (0, 0), (0, config.half - x.shape[3] // 2)]
    return jnp.concatenate([jnp.pad(h, pad) for h in jnp.split(x, 2, axis=-1)], axis=-1)


def _unpad(x: jax.Array, length: int, head_dim: int) -> jax.Array:
    """Inverse of `_pad`: [B, Lp, H, 2·half] -> [B, L, H, D]."""
    half = x.shape[3] // 2
    return jnp.concatenate([x[:, :length, :, : head_dim // 2], x[:, :length, :, half: half + head_dim // 2]], -1)


def _specs(config: _Config, block_q: int, heads: int, dp: int, seg: jax.Array | None
           ) -> dict[str, pl.BlockSpec | None]:
    """BlockSpecs over grid (Lp/BQ, B, Hq/H), H = `heads` query heads of one group per program: their query rows,
    their leader's, their group's, their k/v head (all rows), their row statistics [B, Hq, Lp], ω, and the ids of
    their query rows and of all keys (None without documents)."""
    g, lp = config.groups, config.padded
    group = lambda h: lax.div(h * heads, jnp.int32(g))
    specs = {
        "heads": pl.BlockSpec((None, block_q, heads, dp), lambda i, b, h: (b, i, h, 0)),
        "leader": pl.BlockSpec((None, block_q, None, dp), lambda i, b, h: (b, i, group(h) * g, 0)),
        "group": pl.BlockSpec((None, block_q, g, dp), lambda i, b, h: (b, i, group(h), 0)),
        "kv": pl.BlockSpec((None, lp, None, dp), lambda i, b, h: (b, 0, group(h), 0)),
        "stats": pl.BlockSpec((None, heads, block_q), lambda i, b, h: (b, h, i)),
        "freq": pl.BlockSpec((config.half,), lambda i, b, h: (0,)),
    }
    documents = seg is not None
    specs["seg_rows"] = pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)) if documents else None
    specs["seg_all"] = pl.BlockSpec((None, lp), lambda i, b, h: (b, 0)) if documents else None
    return specs


def _forward_call(config: _Config, q: jax.Array, k: jax.Array, v: jax.Array, freq: jax.Array, seg: jax.Array | None
                  ) -> tuple[jax.Array, jax.Array]:
    """Padded q [B, Lp, Hq, Dp], k/v [B, Lp, Hkv, Dp], ω [Dp/2], segment ids [B, Lp] or None -> o [B, Lp, Hq, Dp],
    lse [B, Hq, Lp] float32."""
    batch, lp, num_heads, dp = q.shape
    bq, bh = config.blocks.block_q, config.blocks.block_h
    s = _specs(config, bq, bh, dp, seg)
    return pl.pallas_call(
        functools.partial(_forward_kernel, config=config), grid=(lp // bq, batch, num_heads // bh),
        in_specs=[s["heads"], s["leader"], s["kv"], s["kv"], s["freq"], s["seg_rows"], s["seg_all"]],
        out_specs=[s["heads"], s["stats"]],
        out_shape=[output_struct(q.shape, q.dtype, q), output_struct((batch, num_heads, lp), jnp.float32, q)],
        compiler_params=config.compiler_params, interpret=config.interpret, name="corope_forward",
    )(q, q, k, v, freq, seg, seg)


def _backward_call(config: _Config, q, k, v, do, lse, row_dot, freq, seg) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Padded inputs, do [B, Lp, Hq, Dp], lse/row_dot [B, Hq, Lp] -> dq [B, Lp, Hq, Dp], dk, dv [B, Lp, Hkv, Dp],
    float32."""
    batch, lp, num_heads, dp = q.shape
    bq, bh = config.blocks.block_q_bwd, config.blocks.block_h_bwd
    s = _specs(config, bq, bh, dp, seg)
    inputs = [q, q, k, v, do, lse, row_dot, freq, seg, seg]
    zeros = [jnp.zeros_like(x, jnp.float32) for x in (q, k, v)]
    aliased_from = len(jax.tree.leaves(inputs))  # the flat index of the first zeros (None inputs are no operand)
    return pl.pallas_call(
        functools.partial(_backward_kernel, config=config), grid=(lp // bq, batch, num_heads // bh),
        in_specs=[s["heads"], s["leader"], s["kv"], s["kv"], s["heads"], s["stats"], s["stats"], s["freq"],
                  s["seg_rows"], s["seg_all"], s["group"], s["kv"], s["kv"]],
        out_specs=[s["group"], s["kv"], s["kv"]],
        out_shape=[output_struct(x.shape, jnp.float32, q) for x in zeros],
        input_output_aliases={aliased_from + i: i for i in range(3)},
        compiler_params=config.compiler_params, interpret=config.interpret, name="corope_backward_dq_dkv",
    )(*inputs, *zeros)


def _corope_pallas_fwd(q, k, v, segment_ids, omega, config: _Config):
    qp, kp, vp = (_pad(x, config) for x in (q, k, v))
    freq = jnp.pad(omega, (0, config.half - omega.shape[0]))  # [Dp/2], 0 on padding
    seg = None if segment_ids is None else jnp.pad(segment_ids.astype(jnp.int32),
                                                   [(0, 0), (0, config.padded - segment_ids.shape[1])])
    o, lse = first_order_only("pallas", functools.partial(_forward_call, config), qp, kp, vp, freq, seg)
    return _unpad(o, q.shape[1], q.shape[3]), (qp, kp, vp, o, lse, freq, seg)


def _corope_pallas_bwd(config: _Config, residuals, do):
    qp, kp, vp, o, lse, freq, seg = residuals
    dop = _pad(do.astype(o.dtype), config)
    row_dot = jnp.einsum("btnd,btnd->bnt", o.astype(jnp.float32), dop.astype(jnp.float32))  # Σ_d dO·O
    grads = first_order_only("pallas", functools.partial(_backward_call, config), qp, kp, vp, dop, lse, row_dot, freq,
                             seg)
    # Segment ids are integers; ω is a constant (see caller_frequencies).
    return (*(_unpad(x, do.shape[1], do.shape[3]).astype(o.dtype) for x in grads), None, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _corope_pallas(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, omega: jax.Array,
                   config: _Config) -> jax.Array:
    return _corope_pallas_fwd(q, k, v, segment_ids, omega, config)[0]


_corope_pallas.defvjp(_corope_pallas_fwd, _corope_pallas_bwd)
_corope_pallas_jit = jax.jit(_corope_pallas, static_argnums=(5,))


def corope_attention_pallas(q: jax.Array, k: jax.Array, v: jax.Array, *, theta: float,
                            sm_scale: float | jax.Array | None, block_sizes: BlockSizes | None = None,
                            interpret: bool | None = None, num_warps: int | None = None, num_stages: int | None = None,
                            segment_ids: jax.Array | None = None, window: int | None = None,
                            inv_freq: jax.Array | None = None, causal: bool = True) -> jax.Array:
    """Fused causal Co-RoPE attention. q [B, L, Hq, D], k/v [B, L, Hkv, D] (float32, bfloat16 or float16)
    -> [B, L, Hq, D].

    segment_ids: int [B, L] document ids (packed documents; padding as an id of its own), None: one document.
    window: int >= 1, query i sees keys i − window < j ≤ i (tiles outside it are never visited), None: all.
    inv_freq: float [D/2] rotary frequencies replacing θ^(−2d/D) (`theta` is then unused); a constant, not
    differentiated (its gradient is zero).
    Differentiable in q, k, v (one fused backward kernel). interpret: run the kernels in the Pallas interpreter
    (default: unless the backend is a GPU); block_sizes (None fields: defaults for D and dtype), num_warps and
    num_stages tune the Triton lowering (defaults: `BlockSizes.default`, `default_num_warps`, 2 stages).
    sm_scale: None (D^−½), a number > 0 or a traced scalar (a learned temperature), which then multiplies q before
    the kernels (gates and scores depend on q and sm_scale only through sm_scale·q). causal=False, other dtypes and
    symbolic shapes raise (`fused_refusal`); x64 mode changes nothing (the kernels index in int32).
    """
    empty, segment_ids, window = open_corope_fused(
        q, k, v, impl="pallas", theta=theta, sm_scale=sm_scale, inv_freq=inv_freq, causal=causal, window=window,
        segment_ids=segment_ids, block_sizes=block_sizes, kind=BlockSizes, num_warps=num_warps, num_stages=num_stages)
    if empty:
        return jnp.zeros(q.shape, q.dtype)
    q, sm_scale = fold_scale(q, sm_scale)
    config = _config(q, k, sm_scale=sm_scale, block_sizes=block_sizes or BlockSizes(),
                     interpret=resolve_interpret(interpret), num_warps=num_warps, num_stages=num_stages,
                     window=window)
    q, k, v = vary_alike(q, k, v)  # one manual-axis type inside the kernels under shard_map
    omega = caller_frequencies(inv_freq)
    if omega is None:
        omega = rotary_frequencies(q.shape[3], theta)
    return _corope_pallas_jit(q, k, v, segment_ids, omega, config)
