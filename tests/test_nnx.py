"""jaxpe.nnx: each NNX layer equals its linen twin for the same parameters, in training and evaluation; decoding with
the cache equals the full forward; generate equals jaxpe.generate; nnx.Optimizer under nnx.jit trains."""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpe
import jaxpe.nnx

B, L, V = 2, 12, 13


def make_config(pe: str, **options) -> jaxpe.ModelConfig:
    fields = dict(vocab_size=V, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_len=16, pe=pe,
                  dropout=0.0)
    return jaxpe.ModelConfig(**{**fields, **options})


def tokens_for(seed: int, length: int = L) -> jax.Array:
    return jax.random.randint(jax.random.PRNGKey(seed), (B, length), 0, V, dtype=jnp.int32)


# (pe, pe_options): every registered encoding, plus the CoPE options that own extra parameters or caches.
ENCODINGS = [(name, {}) for name in jaxpe.PE_NAMES] + [
    ("cope", {"npos": 5, "gates": "sep_keys", "per_head": True}),
    ("cope", {"npos": 6, "shared_table": True, "add_relative": True}),
]
IDS = [name + "-" + "-".join(map(str, options.values())) if options else name for name, options in ENCODINGS]


@pytest.mark.parametrize(("pe", "options"), ENCODINGS, ids=IDS)
def test_transformer_lm_equals_linen(pe, options):
    config = make_config(pe, pe_options=options)
    model = jaxpe.nnx.TransformerLM(config, rngs=nnx.Rngs(0))
    linen = jaxpe.TransformerLM(config)
    tokens = tokens_for(1)
    reference = nn.meta.unbox(linen.init(jax.random.PRNGKey(0), tokens)["params"])
    chex.assert_trees_all_equal_shapes_and_dtypes(model.linen_params(), reference)
    y = model(tokens, deterministic=True)
    chex.assert_shape(y, (B, L, V))
    np.testing.assert_array_equal(y, linen.apply({"params": model.linen_params()}, tokens))
    # Linen parameters loaded into the NNX model give the linen outputs.
    model.load_linen_params(reference)
    np.testing.assert_array_equal(model(tokens, deterministic=True), linen.apply({"params": reference}, tokens))
    assert not np.allclose(model(tokens, deterministic=True), y)


def test_load_linen_params_checks_the_tree():
    model = jaxpe.nnx.TransformerLM(make_config("rope"), rngs=nnx.Rngs(0))
    params = model.linen_params()
    with pytest.raises(ValueError, match="params must have the tree"):
        model.load_linen_params({**params, "extra": jnp.zeros(3)})
    wrong = jax.tree.map(lambda p: p, params)
    wrong["embed"]["embedding"] = jnp.zeros((V + 1, 32))
    with pytest.raises(ValueError, match=r"params\['embed'\]\['embedding'\] must have shape"):
        model.load_linen_params(wrong)


def test_dropout_follows_train_and_eval():
    config = make_config("cope", dropout=0.5)
    model = jaxpe.nnx.TransformerLM(config, rngs=nnx.Rngs(params=0, dropout=1))
    linen, tokens = jaxpe.TransformerLM(config), tokens_for(2)
    variables = {"params": model.linen_params()}
    dropout_keys = nnx.Rngs(dropout=1).dropout.fork()  # the model's own fork of that stream, replayed
    for _ in range(2):  # training by default, one new mask per call
        expected = linen.apply(variables, tokens, deterministic=False, rngs={"dropout": dropout_keys()})
        np.testing.assert_array_equal(model(tokens), expected)
    evaluation = linen.apply(variables, tokens)
    assert not np.allclose(expected, evaluation)
    model.eval()
    np.testing.assert_array_equal(model(tokens), evaluation)
    expected = linen.apply(variables, tokens, deterministic=False, rngs={"dropout": dropout_keys()})
    np.testing.assert_array_equal(model(tokens, deterministic=False), expected)
    model.train()
    forward = nnx.jit(lambda m, t: m(t))
    first, second = forward(model, tokens), forward(model, tokens)  # the key stream advances under nnx.jit
    assert not np.allclose(first, second)
    if hasattr(nnx, "view"):  # flax >= 0.12.5
        np.testing.assert_array_equal(nnx.view(model, deterministic=True)(tokens), evaluation)
        assert not model.deterministic


