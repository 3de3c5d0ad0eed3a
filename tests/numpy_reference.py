"""An independent float64 NumPy restatement of every encoding, written from the papers and the official code, not
from jaxpe.

Sources:
- sinusoidal: Vaswani et al., "Attention Is All You Need", arXiv:1706.03762 (section 3.5).
- RoPE: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", arXiv:2104.09864 (half-split
  pairs (d, d + D/2), as in GPT-NeoX and Hugging Face models).
- ALiBi: Press et al., "Train Short, Test Long", arXiv:2108.12409 (slopes 2^(−8h/H)).
- relative logits: Shaw et al., "Self-Attention with Relative Position Representations", arXiv:1803.02155, computed
  as q_i·r[i − j] as in Huang et al., "Music Transformer", arXiv:1809.04281.
- CoPE: Golovneva et al., "Contextual Position Encoding", arXiv:2405.18719, and the official code, github
  facebookresearch/RAM, projects/cope.
- Co-RoPE: github Superposition09m/Co-RoPE, corope-exp/corope_attn_gqa_pytorch.py (leader-head mileage under GQA).
- forgetting attention: Lin et al., "Forgetting Transformer: Softmax Attention with a Forget Gate", arXiv:2503.02130.
- stick-breaking attention: Tan et al., "Scaling Stick-Breaking Attention", arXiv:2410.17980.
- AM-SPE and the CoPE gate network: this repository's own encodings, restated from the definitions in the docstrings
  of jaxpe/amspe.py and jaxpe/cope_gated.py.

Loops over (batch, head, query, key) on purpose: each line should read like the formula it restates.
Shapes: B batch, L length, Hq query heads, Hkv key/value heads (G = Hq // Hkv, query head h reads kv head h // G),
D head dim, npos position-table rows. Causal throughout: query i sees keys j <= i.
"""
from __future__ import annotations

import itertools
import math

import numpy as np


def sigmoid(x: np.ndarray | float) -> np.ndarray | float:
    return 1.0 / (1.0 + np.exp(-x))


# --- additive encodings ------------------------------------------------------------------------------------------

def sinusoidal_table(length: int, dim: int, *, theta: float = 10000.0, scale: float = 1.0) -> np.ndarray:
    """[length, dim]: PE[i, 2k] = sin(scale·i·θ^(−2k/dim)), PE[i, 2k+1] = cos(same); odd dim has no last cos."""
    table = np.zeros((length, dim))
    for i in range(length):
        for col in range(dim):
            k = col // 2
            angle = scale * i * theta ** (-2.0 * k / dim)
            table[i, col] = math.sin(angle) if col % 2 == 0 else math.cos(angle)
    return table


def amspe(x: np.ndarray, alpha_param: float, *, detail_level: float = 0.5, coarse_scale: float = 10.0) -> np.ndarray:
    """x [B, L, d] -> x + α·coarse[:L] + (1 − α)·detail_level·detail[:L], α = sigmoid(alpha_param)."""
    length, dim = x.shape[1], x.shape[2]
    alpha = sigmoid(alpha_param)
    coarse = sinusoidal_table(length, dim, scale=coarse_scale)
    detail = sinusoidal_table(length, dim)
    return x + (alpha * coarse + (1.0 - alpha) * detail_level * detail)[None]


# --- rotary ------------------------------------------------------------------------------------------------------

def rope(x: np.ndarray, positions: np.ndarray, *, theta: float = 10000.0, omega_scale: float = 1.0) -> np.ndarray:
    """x [B, L, H, D], positions [B, L] or [L]: rotate the pair (d, d + D/2) by position·ω_d, ω_d = c·θ^(−2d/D)."""
    b, length, heads, dim = x.shape
    positions = np.broadcast_to(np.asarray(positions, np.float64), (b, length))
    half = dim // 2
    out = np.zeros(x.shape)
    for bi in range(b):
        for i in range(length):
            for d in range(half):
                angle = positions[bi, i] * omega_scale * theta ** (-2.0 * d / dim)
                c, s = math.cos(angle), math.sin(angle)
                for h in range(heads):
                    x1, x2 = x[bi, i, h, d], x[bi, i, h, d + half]
                    out[bi, i, h, d] = x1 * c - x2 * s
                    out[bi, i, h, d + half] = x2 * c + x1 * s
    return out


