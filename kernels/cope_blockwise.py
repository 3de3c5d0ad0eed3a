"""CoPE attention, blockwise in pure JAX: causal, GQA, forward and fused backward, O(L·block) memory.

B batch, L length, Hq query heads, Hkv key/value heads, G = Hq // Hkv, D head dim, P = npos positions,
T key block, C query chunk (a multiple of T). Inside, heads are grouped: q [B, Hkv, G, L, D],
k/v/kg [B, Hkv, L, D], z [B, Hkv, G, L, P]; everything is computed in float32.

The maths (SPEC §3): g_ij = sigmoid(sm_scale·q_i·kg_j) for j ≤ i, p_ij = min(Σ_{t=j..i} g_it, P − 1),
z_ip = q_i·e_p, pos_ij = (1 − w)·z_i,lo + w·z_i,hi with lo = ⌊p⌋, hi = min(lo + 1, P − 1), w = p − lo,
logits_ij = sm_scale·(q_i·k_j + pos_ij), causal softmax, times v.

Forward: query chunks (a static loop); for each, key blocks scanned in reverse from the diagonal, carrying the
suffix sum R_i of the gates seen so far, so that inside a block p = R + (rowtotal − cumsum + g). Once every row
of the chunk has R ≥ P − 1, every earlier key sits at the clamped position: those blocks are plain attention
plus the per-row constant z_i,P−1 (no gates, no gathers) and R stops changing.

Backward: the gate gradient dg_it = Σ_{j≤t} ∂L/∂p_ij is a prefix sum over keys, so the backward walks key
blocks forward, carrying prefix sums of g and of ∂L/∂p. Then p_ij = R_i − (gates before j), R_i being the
forward's final carry: the gate sum over the blocks it computed in full. The clamped blocks come first and
need no gate work (∂L/∂p = 0 there). Only [B, Hkv, G, C, T] tiles are ever built.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _key_blocks(x: jax.Array, size: int) -> jax.Array:
    """[B, Hkv, L, D] -> [L / size, B, Hkv, size, D], the scanned axis first."""
    b, h, length, d = x.shape
    return x.reshape(b, h, length // size, size, d).transpose(2, 0, 1, 3, 4)


def _causal(rows: jax.Array, index: jax.Array, size: int) -> jax.Array:
    """Mask [C, T]: key j = index·size + t is visible from row i iff j ≤ i."""
    cols = index * size + jnp.arange(size)
    return cols[None, :] <= rows[:, None]


def _gates(q: jax.Array, kg: jax.Array, mask: jax.Array, sm_scale: float) -> jax.Array:
    """q [B, Hkv, G, C, D], kg [B, Hkv, T, D] -> g [B, Hkv, G, C, T], zero where masked."""
    s = jnp.einsum("bhgcd,bhtd->bhgct", q, kg)
    return jnp.where(mask[None, None, None], jax.nn.sigmoid(sm_scale * s), 0.0)


def _interpolate(z: jax.Array, p: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Position logits from z [B, Hkv, G, C, P] at p [B, Hkv, G, C, T] (in [0, P − 1]).

    Returns pos [B, Hkv, G, C, T] and (lo, hi, w, z_lo, z_hi) for the backward.
    """
    lo = jnp.floor(p)
    w = p - lo
    lo = lo.astype(jnp.int32)
    hi = jnp.minimum(lo + 1, z.shape[-1] - 1)
    z_lo = jnp.take_along_axis(z, lo, axis=-1)
    z_hi = jnp.take_along_axis(z, hi, axis=-1)
    return z_lo + w * (z_hi - z_lo), (lo, hi, w, z_lo, z_hi)


