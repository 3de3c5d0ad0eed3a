"""Every encoding against hand-computed values or the independent float64 NumPy restatement in numpy_reference.py.

JAX runs in float32, the reference in float64 on the same (float32-rounded) inputs.
Shapes: B batch, L length, Hq query heads, Hkv key/value heads, D head dim.
"""
from __future__ import annotations

import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
import numpy_reference as ref
from jaxpe import cope as jaxpe_cope
from jaxpe import corope as jaxpe_corope
from jaxpe.learned import LearnedPE
from jaxpe.tables import relative_logits, relative_logits_indexed
from jaxpe.sinusoidal import SinusoidalPE

TOL = dict(rtol=2e-5, atol=2e-5)

# Jitted once here: one compilation per input shape instead of one per primitive (eager dispatch is slow on CPU).
alibi_bias = jax.jit(jaxpe.alibi_bias, static_argnums=(1, 2))
apply_rope = jax.jit(jaxpe.apply_rope, static_argnames=("theta",))
cope_attention = jax.jit(jaxpe.cope_attention, static_argnames=("sm_scale", "causal", "impl"))
cope_positions = jax.jit(jaxpe.cope_positions, static_argnames=("npos", "sm_scale"))
cope_position_logits = jax.jit(jaxpe_cope.cope_position_logits)
corope_attention = jax.jit(jaxpe.corope_attention, static_argnames=("theta", "sm_scale", "causal", "impl"))
corope_attention_reference = jax.jit(jaxpe_corope.corope_attention_reference, static_argnames=("theta", "sm_scale"))
corope_mileage = jax.jit(jaxpe.corope_mileage, static_argnames=("sm_scale",))
corope_scores = jax.jit(jaxpe_corope.corope_scores, static_argnames=("theta", "sm_scale"))
jit_relative_logits = jax.jit(relative_logits, static_argnums=(3,))
sinusoidal_table = jax.jit(jaxpe.sinusoidal_table, static_argnums=(0, 1), static_argnames=("theta", "scale"))


def normal(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    """float32 standard-normal draws (the reference reads them as float64, so both sides see the same numbers)."""
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def qkv(rng: np.random.Generator, b: int, length: int, hq: int, hkv: int, d: int) -> tuple[np.ndarray, ...]:
    return normal(rng, b, length, hq, d), normal(rng, b, length, hkv, d), normal(rng, b, length, hkv, d)


def f64(x: np.ndarray | jax.Array) -> np.ndarray:
    return np.asarray(x, np.float64)


def randomized(params: dict, rng: np.random.Generator, scale: float = 0.5) -> dict:
    """The same tree, unboxed, with every leaf redrawn from N(0, scale²), so small initialisers cannot hide a wrong
    term."""
    return jax.tree.map(lambda p: jnp.asarray(normal(rng, *p.shape, scale=scale)), nn.meta.unbox(params))


def run_core(name: str, options: dict, q: np.ndarray, k: np.ndarray, v: np.ndarray, x: np.ndarray,
             rng: np.random.Generator) -> tuple[np.ndarray, dict]:
    """Build encoding `name`'s attention core through the registry, randomise its params, run it causally."""
    b, length, _, d = q.shape
    core = jaxpe.pe_config(name, **options).core(head_dim=d, max_len=length, impl="reference")
    q_pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jaxpe.AttentionContext(x=jnp.asarray(x), q_pos=q_pos))
    shapes = jax.eval_shape(core.init, jax.random.PRNGKey(0), *args)
    params = randomized(shapes.get("params", {}), rng)
    out = jax.jit(core.apply)({"params": params}, *args)
    return np.asarray(out), jax.tree.map(f64, params)


# --- sinusoidal, learned ----------------------------------------------------------------------------------------

def test_sinusoidal_table_hand_values():
    # dim 4, θ = 10000: frequencies 1 and 10000^(-1/2) = 0.01; columns sin(i), cos(i), sin(0.01 i), cos(0.01 i).
    expected = np.array([
        [0.0, 1.0, 0.0, 1.0],
        [0.8414709848, 0.5403023059, 0.0099998333, 0.9999500004],
        [0.9092974268, -0.4161468365, 0.0199986667, 0.9998000067],
    ])
    np.testing.assert_allclose(sinusoidal_table(3, 4), expected, rtol=1e-6, atol=1e-6)


def test_sinusoidal_table_odd_dim_drops_last_cos():
    table = np.asarray(sinusoidal_table(6, 5))
    assert table.shape == (6, 5)
    i = np.arange(6)
    np.testing.assert_allclose(table[:, 4], np.sin(i * 10000.0 ** (-4 / 5)), rtol=1e-6, atol=1e-6)  # a sine column
    np.testing.assert_allclose(table, ref.sinusoidal_table(6, 5), rtol=1e-6, atol=1e-6)


def test_sinusoidal_table_theta_and_scale():
    table = sinusoidal_table(7, 6, theta=100.0, scale=2.5)
    np.testing.assert_allclose(table, ref.sinusoidal_table(7, 6, theta=100.0, scale=2.5), rtol=1e-5, atol=1e-5)
    # hand value: row 3, column 2 = sin(2.5·3·100^(-2/6))
    assert math.isclose(float(table[3, 2]), math.sin(7.5 * 100.0 ** (-1 / 3)), rel_tol=1e-5)


