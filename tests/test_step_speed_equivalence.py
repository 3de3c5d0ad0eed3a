"""The cheaper pieces of the CPU training step (issue 13) compute what the pieces they replaced computed.

- CoPE's interpolation from flat gathers (`interpolate_table_rows`) == take_along_axis reads, values and
  gradients;
- the gate suffix sums as a triangular matmul (`reverse_cumsum_keys`) == the associative scan;
- two tables read by one complex gather (`gather_table_row_pairs`) == two gathers, values and gradients;
- relative position logits from a flat gather == take_along_axis;
- dropout masks from a counter hash (`jaxpe.dropout`) are Bernoulli(1 − rate): rate, independence of neighbours,
  of calls and of keys, and flax's scaling.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.cope import interpolate_table_rows, reverse_cumsum_keys
from jaxpe.dropout import Dropout, dropout, keep_mask
from jaxpe.kernels._common import interpolate
from jaxpe.relative import gather_table_row_pairs, gather_table_rows, relative_logits
from jaxpe.softmax_attention import reverse_cumsum


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
    got = jax.vjp(interpolate_table_rows, z, p)[1](ct)
    want = jax.vjp(reference, z, p)[1](ct)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_interpolate_table_rows_ignores_a_non_finite_next_row_at_integer_positions():
    z = jnp.array([1.0, 2.0, jnp.nan]).reshape(1, 1, 1, 3)
    got = interpolate_table_rows(z, jnp.array([1.0, 0.5, 1.5]).reshape(1, 1, 1, 3))
    np.testing.assert_array_equal(got[..., :2], [[[[2.0, 1.5]]]])
    assert np.isnan(got[..., 2]).all()


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
    for got, want in zip(jax.vjp(pairs, z, y)[1](cts), jax.vjp(twice, z, y)[1](cts)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("length", [1, 7, 80, 300])
def test_reverse_cumsum_keys_matches_the_scan(key, length):
    gates = jax.nn.sigmoid(jax.random.normal(key, (2, 3, 4, length)))
    np.testing.assert_allclose(reverse_cumsum_keys(gates), reverse_cumsum(gates), rtol=1e-5, atol=1e-4)
    ct = jnp.ones_like(gates)
    np.testing.assert_allclose(jax.vjp(reverse_cumsum_keys, gates)[1](ct)[0],
                               jax.vjp(reverse_cumsum, gates)[1](ct)[0], rtol=1e-5, atol=1e-4)


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

