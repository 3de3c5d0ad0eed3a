"""The cheaper pieces of the CPU training step compute what their plain restatements compute.

- CoPE's interpolation from flat gathers (`interpolate_table_rows`) == take_along_axis reads, values and
  gradients;
- the gate suffix sums as a triangular matmul (`reverse_cumsum_keys`) == the associative scan;
- CoPE by causal query blocks (`cope_attention_causal`) == one block (`cope_attention_reference`), with documents,
  windows, separate gate keys, x-transformers' variants and cope+rel logits, values and gradients, and NumPy;
- two tables read by one complex gather (`gather_table_row_pairs`) == two gathers, values and gradients;
- relative position logits from a flat gather == take_along_axis;
- softmax attention with its written-out backward (`masked_softmax_attention`, `attend`) == autodiff of the
  softmax formula and `jax.nn.dot_product_attention`, values and gradients (GQA, bias, documents, windows, rows
  with no visible key);
- GELU with its one-pass backward (`jaxpe.model.gelu`) == `jax.nn.gelu(approximate=True)`;
- dropout masks from a counter hash (`jaxpe.dropout`) are Bernoulli(1 − rate): rate, independence of neighbours,
  of calls and of keys, and flax's scaling.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_reference as ref
from kernel_harness import square_intermediates_of_grad
from jaxpe.cope import (cope_attention, cope_attention_causal, cope_attention_reference, interpolate_table_rows,
                        reverse_cumsum_keys)
from jaxpe.dropout import Dropout, dropout, keep_mask
from jaxpe.model import gelu
from jaxpe.kernels._common import interpolate
from jaxpe.tables import relative_logits
from jaxpe.softmax_attention import (attend, causal_mask, causal_query_blocks, masked_softmax_attention, reverse_cumsum,
                                     visibility_mask)
from jaxpe.tables import gather_table_row_pairs, gather_table_rows


def _positions(key, shape, size):
    p = jax.random.uniform(key, shape, minval=0.0, maxval=size - 1.0)
    return p.at[..., 0].set(size - 1.0).at[..., 1].set(0.0).at[..., 2].set(float(min(3, size - 1)))  # ends, integer


@pytest.mark.parametrize("b,lq,h,lk,size", [(2, 5, 3, 7, 9), (1, 4, 1, 6, 2), (2, 8, 2, 8, 10)])
def test_interpolate_table_rows_matches_take_along_axis_with_gradients(key, b, lq, h, lk, size):
    kz, kp, kc = jax.random.split(key, 3)
    z = jax.random.normal(kz, (b, lq, h, size))  # [B, Lq, H, P]
    p = _positions(kp, (b, h, lq, lk), size)
    ct = jax.random.normal(kc, (b, h, lq, lk))

    def reference(z, p):
        zt = jnp.transpose(z, (0, 2, 1, 3))
        return interpolate(lambda index: jnp.take_along_axis(zt, index, axis=-1), p, size).value

    np.testing.assert_allclose(interpolate_table_rows(z, p), reference(z, p), rtol=1e-6, atol=1e-6)
    cotangents = jax.jit(lambda f, z, p: jax.vjp(f, z, p)[1](ct), static_argnums=0)  # one compile, not one per op
    got, want = cotangents(interpolate_table_rows, z, p), cotangents(reference, z, p)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_interpolate_table_rows_ignores_a_non_finite_next_row_at_integer_positions():
    z = jnp.array([1.0, 2.0, jnp.nan]).reshape(1, 1, 1, 3)
    got = interpolate_table_rows(z, jnp.array([1.0, 0.5, 1.5]).reshape(1, 1, 1, 3))
    np.testing.assert_array_equal(got[..., :2], [[[[2.0, 1.5]]]])
    assert np.isnan(got[..., 2]).all()


@pytest.mark.parametrize("length", [1, 47, 48, 61, 97])
def test_causal_query_blocks_tile_the_queries(length):
    blocks = causal_query_blocks(length)
    assert blocks[0][0] == 0 and blocks[-1][1] == length
    assert all(end == start for (_, end), (start, _) in zip(blocks[:-1], blocks[1:]))
    assert len(blocks) == (1 if length < 48 else 3)


@pytest.mark.parametrize("length, case", [(48, "plain"), (61, "documents"), (97, "variants"), (50, "relative")])
def test_cope_query_blocks_equal_one_block(key, length, case):
    """Query blocks give the one-block result: values and all gradients, under documents and windows, with
    separate gate keys, talking heads with the soft one-hot readout, and cope+rel logits."""
    kq, kk, kv, ke, kg, kx, kc, kt = jax.random.split(key, 8)
    q = 2.0 * jax.random.normal(kq, (2, length, 4, 8))  # spread the gates so positions are fractional
    k, v = jax.random.normal(kk, (2, length, 2, 8)), jax.random.normal(kv, (2, length, 2, 8))
    pos_emb = jax.random.normal(ke, (40, 8))  # fewer rows than keys: positions clamp
    gate_k = jax.random.normal(kg, k.shape) if case == "documents" else None
    ids = jnp.asarray(np.repeat([[0, 1, 1, 2]], 2, 0).repeat(-(-length // 4), 1)[:, :length])
    mask = visibility_mask(length, length, segment_ids=ids, window=30) if case == "documents" else None
    extra = jax.random.normal(kx, (2, 4, length, length)) if case == "relative" else None
    kw = dict(soft_onehot_temp=0.3, talking_heads=jnp.eye(4) + 0.1 * jax.random.normal(kt, (4, 4))) if (
        case == "variants") else {}
    ct = jax.random.normal(kc, q.shape)

    def run(fn):
        @jax.jit
        def with_grads(*args):
            out, pullback = jax.vjp(lambda *a: fn(*a[:4], sm_scale=0.4, gate_k=a[4], mask=mask, extra_logits=extra,
                                                    **kw), *args)
            return out, pullback(ct)

        return with_grads(q, k, v, pos_emb, gate_k)

    (out, grads), (want, want_grads) = run(cope_attention_causal), run(cope_attention_reference)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    for got, expected in zip(grads, want_grads):
        if expected is not None:
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_cope_attention_by_query_blocks_matches_numpy(key):
    kq, kk, kv, ke = jax.random.split(key, 4)
    q = 2.0 * jax.random.normal(kq, (1, 49, 2, 4))
    k, v, pos_emb = jax.random.normal(kk, (1, 49, 2, 4)), jax.random.normal(kv, (1, 49, 2, 4)), jax.random.normal(
        ke, (50, 4))
    out = jax.jit(functools.partial(cope_attention_causal, sm_scale=0.5))(q, k, v, pos_emb)
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    np.testing.assert_allclose(out, ref.cope_attention(f64(q), f64(k), f64(v), f64(pos_emb)), rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="impl='auto' picks the dense path on CPU only")
def test_auto_runs_query_blocks_and_reference_one_block():
    """On CPU impl="auto" takes the query blocks (no [B, H, L, L] intermediate in the gradient's jaxpr at L = 48;
    the suffix sums' [L, L] triangle is no score), the explicit "reference" the one-block ground truth (which has
    them)."""
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 48, 2, 4))
    pos_emb = jnp.zeros((49, 4))
    scores = lambda impl: [shape for shape in square_intermediates_of_grad(  # noqa: E731
        functools.partial(cope_attention, impl=impl), q, q, q, pos_emb, size=48) if len(shape) == 4]
    squares = {impl: scores(impl) for impl in ("auto", "reference")}
    assert squares["auto"] == [] and squares["reference"]


@pytest.mark.parametrize("b,lq,h,lk,size", [(2, 5, 3, 7, 9), (1, 1, 1, 1, 1), (3, 4, 2, 9, 6)])
def test_gather_table_row_pairs_equals_two_gathers_with_gradients(key, b, lq, h, lk, size):
    """One complex gather of (z, y) == two real gathers, values and gradients (a repeated index sums)."""
    kz, ky, ki, kc, kd = jax.random.split(key, 5)
    z, y = jax.random.normal(kz, (b, lq, h, size)), jax.random.normal(ky, (b, lq, h, size))
    index = jax.random.randint(ki, (b, h, lq, lk), 0, size)
    cts = jax.random.normal(kc, index.shape), jax.random.normal(kd, index.shape)
    pairs = lambda z, y: gather_table_row_pairs(z, y, index)  # noqa: E731
    twice = lambda z, y: (gather_table_rows(z, index), gather_table_rows(y, index))  # noqa: E731
    for got, want in zip(pairs(z, y), twice(z, y)):
        np.testing.assert_array_equal(got, want)
    # by hand: entry (0, 0, 0, 0) reads row index[0, 0, 0, 0] of query 0, head 0
    assert pairs(z, y)[1][0, 0, 0, 0] == y[0, 0, 0, index[0, 0, 0, 0]]
    cotangents = jax.jit(lambda f, z, y: jax.vjp(f, z, y)[1](cts), static_argnums=0)  # one compile, not one per op
    for got, want in zip(cotangents(pairs, z, y), cotangents(twice, z, y)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("length", [1, 7, 80, 300])
def test_reverse_cumsum_keys_matches_the_scan(key, length):
    gates = jax.nn.sigmoid(jax.random.normal(key, (2, 3, 4, length)))
    ct = jnp.ones_like(gates)

    # one program per side: op by op, each of the scan's many small ops would compile again at every length
    @functools.partial(jax.jit, static_argnums=1)
    def value_and_cotangent(gates, f):
        out, vjp = jax.vjp(f, gates)
        return out, vjp(ct)[0]

    for got, want in zip(value_and_cotangent(gates, reverse_cumsum_keys), value_and_cotangent(gates, reverse_cumsum)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_relative_logits_match_take_along_axis(key):
    kq, kt = jax.random.split(key)
    q = jax.random.normal(kq, (2, 6, 3, 4))
    table = jax.random.normal(kt, (5, 4))
    q_pos = jnp.array([[0, 1, 2, 3, 4, 5], [0, 1, 0, 1, 2, 3]], jnp.int32)

    def reference(q, table):
        z = jnp.einsum("bqhd,pd->bhqp", q, table)
        rel = jnp.clip(q_pos[:, :, None] - q_pos[:, None, :], 0, 4)
        return jnp.take_along_axis(z, jnp.broadcast_to(rel[:, None], (2, 3, 6, 6)), axis=-1)

    got = relative_logits(q, table, q_pos, q_pos)
    np.testing.assert_allclose(got, reference(q, table), rtol=1e-5, atol=1e-5)
    ct = jnp.ones_like(got)
    for g, w in zip(jax.vjp(lambda q, t: relative_logits(q, t, q_pos, q_pos), q, table)[1](ct),
                    jax.vjp(reference, q, table)[1](ct)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("keep", [0.9, 0.5, 0.02])
def test_keep_mask_is_bernoulli(keep):
    n = 1 << 20
    mask = np.asarray(keep_mask(jax.random.PRNGKey(3), (n,), keep))
    assert abs(mask.mean() - keep) < 5 * np.sqrt(keep * (1 - keep) / n)
    x = mask.astype(np.float64) - keep  # neighbours, rows of a [B, L, d] layout and far apart elements
    for lag in (1, 2, 128, 4096):
        corr = (x[:-lag] * x[lag:]).mean() / (keep * (1 - keep))
        assert abs(corr) < 5 / np.sqrt(n), lag


def test_keep_masks_of_different_keys_are_independent():
    n = 1 << 18
    a = np.asarray(keep_mask(jax.random.PRNGKey(0), (n,), 0.5))
    b = np.asarray(keep_mask(jax.random.PRNGKey(1), (n,), 0.5))
    folded = np.asarray(keep_mask(jax.random.fold_in(jax.random.PRNGKey(0), 1), (n,), 0.5))
    for other in (b, folded):
        assert abs((a == other).mean() - 0.5) < 5 * 0.5 / np.sqrt(n)


def test_dropout_scales_kept_values_and_passes_through_when_deterministic(key):
    x = jnp.arange(1.0, 1001.0).reshape(10, 100)
    y = dropout(x, 0.25, key)
    kept = y != 0
    np.testing.assert_allclose(y[kept], x[kept] / 0.75, rtol=1e-6)
    assert dropout(x, 0.0, key) is x
    module = Dropout(0.3)
    assert module.apply({}, x, deterministic=True) is x
    z = module.apply({}, x, deterministic=False, rngs={"dropout": key})
    assert 0.5 < float((z != 0).mean()) < 0.9
    with pytest.raises(ValueError, match="rate"):
        dropout(x, 1.0, key)



def _softmax_attention_by_formula(logits, v, mask):
    """p = softmax over the visible keys (0 for a row with none), out = p·v with query head h reading head h // G."""
    logits = jnp.where(mask[:, None], logits, -jnp.inf)
    top = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0))
    p = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
    v = jnp.repeat(v, logits.shape[1] // v.shape[2], axis=2)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("b,hq,hkv,lq,lk,d", [(2, 4, 2, 7, 7, 5), (1, 3, 3, 4, 9, 8), (2, 6, 1, 1, 5, 4)])
def test_masked_softmax_attention_backward_matches_autodiff_of_the_formula(key, b, hq, hkv, lq, lk, d):
    kl, kv, kw, km = jax.random.split(key, 4)
    logits = 3.0 * jax.random.normal(kl, (b, hq, lq, lk))
    v = jax.random.normal(kv, (b, lk, hkv, d))
    w = jax.random.normal(kw, (b, lq, hq, d))
    mask = causal_mask(lq, lk) & jax.random.bernoulli(km, 0.7, (b, lq, lk))
    mask = mask.at[0, 0].set(False)  # a row with no visible key: zeros, and no gradient
    loss = lambda fn: lambda x, y: jnp.sum(fn(x, y, mask) * w)
    out = masked_softmax_attention(logits, v, mask)
    np.testing.assert_allclose(out, _softmax_attention_by_formula(logits, v, mask), atol=1e-6)
    np.testing.assert_array_equal(out[0, 0], 0.0)
    ours = jax.jit(jax.grad(loss(masked_softmax_attention), argnums=(0, 1)))(logits, v)  # jit: one compile, not
    theirs = jax.jit(jax.grad(loss(_softmax_attention_by_formula), argnums=(0, 1)))(logits, v)  # one per op
    for a, b_ in zip(ours, theirs):
        np.testing.assert_allclose(a, b_, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(jnp.where(mask[:, None], 0.0, ours[0]), 0.0)  # hidden logits get no gradient


def test_masked_softmax_attention_keeps_low_precision_values_and_their_gradient_dtype(key):
    logits = jax.random.normal(key, (1, 2, 3, 3))
    v = jax.random.normal(jax.random.fold_in(key, 1), (1, 3, 2, 4)).astype(jnp.bfloat16)
    mask = causal_mask(3, 3)
    out = masked_softmax_attention(logits, v, mask)
    dv = jax.grad(lambda v: masked_softmax_attention(logits, v, mask).astype(jnp.float32).sum())(v)
    assert out.dtype == dv.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), _softmax_attention_by_formula(logits, v.astype(jnp.float32),
                                                                                      mask), atol=1e-2)