def test_sinusoidal_and_learned_layers_add_their_table():
    rng = np.random.default_rng(0)
    x = normal(rng, 2, 5, 6)
    sinusoidal = SinusoidalPE(max_len=8)
    out = jax.jit(sinusoidal.apply)({}, jnp.asarray(x))
    np.testing.assert_allclose(out, f64(x) + ref.sinusoidal_table(5, 6)[None], **TOL)
    scaled = jax.jit(SinusoidalPE(max_len=8, amplitude=0.02).apply)({}, jnp.asarray(x))
    np.testing.assert_allclose(scaled, f64(x) + 0.02 * ref.sinusoidal_table(5, 6)[None], **TOL)

    learned = LearnedPE(max_len=8)
    params = randomized(jax.eval_shape(learned.init, jax.random.PRNGKey(0), jnp.asarray(x))["params"], rng)
    out = jax.jit(learned.apply)({"params": params}, jnp.asarray(x))
    np.testing.assert_allclose(out, f64(x) + f64(params["table"])[None, :5], **TOL)


# --- AM-SPE -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha, detail_level, d_model", [(0.0, 0.5, 8), (1.3, 0.5, 8), (-0.7, 0.2, 7), (2.0, 1.0, 5)])
def test_amspe_against_numpy_restatement(alpha, detail_level, d_model):
    rng = np.random.default_rng(1)
    x = normal(rng, 2, 6, d_model)
    layer = jaxpe.AMSPE(d_model, max_len=10)
    variables = nn.meta.unbox(jax.jit(layer.init)(jax.random.PRNGKey(0), jnp.asarray(x)))
    assert variables["params"]["alpha"].shape == (1,)
    np.testing.assert_array_equal(variables["params"]["alpha"], [0.0])  # initialised to 0: α = 1/2
    params = {"alpha": jnp.array([alpha], jnp.float32)}
    out = jax.jit(layer.apply, static_argnums=(2,))({"params": params}, jnp.asarray(x), detail_level)
    np.testing.assert_allclose(out, ref.amspe(f64(x), alpha, detail_level=detail_level), **TOL)


def test_amspe_amplitude_scales_the_blend_not_the_input():
    rng = np.random.default_rng(3)
    x = normal(rng, 2, 6, 8)
    params = {"alpha": jnp.array([0.4], jnp.float32)}
    out = jax.jit(jaxpe.AMSPE(8, max_len=10, amplitude=0.05).apply)({"params": params}, jnp.asarray(x))
    pe = ref.amspe(np.zeros_like(f64(x)), 0.4)
    np.testing.assert_allclose(out, f64(x) + 0.05 * pe, **TOL)


def test_amspe_coarse_scale_and_blend_by_hand():
    # alpha → +∞ leaves only the coarse table: x + sin/cos(coarse_scale·i·ω).
    layer = jaxpe.AMSPE(2, max_len=4, coarse_scale=3.0)
    x = jnp.zeros((1, 3, 2))
    out = jax.jit(layer.apply)({"params": {"alpha": jnp.array([40.0])}}, x)
    i = np.arange(3)
    np.testing.assert_allclose(out[0], np.stack([np.sin(3.0 * i), np.cos(3.0 * i)], -1), **TOL)


# --- RoPE -------------------------------------------------------------------------------------------------------

def test_apply_rope_positions_1d_and_2d():
    rng = np.random.default_rng(2)
    x = normal(rng, 2, 5, 3, 8)
    positions = np.arange(5)
    np.testing.assert_allclose(apply_rope(jnp.asarray(x), jnp.asarray(positions)),
                               ref.rope(f64(x), positions), **TOL)
    per_batch = np.array([[3, 4, 5, 6, 7], [0, 2, 4, 6, 8]])
    np.testing.assert_allclose(apply_rope(jnp.asarray(x), jnp.asarray(per_batch), theta=100.0),
                               ref.rope(f64(x), per_batch, theta=100.0), **TOL)


def test_apply_rope_half_split_by_hand():
    # D = 4: pairs (0, 2) and (1, 3); ω = 1 and θ^(-1/2) = 0.01. Position 1 rotates x = e_0 to (cos 1, 0, sin 1, 0).
    x = jnp.zeros((1, 2, 1, 4)).at[:, :, :, 0].set(1.0)
    out = np.asarray(apply_rope(x, jnp.arange(2)))
    np.testing.assert_allclose(out[0, 1, 0], [math.cos(1.0), 0.0, math.sin(1.0), 0.0], **TOL)
    np.testing.assert_allclose(out[0, 0, 0], [1.0, 0.0, 0.0, 0.0], **TOL)


def test_rope_dot_product_depends_only_on_offset():
    rng = np.random.default_rng(3)
    q, k = normal(rng, 1, 1, 1, 8), normal(rng, 1, 1, 1, 8)

    def score(i: int, j: int) -> float:
        qi = apply_rope(jnp.asarray(q), jnp.array([i]))
        kj = apply_rope(jnp.asarray(k), jnp.array([j]))
        return float(jnp.sum(qi * kj))

    for offset in (0, 1, 5):
        base = score(offset, 0)
        for shift in (1, 7, 30):
            assert math.isclose(score(offset + shift, shift), base, rel_tol=1e-4, abs_tol=1e-4)
    assert not math.isclose(score(1, 0), score(2, 0), rel_tol=1e-3)


