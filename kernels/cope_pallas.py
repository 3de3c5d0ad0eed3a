"""Fused CoPE attention in Pallas (Triton lowering on GPU, interpret mode elsewhere): a forward kernel and one
backward kernel, with packed documents and sliding windows.

Letters (as in jaxpe/): B batch, L length (Lp padded), Hq query heads, Hkv key/value heads, G = Hq / Hkv group
size, D head dim (Dp padded to a power of two), P = npos table rows (Pp padded). Einsum subscripts: b batch, t query
and s key positions, n query head (Hq), d head dim, p table row. Kernel tiles are [block_q, block_k].

The maths (arXiv 2405.18719): g_ij = sigmoid(sm_scale·q_i·kg_j) for j ≤ i, p_ij = min(Σ_{t=j..i} g_it, P − 1),
z_ip = q_i·e_p (one XLA matmul outside the kernels), pos_ij = (1 − w)·z_i,lo + w·z_i,hi with lo = ⌊p⌋,
hi = min(lo + 1, P − 1), w = p − lo; logits_ij = sm_scale·(q_i·k_j + pos_ij), causal softmax, times v.
Every tile reads z_i,lo and z_i,hi with two gather loads from the program's [block_q, Pp] block of z (indices
clamped into [0, P − 1]): O(1) work per logit whatever the table size. When the gates come from the keys
(gate_k None) one q·kᵀ per tile gives both the logits and the gates. float32 gate logits are float32-accurate
(TF32×3 on the GPU: a TF32 error in a gate shifts every position counted past it), summed over dots of 32
head-dim columns read from the refs: the TF32×3 operand splits of whole [rows, Dp] tiles do not fit the registers.

Forward: one program per (query block, batch, head) walks key blocks in reverse from the diagonal, carrying the
suffix sum R_i of the gates; inside a tile p = R + (rowtotal − cumsum + g). Once every row's R reaches P − 1 the
remaining tiles are plain attention plus the per-row constant z_i,P−1: a second loop with no gate work. When
differentiating it saves, per row, only R_i where the reverse walk stopped and the first key e_i of the last block
it walked ([B, Hq, Lp] each: O(L)); keys before e_i are clamped (or outside the window).

Backward: one query-major program per (query block, batch, head) walks key blocks forward from the first visible
one to the diagonal. Blocks wholly before min_i e_i are clamped tiles (∂L/∂z_i,P−1 += Σ_j ds_ij). Later tiles
rebuild p from the saved R: p_ij = R_i − C_i − Σ_{e_i ≤ t < j} g_it, with C_i the sum of gates ≥ e_i in the
blocks already walked (clamped into [0, P − 1] against rounding). With ds = ∂L/∂(q·k + pos),
∂L/∂p_ij = ds_ij·(z_i,hi − z_i,lo) (0 once clamped) and the gate gradient dg_it = Σ_{j≤t} ∂L/∂p_ij is a prefix sum
over keys, carried across blocks. dq stays in registers; dk, dv (and d gate_k) are atomic adds into float32
zero-initialised outputs spanning the kv head's rows, ∂L/∂z atomic adds at (i, lo) and (i, hi) into the program's
own block. The table gradient and z's share of dq are XLA matmuls. Extra work against the forward: the gates'
dot is redone (once more per tile with gate_k), and each tile adds 2·block_q·block_k scattered atomics for ∂L/∂z
and three [block_k, Dp] atomic tile adds (two with gates from k); the float32 atomics make the gradients'
summation order (so their last bits) vary run to run.

Documents and windows: key j is visible to query i iff j ≤ i, segment_ids[b, i] == segment_ids[b, j] (when given)
and i − j < window (when given); invisible keys have gate 0. The document ids are an extra int32 input [B, Lp],
passed only when given (one block of row ids and the key ids of the batch row per program), compared per tile.
A window bounds every loop: both kernels start at the key block of key i0 − W + 1 (i0 the block's first row), so
the work is O(L·(W + block)).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxpe.base import check_cope_inputs
from jaxpe.kernels._checks import fused_refusal, open_fused
from jaxpe.kernels._common import BlockSizes as SharedBlockSizes
from jaxpe.kernels._common import (MASK_VALUE, dot, first_order_only, fold_scale, next_power_of_two, output_struct,
                                   resolve_interpret, tile_extent, triton_compiler_params, vary_alike)
from jaxpe.kernels._pallas_rows import visible


class BlockSizes(SharedBlockSizes):
    """CoPE's tile sizes (`default`, for D, dtype and whether gates come from a separate gate_k)."""

    @classmethod
    def default(cls, head_dim: int, dtype: jnp.dtype, *, gate_k: bool = False) -> BlockSizes:
        """The largest sizes found to keep the kernels within the compile report's budget on an H100 (no spills in
        the forward, a few bytes at most in the backward): float32 tiles take twice the registers of bfloat16 ones,
        and a separate gate_k (a second dot per tile) more. Backward query blocks of 32 rows halve the atomic adds
        into dk and dv against 16."""
        dp, wide = tile_extent(head_dim), jnp.dtype(dtype).itemsize > 2
        if not wide:
            if gate_k and dp >= 256:
                return cls(16, 32, 16, 32)
            return cls(64 if dp == 128 and not gate_k else 32, 32, 32, 32)
        backward = (32, 32) if dp <= 64 else (32, 16) if dp == 128 else (16, 16)
        if gate_k:
            return cls(16, 32 if dp <= 64 else 16, *backward)
        return cls(32, 32 if dp <= 128 else 16, *backward)


