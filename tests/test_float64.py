"""float64 inputs (x64 mode) compute in float64 on the XLA paths (reference, blockwise, "auto" on CPU): outputs match
the float64 NumPy restatements of tests/numpy_reference.py far below float32's resolution, and
`jax.test_util.check_grads` passes at its float64 defaults for every encoding's layer and both attention functions.
float32 inputs under x64 stay float32 throughout (no float64 value in the jaxpr)."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as npr
import pytest
from jax.test_util import check_grads
from transformation_harness import float64_values

import jaxpe

F64 = dict(rtol=1e-11, atol=1e-12)  # float32 maths misses these by four orders of magnitude and more
IMPLS = ("reference", "blockwise", "auto")
CONTEXTUAL = ("cope", "cope_rope", "corope")


def normal(seed: int, shape: tuple[int, ...], dtype=jnp.float64) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), shape, dtype)


def qkv(length: int, heads: tuple[int, int] = (2, 2), head_dim: int = 8, dtype=jnp.float64) -> tuple[jax.Array, ...]:
    hq, hkv = heads
    return (normal(1, (2, length, hq, head_dim), dtype), normal(2, (2, length, hkv, head_dim), dtype),
            normal(3, (2, length, hkv, head_dim), dtype))


@pytest.mark.parametrize("impl", IMPLS)
def test_cope_matches_the_float64_restatement(impl):
    with jax.enable_x64(True):
        q, k, v = qkv(24)
        pos_emb = normal(4, (10, 8))
        got = jaxpe.cope_attention(q, k, v, pos_emb, sm_scale=0.7, impl=impl)
        assert got.dtype == jnp.float64
        want = npr.cope_attention(*(np.asarray(x) for x in (q, k, v, pos_emb)), sm_scale=0.7)
        np.testing.assert_allclose(np.asarray(got), want, **F64)


@pytest.mark.parametrize("impl", IMPLS)
def test_corope_matches_the_float64_restatement(impl):
    """Long enough (L 300) that Co-RoPE's angles Δ·ω reach the hundreds, where float32 angles are off by ~1e-5."""
    with jax.enable_x64(True):
        q, k, v = (x * 0.3 for x in qkv(300, head_dim=4))
        got = jaxpe.corope_attention(q, k, v, impl=impl)
        assert got.dtype == jnp.float64
        want = npr.corope_attention(*(np.asarray(x) for x in (q, k, v)))
        np.testing.assert_allclose(np.asarray(got), want, **F64)


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
@pytest.mark.parametrize("encoding", ["cope", "corope"])
def test_check_grads_at_float64_defaults(encoding, impl):
    """Reverse mode against central differences at check_grads' float64 eps and tolerances, GQA, a traced sm_scale
    (a learned temperature) among the differentiated arguments, and the gradient of the gradient (blockwise's
    backward is differentiable; the reference's is plain jnp)."""
    with jax.enable_x64(True):
        q, k, v = qkv(11, heads=(4, 2))
        scale = jnp.asarray(0.4)
        if encoding == "cope":
            pos_emb = normal(4, (6, 8))
            fn = lambda q, k, v, pos_emb, scale: jaxpe.cope_attention(q, k, v, pos_emb, sm_scale=scale, impl=impl)
            args = (q, k, v, pos_emb, scale)
        else:
            fn = lambda q, k, v, scale: jaxpe.corope_attention(q, k, v, sm_scale=scale, impl=impl)
            args = (q, k, v, scale)
        check_grads(fn, args, order=1, modes=("rev",))
        cotangent = normal(5, q.shape)
        check_grads(lambda q: jax.grad(lambda q: jnp.sum(fn(q, *args[1:]) * cotangent))(q), (q,), order=1,
                    modes=("rev",))


def layers() -> list[tuple[str, str]]:
    """(encoding, impl): every encoding on "auto", the contextual ones on each XLA path too."""
    return [(pe, impl) for pe in jaxpe.PE_NAMES for impl in IMPLS if impl == "auto" or pe in CONTEXTUAL]


@pytest.mark.parametrize("pe, impl", layers())
def test_every_layer_passes_check_grads_at_float64_defaults(pe, impl):
    """An Attention layer in float64 (dtype and param_dtype float64, the position tables cast to float64 as a user
    casting the whole parameter tree does): a float64 output, and gradients in x and every parameter that agree
    with central differences at float64 tolerances."""
    with jax.enable_x64(True):
        layer = jaxpe.Attention(num_heads=4, num_kv_heads=2, head_dim=4, pe=pe, max_len=16, impl=impl,
                                dtype=jnp.float64, param_dtype=jnp.float64)
        x = normal(1, (2, 10, 16))
        params = jax.tree_util.tree_map(lambda p: p.astype(jnp.float64), layer.init(jax.random.PRNGKey(0), x))
        assert layer.apply(params, x).dtype == jnp.float64
        check_grads(layer.apply, (params, x), order=1, modes=("rev",))