# --- ALiBi, relative --------------------------------------------------------------------------------------------

def test_alibi_slopes_hand_values():
    np.testing.assert_allclose(jaxpe.alibi_slopes(8), [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256])
    np.testing.assert_allclose(jaxpe.alibi_slopes(4), [1 / 4, 1 / 16, 1 / 64, 1 / 256])


def test_alibi_bias_hand_values():
    bias = np.asarray(alibi_bias(jnp.array([[0, 1, 2]]), 3, 2))  # slopes 1/16, 1/256
    distance = np.array([[0, -1, -2], [1, 0, -1], [2, 1, 0]])
    np.testing.assert_allclose(bias[0, 0], -distance / 16)
    np.testing.assert_allclose(bias[0, 1], -distance / 256)
    q_pos = np.array([[4, 5], [1, 2]])  # decoding: queries at absolute positions, keys 0..5
    np.testing.assert_allclose(alibi_bias(jnp.asarray(q_pos), 6, 8), ref.alibi_bias(q_pos, 6, 8), **TOL)


@pytest.mark.parametrize("npos", [2, 3, 10])
def test_relative_logits_clip_at_npos(npos):
    rng = np.random.default_rng(4)
    q, table = normal(rng, 2, 6, 2, 4), normal(rng, npos, 4)
    q_pos = np.broadcast_to(np.arange(6), (2, 6))
    got = np.asarray(jit_relative_logits(jnp.asarray(q), jnp.asarray(table), jnp.asarray(q_pos), 6))
    want = ref.relative_logits(f64(q), f64(table), q_pos, 6)
    causal = np.tril(np.ones((6, 6), bool))
    np.testing.assert_allclose(got[..., causal], want[..., causal], **TOL)
    # by hand: query 5 against key 0 reads row min(5, npos − 1)
    assert math.isclose(got[0, 1, 5, 0], float(f64(q)[0, 5, 1] @ f64(table)[min(5, npos - 1)]), rel_tol=1e-5)


def test_relative_logits_decode_positions():
    rng = np.random.default_rng(5)
    q, table = normal(rng, 1, 2, 1, 4), normal(rng, 3, 4)
    q_pos = np.array([[4, 5]])
    got = np.asarray(jit_relative_logits(jnp.asarray(q), jnp.asarray(table), jnp.asarray(q_pos), 6))
    visible = np.arange(6)[None, :] <= q_pos[0][:, None]  # the future key 5 of query 4 is masked anyway
    np.testing.assert_allclose(got[..., visible], ref.relative_logits(f64(q), f64(table), q_pos, 6)[..., visible],
                               **TOL)


@pytest.mark.parametrize("length, npos", [(1, 3), (6, 2), (6, 6), (6, 7), (9, 20), (33, 1)])
def test_relative_logits_indexed_against_numpy(length, npos):
    """The skewed (gather-free) relative logits: the NumPy restatement on and below the diagonal, distance 0
    (q_i·r[0], as `relative_logits` gives) above it; gradients equal those of the gathering version."""
    rng = np.random.default_rng(length + npos)
    q, table = normal(rng, 2, length, 3, 4), normal(rng, npos, 4)
    q_pos = np.broadcast_to(np.arange(length), (2, length))
    got = np.asarray(jax.jit(relative_logits_indexed)(jnp.asarray(q), jnp.asarray(table)))
    want = ref.relative_logits(f64(q), f64(table), q_pos, length)
    causal = np.tril(np.ones((length, length), bool))
    np.testing.assert_allclose(got[..., causal], want[..., causal], **TOL)
    above = np.einsum("bqhd,d->bhq", f64(q), f64(table)[0])[..., None] * np.ones(length)
    np.testing.assert_allclose(got[..., ~causal], above[..., ~causal], **TOL)
    weights = jnp.asarray(normal(rng, 2, 3, length, length))
    loss = lambda fn: lambda q, t: jnp.sum(weights * fn(q, t))  # noqa: E731
    gathered = jax.grad(loss(lambda q, t: relative_logits(q, t, jnp.asarray(q_pos), length)), (0, 1))
    skewed = jax.grad(loss(relative_logits_indexed), (0, 1))
    for a, b in zip(skewed(jnp.asarray(q), jnp.asarray(table)), gathered(jnp.asarray(q), jnp.asarray(table))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_relative_attention_reads_no_pairwise_gather_by_default():
    """A relative-position layer without caller positions or documents takes the skewed path (no gather of
    [B, H, L, L] entries) and gives the output that the same layer with explicit positions 0..L−1 (the gather)
    gives."""
    attn = jaxpe.Attention(num_heads=2, num_kv_heads=2, head_dim=4, pe=jaxpe.pe_config("relative", npos=5),
                           max_len=7)
    x = jnp.asarray(normal(np.random.default_rng(9), 2, 7, 8))
    params = randomized(attn.init(jax.random.PRNGKey(0), x)["params"], np.random.default_rng(10))

    def largest_gather(**kw) -> int:
        jaxpr = str(jax.make_jaxpr(lambda p: attn.apply({"params": p}, x, **kw))(params))
        return max([math.prod(map(int, shape.split(","))) for shape in re.findall(r"f32\[([\d,]+)\] = gather", jaxpr)],
                   default=0)

    assert largest_gather() < 2 * 2 * 7 * 7 <= largest_gather(positions=jnp.arange(7))
    explicit = attn.apply({"params": params}, x, positions=jnp.arange(7))
    np.testing.assert_allclose(attn.apply({"params": params}, x), explicit, **TOL)


@pytest.mark.parametrize("name", ["none", "rope", "alibi", "relative"])
def test_attention_cores_against_numpy(name):
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, 2, 6, 4, 2, 8)
    x = normal(rng, 2, 6, 16)
    options = {"npos": 4} if name == "relative" else {}
    out, params = run_core(name, options, q, k, v, x, rng)
    q64, k64 = f64(q), f64(k)
    sm_scale, positions, bias = 8 ** -0.5, np.arange(6), None
    if name == "rope":
        q64, k64 = ref.rope(q64, positions), ref.rope(k64, positions)
    if name == "alibi":
        bias = ref.alibi_bias(np.broadcast_to(positions, (2, 6)), 6, 4)
    if name == "relative":
        bias = sm_scale * ref.relative_logits(q64, params["rel_table"], np.broadcast_to(positions, (2, 6)), 6)
    np.testing.assert_allclose(out, ref.softmax_attention(q64, k64, f64(v), bias=bias), **TOL)


