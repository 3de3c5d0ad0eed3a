"""jaxpe.nnx in an ordinary NNX program, where it fell short of linen: constructor checks that name the argument,
no dropout stream needed without dropout, decoding past max_len as jaxpe.init_cache allows; and an orbax round trip of
nnx.state into an nnx.eval_shape model."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxpe
import jaxpe.nnx

B, L, V, D_MODEL, MAX_LEN = 2, 10, 11, 16, 8
HEADS = dict(num_heads=2, num_kv_heads=1, head_dim=8)


def make_config(pe: str, **fields) -> jaxpe.ModelConfig:
    return jaxpe.ModelConfig(**{**dict(vocab_size=V, d_model=D_MODEL, num_layers=2, num_heads=2, max_len=MAX_LEN,
                                       pe=pe, dropout=0.0), **fields})


def tokens_for(seed: int, length: int = L) -> jax.Array:
    return jax.random.randint(jax.random.PRNGKey(seed), (B, length), 0, V, dtype=jnp.int32)


BUILDERS = {
    "attention": lambda **kw: jaxpe.nnx.Attention(D_MODEL, **HEADS, pe="rope", rngs=nnx.Rngs(0), **kw),
    "model": lambda **kw: jaxpe.nnx.TransformerLM(make_config("rope"), rngs=nnx.Rngs(0), **kw),
}


@pytest.mark.parametrize("layer", sorted(BUILDERS))
@pytest.mark.parametrize("value", ["no", 1, None], ids=repr)
def test_deterministic_must_be_a_bool_at_construction(layer, value):
    """As linen's field: a ValueError naming it, not a TypeError at the first call (None silently turned dropout
    off while drawing keys)."""
    with pytest.raises(ValueError, match=rf"deterministic={value!r} must be a bool"):
        BUILDERS[layer](deterministic=value)
    if value is not None and hasattr(nnx, "view"):  # flax >= 0.12.5
        with pytest.raises(ValueError, match=rf"deterministic={value!r} must be a bool"):
            nnx.view(BUILDERS[layer](), deterministic=value)


def test_no_dropout_needs_no_dropout_stream():
    """dropout=0 in training mode runs with nnx.Rngs(params=...) only, as nnx.Dropout(0.0) does, and equals linen."""
    tokens = tokens_for(1)
    model = jaxpe.nnx.TransformerLM(make_config("cope"), rngs=nnx.Rngs(params=0))
    assert not model.deterministic
    np.testing.assert_array_equal(model(tokens), jaxpe.TransformerLM(make_config("cope")).apply(
        {"params": model.linen_params()}, tokens))
    layer = jaxpe.nnx.Attention(D_MODEL, **HEADS, pe="corope", rngs=nnx.Rngs(params=0))
    x = jax.random.normal(jax.random.PRNGKey(2), (B, L, D_MODEL))
    np.testing.assert_array_equal(layer(x), jaxpe.Attention(**HEADS, pe="corope").apply(
        {"params": layer.linen_params()}, x))
    with pytest.raises(ValueError, match="needs a 'dropout' or 'default' stream"):  # with dropout, the clear error
        jaxpe.nnx.Attention(D_MODEL, **HEADS, pe="rope", dropout=0.1, rngs=nnx.Rngs(params=0))(x)


def test_sizes_are_checked_before_the_sample_input():
    with pytest.raises(ValueError, match=r"d_model=7\.5 must be an int >= 1"):  # was a jax shape TypeError
        jaxpe.nnx.AMSPE(7.5, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="d_model=0 must be an int >= 1"):  # was a table of width 0
        jaxpe.nnx.embedding("learned", d_model=0, max_len=MAX_LEN, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="max_len=0 must be an int >= 1"):  # was "length=0"
        jaxpe.nnx.embedding("sinusoidal", d_model=D_MODEL, max_len=0, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("pe", ["rope", "cope"])
def test_decodes_past_max_len_as_linen(pe):
    """Encodings acting in attention decode beyond max_len (docs/decoding.md); prefill + one token at a time under
    nnx.jit equals linen's full forward of max_len + 2 tokens."""
    config = make_config(pe)
    model = jaxpe.nnx.TransformerLM(config, rngs=nnx.Rngs(3), deterministic=True)
    tokens = tokens_for(4, MAX_LEN + 2)
    full = jaxpe.TransformerLM(config).apply({"params": model.linen_params()}, tokens)
    model.init_cache(B, MAX_LEN + 2)
    step = nnx.jit(lambda m, t: m(t, decode=True))
    steps = [step(model, tokens[:, :3])] + [step(model, tokens[:, i:i + 1]) for i in range(3, MAX_LEN + 2)]
    chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), full, atol=1e-5, rtol=1e-5)


