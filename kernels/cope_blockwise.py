"""CoPE attention, blockwise in pure JAX: causal or bidirectional, GQA, packed documents, sliding windows, forward and
fused backward, O(L·block) memory.

Letters (as in jaxpe/): B batch, L length (Lp padded), Hq query heads, Hkv key/value heads, G = Hq / Hkv group
size, D head dim, P = npos table rows, BK keys per block, C query rows per chunk (a multiple of BK). Einsum
subscripts: b batch, k kv head (Hkv), g head of its group (G), t query and s key positions, d head dim, p table row.
Inside, heads are grouped: q [B, Hkv, G, Lp, D], k/v/kg [B, Hkv, Lp, D], z [B, Hkv, G, Lp, P]; everything is
computed in float32 (in float64 for float64 inputs: `compute_dtype`).

The maths (arXiv 2405.18719): g_ij = sigmoid(sm_scale·q_i·kg_j) for j ≤ i, p_ij = min(Σ_{t=j..i} g_it, P − 1),
z_ip = q_i·e_p, pos_ij = (1 − w)·z_i,lo + w·z_i,hi with lo = ⌊p⌋, hi = min(lo + 1, P − 1), w = p − lo,
logits_ij = sm_scale·(q_i·k_j + pos_ij), causal softmax, times v. Every term is linear in sm_scale·q, so the
kernels take q already multiplied by sm_scale (in the compute dtype) and sm_scale appears nowhere else: it is an operand
(a traced scalar, a learned temperature) whose gradient is Σ q·∂L/∂(sm_scale·q).

Bidirectional (causal=False; as x-transformers' data-dependent ALiBi counts both ways): every visible key counts,
p_ij = Σ_{t=j..i} g_it for j ≤ i and p_ij = Σ_{t=i..j} g_it for j ≥ i (the diagonal once: p_ii = g_ii), clamped to
P − 1. The keys j ≤ i are the causal walk; the keys j > i are a strict causal walk over the time-reversed sequence
(q, k, v, kg and the document ids reversed): its gates still count the diagonal, its softmax leaves it out, so the
two key sets are disjoint and their outputs merge by their row log-sum-exps, with no term to subtract.

Forward: query chunks (lax.map, one compiled body); for each, key blocks walked in reverse from the diagonal, carrying
the suffix sum R_i of the gates seen so far, so that inside a block p = R + (rowtotal − cumsum + g). Once every row
of the chunk has R ≥ P − 1, every earlier key sits at the clamped position: those blocks are plain attention
plus the per-row constant z_i,P−1 (no gates, no gathers) and R stops changing. The output is in the compute dtype and
comes with the rows' log-sum-exps lse, both differentiable: lse's cotangent only shifts the softmax's row term,
δ_i − dlse_i.

Backward: the gate gradient dg_it = Σ_{j≤t} ∂L/∂p_ij is a prefix sum over keys, so the backward walks key
blocks forward, carrying prefix sums of g and of ∂L/∂p. Then p_ij = R_i − (gates before j), R_i being the
forward's final carry: the gate sum over the blocks it computed in full. The clamped blocks come first and
need no gate work (∂L/∂p = 0 there). Only [B, Hkv, G, C, BK] tiles are ever built.

Every loop has a trip count fixed by the shapes (a chunk walks as many blocks as the longest one needs and skips the
others by lax.cond), so the backward is itself reverse-differentiable: jax.grad of jax.grad works. A length that is
symbolic (jax.export) gets the full block sizes and is padded up to a multiple of the chunk.

Documents and windows (one definition everywhere): key j is visible to query i iff j ≤ i, segment_ids[b, i] ==
segment_ids[b, j] (when given) and i − j < window (when given). Invisible keys have gate 0, so positions count only
the keys of the query's document inside its window. The segment mask is applied per tile (the chunk's row ids
against the block's key ids). With a window the chunk is at most the window (rounded up to BK) and each chunk walks
a static number of key blocks, C / BK + ⌈(W − 1) / BK⌉ (blocks before 0 are skipped), so the work is
O(L·(W + BK)), not O(L²); the backward walks the same blocks forward.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxpe.base import (GATE_PRECISION, check_cope_inputs, check_positive_int, compute_dtype, open_attention,
                        scale_or_default)
from jaxpe.kernels._common import MASK_VALUE, Interpolation, carry_init, interpolate, vary_alike


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static settings of one call (hashable: the jit static argument and the custom_vjp's non-differentiable one)."""

    block_k: int  # keys per scan step (BK, at most L)
    block_q: int  # query rows per chunk (C, rounded to a multiple of BK)
    window: int | None = None  # sliding window W (< L), None: the whole causal prefix
    strict: bool = False  # the softmax leaves out the diagonal (the gates count it): keys j < i only