@pytest.mark.parametrize("pe", [pe for pe in jaxpe.PE_NAMES if jaxpe.pe_config(pe).additive])
def test_every_embedding_passes_check_grads_at_float64_defaults(pe):
    with jax.enable_x64(True):
        embedding = jaxpe.pe_config(pe).embedding(d_model=16, max_len=16)
        x = normal(1, (2, 10, 16))
        params = jax.tree_util.tree_map(lambda p: p.astype(jnp.float64), embedding.init(jax.random.PRNGKey(0), x))
        assert embedding.apply(params, x).dtype == jnp.float64
        check_grads(embedding.apply, (params, x), order=1, modes=("rev",))


def test_fixed_tables_and_angles_are_float64_for_float64_inputs():
    """The sinusoidal table (rows up to 2000, where float32 angles are off by ~1e-4), the rotation of RoPE at
    positions up to 5000 and ALiBi's slopes for 16 heads (2^(−h/2), not float32 numbers), against NumPy."""
    with jax.enable_x64(True):
        table = jaxpe.sinusoidal_table(2000, 6, dtype=jnp.float64)
        np.testing.assert_allclose(np.asarray(table), npr.sinusoidal_table(2000, 6), **F64)
        x = normal(1, (1, 3, 2, 8))
        positions = jnp.asarray([7, 1234, 5000])
        np.testing.assert_allclose(np.asarray(jaxpe.apply_rope(x, positions)),
                                   npr.rope(np.asarray(x), np.asarray(positions)), **F64)
        q_pos = np.asarray([[0, 3, 5]])
        bias = jaxpe.alibi_bias(q_pos, 6, 16, dtype=jnp.float64)
        np.testing.assert_allclose(np.asarray(bias), npr.alibi_bias(q_pos, 6, 16), **F64)


@pytest.mark.parametrize("pe", jaxpe.PE_NAMES)
def test_float32_inputs_stay_float32_under_x64(pe):
    """The layer's forward and gradient at float32 inputs and parameters carry no float64 value in x64 mode."""
    with jax.enable_x64(True):
        layer = jaxpe.Attention(num_heads=4, num_kv_heads=2, head_dim=4, pe=pe, max_len=16)
        x = normal(1, (2, 10, 16), jnp.float32)
        params = layer.init(jax.random.PRNGKey(0), x)
        grad = jax.grad(lambda params, x: jnp.sum(layer.apply(params, x)), argnums=(0, 1))
        assert float64_values(grad, params, x) == []
        assert layer.apply(params, x).dtype == jnp.float32


@pytest.mark.parametrize("param_dtype, want", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32),
                                               (jnp.float64, jnp.float64)])
def test_position_parameters_are_float32_unless_param_dtype_is_float64(param_dtype, want):
    """Under x64 too (where flax's initializers default to float64): a layer's tables and gate networks take
    promote_types(float32, param_dtype), as flax's own layers take param_dtype (a float64 model's gates were
    float32); the embeddings' are float32."""
    with jax.enable_x64(True):
        x = normal(1, (1, 4, 16), jnp.float32)
        for pe, options in (("relative", {}), ("cope", dict(talking_heads=True, add_relative=True)),
                            ("cope", dict(gates="sep_keys")), ("cope_gated", {}), ("fox", {})):
            layer = jaxpe.Attention(num_heads=2, num_kv_heads=2, head_dim=8, pe=jaxpe.pe_config(pe, **options),
                                    max_len=16, param_dtype=param_dtype)
            found = jax.tree_util.tree_leaves_with_path(nn.meta.unbox(layer.init(jax.random.PRNGKey(0), x)["params"]))
            dtypes = {jax.tree_util.keystr(path): leaf.dtype for path, leaf in found if path[0].key == "pe"}
            assert dtypes and dtypes == dict.fromkeys(dtypes, want), (pe, options)
        for pe in ("learned", "amspe"):
            embedding = jaxpe.pe_config(pe).embedding(d_model=16, max_len=16)
            leaves = jax.tree_util.tree_leaves(nn.meta.unbox(embedding.init(jax.random.PRNGKey(0), x)))
            assert leaves and all(leaf.dtype == jnp.float32 for leaf in leaves)