@pytest.mark.parametrize(("pe", "options"), [("rope", {}), ("learned", {}), ("cope_gated", {}), ("corope", {}),
                                             ("cope", {"gates": "sep_keys", "npos": 8})], ids=str)
def test_decode_equals_full_forward(pe, options):
    model = jaxpe.nnx.TransformerLM(make_config(pe, pe_options=options), rngs=nnx.Rngs(0))
    model.eval()
    tokens = tokens_for(3)
    full = model(tokens)
    model.init_cache(B, L)
    steps = [model(tokens[:, :5], decode=True)] + [model(tokens[:, i:i + 1], decode=True) for i in range(5, L)]
    chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), full, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(model.cache["position"][...], [L] * B)  # each row's next position


def test_decode_needs_a_cache_of_a_valid_size():
    model = jaxpe.nnx.TransformerLM(make_config("rope"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="init_cache"):
        model(tokens_for(0), decode=True)
    with pytest.raises(ValueError, match="batch_size=0"):
        model.init_cache(0, 4)
    learned = jaxpe.nnx.TransformerLM(make_config("learned"), rngs=nnx.Rngs(0))  # a table of max_len rows
    with pytest.raises(ValueError, match="L=17 exceeds the position table's max_len=16"):
        learned.init_cache(B, 17)


@pytest.mark.parametrize("pe", ["rope", "cope", "corope", "learned"])
def test_generate_equals_linen_generate(pe):
    config = make_config(pe)
    model = jaxpe.nnx.TransformerLM(config, rngs=nnx.Rngs(4))
    linen, params = jaxpe.TransformerLM(config), model.linen_params()
    prompt = tokens_for(5, length=4)
    out = jaxpe.nnx.generate(model, prompt, max_new_tokens=6)
    chex.assert_shape(out, (B, 10))
    np.testing.assert_array_equal(out, jaxpe.generate(linen, params, prompt, max_new_tokens=6))
    rng = jax.random.PRNGKey(7)
    sampled = jaxpe.nnx.generate(model, prompt, max_new_tokens=6, rng=rng, temperature=1.0)
    np.testing.assert_array_equal(sampled, jaxpe.generate(linen, params, prompt, max_new_tokens=6, rng=rng,
                                                          temperature=1.0))
    assert model.cache is None  # generate leaves the model's own cache alone


def test_generate_rejects_a_linen_model():
    config = make_config("rope")
    with pytest.raises(TypeError, match="jaxpe.nnx.TransformerLM"):
        jaxpe.nnx.generate(jaxpe.TransformerLM(config), tokens_for(0, 4), max_new_tokens=2)
    model = jaxpe.nnx.TransformerLM(make_config("learned"), rngs=nnx.Rngs(0))  # a table of max_len rows
    with pytest.raises(ValueError, match="exceeds max_len"):
        jaxpe.nnx.generate(model, tokens_for(0, 4), max_new_tokens=14)  # 17 fed


def test_training_with_nnx_optimizer_under_nnx_jit_reduces_the_loss():
    model = jaxpe.nnx.TransformerLM(make_config("cope", dropout=0.1), rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    tokens = tokens_for(6)

    def loss_fn(model: jaxpe.nnx.TransformerLM) -> jax.Array:
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @nnx.jit
    def train_step(model: jaxpe.nnx.TransformerLM, optimizer: nnx.Optimizer) -> jax.Array:
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    before = model.linen_params()
    evaluation = nnx.jit(loss_fn)  # retraced when model.eval() / model.train() change the mode
    model.eval()
    initial = float(evaluation(model))
    model.train()
    losses = [float(train_step(model, optimizer)) for _ in range(8)]
    model.eval()
    final = float(evaluation(model))
    assert np.all(np.isfinite(losses))
    assert final < 0.8 * initial, (initial, losses, final)
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), before, model.linen_params())
    assert all(jax.tree.leaves(changed))


