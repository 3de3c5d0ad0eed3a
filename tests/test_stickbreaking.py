"""jaxpe.stickbreaking_attention (jaxpe/stickbreaking.py, kernels/stickbreaking_blockwise.py): both impls against a
NumPy restatement of the formula (GQA, attend_current, documents, windows), weights and remainder summing to 1,
blockwise against the reference in value and gradient (the remainder's too) on lengths that are no multiple of the
block, bf16 inputs, jit/vmap, the layer's remainder bias, the fused Pallas kernels (interpreter on CPU) against the
reference, and the input checks."""
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
import numpy_reference as ref
from jaxpe.kernels.stickbreaking_blockwise import stickbreaking_attention_blockwise
from jaxpe.kernels.stickbreaking_pallas import BlockSizes, stickbreaking_attention_pallas
from jaxpe.stickbreaking import attended_mask, stickbreaking_attention_reference
from jaxpe.softmax_attention import visibility_mask
from kernel_harness import DOCUMENTS, assert_matches_elementwise, gpu_and_interpreted, square_intermediates_of_grad


def inputs(key: jax.Array, *, b: int = 2, length: int = 11, hq: int = 4, hkv: int = 2, d: int = 8,
           dtype=jnp.float32) -> tuple[jax.Array, ...]:
    """q [B, L, Hq, D], k/v [B, L, Hkv, D]."""
    kq, kk, kv = jax.random.split(key, 3)
    return (jax.random.normal(kq, (b, length, hq, d), dtype), jax.random.normal(kk, (b, length, hkv, d), dtype),
            jax.random.normal(kv, (b, length, hkv, d), dtype))


CASES = {  # options of stickbreaking_attention, each value once
    "default": {},
    "attend_current": {"attend_current": True},
    "segments": {"segment_ids": DOCUMENTS},
    "window": {"window": 4},
    "sm_scale": {"sm_scale": 1.3},
}


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
@pytest.mark.parametrize("case", CASES)
def test_matches_the_numpy_restatement(case, impl, key):
    q, k, v = inputs(key)
    options = CASES[case]
    out, remainder = jaxpe.stickbreaking_attention(q, k, v, impl=impl, return_remainder=True, **options)
    want, want_remainder = ref.stickbreaking_attention(*map(np.asarray, (q, k, v)), **options)
    chex.assert_shape((out, remainder), (q.shape, q.shape[:3]))
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(remainder, want_remainder, atol=2e-6, rtol=2e-5)
    np.testing.assert_array_equal(jaxpe.stickbreaking_attention(q, k, v, impl=impl, **options), out)


@pytest.mark.parametrize("attend_current", [False, True])
@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_weights_and_remainder_sum_to_one(impl, attend_current, key):
    """With v all ones every output entry is Σ_j A_ij; the remainder (computed as Π_k (1 − β_ik)) is the rest. The
    first query attends nothing without attend_current: out 0, remainder 1."""
    q, k, v = inputs(key, length=37)
    q = 3.0 * q  # sharp gates: weights far from uniform
    out, remainder = jaxpe.stickbreaking_attention(q, k, jnp.ones_like(v), impl=impl, attend_current=attend_current,
                                                   return_remainder=True)
    np.testing.assert_allclose(out + remainder[..., None], 1.0, atol=1e-5)
    assert float(jnp.min(remainder)) < 0.1 < float(jnp.max(remainder[:, 1:]))
    if not attend_current:
        np.testing.assert_array_equal(out[:, 0], 0.0)
        np.testing.assert_array_equal(remainder[:, 0], 1.0)


def loss(fn, weights):
    return lambda *a: jnp.sum(fn(*a)[0] * weights) + jnp.sum(jnp.sin(3.0 * fn(*a)[1]))


@pytest.mark.parametrize(("case", "block"), [("default", 4), ("attend_current", 5), ("segments", 4),
                                             ("window", 5)])