# --- CoPE -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("hq, hkv, per_head, with_gate_k, npos", [
    (2, 2, False, False, 7),  # MHA, shared table, npos = L + 1
    (4, 2, False, False, 3),  # GQA, heavy clamping
    (4, 2, True, False, 4),  # per-head table
    (4, 1, True, True, 5),  # MQA, per-head table, separate gate keys
    (2, 2, False, True, 2),  # smallest table
])
def test_cope_attention_against_numpy(hq, hkv, per_head, with_gate_k, npos):
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, 2, 6, hq, hkv, 8)
    q *= 3.0  # spread the gates over (0, 1) so positions are fractional
    pos_emb = normal(rng, *((hq, npos, 8) if per_head else (npos, 8)))
    gate_k = normal(rng, *k.shape) if with_gate_k else None
    out = cope_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos_emb),
                               gate_k=None if gate_k is None else jnp.asarray(gate_k), impl="reference")
    assert out.shape == (2, 6, hq, 8) and out.dtype == jnp.float32
    want = ref.cope_attention(f64(q), f64(k), f64(v), f64(pos_emb), gate_k=None if gate_k is None else f64(gate_k))
    np.testing.assert_allclose(out, want, **TOL)


def test_cope_attention_sm_scale():
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, 1, 5, 2, 2, 4)
    pos_emb = normal(rng, 4, 4)
    out = cope_attention(*map(jnp.asarray, (q, k, v, pos_emb)), sm_scale=0.3, impl="reference")
    np.testing.assert_allclose(out, ref.cope_attention(*map(f64, (q, k, v, pos_emb)), sm_scale=0.3), **TOL)


def test_cope_positions_against_numpy():
    rng = np.random.default_rng(9)
    q, k, _ = qkv(rng, 2, 7, 4, 2, 4)
    q *= 2.0
    gate_k = normal(rng, *k.shape)
    got = np.asarray(cope_positions(jnp.asarray(q), jnp.asarray(k), npos=4))
    np.testing.assert_allclose(got, ref.cope_positions(f64(q), f64(k), npos=4), **TOL)
    got = np.asarray(cope_positions(jnp.asarray(q), jnp.asarray(k), npos=9, gate_k=jnp.asarray(gate_k)))
    np.testing.assert_allclose(got, ref.cope_positions(f64(q), f64(k), npos=9, gate_k=f64(gate_k)), **TOL)
    assert 0.5 < got.max() < 8  # some positions are fractional and unclamped


def saturating_inputs(rng: np.random.Generator, b: int, length: int, hq: int, hkv: int, d: int):
    """q, k, v, gate_k with every gate sigmoid(sm_scale·q·gate_k) exactly 1 in float32: q and gate_k share a large
    component along axis 0, which k and the tables leave out so that it does not touch the logits."""
    q, k, v = qkv(rng, b, length, hq, hkv, d)
    q[..., 0] = 30.0
    k[..., 0] = 0.0
    gate_k = np.zeros_like(k)
    gate_k[..., 0] = 30.0
    return q, k, v, gate_k


def test_cope_every_gate_one_gives_i_minus_j_plus_one_clamped():
    rng = np.random.default_rng(10)
    length = 6
    q, k, _, gate_k = saturating_inputs(rng, 1, length, 2, 2, 4)
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    for npos in (length + 1, 3):
        got = np.asarray(cope_positions(jnp.asarray(q), jnp.asarray(k), npos=npos, gate_k=jnp.asarray(gate_k)))
        want = np.where(j <= i, np.minimum(i - j + 1, npos - 1), 0)
        np.testing.assert_array_equal(got[0, 0], want)
        np.testing.assert_array_equal(got[0, 1], want)
    # q aligned with k (no separate gate keys) saturates the default gates too.
    aligned = np.full((1, length, 1, 4), 10.0, np.float32)
    got = np.asarray(cope_positions(jnp.asarray(aligned), jnp.asarray(aligned), npos=length + 1))
    np.testing.assert_array_equal(got[0, 0], np.where(j <= i, i - j + 1, 0))