@pytest.mark.parametrize(("pe", "options"), ENCODINGS, ids=IDS)
def test_attention_equals_linen(pe, options):
    pe_config = jaxpe.pe_config(pe, **options)
    fields = dict(num_heads=4, num_kv_heads=2, head_dim=8, pe=pe_config, max_len=16, dropout=0.5)
    layer = jaxpe.nnx.Attention(32, **fields, rngs=nnx.Rngs(params=0, dropout=1))
    linen = jaxpe.Attention(**fields)
    x = jax.random.normal(jax.random.PRNGKey(1), (B, L, 32))
    shape = pe_config.shared_table_shape(head_dim=8, num_heads=4, max_len=16)
    pos_emb = None if shape is None else jax.random.normal(jax.random.PRNGKey(2), shape)
    variables = {"params": layer.linen_params()}
    expected = linen.apply(variables, x, deterministic=False, pos_emb=pos_emb,
                           rngs={"dropout": nnx.Rngs(dropout=1).dropout.fork()()})
    np.testing.assert_array_equal(layer(x, pos_emb=pos_emb), expected)
    layer.eval()
    y = layer(x, pos_emb=pos_emb)
    chex.assert_shape(y, (B, L, 32))
    np.testing.assert_array_equal(y, linen.apply(variables, x, pos_emb=pos_emb))
    if shape is not None:
        with pytest.raises(ValueError, match="pos_emb is None"):
            layer(x)


@pytest.mark.parametrize("pe", ["cope_gated", "relative"])
def test_attention_decode_equals_full_forward(pe):
    layer = jaxpe.nnx.Attention(32, num_heads=4, num_kv_heads=1, head_dim=8, pe=jaxpe.pe_config(pe), max_len=16,
                                rngs=nnx.Rngs(0), deterministic=True)
    x = jax.random.normal(jax.random.PRNGKey(1), (B, L, 32))
    full = layer(x)
    layer.init_cache(B, L)
    steps = [layer(x[:, :4], decode=True)] + [layer(x[:, i:i + 1], decode=True) for i in range(4, L)]
    chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), full, atol=1e-5, rtol=1e-5)


def test_amspe_equals_linen():
    layer = jaxpe.nnx.AMSPE(7, max_len=20, coarse_scale=5.0, rngs=nnx.Rngs(0))
    assert layer.params["alpha"][...].shape == (1,)
    params = {"alpha": jnp.array([0.7])}
    layer.load_linen_params(params)
    x = jax.random.normal(jax.random.PRNGKey(1), (B, L, 7))
    positions = jnp.broadcast_to(jnp.arange(3, 3 + L), (B, L))
    linen = jaxpe.AMSPE(7, max_len=20, coarse_scale=5.0)
    for detail_level, pos in ((0.5, None), (0.9, positions)):
        expected = linen.apply({"params": params}, x, detail_level, positions=pos)
        np.testing.assert_array_equal(layer(x, detail_level, positions=pos), expected)
    assert not np.allclose(layer(x), layer(x, positions=positions))


