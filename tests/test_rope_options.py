"""RoPE as models configure it: layouts, partial rotary, Hugging Face rope_scaling and config.json options, and the
same options reaching Co-RoPE (Llama 3 scaling, partial rotary) checked against tests/numpy_reference.py.

The references here are written independently of jaxpe: a NumPy rotation that lists each layout's pairs, and float64
restatements of each scaling from its published definition (transformers' modeling_rope_utils; Meta's llama
`apply_scaling` for Llama 3.1), plus values worked out by hand. B batch, L length, H heads, D head dim, R rotary dim.
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as npr
import pytest

import jaxpe
from jaxpe.rope import RoPEConfig
from jaxpe.rope_scaling import hf_rope_options, rope_frequencies, rope_scaling_dict

TOL = dict(rtol=1e-5, atol=1e-5)
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}  # Meta-Llama-3.1-8B config.json
QWEN25_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}  # Qwen2.5 model cards


# --- independent references --------------------------------------------------------------------------------------

def np_rope(x: np.ndarray, positions: np.ndarray, freqs, attention_factor: float = 1.0, *,
            interleaved: bool = False) -> np.ndarray:
    """x [B, L, H, D] float64 rotated pair by pair; positions [B|1, L]; R = 2·len(freqs)."""
    r = 2 * len(freqs)
    pairs = [(2 * d, 2 * d + 1) if interleaved else (d, d + r // 2) for d in range(r // 2)]
    out = np.array(x, np.float64)
    positions = np.broadcast_to(np.asarray(positions, np.float64).reshape(-1, x.shape[1]), x.shape[:2])
    for d, (i, j) in enumerate(pairs):
        angle = positions[:, :, None] * float(freqs[d])  # [B, L, 1]
        c, s = attention_factor * np.cos(angle), attention_factor * np.sin(angle)
        out[..., i] = x[..., i] * c - x[..., j] * s
        out[..., j] = x[..., j] * c + x[..., i] * s
    return out


def ref_default(r: int, theta: float) -> np.ndarray:
    return np.array([theta ** (-2.0 * d / r) for d in range(r // 2)])


def ref_dynamic(r: int, theta: float, factor: float, original: int, length: int) -> np.ndarray:
    """Dynamic NTK: past the original length the base grows to θ·(factor·s/L0 − (factor − 1))^(R/(R−2))."""
    if length > original:
        theta = theta * (factor * length / original - (factor - 1)) ** (r / (r - 2))
    return ref_default(r, theta)


def ref_llama3(r: int, theta: float, factor: float, low_freq_factor: float, high_freq_factor: float,
               original: int) -> np.ndarray:
    """Meta's llama `apply_scaling` (Llama 3.1), one frequency at a time."""
    out = []
    for freq in ref_default(r, theta):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high_freq_factor:
            out.append(freq)
        elif wavelen > original / low_freq_factor:
            out.append(freq / factor)
        else:
            smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def ref_yarn(r: int, theta: float, factor: float, original: int, beta_fast: float = 32, beta_slow: float = 1,
             truncate: bool = True, mscale: float | None = None, mscale_all_dim: float | None = None,
             attention_factor: float | None = None) -> tuple[np.ndarray, float]:
    """YaRN as transformers defines it: pair d turns L0·ω_d/(2π) times over the original length; the pair index where
    it turns β times is R·ln(L0/(2πβ))/(2·ln θ). Pairs below the beta_fast index extrapolate (keep ω), pairs above the
    beta_slow index interpolate (ω/factor), linearly in the index between."""
    def index(turns):
        return r * math.log(original / (2 * math.pi * turns)) / (2 * math.log(theta))

    lo, hi = index(beta_fast), index(beta_slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, r - 1)
    out = []
    for d, freq in enumerate(ref_default(r, theta)):
        interpolate = min(max((d - lo) / (hi - lo), 0.0), 1.0)
        out.append(interpolate * freq / factor + (1 - interpolate) * freq)
    if attention_factor is None:
        m = lambda scale: 0.1 * scale * math.log(factor) + 1
        attention_factor = m(mscale) / m(mscale_all_dim) if mscale and mscale_all_dim else m(1.0)
    return np.array(out), attention_factor


def normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