def _visible(rows: jax.Array, index: jax.Array, size: int, seg_rows: jax.Array | None, seg: jax.Array | None,
             window: int | None) -> jax.Array:
    """Mask [B|1, 1, 1, C, BK]: key j = index·size + c visible from row i (causal, same document, inside the window).
    seg_rows [B, C] are the rows' document ids, seg [B, Lp] every key's."""
    cols = index * size + jnp.arange(size, dtype=jnp.int32)
    mask = cols[None, :] <= rows[:, None]
    if window is not None:
        mask &= rows[:, None] - cols[None, :] < window
    mask = mask[None, None, None]
    if seg_rows is not None:
        seg_keys = lax.dynamic_slice_in_dim(seg, index * size, size, axis=1)  # [B, BK]
        mask = mask & (seg_rows[:, :, None] == seg_keys[:, None, :])[:, None, None]
    return mask


def _attended(mask: jax.Array, rows: jax.Array, index: jax.Array, size: int, strict: bool) -> jax.Array:
    """The keys the softmax reads: `mask` (that of the gates), without the diagonal when `strict`."""
    if not strict:
        return mask
    cols = index * size + jnp.arange(size, dtype=jnp.int32)
    return mask & (cols[None, :] < rows[:, None])[None, None, None]


def _walked_blocks(chunk: int, size: int, window: int | None, padded: int) -> int:
    """The static number of key blocks one chunk of C rows walks: every block without a window (a chunk skips
    those past its diagonal), C / BK + ⌈(W − 1) / BK⌉ under one (blocks before key 0 are skipped)."""
    every = padded // size
    if window is None:
        return every
    walked = chunk // size + -(-(window - 1) // size)
    return min(walked, every) if isinstance(padded, int) else walked


def _gates(q: jax.Array, kg: jax.Array, mask: jax.Array) -> jax.Array:
    """q [B, Hkv, G, C, D] (times sm_scale), kg [B, Hkv, BK, D], mask [B|1, 1, 1, C, BK] -> g [B, Hkv, G, C, BK], zero
    where masked."""
    s = jnp.einsum("bkgtd,bksd->bkgts", q, kg, precision=GATE_PRECISION)
    return jnp.where(mask, jax.nn.sigmoid(s), 0.0)


def _interpolate(z: jax.Array, p: jax.Array) -> Interpolation:
    """Position logits from z [B, Hkv, G, C, P] at p [B, Hkv, G, C, BK] (in [0, P − 1]): `.value`, and the indices,
    weights and logits read that the backward needs."""
    return interpolate(lambda index: jnp.take_along_axis(z, index, axis=-1), p, z.shape[-1])


