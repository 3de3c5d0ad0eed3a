"""Rematerialised layers with dropout, bidirectional (encoder) layers, and the warning before a dense path builds
logits too large to hold.

B batch, L length, H heads, D head dim.
"""
import dataclasses
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpe
import jaxpe.nnx as jnnx
from numpy_reference import rope as np_rope

LAYER = dict(num_heads=2, num_kv_heads=1, head_dim=8, max_len=16)
BIDIRECTIONAL = ("none", "learned", "rope", "cope", "cope_rope", "corope", "fox")  # a sample of those both ways
CAUSAL_ONLY = ("alibi", "relative", "stickbreaking")


def _x(length: int = 6, batch: int = 2, width: int = 16) -> jax.Array:
    return jax.random.normal(jax.random.key(1), (batch, length, width))


def _dropout_rngs() -> dict[str, jax.Array]:
    return {"dropout": jax.random.key(7)}


# --- rematerialisation -------------------------------------------------------------------------------------------

def test_remat_attention_with_dropout_matches_the_plain_layer():
    """nn.remat(Attention) with dropout on (the field, or a positional static argument) and off gives the plain
    layer's values and gradients; a traced `deterministic` is a TypeError saying how to pass it."""
    x = _x()
    plain = jaxpe.Attention(pe="cope", dropout=0.5, **LAYER)
    params = plain.init(jax.random.key(0), x)

    def loss(module: nn.Module, params, *args, **kwargs):
        return jnp.sum(module.apply(params, x, *args, rngs=_dropout_rngs(), **kwargs) ** 2)

    positional = nn.remat(jaxpe.Attention, static_argnums=(2,))(pe="cope", dropout=0.5, **LAYER)
    for deterministic in (False, True):
        want = jax.jit(jax.value_and_grad(lambda p: loss(plain, p, deterministic=deterministic)))(params)
        by_field = nn.remat(jaxpe.Attention)(pe="cope", dropout=0.5, deterministic=deterministic, **LAYER)
        forms = ((by_field, ()), (positional, (deterministic,)))
        for module, args in forms if not deterministic else forms[1:]:  # dropout off: the positional form suffices
            got = jax.jit(jax.value_and_grad(lambda p: loss(module, p, *args)))(params)
            chex.assert_trees_all_close(got, want, atol=1e-6, rtol=1e-6)
    assert not np.allclose(plain.apply(params, x, False, rngs=_dropout_rngs()), plain.apply(params, x))
    traced = nn.remat(jaxpe.Attention)(pe="cope", dropout=0.5, **LAYER)
    with pytest.raises(TypeError, match="deterministic is traced.*static_argnums"):
        traced.apply(params, x, deterministic=False, rngs=_dropout_rngs())


def test_model_remat_gives_the_same_values_and_gradients():
    """Every policy, dropout on: the loss and every gradient (the shared CoPE table's included) as without remat."""
    config = jaxpe.ModelConfig(vocab_size=13, d_model=16, num_heads=2, num_layers=2, max_len=16, pe="cope",
                               pe_options={"shared_table": True}, dropout=0.2)
    tokens = jnp.arange(20, dtype=jnp.int32).reshape(2, 10) % 13
    params = jaxpe.TransformerLM(config).init(jax.random.key(0), tokens)

    def loss(params, config):
        logits = jaxpe.TransformerLM(config).apply(params, tokens, deterministic=False, rngs=_dropout_rngs())
        return jnp.mean(logits ** 2)

    step = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    want = step(params, config)
    for remat in ("dots", "full"):
        remat_config = dataclasses.replace(config, remat=remat)
        assert jax.tree.structure(jaxpe.TransformerLM(remat_config).init(jax.random.key(0), tokens)) == \
            jax.tree.structure(params)
        chex.assert_trees_all_close(step(params, remat_config), want, atol=1e-6, rtol=1e-6)


def test_model_remat_saves_memory_and_checks_its_name():
    """A rematerialised train step needs less temporary memory than one keeping every intermediate (XLA's memory
    analysis of the compiled step; benchmarks/remat_memory.py measures it at a long length)."""
    config = jaxpe.ModelConfig(vocab_size=13, d_model=32, num_heads=2, num_layers=2, max_len=128, pe="rope",
                               dropout=0.0)
    tokens = jnp.zeros((1, 128), jnp.int32)
    params = jaxpe.TransformerLM(config).init(jax.random.key(0), tokens)

    def temp_bytes(remat: str) -> int:
        model = jaxpe.TransformerLM(dataclasses.replace(config, remat=remat))
        step = jax.jit(jax.grad(lambda p: jnp.mean(model.apply(p, tokens) ** 2)))
        analysis = step.lower(params).compile().memory_analysis()
        if analysis is None:
            pytest.skip("this jaxlib gives no memory analysis")
        return analysis.temp_size_in_bytes

    assert temp_bytes("full") < temp_bytes("none")
    with pytest.raises(ValueError, match="remat='some'"):
        jaxpe.ModelConfig(remat="some")


