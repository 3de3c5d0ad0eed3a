"""Forward mode (jvp, linearize, jacfwd) and second order (Hessian-vector products, grad of grad) through the dense
paths: masked softmax attention, GELU, the paired table gather, CoPE and Co-RoPE (impl "reference", and "auto" at
lengths where it runs them on CPU) and a TransformerLM of every encoding.

References are independent of the code under test: plain jnp restatements of the maths (jax.nn.softmax,
jax.nn.gelu, take_along_axis; CoPE and Co-RoPE written from the formulas and checked against numpy_reference.py)
differentiated by JAX in float64, the closed form GELU''(0) = √(2/π), and central finite differences for the models.
B batch, L length, Hq query heads, Hkv key/value heads, D head dim.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
import numpy_reference as ref
from jaxpe.model import gelu
from jaxpe.tables import gather_table_row_pairs
from jaxpe.softmax_attention import masked_softmax_attention

TOL = dict(rtol=2e-4, atol=2e-5)  # float32 code against float64 restatements
SELF_TOL = dict(rtol=1e-5, atol=1e-6)  # two modes of the same float32 code
# Each test compiles a few programs once: XLA's expensive optimisations would cost more than running them.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def compiled(f, **kw):
    return jax.jit(f, compiler_options=FAST_COMPILE, **kw)


def f64(tree):
    """float64 copies (inside jax.enable_x64, a context manager on jax 0.10 and 0.12)."""
    return jax.tree_util.tree_map(lambda x: jnp.asarray(np.asarray(x, np.float64)), tree)


def close(actual, desired, **tol) -> None:
    jax.tree_util.tree_map(lambda a, d: np.testing.assert_allclose(np.asarray(a, np.float64),
                                                                   np.asarray(d, np.float64), **tol), actual, desired)


def normal(seed: int, *shapes: tuple[int, ...], scale: float = 1.0) -> list[jax.Array]:
    """float32 standard normals from NumPy (an eager jax.random call would compile a program per shape)."""
    rng = np.random.default_rng(seed)
    return [jnp.asarray(scale * rng.standard_normal(s), jnp.float32) for s in shapes]


def hvp_forward_over_reverse(f, x, t):
    return jax.jvp(jax.grad(f), (x,), (t,))[1]


def hvp_reverse_over_reverse(f, x, t):
    return jax.grad(lambda y: tree_vdot(jax.grad(f)(y), t))(x)


def tree_vdot(a, b) -> jax.Array:
    return sum(jnp.vdot(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


# --- plain restatements (float64 under x64) ----------------------------------------------------------------------

def plain_softmax_attention(logits, v, mask):
    """logits [B, Hq, Lq, Lk], v [B, Lk, Hkv, D], mask [B|1, Lq, Lk] -> [B, Lq, Hq, D]; rows with no key give 0."""
    p = jax.nn.softmax(jnp.where(mask[:, None], logits, -jnp.inf), axis=-1)
    p = jnp.where(jnp.any(mask, axis=-1)[:, None, :, None], p, 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, jnp.repeat(v, logits.shape[1] // v.shape[2], axis=2))


def plain_cope(q, k, v, pos_emb):
    """CoPE (arXiv:2405.18719) from its five steps: gates σ(q·k/√D), p_ij = Σ_{t=j..i} g_it clamped to npos − 1,
    pos_ij = interpolation of q_i·e[p] between ⌊p⌋ and ⌈p⌉, softmax((q·k + pos)/√D) v."""
    length, hq, dim = q.shape[1:]
    npos = pos_emb.shape[0]
    k, v = (jnp.repeat(x, hq // x.shape[2], axis=2) for x in (k, v))
    causal = jnp.tril(jnp.ones((1, 1, length, length), bool))
    qk = jnp.einsum("bihd,bjhd->bhij", q, k)
    gates = jnp.where(causal, jax.nn.sigmoid(qk / math.sqrt(dim)), 0.0)
    p = jnp.minimum(jnp.flip(jnp.cumsum(jnp.flip(gates, -1), -1), -1), npos - 1)
    z = jnp.einsum("bihd,pd->bhip", q, pos_emb)
    lo = jax.lax.stop_gradient(jnp.floor(p))
    w = p - lo
    lo = lo.astype(jnp.int32)
    at = lambda rows: jnp.take_along_axis(z, rows, axis=-1)  # noqa: E731
    logits = jnp.where(causal, (qk + (1 - w) * at(lo) + w * at(jnp.minimum(lo + 1, npos - 1))) / math.sqrt(dim),
                       -jnp.inf)
    return jnp.einsum("bhij,bjhd->bihd", jax.nn.softmax(logits, axis=-1), v)


def plain_corope(q, k, v, theta=10000.0):
    """Co-RoPE: leader-head gates z_ij = σ(q^leader_i·k_j/√D), Δ_ij = Σ_{t=j+1..i} z_it, φ = Δ·θ^(−2d/D),
    score = Σ_d (E_A cos φ − E_B sin φ)/√D, E_A = q1k1 + q2k2, E_B = q2k1 − q1k2."""
    length, hq, dim = q.shape[1:]
    groups = hq // k.shape[2]
    causal = jnp.tril(jnp.ones((1, 1, length, length), bool))
    z = jnp.where(causal, jax.nn.sigmoid(jnp.einsum("bigd,bjgd->bgij", q[:, :, ::groups], k) / math.sqrt(dim)), 0.0)
    a = jnp.cumsum(z, axis=-1)
    delta = jnp.diagonal(a, axis1=-2, axis2=-1)[..., None] - a  # [B, Hkv, L, L]
    delta = jnp.repeat(delta, groups, axis=1)  # [B, Hq, L, L]
    omega = theta ** (-2.0 * jnp.arange(dim // 2) / dim)
    phi = delta[..., None] * omega.reshape(1, 1, 1, 1, -1)  # [B, Hq, L, L, D/2]
    k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))
    (q1, q2), (k1, k2) = jnp.split(q, 2, axis=-1), jnp.split(k, 2, axis=-1)
    pair = lambda a, b: jnp.einsum("bihd,bjhd->bhijd", a, b)  # noqa: E731
    e_a, e_b = pair(q1, k1) + pair(q2, k2), pair(q2, k1) - pair(q1, k2)
    scores = jnp.sum(e_a * jnp.cos(phi) - e_b * jnp.sin(phi), axis=-1) / math.sqrt(dim)
    return jnp.einsum("bhij,bjhd->bihd", jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1), v)


# --- masked softmax attention ------------------------------------------------------------------------------------

def test_masked_softmax_attention_forward_mode_and_second_order_match_plain_softmax():
    """GQA (Hq 4, Hkv 2), 5 queries over 7 keys, a padded key and one query that sees no key (zero output and
    tangent). Tangents on logits and v together and on each alone (the other one's tangent is a symbolic zero);
    jacfwd == jacrev, linearize == jvp, both Hessian-vector products, and a bfloat16 v."""
    logits, v, d_logits, d_v, weights = normal(0, (2, 4, 5, 7), (2, 7, 2, 8), (2, 4, 5, 7), (2, 7, 2, 8),
                                               (2, 5, 4, 8))
    mask = np.broadcast_to(np.arange(7)[None, :] <= np.arange(5)[:, None] + 2, (2, 5, 7)).copy()  # queries last
    mask[1, :, 3] = False
    mask[1, 2] = False
    mask = jnp.asarray(mask)

    def derivatives(attention, lg, vv, dl, dv, w):
        f = lambda a, b: attention(a, b, mask)  # noqa: E731
        loss = lambda a: jnp.sum(jnp.sin(f(a, vv) * w))  # noqa: E731
        return dict(both=jax.jvp(f, (lg, vv), (dl, dv)), logits=jax.jvp(lambda a: f(a, vv), (lg,), (dl,))[1],
                    v=jax.jvp(lambda b: f(lg, b), (vv,), (dv,))[1], hvp=hvp_forward_over_reverse(loss, lg, dl))

    @compiled
    def more(lg, vv, dl, dv, w):
        f = lambda a, b: masked_softmax_attention(a, b, mask)  # noqa: E731
        loss = lambda a: jnp.sum(jnp.sin(f(a, vv) * w))  # noqa: E731
        return dict(jacfwd=jax.jacfwd(f, argnums=(0, 1))(lg, vv), jacrev=jax.jacrev(f, argnums=(0, 1))(lg, vv),
                    linearized=jax.linearize(f, lg, vv)[1](dl, dv), hvp_reverse=hvp_reverse_over_reverse(loss, lg, dl),
                    bf16=jax.jvp(f, (lg, vv.astype(jnp.bfloat16)), (dl, dv.astype(jnp.bfloat16))))

    got = compiled(derivatives, static_argnums=0)(masked_softmax_attention, logits, v, d_logits, d_v, weights)
    with jax.enable_x64(True):
        want = compiled(derivatives, static_argnums=0)(plain_softmax_attention,
                                                       *f64((logits, v, d_logits, d_v, weights)))
    close(got, want, **TOL)
    np.testing.assert_array_equal(np.asarray(got["both"][1])[1, 2], 0.0)
    extra = more(logits, v, d_logits, d_v, weights)
    close(extra["jacfwd"], extra["jacrev"], **SELF_TOL)
    close(extra["linearized"], got["both"][1], **SELF_TOL)
    close(extra["hvp_reverse"], got["hvp"], **SELF_TOL)
    out16, tangent16 = extra["bf16"]
    assert out16.dtype == tangent16.dtype == jnp.bfloat16
    close(tangent16, got["both"][1], rtol=3e-2, atol=3e-2)


# --- GELU and the paired gather ----------------------------------------------------------------------------------

def test_gelu_forward_mode_and_second_order_match_jax_nn_gelu():
    x, dx = normal(0, (64,), (64,))
    x = 3.0 * x

    def derivatives(g, y, dy):
        return dict(jvp=jax.jvp(g, (y,), (dy,))[1], linearized=jax.linearize(g, y)[1](dy),
                    grad_of_grad=jax.vmap(jax.grad(jax.grad(g)))(y),
                    jacfwd_of_grad=jax.vmap(jax.jacfwd(jax.grad(g)))(y),
                    at_zero=jax.grad(jax.grad(g))(jnp.zeros((), y.dtype)))

    got = compiled(derivatives, static_argnums=0)(gelu, x, dx)
    with jax.enable_x64(True):
        plain = compiled(derivatives, static_argnums=0)(lambda y: jax.nn.gelu(y, approximate=True), *f64((x, dx)))
    plain.update(linearized=plain["jvp"], jacfwd_of_grad=plain["grad_of_grad"])
    close(got, plain, rtol=2e-4, atol=1e-4)  # f32 cancels in 1 − tanh² at |x| of 5 to 10
    np.testing.assert_allclose(got["at_zero"], math.sqrt(2.0 / math.pi), rtol=1e-6)  # GELU''(0) = √(2/π)


def test_gather_table_row_pairs_forward_mode_is_the_gather_of_the_tangents():
    z, y, dz, dy = normal(0, (2, 3, 2, 5), (2, 3, 2, 5), (2, 3, 2, 5), (2, 3, 2, 5))
    index = np.random.default_rng(1).integers(0, 5, (2, 2, 3, 4))
    take = lambda t: np.take_along_axis(np.transpose(t, (0, 2, 1, 3)), index, axis=-1)  # noqa: E731
    index = jnp.asarray(index, jnp.int32)
    f = lambda a, b: gather_table_row_pairs(a, b, index)  # noqa: E731

    @compiled
    def derivatives(a, b, da, db):
        loss = lambda c: jnp.sum(jnp.sin(f(c, b)[0]) * f(c, b)[1])  # noqa: E731
        plain = lambda c: jnp.sum(jnp.sin(take(c)) * take(b))  # noqa: E731
        return dict(jvp=jax.jvp(f, (a, b), (da, db)), linearized=jax.linearize(f, a, b)[1](da, db),
                    jacfwd=jax.jacfwd(f, argnums=(0, 1))(a, b), jacrev=jax.jacrev(f, argnums=(0, 1))(a, b),
                    hvp=hvp_forward_over_reverse(loss, a, da), plain_hvp=hvp_forward_over_reverse(plain, a, da))

    got = derivatives(z, y, dz, dy)
    close(got["jvp"], ((take(z), take(y)), (take(dz), take(dy))), rtol=0, atol=0)
    close(got["linearized"], got["jvp"][1], rtol=0, atol=0)
    close(got["jacfwd"], got["jacrev"], rtol=0, atol=0)
    close(got["hvp"], got["plain_hvp"], **SELF_TOL)


# --- CoPE and Co-RoPE --------------------------------------------------------------------------------------------

def contextual(name: str, impl: str, pos_emb: jax.Array):
    """(jaxpe's attention, its plain restatement), each f(q, k, v) -> [B, L, Hq, D]."""
    if name == "cope":
        return (lambda q, k, v: jaxpe.cope_attention(q, k, v, pos_emb, impl=impl),
                lambda q, k, v: plain_cope(q, k, v, pos_emb.astype(q.dtype)))
    return lambda q, k, v: jaxpe.corope_attention(q, k, v, impl=impl), plain_corope


def attention_derivatives(f, q, k, v, dq, dk, dv, weights):
    """Forward mode along (dq, dk, dv) and the Hessian-vector product along dq of Σ sin(f(q, k, v)·weights)."""
    loss = lambda x: jnp.sum(jnp.sin(f(x, k, v)) * weights)  # noqa: E731
    return dict(jvp=jax.jvp(f, (q, k, v), (dq, dk, dv)), hvp=hvp_forward_over_reverse(loss, q, dq))


@pytest.mark.parametrize("name,impl,length", [("cope", "reference", 6), ("corope", "reference", 6),
                                              ("cope", "auto", 48)])
def test_contextual_attention_forward_mode_and_second_order_match_plain_restatement(name, impl, length):
    """q [1, L, 4, 8], k/v [1, L, 2, 8] (GQA), a table of L + 1 rows (no clamping): jvp and the Hessian-vector
    product (forward over reverse) against the float64 restatement, which itself matches numpy_reference.py; at
    L = 6 also linearize and reverse over reverse. impl "auto" at 48 runs CoPE's dense path by causal query blocks
    (the TransformerLM tests below run "auto" at L = 6: the one-block dense paths)."""
    shapes = [(1, length, 4, 8), (1, length, 2, 8), (1, length, 2, 8)]
    primals, tangents = normal(0, *shapes), normal(1, *shapes)
    pos_emb, weights = normal(2, (length + 1, 8), shapes[0], scale=0.5)
    f, plain = contextual(name, impl, pos_emb)
    short = length < 48

    @compiled
    def derivatives(*args):
        q, k, v, dq = args[:4]
        if not short:
            return attention_derivatives(f, *args)
        loss = lambda x: jnp.sum(jnp.sin(f(x, k, v)) * weights)  # noqa: E731
        return dict(attention_derivatives(f, *args), linearized=jax.linearize(f, q, k, v)[1](*args[3:6]),
                    hvp_reverse=hvp_reverse_over_reverse(loss, q, dq))

    got = derivatives(*primals, *tangents, weights)
    with jax.enable_x64(True):
        want = compiled(attention_derivatives, static_argnums=0)(plain, *f64((*primals, *tangents, weights)))
    if short:
        arrays = [np.asarray(x, np.float64) for x in primals]
        restated = (ref.cope_attention(*arrays, np.asarray(pos_emb, np.float64)) if name == "cope"
                    else ref.corope_attention(*arrays))
        np.testing.assert_allclose(want["jvp"][0], restated, rtol=1e-12, atol=1e-12)
        close(got["linearized"], got["jvp"][1], **SELF_TOL)
        close(got["hvp"], got["hvp_reverse"], **SELF_TOL)
    close(got["jvp"], want["jvp"], **TOL)
    close(got["hvp"], want["hvp"], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("name", ["cope", "corope"])
def test_contextual_attention_jacfwd_equals_jacrev(name):
    q, k, v = normal(0, (1, 4, 2, 4), (1, 4, 1, 4), (1, 4, 1, 4))
    f = lambda x: contextual(name, "reference", 0.5 * v[0, :, 0])[0](x, k, v)  # noqa: E731
    got = compiled(lambda x: (jax.jacfwd(f)(x), jax.jacrev(f)(x)))(q)
    close(*got, **SELF_TOL)


# --- TransformerLM of every encoding -----------------------------------------------------------------------------

VOCAB = 11


def tiny_model(pe: str) -> tuple[jaxpe.TransformerLM, dict, jax.Array]:
    """tests/tiny_config.py's model (d_model 16, one layer, 2 heads, max_len 16) without dropout, 2 × 6 tokens: at
    that length impl "auto" runs the dense CoPE and Co-RoPE on CPU. Parameters are NumPy normals of scale 0.3 in
    the shapes of model.init (traced, not compiled)."""
    config = jaxpe.ModelConfig(vocab_size=VOCAB, d_model=16, num_layers=1, num_heads=2, max_len=16, pe=pe,
                               dropout=0.0)
    model = jaxpe.TransformerLM(config)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, VOCAB, (2, 6)), jnp.int32)
    shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(1), tokens)["params"])
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    return model, treedef.unflatten(normal(5, *(x.shape for x in leaves), scale=0.3)), tokens