@pytest.mark.parametrize("npos", [3, 8])
def test_cope_saturated_gates_equal_integer_relative_bias(npos):
    """Positions i − j + 1 are integers: the interpolation must read table row min(i − j + 1, npos − 1) exactly."""
    rng = np.random.default_rng(11)
    length, d = 6, 8
    q, k, v, gate_k = saturating_inputs(rng, 2, length, 4, 2, d)
    pos_emb = normal(rng, npos, d)
    pos_emb[:, 0] = 0.0
    out = cope_attention(*map(jnp.asarray, (q, k, v, pos_emb)), gate_k=jnp.asarray(gate_k), impl="reference")
    sm_scale = d ** -0.5
    bias = np.zeros((2, 4, length, length))
    for b in range(2):
        for h in range(4):
            for i in range(length):
                for j in range(i + 1):
                    bias[b, h, i, j] = sm_scale * f64(q)[b, i, h] @ f64(pos_emb)[min(i - j + 1, npos - 1)]
    np.testing.assert_allclose(out, ref.softmax_attention(f64(q), f64(k), f64(v), bias=bias), **TOL)


def test_cope_interpolation_exact_at_integers_and_linear_between():
    rng = np.random.default_rng(12)
    q, pos_emb = normal(rng, 1, 1, 1, 4), normal(rng, 5, 4)
    z = f64(pos_emb) @ f64(q)[0, 0, 0]  # z_p = q·e[p], [npos]
    positions = np.array([0.0, 1.0, 2.0, 4.0, 0.25, 2.5, 3.75], np.float32)
    got = np.asarray(cope_position_logits(jnp.asarray(q), jnp.asarray(pos_emb),
                                          jnp.asarray(positions)[None, None, None]))[0, 0, 0]
    want = [z[0], z[1], z[2], z[4], 0.75 * z[0] + 0.25 * z[1], 0.5 * z[2] + 0.5 * z[3], 0.25 * z[3] + 0.75 * z[4]]
    np.testing.assert_allclose(got, want, **TOL)


def test_cope_gradient_through_fraction_not_floor():
    """d pos / d p = z_⌈p⌉ − z_⌊p⌋ (no term from ⌊p⌋), also exactly at an integer where ⌊p⌋ jumps; pos is continuous
    there, so a floor-gradient delta would have nothing to stand for."""
    rng = np.random.default_rng(13)
    q, pos_emb = normal(rng, 1, 1, 1, 4), normal(rng, 5, 4)
    z = f64(pos_emb) @ f64(q)[0, 0, 0]

    def pos_logit(p: jax.Array) -> jax.Array:
        return cope_position_logits(jnp.asarray(q), jnp.asarray(pos_emb), p[None, None, None, None])[0, 0, 0, 0]

    grad = jax.grad(pos_logit)
    for p, lo in ((0.3, 0), (1.6, 1), (3.2, 3), (2.0, 2), (1.0, 1)):
        assert math.isclose(float(grad(jnp.float32(p))), z[lo + 1] - z[lo], rel_tol=1e-5, abs_tol=1e-5)
    eps = 1e-3
    below, at, above = (float(pos_logit(jnp.float32(p))) for p in (2.0 - eps, 2.0, 2.0 + eps))
    assert abs(below - at) < 5 * eps * abs(z).max() and abs(above - at) < 5 * eps * abs(z).max()


def test_cope_attention_gradient_matches_finite_differences():
    """jax.grad of a scalar loss of cope_attention against central differences of the float64 reference, along
    random directions in q, k, v, pos_emb and gate_k (the gates reach the loss only through w)."""
    rng = np.random.default_rng(14)
    q, k, v = qkv(rng, 1, 5, 2, 1, 4)
    q *= 2.0
    pos_emb, gate_k = normal(rng, 4, 4), normal(rng, *k.shape)
    weights = normal(rng, 1, 5, 2, 4)
    inputs = [q, k, v, pos_emb, gate_k]

    def loss_jax(*args: jax.Array) -> jax.Array:
        q_, k_, v_, e_, g_ = args
        return jnp.sum(cope_attention(q_, k_, v_, e_, gate_k=g_, impl="reference") * weights)

    def loss_ref(*args: np.ndarray) -> float:
        q_, k_, v_, e_, g_ = args
        return float(np.sum(ref.cope_attention(q_, k_, v_, e_, gate_k=g_) * weights))

    grads = jax.jit(jax.grad(loss_jax, argnums=tuple(range(5))))(*map(jnp.asarray, inputs))
    h = 1e-4
    for index, grad in enumerate(grads):
        direction = rng.standard_normal(inputs[index].shape)
        plus = [f64(a) + (h * direction if n == index else 0.0) for n, a in enumerate(inputs)]
        minus = [f64(a) - (h * direction if n == index else 0.0) for n, a in enumerate(inputs)]
        numeric = (loss_ref(*plus) - loss_ref(*minus)) / (2 * h)
        analytic = float(np.sum(f64(grad) * direction))
        assert math.isclose(analytic, numeric, rel_tol=1e-3, abs_tol=1e-4), (index, analytic, numeric)
    assert np.abs(f64(grads[4])).max() > 1e-3  # the gate keys do receive a gradient


