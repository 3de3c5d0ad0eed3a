"""Fused Co-RoPE attention in Pallas (Triton lowering on GPU, interpret mode on CPU): causal, GQA, fwd + bwd.

B batch, L length, Hq query heads, Hkv key/value heads, G = Hq // Hkv, D head dim, Dh = D/2 rotary pairs.
Tiles: BQ query rows × BK keys × BD rotary pairs. One program instance owns one GQA group (G query heads, one
k/v head), so the mileage Δ and its cos/sin are computed once per tile and reused by every head of the group.

Maths (SPEC §3): z_ij = sigmoid(sm_scale·q^leader_i·k_j) (j ≤ i), Δ_ij = Σ_{t=j+1..i} z_it, φ_ijd = Δ_ij·ω_d.
With the rotated keys kc = k1 cos φ + k2 sin φ, ks = k2 cos φ − k1 sin φ ([BQ, BK, BD] per chunk, per group),
score_ij = sm_scale·Σ_d (q1·kc + q2·ks) — elementwise work, not a matmul — and ∂kc/∂φ = ks, ∂ks/∂φ = −kc.

Kernels:
- forward, grid (L/BQ, B, Hkv): walks key blocks in reverse from the diagonal carrying the per-row suffix sum of z
  (one pass, causal early exit), online softmax; writes o and the per-row logsumexp.
- dq, grid (L/BQ, B, Hkv): the same reverse walk; dΔ_ij = sm_scale·Σ_d ω_d Σ_h dS^h (q1^h ks − q2^h kc); the
  gate gradient dz_it = Σ_{j<t} dΔ_ij = Tot_i − Suf_it with Suf_it = Σ_{j≥t} dΔ_ij carried and Tot_i known at
  the end, so dq^leader gets sm_scale·(Tot_i·Σ_t z'_it k_t − Σ_t Suf_it z'_it k_t) from one pass. It also
  writes, for every (key block, row), the carried suffix sums of z and of dΔ at that block's right edge, and Tot.
- dk/dv, grid (L/BK, B, Hkv): walks query blocks from the diagonal down; rebuilds Δ and dz from those carries.
Memory: O(L) per head for o, lse; the backward's carries are [B, Hkv, L/BK, L] float32 (1/BK of an L×L
array); no L×L or L×L×D tensor exists anywhere.

Triton restrictions respected: block sizes powers of two ≥ 16, no reverse cumsum (rowtotal − cumsum), no
gathers, no slicing or concatenation of in-register tiles (the head dim is processed in BD-wide chunks loaded
straight from the refs), static shapes; the head dim's halves are zero-padded to a power of two outside.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxpe.kernels._common import check_head_dim
from jaxpe.kernels.corope_blockwise import check_corope_inputs

_CompilerParams = getattr(pltriton, "CompilerParams", None) or pltriton.TritonCompilerParams
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _is_power_of_two_at_least_16(n: int) -> bool:
    return isinstance(n, int) and n >= 16 and n & (n - 1) == 0


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

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not _is_power_of_two_at_least_16(value):
                raise ValueError(f"BlockSizes.{field.name}={value!r} must be a power of two >= 16")


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _sigmoid(x: jax.Array) -> jax.Array:
    """The logistic function from exp and divide (Triton has no logistic lowering)."""
    return 1.0 / (1.0 + jnp.exp(-x))


def _mm(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False, exact: bool = False
        ) -> jax.Array:
    """a @ b with float32 accumulation; `exact` asks for IEEE float32 products (no TF32) for float32 inputs."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    precision = lax.Precision.HIGHEST if exact else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _omega(lo: int, block_d: int, head_dim: int, theta: float) -> jax.Array:
    """ω [BD] for rotary pairs lo..lo+BD−1, ω_d = θ^(−2d/D) (pairs past D/2 are zero padding; any ω works)."""
    d = (lo + lax.broadcasted_iota(jnp.int32, (block_d,), 0)).astype(jnp.float32)
    return jnp.exp(d * (-2.0 * math.log(theta) / head_dim))


