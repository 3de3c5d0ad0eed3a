"""jaxpe.forgetting_attention (jaxpe/fox.py, kernels/fox_blockwise.py): both impls against a NumPy restatement of the
formula (GQA, documents, windows, bidirectional), gates all 1 against jax.nn.dot_product_attention, blockwise against
the reference in value and gradient on lengths that are no multiple of the block, bf16 inputs, jit/vmap, the
layer's gate, the fused Pallas kernels (interpreter on CPU) against the reference, and the input checks."""
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
import numpy_reference as ref
from jaxpe.dispatch import resolve_unfused_impl
from jaxpe.fox import forget_gate_cumsum, forgetting_attention_reference
from jaxpe.kernels.fox_blockwise import forgetting_attention_blockwise
from jaxpe.kernels.fox_pallas import BlockSizes, forgetting_attention_pallas
from jaxpe.softmax_attention import visibility_mask
from kernel_harness import DOCUMENTS, assert_matches_elementwise, gpu_and_interpreted, square_intermediates_of_grad


def inputs(key: jax.Array, *, b: int = 2, length: int = 11, hq: int = 4, hkv: int = 2, d: int = 8,
           dtype=jnp.float32) -> tuple[jax.Array, ...]:
    """q [B, L, Hq, D], k/v [B, L, Hkv, D] and log gates [B, L, Hq] in [−3, 0)."""
    kq, kk, kv, kf = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, length, hq, d), dtype)
    k = jax.random.normal(kk, (b, length, hkv, d), dtype)
    v = jax.random.normal(kv, (b, length, hkv, d), dtype)
    log_fgate = jax.nn.log_sigmoid(jax.random.normal(kf, (b, length, hq)) + 1.5)
    return q, k, v, log_fgate


CASES = {  # options of forgetting_attention, each value once
    "causal": {},
    "bidirectional": {"causal": False},
    "segments": {"segment_ids": DOCUMENTS},
    "window": {"window": 4},
    "bidirectional-window": {"causal": False, "window": 3},
    "sm_scale": {"sm_scale": 0.7},
}


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
@pytest.mark.parametrize("case", CASES)
def test_matches_the_numpy_restatement(case, impl, key):
    q, k, v, log_fgate = inputs(key)
    options = CASES[case]
    out = jaxpe.forgetting_attention(q, k, v, log_fgate, impl=impl, **options)
    want = ref.forgetting_attention(*map(np.asarray, (q, k, v, log_fgate)), **options)
    chex.assert_shape(out, q.shape)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_gates_all_one_give_plain_causal_attention(impl, key):
    """log f = 0: no decay, softmax attention as jax.nn.dot_product_attention computes it (GQA included)."""
    q, k, v, log_fgate = inputs(key)
    out = jaxpe.forgetting_attention(q, k, v, jnp.zeros_like(log_fgate), impl=impl)
    np.testing.assert_allclose(out, jax.nn.dot_product_attention(q, k, v, is_causal=True), atol=2e-5, rtol=2e-5)


def test_the_gates_matter(key):
    """Small gates forget: the output moves away from plain attention, towards the last keys."""
    q, k, v, log_fgate = inputs(key)
    plain = jaxpe.forgetting_attention(q, k, v, jnp.zeros_like(log_fgate))
    forgetful = jaxpe.forgetting_attention(q, k, v, jnp.full_like(log_fgate, -30.0))
    assert not np.allclose(plain, forgetful, atol=1e-2)
    # every gate ≈ e^−30: each query sees only itself
    own = jnp.repeat(v, q.shape[2] // v.shape[2], axis=2)
    np.testing.assert_allclose(forgetful, own, atol=1e-6)


def loss_grads(fn, q, k, v, c, sm_scale):
    """Gradients of a weighted sum of fn's output with respect to q, k, v, c and sm_scale."""
    weights = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)
    return jax.grad(lambda *a: jnp.sum(fn(*a) * weights), argnums=(0, 1, 2, 3, 4))(q, k, v, c, sm_scale)