@pytest.mark.parametrize("options", [
    {"npos": 4},
    {"npos": 3, "per_head": True},
    {"npos": 5, "gates": "values"},
    {"npos": 4, "gates": "sep_keys"},
    {"npos": 4, "add_relative": True},
])
def test_cope_core_options_against_numpy(options):
    rng = np.random.default_rng(15)
    q, k, v = qkv(rng, 2, 6, 4, 2, 4)
    x = normal(rng, 2, 6, 8)
    out, params = run_core("cope", options, q, k, v, x, rng)
    gate_k = None
    if options.get("gates") == "values":
        gate_k = f64(v)
    if options.get("gates") == "sep_keys":
        dense = params["gate_key"]
        gate_k = np.einsum("blm,mhd->blhd", f64(x), dense["kernel"]) + dense.get("bias", 0.0)
    extra = None
    if options.get("add_relative"):
        extra = ref.relative_logits(f64(q), params["rel_table"], np.broadcast_to(np.arange(6), (2, 6)), 6)
    want = ref.cope_attention(f64(q), f64(k), f64(v), params["pos_emb"], gate_k=gate_k, extra_logits=extra)
    np.testing.assert_allclose(out, want, **TOL)


# --- CoPE gate-network variant and its RoPE hybrid --------------------------------------------------------------

@pytest.mark.parametrize("name", ["cope_gated", "cope_rope"])
def test_gated_cope_cores_against_numpy(name):
    rng = np.random.default_rng(16)
    q, k, v = qkv(rng, 2, 7, 4, 2, 4)
    x = normal(rng, 2, 7, 8)
    out, params = run_core(name, {"max_pos": 4}, q, k, v, x, rng)
    want = ref.gated_cope_attention(
        f64(q), f64(k), f64(v), f64(x), gate_w=params["gate"]["kernel"], gate_b=params["gate"]["bias"],
        table=params["pos_table"], pos_query=params["pos_query"]["kernel"],
        rope_theta=10000.0 if name == "cope_rope" else None)
    np.testing.assert_allclose(out, want, **TOL)


# --- Co-RoPE ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("hq, hkv, theta", [(2, 2, 10000.0), (4, 2, 10000.0), (4, 1, 50.0)])
def test_corope_attention_against_numpy(hq, hkv, theta):
    rng = np.random.default_rng(17)
    q, k, v = qkv(rng, 2, 6, hq, hkv, 8)
    q *= 2.0
    out = corope_attention(*map(jnp.asarray, (q, k, v)), theta=theta, impl="reference")
    np.testing.assert_allclose(out, ref.corope_attention(f64(q), f64(k), f64(v), theta=theta), **TOL)


def test_corope_mileage_against_numpy():
    rng = np.random.default_rng(18)
    q, k, _ = qkv(rng, 2, 6, 4, 2, 4)
    got = np.asarray(corope_mileage(jnp.asarray(q), jnp.asarray(k), sm_scale=0.7))
    want = ref.corope_mileage(f64(q), f64(k), sm_scale=0.7)
    causal = np.tril(np.ones((6, 6), bool))
    np.testing.assert_allclose(got[..., causal], want[..., causal], **TOL)


@jax.jit
def rope_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array) -> jax.Array:
    """RoPE attention from jaxpe.apply_rope and jax.nn.dot_product_attention (causal, GQA)."""
    q_rot, k_rot = jaxpe.apply_rope(q, positions), jaxpe.apply_rope(k, positions)
    return jax.nn.dot_product_attention(q_rot, k_rot, v, is_causal=True)


@pytest.mark.parametrize("c", [1.0, 0.37, 2.5])
def test_corope_constant_gate_is_rope_with_scaled_frequencies(c):
    """Δ_ij = c·(i − j) is RoPE with every ω_d multiplied by c, i.e. RoPE at positions c·i."""
    rng = np.random.default_rng(19)
    length = 7
    q, k, v = qkv(rng, 2, length, 4, 2, 8)
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    mileage = np.broadcast_to(np.where(j <= i, c * (i - j), 0.0), (2, 2, length, length)).astype(np.float32)
    out = corope_attention_reference(*map(jnp.asarray, (q, k, v)), theta=10000.0, sm_scale=8 ** -0.5,
                                     mileage=jnp.asarray(mileage))
    positions = (c * np.arange(length)).astype(np.float32)
    np.testing.assert_allclose(out, rope_attention(q, k, v, positions), **TOL)
    scaled = ref.rope(f64(q), np.arange(length), omega_scale=c), ref.rope(f64(k), np.arange(length), omega_scale=c)
    np.testing.assert_allclose(out, ref.softmax_attention(*scaled, f64(v)), **TOL)