_apply_rope = jax.jit(jaxpe.apply_rope, static_argnames=("theta", "rotary_dim", "interleaved", "scaling"))


def apply_rope(x, positions, **options):
    """jaxpe.apply_rope under jit, a scaling dict passed as its (key, value) pairs (hashable, static)."""
    if isinstance(options.get("scaling"), dict):
        options["scaling"] = tuple(sorted(options["scaling"].items()))
    return _apply_rope(jnp.asarray(x), jnp.asarray(positions), **options)


# --- layouts and partial rotary -------------------------------------------------------------------------------------

def test_d4_by_hand_both_layouts():
    # D = 4, θ = 10^4: ω = (1, 0.01). Half-split pairs (0, 2), (1, 3); interleaved pairs (0, 1), (2, 3).
    eye = jnp.eye(4)[None, :, None, :]  # [1, 4, 1, 4]: x_t = e_t at every t
    pos = jnp.ones(4)
    c1, s1, c2, s2 = math.cos(1.0), math.sin(1.0), math.cos(0.01), math.sin(0.01)
    half = np.asarray(apply_rope(eye, pos))[0, :, 0]
    np.testing.assert_allclose(half, [[c1, 0, s1, 0], [0, c2, 0, s2], [-s1, 0, c1, 0], [0, -s2, 0, c2]], **TOL)
    inter = np.asarray(apply_rope(eye, pos, interleaved=True))[0, :, 0]
    np.testing.assert_allclose(inter, [[c1, s1, 0, 0], [-s1, c1, 0, 0], [0, 0, c2, s2], [0, 0, -s2, c2]], **TOL)


def test_partial_rotary_by_hand():
    # D = 6, R = 4: ω = (1, 0.01) over R; dims 4, 5 pass through.
    x = jnp.asarray([1.0, 0, 0, 0, 2.0, 3.0])[None, None, None, :]
    out = np.asarray(apply_rope(x, jnp.array([1]), rotary_dim=4))[0, 0, 0]
    np.testing.assert_allclose(out, [math.cos(1.0), 0, math.sin(1.0), 0, 2.0, 3.0], **TOL)
    out = np.asarray(apply_rope(x, jnp.array([1]), rotary_dim=4, interleaved=True))[0, 0, 0]
    np.testing.assert_allclose(out, [math.cos(1.0), math.sin(1.0), 0, 0, 2.0, 3.0], **TOL)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d, r", [(8, None), (12, 8), (10, 2)])
def test_layouts_against_numpy(interleaved, d, r):
    rng = np.random.default_rng(0)
    x = normal(rng, 2, 5, 3, d)
    positions = np.array([[3, 4, 5, 6, 7], [0, 2, 4, 6, 90]])
    out = apply_rope(jnp.asarray(x), jnp.asarray(positions), theta=500.0, rotary_dim=r, interleaved=interleaved)
    np.testing.assert_allclose(out, np_rope(x, positions, ref_default(r or d, 500.0), interleaved=interleaved), **TOL)
    floats = np.array([0.5, 1.25, 2.0, 7.75, 11.0])  # [L] float positions
    out = apply_rope(jnp.asarray(x), jnp.asarray(floats), rotary_dim=r, interleaved=interleaved)
    np.testing.assert_allclose(out, np_rope(x, floats, ref_default(r or d, 1e4), interleaved=interleaved), **TOL)


@pytest.mark.parametrize("d, r", [(8, 8), (10, 6)])
def test_interleaved_is_half_split_after_a_permutation(d, r):
    # perm[k] = 2k and perm[k + R/2] = 2k + 1 moves interleaved pairs onto half-split pairs; the tail stays.
    perm = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2), np.arange(r, d)])
    x = jnp.asarray(normal(np.random.default_rng(1), 2, 6, 2, d))
    positions = jnp.arange(6) * 3
    inter = apply_rope(x, positions, rotary_dim=r, interleaved=True)
    half = apply_rope(x[..., perm], positions, rotary_dim=r)
    np.testing.assert_allclose(inter[..., perm], half, **TOL)
    assert not np.allclose(inter, apply_rope(x, positions, rotary_dim=r), **TOL)  # the layouts do differ


