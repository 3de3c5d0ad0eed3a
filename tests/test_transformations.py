"""The contextual attentions (CoPE, Co-RoPE, forgetting and stick-breaking attention) inside the programs researchers
write: jit, vmap over an extra axis, remat with its policies, lax.scan over stacked layers, eval_shape, each for every
impl (stick-breaking's native Triton kernels in Triton's interpreter too), against the dense reference called
plainly. (shard_map, x64, dtypes, export and bidirectional attention per encoding: test_transformations_cope.py and
test_transformations_corope.py.)"""
from __future__ import annotations

import functools
import importlib.util
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe

IMPLS = ("reference", "blockwise", "pallas", "auto")
FAST_IMPLS = ("blockwise", "auto")  # the Pallas kernels in interpret mode are slow on CPU: jit, grad and eval_shape
B, L, HQ, HKV, D, NPOS = 2, 24, 4, 2, 8, 12


def _attention(encoding: str, impl: str):
    """attention(q, k, v, e) for the encoding; e is CoPE's table (ignored by the others). FoX's log forget gates come
    from q's first feature (−softplus: content-dependent, differentiable, and mapped along with q)."""
    if encoding == "cope":
        return lambda q, k, v, e: jaxpe.cope_attention(q, k, v, e, impl=impl)
    if encoding == "fox":
        return lambda q, k, v, e: jaxpe.forgetting_attention(q, k, v, -jax.nn.softplus(q[..., 0]), impl=impl)
    if encoding == "stickbreaking":
        return lambda q, k, v, e: jaxpe.stickbreaking_attention(q, k, v, impl=impl)
    return lambda q, k, v, e: jaxpe.corope_attention(q, k, v, impl=impl)


def _inputs(seed: int = 0, lead: tuple[int, ...] = ()) -> tuple[jax.Array, ...]:
    kq, kk, kv, ke = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(kq, (*lead, B, L, HQ, D))
    k = jax.random.normal(kk, (*lead, B, L, HKV, D))
    v = jax.random.normal(kv, (*lead, B, L, HKV, D))
    return q, k, v, 0.3 * jax.random.normal(ke, (NPOS, D))


def _loss(attention, q, k, v, e):
    return jnp.sum(jnp.sin(attention(q, k, v, e)))


ENCODINGS = ("cope", "corope", "fox", "stickbreaking")
# stick-breaking's native kernels, in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
TRITON = pytest.param("stickbreaking", "triton", marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="impl='triton' needs triton (Triton's interpreter on CPU)"))
EVERY_IMPL = pytest.mark.parametrize(("encoding", "impl"), [*itertools.product(ENCODINGS, IMPLS), TRITON])
FAST = pytest.mark.parametrize(("encoding", "impl"), [*itertools.product(ENCODINGS, FAST_IMPLS), TRITON])


@EVERY_IMPL
def test_jit_and_grad_match_the_reference(encoding, impl):
    args = _inputs()
    want = _attention(encoding, "reference")(*args)
    got = jax.jit(_attention(encoding, impl))(*args)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)
    want_grads = jax.grad(functools.partial(_loss, _attention(encoding, "reference")), argnums=(0, 1, 2, 3))(*args)
    grads = jax.jit(jax.grad(functools.partial(_loss, _attention(encoding, impl)), argnums=(0, 1, 2, 3)))(*args)
    for got_g, want_g in zip(grads, want_grads):
        np.testing.assert_allclose(got_g, want_g, atol=5e-4, rtol=5e-4)


@FAST
def test_vmap_over_an_extra_axis_is_the_loop(encoding, impl):
    """vmap over a leading axis of q, k, v (an ensemble, say) equals calling each member; so do its gradients."""
    q, k, v, e = _inputs(lead=(3,))
    attention = _attention(encoding, impl)
    got = jax.vmap(attention, in_axes=(0, 0, 0, None))(q, k, v, e)
    want = jnp.stack([_attention(encoding, "reference")(q[i], k[i], v[i], e) for i in range(3)])
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)
    grad = jax.grad(lambda q, k, v, e: jnp.sum(jax.vmap(functools.partial(_loss, attention),
                                                        in_axes=(0, 0, 0, None))(q, k, v, e)), argnums=(0, 3))
    dq, de = grad(q, k, v, e)
    reference_grad = jax.grad(functools.partial(_loss, _attention(encoding, "reference")), argnums=(0, 3))
    want = [reference_grad(q[i], k[i], v[i], e) for i in range(3)]
    np.testing.assert_allclose(dq, jnp.stack([w[0] for w in want]), atol=5e-4, rtol=5e-4)
    np.testing.assert_allclose(de, sum(w[1] for w in want), atol=2e-3, rtol=2e-3)  # the table is shared: summed


@FAST
@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
def test_remat_with_its_policies_keeps_the_gradient(encoding, impl, policy):
    args = _inputs(1)
    attention = _attention(encoding, impl)
    remat = jax.checkpoint(functools.partial(_loss, attention), policy=getattr(jax.checkpoint_policies, policy))
    want = jax.grad(functools.partial(_loss, _attention(encoding, "reference")), argnums=(0, 1, 2))(*args)
    got = jax.jit(jax.grad(remat, argnums=(0, 1, 2)))(*args)
    for got_g, want_g in zip(got, want):
        np.testing.assert_allclose(got_g, want_g, atol=5e-4, rtol=5e-4)


@FAST
def test_scan_over_stacked_layers(encoding, impl):
    """A residual stack of attention layers run by lax.scan over stacked projections (the scan-over-layers recipe),
    its value and gradient equal to the same layers in a Python loop on the reference."""
    depth = 3
    x = jax.random.normal(jax.random.PRNGKey(2), (B, L, HQ * D))
    weights = 0.2 * jax.random.normal(jax.random.PRNGKey(3), (depth, 3, HQ * D, HQ * D))
    e = _inputs()[3]

    def layer(attention, x, w):
        q, k, v = (jnp.einsum("bld,de->ble", x, w[i]).reshape(B, L, HQ, D) for i in range(3))
        k, v = k[:, :, :HKV], v[:, :, :HKV]
        return x + attention(q, k, v, e).reshape(B, L, HQ * D)

    def scanned(weights):
        out, _ = jax.lax.scan(lambda h, w: (layer(_attention(encoding, impl), h, w), None), x, weights)
        return jnp.sum(out**2)

    def looped(weights):
        h = x
        for i in range(depth):
            h = layer(_attention(encoding, "reference"), h, weights[i])
        return jnp.sum(h**2)

    np.testing.assert_allclose(jax.jit(scanned)(weights), looped(weights), rtol=2e-4)
    np.testing.assert_allclose(jax.jit(jax.grad(scanned))(weights), jax.grad(looped)(weights), atol=2e-3, rtol=2e-3)


@EVERY_IMPL
def test_eval_shape_runs_nothing_and_gives_the_output_type(encoding, impl):
    shapes = [jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in _inputs()]
    out = jax.eval_shape(_attention(encoding, impl), *shapes)
    assert out.shape == (B, L, HQ, D) and out.dtype == jnp.bfloat16
    grads = jax.eval_shape(jax.grad(functools.partial(_loss, _attention(encoding, impl)), argnums=(0, 1)),
                           *[jax.ShapeDtypeStruct(s.shape, jnp.float32) for s in shapes])
    assert [g.shape for g in grads] == [(B, L, HQ, D), (B, L, HKV, D)]
