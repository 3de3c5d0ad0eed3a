"""A whole TransformerLM under jax.export with a symbolic batch and length, for every encoding: exported once, run at
lengths it was not traced at, serialized and read back, and its training gradient exported too. Each exported call
is compared with the same function jitted at that shape. (The attention functions alone: test_transformations_cope.py
and test_transformations_corope.py.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe

VOCAB = 11
MAX_LEN = 48
TABLE_BOUND = {"learned", "sinusoidal", "amspe"}  # additive tables of max_len rows: the length needs a bound


def model_and_params(pe: str, impl: str = "auto") -> tuple[jaxpe.TransformerLM, dict]:
    config = jaxpe.ModelConfig(vocab_size=VOCAB, d_model=16, num_layers=2, num_heads=2, max_len=MAX_LEN, pe=pe,
                               dropout=0.0, impl=impl)
    model = jaxpe.TransformerLM(config)
    return model, model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))


def symbolic_tokens(pe: str) -> jax.ShapeDtypeStruct:
    constraints = (f"l <= {MAX_LEN}",) if pe in TABLE_BOUND else ()
    batch, length = jax.export.symbolic_shape("b, l", constraints=constraints)
    return jax.ShapeDtypeStruct((batch, length), jnp.int32)


def tokens(batch: int, length: int) -> jax.Array:
    return jax.random.randint(jax.random.PRNGKey(batch * 1000 + length), (batch, length), 0, VOCAB)


@pytest.mark.parametrize("pe", jaxpe.PE_NAMES)
def test_forward_exports_with_symbolic_batch_and_length(pe):
    model, params = model_and_params(pe)
    forward = jax.jit(lambda p, t: model.apply(p, t))
    exported = jax.export.export(forward)(params, symbolic_tokens(pe))
    restored = jax.export.deserialize(exported.serialize())
    for batch, length in ((1, 3), (3, 37)):
        t = tokens(batch, length)
        want = forward(params, t)
        np.testing.assert_allclose(exported.call(params, t), want, atol=2e-5, rtol=0)
        np.testing.assert_allclose(restored.call(params, t), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("pe", ["cope", "corope", "relative", "learned"])
def test_training_gradient_exports_with_symbolic_shapes(pe):
    model, params = model_and_params(pe)

    def loss(p, inputs, targets):
        logits = model.apply(p, inputs)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1))

    grad = jax.jit(jax.grad(loss))
    shape = symbolic_tokens(pe)
    exported = jax.export.export(grad)(params, shape, shape)
    inputs, targets = tokens(2, 29), tokens(2, 30)[:, 1:]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=0),
                 exported.call(params, inputs, targets), grad(params, inputs, targets))


@pytest.mark.parametrize("pe", sorted(TABLE_BOUND))
def test_unbounded_length_with_a_table_names_the_constraint(pe):
    model, params = model_and_params(pe)
    batch, length = jax.export.symbolic_shape("b, l")
    with pytest.raises(ValueError, match=f"constraints=\\('l <= {MAX_LEN}',\\)"):
        jax.export.export(jax.jit(lambda p, t: model.apply(p, t)))(params,
                                                                  jax.ShapeDtypeStruct((batch, length), jnp.int32))


@pytest.mark.parametrize("pe", ["cope", "corope"])
def test_pallas_model_refuses_symbolic_shapes_in_words(pe):
    model, params = model_and_params(pe, impl="pallas")
    with pytest.raises(ValueError, match="symbolic|static"):
        jax.export.export(jax.jit(lambda p, t: model.apply(p, t)))(params, symbolic_tokens(pe))
