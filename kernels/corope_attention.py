"""Fused Co-RoPE attention in Pallas (Triton lowering on GPU, interpret mode on CPU): causal, GQA, packed documents,
sliding windows, caller-given rotary frequencies, fwd + bwd.

Letters (as gemma's): B batch, L length (Lp padded), N query heads, K key/value heads, G = N / K group size, D head
dim, Dh = D/2 rotary pairs. Einsum subscripts are the lower-case letters, with t for query and s for key positions.
Tiles: BQ query rows × BK keys × BD rotary pairs. One program instance owns one GQA group (G query heads, one
k/v head), so the mileage Δ and its cos/sin are computed once per tile and reused by every head of the group.

Maths (SPEC §3): z_ij = sigmoid(sm_scale·q^leader_i·k_j) (j ≤ i), Δ_ij = Σ_{t=j+1..i} z_it, φ_ijd = Δ_ij·ω_d.
With the rotated keys kc = k1 cos φ + k2 sin φ, ks = k2 cos φ − k1 sin φ ([BQ, BK, BD] per chunk, per group),
score_ij = sm_scale·Σ_d (q1·kc + q2·ks) — elementwise work, not a matmul — and ∂kc/∂φ = ks, ∂ks/∂φ = −kc.

Visibility (as in corope_blockwise): key j is visible to query i iff j ≤ i, same document (segment ids, optional)
and i − j < window (optional); invisible gates are 0. Every walk below covers only the key (or query) blocks that
reach into the window, so the work with a window is O(L·window); documents are masked per tile. ω_d = θ^(−2d/D) is
computed in the kernels; the caller's inv_freq comes as an input [Dp/2] (zero-padded). With none of these options
the kernels trace as they did before them.

Kernels:
- forward, grid (L/BQ, B, K): walks key blocks in reverse from the diagonal carrying the per-row suffix sum of z
  (one pass, causal early exit), online softmax; writes o and the per-row logsumexp.
- dq, grid (L/BQ, B, K): the same reverse walk; dΔ_ij = sm_scale·Σ_d ω_d Σ_h dS^h (q1^h ks − q2^h kc); the
  gate gradient dz_it = Σ_{j<t} dΔ_ij = Tot_i − Suf_it with Suf_it = Σ_{j≥t} dΔ_ij carried and Tot_i known at
  the end, so dq^leader gets sm_scale·(Tot_i·Σ_t z'_it k_t − Σ_t Suf_it z'_it k_t) from one pass. It also
  writes, for every (key block, row), the carried suffix sums of z and of dΔ at that block's right edge, and Tot.
- dk/dv, grid (L/BK, B, K): walks query blocks from the diagonal down; rebuilds Δ and dz from those carries.
Memory: O(L) per head for o, lse; the backward's carries are [B, K, L/BK, L] float32 (1/BK of an L×L
array); no L×L or L×L×D tensor exists anywhere.

Triton restrictions respected: block sizes powers of two ≥ 16, no reverse cumsum (rowtotal − cumsum), no
gathers, no slicing or concatenation of in-register tiles (the head dim is processed in BD-wide chunks loaded
straight from the refs), static shapes; the head dim's halves are zero-padded to a power of two outside.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxpe.kernels._checks import (check_corope_inputs, check_kernel_dtype, check_pallas_settings, check_segment_ids,
                                   check_window)
from jaxpe.kernels._common import (MASK_VALUE, check_block_sizes, check_head_dim, dot, resolve_interpret,
                                   rotary_frequencies, tile_extent, triton_compiler_params)
from jaxpe.kernels.corope_blockwise import caller_frequencies, check_inv_freq, effective_window


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes. Each must be a power of two ≥ 16 (Triton tiles); blocks larger than the padded problem shrink.

    The trig work of a tile is block_q·block_k·block_d sin+cos, held in registers: keep that product small.
    """

    block_q: int = 32  # forward: query rows per program instance
    block_k: int = 32  # forward: keys per step of the reverse walk
    block_d: int = 16  # rotary pairs per trig chunk (all kernels)
    block_q_bwd: int = 32  # backward (dq and dk/dv kernels): query rows per tile
    block_k_bwd: int = 32  # backward: keys per tile, also the granularity of the carried row sums

    def __post_init__(self) -> None:
        check_block_sizes(self)

    def fitted(self, length: int, half: int) -> BlockSizes:
        """The same sizes, the row and key blocks capped at the next power of two >= length (and >= 16), block_d
        at the padded half head dim."""
        cap = tile_extent(length)
        return BlockSizes(block_q=min(self.block_q, cap), block_k=min(self.block_k, cap),
                          block_d=min(self.block_d, half), block_q_bwd=min(self.block_q_bwd, cap),
                          block_k_bwd=min(self.block_k_bwd, cap))


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static settings of one call, fitted to its shapes (hashable: the jit static argument, the custom_vjp's
    non-differentiable one and the kernels' keyword argument)."""

    theta: float
    sm_scale: float
    head_dim: int  # D, the caller's (for ω)
    groups: int  # G, the query heads of one program
    padded: int  # Lp, a multiple of every block
    half: int  # padded D/2, a power of two >= 16
    blocks: BlockSizes  # fitted to L and D
    interpret: bool
    num_warps: int | None  # None: 4 or 8 by tile size
    num_stages: int | None  # None: 2
    window: int | None = None  # keys i − window < j ≤ i are visible; None: the whole causal prefix
    segmented: bool = False  # document ids are passed (two inputs after the kernel's usual ones)
    custom_freq: bool = False  # the caller's ω is passed (an input after the kernel's usual ones, before the ids)

    @property
    def chunks(self) -> range:
        """The first rotary pair of each BD-wide chunk."""
        return range(0, self.half, self.blocks.block_d)

    def compiler_params(self, tile: int):
        """Triton settings for a kernel whose tiles hold `tile` = BQ·BK scores."""
        num_warps = self.num_warps if self.num_warps is not None else (4 if tile <= 32 * 32 else 8)
        return triton_compiler_params(num_warps=num_warps, num_stages=self.num_stages or 2)


def _config(q: jax.Array, k: jax.Array, *, theta: float, sm_scale: float, block_sizes: BlockSizes, interpret: bool,
            num_warps: int | None, num_stages: int | None, window: int | None, segmented: bool, custom_freq: bool
            ) -> _Config:
    """The static settings for q [B, L, N, D], k [B, L, K, D]: blocks fitted, L padded to a multiple of every block,
    each half of D to a power of two >= 16."""
    length, d = q.shape[1], q.shape[3]
    half = tile_extent(d // 2)
    blocks = block_sizes.fitted(length, half)
    multiple = max(blocks.block_q, blocks.block_k, blocks.block_q_bwd, blocks.block_k_bwd)
    return _Config(theta=float(theta), sm_scale=float(sm_scale), head_dim=d, groups=q.shape[2] // k.shape[2],
                   padded=-(-length // multiple) * multiple, half=half, blocks=blocks, interpret=interpret,
                   num_warps=num_warps, num_stages=num_stages, window=effective_window(window, length),
                   segmented=segmented, custom_freq=custom_freq)


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
    last = lax.div((qb + 1) * block_q - 1, block_k)
    if config.window is None:
        return last, last + 1
    return last, last + 1 - lax.div(jnp.maximum(qb * block_q - config.window + 1, 0), block_k)


def _query_blocks(kb: jax.Array, block_q: int, block_k: int, num_q_blocks: int, config: _Config
                  ) -> tuple[jax.Array, jax.Array | int]:
    """The query blocks [first, end) that see key block kb: the exact inverse of `_key_blocks`."""
    first = lax.div(kb * block_k, block_q)
    if config.window is None:
        return first, num_q_blocks
    return first, jnp.minimum(lax.div(kb * block_k + block_k + config.window - 2, block_q) + 1, num_q_blocks)


def _gates(q_lead: jax.Array, k: jax.Array, mask: jax.Array, config: _Config) -> jax.Array:
    """q_lead [BQ, Dp], k [BK, Dp] -> gates z [BQ, BK], 0 where `mask` is False."""
    z = jax.nn.sigmoid(config.sm_scale * dot(q_lead, k, trans_b=True, accurate=True, interpret=config.interpret))
    return jnp.where(mask, z, 0.0)


def _split_refs(refs: tuple, config: _Config) -> tuple:
    """([freq_ref,] [seg_q_ref, seg_k_ref,] outputs...) -> freq_ref (None: θ^(−2d/D)), seg_q_ref, seg_k_ref (None
    without documents), the output refs."""
    rest = list(refs)
    freq_ref = rest.pop(0) if config.custom_freq else None
    seg_refs = (rest.pop(0), rest.pop(0)) if config.segmented else (None, None)
    return (freq_ref, *seg_refs, *rest)


def _suffix_exclusive(x: jax.Array) -> jax.Array:
    """[BQ, BK] -> Σ_{t>j} x[:, t], as rowtotal − cumsum (Triton cannot lower a reverse cumsum)."""
    return jnp.sum(x, axis=1, keepdims=True) - jnp.cumsum(x, axis=1)


Loader = Callable[..., jax.Array]


def _rotate(delta: jax.Array, load_k: Loader, freq_ref, lo: int, config: _Config
            ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """One chunk: ω [BD] (freq_ref's, else θ^(−2d/D)), cos φ, sin φ, kc, ks [BQ, BK, BD] for delta [BQ, BK]. Pairs
    past D/2 are zero padding (any ω works there)."""
    if freq_ref is None:
        pairs = lo + lax.broadcasted_iota(jnp.int32, (config.blocks.block_d,), 0)
        omega = rotary_frequencies(config.head_dim, config.theta, pairs)
    else:
        omega = freq_ref[pl.ds(lo, config.blocks.block_d)]
    phi = delta[:, :, None] * omega[None, None, :]
    cos, sin = jnp.cos(phi), jnp.sin(phi)
    k1, k2 = load_k(lo)[None], load_k(config.half + lo)[None]  # [1, BK, BD]
    return omega, cos, sin, k1 * cos + k2 * sin, k2 * cos - k1 * sin


def _scores(delta: jax.Array, load_q: Loader, load_k: Loader, freq_ref, config: _Config) -> list[jax.Array]:
    """G scores [BQ, BK] = sm_scale·Σ_d (q1·kc + q2·ks); the trig is shared by the heads of the group."""
    scores = [jnp.zeros(delta.shape, jnp.float32) for _ in range(config.groups)]
    for lo in config.chunks:
        _, _, _, kc, ks = _rotate(delta, load_k, freq_ref, lo, config)
        for r in range(config.groups):
            q1, q2 = load_q(r, lo)[:, None, :], load_q(r, config.half + lo)[:, None, :]
            scores[r] = scores[r] + jnp.sum(q1 * kc + q2 * ks, axis=2)
    return [config.sm_scale * s for s in scores]


def _softmax_grads(scores: list[jax.Array], mask: jax.Array, lse: list[jax.Array], row_dot: list[jax.Array],
                   do: list[jax.Array], v: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
    """Per head: P = exp(S − lse) and dS = P·(dO·vᵀ − Σ_d dO·O), each [BQ, BK]."""
    p = [jnp.where(mask, jnp.exp(s - m[:, None]), 0.0) for s, m in zip(scores, lse)]
    ds = [pr * (dot(dor, v, trans_b=True) - rd[:, None]) for pr, dor, rd in zip(p, do, row_dot)]
    return p, ds


def _rotary_backward(delta: jax.Array, ds: list[jax.Array], load_q: Loader, load_k: Loader, freq_ref,
                     config: _Config, *, wrt_q: bool) -> tuple[list, jax.Array]:
    """Back through the scores of one tile.

    Returns per chunk either (wrt_q) per head (dq1, dq2) [BQ, BD], or (dk1, dk2) [BK, BD]; and dΔ [BQ, BK].
    """
    grads, d_delta = [], jnp.zeros(delta.shape, jnp.float32)
    for lo in config.chunks:
        omega, cos, sin, kc, ks = _rotate(delta, load_k, freq_ref, lo, config)
        dsq1 = jnp.zeros(kc.shape, jnp.float32)  # Σ_h dS^h q1^h, [BQ, BK, BD]
        dsq2 = jnp.zeros(kc.shape, jnp.float32)
        per_head = []
        for r in range(config.groups):
            dsr = ds[r][:, :, None]
            if wrt_q:
                per_head.append((jnp.sum(dsr * kc, axis=1), jnp.sum(dsr * ks, axis=1)))
            dsq1 = dsq1 + dsr * load_q(r, lo)[:, None, :]
            dsq2 = dsq2 + dsr * load_q(r, config.half + lo)[:, None, :]
        if wrt_q:
            grads.append(per_head)
        else:
            grads.append((jnp.sum(dsq1 * cos - dsq2 * sin, axis=0), jnp.sum(dsq1 * sin + dsq2 * cos, axis=0)))
        d_delta = d_delta + jnp.sum((dsq1 * ks - dsq2 * kc) * omega[None, None, :], axis=2)
    return grads, config.sm_scale * d_delta


def _forward_kernel(q_ref, k_ref, v_ref, *refs, config: _Config):
    """q_ref [BQ, G, Dp], k_ref/v_ref [Lp, Dp], freq_ref [Dp/2], seg_q_ref [BQ], seg_k_ref [Lp] (with documents)
    -> o_ref [BQ, G, Dp], lse_ref [G, BQ]."""
    freq_ref, seg_q_ref, seg_k_ref, o_ref, lse_ref = _split_refs(refs, config)
    block_q, block_k = config.blocks.block_q, config.blocks.block_k
    qb = pl.program_id(0)
    rows = qb * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    seg_rows = None if seg_q_ref is None else seg_q_ref[...]
    load_q = lambda r, lo: q_ref[:, r, pl.ds(lo, config.blocks.block_d)].astype(jnp.float32)
    last_kb, key_steps = _key_blocks(qb, block_q, block_k, config)

    def body(step, carry):
        z_suffix, m, l, acc = carry  # [BQ]; G × [BQ]; G × [BQ]; G × [BQ, Dp]
        kb = last_kb - step
        keys = pl.ds(kb * block_k, block_k)
        cols = kb * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        load_k = lambda lo: k_ref[keys, pl.ds(lo, config.blocks.block_d)].astype(jnp.float32)
        mask = _visible(rows, cols, seg_rows, None if seg_k_ref is None else seg_k_ref[keys], config)
        z = _gates(q_ref[:, 0, :], k_ref[keys, :], mask, config)
        delta = z_suffix[:, None] + _suffix_exclusive(z)  # [BQ, BK]
        scores = _scores(delta, load_q, load_k, freq_ref, config)
        v = v_ref[keys, :]
        new_m, new_l, new_acc = [], [], []
        for r in range(config.groups):
            s = jnp.where(mask, scores[r], MASK_VALUE)
            m_r = jnp.maximum(m[r], jnp.max(s, axis=1))
            p = jnp.exp(s - m_r[:, None])
            correction = jnp.exp(m[r] - m_r)
            new_m.append(m_r)
            new_l.append(correction * l[r] + jnp.sum(p, axis=1))
            new_acc.append(correction[:, None] * acc[r] + dot(p.astype(v.dtype), v))
        return z_suffix + jnp.sum(z, axis=1), new_m, new_l, new_acc

    g, dp = config.groups, o_ref.shape[-1]
    init = (jnp.zeros((block_q,), jnp.float32), [jnp.full((block_q,), -jnp.inf, jnp.float32)] * g,
            [jnp.zeros((block_q,), jnp.float32)] * g, [jnp.zeros((block_q, dp), jnp.float32)] * g)
    _, m, l, acc = lax.fori_loop(0, key_steps, body, init)
    for r in range(g):
        o_ref[:, r, :] = (acc[r] / l[r][:, None]).astype(o_ref.dtype)
        lse_ref[r, :] = m[r] + jnp.log(l[r])


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, row_dot_ref, *refs, config: _Config):
    """q_ref/do_ref [BQ, G, Dp], k_ref/v_ref [Lp, Dp], lse_ref/row_dot_ref [G, BQ], freq_ref [Dp/2], seg_q_ref [BQ],
    seg_k_ref [Lp] (with documents) -> dq_ref [BQ, G, Dp], z_carry_ref/dd_carry_ref [L/BK, BQ] (suffix sums right of
    each visited key block; the others are never written), dd_total_ref [BQ].
    """
    freq_ref, seg_q_ref, seg_k_ref, dq_ref, z_carry_ref, dd_carry_ref, dd_total_ref = _split_refs(refs, config)
    block_q, block_k = config.blocks.block_q_bwd, config.blocks.block_k_bwd
    qb = pl.program_id(0)
    rows = qb * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    seg_rows = None if seg_q_ref is None else seg_q_ref[...]
    load_q = lambda r, lo: q_ref[:, r, pl.ds(lo, config.blocks.block_d)].astype(jnp.float32)
    q_lead = q_ref[:, 0, :]
    do = [do_ref[:, r, :] for r in range(config.groups)]
    lse = [lse_ref[r, :] for r in range(config.groups)]
    row_dot = [row_dot_ref[r, :] for r in range(config.groups)]
    last_kb, key_steps = _key_blocks(qb, block_q, block_k, config)

    def body(step, carry):
        z_suffix, dd_suffix, dq, dq_gate_total, dq_gate_suffix = carry
        kb = last_kb - step
        z_carry_ref[kb, :] = z_suffix
        dd_carry_ref[kb, :] = dd_suffix
        keys = pl.ds(kb * block_k, block_k)
        cols = kb * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        load_k = lambda lo: k_ref[keys, pl.ds(lo, config.blocks.block_d)].astype(jnp.float32)
        mask = _visible(rows, cols, seg_rows, None if seg_k_ref is None else seg_k_ref[keys], config)
        z = _gates(q_lead, k_ref[keys, :], mask, config)
        delta = z_suffix[:, None] + _suffix_exclusive(z)
        _, ds = _softmax_grads(_scores(delta, load_q, load_k, freq_ref, config), mask, lse, row_dot, do,
                               v_ref[keys, :])
        grads, d_delta = _rotary_backward(delta, ds, load_q, load_k, freq_ref, config, wrt_q=True)
        dq = [[(a1 + g1, a2 + g2) for (a1, a2), (g1, g2) in zip(acc_c, grad_c)] for acc_c, grad_c in zip(dq, grads)]
        suffix = dd_suffix[:, None] + _suffix_exclusive(d_delta) + d_delta  # Σ_{j≥t} dΔ_ij, [BQ, BK]
        z_slope = z * (1.0 - z)  # dz/dlogit, 0 above the diagonal
        suffix_slope = suffix * z_slope
        dq_gate_total = [(t1 + dot(z_slope, load_k(lo)), t2 + dot(z_slope, load_k(config.half + lo)))
                         for (t1, t2), lo in zip(dq_gate_total, config.chunks)]
        dq_gate_suffix = [(s1 + dot(suffix_slope, load_k(lo)), s2 + dot(suffix_slope, load_k(config.half + lo)))
                          for (s1, s2), lo in zip(dq_gate_suffix, config.chunks)]
        return (z_suffix + jnp.sum(z, axis=1), dd_suffix + jnp.sum(d_delta, axis=1), dq,
                dq_gate_total, dq_gate_suffix)

    row = jnp.zeros((block_q,), jnp.float32)
    chunk = jnp.zeros((block_q, config.blocks.block_d), jnp.float32)
    pairs = [(chunk, chunk) for _ in config.chunks]
    init = (row, row, [[(chunk, chunk)] * config.groups for _ in config.chunks], pairs, pairs)
    _, dd_total, dq, dq_gate_total, dq_gate_suffix = lax.fori_loop(0, key_steps, body, init)
    dd_total_ref[...] = dd_total
    for c, lo in enumerate(config.chunks):
        for r in range(config.groups):
            dq1, dq2 = dq[c][r]
            if r == 0:  # the leader's gates: dz_it = Tot_i − Suf_it
                (t1, t2), (s1, s2) = dq_gate_total[c], dq_gate_suffix[c]
                dq1 = dq1 + dd_total[:, None] * t1 - s1
                dq2 = dq2 + dd_total[:, None] * t2 - s2
            dq_ref[:, r, pl.ds(lo, config.blocks.block_d)] = (config.sm_scale * dq1).astype(dq_ref.dtype)
            dq_ref[:, r, pl.ds(config.half + lo, config.blocks.block_d)] = (config.sm_scale * dq2).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, row_dot_ref, z_carry_ref, dd_carry_ref, dd_total_ref,
                *refs, config: _Config):
    """q_ref/do_ref [Lp, G, Dp], k_ref/v_ref [BK, Dp], lse_ref/row_dot_ref [G, Lp],
    z_carry_ref/dd_carry_ref [L/BK, Lp], dd_total_ref [Lp], freq_ref [Dp/2], seg_q_ref [Lp], seg_k_ref [BK] (with
    documents) -> dk_ref/dv_ref [BK, Dp]."""
    freq_ref, seg_q_ref, seg_k_ref, dk_ref, dv_ref = _split_refs(refs, config)
    block_q, block_k = config.blocks.block_q_bwd, config.blocks.block_k_bwd
    kb = pl.program_id(0)
    cols = kb * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    seg_cols = None if seg_k_ref is None else seg_k_ref[...]
    load_k = lambda lo: k_ref[:, pl.ds(lo, config.blocks.block_d)].astype(jnp.float32)
    k, v = k_ref[...], v_ref[...]
    first_qb, end_qb = _query_blocks(kb, block_q, block_k, pl.cdiv(q_ref.shape[0], block_q), config)

    def body(qb, carry):
        dk, dv = carry
        span = pl.ds(qb * block_q, block_q)
        rows = qb * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
        load_q = lambda r, lo: q_ref[span, r, pl.ds(lo, config.blocks.block_d)].astype(jnp.float32)
        q_lead = q_ref[span, 0, :]
        do = [do_ref[span, r, :] for r in range(config.groups)]
        mask = _visible(rows, cols, None if seg_q_ref is None else seg_q_ref[span], seg_cols, config)
        z = _gates(q_lead, k, mask, config)
        delta = z_carry_ref[kb, span][:, None] + _suffix_exclusive(z)
        p, ds = _softmax_grads(_scores(delta, load_q, load_k, freq_ref, config), mask,
                               [lse_ref[r, span] for r in range(config.groups)],
                               [row_dot_ref[r, span] for r in range(config.groups)], do, v)
        for pr, dor in zip(p, do):
            dv = dv + dot(pr.astype(dor.dtype), dor, trans_a=True)
        grads, d_delta = _rotary_backward(delta, ds, load_q, load_k, freq_ref, config, wrt_q=False)
        suffix = dd_carry_ref[kb, span][:, None] + _suffix_exclusive(d_delta) + d_delta  # Σ_{j≥t} dΔ_ij
        d_logit = (dd_total_ref[span][:, None] - suffix) * z * (1.0 - z)  # dz_it·z'_it, [BQ, BK]
        dk = [(a1 + g1 + dot(d_logit, load_q(0, lo), trans_a=True),
               a2 + g2 + dot(d_logit, load_q(0, config.half + lo), trans_a=True))
              for (a1, a2), (g1, g2), lo in zip(dk, grads, config.chunks)]
        return dk, dv

    chunk = jnp.zeros((block_k, config.blocks.block_d), jnp.float32)
    init = ([(chunk, chunk) for _ in config.chunks], jnp.zeros(dv_ref.shape, jnp.float32))
    dk, dv = lax.fori_loop(first_qb, end_qb, body, init)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    for (dk1, dk2), lo in zip(dk, config.chunks):
        dk_ref[:, pl.ds(lo, config.blocks.block_d)] = (config.sm_scale * dk1).astype(dk_ref.dtype)
        dk_ref[:, pl.ds(config.half + lo, config.blocks.block_d)] = (config.sm_scale * dk2).astype(dk_ref.dtype)


def _pad(x: jax.Array, config: _Config) -> jax.Array:
    """[B, L, H, D] -> [B, Lp, H, 2·half]: zero rows at the end, each rotary half zero-padded to `half`."""
    pad = [(0, 0), (0, config.padded - x.shape[1]), (0, 0), (0, config.half - x.shape[3] // 2)]
    return jnp.concatenate([jnp.pad(h, pad) for h in jnp.split(x, 2, axis=-1)], axis=-1)


def _unpad(x: jax.Array, length: int, head_dim: int) -> jax.Array:
    """Inverse of `_pad`: [B, Lp, H, 2·half] -> [B, L, H, D]."""
    half = x.shape[3] // 2
    return jnp.concatenate([x[:, :length, :, : head_dim // 2], x[:, :length, :, half: half + head_dim // 2]], -1)


def _extras(config: _Config, freq: jax.Array | None, seg: jax.Array | None, rows: int, cols: int
            ) -> tuple[list[pl.BlockSpec], list[jax.Array]]:
    """The specs and arrays after a kernel's usual inputs: the caller's ω [Dp/2] (if any), then (with documents) the
    ids of the program's queries (tiles of `rows`) and keys (tiles of `cols`); a tile of Lp means all of them."""
    specs, arrays = [], []
    if freq is not None:
        specs.append(pl.BlockSpec((config.half,), lambda i, b, h: (0,)))
        arrays.append(freq)
    if seg is not None:
        tile = lambda n: pl.BlockSpec((None, n), (lambda i, b, h: (b, i)) if n < config.padded
                                      else (lambda i, b, h: (b, 0)))
        specs += [tile(rows), tile(cols)]
        arrays += [seg, seg]
    return specs, arrays


def _forward_call(config: _Config, q: jax.Array, k: jax.Array, v: jax.Array, freq: jax.Array, seg: jax.Array | None
                  ) -> tuple[jax.Array, jax.Array]:
    """Padded q [B, Lp, N, Dp], k/v [B, Lp, K, Dp], ω [Dp/2], segment ids [B, Lp] or None -> o [B, Lp, N, Dp],
    lse [B, N, Lp] float32."""
    batch, lp, num_heads, dp = q.shape
    g, bq, bk = config.groups, config.blocks.block_q, config.blocks.block_k
    group_rows = pl.BlockSpec((None, bq, g, dp), lambda i, b, h: (b, i, h, 0))
    kv_all = pl.BlockSpec((None, lp, None, dp), lambda i, b, h: (b, 0, h, 0))
    extra_specs, extras = _extras(config, freq, seg, bq, lp)
    return pl.pallas_call(
        functools.partial(_forward_kernel, config=config), grid=(lp // bq, batch, k.shape[2]),
        in_specs=[group_rows, kv_all, kv_all, *extra_specs],
        out_specs=[group_rows, pl.BlockSpec((None, g, bq), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, num_heads, lp), jnp.float32)],
        compiler_params=config.compiler_params(bq * bk), interpret=config.interpret, name="corope_forward",
    )(q, k, v, *extras)


def _dq_call(config: _Config, q, k, v, do, lse, row_dot, freq, seg) -> tuple[jax.Array, ...]:
    """Padded inputs, do [B, Lp, N, Dp], lse/row_dot [B, N, Lp] -> dq [B, Lp, N, Dp] and the carries of the dk/dv
    kernel: suffix sums of z and of dΔ right of each key block [B, K, Lp/BK, Lp], dΔ row totals [B, K, Lp]."""
    batch, lp, _, dp = q.shape
    num_kv = k.shape[2]
    g, bq, bk = config.groups, config.blocks.block_q_bwd, config.blocks.block_k_bwd
    group_rows = pl.BlockSpec((None, bq, g, dp), lambda i, b, h: (b, i, h, 0))
    group_stats = pl.BlockSpec((None, g, bq), lambda i, b, h: (b, h, i))
    kv_all = pl.BlockSpec((None, lp, None, dp), lambda i, b, h: (b, 0, h, 0))
    carries = pl.BlockSpec((None, None, lp // bk, bq), lambda i, b, h: (b, h, 0, i))
    carry_shape = jax.ShapeDtypeStruct((batch, num_kv, lp // bk, lp), jnp.float32)
    extra_specs, extras = _extras(config, freq, seg, bq, lp)
    return pl.pallas_call(
        functools.partial(_dq_kernel, config=config), grid=(lp // bq, batch, num_kv),
        in_specs=[group_rows, kv_all, kv_all, group_rows, group_stats, group_stats, *extra_specs],
        out_specs=[group_rows, carries, carries, pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), carry_shape, carry_shape,
                   jax.ShapeDtypeStruct((batch, num_kv, lp), jnp.float32)],
        compiler_params=config.compiler_params(bq * bk), interpret=config.interpret, name="corope_backward_dq",
    )(q, k, v, do, lse, row_dot, *extras)


def _dkv_call(config: _Config, q, k, v, do, lse, row_dot, z_carry, dd_carry, dd_total, freq, seg
              ) -> tuple[jax.Array, jax.Array]:
    """Padded inputs and the dq kernel's carries -> dk, dv [B, Lp, K, Dp]."""
    batch, lp, _, dp = q.shape
    num_kv = k.shape[2]
    g, bq, bk = config.groups, config.blocks.block_q_bwd, config.blocks.block_k_bwd
    group_all = pl.BlockSpec((None, lp, g, dp), lambda i, b, h: (b, 0, h, 0))
    stats_all = pl.BlockSpec((None, g, lp), lambda i, b, h: (b, h, 0))
    carries_all = pl.BlockSpec((None, None, lp // bk, lp), lambda i, b, h: (b, h, 0, 0))
    kv_block = pl.BlockSpec((None, bk, None, dp), lambda i, b, h: (b, i, h, 0))
    extra_specs, extras = _extras(config, freq, seg, lp, bk)
    return pl.pallas_call(
        functools.partial(_dkv_kernel, config=config), grid=(lp // bk, batch, num_kv),
        in_specs=[group_all, kv_block, kv_block, group_all, stats_all, stats_all, carries_all, carries_all,
                  pl.BlockSpec((None, None, lp), lambda i, b, h: (b, h, 0)), *extra_specs],
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=config.compiler_params(bq * bk), interpret=config.interpret, name="corope_backward_dkv",
    )(q, k, v, do, lse, row_dot, z_carry, dd_carry, dd_total, *extras)


def _corope_pallas_fwd(q, k, v, segment_ids, omega, config: _Config):
    qp, kp, vp = (_pad(x, config) for x in (q, k, v))
    freq = None if omega is None else jnp.pad(omega, (0, config.half - omega.shape[0]))  # [Dp/2], 0 on padding
    seg = None if segment_ids is None else jnp.pad(segment_ids.astype(jnp.int32),
                                                   [(0, 0), (0, config.padded - segment_ids.shape[1])])
    o, lse = _forward_call(config, qp, kp, vp, freq, seg)
    return _unpad(o, q.shape[1], q.shape[3]), (qp, kp, vp, o, lse, freq, seg)


def _corope_pallas_bwd(config: _Config, residuals, do):
    qp, kp, vp, o, lse, freq, seg = residuals
    dop = _pad(do.astype(o.dtype), config)
    row_dot = jnp.einsum("btnd,btnd->bnt", o.astype(jnp.float32), dop.astype(jnp.float32))  # Σ_d dO·O
    dq, *carries = _dq_call(config, qp, kp, vp, dop, lse, row_dot, freq, seg)
    dk, dv = _dkv_call(config, qp, kp, vp, dop, lse, row_dot, *carries, freq, seg)
    # Segment ids are integers; ω is a constant (see caller_frequencies).
    return (*(_unpad(x, do.shape[1], do.shape[3]) for x in (dq, dk, dv)), None, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _corope_pallas(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None,
                   omega: jax.Array | None, config: _Config) -> jax.Array:
    return _corope_pallas_fwd(q, k, v, segment_ids, omega, config)[0]


_corope_pallas.defvjp(_corope_pallas_fwd, _corope_pallas_bwd)
_corope_pallas_jit = jax.jit(_corope_pallas, static_argnums=(5,))


def corope_attention_pallas(q: jax.Array, k: jax.Array, v: jax.Array, *, theta: float, sm_scale: float,
                            block_sizes: BlockSizes | None = None, interpret: bool | None = None,
                            num_warps: int | None = None, num_stages: int | None = None,
                            segment_ids: jax.Array | None = None, window: int | None = None,
                            inv_freq: jax.Array | None = None) -> jax.Array:
    """Fused causal Co-RoPE attention. q [B, L, N, D], k/v [B, L, K, D] (float32 or bfloat16) -> [B, L, N, D].

    segment_ids: int [B, L] document ids (packed documents; padding as an id of its own), None: one document.
    window: int >= 1, query i sees keys i − window < j ≤ i (tiles outside it are never visited), None: all.
    inv_freq: float [D/2] rotary frequencies replacing θ^(−2d/D) (`theta` is then unused); a constant, not
    differentiated (its gradient is zero).
    Differentiable in q, k, v (fused dq and dk/dv kernels). interpret: run the kernels in the Pallas interpreter
    (default: unless the backend is a GPU); num_warps/num_stages tune the Triton lowering (defaults: 4 or 8 warps by
    tile size, 2 stages).
    """
    check_corope_inputs(q, k, v, theta=theta, sm_scale=sm_scale)
    check_kernel_dtype(q)
    check_head_dim(q.shape[3])
    check_pallas_settings(block_sizes, BlockSizes, num_warps=num_warps, num_stages=num_stages)
    check_segment_ids(segment_ids, q.shape[0], q.shape[1])
    check_window(window)
    check_inv_freq(inv_freq, q.shape[3])
    if q.shape[1] == 0:  # no queries: an empty output, as jax.nn.dot_product_attention gives
        return jnp.zeros(q.shape, q.dtype)
    config = _config(q, k, theta=theta, sm_scale=sm_scale, block_sizes=block_sizes or BlockSizes(),
                     interpret=resolve_interpret(interpret), num_warps=num_warps, num_stages=num_stages,
                     window=window, segmented=segment_ids is not None, custom_freq=inv_freq is not None)
    return _corope_pallas_jit(q, k, v, segment_ids, caller_frequencies(inv_freq), config)