def test_corope_scores_with_offsets_are_rope_logits():
    rng = np.random.default_rng(20)
    q, k, _ = qkv(rng, 1, 5, 2, 2, 6)
    i, j = np.arange(5)[:, None], np.arange(5)[None, :]
    mileage = np.broadcast_to((i - j).astype(np.float32), (1, 2, 5, 5))
    scores = np.asarray(corope_scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(mileage), sm_scale=1.0))
    want = ref.dot_logits(ref.rope(f64(q), np.arange(5)), ref.rope(f64(k), np.arange(5)))
    np.testing.assert_allclose(scores, want, **TOL)


def test_corope_zero_leader_query_gives_half_speed_rope():
    """A zero leader query makes every gate sigmoid(0) = 1/2: Δ = (i − j)/2 for the whole group, computed by the
    contextual path itself; the non-leader heads then attend exactly like RoPE at positions i/2."""
    rng = np.random.default_rng(21)
    length = 6
    q, k, v = qkv(rng, 1, length, 4, 2, 8)
    q[:, :, 0::2] = 0.0  # leaders of groups 0 and 1 are heads 0 and 2
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    mileage = np.asarray(corope_mileage(jnp.asarray(q), jnp.asarray(k)))
    np.testing.assert_allclose(mileage[0, 0], np.where(j <= i, (i - j) / 2, 0.0), **TOL)
    out = np.asarray(corope_attention(*map(jnp.asarray, (q, k, v)), impl="reference"))
    want = np.asarray(rope_attention(q, k, v, np.arange(length, dtype=np.float32) / 2))
    np.testing.assert_allclose(out[:, :, 1::2], want[:, :, 1::2], **TOL)


def test_corope_leader_is_first_head_of_group():
    rng = np.random.default_rng(22)
    q, k, v = qkv(rng, 1, 6, 6, 2, 4)  # G = 3: groups {0, 1, 2} and {3, 4, 5}, leaders 0 and 3
    q *= 2.0
    run = lambda q_: np.asarray(corope_attention(jnp.asarray(q_), jnp.asarray(k), jnp.asarray(v),
                                                       impl="reference"))
    base = run(q)
    changed = lambda out: [h for h in range(6) if not np.allclose(out[:, 1:, h], base[:, 1:, h], atol=1e-6)]
    for head, expected in ((1, [1]), (5, [5]), (0, [0, 1, 2]), (3, [3, 4, 5])):
        perturbed = q.copy()
        perturbed[:, :, head] += normal(rng, 1, 6, 4)
        assert changed(run(perturbed)) == expected, head


# --- errors -----------------------------------------------------------------------------------------------------

def test_npos_below_two_raises():
    q = jnp.ones((1, 4, 2, 4))
    with pytest.raises(ValueError, match="npos=1 must be"):
        jaxpe.cope_attention(q, q, q, jnp.ones((1, 4)), impl="reference")
    with pytest.raises(ValueError, match="npos=1 must be"):
        jaxpe.pe_config("cope", npos=1)
    with pytest.raises(ValueError, match="npos=1 must be"):
        jaxpe.pe_config("relative", npos=1).core(head_dim=4, max_len=8, impl="reference")
    with pytest.raises(ValueError, match="max_pos=1 must be"):
        jaxpe.pe_config("cope_gated", max_pos=1)


def test_odd_head_dim_raises_for_rotary():
    x = jnp.ones((1, 3, 2, 5))
    with pytest.raises(ValueError, match="head dim D=5 must be even"):
        jaxpe.apply_rope(x, jnp.arange(3))
    with pytest.raises(ValueError, match="head dim D=5 must be even"):
        jaxpe.corope_attention(x, x, x, impl="reference")
    for name in ("rope", "corope", "cope_rope"):
        with pytest.raises(ValueError, match="head dim D=5 must be even"):
            jaxpe.pe_config(name).core(head_dim=5, max_len=8, impl="reference")


@pytest.mark.parametrize("attention", ["cope", "corope"])
def test_qkv_errors(attention):
    def call(q, k, v, **kwargs):
        if attention == "cope":
            return jaxpe.cope_attention(q, k, v, jnp.ones((4, q.shape[-1]), q.dtype), **kwargs)
        return jaxpe.corope_attention(q, k, v, **kwargs)

    q, kv = jnp.ones((1, 4, 3, 4)), jnp.ones((1, 4, 2, 4))
    with pytest.raises(ValueError, match="Hq=3, Hkv=2"):
        call(q, kv, kv, impl="reference")
    q = jnp.ones((1, 4, 2, 4))
    with pytest.raises(ValueError, match="causal=False"):  # the fused kernels are causal (the others are not)
        call(q, q, q, causal=False, impl="pallas")
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        call(q, q, jnp.ones((1, 4, 2, 6)), impl="reference")
    with pytest.raises(ValueError, match="q and k must share batch and head dim"):
        call(q, jnp.ones((1, 4, 2, 6)), jnp.ones((1, 4, 2, 6)), impl="reference")
    with pytest.raises(ValueError, match="q and k must have the same length"):
        call(q, jnp.ones((1, 5, 2, 4)), jnp.ones((1, 5, 2, 4)), impl="reference")
    with pytest.raises(ValueError, match=r"q must have shape \[B L H D\]"):
        call(jnp.ones((4, 2, 4)), q, q, impl="reference")
    with pytest.raises(TypeError, match="q, k, v must share a dtype"):
        call(q.astype(jnp.bfloat16), q, q, impl="reference")
    with pytest.raises(TypeError, match="q must be a floating-point array"):
        call(jnp.ones((1, 4, 2, 4), jnp.int32), q, q, impl="reference")
    with pytest.raises(ValueError, match="impl='fast' must be one of"):
        call(q, q, q, impl="fast")