@pytest.mark.parametrize("pe", jaxpe.PE_NAMES)
def test_encoding_modules_equal_linen(pe):
    pe_config = jaxpe.pe_config(pe)
    x = jax.random.normal(jax.random.PRNGKey(1), (B, L, 32))
    module = pe_config.embedding(d_model=32, max_len=16)
    emb = jaxpe.nnx.embedding(pe_config, d_model=32, max_len=16, rngs=nnx.Rngs(0))
    assert (emb is None) == (module is None)
    if emb is not None:
        positions = jnp.broadcast_to(jnp.arange(2, 2 + L), (B, L))
        np.testing.assert_array_equal(emb(x, positions=positions),
                                      module.apply({"params": emb.linen_params()}, x, positions=positions))
    core = jaxpe.nnx.core(pe_config, num_heads=4, num_kv_heads=2, head_dim=8, d_model=32, max_len=16,
                          rngs=nnx.Rngs(0))
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (B, L, h, 8)) for i, h in ((2, 4), (3, 2), (4, 2)))
    ctx = jaxpe.AttentionContext(x=x, q_pos=jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)))
    out = core(q, k, v, ctx)
    chex.assert_shape(out, (B, L, 4, 8))
    linen_core = pe_config.core(head_dim=8, max_len=16, impl="auto")
    np.testing.assert_array_equal(out, linen_core.apply({"params": core.linen_params()}, q, k, v, ctx))


def test_core_decode_with_its_own_cache_equals_full_forward():
    """CoPE with separate gate keys caches them: queries of each step see the keys of every earlier step."""
    pe = jaxpe.pe_config("cope", gates="sep_keys", npos=6)
    core = jaxpe.nnx.core(pe, num_heads=2, num_kv_heads=2, head_dim=8, d_model=16, max_len=16, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (B, L, 16))
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (B, L, 2, 8)) for i in (2, 3, 4))
    q_pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    full = core(q, k, v, jaxpe.AttentionContext(x=x, q_pos=q_pos))
    core.init_cache(B, L)
    assert core.cache["gate_keys"][...].shape == (B, L, 2, 8)
    steps = []
    for start, stop in ((0, 5), *((i, i + 1) for i in range(5, L))):
        mask = jnp.arange(L)[None, None, :] <= q_pos[:, start:stop, None]  # [B, Lq, S]
        ctx = jaxpe.AttentionContext(x=x[:, start:stop], q_pos=q_pos[:, start:stop], mask=mask, decode=True)
        steps.append(core(q[:, start:stop], k, v, ctx))
    chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), full, atol=1e-5, rtol=1e-5)


def test_layers_compose_in_an_nnx_module():
    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.norm = nnx.LayerNorm(32, rngs=rngs)
            self.attn = jaxpe.nnx.Attention(32, num_heads=4, num_kv_heads=2, head_dim=8,
                                            pe=jaxpe.pe_config("corope"), dropout=0.1, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return x + self.attn(self.norm(x))

    block = Block(nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (B, L, 32))
    grads = nnx.grad(lambda b: jnp.mean(b(x) ** 2))(block)
    paths = {path for path, _ in nnx.to_flat_state(grads)}
    assert paths >= {("attn", "params", "query", "kernel"), ("norm", "scale")}
    block.eval()
    chex.assert_trees_all_close(nnx.jit(lambda b: b(x))(block), block(x), atol=1e-5, rtol=1e-5)


def test_arguments_are_checked():
    config = make_config("rope")
    with pytest.raises(TypeError, match="rngs must be an nnx.Rngs"):
        jaxpe.nnx.TransformerLM(config, rngs=0)
    with pytest.raises(TypeError, match="config must be a jaxpe.ModelConfig"):
        jaxpe.nnx.TransformerLM({"vocab_size": V}, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="pe must be an encoding name"):
        jaxpe.nnx.Attention(32, num_heads=4, num_kv_heads=2, head_dim=8, pe=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="d_model=0"):
        jaxpe.nnx.Attention(0, num_heads=4, num_kv_heads=2, head_dim=8, pe=jaxpe.pe_config("rope"),
                            rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="pe must be an encoding name"):
        jaxpe.nnx.core(0, num_heads=4, num_kv_heads=2, head_dim=8, d_model=32, rngs=nnx.Rngs(0))


def test_both_import_forms_work():
    from jaxpe import nnx as jaxpe_nnx

    assert jaxpe_nnx is jaxpe.nnx
    assert set(jaxpe_nnx.__all__) <= set(dir(jaxpe_nnx))