@pytest.mark.parametrize("interleaved", [False, True])
def test_partial_rotary_is_full_rope_on_the_first_dims(interleaved):
    x = jnp.asarray(normal(np.random.default_rng(2), 1, 7, 2, 16))
    positions = jnp.arange(7) + 100
    out = apply_rope(x, positions, rotary_dim=6, interleaved=interleaved)
    np.testing.assert_array_equal(out[..., 6:], x[..., 6:])
    np.testing.assert_allclose(out[..., :6], apply_rope(x[..., :6], positions, interleaved=interleaved), **TOL)


@pytest.mark.parametrize("options", [dict(), dict(interleaved=True), dict(rotary_dim=4),
                                     dict(rotary_dim=6, interleaved=True), dict(scaling=LLAMA31, theta=5e5)])
def test_scores_depend_only_on_the_offset(options):
    rng = np.random.default_rng(3)
    q, k = jnp.asarray(normal(rng, 1, 1, 1, 10)), jnp.asarray(normal(rng, 1, 1, 1, 10))

    def score(i: int, j: int) -> float:
        return float(jnp.sum(apply_rope(q, jnp.array([i]), **options) *
                             apply_rope(k, jnp.array([j]), **options)))

    for offset in (0, 1, 5):
        for shift in (1, 7, 300):
            assert math.isclose(score(offset + shift, shift), score(offset, 0), rel_tol=1e-4, abs_tol=1e-4)
    assert not math.isclose(score(1, 0), score(2, 0), rel_tol=1e-3)


def test_dtype_is_kept():
    x = jnp.ones((1, 3, 1, 8), jnp.bfloat16)
    assert apply_rope(x, jnp.arange(3), rotary_dim=4, interleaved=True, scaling=QWEN25_YARN).dtype == x.dtype


# --- scaling ----------------------------------------------------------------------------------------------------

SCALINGS = {  # name: (rotary_dim, theta, rope_scaling, reference frequencies and attention factor)
    "linear": (64, 1e4, {"rope_type": "linear", "factor": 2.0}, lambda: (ref_default(64, 1e4) / 2, 1.0)),
    "llama3.1-8b": (128, 5e5, LLAMA31, lambda: (ref_llama3(128, 5e5, 8.0, 1.0, 4.0, 8192), 1.0)),
    "llama3-partial": (32, 5e5, LLAMA31, lambda: (ref_llama3(32, 5e5, 8.0, 1.0, 4.0, 8192), 1.0)),
    "qwen2.5-yarn": (128, 1e6, QWEN25_YARN, lambda: ref_yarn(128, 1e6, 4.0, 32768)),
    "yarn-no-truncate": (64, 1e4, {"rope_type": "yarn", "factor": 8, "original_max_position_embeddings": 4096,
                                   "truncate": False}, lambda: ref_yarn(64, 1e4, 8, 4096, truncate=False)),
    "yarn-betas": (64, 1e4, {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048,
                             "beta_fast": 16.0, "beta_slow": 2.0}, lambda: ref_yarn(64, 1e4, 16.0, 2048, 16, 2)),
    "yarn-deepseek-mscale": (64, 1e4, {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                       "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5},
                             lambda: ref_yarn(64, 1e4, 40, 4096, mscale=1.0, mscale_all_dim=0.5)),
    "yarn-attention-factor": (64, 1e4, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                                        "attention_factor": 1.5},
                              lambda: ref_yarn(64, 1e4, 4.0, 4096, attention_factor=1.5)),
}