def test_cope_pos_emb_and_gate_k_errors():
    q = jnp.ones((1, 4, 2, 4))
    with pytest.raises(ValueError, match=r"pos_emb must have shape .*pos_emb.shape=\(5, 3\)"):
        jaxpe.cope_attention(q, q, q, jnp.ones((5, 3)), impl="reference")
    with pytest.raises(ValueError, match=r"pos_emb.shape=\(3, 5, 4\)"):
        jaxpe.cope_attention(q, q, q, jnp.ones((3, 5, 4)), impl="reference")
    with pytest.raises(TypeError, match="pos_emb must be a floating-point array"):
        jaxpe.cope_attention(q, q, q, jnp.ones((5, 4), jnp.int32), impl="reference")
    with pytest.raises(ValueError, match=r"gate_k must match k's shape, got gate_k.shape=\(1, 4, 1, 4\)"):
        jaxpe.cope_attention(q, q, q, jnp.ones((5, 4)), gate_k=jnp.ones((1, 4, 1, 4)), impl="reference")
    with pytest.raises(TypeError, match="gate_k must match k's dtype, got gate_k.dtype=bfloat16"):
        jaxpe.cope_attention(q, q, q, jnp.ones((5, 4)), gate_k=q.astype(jnp.bfloat16), impl="reference")


def test_rope_input_errors():
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        jaxpe.apply_rope(jnp.ones((1, 3, 2, 4), jnp.int32), jnp.arange(3))
    with pytest.raises(ValueError, match="positions must have shape"):
        jaxpe.apply_rope(jnp.ones((1, 3, 2, 4)), jnp.arange(4))


def test_length_beyond_fixed_table_raises():
    x = jnp.ones((1, 5, 6))
    with pytest.raises(ValueError, match="L=5 exceeds the position table's max_len=4"):
        jax.eval_shape(LearnedPE(max_len=4).init, jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="L=5 exceeds the position table's max_len=4"):
        jax.eval_shape(SinusoidalPE(max_len=4).init, jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="L=5 exceeds the position table's max_len=4"):
        jax.eval_shape(jaxpe.AMSPE(6, max_len=4).init, jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match=r"x must have shape \[B, L, d_model=7\]"):
        jax.eval_shape(jaxpe.AMSPE(7, max_len=8).init, jax.random.PRNGKey(0), x)


def test_registry_errors():
    with pytest.raises(ValueError, match="unknown encoding pe='nope'"):
        jaxpe.pe_config("nope")
    with pytest.raises(ValueError, match="unknown option 'npos' for pe='rope'"):
        jaxpe.pe_config("rope", npos=3)
    with pytest.raises(ValueError, match="gates='bogus' must be one of"):
        jaxpe.pe_config("cope", gates="bogus")
    with pytest.raises(ValueError, match="every=0 must be"):
        jaxpe.pe_config("cope", every=0)
    for name in ("sinusoidal", "amspe"):
        with pytest.raises(ValueError, match="amplitude=0.0 must be > 0"):
            jaxpe.pe_config(name, amplitude=0.0)


def test_table_helpers_reject_bad_sizes():
    with pytest.raises(ValueError, match="length=0 must be"):
        jaxpe.sinusoidal_table(0, 4)
    with pytest.raises(ValueError, match="theta=-1.0 must be > 0"):
        jaxpe.sinusoidal_table(3, 4, theta=-1.0)
    with pytest.raises(ValueError, match="num_heads=0 must be"):
        jaxpe.alibi_slopes(0)


def test_registry_lists_every_encoding_in_documented_order():
    """PE_NAMES: no encoding, the additive ones, those acting inside attention, the contextual ones last."""
    assert jaxpe.PE_NAMES == ("none", "learned", "sinusoidal", "amspe", "rope", "alibi", "relative", "cope",
                              "cope_gated", "cope_rope", "corope", "fox", "stickbreaking")


def test_cope_positions_validates_inputs():
    q = jnp.ones((1, 4, 2, 4))
    with pytest.raises(ValueError, match="npos=1 must be"):
        jaxpe.cope_positions(q, q, npos=1)
    with pytest.raises(TypeError, match="q must be a floating-point array"):
        jaxpe.cope_positions(q.astype(jnp.int32), q, npos=3)
    with pytest.raises(ValueError, match="Hq=3, Hkv=2"):
        jaxpe.cope_positions(jnp.ones((1, 4, 3, 4)), jnp.ones((1, 4, 2, 4)), npos=3)


def test_corope_mileage_validates_inputs():
    q = jnp.ones((1, 4, 2, 4))
    with pytest.raises(TypeError, match="q must be a floating-point array"):
        jaxpe.corope_mileage(q.astype(jnp.int32), q)
    with pytest.raises(ValueError, match="Hq=3, Hkv=2"):
        jaxpe.corope_mileage(jnp.ones((1, 4, 3, 4)), jnp.ones((1, 4, 2, 4)))