# --- attention ---------------------------------------------------------------------------------------------------

def causal_attention(logits: np.ndarray, v: np.ndarray) -> np.ndarray:
    """logits [B, Hq, L, L] (already scaled, any bias included), v [B, L, Hkv, D] -> [B, L, Hq, D], causal softmax."""
    b, hq, length, _ = logits.shape
    groups = hq // v.shape[2]
    out = np.zeros((b, length, hq, v.shape[3]))
    for bi in range(b):
        for h in range(hq):
            for i in range(length):
                row = logits[bi, h, i, : i + 1]
                p = np.exp(row - row.max())
                p /= p.sum()
                out[bi, i, h] = p @ v[bi, : i + 1, h // groups]
    return out


def dot_logits(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """q [B, L, Hq, D], k [B, L, Hkv, D] -> q_i·k_j [B, Hq, L, L] with GQA (query head h reads kv head h // G)."""
    groups = q.shape[2] // k.shape[2]
    return np.array([[[[q[bi, i, h] @ k[bi, j, h // groups] for j in range(k.shape[1])]
                       for i in range(q.shape[1])]
                      for h in range(q.shape[2])]
                     for bi in range(q.shape[0])])


def softmax_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, sm_scale: float | None = None,
                      bias: np.ndarray | None = None) -> np.ndarray:
    """Causal attention softmax(sm_scale·q·k + bias) v; bias [B|1, Hq, L, L] is added after scaling."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    logits = sm_scale * dot_logits(q, k)
    if bias is not None:
        logits = logits + bias
    return causal_attention(logits, v)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """[H]: 2^(−8h/H) for h = 1..H."""
    return np.array([2.0 ** (-8.0 * h / num_heads) for h in range(1, num_heads + 1)])


def alibi_bias(q_pos: np.ndarray, k_len: int, num_heads: int) -> np.ndarray:
    """q_pos [B, Lq] -> [B, H, Lq, Lk] = −slope_h·(i − j)."""
    slopes = alibi_slopes(num_heads)
    b, lq = q_pos.shape
    out = np.zeros((b, num_heads, lq, k_len))
    for bi in range(b):
        for h in range(num_heads):
            for qi in range(lq):
                for j in range(k_len):
                    out[bi, h, qi, j] = -slopes[h] * (q_pos[bi, qi] - j)
    return out


def relative_logits(q: np.ndarray, table: np.ndarray, q_pos: np.ndarray, k_len: int) -> np.ndarray:
    """q [B, Lq, H, D], table [npos, D] -> [B, H, Lq, Lk] = q_i·r[min(i − j, npos − 1)] (for j <= i)."""
    b, lq, heads, _ = q.shape
    npos = table.shape[0]
    out = np.zeros((b, heads, lq, k_len))
    for bi in range(b):
        for h in range(heads):
            for qi in range(lq):
                i = q_pos[bi, qi]
                for j in range(min(i + 1, k_len)):
                    out[bi, h, qi, j] = q[bi, qi, h] @ table[min(i - j, npos - 1)]
    return out


# --- CoPE (arXiv:2405.18719) -------------------------------------------------------------------------------------

def cope_positions(q: np.ndarray, k: np.ndarray, *, npos: int, sm_scale: float | None = None,
                   gate_k: np.ndarray | None = None) -> np.ndarray:
    """p [B, Hq, L, L]: p_ij = min(Σ_{t=j..i} sigmoid(sm_scale·q_i·kg_t), npos − 1) for j <= i, 0 above the diagonal."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    kg = k if gate_k is None else gate_k
    b, length, hq, _ = q.shape
    groups = hq // kg.shape[2]
    p = np.zeros((b, hq, length, length))
    for bi in range(b):
        for h in range(hq):
            for i in range(length):
                for j in range(i + 1):
                    total = sum(sigmoid(sm_scale * (q[bi, i, h] @ kg[bi, t, h // groups])) for t in range(j, i + 1))
                    p[bi, h, i, j] = min(total, npos - 1)
    return p


def cope_interpolate(q_row: np.ndarray, table: np.ndarray, p: float) -> float:
    """q_i·e[p] with e linear between rows ⌊p⌋ and ⌈p⌉: (1 − w)·q·e[⌊p⌋] + w·q·e[⌈p⌉], w = p − ⌊p⌋."""
    lo = math.floor(p)
    hi = min(lo + 1, table.shape[0] - 1)
    w = p - lo
    return (1.0 - w) * (q_row @ table[lo]) + w * (q_row @ table[hi])


def cope_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos_emb: np.ndarray, *,
                   sm_scale: float | None = None, gate_k: np.ndarray | None = None,
                   extra_logits: np.ndarray | None = None) -> np.ndarray:
    """CoPE attention [B, L, Hq, D]: softmax(sm_scale·(q_i·k_j + q_i·e[p_ij] + extra)) v.

    pos_emb [npos, D] (shared by the heads) or [Hq, npos, D]; extra_logits [B, Hq, L, L] ("cope+rel").
    """
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    npos = pos_emb.shape[-2]
    p = cope_positions(q, k, npos=npos, sm_scale=sm_scale, gate_k=gate_k)
    logits = dot_logits(q, k)
    b, length, hq, _ = q.shape
    for bi in range(b):
        for h in range(hq):
            table = pos_emb if pos_emb.ndim == 2 else pos_emb[h]
            for i in range(length):
                for j in range(i + 1):
                    logits[bi, h, i, j] += cope_interpolate(q[bi, i, h], table, p[bi, h, i, j])
    if extra_logits is not None:
        logits = logits + extra_logits
    return causal_attention(sm_scale * logits, v)


# --- CoPE gate-network variant (jaxpe/cope_gated.py) -------------------------------------------------------------

def gated_cope_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, x: np.ndarray, *, gate_w: np.ndarray,
                         gate_b: np.ndarray, table: np.ndarray, pos_query: np.ndarray, rope_theta: float | None = None
                         ) -> np.ndarray:
    """Attention with bias (W_q q_i)·e(p_j)/√D, p_j = clip(Σ_{t≤j} sigmoid(x_t W_g + b_g), 0, max_pos − 1).

    x [B, L, d_model], gate_w [d_model, H], gate_b [H], table [max_pos, D], pos_query [D, D] (q_proj = q @ W);
    with rope_theta, q and k are also rotated (the `cope_rope` hybrid; the bias uses the unrotated q).
    """
    b, length, heads, dim = q.shape
    max_pos = table.shape[0]
    bias = np.zeros((b, heads, length, length))
    for bi in range(b):
        for h in range(heads):
            running = 0.0
            emb = np.zeros((length, dim))
            for j in range(length):
                running += sigmoid(x[bi, j] @ gate_w[:, h] + gate_b[h])
                p = min(max(running, 0.0), max_pos - 1)
                lo = math.floor(p)
                hi = min(lo + 1, max_pos - 1)
                emb[j] = (1.0 - (p - lo)) * table[lo] + (p - lo) * table[hi]
            for i in range(length):
                q_proj = q[bi, i, h] @ pos_query
                for j in range(length):
                    bias[bi, h, i, j] = q_proj @ emb[j] / math.sqrt(dim)
    if rope_theta is not None:
        q = rope(q, np.arange(length), theta=rope_theta)
        k = rope(k, np.arange(length), theta=rope_theta)
    return softmax_attention(q, k, v, bias=bias)


# --- Co-RoPE (Superposition09m/Co-RoPE) --------------------------------------------------------------------------

def corope_mileage(q: np.ndarray, k: np.ndarray, *, sm_scale: float | None = None) -> np.ndarray:
    """Δ [B, Hkv, L, L]: Δ_ij = a_ii − a_ij, a_ij = Σ_{t≤j} sigmoid(sm_scale·q^leader_i·k_t), leader = head g·G."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    b, length, hq, _ = q.shape
    hkv = k.shape[2]
    groups = hq // hkv
    delta = np.zeros((b, hkv, length, length))
    for bi in range(b):
        for g in range(hkv):
            leader = q[:, :, g * groups]
            for i in range(length):
                z = [sigmoid(sm_scale * (leader[bi, i] @ k[bi, t, g])) for t in range(i + 1)]
                a = np.cumsum(z)
                for j in range(i + 1):
                    delta[bi, g, i, j] = a[i] - a[j]
    return delta


def corope_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, theta: float = 10000.0,
                     sm_scale: float | None = None, mileage: np.ndarray | None = None,
                     freqs: np.ndarray | None = None) -> np.ndarray:
    """Co-RoPE [B, L, Hq, D]: score_ij = sm_scale·Σ_{d<D/2} (E_A cos φ − E_B sin φ), φ = Δ_ij·ω_d, ω_d = θ^(−2d/D)
    or freqs[d] (freqs [D/2]: scaled RoPE frequencies)."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    if mileage is None:
        mileage = corope_mileage(q, k, sm_scale=sm_scale)
    b, length, hq, dim = q.shape
    half = dim // 2
    groups = hq // k.shape[2]
    scores = np.zeros((b, hq, length, length))
    for bi in range(b):
        for h in range(hq):
            g = h // groups
            for i in range(length):
                q1, q2 = q[bi, i, h, :half], q[bi, i, h, half:]
                for j in range(i + 1):
                    k1, k2 = k[bi, j, g, :half], k[bi, j, g, half:]
                    total = 0.0
                    for d in range(half):
                        omega = theta ** (-2.0 * d / dim) if freqs is None else freqs[d]
                        phi = mileage[bi, g, i, j] * omega
                        e_a = q1[d] * k1[d] + q2[d] * k2[d]
                        e_b = q2[d] * k1[d] - q1[d] * k2[d]
                        total += e_a * math.cos(phi) - e_b * math.sin(phi)
                    scores[bi, h, i, j] = sm_scale * total
    return causal_attention(scores, v)


# --- the rest of the data-dependent family -------------------------------------------------------------------------

def _visible(bi: int, i: int, j: int, *, causal: bool, segment_ids: np.ndarray | None, window: int | None) -> bool:
    """Key j visible to query i: j <= i (when causal), the same document, |i − j| < window."""
    return ((j <= i or not causal) and (segment_ids is None or segment_ids[bi, i] == segment_ids[bi, j])
            and (window is None or abs(i - j) < window))


def forgetting_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, log_fgate: np.ndarray, *,
                         sm_scale: float | None = None, causal: bool = True, segment_ids: np.ndarray | None = None,
                         window: int | None = None) -> np.ndarray:
    """FoX [B, L, Hq, D]: softmax over visible keys of sm_scale·q_i·k_j + Σ log f_l over the positions l strictly
    after the earlier of (i, j) up to the later one; log_fgate [B, L, Hq]."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    b, length, hq, dim = q.shape
    groups = hq // k.shape[2]
    out = np.zeros((b, length, hq, dim))
    for bi, h, i in itertools.product(range(b), range(hq), range(length)):
        keys = [j for j in range(length) if _visible(bi, i, j, causal=causal, segment_ids=segment_ids, window=window)]
        logits = []
        for j in keys:
            first, last = min(i, j), max(i, j)
            decay = sum(log_fgate[bi, l, h] for l in range(first + 1, last + 1))
            logits.append(sm_scale * (q[bi, i, h] @ k[bi, j, h // groups]) + decay)
        p = np.exp(np.array(logits) - max(logits))
        p /= p.sum()
        out[bi, i, h] = sum(p_j * v[bi, j, h // groups] for p_j, j in zip(p, keys))
    return out


def stickbreaking_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, sm_scale: float | None = None,
                            attend_current: bool = False, segment_ids: np.ndarray | None = None,
                            window: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Stick-breaking (out [B, L, Hq, D], remainder [B, L, Hq]): over the visible keys j < i (j <= i with
    attend_current), A_ij = β_ij·Π_{k > j} (1 − β_ik), β = sigmoid(sm_scale·q·k); remainder 1 − Σ_j A_ij."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    b, length, hq, dim = q.shape
    groups = hq // k.shape[2]
    out = np.zeros((b, length, hq, dim))
    remainder = np.ones((b, length, hq))
    for bi, h, i in itertools.product(range(b), range(hq), range(length)):
        keys = [j for j in range(i + 1) if (j < i or attend_current)
                and _visible(bi, i, j, causal=True, segment_ids=segment_ids, window=window)]
        beta = {j: sigmoid(sm_scale * (q[bi, i, h] @ k[bi, j, h // groups])) for j in keys}
        for j in keys:
            weight = beta[j] * math.prod(1.0 - beta[t] for t in keys if t > j)
            out[bi, i, h] += weight * v[bi, j, h // groups]
            remainder[bi, i, h] -= weight
    return out, remainder
