"""CoPE attention, blockwise in pure JAX: causal, GQA, packed documents, sliding windows, forward and fused backward,
O(L·block) memory.

Letters (as gemma's): B batch, L length (Lp padded), N query heads, K key/value heads, G = N / K group size, D head
dim, P = npos table rows, BK keys per block, C query rows per chunk (a multiple of BK). Einsum subscripts are the
lower-case letters, with t for query and s for key positions. Inside, heads are grouped: q [B, K, G, Lp, D],
k/v/kg [B, K, Lp, D], z [B, K, G, Lp, P]; everything is computed in float32.

The maths (SPEC §3): g_ij = sigmoid(sm_scale·q_i·kg_j) for j ≤ i, p_ij = min(Σ_{t=j..i} g_it, P − 1),
z_ip = q_i·e_p, pos_ij = (1 − w)·z_i,lo + w·z_i,hi with lo = ⌊p⌋, hi = min(lo + 1, P − 1), w = p − lo,
logits_ij = sm_scale·(q_i·k_j + pos_ij), causal softmax, times v.

Forward: query chunks (lax.map, one compiled body); for each, key blocks walked in reverse from the diagonal, carrying
the suffix sum R_i of the gates seen so far, so that inside a block p = R + (rowtotal − cumsum + g). Once every row
of the chunk has R ≥ P − 1, every earlier key sits at the clamped position: those blocks are plain attention
plus the per-row constant z_i,P−1 (no gates, no gathers) and R stops changing.

Backward: the gate gradient dg_it = Σ_{j≤t} ∂L/∂p_ij is a prefix sum over keys, so the backward walks key
blocks forward, carrying prefix sums of g and of ∂L/∂p. Then p_ij = R_i − (gates before j), R_i being the
forward's final carry: the gate sum over the blocks it computed in full. The clamped blocks come first and
need no gate work (∂L/∂p = 0 there). Only [B, K, G, C, BK] tiles are ever built.

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

import jax
import jax.numpy as jnp
from jax import lax

from jaxpe.kernels._checks import check_cope_inputs, check_positive_int, check_segment_ids, check_window
from jaxpe.kernels._common import MASK_VALUE, Interpolation, interpolate


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static settings of one call (hashable: the jit static argument and the custom_vjp's non-differentiable one)."""

    sm_scale: float
    block_k: int  # keys per scan step (BK, at most L)
    block_q: int  # query rows per chunk (C, rounded to a multiple of BK)
    window: int | None = None  # sliding window W (< L), None: the whole causal prefix


def _causal(rows: jax.Array, index: jax.Array, size: int) -> jax.Array:
    """Mask [C, BK]: key j = index·size + c is visible from row i iff j ≤ i."""
    cols = index * size + jnp.arange(size)
    return cols[None, :] <= rows[:, None]


def _visible(rows: jax.Array, index: jax.Array, size: int, seg_rows: jax.Array | None, seg: jax.Array | None,
             window: int | None) -> jax.Array:
    """Mask [B|1, 1, 1, C, BK]: key j = index·size + c visible from row i (causal, same document, inside the window).
    seg_rows [B, C] are the rows' document ids, seg [B, Lp] every key's."""
    mask = _causal(rows, index, size)
    if window is not None:
        cols = index * size + jnp.arange(size)
        mask &= rows[:, None] - cols[None, :] < window
    mask = mask[None, None, None]
    if seg_rows is not None:
        seg_keys = lax.dynamic_slice_in_dim(seg, index * size, size, axis=1)  # [B, BK]
        mask = mask & (seg_rows[:, :, None] == seg_keys[:, None, :])[:, None, None]
    return mask