def test_orbax_restores_nnx_state_into_an_abstract_model(tmp_path):
    """nnx.state saved with orbax, restored into nnx.eval_shape's abstract model (shared CoPE table, dropout stream
    included): the same outputs and the same next dropout key."""
    config = make_config("cope", pe_options={"shared_table": True, "npos": 4}, dropout=0.5)
    model = jaxpe.nnx.TransformerLM(config, rngs=nnx.Rngs(params=5, dropout=6))
    model(tokens_for(0))  # advance the dropout stream
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "state", nnx.state(model))
    checkpointer.wait_until_finished()
    graph, abstract = nnx.split(nnx.eval_shape(lambda: jaxpe.nnx.TransformerLM(config, rngs=nnx.Rngs(0))))
    restored = nnx.merge(graph, checkpointer.restore(tmp_path / "state", abstract))
    tokens = tokens_for(7)
    np.testing.assert_array_equal(restored(tokens), model(tokens))  # training mode: the same mask
    np.testing.assert_array_equal(restored(tokens, deterministic=True), model(tokens, deterministic=True))


def test_a_call_takes_the_dropout_rngs_as_nnx_dropout():
    """`rngs=` at the call (an nnx.Rngs, an nnx.RngStream or a key) draws the masks, as in nnx.Dropout and
    nnx.MultiHeadAttention, for a model built without a dropout stream; under nnx.jit too."""
    config = make_config("cope", dropout=0.5)
    model = jaxpe.nnx.TransformerLM(config, rngs=nnx.Rngs(params=0))
    tokens = tokens_for(8)
    expected = lambda key: jaxpe.TransformerLM(config).apply(  # noqa: E731
        {"params": model.linen_params()}, tokens, deterministic=False, rngs={"dropout": key})
    key = jax.random.key(9)
    np.testing.assert_array_equal(model(tokens, rngs=key), expected(key))
    np.testing.assert_array_equal(model(tokens, rngs=nnx.Rngs(dropout=9)), expected(nnx.Rngs(dropout=9).dropout()))
    stream = nnx.Rngs(3).default
    # compiled against eager: the same masks (a different one moves outputs by O(1)), XLA's rounding (jax 0.11 fuses)
    np.testing.assert_allclose(nnx.jit(lambda m, r: m(tokens, rngs=r))(model, stream),
                               expected(nnx.Rngs(3).default()), rtol=1e-5, atol=1e-6)
    assert int(stream.count[...]) == 1  # the caller's stream advanced
    layer = jaxpe.nnx.Attention(D_MODEL, **HEADS, pe="rope", dropout=0.5, rngs=nnx.Rngs(params=0))
    x = jax.random.normal(jax.random.PRNGKey(2), (B, L, D_MODEL))
    np.testing.assert_array_equal(layer(x, rngs=key), jaxpe.Attention(**HEADS, pe="rope", dropout=0.5).apply(
        {"params": layer.linen_params()}, x, deterministic=False, rngs={"dropout": key}))
    with pytest.raises(TypeError, match="rngs must be an nnx.Rngs, an nnx.RngStream or a PRNG key"):
        layer(x, rngs=3)


def test_a_core_without_a_decoding_cache_decodes_without_init_cache():
    """As its docstring says and as linen: only the cores that cache (here CoPE "sep_keys") need init_cache first."""
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (B, L, 2, 8)) for i in (2, 3, 4))
    q_pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    ctx = jaxpe.AttentionContext(x=jax.random.normal(jax.random.PRNGKey(1), (B, L, D_MODEL)), q_pos=q_pos, k_pos=q_pos,
                                 mask=jnp.arange(L)[None, None, :] <= q_pos[:, :, None], decode=True)
    core = lambda pe: jaxpe.nnx.core(pe, num_heads=2, num_kv_heads=2, head_dim=8, d_model=D_MODEL,  # noqa: E731
                                     max_len=16, rngs=nnx.Rngs(0))
    rope = core("rope")
    np.testing.assert_array_equal(rope(q, k, v, ctx), jaxpe.pe_config("rope").core(
        head_dim=8, max_len=16, impl="auto").apply({"params": rope.linen_params()}, q, k, v, ctx))
    assert rope.cache is None
    sep_keys = core(jaxpe.pe_config("cope", gates="sep_keys"))
    with pytest.raises(ValueError, match=r"call init_cache\(batch_size, length\) first"):
        sep_keys(q, k, v, ctx)
    assert sep_keys.cache is None