@pytest.mark.parametrize("name", list(SCALINGS))
def test_frequencies_against_the_published_formulas(name):
    r, theta, scaling, reference = SCALINGS[name]
    freqs, attention_factor = rope_frequencies(r, theta=theta, scaling=scaling)
    want_freqs, want_factor = reference()
    assert freqs.shape == (r // 2,) and freqs.dtype == jnp.float32
    np.testing.assert_allclose(freqs, want_freqs, rtol=2e-6)
    assert math.isclose(attention_factor, want_factor, rel_tol=1e-12)


def test_llama31_bands_by_hand():
    # θ = 5e5, R = 128: λ_d = 2π·θ^(d/64) < 8192/4 for d <= 28 (kept); > 8192/1 for d >= 35 (divided by 8).
    freqs, factor = rope_frequencies(128, theta=5e5, scaling=LLAMA31)
    base = ref_default(128, 5e5)
    np.testing.assert_allclose(freqs[:29], base[:29], rtol=1e-6)
    np.testing.assert_allclose(freqs[35:], base[35:] / 8, rtol=1e-6)
    assert np.all(freqs[29:35] < base[29:35]) and np.all(freqs[29:35] > base[29:35] / 8) and factor == 1.0


def test_qwen25_yarn_by_hand():
    # θ = 1e6, R = 128, L0 = 32768: the pair index turning 32 times is 128·ln(32768/(64π))/(2 ln 1e6) = 23.60 (floor
    # 23), once is 39.65 (ceil 40): pairs 0..23 keep ω, pairs 40.. get ω/4; cos and sin grow by 1 + 0.1·ln 4.
    freqs, factor = rope_frequencies(128, theta=1e6, scaling=QWEN25_YARN)
    base = ref_default(128, 1e6)
    np.testing.assert_allclose(freqs[:24], base[:24], rtol=1e-6)
    np.testing.assert_allclose(freqs[40:], base[40:] / 4, rtol=1e-6)
    assert np.all(freqs[24:40] < base[24:40]) and np.all(freqs[24:40] > base[24:40] / 4)
    assert math.isclose(factor, 1.1386294361119891, rel_tol=1e-12)


def test_yarn_attention_factor_scales_only_the_rotated_dims():
    x = jnp.asarray(normal(np.random.default_rng(4), 1, 2, 1, 6))
    out = apply_rope(x, jnp.zeros(2, jnp.int32), rotary_dim=4, scaling=QWEN25_YARN)  # position 0: no turn
    np.testing.assert_allclose(out[..., :4], 1.1386294361119891 * x[..., :4], **TOL)
    np.testing.assert_array_equal(out[..., 4:], x[..., 4:])
    positions = jnp.array([5, 40000])
    out = apply_rope(x, positions, rotary_dim=4, interleaved=True, scaling=QWEN25_YARN, theta=1e6)
    freqs, factor = ref_yarn(4, 1e6, 4.0, 32768)
    np.testing.assert_allclose(out, np_rope(np.asarray(x), np.asarray(positions), freqs, factor, interleaved=True),
                               **TOL)


def test_linear_equals_positions_over_factor():
    x = jnp.asarray(normal(np.random.default_rng(5), 2, 9, 2, 8))
    positions = jnp.arange(9) * 11
    scaled = apply_rope(x, positions, scaling={"type": "linear", "factor": 2})
    np.testing.assert_allclose(scaled, apply_rope(x, positions / 2.0), **TOL)


def test_dynamic_below_and_above_the_original_length():
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 32}
    base = ref_default(16, 1e4)
    for length in (None, 10, 32):
        np.testing.assert_allclose(rope_frequencies(16, scaling=dynamic, length=length)[0], base, rtol=1e-6)
    above = ref_dynamic(16, 1e4, 2.0, 32, 64)  # θ·3^(16/14)
    np.testing.assert_allclose(rope_frequencies(16, scaling=dynamic, length=64)[0], above, rtol=2e-6)
    traced = jax.jit(lambda n: rope_frequencies(16, scaling=dynamic, length=n)[0])
    np.testing.assert_allclose(traced(64), above, rtol=2e-6)
    np.testing.assert_allclose(traced(20), base, rtol=1e-6)
    # apply_rope takes the length from the positions: max + 1, as transformers does.
    x = normal(np.random.default_rng(6), 1, 4, 1, 16)
    for positions, freqs in ((np.array([0, 1, 2, 20]), base), (np.array([0, 1, 2, 63]), above)):
        out = jax.jit(lambda x, p: apply_rope(x, p, scaling=dynamic))(jnp.asarray(x), jnp.asarray(positions))
        np.testing.assert_allclose(out, np_rope(x, positions, freqs), **TOL)