def _gates(q_lead: jax.Array, k: jax.Array, rows: jax.Array, cols: jax.Array, sm_scale: float
           ) -> tuple[jax.Array, jax.Array]:
    """q_lead [BQ, Dp], k [BK, Dp] -> causal gates z [BQ, BK] (0 above the diagonal) and the mask."""
    mask = cols[None, :] <= rows[:, None]
    z = _sigmoid(sm_scale * _mm(q_lead, k, trans_b=True, exact=True))
    return jnp.where(mask, z, 0.0), mask


def _suffix_exclusive(x: jax.Array) -> jax.Array:
    """[BQ, BK] -> Σ_{t>j} x[:, t], as rowtotal − cumsum (Triton cannot lower a reverse cumsum)."""
    return jnp.sum(x, axis=1, keepdims=True) - jnp.cumsum(x, axis=1)


Loader = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Static shape facts shared by the three kernels."""

    groups: int  # G, query heads per program
    half: int  # padded D/2 (power of two)
    block_d: int
    head_dim: int  # the caller's D (for ω)
    theta: float
    sm_scale: float

    @property
    def chunks(self) -> range:
        return range(0, self.half, self.block_d)


def _rotate(delta: jax.Array, load_k: Loader, lo: int, geo: _Geometry
            ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """One chunk: ω [BD], cos φ, sin φ, kc, ks [BQ, BK, BD] for delta [BQ, BK]."""
    omega = _omega(lo, geo.block_d, geo.head_dim, geo.theta)
    phi = delta[:, :, None] * omega[None, None, :]
    cos, sin = jnp.cos(phi), jnp.sin(phi)
    k1, k2 = load_k(lo)[None], load_k(geo.half + lo)[None]  # [1, BK, BD]
    return omega, cos, sin, k1 * cos + k2 * sin, k2 * cos - k1 * sin


def _scores(delta: jax.Array, load_q: Loader, load_k: Loader, geo: _Geometry) -> list[jax.Array]:
    """G scores [BQ, BK] = sm_scale·Σ_d (q1·kc + q2·ks); the trig is shared by the heads of the group."""
    scores = [jnp.zeros(delta.shape, jnp.float32) for _ in range(geo.groups)]
    for lo in geo.chunks:
        _, _, _, kc, ks = _rotate(delta, load_k, lo, geo)
        for r in range(geo.groups):
            q1, q2 = load_q(r, lo)[:, None, :], load_q(r, geo.half + lo)[:, None, :]
            scores[r] = scores[r] + jnp.sum(q1 * kc + q2 * ks, axis=2)
    return [geo.sm_scale * s for s in scores]


def _softmax_grads(scores: list[jax.Array], mask: jax.Array, lse: list[jax.Array], row_dot: list[jax.Array],
                   do: list[jax.Array], v: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
    """Per head: P = exp(S − lse) and dS = P·(dO·vᵀ − Σ_d dO·O), each [BQ, BK]."""
    p = [jnp.where(mask, jnp.exp(s - m[:, None]), 0.0) for s, m in zip(scores, lse)]
    ds = [pr * (_mm(dor, v, trans_b=True) - rd[:, None]) for pr, dor, rd in zip(p, do, row_dot)]
    return p, ds


def _rotary_backward(delta: jax.Array, ds: list[jax.Array], load_q: Loader, load_k: Loader, geo: _Geometry,
                     *, wrt_q: bool) -> tuple[list, jax.Array]:
    """Back through the scores of one tile.

    Returns per chunk either (wrt_q) per head (dq1, dq2) [BQ, BD], or (dk1, dk2) [BK, BD]; and dΔ [BQ, BK].
    """
    grads, d_delta = [], jnp.zeros(delta.shape, jnp.float32)
    for lo in geo.chunks:
        omega, cos, sin, kc, ks = _rotate(delta, load_k, lo, geo)
        dsq1 = jnp.zeros(kc.shape, jnp.float32)  # Σ_h dS^h q1^h, [BQ, BK, BD]
        dsq2 = jnp.zeros(kc.shape, jnp.float32)
        per_head = []
        for r in range(geo.groups):
            dsr = ds[r][:, :, None]
            if wrt_q:
                per_head.append((jnp.sum(dsr * kc, axis=1), jnp.sum(dsr * ks, axis=1)))
            dsq1 = dsq1 + dsr * load_q(r, lo)[:, None, :]
            dsq2 = dsq2 + dsr * load_q(r, geo.half + lo)[:, None, :]
        if wrt_q:
            grads.append(per_head)
        else:
            grads.append((jnp.sum(dsq1 * cos - dsq2 * sin, axis=0), jnp.sum(dsq1 * sin + dsq2 * cos, axis=0)))
        d_delta = d_delta + jnp.sum((dsq1 * ks - dsq2 * kc) * omega[None, None, :], axis=2)
    return grads, geo.sm_scale * d_delta


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, geo: _Geometry, block_q: int, block_k: int):
    """q_ref [BQ, G, Dp], k_ref/v_ref [Lp, Dp] -> o_ref [BQ, G, Dp], lse_ref [G, BQ]."""
    qb = pl.program_id(0)
    rows = qb * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    load_q = lambda r, lo: q_ref[:, r, pl.ds(lo, geo.block_d)].astype(jnp.float32)
    last_kb = lax.div((qb + 1) * block_q - 1, block_k)

    def body(step, carry):
        z_suffix, m, l, acc = carry  # [BQ]; G × [BQ]; G × [BQ]; G × [BQ, Dp]
        kb = last_kb - step
        keys = pl.ds(kb * block_k, block_k)
        cols = kb * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        load_k = lambda lo: k_ref[keys, pl.ds(lo, geo.block_d)].astype(jnp.float32)
        z, mask = _gates(q_ref[:, 0, :], k_ref[keys, :], rows, cols, geo.sm_scale)
        delta = z_suffix[:, None] + _suffix_exclusive(z)  # [BQ, BK]
        scores = _scores(delta, load_q, load_k, geo)
        v = v_ref[keys, :]
        new_m, new_l, new_acc = [], [], []
        for r in range(geo.groups):
            s = jnp.where(mask, scores[r], _MASK_VALUE)
            m_r = jnp.maximum(m[r], jnp.max(s, axis=1))
            p = jnp.exp(s - m_r[:, None])
            correction = jnp.exp(m[r] - m_r)
            new_m.append(m_r)
            new_l.append(correction * l[r] + jnp.sum(p, axis=1))
            new_acc.append(correction[:, None] * acc[r] + _mm(p.astype(v.dtype), v))
        return z_suffix + jnp.sum(z, axis=1), new_m, new_l, new_acc

    g, dp = geo.groups, o_ref.shape[-1]
    init = (jnp.zeros((block_q,), jnp.float32), [jnp.full((block_q,), -jnp.inf, jnp.float32)] * g,
            [jnp.zeros((block_q,), jnp.float32)] * g, [jnp.zeros((block_q, dp), jnp.float32)] * g)
    _, m, l, acc = lax.fori_loop(0, last_kb + 1, body, init)
    for r in range(g):
        o_ref[:, r, :] = (acc[r] / l[r][:, None]).astype(o_ref.dtype)
        lse_ref[r, :] = m[r] + jnp.log(l[r])


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, row_dot_ref,
               dq_ref, z_carry_ref, dd_carry_ref, dd_total_ref, *, geo: _Geometry, block_q: int, block_k: int):
    """q_ref/do_ref [BQ, G, Dp], k_ref/v_ref [Lp, Dp], lse_ref/row_dot_ref [G, BQ] ->
    dq_ref [BQ, G, Dp], z_carry_ref/dd_carry_ref [L/BK, BQ] (suffix sums right of each key block), dd_total_ref [BQ].
    """
    qb = pl.program_id(0)
    rows = qb * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    load_q = lambda r, lo: q_ref[:, r, pl.ds(lo, geo.block_d)].astype(jnp.float32)
    q_lead = q_ref[:, 0, :]
    do = [do_ref[:, r, :] for r in range(geo.groups)]
    lse = [lse_ref[r, :] for r in range(geo.groups)]
    row_dot = [row_dot_ref[r, :] for r in range(geo.groups)]
    last_kb = lax.div((qb + 1) * block_q - 1, block_k)

    def body(step, carry):
        z_suffix, dd_suffix, dq, dq_gate_total, dq_gate_suffix = carry
        kb = last_kb - step
        z_carry_ref[kb, :] = z_suffix
        dd_carry_ref[kb, :] = dd_suffix
        keys = pl.ds(kb * block_k, block_k)
        cols = kb * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        load_k = lambda lo: k_ref[keys, pl.ds(lo, geo.block_d)].astype(jnp.float32)
        z, mask = _gates(q_lead, k_ref[keys, :], rows, cols, geo.sm_scale)
        delta = z_suffix[:, None] + _suffix_exclusive(z)
        _, ds = _softmax_grads(_scores(delta, load_q, load_k, geo), mask, lse, row_dot, do, v_ref[keys, :])
        grads, d_delta = _rotary_backward(delta, ds, load_q, load_k, geo, wrt_q=True)
        dq = [[(a1 + g1, a2 + g2) for (a1, a2), (g1, g2) in zip(acc_c, grad_c)] for acc_c, grad_c in zip(dq, grads)]
        suffix = dd_suffix[:, None] + _suffix_exclusive(d_delta) + d_delta  # Σ_{j≥t} dΔ_ij, [BQ, BK]
        z_slope = z * (1.0 - z)  # dz/dlogit, 0 above the diagonal
        suffix_slope = suffix * z_slope
        dq_gate_total = [(t1 + _mm(z_slope, load_k(lo)), t2 + _mm(z_slope, load_k(geo.half + lo)))
                         for (t1, t2), lo in zip(dq_gate_total, geo.chunks)]
        dq_gate_suffix = [(s1 + _mm(suffix_slope, load_k(lo)), s2 + _mm(suffix_slope, load_k(geo.half + lo)))
                          for (s1, s2), lo in zip(dq_gate_suffix, geo.chunks)]
        return (z_suffix + jnp.sum(z, axis=1), dd_suffix + jnp.sum(d_delta, axis=1), dq,
                dq_gate_total, dq_gate_suffix)

    row = jnp.zeros((block_q,), jnp.float32)
    chunk = jnp.zeros((block_q, geo.block_d), jnp.float32)
    pairs = [(chunk, chunk) for _ in geo.chunks]
    init = (row, row, [[(chunk, chunk)] * geo.groups for _ in geo.chunks], pairs, pairs)
    _, dd_total, dq, dq_gate_total, dq_gate_suffix = lax.fori_loop(0, last_kb + 1, body, init)
    dd_total_ref[...] = dd_total
    for c, lo in enumerate(geo.chunks):
        for r in range(geo.groups):
            dq1, dq2 = dq[c][r]
            if r == 0:  # the leader's gates: dz_it = Tot_i − Suf_it
                (t1, t2), (s1, s2) = dq_gate_total[c], dq_gate_suffix[c]
                dq1 = dq1 + dd_total[:, None] * t1 - s1
                dq2 = dq2 + dd_total[:, None] * t2 - s2
            dq_ref[:, r, pl.ds(lo, geo.block_d)] = (geo.sm_scale * dq1).astype(dq_ref.dtype)
            dq_ref[:, r, pl.ds(geo.half + lo, geo.block_d)] = (geo.sm_scale * dq2).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, row_dot_ref, z_carry_ref, dd_carry_ref, dd_total_ref,
                dk_ref, dv_ref, *, geo: _Geometry, block_q: int, block_k: int):
    """q_ref/do_ref [Lp, G, Dp], k_ref/v_ref [BK, Dp], lse_ref/row_dot_ref [G, Lp],
    z_carry_ref/dd_carry_ref [L/BK, Lp], dd_total_ref [Lp] -> dk_ref/dv_ref [BK, Dp]."""
    kb = pl.program_id(0)
    cols = kb * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    load_k = lambda lo: k_ref[:, pl.ds(lo, geo.block_d)].astype(jnp.float32)
    k, v = k_ref[...], v_ref[...]
    first_qb = lax.div(kb * block_k, block_q)

    def body(qb, carry):
        dk, dv = carry
        span = pl.ds(qb * block_q, block_q)
        rows = qb * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
        load_q = lambda r, lo: q_ref[span, r, pl.ds(lo, geo.block_d)].astype(jnp.float32)
        q_lead = q_ref[span, 0, :]
        do = [do_ref[span, r, :] for r in range(geo.groups)]
        z, mask = _gates(q_lead, k, rows, cols, geo.sm_scale)
        delta = z_carry_ref[kb, span][:, None] + _suffix_exclusive(z)
        p, ds = _softmax_grads(_scores(delta, load_q, load_k, geo), mask,
                               [lse_ref[r, span] for r in range(geo.groups)],
                               [row_dot_ref[r, span] for r in range(geo.groups)], do, v)
        for pr, dor in zip(p, do):
            dv = dv + _mm(pr.astype(dor.dtype), dor, trans_a=True)
        grads, d_delta = _rotary_backward(delta, ds, load_q, load_k, geo, wrt_q=False)
        suffix = dd_carry_ref[kb, span][:, None] + _suffix_exclusive(d_delta) + d_delta  # Σ_{j≥t} dΔ_ij
        d_logit = (dd_total_ref[span][:, None] - suffix) * z * (1.0 - z)  # dz_it·z'_it, [BQ, BK]
        dk = [(a1 + g1 + _mm(d_logit, load_q(0, lo), trans_a=True),
               a2 + g2 + _mm(d_logit, load_q(0, geo.half + lo), trans_a=True))
              for (a1, a2), (g1, g2), lo in zip(dk, grads, geo.chunks)]
        return dk, dv

    chunk = jnp.zeros((block_k, geo.block_d), jnp.float32)
    init = ([(chunk, chunk) for _ in geo.chunks], jnp.zeros(dv_ref.shape, jnp.float32))
    dk, dv = lax.fori_loop(first_qb, pl.cdiv(q_ref.shape[0], block_q), body, init)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    for (dk1, dk2), lo in zip(dk, geo.chunks):
        dk_ref[:, pl.ds(lo, geo.block_d)] = (geo.sm_scale * dk1).astype(dk_ref.dtype)
        dk_ref[:, pl.ds(geo.half + lo, geo.block_d)] = (geo.sm_scale * dk2).astype(dk_ref.dtype)


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static settings of one call (hashable: a jit static argument and the custom_vjp's non-diff argument)."""

    theta: float
    sm_scale: float
    block_sizes: BlockSizes
    interpret: bool
    num_warps: int | None
    num_stages: int | None


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Block sizes fitted to one problem: padded length Lp, padded half head dim, tiles."""

    length: int  # Lp, a multiple of every block
    half: int  # padded D/2, a power of two ≥ 16
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    geo: _Geometry


def _plan(length: int, d: int, groups: int, cfg: _Config) -> _Plan:
    half = max(16, _next_power_of_two(d // 2))
    cap = max(16, _next_power_of_two(length))
    bs = cfg.block_sizes
    blocks = [min(b, cap) for b in (bs.block_q, bs.block_k, bs.block_q_bwd, bs.block_k_bwd)]
    padded = -(-length // max(blocks)) * max(blocks)
    geo = _Geometry(groups=groups, half=half, block_d=min(bs.block_d, half), head_dim=d,
                    theta=cfg.theta, sm_scale=cfg.sm_scale)
    return _Plan(padded, half, *blocks, geo=geo)


def _pad(x: jax.Array, plan: _Plan) -> jax.Array:
    """[B, L, H, D] -> [B, Lp, H, 2·half]: zero rows at the end, each rotary half zero-padded to `half`."""
    pad = [(0, 0), (0, plan.length - x.shape[1]), (0, 0), (0, plan.half - x.shape[3] // 2)]
    return jnp.concatenate([jnp.pad(h, pad) for h in jnp.split(x, 2, axis=-1)], axis=-1)


def _unpad(x: jax.Array, length: int, head_dim: int) -> jax.Array:
    """Inverse of `_pad`: [B, Lp, H, 2·half] -> [B, L, H, D]."""
    half = x.shape[3] // 2
    return jnp.concatenate([x[:, :length, :, : head_dim // 2], x[:, :length, :, half: half + head_dim // 2]], -1)


def _compiler_params(cfg: _Config, tile: int):
    num_warps = cfg.num_warps if cfg.num_warps is not None else (4 if tile <= 32 * 32 else 8)
    num_stages = cfg.num_stages if cfg.num_stages is not None else 2
    return _CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, plan: _Plan, cfg: _Config) -> tuple[jax.Array, jax.Array]:
    """Padded q [B, Lp, Hq, Dp], k/v [B, Lp, Hkv, Dp] -> o [B, Lp, Hq, Dp], lse [B, Hq, Lp] float32."""
    b, lp, hq, dp = q.shape
    g, bq = plan.geo.groups, plan.block_q
    group_rows = pl.BlockSpec((None, bq, g, dp), lambda i, n, h: (n, i, h, 0))
    kv_all = pl.BlockSpec((None, lp, None, dp), lambda i, n, h: (n, 0, h, 0))
    return pl.pallas_call(
        functools.partial(_forward_kernel, geo=plan.geo, block_q=bq, block_k=plan.block_k),
        grid=(lp // bq, b, k.shape[2]),
        in_specs=[group_rows, kv_all, kv_all],
        out_specs=[group_rows, pl.BlockSpec((None, g, bq), lambda i, n, h: (n, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, lp), jnp.float32)],
        compiler_params=_compiler_params(cfg, bq * plan.block_k),
        interpret=cfg.interpret,
        name="corope_forward",
    )(q, k, v)


def _backward(q, k, v, o, lse, do, plan: _Plan, cfg: _Config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Padded residuals and do [B, Lp, Hq, Dp] -> padded dq, dk, dv (dq kernel, then dk/dv kernel)."""
    b, lp, hq, dp = q.shape
    hkv = k.shape[2]
    g, bq, bk = plan.geo.groups, plan.block_q_bwd, plan.block_k_bwd
    n_kb = lp // bk
    row_dot = jnp.einsum("blhd,blhd->bhl", o.astype(jnp.float32), do.astype(jnp.float32))  # Σ_d dO·O
    params = _compiler_params(cfg, bq * bk)

    group_rows = pl.BlockSpec((None, bq, g, dp), lambda i, n, h: (n, i, h, 0))
    group_stats = pl.BlockSpec((None, g, bq), lambda i, n, h: (n, h, i))
    kv_all = pl.BlockSpec((None, lp, None, dp), lambda i, n, h: (n, 0, h, 0))
    carries = pl.BlockSpec((None, None, n_kb, bq), lambda i, n, h: (n, h, 0, i))
    carry_shape = jax.ShapeDtypeStruct((b, hkv, n_kb, lp), jnp.float32)
    dq, z_carry, dd_carry, dd_total = pl.pallas_call(
        functools.partial(_dq_kernel, geo=plan.geo, block_q=bq, block_k=bk),
        grid=(lp // bq, b, hkv),
        in_specs=[group_rows, kv_all, kv_all, group_rows, group_stats, group_stats],
        out_specs=[group_rows, carries, carries, pl.BlockSpec((None, None, bq), lambda i, n, h: (n, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), carry_shape, carry_shape,
                   jax.ShapeDtypeStruct((b, hkv, lp), jnp.float32)],
        compiler_params=params,
        interpret=cfg.interpret,
        name="corope_backward_dq",
    )(q, k, v, do, lse, row_dot)

    group_all = pl.BlockSpec((None, lp, g, dp), lambda i, n, h: (n, 0, h, 0))
    stats_all = pl.BlockSpec((None, g, lp), lambda i, n, h: (n, h, 0))
    carries_all = pl.BlockSpec((None, None, n_kb, lp), lambda i, n, h: (n, h, 0, 0))
    kv_block = pl.BlockSpec((None, bk, None, dp), lambda i, n, h: (n, i, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, geo=plan.geo, block_q=bq, block_k=bk),
        grid=(n_kb, b, hkv),
        in_specs=[group_all, kv_block, kv_block, group_all, stats_all, stats_all, carries_all, carries_all,
                  pl.BlockSpec((None, None, lp), lambda i, n, h: (n, h, 0))],
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params,
        interpret=cfg.interpret,
        name="corope_backward_dkv",
    )(q, k, v, do, lse, row_dot, z_carry, dd_carry, dd_total)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _corope(q: jax.Array, k: jax.Array, v: jax.Array, cfg: _Config) -> jax.Array:
    return _corope_fwd(q, k, v, cfg)[0]


def _corope_fwd(q, k, v, cfg: _Config):
    plan = _plan(q.shape[1], q.shape[3], q.shape[2] // k.shape[2], cfg)
    qp, kp, vp = (_pad(x, plan) for x in (q, k, v))
    o, lse = _forward(qp, kp, vp, plan, cfg)
    return _unpad(o, q.shape[1], q.shape[3]), (qp, kp, vp, o, lse)


def _corope_bwd(cfg: _Config, residuals, do):
    qp, kp, vp, o, lse = residuals
    length, d = do.shape[1], do.shape[3]
    plan = _plan(length, d, qp.shape[2] // kp.shape[2], cfg)
    grads = _backward(qp, kp, vp, o, lse, _pad(do.astype(o.dtype), plan), plan, cfg)
    return tuple(_unpad(x, length, d) for x in grads)


_corope.defvjp(_corope_fwd, _corope_bwd)
_corope_jit = jax.jit(_corope, static_argnums=(3,))


def corope_attention_pallas(q: jax.Array, k: jax.Array, v: jax.Array, *, theta: float, sm_scale: float,
                            block_sizes: BlockSizes | None = None, interpret: bool | None = None,
                            num_warps: int | None = None, num_stages: int | None = None) -> jax.Array:
    """Fused causal Co-RoPE attention. q [B, L, Hq, D], k/v [B, L, Hkv, D] (float32 or bfloat16) -> [B, L, Hq, D].

    Differentiable (fused dq and dk/dv kernels). interpret defaults to True off GPU (Pallas interpreter);
    num_warps/num_stages tune the Triton lowering (defaults: 4 or 8 warps by tile size, 2 stages).
    """
    check_corope_inputs(q, k, v, theta=theta, sm_scale=sm_scale)
    check_head_dim(q.shape[3])
    if block_sizes is None:
        block_sizes = BlockSizes()
    if not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes, got {type(block_sizes).__name__}")
    for name, value in (("num_warps", num_warps), ("num_stages", num_stages)):
        if value is not None and not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name}={value!r} must be a positive int or None")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    cfg = _Config(float(theta), float(sm_scale), block_sizes, bool(interpret), num_warps, num_stages)
    return _corope_jit(q, k, v, cfg)