@pytest.mark.parametrize("pe", jaxpe.PE_NAMES)
def test_transformer_forward_mode_and_hessian_vector_product(pe):
    """Forward mode: jvp of the loss along a random direction t == ⟨grad, t⟩ == the central difference of the loss.
    Second order: the Hessian-vector product along t (jvp of value_and_grad, forward over reverse) == the central
    difference of the gradients."""
    model, params, tokens = tiny_model(pe)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    t = treedef.unflatten(normal(4, *(x.shape for x in leaves), scale=0.1))
    eps = 1e-3

    def loss(p):
        return jnp.mean(jax.nn.log_softmax(model.apply({"params": p}, tokens))[..., 0] ** 2)

    @compiled
    def derivatives(p):
        return jax.jvp(loss, (p,), (t,))[1], jax.jvp(jax.value_and_grad(loss), (p,), (t,))

    shifted = lambda s: jax.tree_util.tree_map(lambda x, y: np.asarray(x) + s * np.asarray(y), params, t)  # noqa: E731
    tangent, ((_, grad), (_, hvp)) = jax.tree_util.tree_map(np.asarray, derivatives(params))
    _, ((value_up, grad_up), _) = derivatives(shifted(eps))
    _, ((value_down, grad_down), _) = derivatives(shifted(-eps))
    close(tangent, sum(np.vdot(g, d) for g, d in zip(jax.tree_util.tree_leaves(grad), jax.tree_util.tree_leaves(t))),
          rtol=1e-4, atol=1e-6)
    close(tangent, (value_up - value_down) / (2 * eps), rtol=1e-2, atol=2e-3)
    grad_difference = jax.tree_util.tree_map(lambda a, b: (np.asarray(a) - np.asarray(b)) / (2 * eps),
                                             grad_up, grad_down)
    scale = max(np.abs(x).max() for x in jax.tree_util.tree_leaves(hvp))
    close(hvp, grad_difference, rtol=0, atol=1e-2 * scale)