def test_scaling_spellings_agree():
    assert rope_scaling_dict({"type": "linear", "factor": 2.0}) == {"rope_type": "linear", "factor": 2.0}
    assert rope_scaling_dict({"rope_type": "linear", "type": "linear", "factor": 2}) == {"rope_type": "linear",
                                                                                       "factor": 2}
    assert rope_scaling_dict({"rope_type": "default"}) is None and rope_scaling_dict({}) is None
    assert rope_scaling_dict(None) is None
    assert RoPEConfig(scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}) == RoPEConfig(
        scaling=(("factor", 4.0), ("original_max_position_embeddings", 64), ("rope_type", "yarn")))
    assert RoPEConfig(scaling={"rope_type": "default"}).scaling is None
    hash(RoPEConfig(scaling=LLAMA31))  # stored hashably
    x = jnp.ones((1, 3, 1, 8))  # jit with the pairs as a static argument = eager with the dict
    np.testing.assert_allclose(_apply_rope(x, jnp.arange(3) * 5000, scaling=tuple(sorted(LLAMA31.items()))),
                               jaxpe.apply_rope(x, jnp.arange(3) * 5000, scaling=LLAMA31), **TOL)


# --- the attention core -------------------------------------------------------------------------------------------

def np_causal_attention(q, k, v, mask=None):
    """q [B, L, H, D], k/v [B, L, H, D] float64 (MHA), causal softmax with scale D^-1/2; mask [B, L, L] or None."""
    length = q.shape[1]
    logits = np.einsum("blhd,bshd->bhls", q, k) / math.sqrt(q.shape[-1])
    keep = np.tril(np.ones((length, length), bool))[None, None]
    if mask is not None:
        keep = keep & mask[:, None]
    logits = np.where(keep, logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bhls,bshd->blhd", w / w.sum(-1, keepdims=True), v)


CORE_CASES = {  # options, reference frequencies and attention factor at the test's positions (max k position 4099)
    "interleaved-partial-yarn": (dict(rotary_dim=4, interleaved=True, scaling=QWEN25_YARN | {
        "original_max_position_embeddings": 2048}), lambda: ref_yarn(4, 1e4, 4.0, 2048)),
    "dynamic": (dict(scaling={"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 1024}),
                lambda: (ref_dynamic(8, 1e4, 2.0, 1024, 4100), 1.0)),
    "llama3-half-split": (dict(scaling=LLAMA31 | {"original_max_position_embeddings": 64}),
                          lambda: (ref_llama3(8, 1e4, 8.0, 1.0, 4.0, 64), 1.0)),
}


@pytest.mark.parametrize("name", list(CORE_CASES))
def test_rope_core_rotates_q_and_k_at_their_positions(name):
    options, reference = CORE_CASES[name]
    rng = np.random.default_rng(7)
    q, k, v = (normal(rng, 2, 5, 2, 8) for _ in range(3))
    positions = np.array([[0, 1, 2, 3, 4], [4095, 4096, 4097, 4098, 4099]])
    core = jaxpe.pe_config("rope", **options).core(head_dim=8, max_len=8, impl="reference")
    ctx = jaxpe.AttentionContext(x=jnp.zeros((2, 5, 16)), q_pos=jnp.asarray(positions, jnp.int32),
                                 k_pos=jnp.asarray(positions, jnp.int32))
    out = jax.jit(core.apply)({}, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), ctx)
    freqs, factor = reference()
    interleaved = options.get("interleaved", False)
    rot = lambda x: np_rope(x, positions, freqs, factor, interleaved=interleaved)
    np.testing.assert_allclose(out, np_causal_attention(rot(q), rot(k), v), **TOL)


def test_rope_core_packed_documents_equal_separate_runs():
    rng = np.random.default_rng(8)
    q, k, v = (jnp.asarray(normal(rng, 1, 6, 2, 8)) for _ in range(3))
    core = jaxpe.pe_config("rope", rotary_dim=4, interleaved=True).core(head_dim=8, max_len=8, impl="reference")
    pos = jnp.array([[0, 1, 2, 0, 1, 2]], jnp.int32)
    ctx = jaxpe.AttentionContext(x=jnp.zeros((1, 6, 16)), q_pos=pos, k_pos=pos,
                                 segment_ids=jnp.array([[0, 0, 0, 1, 1, 1]], jnp.int32))
    apply = jax.jit(core.apply)
    packed = apply({}, q, k, v, ctx)
    for doc in (slice(0, 3), slice(3, 6)):
        one = jaxpe.AttentionContext(x=jnp.zeros((1, 3, 16)), q_pos=pos[:, doc], k_pos=pos[:, doc])
        np.testing.assert_allclose(packed[:, doc], apply({}, q[:, doc], k[:, doc], v[:, doc], one), **TOL)


# --- Hugging Face config.json ---------------------------------------------------------------------------------------

HF_CONFIGS = {  # the rope-related fields of public config.json files (Qwen2.5 with its model card's YaRN added)
    "llama-3.1-8b": ({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "head_dim": 128,
                      "max_position_embeddings": 131072, "rope_theta": 500000.0, "rope_scaling": LLAMA31},
                     dict(theta=500000.0, rotary_dim=None, interleaved=False, scaling=LLAMA31)),
    "qwen2.5-7b-yarn": ({"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28,
                         "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rope_scaling": QWEN25_YARN},
                        dict(theta=1e6, rotary_dim=None, interleaved=False,
                             scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})),
    "phi-2": ({"model_type": "phi", "hidden_size": 2560, "num_attention_heads": 32, "partial_rotary_factor": 0.4,
               "rope_theta": 10000.0, "rope_scaling": None, "max_position_embeddings": 2048},
              dict(theta=1e4, rotary_dim=32, interleaved=False, scaling=None)),
    "gpt-neox-20b": ({"model_type": "gpt_neox", "hidden_size": 6144, "num_attention_heads": 64, "rotary_pct": 0.25,
                      "rotary_emb_base": 10000, "max_position_embeddings": 2048},
                     dict(theta=1e4, rotary_dim=24, interleaved=False, scaling=None)),
    "gpt-j-6b": ({"model_type": "gptj", "n_embd": 4096, "n_head": 16, "rotary_dim": 64, "n_positions": 2048},
                 dict(theta=1e4, rotary_dim=64, interleaved=True, scaling=None)),
    "dynamic": ({"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 4096, "rope_theta": 1e4,
                 "rope_scaling": {"type": "dynamic", "factor": 2.0}},
                dict(theta=1e4, rotary_dim=None, interleaved=False,
                     scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4096})),
    "yarn-factor-from-lengths": ({"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 163840,
                                  "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4096}},
                                 dict(theta=1e4, rotary_dim=None, interleaved=False,
                                      scaling={"rope_type": "yarn", "factor": 40.0,
                                               "original_max_position_embeddings": 4096})),
    "rope-parameters": ({"hidden_size": 256, "num_attention_heads": 2, "max_position_embeddings": 8192,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
                        dict(theta=1e6, rotary_dim=64, interleaved=False, scaling=None)),
}


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hf_rope_options(name):
    config, want = HF_CONFIGS[name]
    options = hf_rope_options(config)
    assert options == want | {"scaling": rope_scaling_dict(want["scaling"])}
    pe = jaxpe.pe_config("rope", **options)
    head_dim = config.get("head_dim") or config.get("hidden_size", config.get("n_embd")) // config.get(
        "num_attention_heads", config.get("n_head"))
    assert isinstance(pe.core(head_dim=head_dim, max_len=16, impl="auto"), jaxpe.rope.RoPECore)


def test_model_takes_rope_options():
    options = hf_rope_options({"hidden_size": 32, "num_attention_heads": 2, "partial_rotary_factor": 0.5,
                               "max_position_embeddings": 16, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    config = jaxpe.ModelConfig(vocab_size=11, d_model=32, num_layers=1, num_heads=2, max_len=32, dropout=0.0,
                               pe="rope", pe_options=options | {"interleaved": True})
    model = jaxpe.TransformerLM(config)
    tokens = jnp.arange(24)[None] % 11
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)  # traces the layers: shapes only, no compile
    assert jax.eval_shape(model.apply, params, tokens).shape == (1, 24, 11)


def test_model_prefill_and_decode_match_the_full_forward():
    # Static frequencies (here YaRN, interleaved, partial) make cached decoding exact. Dynamic NTK is not: a decoding
    # step scales by the positions seen so far, the full forward by all of them (transformers behaves alike).
    options = dict(rotary_dim=4, interleaved=True, scaling=QWEN25_YARN | {"original_max_position_embeddings": 4})
    config = jaxpe.ModelConfig(vocab_size=11, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, max_len=12,
                               dropout=0.0, pe="rope", pe_options=options)
    model = jaxpe.TransformerLM(config)
    toks = jax.random.randint(jax.random.PRNGKey(0), (2, 9), 0, 11)
    params = jax.jit(model.init)(jax.random.PRNGKey(1), toks)["params"]
    full = jax.jit(lambda t: model.apply({"params": params}, t))(toks)
    step = jax.jit(lambda cache, t: model.apply({"params": params, "cache": cache}, t, decode=True, mutable=["cache"]))
    cache, outs = jaxpe.init_cache(model, 2, 9), []
    for t in range(9):  # one token at a time: one compiled step
        logits, state = step(cache, toks[:, t:t + 1])
        cache = state["cache"]
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=2e-5, rtol=2e-5)


# --- Co-RoPE with Llama 3 scaling ---------------------------------------------------------------------------------

# θ = 100, R = 16, L0 = 64, low 1, high 4, factor 8: λ_d = 2π·100^(d/8) = 6.3, 11.2, 19.9, 35.3, 62.8, 112, 199, 353,
# so pairs 0, 1 (λ < 64/4) keep ω, pairs 2, 3, 4 (16 <= λ <= 64) are smoothed, pairs 5, 6, 7 (λ > 64) get ω/8.
# With R = 8 of D = 16 the wavelengths are 6.3, 19.9, 62.8, 199: pair 0 kept, 1 and 2 smoothed, 3 divided, and the
# last 4 of the 8 frequency pairs do not rotate.
SMALL_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}