def test_blockwise_matches_the_reference_in_value_and_gradient(case, block, key):
    """L = 11 is no multiple of the blocks; a loss of both the output and the remainder; gradients with respect to
    q, k, v and the temperature."""
    q, k, v = inputs(key)
    options = dict(CASES[case])
    attend_current = options.get("attend_current", False)
    segments = options.get("segment_ids")
    segments = None if segments is None else jnp.asarray(segments)
    window = options.get("window")
    visible = visibility_mask(11, 11, segment_ids=segments, window=window)
    mask = attended_mask(visible, jnp.arange(11)[None], attend_current=attend_current)

    def dense(q, k, v, scale):
        return stickbreaking_attention_reference(q, k, v, sm_scale=scale, mask=mask)

    def blockwise(q, k, v, scale):
        return stickbreaking_attention_blockwise(q, k, v, sm_scale=scale, attend_current=attend_current, block=block,
                                                 segment_ids=segments, window=window)

    scale = jnp.float32(0.6)
    for got, want in zip(blockwise(q, k, v, scale), dense(q, k, v, scale)):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    weights = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)
    grads = lambda fn: jax.grad(loss(fn, weights), argnums=(0, 1, 2, 3))(q, k, v, scale)
    for got, want in zip(grads(blockwise), grads(dense)):
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_bf16_inputs_give_bf16_outputs_near_float32(impl, key):
    q, k, v = inputs(key, dtype=jnp.bfloat16)
    out, remainder = jaxpe.stickbreaking_attention(q, k, v, impl=impl, return_remainder=True)
    assert out.dtype == remainder.dtype == jnp.bfloat16
    want, want_remainder = jaxpe.stickbreaking_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                                         impl="reference", return_remainder=True)
    np.testing.assert_allclose(out.astype(jnp.float32), want, atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(remainder.astype(jnp.float32), want_remainder, atol=1e-2, rtol=1e-2)


def test_jit_and_vmap_equal_the_eager_call(key):
    q, k, v = inputs(key, b=1)
    run = lambda q, k, v: jaxpe.stickbreaking_attention(q, k, v, impl="blockwise", window=5)
    eager = run(q, k, v)
    np.testing.assert_allclose(jax.jit(run)(q, k, v), eager, atol=1e-6, rtol=1e-6)
    batched = jax.vmap(run)(*(jnp.stack([x, 2.0 * x]) for x in (q, k, v)))
    np.testing.assert_allclose(batched[0], eager, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(batched[1], run(*(2.0 * x for x in (q, k, v))), atol=1e-5, rtol=1e-5)


def test_layer_adds_the_remainder_times_its_head_bias(key):
    """out_i + remainder_i·head_bias_h per head (the authors' layer); head_bias starts at zero."""
    x = jax.random.normal(key, (2, 9, 32))
    model = jaxpe.Attention(num_heads=4, num_kv_heads=2, head_dim=8, pe="stickbreaking")
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(3), x)["params"])
    np.testing.assert_array_equal(params["pe"]["head_bias"], np.zeros((4, 8)))
    params["pe"]["head_bias"] = jax.random.normal(jax.random.PRNGKey(4), (4, 8))
    out = model.apply({"params": params}, x)
    q, k, v = (jnp.einsum("bld,dhk->blhk", x, params[name]["kernel"]) for name in ("query", "key", "value"))
    attn, remainder = ref.stickbreaking_attention(*map(np.asarray, (q, k, v)))
    heads = attn + remainder[..., None] * np.asarray(params["pe"]["head_bias"])
    np.testing.assert_allclose(out, np.einsum("blhk,hkd->bld", heads, params["out"]["kernel"]), atol=2e-5,
                               rtol=2e-5)


BAD = [
    (dict(impl="fused"), "impl='fused'"),
    (dict(attend_current=1), "attend_current=1"),
    (dict(return_remainder="yes"), "return_remainder='yes'"),
    (dict(window=-2), "window=-2"),
    (dict(sm_scale=0.0), "sm_scale"),
]


@pytest.mark.parametrize(("options", "match"), BAD, ids=[m for _, m in BAD])
def test_bad_inputs_raise_value_errors_naming_them(options, match, key):
    q, k, v = inputs(key)
    with pytest.raises(ValueError, match=match):
        jaxpe.stickbreaking_attention(q, k, v, **options)


class _PallasSweep:
    """The fused kernels against the dense reference, value and gradient (q, k, v and a traced temperature, through a
    loss of the output and the remainder); INTERPRET selects the Pallas interpreter (CPU CI) or the Triton lowering
    (GPU), TOLERANCE the per-dtype table (kernel_harness). L = 37 is no multiple of the 16-row blocks; GQA (4 query
    heads on 2 kv heads)."""

    INTERPRET: bool
    TOLERANCE: dict

    @pytest.mark.parametrize("case", ["default", "window", "segments-attend_current", "32-row blocks",
                                      "32-row blocks-attend_current"])
    def test_matches_the_reference(self, case, key):
        """32-row query blocks over 16-key blocks: the key blocks wholly before a query block's first row run
        without the mask, the others with it."""
        q, k, v = inputs(key, length=37)
        window = 5 if case == "window" else None
        segments = jnp.asarray(np.repeat(np.arange(3), 13)[None, :37].repeat(2, 0), jnp.int32) \
            if case.startswith("segments") else None
        attend_current = case.endswith("attend_current")
        rows = 32 if case.startswith("32-row") else 16
        mask = attended_mask(visibility_mask(37, 37, segment_ids=segments, window=window), jnp.arange(37)[None],
                             attend_current=attend_current)

        def dense(q, k, v, scale):
            return stickbreaking_attention_reference(q, k, v, sm_scale=scale, mask=mask)

        def fused(q, k, v, scale):
            return stickbreaking_attention_pallas(q, k, v, sm_scale=scale, attend_current=attend_current,
                                                  block_sizes=BlockSizes(rows, 16, rows, 16), interpret=self.INTERPRET,
                                                  segment_ids=segments, window=window)

        scale = jnp.float32(0.5)
        weights = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)
        grads = lambda fn: jax.grad(loss(fn, weights), argnums=(0, 1, 2, 3))(q, k, v, scale)
        assert_matches_elementwise([*fused(q, k, v, scale), *grads(fused)], [*dense(q, k, v, scale), *grads(dense)],
                                   names=["out", "remainder", "dq", "dk", "dv", "dscale"], dtype="float32",
                                   context=case, table=self.TOLERANCE)