@pytest.mark.parametrize(("case", "block"), [("causal", 4), ("bidirectional-window", 5), ("segments", 4)])
def test_blockwise_matches_the_reference_in_value_and_gradient(case, block, key):
    """L = 11 is no multiple of the blocks; gradients with respect to every input and the temperature."""
    q, k, v, log_fgate = inputs(key)
    options = dict(CASES[case])
    causal, window = options.pop("causal", True), options.pop("window", None)
    segments = options.pop("segment_ids", None)
    c = forget_gate_cumsum(log_fgate)
    mask = visibility_mask(11, 11, segment_ids=segments, window=window, causal=causal)

    def dense(q, k, v, c, scale):
        return forgetting_attention_reference(q, k, v, c, c, sm_scale=scale, mask=mask, causal=causal)

    def blockwise(q, k, v, c, scale):
        return forgetting_attention_blockwise(q, k, v, c, sm_scale=scale, causal=causal, block=block,
                                              segment_ids=None if segments is None else jnp.asarray(segments),
                                              window=window)

    scale = jnp.float32(0.4)
    np.testing.assert_allclose(blockwise(q, k, v, c, scale), dense(q, k, v, c, scale), atol=2e-5, rtol=2e-5)
    for got, want in zip(loss_grads(blockwise, q, k, v, c, scale), loss_grads(dense, q, k, v, c, scale)):
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5)


def test_gradient_reaches_the_gates_at_one(key):
    """At log f = 0 the bias c_i − c_j still has slope 1 in each gate between key and query: the blockwise gradient
    with respect to log_fgate equals the reference's and is not zero."""
    q, k, v, log_fgate = inputs(key)
    loss = lambda impl: lambda f: jnp.sum(jnp.sin(jaxpe.forgetting_attention(q, k, v, f, impl=impl)))
    zeros = jnp.zeros_like(log_fgate)
    want = jax.grad(loss("reference"))(zeros)
    assert np.abs(want).max() > 1e-3
    np.testing.assert_allclose(jax.grad(loss("blockwise"))(zeros), want, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_bf16_inputs_give_bf16_outputs_near_float32(impl, key):
    q, k, v, log_fgate = inputs(key, dtype=jnp.bfloat16)
    out = jaxpe.forgetting_attention(q, k, v, log_fgate, impl=impl)
    assert out.dtype == jnp.bfloat16
    want = jaxpe.forgetting_attention(*(x.astype(jnp.float32) for x in (q, k, v)), log_fgate, impl="reference")
    np.testing.assert_allclose(out.astype(jnp.float32), want, atol=3e-2, rtol=3e-2)


def test_jit_and_vmap_equal_the_eager_call(key):
    q, k, v, log_fgate = inputs(key, b=1)
    run = lambda q, k, v, f: jaxpe.forgetting_attention(q, k, v, f, impl="blockwise", window=5)
    eager = run(q, k, v, log_fgate)
    np.testing.assert_allclose(jax.jit(run)(q, k, v, log_fgate), eager, atol=1e-6, rtol=1e-6)
    stacked = [jnp.stack([x, 2.0 * x]) for x in (q, k, v, log_fgate)]
    batched = jax.vmap(run)(*stacked)
    np.testing.assert_allclose(batched[0], eager, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(batched[1], run(*(2.0 * x for x in (q, k, v, log_fgate))), atol=1e-5, rtol=1e-5)


def test_layer_gate_is_initialised_as_the_paper_code(key):
    """The fox layer owns one Dense d_model -> Hq with bias: weights N(0, 0.02²), bias 0 (gates start at 1/2)."""
    model = jaxpe.Attention(num_heads=4, num_kv_heads=2, head_dim=8, pe="fox")
    params = nn.meta.unbox(model.init(key, jnp.zeros((1, 5, 32)))["params"])
    gate = params["pe"]["fgate"]
    chex.assert_shape(gate["kernel"], (32, 4))
    np.testing.assert_array_equal(gate["bias"], np.zeros(4))
    assert 0.01 < float(jnp.std(gate["kernel"])) < 0.03


def test_layer_equals_the_function_with_its_gates(key):
    """The fox layer's attention is forgetting_attention with log f = log σ(x·W + b) of the layer input."""
    x = jax.random.normal(key, (2, 9, 32))
    model = jaxpe.Attention(num_heads=4, num_kv_heads=2, head_dim=8, pe="fox")
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(3), x)["params"])
    params["pe"]["fgate"]["bias"] = jnp.linspace(-2.0, 2.0, 4)
    out = model.apply({"params": params}, x)
    q = jnp.einsum("bld,dhk->blhk", x, params["query"]["kernel"])
    k = jnp.einsum("bld,dhk->blhk", x, params["key"]["kernel"])
    v = jnp.einsum("bld,dhk->blhk", x, params["value"]["kernel"])
    log_fgate = jax.nn.log_sigmoid(x @ params["pe"]["fgate"]["kernel"] + params["pe"]["fgate"]["bias"][None, None])
    want = ref.forgetting_attention(*map(np.asarray, (q, k, v, log_fgate)))
    np.testing.assert_allclose(out, np.einsum("blhk,hkd->bld", want, params["out"]["kernel"]), atol=2e-5,
                               rtol=2e-5)