# --- bidirectional layers ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("pe", BIDIRECTIONAL)
def test_bidirectional_layer_sees_later_tokens(pe):
    """causal=False: the output at position 0 changes with the last token; the causal layer's does not."""
    x = _x()
    later = x.at[:, -1].add(1.0)
    for causal in (True, False):
        layer = jaxpe.Attention(pe=pe, causal=causal, **LAYER)
        params = layer.init(jax.random.key(0), x)
        moved = np.abs(layer.apply(params, later)[:, 0] - layer.apply(params, x)[:, 0]).max()
        assert (moved > 1e-4) == (not causal), (causal, moved)


def _project(params, name: str, x: np.ndarray) -> np.ndarray:
    return np.einsum("bld,dhk->blhk", x, np.asarray(params["params"][name]["kernel"]))


def test_bidirectional_rope_layer_matches_numpy():
    """Full softmax over every key of rotated q, k, restated in NumPy (float64), GQA with 2 query heads on 1."""
    x = _x()
    layer = jaxpe.Attention(pe="rope", causal=False, **LAYER)
    params = jax.tree.map(np.asarray, nn.meta.unbox(layer.init(jax.random.key(0), x)))
    xs = np.asarray(x, np.float64)
    positions = np.arange(x.shape[1])
    q = np_rope(_project(params, "query", xs), positions)
    k = np_rope(_project(params, "key", xs), positions)
    v = _project(params, "value", xs)
    logits = np.einsum("bqhd,bkd->bhqk", q, k[:, :, 0]) / np.sqrt(q.shape[-1])
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    heads = np.einsum("bhqk,bkd->bqhd", weights, v[:, :, 0])
    want = np.einsum("bqhd,hde->bqe", heads, params["params"]["out"]["kernel"])
    np.testing.assert_allclose(layer.apply(params, x), want, atol=2e-5, rtol=1e-4)


def test_bidirectional_none_layer_is_permutation_equivariant():
    """Without positions a bidirectional layer commutes with any reordering of the tokens (a causal one does not)."""
    x = _x(length=7)
    order = jnp.array([3, 0, 6, 1, 5, 2, 4])
    for causal in (False, True):
        layer = jaxpe.Attention(pe="none", causal=causal, **LAYER)
        params = layer.init(jax.random.key(0), x)
        same = np.allclose(layer.apply(params, x[:, order]), layer.apply(params, x)[:, order], atol=1e-5)
        assert same == (not causal)


@pytest.mark.parametrize("pe", ["cope", "corope", "fox"])
def test_bidirectional_contextual_layer_is_its_pure_function(pe):
    """The layer's causal=False is cope_attention / corope_attention / forgetting_attention with causal=False on its
    projections (FoX's log forget gates log σ(x·W + b), restated in NumPy)."""
    x = _x()
    layer = jaxpe.Attention(pe=pe, causal=False, **LAYER)
    params = nn.meta.unbox(layer.init(jax.random.key(0), x))
    q, k, v = (jnp.asarray(_project(params, name, np.asarray(x))) for name in ("query", "key", "value"))
    if pe == "cope":
        heads = jaxpe.cope_attention(q, k, v, params["params"]["pe"]["pos_emb"], causal=False, impl="reference")
    elif pe == "corope":
        heads = jaxpe.corope_attention(q, k, v, causal=False, impl="reference")
    else:
        gate = params["params"]["pe"]["fgate"]
        logits = np.asarray(x, np.float64) @ np.asarray(gate["kernel"], np.float64) + np.asarray(gate["bias"])
        heads = jaxpe.forgetting_attention(q, k, v, jnp.asarray(-np.logaddexp(0.0, -logits), jnp.float32),
                                           causal=False, impl="reference")
    want = jnp.einsum("bqhd,hde->bqe", heads, params["params"]["out"]["kernel"])
    chex.assert_trees_all_close(layer.apply(params, x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pe, impl", [("cope", "pallas"), ("cope", "triton"), ("corope", "pallas"),
                                      ("corope", "triton"), ("fox", "pallas")])