def default_num_warps(head_dim: int) -> int:
    """Warps per program: 4 up to Dp = 64, 8 above (in float32 and bfloat16 alike: the block sizes absorb the
    dtype)."""
    return 4 if tile_extent(head_dim) <= 64 else 8


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static settings of one call, fitted to its shapes (hashable: the jit static argument, the custom_vjp's
    non-differentiable one and the kernels' keyword argument)."""

    sm_scale: float
    npos: int  # P
    length: int  # L, before padding
    blocks: BlockSizes  # fitted to L, D, dtype and gate_k
    interpret: bool
    num_warps: int
    num_stages: int | None  # None: 2 in the forward, 1 in the backward
    window: int | None = None  # sliding window W (< L), None: the whole causal prefix
    accurate_gates: bool = False  # float32-accurate gate logits (TF32×3 on the GPU)

    def compiler_params(self, *, backward: bool):
        """Triton settings of the forward or the backward kernel. The backward's loop carries too much for Triton's
        software pipelining: with 2 stages ptxas spills kilobytes (float32, D 256), with 1 none."""
        return triton_compiler_params(num_warps=self.num_warps, num_stages=self.num_stages or (1 if backward else 2))


def _first_key_block(row0: jax.Array, window: int | None, block_k: int) -> jax.Array | int:
    """The first key block that row `row0` (or any later row) can see: 0 without a window."""
    if window is None:
        return 0
    return jnp.maximum(row0 - (window - 1), 0) // block_k


_ACCURATE_CHUNK = 32  # head-dim columns per float32-accurate gate dot (TF32×3 splits of wider tiles spill)
_SCORE_CHUNK = 64  # head-dim columns per q·kᵀ dot of the forward with gate_k (see _scores_and_gates)


def _chunked_dot(a_ref, b_ref, keys, dp: int, width: int, *, accurate: bool, interpret: bool) -> jax.Array:
    """a·bᵀ [block_q, block_k] summed over dots of `width` columns read from a_ref [block_q, Dp] and the rows `keys`
    of b_ref [Lp, Dp]."""
    width = min(width, dp)
    return sum(dot(a_ref[:, pl.ds(c, width)], b_ref[keys, pl.ds(c, width)], trans_b=True, accurate=accurate,
                   interpret=interpret) for c in range(0, dp, width))


def _scores_and_gates(q: jax.Array, k: jax.Array, q_ref, k_ref, kg_ref, keys, mask: jax.Array, config: _Config, *,
                      scores_from_refs: bool = False) -> tuple[jax.Array, jax.Array]:
    """s = q·kᵀ and the gates g (0 where masked), both [block_q, block_k] float32; with gates from k the gate
    logits are s itself. Accurate gate logits wider than _ACCURATE_CHUNK columns are summed over column chunks
    read from the refs, and with `scores_from_refs` s beside them over chunks of _SCORE_CHUNK (the forward with
    gate_k: a whole q tile kept in registers beside the chunks spills at Dp = 256)."""
    gate_ref = k_ref if kg_ref is None else kg_ref
    dp = q.shape[1]
    chunked = config.accurate_gates and dp > _ACCURATE_CHUNK
    if chunked:
        logits = _chunked_dot(q_ref, gate_ref, keys, dp, _ACCURATE_CHUNK, accurate=True, interpret=config.interpret)
    else:
        logits = dot(q, gate_ref[keys, :], trans_b=True, accurate=config.accurate_gates, interpret=config.interpret)
    if kg_ref is None:
        s = logits
    elif chunked and scores_from_refs:
        s = _chunked_dot(q_ref, k_ref, keys, dp, _SCORE_CHUNK, accurate=False, interpret=config.interpret)
    else:
        s = dot(q, k, trans_b=True)
    return s, jnp.where(mask, jax.nn.sigmoid(config.sm_scale * logits), 0.0)


def _interpolation(z_ref, p: jax.Array, npos: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """lo, hi (int32), w, z_lo, z_hi [block_q, block_k] for positions p in [0, P − 1], read from z_ref [block_q, Pp]
    by two gathers (indices clamped into [0, P − 1], so rows holding garbage read in range)."""
    lo = jnp.clip(jnp.floor(p), 0.0, npos - 1.0)
    w = p - lo
    lo = lo.astype(jnp.int32)
    hi = jnp.minimum(lo + 1, npos - 1)
    rows = jnp.arange(p.shape[0], dtype=jnp.int32)[:, None]
    return lo, hi, w, z_ref[rows, lo], z_ref[rows, hi]


def _online_softmax(carry, s, mask, v, sm_scale):
    """One tile of the forward's online softmax: carry (m, l, acc) updated with logits sm_scale·s."""
    m, l, acc = carry
    logits = jnp.where(mask, sm_scale * s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1))
    correction = jnp.exp(m - m_new)
    probs = jnp.exp(logits - m_new[:, None])
    acc = acc * correction[:, None] + dot(probs.astype(v.dtype), v)
    return m_new, l * correction + jnp.sum(probs, axis=1), acc


def _softmax_grads(s, mask, lse, delta, do, v, sm_scale):
    """probs and ds = ∂L/∂(q·k + pos) for one tile, from the saved lse and delta = rowsum(o·do)."""
    probs = jnp.exp(jnp.where(mask, sm_scale * s, MASK_VALUE) - lse[:, None])
    ds = sm_scale * probs * (dot(do, v, trans_b=True) - delta[:, None])
    return probs, ds


def _forward_kernel(q_ref, k_ref, v_ref, kg_ref, seg_q_ref, seg_k_ref, z_ref, o_ref, lse_ref, r_ref, e_ref, *,
                    config: _Config):
    """One query block: key blocks in reverse from the diagonal, full tiles until every row is clamped, then
    clamped tiles. Refs: q/o [bq, Dp], k/v/kg [Lp, Dp] (kg None: gates from k), row ids seg_q [bq] and key ids
    seg_k [Lp] (None without documents), z [bq, Pp], lse [bq], and when differentiating (else None) r [bq] (R where
    the walk stopped) and e [bq] int32 (its first full key)."""
    sm_scale, npos, length, block_k = config.sm_scale, config.npos, config.length, config.blocks.block_k
    block_q = q_ref.shape[0]
    rows = pl.program_id(0) * block_q + jnp.arange(block_q, dtype=jnp.int32)
    live = rows < length
    seg_rows = None if seg_q_ref is None else seg_q_ref[...]
    q = q_ref[...]

    def tile(index, carry, full: bool):
        keys = pl.ds(index * block_k, block_k)
        mask = visible(rows, index * block_k + jnp.arange(block_k, dtype=jnp.int32), config.window, seg_rows,
                        None if seg_k_ref is None else seg_k_ref[keys])
        k = k_ref[keys, :]
        if not full:
            s = dot(q, k, trans_b=True) + z_ref[:, pl.ds(npos - 1, 1)]
            return _online_softmax(carry, s, mask, v_ref[keys, :], sm_scale)
        *softmax, r = carry
        s, g = _scores_and_gates(q, k, q_ref, k_ref, kg_ref, keys, mask, config, scores_from_refs=True)
        total = jnp.sum(g, axis=1)
        p = jnp.minimum(r[:, None] + total[:, None] - jnp.cumsum(g, axis=1) + g, npos - 1.0)
        _, _, w, z_lo, z_hi = _interpolation(z_ref, p, npos)
        s = s + z_lo + w * (z_hi - z_lo)
        return (*_online_softmax(softmax, s, mask, v_ref[keys, :], sm_scale), r + total)

    first = _first_key_block(pl.program_id(0) * block_q, config.window, block_k)

    def unclamped(state):
        index, carry = state
        return jnp.logical_and(index >= first, jnp.min(jnp.where(live, carry[3], jnp.inf)) < npos - 1)

    init = (jnp.full((block_q,), MASK_VALUE, jnp.float32), jnp.zeros((block_q,), jnp.float32),
            jnp.zeros(q.shape, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    last = ((pl.program_id(0) + 1) * block_q + block_k - 1) // block_k - 1
    index, (*carry, r) = lax.while_loop(unclamped, lambda st: (st[0] - 1, tile(st[0], st[1], True)), (last, init))
    walked = index + 1 if config.window is None else index + 1 - first  # the clamped blocks left
    m, l, acc = lax.fori_loop(0, walked, lambda i, c: tile(index - i, c, False), tuple(carry))
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)
    if r_ref is not None:
        r_ref[...] = r
        e_ref[...] = jnp.full((block_q,), (index + 1) * block_k, jnp.int32)


def _backward_kernel(q_ref, k_ref, v_ref, kg_ref, seg_q_ref, seg_k_ref, z_ref, do_ref, lse_ref, delta_ref, r_ref,
                     e_ref, dz_in_ref, dk_in_ref, dv_in_ref, dkg_in_ref, dq_ref, dz_ref, dk_ref, dv_ref, dkg_ref, *,
                     config: _Config):
    """One query block: key blocks forward from the first visible one to the diagonal, clamped tiles first.
    Refs: q/do/dq [bq, Dp], k/v/kg [Lp, Dp] (kg None: gates from k), row ids seg_q [bq] and key ids seg_k [Lp] (None
    without documents), z/dz [bq, Pp], lse/delta/r/e [bq], the zeros aliased to the outputs (the *_in refs, unread),
    dk/dv/dkg [Lp, Dp] (atomic adds; dkg None with kg)."""
    del dz_in_ref, dk_in_ref, dv_in_ref, dkg_in_ref  # the same buffers as dz_ref, dk_ref, dv_ref, dkg_ref
    sm_scale, npos = config.sm_scale, config.npos
    block_k = config.blocks.block_k_bwd
    block_q = q_ref.shape[0]
    row0 = pl.program_id(0) * block_q
    rows = row0 + jnp.arange(block_q, dtype=jnp.int32)
    local = jnp.arange(block_q, dtype=jnp.int32)[:, None]
    seg_rows = None if seg_q_ref is None else seg_q_ref[...]
    q, do, lse, delta, r, e = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...], r_ref[...], e_ref[...]

    def tile(index, carry, full: bool):
        dq, dz_last, c, dp_before = carry
        keys = pl.ds(index * block_k, block_k)
        cols = index * block_k + jnp.arange(block_k, dtype=jnp.int32)
        mask = visible(rows, cols, config.window, seg_rows, None if seg_k_ref is None else seg_k_ref[keys])
        k, v = k_ref[keys, :], v_ref[keys, :]
        if not full:
            probs, ds = _softmax_grads(dot(q, k, trans_b=True) + z_ref[:, pl.ds(npos - 1, 1)], mask, lse, delta,
                                       do, v, sm_scale)
            dz_last = dz_last + jnp.sum(ds, axis=1)
            dscore = ds
        else:
            s, g = _scores_and_gates(q, k, q_ref, k_ref, kg_ref, keys, mask, config)
            walked = cols[None, :] >= e[:, None]  # keys whose gates the forward counted into R
            g = jnp.where(walked, g, 0.0)
            p = jnp.clip(r[:, None] - c[:, None] - (jnp.cumsum(g, axis=1) - g), 0.0, npos - 1.0)
            p = jnp.where(walked, p, npos - 1.0)
            lo, hi, w, z_lo, z_hi = _interpolation(z_ref, p, npos)
            probs, ds = _softmax_grads(s + z_lo + w * (z_hi - z_lo), mask, lse, delta, do, v, sm_scale)
            jax.ref.addupdate(dz_ref, (local, lo), ds * (1.0 - w))
            jax.ref.addupdate(dz_ref, (local, hi), ds * w)
            dp = jnp.where(p < npos - 1, ds * (z_hi - z_lo), 0.0)
            dgate = sm_scale * (dp_before[:, None] + jnp.cumsum(dp, axis=1)) * g * (1.0 - g)
            c, dp_before = c + jnp.sum(g, axis=1), dp_before + jnp.sum(dp, axis=1)
            if kg_ref is None:
                dscore = ds + dgate
            else:
                dscore = ds
                kg = kg_ref[keys, :]
                dq = dq + dot(dgate.astype(kg.dtype), kg)
                jax.ref.addupdate(dkg_ref, (keys, slice(None)), dot(dgate.astype(q.dtype), q, trans_a=True))
        jax.ref.addupdate(dk_ref, (keys, slice(None)), dot(dscore.astype(q.dtype), q, trans_a=True))
        jax.ref.addupdate(dv_ref, (keys, slice(None)), dot(probs.astype(do.dtype), do, trans_a=True))
        return dq + dot(dscore.astype(k.dtype), k), dz_last, c, dp_before

    first = _first_key_block(row0, config.window, block_k)
    num_blocks = (row0 + block_q + block_k - 1) // block_k
    clamped_end = jnp.minimum(jnp.maximum(first, jnp.min(e) // block_k), num_blocks)
    zeros = jnp.zeros((block_q,), jnp.float32)
    carry = (jnp.zeros(q.shape, jnp.float32), zeros, zeros, zeros)
    carry = lax.fori_loop(first, clamped_end, lambda i, c: tile(i, c, False), carry)
    dq, dz_last, _, _ = lax.fori_loop(clamped_end, num_blocks, lambda i, c: tile(i, c, True), carry)
    dq_ref[...] = dq
    jax.ref.addupdate(dz_ref, (local, jnp.full((block_q, 1), npos - 1, jnp.int32)), dz_last[:, None])


def _padded(q, k, v, kg, pos_emb, blocks: BlockSizes):
    """Zero-pad L to a multiple of every block and D to a power of two (kg may be None); e the padded table and
    z [B, Hq, Lp, Pp] float32 = q·e."""
    length, d = q.shape[1], q.shape[3]
    multiple = max(dataclasses.astuple(blocks))
    padded, dp = -(-length // multiple) * multiple, tile_extent(d)
    pad = [(0, 0), (0, padded - length), (0, 0), (0, dp - d)]
    q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
    kg = None if kg is None else jnp.pad(kg, pad)
    e = jnp.pad(pos_emb.astype(q.dtype), [(0, 0)] * (pos_emb.ndim - 1) + [(0, dp - d)])
    spec = "btnd,pd->bntp" if e.ndim == 2 else "btnd,npd->bntp"
    z = jnp.einsum(spec, q, e, preferred_element_type=jnp.float32)
    npos = pos_emb.shape[-2]
    z = jnp.pad(z, [(0, 0), (0, 0), (0, 0), (0, next_power_of_two(npos) - npos)])
    return q, k, v, kg, e, z


@dataclasses.dataclass(frozen=True)
class _RowSpecs:
    """BlockSpecs of a kernel with one program per (query block of `bq` rows, batch, query head): grid
    (Lp / bq, B, Hq). Every key/value row of the head's kv head is visible; z and per-row values are blocked by
    rows."""

    row: pl.BlockSpec  # [bq, Dp] of a [B, Lp, Hq, Dp] array
    kv_full: pl.BlockSpec  # [Lp, Dp] of a [B, Lp, Hkv, Dp] array, kv head n // G
    z: pl.BlockSpec  # [bq, Pp] of z [B, Hq, Lp, Pp]
    stat: pl.BlockSpec  # [bq] of [B, Hq, Lp]
    grid: tuple[int, int, int]
    seg_rows: pl.BlockSpec  # [bq] of document ids [B, Lp]
    seg_keys: pl.BlockSpec  # [Lp] of document ids [B, Lp]


def _row_specs(q: jax.Array, k: jax.Array, z: jax.Array, bq: int) -> _RowSpecs:
    batch, padded, num_heads, dp = q.shape
    groups = num_heads // k.shape[2]
    return _RowSpecs(
        row=pl.BlockSpec((None, bq, None, dp), lambda i, b, h: (b, i, h, 0)),
        kv_full=pl.BlockSpec((None, padded, None, dp), lambda i, b, h: (b, 0, h // groups, 0)),
        z=pl.BlockSpec((None, None, bq, z.shape[-1]), lambda i, b, h: (b, h, i, 0)),
        stat=pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
        grid=(padded // bq, batch, num_heads),
        seg_rows=pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
        seg_keys=pl.BlockSpec((None, padded), lambda i, b, h: (b, 0)),
    )


def _forward_call(config: _Config, q, k, v, kg, z, seg, *, save: bool):
    """o [B, Lp, Hq, Dp], lse [B, Hq, Lp] (and with `save` R [B, Hq, Lp] float32 and e [B, Hq, Lp] int32, else
    None); kg and seg may be None."""
    batch, padded, num_heads, _ = q.shape
    specs = _row_specs(q, k, z, config.blocks.block_q)
    stat = output_struct((batch, num_heads, padded), jnp.float32, q)
    saved = [stat, output_struct(stat.shape, jnp.int32, q)] if save else [None, None]
    out_shape = [output_struct(q.shape, q.dtype, q), stat, *saved]
    return pl.pallas_call(
        functools.partial(_forward_kernel, config=config), grid=specs.grid,
        in_specs=[specs.row, specs.kv_full, specs.kv_full, specs.kv_full if kg is not None else None,
                  *([specs.seg_rows, specs.seg_keys] if seg is not None else [None, None]), specs.z],
        out_specs=[specs.row, specs.stat, *(specs.stat if x is not None else None for x in saved)],
        out_shape=out_shape, compiler_params=config.compiler_params(backward=False), interpret=config.interpret,
        name="cope_forward",
    )(q, k, v, kg, seg, seg, z)


def _backward_call(config: _Config, q, k, v, kg, z, do, lse, delta, r, e, seg):
    """dq [B, Lp, Hq, Dp], dz [B, Hq, Lp, Pp], dk, dv, dkg [B, Lp, Hkv, Dp] (dkg None without kg), all float32."""
    specs = _row_specs(q, k, z, config.blocks.block_q_bwd)
    zeros = [jnp.zeros_like(z, jnp.float32)] + [jnp.zeros_like(k, jnp.float32)] * 2
    zeros.append(None if kg is None else jnp.zeros_like(k, jnp.float32))
    inputs = [q, k, v, kg, seg, seg, z, do, lse, delta, r, e]
    accumulated = [specs.z, specs.kv_full, specs.kv_full, None if kg is None else specs.kv_full]
    aliased_from = len(jax.tree.leaves(inputs))  # the flat index of the first zeros (None inputs are no operand)
    return pl.pallas_call(
        functools.partial(_backward_kernel, config=config), grid=specs.grid,
        in_specs=[specs.row, specs.kv_full, specs.kv_full, specs.kv_full if kg is not None else None,
                  *([specs.seg_rows, specs.seg_keys] if seg is not None else [None, None]), specs.z, specs.row,
                  *[specs.stat] * 4, *accumulated],
        out_specs=[specs.row, *accumulated],
        out_shape=[output_struct(q.shape, jnp.float32, q),
                   *(None if x is None else output_struct(x.shape, x.dtype, q) for x in zeros)],
        input_output_aliases={aliased_from + i: 1 + i for i in range(len(jax.tree.leaves(zeros)))},
        compiler_params=config.compiler_params(backward=True), interpret=config.interpret,
        name="cope_backward_dq",
    )(*inputs, *zeros)


def _padded_segments(segment_ids: jax.Array | None, padded: int) -> jax.Array | None:
    """Document ids [B, L] -> [B, Lp] (padded rows and keys take id 0: no real row sees a padded key)."""
    if segment_ids is None:
        return None
    return jnp.pad(segment_ids, [(0, 0), (0, padded - segment_ids.shape[1])])


def _cope_pallas_fwd(q, k, v, gate_k, pos_emb, segment_ids, config: _Config):
    qp, kp, vp, kgp, _, z = _padded(q, k, v, gate_k, pos_emb, config.blocks)
    seg = _padded_segments(segment_ids, qp.shape[1])
    out, lse, r, e = first_order_only("pallas", functools.partial(_forward_call, config, save=True), qp, kp, vp, kgp,
                                      z, seg)
    return out[:, :config.length, :, :q.shape[3]], (q, k, v, gate_k, pos_emb, segment_ids, out, lse, r, e)


def _cope_pallas_bwd(config: _Config, residuals, dout):
    q, k, v, gate_k, pos_emb, segment_ids, out, lse, r, e = residuals
    qp, kp, vp, kgp, table, z = _padded(q, k, v, gate_k, pos_emb, config.blocks)
    seg = _padded_segments(segment_ids, qp.shape[1])
    do = jnp.pad(dout, [(0, 0), (0, out.shape[1] - dout.shape[1]), (0, 0), (0, out.shape[3] - dout.shape[3])])
    delta = jnp.einsum("btnd,btnd->bnt", out.astype(jnp.float32), do.astype(jnp.float32))
    do = do.astype(q.dtype)
    dq, dz, dk, dv, dkg = first_order_only("pallas", functools.partial(_backward_call, config), qp, kp, vp, kgp, z,
                                           do, lse, delta, r, e, seg)
    dz = dz[..., :config.npos]
    if table.ndim == 2:
        dq = dq + jnp.einsum("bntp,pd->btnd", dz, table.astype(jnp.float32))
        de = jnp.einsum("bntp,btnd->pd", dz, qp.astype(jnp.float32))
    else:
        dq = dq + jnp.einsum("bntp,npd->btnd", dz, table.astype(jnp.float32))
        de = jnp.einsum("bntp,btnd->npd", dz, qp.astype(jnp.float32))
    length, d = config.length, q.shape[3]
    dgate_k = None if gate_k is None else dkg[:, :length, :, :d].astype(gate_k.dtype)
    return (dq[:, :length, :, :d].astype(q.dtype), dk[:, :length, :, :d].astype(k.dtype),
            dv[:, :length, :, :d].astype(v.dtype), dgate_k, de[..., :d].astype(pos_emb.dtype), None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _cope_pallas(q: jax.Array, k: jax.Array, v: jax.Array, gate_k: jax.Array | None, pos_emb: jax.Array,
                 segment_ids: jax.Array | None, config: _Config) -> jax.Array:
    qp, kp, vp, kgp, _, z = _padded(q, k, v, gate_k, pos_emb, config.blocks)
    out = _forward_call(config, qp, kp, vp, kgp, z, _padded_segments(segment_ids, qp.shape[1]), save=False)[0]
    return out[:, :config.length, :, :q.shape[3]]


_cope_pallas.defvjp(_cope_pallas_fwd, _cope_pallas_bwd)
_cope_pallas_jit = jax.jit(_cope_pallas, static_argnums=(6,))


def open_cope_fused(q: jax.Array, k: jax.Array, v: jax.Array, pos_emb: jax.Array, gate_k: jax.Array | None, *,
                    impl: str, sm_scale: float | jax.Array | None, block_sizes: BlockSizes | None,
                    num_warps: int | None, num_stages: int | None, segment_ids: jax.Array | None, window: int | None
                    ) -> tuple[jax.Array, float, jax.Array | None, int | None] | None:
    """The opening of both fused CoPE entries (impl "pallas" and "triton"): every input checked, then (q, sm_scale,
    segment_ids, window) as the kernels take them (`fold_scale`), or None when there is no query."""
    check_cope_inputs(q, k, v, pos_emb, gate_k, sm_scale=sm_scale)
    empty, segment_ids, window = open_fused(q, fused_refusal(q, impl=impl), block_sizes=block_sizes,
                                            blocks_type=BlockSizes, num_warps=num_warps, num_stages=num_stages,
                                            segment_ids=segment_ids, window=window)
    if empty:
        return None
    return (*fold_scale(q, sm_scale), segment_ids, window)


def cope_attention_pallas(q: jax.Array, k: jax.Array, v: jax.Array, pos_emb: jax.Array,
                          gate_k: jax.Array | None = None, *, sm_scale: float | jax.Array | None,
                          block_sizes: BlockSizes | None = None,
                          interpret: bool | None = None, num_warps: int | None = None,
                          num_stages: int | None = None, segment_ids: jax.Array | None = None,
                          window: int | None = None) -> jax.Array:
    """Causal CoPE attention, fused kernels with a fused backward (custom VJP).

    q [B, L, Hq, D], k/v [B, L, Hkv, D] (Hkv divides Hq), pos_emb [P, D] or [Hq, P, D], gate_k [B, L, Hkv, D] or None
    (gates from k) -> [B, L, Hq, D] in q's dtype.
    block_sizes: None fields (or None) take `BlockSizes.default(D, q.dtype, gate_k=gate_k is not None)`; interpret:
    run the kernels in the Pallas interpreter (default: unless the backend is a GPU); num_warps/num_stages tune the
    Triton lowering (defaults: `default_num_warps`; 2 stages in the forward, 1 in the backward).
    segment_ids [B, L] int: packed documents (a key is visible only from queries with the same id; positions
    restart at each document); window: each query sees itself and the window − 1 keys before it (key blocks
    outside are skipped).
    sm_scale: None (D^−½), a number > 0 or a traced scalar (a learned temperature), which multiplies q before the
    kernels (in q's dtype: a bfloat16 q is rounded once more). Differentiable once (jax.grad, not jax.grad of
    jax.grad nor jax.jvp); static shapes only (no symbolic jax.export dims).
    """
    opened = open_cope_fused(q, k, v, pos_emb, gate_k, impl="pallas", sm_scale=sm_scale, block_sizes=block_sizes,
                             num_warps=num_warps, num_stages=num_stages, segment_ids=segment_ids, window=window)
    if opened is None:
        return jnp.zeros(q.shape, q.dtype)
    q, sm_scale, segment_ids, window = opened
    blocks = (block_sizes or BlockSizes()).fitted(length=q.shape[1], head_dim=q.shape[3], dtype=q.dtype,
                                                  gate_k=gate_k is not None)
    config = _Config(sm_scale=sm_scale, npos=pos_emb.shape[-2], length=q.shape[1], blocks=blocks,
                     interpret=resolve_interpret(interpret), num_warps=num_warps or default_num_warps(q.shape[3]),
                     num_stages=num_stages, window=window, accurate_gates=q.dtype == jnp.float32)
    q, k, v, gate_k, pos_emb, segment_ids = vary_alike(q, k, v, gate_k, pos_emb, segment_ids)
    return _cope_pallas_jit(q, k, v, gate_k, pos_emb, segment_ids, config)