BAD = [
    (dict(log_fgate=jnp.full((2, 11, 4), 0.5)), "log_fgate must be <= 0"),
    (dict(log_fgate=jnp.full((2, 11, 4), -0.1).at[0, 3, 1].set(-jnp.inf)),
     r"log_fgate must be finite.*min\(log_fgate\)=-inf"),
    (dict(log_fgate=jnp.zeros((2, 11, 2))), "log_fgate must have shape"),
    (dict(impl="triton"), "impl='triton'"),
    (dict(impl="pallas", causal=False), "causal=False is not supported by impl='pallas'"),
    (dict(window=0), "window=0"),
    (dict(causal=1), "causal=1"),
    (dict(sm_scale=-1.0), "sm_scale"),
]


@pytest.mark.parametrize(("options", "match"), BAD, ids=[m for _, m in BAD])
def test_bad_inputs_raise_value_errors_naming_them(options, match, key):
    q, k, v, log_fgate = inputs(key)
    options = dict(options)
    log_fgate = options.pop("log_fgate", log_fgate)
    with pytest.raises(ValueError, match=match):
        jaxpe.forgetting_attention(q, k, v, log_fgate, **options)


class _PallasSweep:
    """The fused kernels against the dense reference, value and gradient (q, k, v, the gates' running sums and a
    traced temperature); INTERPRET selects the Pallas interpreter (CPU CI) or the Triton lowering (GPU), TOLERANCE
    the per-dtype table (kernel_harness). L = 37 is no multiple of the 16-row blocks; GQA (4 query heads on 2 kv
    heads)."""

    INTERPRET: bool
    TOLERANCE: dict

    @pytest.mark.parametrize("case", ["causal", "causal, 32-row blocks", "segments", "window"])
    def test_matches_the_reference(self, case, key):
        """32-row query blocks over 16-key blocks: the forward's unmasked key blocks end inside a query block."""
        q, k, v, log_fgate = inputs(key, length=37)
        c = forget_gate_cumsum(log_fgate)
        window = 5 if case == "window" else None
        segments = jnp.asarray(np.repeat(np.arange(3), 13)[None, :37].repeat(2, 0), jnp.int32) if case == "segments" \
            else None
        mask = jaxpe.softmax_attention.visibility_mask(37, 37, segment_ids=segments, window=window)

        def dense(q, k, v, c, scale):
            return forgetting_attention_reference(q, k, v, c, c, sm_scale=scale, mask=mask)

        def fused(q, k, v, c, scale):
            rows = 32 if "32-row" in case else 16
            return forgetting_attention_pallas(q, k, v, c, sm_scale=scale, block_sizes=BlockSizes(rows, 16, rows, 16),
                                               interpret=self.INTERPRET, segment_ids=segments, window=window)

        args = (q, k, v, c, jnp.float32(0.3))
        assert_matches_elementwise([fused(*args), *loss_grads(fused, *args)], [dense(*args), *loss_grads(dense, *args)],
                                   names=["out", "dq", "dk", "dv", "dc", "dscale"], dtype="float32", context=case,
                                   table=self.TOLERANCE)