def test_bidirectional_layer_refuses_the_causal_kernels(pe, impl):
    """A layer or model asked for a fused (causal) kernel and causal=False says so when it is built, rather than at
    its first call (or attending causally)."""
    refusal = f"causal=False is not supported by impl='{impl}'"
    with pytest.raises(ValueError, match=refusal):
        jaxpe.Attention(pe=pe, causal=False, impl=impl, **LAYER)
    with pytest.raises(ValueError, match=refusal):
        jaxpe.ModelConfig(vocab_size=8, d_model=16, num_layers=1, num_heads=2, pe=pe, impl=impl, causal=False)
    with pytest.raises(ValueError, match=refusal):
        jnnx.Attention(16, pe=pe, num_heads=2, num_kv_heads=1, head_dim=8, causal=False, impl=impl, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("impl", ["pallas", "triton"])
def test_bidirectional_layer_without_kernels_ignores_impl(impl):
    """impl chooses the contextual encodings' kernels only: a RoPE encoder layer given a fused impl attends both ways
    (the last query sees the first key's value change)."""
    layer = jaxpe.Attention(pe="rope", causal=False, impl=impl, **LAYER)
    x = _x()
    params = layer.init(jax.random.key(0), x)
    moved = layer.apply(params, x.at[:, -1].add(1.0))
    assert not np.allclose(layer.apply(params, x)[:, 0], moved[:, 0])


@pytest.mark.parametrize("pe", CAUSAL_ONLY)
def test_causal_only_encodings_refuse_causal_false(pe):
    with pytest.raises(ValueError, match=f"causal=False: pe='{pe}' runs causal attention only"):
        jaxpe.Attention(pe=pe, causal=False, **LAYER)
    with pytest.raises(ValueError, match=f"pe='{pe}' runs causal attention only"):
        jaxpe.ModelConfig(pe=pe, causal=False)
    with pytest.raises(ValueError, match="pe='relative' runs causal attention only"):
        jaxpe.ModelConfig(pe="cope", layer_pe=("cope", "relative"), causal=False)
    with pytest.raises(ValueError, match="add_relative=True"):
        jaxpe.Attention(pe=jaxpe.pe_config("cope", add_relative=True), causal=False, **LAYER)


def test_bidirectional_model_encodes_and_refuses_to_decode():
    config = jaxpe.ModelConfig(vocab_size=13, d_model=16, num_heads=2, num_layers=2, max_len=16, pe="corope",
                               dropout=0.0, causal=False)
    model = jaxpe.TransformerLM(config)
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
    params = model.init(jax.random.key(0), tokens)
    moved = model.apply(params, tokens.at[:, -1].set(0))[:, 0] - model.apply(params, tokens)[:, 0]
    assert np.abs(moved).max() > 1e-4  # position 0 reads the last token
    with pytest.raises(ValueError, match="decode=True needs causal attention.*causal=False"):
        jaxpe.generate(model, params, tokens[:, :2], max_new_tokens=2)
    nnx_model = jnnx.TransformerLM(config, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="decode=True needs causal attention"):
        nnx_model.init_cache(1, 8)


def test_nnx_bidirectional_layer_matches_linen_and_rematerialises_with_dropout():
    x = _x()
    make = lambda: jnnx.Attention(16, pe="rope", causal=False, dropout=0.5,  # noqa: E731
                                  rngs=nnx.Rngs(params=0, dropout=1), **LAYER)
    layer = make()
    layer.eval()
    linen = jaxpe.Attention(pe="rope", causal=False, dropout=0.5, **LAYER)
    chex.assert_trees_all_close(layer(x), linen.apply({"params": layer.linen_params()}, x), atol=1e-6)

    def loss(layer, x):
        return jnp.sum(layer(x) ** 2)

    want = nnx.value_and_grad(loss)(make(), x)
    got = nnx.value_and_grad(lambda layer, x: nnx.remat(loss)(layer, x))(make(), x)
    chex.assert_trees_all_close(jax.tree.leaves(got), jax.tree.leaves(want), atol=1e-6, rtol=1e-6)


# --- dense paths at lengths they cannot hold ---------------------------------------------------------------------

def test_dense_path_over_4_gib_warns_before_compiling():
    """impl="reference" at L = 131072 means [1, 1, L, L] float32 logits of 64 GiB: a warning while tracing
    (jax.eval_shape computes nothing); "auto" at that length runs blockwise without one."""
    length = 131072
    q = jax.ShapeDtypeStruct((1, length, 1, 8), jnp.float32)
    pos_emb = jax.ShapeDtypeStruct((16, 8), jnp.float32)
    with pytest.warns(RuntimeWarning, match=r"\[1, 1, 131072, 131072\] float32 logits of 64\.0 GiB.*impl='auto'"):
        jax.eval_shape(lambda q, e: jaxpe.cope_attention(q, q, q, e, impl="reference"), q, pos_emb)
    with pytest.warns(RuntimeWarning, match="Co-RoPE's 'reference' path.*64.0 GiB"):
        jax.eval_shape(lambda q: jaxpe.corope_attention(q, q, q, impl="reference"), q)
    layer = jaxpe.Attention(pe="rope", num_heads=1, num_kv_heads=1, head_dim=8)
    x = jax.ShapeDtypeStruct((1, length, 8), jnp.float32)
    with pytest.warns(RuntimeWarning, match="softmax attention builds dense.*dense at every impl"):
        jax.eval_shape(lambda x: layer.init_with_output(jax.random.key(0), x)[0], x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.eval_shape(lambda q, e: jaxpe.cope_attention(q, q, q, e, impl="auto"), q, pos_emb)
        jax.eval_shape(lambda q, e: jaxpe.cope_attention(q[:, :4096], q[:, :4096], q[:, :4096], e,
                                                         impl="reference"), q, pos_emb)