def _chunk_forward(q: jax.Array, z: jax.Array, kv_blocks: tuple[jax.Array, ...], rows: jax.Array, *,
                   sm_scale: float, length: int) -> tuple[jax.Array, ...]:
    """One query chunk against its key blocks [N, B, Hkv, T, D] (k, v, kg), walked in reverse.

    q [B, Hkv, G, C, D], z [B, Hkv, G, C, P], rows [C] (global row index).
    Returns out [B, Hkv, G, C, D], lse [B, Hkv, G, C], R [B, Hkv, G, C], clamped [N] bool.
    """
    size, npos = kv_blocks[0].shape[3], z.shape[-1]
    live = (rows < length)[None, None, None]  # padded rows never decide anything

    def step(carry, xs):
        m, l, acc, r = carry
        k, v, kg, index = xs
        mask = _causal(rows, index, size)
        qk = jnp.einsum("bhgcd,bhtd->bhgct", q, k)
        clamped = jnp.all(jnp.where(live, r >= npos - 1, True))

        def full():
            g = _gates(q, kg, mask, sm_scale)
            csum = jnp.cumsum(g, axis=-1)
            total = csum[..., -1:]
            p = jnp.minimum(r[..., None] + total - csum + g, npos - 1)
            return qk + _interpolate(z, p)[0], r + total[..., 0]

        def at_clamp():
            return qk + z[..., -1:], r

        s, r = lax.cond(clamped, at_clamp, full)
        logits = jnp.where(mask[None, None, None], sm_scale * s, _MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        correction = jnp.exp(m - m_new)
        probs = jnp.exp(logits - m_new[..., None])
        l = l * correction + jnp.sum(probs, axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("bhgct,bhtd->bhgcd", probs, v)
        return (m_new, l, acc, r), clamped

    rowshape = q.shape[:-1]
    init = (jnp.full(rowshape, _MASK_VALUE), jnp.zeros(rowshape), jnp.zeros(q.shape), jnp.zeros(rowshape))
    indices = jnp.arange(kv_blocks[0].shape[0])
    (m, l, acc, r), clamped = lax.scan(step, init, (*kv_blocks, indices), reverse=True)
    return acc / l[..., None], m + jnp.log(l), r, clamped


def _chunk_backward(q: jax.Array, z: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, r: jax.Array,
                    first_full: jax.Array, kv_blocks: tuple[jax.Array, ...], rows: jax.Array, *,
                    sm_scale: float) -> tuple[jax.Array, ...]:
    """Gradients of one query chunk, key blocks walked forward (prefix sums of g and ∂L/∂p carried).

    q/do [B, Hkv, G, C, D], z [B, Hkv, G, C, P], lse/delta/r [B, Hkv, G, C]; blocks before `first_full`
    were clamped in the forward. Returns dq [B, Hkv, G, C, D], dz [B, Hkv, G, C, P] and per key block
    dk, dv, dkg [N, B, Hkv, T, D].
    """
    size, npos = kv_blocks[0].shape[3], z.shape[-1]
    flat_rows = jnp.arange(z.size // npos)[:, None]

    def scatter(dz: jax.Array, index: jax.Array, values: jax.Array) -> jax.Array:
        """dz[..., index] += values along the last axis (index/values [B, Hkv, G, C, T])."""
        flat = dz.reshape(-1, npos).at[flat_rows, index.reshape(-1, size)].add(values.reshape(-1, size))
        return flat.reshape(dz.shape)

    def softmax_grads(s, mask, v):
        probs = jnp.exp(jnp.where(mask[None, None, None], sm_scale * s, _MASK_VALUE) - lse[..., None])
        dprobs = jnp.einsum("bhgcd,bhtd->bhgct", do, v)
        return probs, sm_scale * probs * (dprobs - delta[..., None])  # ds: gradient of q·k + pos

    def step(carry, xs):
        dq, dz, g_before, dp_before = carry
        k, v, kg, index = xs
        mask = _causal(rows, index, size)
        qk = jnp.einsum("bhgcd,bhtd->bhgct", q, k)

        def full():
            g = _gates(q, kg, mask, sm_scale)
            csum = jnp.cumsum(g, axis=-1)
            p = jnp.clip(r[..., None] - g_before[..., None] - (csum - g), 0.0, npos - 1)
            pos, (lo, hi, w, z_lo, z_hi) = _interpolate(z, p)
            probs, ds = softmax_grads(qk + pos, mask, v)
            dz_new = scatter(scatter(dz, lo, ds * (1.0 - w)), hi, ds * w)
            dp_csum = jnp.cumsum(ds * (z_hi - z_lo), axis=-1)
            dgate = sm_scale * (dp_before[..., None] + dp_csum) * g * (1.0 - g)
            dq_new = dq + jnp.einsum("bhgct,bhtd->bhgcd", ds, k) + jnp.einsum("bhgct,bhtd->bhgcd", dgate, kg)
            dkg = jnp.einsum("bhgct,bhgcd->bhtd", dgate, q)
            return (dq_new, dz_new, g_before + csum[..., -1], dp_before + dp_csum[..., -1]), probs, ds, dkg

        def at_clamp():
            probs, ds = softmax_grads(qk + z[..., -1:], mask, v)
            dz_new = dz.at[..., -1].add(jnp.sum(ds, axis=-1))
            dq_new = dq + jnp.einsum("bhgct,bhtd->bhgcd", ds, k)
            return (dq_new, dz_new, g_before, dp_before), probs, ds, jnp.zeros_like(kg)

        carry, probs, ds, dkg = lax.cond(index < first_full, at_clamp, full)
        dk = jnp.einsum("bhgct,bhgcd->bhtd", ds, q)
        dv = jnp.einsum("bhgct,bhgcd->bhtd", probs, do)
        return carry, (dk, dv, dkg)

    rowshape = q.shape[:-1]
    init = (jnp.zeros(q.shape), jnp.zeros(z.shape), jnp.zeros(rowshape), jnp.zeros(rowshape))
    indices = jnp.arange(kv_blocks[0].shape[0])
    (dq, dz, _, _), dkv = lax.scan(step, init, (*kv_blocks, indices))
    return (dq, dz, *dkv)


def _grouped(q: jax.Array, k: jax.Array, v: jax.Array, kg: jax.Array, pos_emb: jax.Array, size: int
             ) -> tuple[jax.Array, ...]:
    """[B, L, H, D] inputs -> float32 q [B, Hkv, G, Lp, D], k/v/kg [B, Hkv, Lp, D], e [P, D] or [Hkv, G, P, D],
    with L zero-padded to Lp, a multiple of `size`."""
    b, length, hq, d = q.shape
    hkv = k.shape[2]
    e = pos_emb.astype(q.dtype).astype(jnp.float32)  # the table at the inputs' precision, as the reference uses it
    if pos_emb.ndim == 3:
        e = e.reshape(hkv, hq // hkv, *pos_emb.shape[1:])
    pad = [(0, 0), (0, -length % size), (0, 0), (0, 0)]
    q = jnp.pad(q, pad).astype(jnp.float32).reshape(b, -1, hkv, hq // hkv, d).transpose(0, 2, 3, 1, 4)
    k, v, kg = (jnp.pad(x, pad).astype(jnp.float32).transpose(0, 2, 1, 3) for x in (k, v, kg))
    return q, k, v, kg, e


def _position_logits(q: jax.Array, e: jax.Array) -> jax.Array:
    """z [B, Hkv, G, L, P] = q·e_p for the shared [P, D] or per-head [Hkv, G, P, D] table."""
    spec = "bhgld,pd->bhglp" if e.ndim == 2 else "bhgld,hgpd->bhglp"
    return jnp.einsum(spec, q, e)


def _chunks(padded: int, size: int, chunk: int) -> list[tuple[int, int]]:
    """Query chunk bounds [(r0, r1)], r0, r1 multiples of the key block `size`."""
    chunk = max(size, chunk // size * size)
    return [(r0, min(r0 + chunk, padded)) for r0 in range(0, padded, chunk)]


def _forward(q, k, v, kg, pos_emb, sm_scale, block_k, block_q):
    length = q.shape[1]
    size = min(block_k, length)
    qg, kt, vt, kgt, e = _grouped(q, k, v, kg, pos_emb, size)
    z = _position_logits(qg, e)
    blocks = tuple(_key_blocks(x, size) for x in (kt, vt, kgt))
    outs = []
    for r0, r1 in _chunks(qg.shape[3], size, block_q):
        rows = jnp.arange(r0, r1)
        outs.append(_chunk_forward(qg[:, :, :, r0:r1], z[:, :, :, r0:r1], tuple(x[:r1 // size] for x in blocks),
                                   rows, sm_scale=sm_scale, length=length))
    out = jnp.concatenate([o[0] for o in outs], axis=3)
    lse = jnp.concatenate([o[1] for o in outs], axis=3)
    r = jnp.concatenate([o[2] for o in outs], axis=3)
    first_full = jnp.stack([jnp.sum(o[3]) for o in outs])
    b, hkv, g, padded, d = out.shape
    result = out.transpose(0, 3, 1, 2, 4).reshape(b, padded, hkv * g, d)[:, :length].astype(q.dtype)
    return result, (q, k, v, kg, pos_emb, out, lse, r, first_full)


def _backward(sm_scale, block_k, block_q, residuals, dout):
    q, k, v, kg, pos_emb, out, lse, r, first_full = residuals
    length = q.shape[1]
    size = min(block_k, length)
    qg, kt, vt, kgt, e = _grouped(q, k, v, kg, pos_emb, size)
    do = _grouped(dout, k, v, kg, pos_emb, size)[0]
    z = _position_logits(qg, e)
    delta = jnp.sum(out * do, axis=-1)
    blocks = tuple(_key_blocks(x, size) for x in (kt, vt, kgt))
    dq_parts, dz_parts = [], []
    dkv = [jnp.zeros_like(x) for x in blocks]
    for c, (r0, r1) in enumerate(_chunks(qg.shape[3], size, block_q)):
        rows = slice(r0, r1)
        dq, dz, *dkv_c = _chunk_backward(
            qg[:, :, :, rows], z[:, :, :, rows], do[:, :, :, rows], lse[:, :, :, rows], delta[:, :, :, rows],
            r[:, :, :, rows], first_full[c], tuple(x[:r1 // size] for x in blocks), jnp.arange(r0, r1),
            sm_scale=sm_scale)
        dkv = [total.at[:r1 // size].add(part) for total, part in zip(dkv, dkv_c)]
        dq_parts.append(dq)
        dz_parts.append(dz)
    dq, dz = jnp.concatenate(dq_parts, axis=3), jnp.concatenate(dz_parts, axis=3)
    if e.ndim == 2:
        dq = dq + jnp.einsum("bhglp,pd->bhgld", dz, e)
        de = jnp.einsum("bhglp,bhgld->pd", dz, qg)
    else:
        dq = dq + jnp.einsum("bhglp,hgpd->bhgld", dz, e)
        de = jnp.einsum("bhglp,bhgld->hgpd", dz, qg).reshape(pos_emb.shape)
    b, hkv, g, padded, d = dq.shape
    dq = dq.transpose(0, 3, 1, 2, 4).reshape(b, padded, hkv * g, d)[:, :length]
    dk, dv, dkg = (x.transpose(1, 0, 3, 2, 4).reshape(b, padded, hkv, d)[:, :length] for x in dkv)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dkg.astype(kg.dtype),
            de.astype(pos_emb.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _cope_blockwise(q, k, v, kg, pos_emb, sm_scale, block_k, block_q):
    return _forward(q, k, v, kg, pos_emb, sm_scale, block_k, block_q)[0]


_cope_blockwise.defvjp(_forward, _backward)


def check_cope_inputs(q: jax.Array, k: jax.Array, v: jax.Array, pos_emb: jax.Array, gate_k: jax.Array | None,
                      sm_scale: float) -> None:
    """Shapes and dtypes for the CoPE kernels: q [B, L, Hq, D], k/v/gate_k [B, L, Hkv, D],
    pos_emb [P, D] or [Hq, P, D] with P >= 2."""
    for name, x in (("q", q), ("k", k), ("v", v), ("pos_emb", pos_emb)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating point, got {name}.dtype={x.dtype}")
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"q, k, v must be [B, L, H, D] with k.shape == v.shape, got {q.shape=}, {k.shape=}, "
                         f"{v.shape=}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q [B, L, Hq, D] and k [B, L, Hkv, D] must share B, L, D with Hkv dividing Hq, got "
                         f"{q.shape=}, {k.shape=}")
    if gate_k is not None and gate_k.shape != k.shape:
        raise ValueError(f"gate_k must have k's shape {k.shape}, got {gate_k.shape=}")
    hq, d = q.shape[2], q.shape[3]
    if pos_emb.shape[-1:] != (d,) or pos_emb.ndim not in (2, 3) or (pos_emb.ndim == 3 and pos_emb.shape[0] != hq):
        raise ValueError(f"pos_emb must be [npos, {d}] or [{hq}, npos, {d}], got {pos_emb.shape=}")
    if pos_emb.shape[-2] < 2:
        raise ValueError(f"npos={pos_emb.shape[-2]} must be >= 2")
    if not sm_scale > 0:
        raise ValueError(f"{sm_scale=} must be > 0")


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_k", "block_q"))
def cope_attention_blockwise(q: jax.Array, k: jax.Array, v: jax.Array, pos_emb: jax.Array,
                             gate_k: jax.Array | None = None, *, sm_scale: float, block_k: int = 128,
                             block_q: int = 512) -> jax.Array:
    """Causal CoPE attention in O(L·block) memory, differentiable (custom VJP).

    q [B, L, Hq, D], k/v [B, L, Hkv, D] (Hkv divides Hq), pos_emb [npos, D] or [Hq, npos, D],
    gate_k [B, L, Hkv, D] or None (gates from k) -> [B, L, Hq, D] in q's dtype.
    block_k: keys per scan step; block_q: query rows per chunk (rounded to a multiple of block_k).
    """
    check_cope_inputs(q, k, v, pos_emb, gate_k, sm_scale)
    if block_k < 1 or block_q < 1:
        raise ValueError(f"{block_k=} and {block_q=} must be >= 1")
    kg = k if gate_k is None else gate_k
    return _cope_blockwise(q, k, v, kg, pos_emb, float(sm_scale), block_k, block_q)