def _chunk_forward(q: jax.Array, z: jax.Array, k: jax.Array, v: jax.Array, kg: jax.Array, r0: jax.Array,
                   seg_rows: jax.Array | None, seg: jax.Array | None, *, size: int, length: int, walked: int,
                   window: int | None, strict: bool) -> tuple[jax.Array, ...]:
    """One query chunk (rows r0 .. r0 + C) against key blocks of `size`, walked in reverse from the diagonal.

    q [B, Hkv, G, C, D] (times sm_scale), z [B, Hkv, G, C, P], k/v/kg [B, Hkv, Lp, D]; seg_rows [B, C] and seg [B, Lp]
    document ids or None. Returns out [B, Hkv, G, C, D], lse [B, Hkv, G, C], R [B, Hkv, G, C] and the first key block
    that was not clamped (the clamped ones are always a prefix of the blocks walked: R only grows).
    """
    npos = z.shape[-1]
    rows = r0 + jnp.arange(q.shape[3], dtype=jnp.int32)
    live = (rows < length)[None, None, None]  # padded rows never decide anything
    num_blocks = (r0 + q.shape[3]) // size  # the blocks up to the chunk's diagonal

    def block(index, carry):
        m, l, acc, r, clamped_blocks = carry
        k_b, v_b, kg_b = (lax.dynamic_slice_in_dim(x, index * size, size, axis=2) for x in (k, v, kg))
        mask = _visible(rows, index, size, seg_rows, seg, window)
        qk = jnp.einsum("bkgtd,bksd->bkgts", q, k_b)
        clamped = jnp.all(jnp.where(live, r >= npos - 1, True))

        def full():
            g = _gates(q, kg_b, mask)
            csum = jnp.cumsum(g, axis=-1)
            total = csum[..., -1:]
            p = jnp.minimum(r[..., None] + total - csum + g, npos - 1)
            return qk + _interpolate(z, p).value, r + total[..., 0]

        def at_clamp():
            return qk + z[..., -1:], r

        s, r = lax.cond(clamped, at_clamp, full)
        logits = jnp.where(_attended(mask, rows, index, size, strict), s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        correction = jnp.exp(m - m_new)
        probs = jnp.exp(logits - m_new[..., None])
        l = l * correction + jnp.sum(probs, axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("bkgts,bksd->bkgtd", probs, v_b)
        return m_new, l, acc, r, clamped_blocks + clamped.astype(jnp.int32)

    def step(carry, i):  # block num_blocks − 1 − i, skipped before key 0
        index = num_blocks - 1 - i
        return lax.cond(index >= 0, functools.partial(block, index), lambda c: c, carry), None

    rowshape = q.shape[:-1]
    init = (carry_init(MASK_VALUE, rowshape, q.dtype, q), carry_init(0.0, rowshape, q.dtype, q),
            carry_init(0.0, q.shape, q.dtype, q), carry_init(0.0, rowshape, q.dtype, q),
            carry_init(0, (), jnp.int32, q))
    (m, l, acc, r, clamped_blocks), _ = lax.scan(step, init, jnp.arange(walked, dtype=jnp.int32))
    first = jnp.maximum(num_blocks - walked, 0)
    return acc / l[..., None], m + jnp.log(l), r, first + clamped_blocks


def _chunk_backward(q: jax.Array, z: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, r: jax.Array,
                    first_full: jax.Array, r0: jax.Array, seg_rows: jax.Array | None, kv: tuple[jax.Array, ...],
                    dkv: tuple[jax.Array, ...], seg: jax.Array | None, *, size: int, walked: int,
                    window: int | None, strict: bool) -> tuple[jax.Array, ...]:
    """Gradients of one query chunk, key blocks walked forward (prefix sums of g and ∂L/∂p carried).

    q/do [B, Hkv, G, C, D] (q times sm_scale), z [B, Hkv, G, C, P], lse/delta/r [B, Hkv, G, C]; blocks before
    `first_full` were clamped in the forward. kv = (k, v, kg) [B, Hkv, Lp, D]; dkv = their gradients so far, to which
    this chunk's part is added; seg_rows [B, C] and seg [B, Lp] document ids or None.
    Returns dq [B, Hkv, G, C, D] and dz [B, Hkv, G, C, P] (with respect to sm_scale·q and its z), dk, dv, dkg.
    """
    npos = z.shape[-1]
    rows = r0 + jnp.arange(q.shape[3], dtype=jnp.int32)
    flat_rows = jnp.arange(z.size // npos, dtype=jnp.int32)[:, None]

    def scatter(dz: jax.Array, index: jax.Array, values: jax.Array) -> jax.Array:
        """dz[..., index] += values along the last axis (index/values [B, Hkv, G, C, BK])."""
        flat = dz.reshape(-1, npos).at[flat_rows, index.reshape(-1, size)].add(values.reshape(-1, size))
        return flat.reshape(dz.shape)

    def softmax_grads(s, mask, v_b):
        probs = jnp.exp(jnp.where(mask, s, MASK_VALUE) - lse[..., None])
        dprobs = jnp.einsum("bkgtd,bksd->bkgts", do, v_b)
        return probs, probs * (dprobs - delta[..., None])  # ds: gradient of q·k + pos

    def block(index, carry):
        dq, dz, g_before, dp_before, dkv = carry
        k_b, v_b, kg_b = (lax.dynamic_slice_in_dim(x, index * size, size, axis=2) for x in kv)
        mask = _visible(rows, index, size, seg_rows, seg, window)
        attended = _attended(mask, rows, index, size, strict)
        qk = jnp.einsum("bkgtd,bksd->bkgts", q, k_b)

        def full():
            g = _gates(q, kg_b, mask)
            csum = jnp.cumsum(g, axis=-1)
            p = jnp.clip(r[..., None] - g_before[..., None] - (csum - g), 0.0, npos - 1)
            at = _interpolate(z, p)
            probs, ds = softmax_grads(qk + at.value, attended, v_b)
            dz_new = scatter(scatter(dz, at.lo, ds * (1.0 - at.w)), at.hi, ds * at.w)
            dp_csum = jnp.cumsum(ds * (at.at_hi - at.at_lo), axis=-1)
            dgate = (dp_before[..., None] + dp_csum) * g * (1.0 - g)
            dq_new = dq + jnp.einsum("bkgts,bksd->bkgtd", ds, k_b) + jnp.einsum("bkgts,bksd->bkgtd", dgate, kg_b)
            dkg = jnp.einsum("bkgts,bkgtd->bksd", dgate, q)
            return (dq_new, dz_new, g_before + csum[..., -1], dp_before + dp_csum[..., -1]), probs, ds, dkg

        def at_clamp():
            probs, ds = softmax_grads(qk + z[..., -1:], attended, v_b)
            dz_new = dz.at[..., -1].add(jnp.sum(ds, axis=-1))
            dq_new = dq + jnp.einsum("bkgts,bksd->bkgtd", ds, k_b)
            return (dq_new, dz_new, g_before, dp_before), probs, ds, jnp.zeros_like(kg_b)

        carry, probs, ds, dkg = lax.cond(index < first_full, at_clamp, full)
        dk = jnp.einsum("bkgts,bkgtd->bksd", ds, q)
        dv = jnp.einsum("bkgts,bkgtd->bksd", probs, do)
        dkv = tuple(_add_block(total, part, index * size) for total, part in zip(dkv, (dk, dv, dkg)))
        return (*carry, dkv)

    num_blocks = (r0 + q.shape[3]) // size
    first = num_blocks - walked  # the forward's blocks, walked forward; those before key 0 are skipped

    def step(carry, i):
        index = first + i
        return lax.cond(index >= 0, functools.partial(block, index), lambda c: c, carry), None

    rowshape = q.shape[:-1]
    init = (carry_init(0.0, q.shape, q.dtype, q), carry_init(0.0, z.shape, z.dtype, z),
            carry_init(0.0, rowshape, q.dtype, q), carry_init(0.0, rowshape, q.dtype, q), dkv)
    (dq, dz, _, _, dkv), _ = lax.scan(step, init, jnp.arange(walked, dtype=jnp.int32))
    return dq, dz, *dkv


def _add_block(total: jax.Array, part: jax.Array, start: jax.Array) -> jax.Array:
    """total[:, :, start : start + BK] += part, for total [B, Hkv, Lp, D] and part [B, Hkv, BK, D]."""
    size = part.shape[2]
    return lax.dynamic_update_slice_in_dim(
        total, lax.dynamic_slice_in_dim(total, start, size, axis=2) + part, start, axis=2)


def _grouped(q: jax.Array, k: jax.Array, v: jax.Array, kg: jax.Array, pos_emb: jax.Array, padded: int
             ) -> tuple[jax.Array, ...]:
    """[B, L, Hq|Hkv, D] inputs -> q [B, Hkv, G, Lp, D], k/v/kg [B, Hkv, Lp, D], e [P, D] or [Hkv, G, P, D] in
    `compute_dtype`, with L zero-padded to Lp = `padded`."""
    num_kv, dtype = k.shape[2], compute_dtype(q, k, v, kg)
    e = pos_emb.astype(q.dtype).astype(dtype)  # the table at the inputs' precision, as the reference uses it
    if pos_emb.ndim == 3:
        e = e.reshape(num_kv, q.shape[2] // num_kv, *pos_emb.shape[1:])
    k, v, kg = (_padded(x, padded).astype(dtype).transpose(0, 2, 1, 3) for x in (k, v, kg))
    return _grouped_rows(q.astype(dtype), padded, num_kv), k, v, kg, e


def _padded(x: jax.Array, padded: int) -> jax.Array:
    """[B, L, ...] zero-padded to [B, Lp, ...]."""
    return jnp.pad(x, [(0, 0), (0, padded - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _grouped_rows(x: jax.Array, padded: int, num_kv: int) -> jax.Array:
    """[B, L, Hq, ...] -> [B, Hkv, G, Lp, ...] (L zero-padded to Lp): query head n is head n % G of group n // G."""
    b, _, n, *rest = x.shape
    x = _padded(x, padded).reshape(b, padded, num_kv, n // num_kv, *rest)
    return jnp.moveaxis(x, 1, 3)


def _ungrouped(x: jax.Array, length: int) -> jax.Array:
    """Inverse of `_grouped_rows`: [B, Hkv, G, Lp, ...] -> [B, L, Hq, ...]."""
    b, num_kv, g, padded, *rest = x.shape
    return jnp.moveaxis(x, 3, 1).reshape(b, padded, num_kv * g, *rest)[:, :length]


def _position_logits(q: jax.Array, e: jax.Array) -> jax.Array:
    """z [B, Hkv, G, L, P] = q·e_p for the shared [P, D] or per-head [Hkv, G, P, D] table."""
    spec = "bkgtd,pd->bkgtp" if e.ndim == 2 else "bkgtd,kgpd->bkgtp"
    return jnp.einsum(spec, q, e)


def _tiling(length: int, config: _Config) -> tuple[int, int, int]:
    """(key block BK, query chunk C, padded length Lp): BK ≤ L, C a multiple of BK (under a window at most W rounded
    up to BK, so that a chunk's work is O(C·(C + W))), Lp a multiple of C. A symbolic length takes the configured
    sizes as they are."""
    static = isinstance(length, int)
    size = min(config.block_k, length) if static else config.block_k
    per_chunk = max(1, config.block_q // size)
    if static:
        per_chunk = min(per_chunk, -(-length // size))
    if config.window is not None:
        per_chunk = min(per_chunk, -(-config.window // size))
    chunk = size * per_chunk
    return size, chunk, -(-length // chunk) * chunk


def _segments(segment_ids: jax.Array | None, padded: int, chunk: int) -> tuple[jax.Array | None, jax.Array | None]:
    """Document ids [B, L] -> (every key's [B, Lp], the rows' per chunk [Lp / C, B, C]); (None, None) without."""
    if segment_ids is None:
        return None, None
    seg = _padded(segment_ids, padded)
    return seg, jnp.moveaxis(seg.reshape(seg.shape[0], padded // chunk, chunk), 1, 0)


def _chunked(x: jax.Array, chunk: int) -> jax.Array:
    """[B, Hkv, G, Lp, ...] -> [Lp / C, B, Hkv, G, C, ...], chunks first (for lax.map and lax.scan)."""
    b, num_kv, g, padded, *rest = x.shape
    x = x.reshape(b, num_kv, g, padded // chunk, chunk, *rest)
    return jnp.moveaxis(x, 3, 0)


def _unchunked(x: jax.Array) -> jax.Array:
    """Inverse of `_chunked`."""
    x = jnp.moveaxis(x, 0, 3)
    b, num_kv, g, n, chunk, *rest = x.shape
    return x.reshape(b, num_kv, g, n * chunk, *rest)


def _chunk_starts(padded: int, chunk: int) -> jax.Array:
    """The first row of every chunk, int32 [Lp / C]."""
    return jnp.arange(padded // chunk, dtype=jnp.int32) * chunk


class _Operands(NamedTuple):
    """What the forward and the backward rule both build from a call's operands (letters as the module's)."""

    size: int  # BK
    chunk: int  # C
    padded: int  # Lp
    walked: int  # key blocks each chunk walks
    q: jax.Array  # [B, Hkv, G, Lp, D] in `compute_dtype`, before sm_scale
    scaled: jax.Array  # sm_scale·q
    k: jax.Array  # [B, Hkv, Lp, D] in `compute_dtype`, as v and kg
    v: jax.Array
    kg: jax.Array
    e: jax.Array  # the table [P, D] or [Hkv, G, P, D] in `compute_dtype`
    z: jax.Array  # [B, Hkv, G, Lp, P] = (sm_scale·q)·e
    seg: jax.Array | None  # every key's document id [B, Lp]
    seg_chunks: jax.Array | None  # the rows' per chunk [Lp / C, B, C]


def _operands(q, k, v, kg, pos_emb, sm_scale, segment_ids, config: _Config) -> _Operands:
    """The tiling of q's length, the grouped and padded operands and the position logits z."""
    size, chunk, padded = _tiling(q.shape[1], config)
    qg, kt, vt, kgt, e = _grouped(q, k, v, kg, pos_emb, padded)
    scaled = qg * sm_scale
    return _Operands(size, chunk, padded, _walked_blocks(chunk, size, config.window, padded), qg, scaled, kt, vt, kgt,
                     e, _position_logits(scaled, e), *_segments(segment_ids, padded, chunk))


def _cope_blockwise_fwd(q, k, v, kg, pos_emb, sm_scale, segment_ids, config: _Config):
    length = q.shape[1]
    ops = _operands(q, k, v, kg, pos_emb, sm_scale, segment_ids, config)

    def one_chunk(xs):
        q_c, z_c, r0, seg_c = xs
        return _chunk_forward(q_c, z_c, ops.k, ops.v, ops.kg, r0, seg_c, ops.seg, size=ops.size, length=length,
                              walked=ops.walked, window=config.window, strict=config.strict)

    out, lse, r, first_full = lax.map(one_chunk, (_chunked(ops.scaled, ops.chunk), _chunked(ops.z, ops.chunk),
                                                 _chunk_starts(ops.padded, ops.chunk), ops.seg_chunks))
    out, lse, r = _unchunked(out), _unchunked(lse), _unchunked(r)
    residuals = (q, k, v, kg, pos_emb, sm_scale, segment_ids, out, lse, r, first_full)
    return (_ungrouped(out, length), _ungrouped(lse, length)), residuals


def _cope_blockwise_bwd(config: _Config, residuals, cotangents):
    q, k, v, kg, pos_emb, sm_scale, segment_ids, out, lse, r, first_full = residuals
    dout, dlse = cotangents
    length, num_kv = q.shape[1], k.shape[2]
    ops = _operands(q, k, v, kg, pos_emb, sm_scale, segment_ids, config)
    qg, scaled, e = ops.q, ops.scaled, ops.e
    do = _grouped_rows(dout.astype(qg.dtype), ops.padded, num_kv)
    delta = jnp.sum(out * do, axis=-1) - _grouped_rows(dlse.astype(qg.dtype), ops.padded, num_kv)
    per_chunk = tuple(_chunked(x, ops.chunk) for x in (scaled, ops.z, do, lse, delta, r))

    def one_chunk(dkv, xs):
        *chunk_inputs, first_c, r0, seg_c = xs
        dq_c, dz_c, *dkv = _chunk_backward(*chunk_inputs, first_c, r0, seg_c, (ops.k, ops.v, ops.kg), dkv, ops.seg,
                                           size=ops.size, walked=ops.walked, window=config.window,
                                           strict=config.strict)
        return tuple(dkv), (dq_c, dz_c)

    init = tuple(carry_init(0.0, ops.k.shape, ops.k.dtype, ops.k) for _ in range(3))
    dkv, (dq, dz) = lax.scan(one_chunk, init, (*per_chunk, first_full, _chunk_starts(ops.padded, ops.chunk),
                                               ops.seg_chunks))
    dq, dz = _unchunked(dq), _unchunked(dz)  # with respect to sm_scale·q
    if e.ndim == 2:
        dq = dq + jnp.einsum("bkgtp,pd->bkgtd", dz, e)
        de = jnp.einsum("bkgtp,bkgtd->pd", dz, scaled)
    else:
        dq = dq + jnp.einsum("bkgtp,kgpd->bkgtd", dz, e)
        de = jnp.einsum("bkgtp,bkgtd->kgpd", dz, scaled).reshape(pos_emb.shape)
    d_scale = jnp.sum(dq * qg)
    dk, dv, dkg = (x.transpose(0, 2, 1, 3)[:, :length] for x in dkv)
    return (_ungrouped(dq * sm_scale, length).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            dkg.astype(kg.dtype), de.astype(pos_emb.dtype), d_scale.astype(sm_scale.dtype), None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _cope_blockwise(q: jax.Array, k: jax.Array, v: jax.Array, kg: jax.Array, pos_emb: jax.Array,
                    sm_scale: jax.Array, segment_ids: jax.Array | None, config: _Config
                    ) -> tuple[jax.Array, jax.Array]:
    """out [B, L, Hq, D] and lse [B, L, Hq] (in `compute_dtype`) of the causal (or with config.strict, strictly
    causal) walk."""
    return _cope_blockwise_fwd(q, k, v, kg, pos_emb, sm_scale, segment_ids, config)[0]


_cope_blockwise.defvjp(_cope_blockwise_fwd, _cope_blockwise_bwd)


def _reversed(x: jax.Array | None) -> jax.Array | None:
    """[B, L, ...] in reverse order along L."""
    return None if x is None else jnp.flip(x, axis=1)


def _merge(o_a: jax.Array, lse_a: jax.Array, o_b: jax.Array, lse_b: jax.Array) -> jax.Array:
    """Softmax attention over two disjoint key sets from each one's output [B, L, Hq, D] and lse [B, L, Hq] (a row
    that sees no key of a set has a vanishing lse there: MASK_VALUE plus a log)."""
    m = lax.stop_gradient(jnp.maximum(lse_a, lse_b))
    w_a, w_b = jnp.exp(lse_a - m)[..., None], jnp.exp(lse_b - m)[..., None]
    return (w_a * o_a + w_b * o_b) / (w_a + w_b)


@functools.partial(jax.jit, static_argnums=(7, 8))
def _attention(q: jax.Array, k: jax.Array, v: jax.Array, kg: jax.Array, pos_emb: jax.Array, sm_scale: jax.Array,
               segment_ids: jax.Array | None, config: _Config, causal: bool) -> jax.Array:
    """The causal walk, and for bidirectional attention the strict one over the reversed sequence merged in."""
    out, lse = _cope_blockwise(q, k, v, kg, pos_emb, sm_scale, segment_ids, config)
    if not causal:
        reverse = dataclasses.replace(config, strict=True)
        out_rev, lse_rev = _cope_blockwise(*map(_reversed, (q, k, v, kg)), pos_emb, sm_scale,
                                           _reversed(segment_ids), reverse)
        out = _merge(out, lse, _reversed(out_rev), _reversed(lse_rev))
    return out.astype(q.dtype)


def cope_attention_blockwise(q: jax.Array, k: jax.Array, v: jax.Array, pos_emb: jax.Array,
                             gate_k: jax.Array | None = None, *, sm_scale: float | jax.Array | None,
                             causal: bool = True, block_k: int = 128, block_q: int = 512,
                             segment_ids: jax.Array | None = None, window: int | None = None) -> jax.Array:
    """CoPE attention in O(L·block) memory, differentiable (custom VJP), twice as well (jax.grad of jax.grad).

    q [B, L, Hq, D], k/v [B, L, Hkv, D] (Hkv divides Hq), pos_emb [P, D] or [Hq, P, D], gate_k [B, L, Hkv, D] or None
    (gates from k) -> [B, L, Hq, D] in q's dtype (any floating dtype; float32 inside, float64 for float64 inputs).
    sm_scale: None (D^−½), a number > 0 or a traced scalar (a learned temperature; differentiable).
    causal=False: bidirectional, positions count gates both ways from the query (module docstring).
    block_k: keys per scan step; block_q: query rows per chunk (rounded to a multiple of block_k). A symbolic length
    (jax.export) is padded to a multiple of the chunk.
    segment_ids [B, L] int: packed documents (a key is visible only from queries with the same id; positions
    restart at each document); window: each query sees itself and the window − 1 keys before it (and after it when
    bidirectional); blocks outside are skipped: O(L·W) work.
    """
    check_cope_inputs(q, k, v, pos_emb, gate_k, sm_scale=sm_scale)
    check_positive_int("block_k", block_k)
    check_positive_int("block_q", block_q)
    empty, segment_ids, window = open_attention(q, causal=causal, segment_ids=segment_ids, window=window)
    if empty:
        return jnp.zeros(q.shape, q.dtype)
    kg = k if gate_k is None else gate_k
    scale = jnp.asarray(scale_or_default(sm_scale, q.shape[3]), compute_dtype(q, k, v, kg))
    operands = vary_alike(q, k, v, kg, pos_emb, scale, segment_ids)
    return _attention(*operands, _Config(int(block_k), int(block_q), window), causal)