TestFoXPallas, TestFoXPallasInterpret = gpu_and_interpreted(_PallasSweep, "TestFoXPallas")


@pytest.mark.gpu
def test_pallas_gradients_are_the_same_bits_every_run(key):
    """The compiled backward adds nothing atomically: two runs give bitwise equal gradients (GQA 8/2 at L 1024, where
    float32 atomic adds of dk and dv into shared kv heads would sum in a varying order)."""
    q, k, v, log_fgate = inputs(key, b=2, length=1024, hq=8, hkv=2, d=64)
    args = (q, k, v, forget_gate_cumsum(log_fgate), jnp.float32(0.125))
    def fused(q, k, v, c, scale):
        return forgetting_attention_pallas(q, k, v, c, sm_scale=scale, interpret=False)

    first, second = (jax.block_until_ready(loss_grads(fused, *args)) for _ in range(2))
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pallas_through_the_public_function(key):
    """impl="pallas" from jaxpe.forgetting_attention equals the NumPy restatement (bf16 inputs: bf16 outputs)."""
    q, k, v, log_fgate = inputs(key, length=19)
    out = jaxpe.forgetting_attention(q, k, v, log_fgate, impl="pallas")
    np.testing.assert_allclose(out, ref.forgetting_attention(*map(np.asarray, (q, k, v, log_fgate))), atol=2e-5,
                               rtol=2e-5)
    half = jaxpe.forgetting_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), log_fgate, impl="pallas")
    assert half.dtype == jnp.bfloat16
    np.testing.assert_allclose(half.astype(jnp.float32), out, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("impl", ["blockwise", "pallas"])
def test_backward_never_builds_a_length_squared_array(impl):
    """jax.grad's jaxpr holds no [.., L, .., L, ..] value (L = 1000); the dense reference does (the probe works)."""
    length = 1000
    q, k, v, log_fgate = inputs(jax.random.PRNGKey(1), b=1, length=length, hq=2, hkv=1, d=16)
    c = forget_gate_cumsum(log_fgate)
    kernel = {"blockwise": functools.partial(forgetting_attention_blockwise, sm_scale=0.2, block=64),
              "pallas": functools.partial(forgetting_attention_pallas, sm_scale=0.2, interpret=True)}[impl]
    mask = jnp.tril(jnp.ones((length, length), bool))[None]
    dense = functools.partial(forgetting_attention_reference, sm_scale=0.2, mask=mask)
    assert square_intermediates_of_grad(lambda q, k, v, c: dense(q, k, v, c, c), q, k, v, c, size=length)
    assert square_intermediates_of_grad(kernel, q, k, v, c, size=length) == []


def test_auto_runs_dense_below_the_measured_length_and_blockwise_from_it():
    """jaxpe.dispatch.UNFUSED_BLOCKWISE_MIN_LENGTH (256): dense below, blockwise from it, dense at a symbolic length
    (jax.export), and a fused path only when asked for by name (stick-breaking has a native Triton one, FoX not)."""
    for encoding in ("fox", "stickbreaking"):
        pick = functools.partial(resolve_unfused_impl, encoding=encoding, batch_heads=8)
        assert (pick("auto", 255), pick("auto", 256), pick("pallas", 8)) == ("reference", "blockwise", "pallas")
        symbolic, = jax.export.symbolic_shape("l")
        assert pick("auto", symbolic) == "reference"
    assert resolve_unfused_impl("triton", 8, encoding="stickbreaking", batch_heads=8) == "triton"
    with pytest.raises(ValueError, match="impl='triton': fox has no such fused kernel"):
        resolve_unfused_impl("triton", 8, encoding="fox", batch_heads=8)