def _window_blocks(chunk: int, size: int, window: int, padded: int) -> int:
    """The static number of key blocks one chunk of C rows walks under a window: C / BK + ⌈(W − 1) / BK⌉."""
    return min(chunk // size + -(-(window - 1) // size), padded // size)


def _gates(q: jax.Array, kg: jax.Array, mask: jax.Array, sm_scale: float) -> jax.Array:
    """q [B, K, G, C, D], kg [B, K, BK, D], mask [B|1, 1, 1, C, BK] -> g [B, K, G, C, BK], zero where masked."""
    s = jnp.einsum("bkgtd,bksd->bkgts", q, kg)
    return jnp.where(mask, jax.nn.sigmoid(sm_scale * s), 0.0)


def _interpolate(z: jax.Array, p: jax.Array) -> Interpolation:
    """Position logits from z [B, K, G, C, P] at p [B, K, G, C, BK] (in [0, P − 1]): `.value`, and the indices,
    weights and logits read that the backward needs."""
    return interpolate(lambda index: jnp.take_along_axis(z, index, axis=-1), p, z.shape[-1])


def _chunk_forward(q: jax.Array, z: jax.Array, k: jax.Array, v: jax.Array, kg: jax.Array, r0: jax.Array,
                   seg_rows: jax.Array | None = None, seg: jax.Array | None = None, *, size: int, sm_scale: float,
                   length: int, window: int | None = None) -> tuple[jax.Array, ...]:
    """One query chunk (rows r0 .. r0 + C) against key blocks of `size`, walked in reverse from the diagonal.

    q [B, K, G, C, D], z [B, K, G, C, P], k/v/kg [B, K, Lp, D]; seg_rows [B, C] and seg [B, Lp] document ids or None.
    Returns out [B, K, G, C, D], lse [B, K, G, C], R [B, K, G, C] and the first key block that was not clamped
    (the clamped ones are always a prefix of the blocks walked: R only grows).
    """
    npos = z.shape[-1]
    rows = r0 + jnp.arange(q.shape[3])
    live = (rows < length)[None, None, None]  # padded rows never decide anything
    num_blocks = (r0 + q.shape[3]) // size

    def step(i, carry):
        m, l, acc, r, clamped_blocks = carry
        index = num_blocks - 1 - i
        k_b, v_b, kg_b = (lax.dynamic_slice_in_dim(x, index * size, size, axis=2) for x in (k, v, kg))
        mask = _visible(rows, index, size, seg_rows, seg, window)
        qk = jnp.einsum("bkgtd,bksd->bkgts", q, k_b)
        clamped = jnp.all(jnp.where(live, r >= npos - 1, True))

        def full():
            g = _gates(q, kg_b, mask, sm_scale)
            csum = jnp.cumsum(g, axis=-1)
            total = csum[..., -1:]
            p = jnp.minimum(r[..., None] + total - csum + g, npos - 1)
            return qk + _interpolate(z, p).value, r + total[..., 0]

        def at_clamp():
            return qk + z[..., -1:], r

        s, r = lax.cond(clamped, at_clamp, full)
        logits = jnp.where(mask, sm_scale * s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        correction = jnp.exp(m - m_new)
        probs = jnp.exp(logits - m_new[..., None])
        l = l * correction + jnp.sum(probs, axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("bkgts,bksd->bkgtd", probs, v_b)
        return m_new, l, acc, r, clamped_blocks + clamped.astype(jnp.int32)

    rowshape = q.shape[:-1]
    init = (jnp.full(rowshape, MASK_VALUE), jnp.zeros(rowshape), jnp.zeros(q.shape), jnp.zeros(rowshape),
            jnp.zeros((), jnp.int32))
    if window is None:
        m, l, acc, r, clamped_blocks = lax.fori_loop(0, num_blocks, step, init)
        return acc / l[..., None], m + jnp.log(l), r, clamped_blocks
    # Under a window: a static number of blocks back from the diagonal (a scan whose length is ∝ W), skipping
    # those before key 0; step(i) walks block num_blocks − 1 − i.
    walked = _window_blocks(q.shape[3], size, window, k.shape[2])
    m, l, acc, r, clamped_blocks = lax.fori_loop(
        0, walked, lambda i, carry: lax.cond(num_blocks - 1 - i >= 0, functools.partial(step, i), lambda c: c, carry),
        init)
    first = jnp.maximum(num_blocks - walked, 0)
    return acc / l[..., None], m + jnp.log(l), r, first + clamped_blocks


def _chunk_backward(q: jax.Array, z: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, r: jax.Array,
                    first_full: jax.Array, kv: tuple[jax.Array, ...], dkv: tuple[jax.Array, ...], r0: jax.Array,
                    seg_rows: jax.Array | None = None, seg: jax.Array | None = None, *, size: int, sm_scale: float,
                    window: int | None = None) -> tuple[jax.Array, ...]:
    """Gradients of one query chunk, key blocks walked forward (prefix sums of g and ∂L/∂p carried).

    q/do [B, K, G, C, D], z [B, K, G, C, P], lse/delta/r [B, K, G, C]; blocks before `first_full`
    were clamped in the forward. kv = (k, v, kg) [B, K, Lp, D]; dkv = their gradients so far, to which this
    chunk's part is added; seg_rows [B, C] and seg [B, Lp] document ids or None.
    Returns dq [B, K, G, C, D], dz [B, K, G, C, P], dk, dv, dkg.
    """
    npos = z.shape[-1]
    rows = r0 + jnp.arange(q.shape[3])
    flat_rows = jnp.arange(z.size // npos)[:, None]

    def scatter(dz: jax.Array, index: jax.Array, values: jax.Array) -> jax.Array:
        """dz[..., index] += values along the last axis (index/values [B, K, G, C, BK])."""
        flat = dz.reshape(-1, npos).at[flat_rows, index.reshape(-1, size)].add(values.reshape(-1, size))
        return flat.reshape(dz.shape)

    def softmax_grads(s, mask, v_b):
        probs = jnp.exp(jnp.where(mask, sm_scale * s, MASK_VALUE) - lse[..., None])
        dprobs = jnp.einsum("bkgtd,bksd->bkgts", do, v_b)
        return probs, sm_scale * probs * (dprobs - delta[..., None])  # ds: gradient of q·k + pos

    def step(index, carry):
        dq, dz, g_before, dp_before, dkv = carry
        k_b, v_b, kg_b = (lax.dynamic_slice_in_dim(x, index * size, size, axis=2) for x in kv)
        mask = _visible(rows, index, size, seg_rows, seg, window)
        qk = jnp.einsum("bkgtd,bksd->bkgts", q, k_b)

        def full():
            g = _gates(q, kg_b, mask, sm_scale)
            csum = jnp.cumsum(g, axis=-1)
            p = jnp.clip(r[..., None] - g_before[..., None] - (csum - g), 0.0, npos - 1)
            at = _interpolate(z, p)
            probs, ds = softmax_grads(qk + at.value, mask, v_b)
            dz_new = scatter(scatter(dz, at.lo, ds * (1.0 - at.w)), at.hi, ds * at.w)
            dp_csum = jnp.cumsum(ds * (at.at_hi - at.at_lo), axis=-1)
            dgate = sm_scale * (dp_before[..., None] + dp_csum) * g * (1.0 - g)
            dq_new = dq + jnp.einsum("bkgts,bksd->bkgtd", ds, k_b) + jnp.einsum("bkgts,bksd->bkgtd", dgate, kg_b)
            dkg = jnp.einsum("bkgts,bkgtd->bksd", dgate, q)
            return (dq_new, dz_new, g_before + csum[..., -1], dp_before + dp_csum[..., -1]), probs, ds, dkg

        def at_clamp():
            probs, ds = softmax_grads(qk + z[..., -1:], mask, v_b)
            dz_new = dz.at[..., -1].add(jnp.sum(ds, axis=-1))
            dq_new = dq + jnp.einsum("bkgts,bksd->bkgtd", ds, k_b)
            return (dq_new, dz_new, g_before, dp_before), probs, ds, jnp.zeros_like(kg_b)

        carry, probs, ds, dkg = lax.cond(index < first_full, at_clamp, full)
        dk = jnp.einsum("bkgts,bkgtd->bksd", ds, q)
        dv = jnp.einsum("bkgts,bkgtd->bksd", probs, do)
        dkv = tuple(_add_block(total, part, index * size) for total, part in zip(dkv, (dk, dv, dkg)))
        return (*carry, dkv)

    rowshape = q.shape[:-1]
    init = (jnp.zeros(q.shape), jnp.zeros(z.shape), jnp.zeros(rowshape), jnp.zeros(rowshape), dkv)
    num_blocks = (r0 + q.shape[3]) // size
    if window is None:
        dq, dz, _, _, dkv = lax.fori_loop(0, num_blocks, step, init)
        return dq, dz, *dkv
    walked = _window_blocks(q.shape[3], size, window, kv[0].shape[2])  # the forward's blocks, walked forward
    first = num_blocks - walked
    dq, dz, _, _, dkv = lax.fori_loop(
        0, walked, lambda i, carry: lax.cond(first + i >= 0, functools.partial(step, first + i), lambda c: c, carry),
        init)
    return dq, dz, *dkv


def _add_block(total: jax.Array, part: jax.Array, start: jax.Array) -> jax.Array:
    """total[:, :, start : start + BK] += part, for total [B, K, Lp, D] and part [B, K, BK, D]."""
    size = part.shape[2]
    return lax.dynamic_update_slice_in_dim(
        total, lax.dynamic_slice_in_dim(total, start, size, axis=2) + part, start, axis=2)


def _grouped(q: jax.Array, k: jax.Array, v: jax.Array, kg: jax.Array, pos_emb: jax.Array, padded: int
             ) -> tuple[jax.Array, ...]:
    """[B, L, N|K, D] inputs -> float32 q [B, K, G, Lp, D], k/v/kg [B, K, Lp, D], e [P, D] or [K, G, P, D],
    with L zero-padded to Lp = `padded`."""
    b, length, n, d = q.shape
    num_kv = k.shape[2]
    e = pos_emb.astype(q.dtype).astype(jnp.float32)  # the table at the inputs' precision, as the reference uses it
    if pos_emb.ndim == 3:
        e = e.reshape(num_kv, n // num_kv, *pos_emb.shape[1:])
    pad = [(0, 0), (0, padded - length), (0, 0), (0, 0)]
    q = jnp.pad(q, pad).astype(jnp.float32).reshape(b, -1, num_kv, n // num_kv, d).transpose(0, 2, 3, 1, 4)
    k, v, kg = (jnp.pad(x, pad).astype(jnp.float32).transpose(0, 2, 1, 3) for x in (k, v, kg))
    return q, k, v, kg, e


def _position_logits(q: jax.Array, e: jax.Array) -> jax.Array:
    """z [B, K, G, L, P] = q·e_p for the shared [P, D] or per-head [K, G, P, D] table."""
    spec = "bkgtd,pd->bkgtp" if e.ndim == 2 else "bkgtd,kgpd->bkgtp"
    return jnp.einsum(spec, q, e)


def _tiling(length: int, config: _Config) -> tuple[int, int, int]:
    """(key block BK, query chunk C, padded length Lp): BK ≤ L, C a multiple of BK (under a window at most W rounded
    up to BK, so that a chunk's work is O(C·(C + W))), Lp a multiple of C."""
    size = min(config.block_k, length)
    num_blocks = -(-length // size)
    if config.window is not None:
        num_blocks = min(num_blocks, -(-config.window // size))
    chunk = size * max(1, min(config.block_q // size, num_blocks))
    return size, chunk, -(-length // chunk) * chunk


def _segments(segment_ids: jax.Array | None, padded: int, chunk: int) -> tuple[jax.Array | None, jax.Array | None]:
    """Document ids [B, L] -> (every key's [B, Lp], the rows' per chunk [Lp / C, B, C]); (None, None) without."""
    if segment_ids is None:
        return None, None
    seg = jnp.pad(segment_ids, [(0, 0), (0, padded - segment_ids.shape[1])])
    return seg, jnp.moveaxis(seg.reshape(seg.shape[0], padded // chunk, chunk), 1, 0)


def _chunked(x: jax.Array, chunk: int) -> jax.Array:
    """[B, K, G, Lp, ...] -> [Lp / C, B, K, G, C, ...], chunks first (for lax.map)."""
    b, num_kv, g, padded, *rest = x.shape
    x = x.reshape(b, num_kv, g, padded // chunk, chunk, *rest)
    return jnp.moveaxis(x, 3, 0)


def _unchunked(x: jax.Array) -> jax.Array:
    """Inverse of `_chunked`."""
    x = jnp.moveaxis(x, 0, 3)
    b, num_kv, g, n, chunk, *rest = x.shape
    return x.reshape(b, num_kv, g, n * chunk, *rest)


def _ungrouped(x: jax.Array, length: int) -> jax.Array:
    """[B, K, G, Lp, D] -> [B, L, N, D]."""
    b, num_kv, g, padded, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, padded, num_kv * g, d)[:, :length]


def _cope_blockwise_fwd(q, k, v, kg, pos_emb, segment_ids, config: _Config):
    length = q.shape[1]
    size, chunk, padded = _tiling(length, config)
    qg, kt, vt, kgt, e = _grouped(q, k, v, kg, pos_emb, padded)
    z = _position_logits(qg, e)
    seg, seg_chunks = _segments(segment_ids, padded, chunk)

    def one_chunk(xs):
        q_c, z_c, r0, seg_c = xs
        return _chunk_forward(q_c, z_c, kt, vt, kgt, r0, seg_c, seg, size=size, sm_scale=config.sm_scale,
                              length=length, window=config.window)

    starts = jnp.arange(0, padded, chunk)
    out, lse, r, first_full = lax.map(one_chunk, (_chunked(qg, chunk), _chunked(z, chunk), starts, seg_chunks))
    out, lse, r = _unchunked(out), _unchunked(lse), _unchunked(r)
    return _ungrouped(out, length).astype(q.dtype), (q, k, v, kg, pos_emb, segment_ids, out, lse, r, first_full)


def _cope_blockwise_bwd(config: _Config, residuals, dout):
    q, k, v, kg, pos_emb, segment_ids, out, lse, r, first_full = residuals
    length = q.shape[1]
    size, chunk, padded = _tiling(length, config)
    qg, kt, vt, kgt, e = _grouped(q, k, v, kg, pos_emb, padded)
    seg, seg_chunks = _segments(segment_ids, padded, chunk)
    do = _grouped(dout, k, v, kg, pos_emb, padded)[0]
    z = _position_logits(qg, e)
    delta = jnp.sum(out * do, axis=-1)
    per_chunk = tuple(_chunked(x, chunk) for x in (qg, z, do, lse, delta, r))

    def one_chunk(c, carry):
        dq, dz, dkv = carry
        q_c, z_c, do_c, lse_c, delta_c, r_c = (x[c] for x in per_chunk)
        seg_c = None if seg_chunks is None else seg_chunks[c]
        dq_c, dz_c, *dkv = _chunk_backward(q_c, z_c, do_c, lse_c, delta_c, r_c, first_full[c], (kt, vt, kgt),
                                           dkv, c * chunk, seg_c, seg, size=size, sm_scale=config.sm_scale,
                                           window=config.window)
        return dq.at[c].set(dq_c), dz.at[c].set(dz_c), tuple(dkv)

    init = (jnp.zeros_like(per_chunk[0]), jnp.zeros_like(per_chunk[1]), tuple(jnp.zeros_like(kt) for _ in range(3)))
    dq, dz, dkv = lax.fori_loop(0, padded // chunk, one_chunk, init)
    dq, dz = _unchunked(dq), _unchunked(dz)
    if e.ndim == 2:
        dq = dq + jnp.einsum("bkgtp,pd->bkgtd", dz, e)
        de = jnp.einsum("bkgtp,bkgtd->pd", dz, qg)
    else:
        dq = dq + jnp.einsum("bkgtp,kgpd->bkgtd", dz, e)
        de = jnp.einsum("bkgtp,bkgtd->kgpd", dz, qg).reshape(pos_emb.shape)
    dk, dv, dkg = (x.transpose(0, 2, 1, 3)[:, :length] for x in dkv)
    return (_ungrouped(dq, length).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dkg.astype(kg.dtype),
            de.astype(pos_emb.dtype), None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _cope_blockwise(q: jax.Array, k: jax.Array, v: jax.Array, kg: jax.Array, pos_emb: jax.Array,
                    segment_ids: jax.Array | None, config: _Config) -> jax.Array:
    return _cope_blockwise_fwd(q, k, v, kg, pos_emb, segment_ids, config)[0]


_cope_blockwise.defvjp(_cope_blockwise_fwd, _cope_blockwise_bwd)
_cope_blockwise_jit = jax.jit(_cope_blockwise, static_argnums=(6,))


def cope_attention_blockwise(q: jax.Array, k: jax.Array, v: jax.Array, pos_emb: jax.Array,
                             gate_k: jax.Array | None = None, *, sm_scale: float, block_k: int = 128,
                             block_q: int = 512, segment_ids: jax.Array | None = None,
                             window: int | None = None) -> jax.Array:
    """Causal CoPE attention in O(L·block) memory, differentiable (custom VJP).

    q [B, L, N, D], k/v [B, L, K, D] (K divides N), pos_emb [P, D] or [N, P, D], gate_k [B, L, K, D] or None
    (gates from k) -> [B, L, N, D] in q's dtype.
    block_k: keys per scan step; block_q: query rows per chunk (rounded to a multiple of block_k).
    segment_ids [B, L] int: packed documents (a key is visible only from queries with the same id; positions
    restart at each document); window: each query sees itself and the window − 1 keys before it (blocks outside
    are skipped: O(L·W) work).
    """
    check_cope_inputs(q, k, v, pos_emb, gate_k, sm_scale=sm_scale)
    check_positive_int("block_k", block_k)
    check_positive_int("block_q", block_q)
    check_segment_ids(segment_ids, q.shape[0], q.shape[1])
    check_window(window)
    if q.shape[1] == 0:  # no queries: an empty output, as jax.nn.dot_product_attention gives
        return jnp.zeros(q.shape, q.dtype)
    if window is not None and window >= q.shape[1]:  # every causal key is inside the window
        window = None
    kg = k if gate_k is None else gate_k
    segment_ids = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    return _cope_blockwise_jit(q, k, v, kg, pos_emb, segment_ids, _Config(float(sm_scale), block_k, block_q, window))