@pytest.mark.parametrize("case", ["causal", "window", "documents", "bias", "mask"])
def test_attend_matches_jax_dot_product_attention_with_gradients(key, case):
    b, l, hq, hkv, d = 2, 9, 4, 2, 8
    kq, kk, kv, kb, kw, ks = jax.random.split(key, 6)
    q, k, v = (jax.random.normal(kx, (b, l, h, d)) for kx, h in ((kq, hq), (kk, hkv), (kv, hkv)))
    w = jax.random.normal(kw, (b, l, hq, d))
    bias = jax.random.normal(kb, (1, hq, l, l)) if case == "bias" else None
    segments = jnp.array([[0] * 4 + [1] * 5, [0] * 9]) if case == "documents" else None
    window = 3 if case == "window" else None
    mask = (causal_mask(l, l) & jax.random.bernoulli(ks, 0.8, (b, l, l))).at[:, :, 0].set(True) \
        if case == "mask" else None
    full = visibility_mask(l, l, segment_ids=segments, window=window) if mask is None else mask

    def ours(q, k, v):
        return jnp.sum(attend(q, k, v, sm_scale=d ** -0.5, mask=mask, bias=bias, segment_ids=segments,
                              window=window) * w)

    def theirs(q, k, v):
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, bias=bias, mask=full[:, None], scale=d ** -0.5) * w)

    grads = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)  # one compile, not one per op
    (ours_value, ours_grads), (theirs_value, theirs_grads) = grads(ours), grads(theirs)
    np.testing.assert_allclose(ours_value, theirs_value, rtol=1e-5)
    for a, b_ in zip(ours_grads, theirs_grads):
        np.testing.assert_allclose(a, b_, atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gelu_matches_jax_tanh_gelu_with_gradients(dtype):
    x = jnp.concatenate([jnp.linspace(-30.0, 30.0, 601), jnp.array([0.0, -1e-4, 1e-4])]).astype(dtype)
    np.testing.assert_allclose(gelu(x).astype(jnp.float32), jax.nn.gelu(x, approximate=True).astype(jnp.float32),
                               atol=1e-6 if dtype == jnp.float32 else 1e-2, rtol=1e-6 if dtype == jnp.float32 else 1e-2)
    grad = lambda fn: jax.grad(lambda x: jnp.sum(fn(x).astype(jnp.float32)))(x)
    assert grad(gelu).dtype == dtype
    np.testing.assert_allclose(grad(gelu).astype(jnp.float32),
                               grad(lambda x: jax.nn.gelu(x, approximate=True)).astype(jnp.float32),
                               atol=1e-5 if dtype == jnp.float32 else 2e-2, rtol=1e-5 if dtype == jnp.float32 else 2e-2)


@pytest.mark.parametrize("q_shape,kv_shape,dtype,error,message", [
    ((1, 4, 3, 8), (1, 4, 2, 8), jnp.float32, ValueError, "multiple of key/value heads"),
    ((1, 4, 2, 8), (1, 4, 2, 4), jnp.float32, ValueError, "head dim"),
    ((1, 4, 8), (1, 4, 8), jnp.float32, ValueError, "q"),
    ((1, 4, 2, 8), (1, 4, 2, 8), jnp.bfloat16, TypeError, "dtype"),
])
def test_attend_names_bad_inputs(q_shape, kv_shape, dtype, error, message):
    q, kv = jnp.zeros(q_shape), jnp.zeros(kv_shape, dtype)
    with pytest.raises(error, match=message):
        attend(q, kv, kv, sm_scale=1.0, mask=None)