TestStickBreakingPallas, TestStickBreakingPallasInterpret = gpu_and_interpreted(_PallasSweep, "TestStickBreakingPallas")


def test_pallas_through_the_public_function(key):
    """impl="pallas" from jaxpe.stickbreaking_attention equals the NumPy restatement, remainder included."""
    q, k, v = inputs(key, length=19)
    out, remainder = jaxpe.stickbreaking_attention(q, k, v, impl="pallas", return_remainder=True)
    want, want_remainder = ref.stickbreaking_attention(*map(np.asarray, (q, k, v)))
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(remainder, want_remainder, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("scale, offset", [(6.0, 0.0), (1.0, 3.0)], ids=["|z| to 23", "z of one sign, to 43"])
def test_pallas_is_as_accurate_as_blockwise_at_large_logits(scale, offset):
    """float32 output and gradients (of the output and the remainder) against float64 (the forward the NumPy
    restatement's, the gradients the float64 reference's): the Pallas kernels' error within 4× blockwise's (down to
    float32's resolution) where the logits are large. Their tiles once summed softplus over the keys after j as the
    tile's total less a running sum, losing ulps of the total: 15× blockwise's error on the output at |z| up to 23,
    500× at logits of one sign."""
    length, d = 64, 64
    kq, kk, kv, kd, kr = jax.random.split(jax.random.PRNGKey(0), 5)
    q = scale * jax.random.normal(kq, (1, length, 2, d)) + offset * d**0.25
    k = jax.random.normal(kk, (1, length, 1, d)) + d**-0.25
    v = jax.random.normal(kv, (1, length, 1, d))
    dout, drem = jax.random.normal(kd, q.shape), jax.random.normal(kr, q.shape[:3])

    def run(impl: str, *args: jax.Array) -> list[np.ndarray]:
        def loss(q, k, v):
            out, remainder = jaxpe.stickbreaking_attention(q, k, v, impl=impl, return_remainder=True)
            return jnp.sum(out * dout.astype(out.dtype)) + jnp.sum(remainder * drem.astype(out.dtype))

        return [np.asarray(x, np.float64) for x in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)]

    with jax.enable_x64(True):
        want = [*ref.stickbreaking_attention(*map(np.asarray, (q, k, v)), sm_scale=d**-0.5),
                *run("reference", *(x.astype(jnp.float64) for x in (q, k, v)))]
    errors = {}
    for impl in ("blockwise", "pallas"):
        got = [*jaxpe.stickbreaking_attention(q, k, v, impl=impl, return_remainder=True), *run(impl, q, k, v)]
        errors[impl] = np.array([np.abs(np.asarray(g, np.float64) - w).max() / np.abs(w).max()
                                 for g, w in zip(got, want)])
    names = ("out", "remainder", "dq", "dk", "dv")
    assert np.all(errors["pallas"] <= 4 * errors["blockwise"] + 2.0**-23), dict(zip(names, zip(*errors.values())))


@pytest.mark.parametrize("impl", ["blockwise", "pallas"])
def test_backward_never_builds_a_length_squared_array(impl):
    """jax.grad's jaxpr (of the output and the remainder) holds no [.., L, .., L, ..] value (L = 1000); the dense
    reference does (the probe works)."""
    length = 1000
    q, k, v = inputs(jax.random.PRNGKey(1), b=1, length=length, hq=2, hkv=1, d=16)
    kernel = {"blockwise": functools.partial(stickbreaking_attention_blockwise, sm_scale=0.2, block=64),
              "pallas": functools.partial(stickbreaking_attention_pallas, sm_scale=0.2, interpret=True)}[impl]
    mask = jnp.tril(jnp.ones((length, length), bool), -1)[None]
    both = lambda fn: lambda *a: jnp.sum(fn(*a)[0]) + jnp.sum(fn(*a)[1])
    dense = functools.partial(stickbreaking_attention_reference, sm_scale=0.2, mask=mask)
    assert square_intermediates_of_grad(both(dense), q, k, v, size=length)
    assert square_intermediates_of_grad(both(kernel), q, k, v, size=length) == []