def test_small_llama3_bands_by_hand():
    base, scaled = ref_default(16, 100.0), ref_llama3(16, 100.0, 8.0, 1.0, 4.0, 64)
    np.testing.assert_allclose(scaled[:2], base[:2], rtol=1e-12)
    assert np.all(scaled[2:5] < base[2:5]) and np.all(scaled[2:5] > base[2:5] / 8)
    np.testing.assert_allclose(scaled[5:], base[5:] / 8, rtol=1e-12)


def np_corope_layer(x: np.ndarray, params: dict, freqs: np.ndarray) -> np.ndarray:
    """x [B, L, d_model] through a Co-RoPE attention layer in float64: projections by the layer's kernels, then the
    NumPy Co-RoPE of tests/numpy_reference.py with the frequencies `freqs` [D/2], then the output projection."""
    kernel = lambda name: np.asarray(params[name]["kernel"], np.float64)  # noqa: E731
    q, k, v = (np.einsum("bld,dhe->blhe", x, kernel(name)) for name in ("query", "key", "value"))
    out = npr.corope_attention(q, k, v, freqs=freqs)  # [B, L, H, D]
    return np.einsum("blhe,hed->bld", out, kernel("out"))


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_corope_with_llama3_scaling_against_numpy(rotary_dim, impl):
    """pe_options {"theta", "rotary_dim", "scaling"} reach Co-RoPE's rotation: a layer built from them equals the
    NumPy restatement rotating by Meta's `apply_scaling` frequencies (zeros past R), and not the unscaled ones."""
    options = {"theta": 100.0, "scaling": SMALL_LLAMA3} | ({} if rotary_dim is None else {"rotary_dim": rotary_dim})
    layer = jaxpe.Attention(num_heads=4, num_kv_heads=2, head_dim=16, pe=jaxpe.pe_config("corope", **options),
                            impl=impl)
    x = normal(np.random.default_rng(3), 1, 12, 32)
    params = nn.meta.unbox(layer.init(jax.random.PRNGKey(0), jnp.asarray(x))["params"])
    r = 16 if rotary_dim is None else rotary_dim
    scaled = np.concatenate([ref_llama3(r, 100.0, 8.0, 1.0, 4.0, 64), np.zeros((16 - r) // 2)])
    unscaled = np.concatenate([ref_default(r, 100.0), np.zeros((16 - r) // 2)])
    got = np.asarray(jax.jit(layer.apply)({"params": params}, jnp.asarray(x)))
    want = np_corope_layer(np.asarray(x, np.float64), params, scaled)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert np.abs(want - np_corope_layer(np.asarray(x, np.float64), params, unscaled)).max() > 1e-3


# --- errors -------------------------------------------------------------------------------------------------------

X = jnp.ones((1, 3, 2, 8))


@pytest.mark.parametrize("kwargs, match", [
    (dict(rotary_dim=3), "rotary_dim=3 must be an even int"),
    (dict(rotary_dim=0), "rotary_dim=0 must be an even int"),
    (dict(rotary_dim=10), r"rotary_dim=10 must be <= the head dim D=8"),
    (dict(rotary_dim=4.0), r"rotary_dim=4.0 must be an even int"),
    (dict(interleaved="yes"), "interleaved='yes' must be a bool"),
    (dict(theta=0.0), "theta=0.0 must be > 0"),
    (dict(scaling=2.0), "scaling=2.0 must be a Hugging Face rope_scaling dict"),
    (dict(scaling={"rope_type": "longrope", "factor": 2.0}), "rope_type='longrope' is not supported"),
    (dict(scaling={"type": "ntk", "factor": 2.0}), "rope_type='ntk' is not supported"),
    (dict(scaling={"rope_type": "linear", "factor": 2.0, "beta_fast": 3}), "unknown key 'beta_fast'"),
    (dict(scaling={"rope_type": "default", "factor": 2.0}), "unknown key 'factor'"),
    (dict(scaling={"factor": 2.0}), "unknown key 'factor'"),
    (dict(scaling={"rope_type": "linear"}), "needs the key 'factor'"),
    (dict(scaling={"rope_type": "linear", "factor": 0.5}), "factor=0.5 must be a number >= 1"),
    (dict(scaling={"rope_type": "linear", "factor": -2}), "factor=-2 must be a number >= 1"),
    (dict(scaling={"rope_type": "linear", "factor": "2"}), "factor='2' must be a number >= 1"),
    (dict(scaling={"rope_type": "linear", "factor": float("inf")}), "factor=inf must be a number >= 1"),
    (dict(scaling={"rope_type": "linear", "type": "yarn", "factor": 2.0}), "rope_type='linear' and type='yarn'"),
    (dict(scaling={"rope_type": "dynamic", "factor": 2.0}), "needs the key 'original_max_position_embeddings'"),
    (dict(scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}),
     "original_max_position_embeddings=0 must be a positive int"),
    (dict(scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "beta_fast": 1,
                   "beta_slow": 4}), "beta_fast=1 must be >= beta_slow=4"),
    (dict(scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "truncate": 1}),
     "truncate=1 must be true or false"),
    (dict(scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                   "attention_factor": 0}), "attention_factor=0 must be a number > 0"),
    (dict(scaling={k: v for k, v in LLAMA31.items() if k != "low_freq_factor"}), "needs the key 'low_freq_factor'"),
    (dict(scaling=LLAMA31 | {"high_freq_factor": 1.0}), "high_freq_factor=1.0 must be greater than low_freq_factor"),
])
def test_apply_rope_refuses_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxpe.apply_rope(X, jnp.arange(3), **kwargs)


def test_config_and_hf_errors():
    with pytest.raises(ValueError, match="rotary_dim=5 must be an even int"):
        jaxpe.pe_config("rope", rotary_dim=5)
    with pytest.raises(ValueError, match="unknown key 'low_freq_factor'"):
        jaxpe.pe_config("rope", scaling={"type": "linear", "factor": 2.0, "low_freq_factor": 1.0})
    with pytest.raises(ValueError, match="rotary_dim=16 must be <= the head dim D=8"):
        jaxpe.pe_config("rope", rotary_dim=16).core(head_dim=8, max_len=4, impl="auto")
    with pytest.raises(ValueError, match="must be > 2 for dynamic NTK"):
        jaxpe.pe_config("rope", rotary_dim=2, scaling={"type": "dynamic", "factor": 2.0,
                                                       "original_max_position_embeddings": 8})
    with pytest.raises(ValueError, match="must be > 2 for dynamic NTK"):
        rope_frequencies(2, scaling={"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8})
    with pytest.raises(ValueError, match="needs head_dim, or hidden_size and num_attention_heads"):
        hf_rope_options({"rope_theta": 1e4})
    with pytest.raises(ValueError, match="per layer type"):
        hf_rope_options({"head_dim": 8, "rope_parameters": {"full_attention": {"rope_type": "default"}}})
    with pytest.raises(ValueError, match="rotary_dim=5 must be an even int"):
        hf_rope_options({"head_dim": 10, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="rope_type='su' is not supported"):
        hf_rope_options({"head_dim": 8, "rope_scaling": {"type": "su", "factor": 2.0}})
