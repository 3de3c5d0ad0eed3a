"""Layers for real models: packed documents, padding, caller positions, left-padded generation, sliding
windows, parameter dtype and logical sharding names.

References are identities that do not depend on how the code computes them: a packed row equals its documents run one
by one; padding never changes the real tokens; a cached decode equals the full forward pass; a window of one key is
attention to oneself; an independent NumPy restatement of windowed softmax attention.
"""
import functools
import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
from tiny_config import xla_flags

CONTEXTUAL = ("cope", "corope")  # the encodings with blockwise and fused implementations
INDEX_BASED = ("learned", "sinusoidal", "amspe", "rope", "alibi", "relative")
CASES = [(pe, "auto") for pe in jaxpe.PE_NAMES if pe not in CONTEXTUAL] + [
    (pe, impl) for pe in CONTEXTUAL for impl in ("reference", "blockwise", "pallas")]
VOCAB, MAX_LEN = 13, 32


def model(pe: str, impl: str = "auto", **overrides) -> jaxpe.TransformerLM:
    config = dict(vocab_size=VOCAB, d_model=16, num_layers=2, num_heads=2, max_len=MAX_LEN, pe=pe, impl=impl,
                  dropout=0.0)
    config.update(overrides)
    return jaxpe.TransformerLM(jaxpe.ModelConfig(**config))


def init(lm: jaxpe.TransformerLM, length: int = 8):
    return nn.meta.unbox(lm.init(jax.random.PRNGKey(1), jnp.zeros((1, length), jnp.int32))["params"])


@functools.cache
def built(pe: str, impl: str) -> tuple[jaxpe.TransformerLM, dict, object]:
    """The model of CASES, its parameters and its jitted apply, made once per (pe, impl) for the tests that share
    them."""
    lm = model(pe, impl)
    return lm, init(lm), jax.jit(lm.apply)


def tokens(batch: int, length: int, seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.PRNGKey(seed), (batch, length), 0, VOCAB)


def close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=tol)


@pytest.mark.parametrize("pe,impl", CASES)
def test_packed_row_equals_documents_run_separately(pe, impl):
    _, params, apply = built(pe, impl)
    toks = tokens(2, 12)
    lengths = (5, 4, 3)  # three documents per row, boundaries inside and across kernel blocks
    segments = jnp.asarray(np.repeat(np.arange(3), lengths))[None].repeat(2, axis=0)
    packed = apply({"params": params}, toks, segment_ids=segments)
    start = 0
    for n in lengths:
        alone = apply({"params": params}, toks[:, start:start + n])
        close(packed[:, start:start + n], alone)
        start += n


@pytest.mark.parametrize("pe,impl", CASES)
def test_padding_never_changes_real_tokens(pe, impl):
    _, params, apply = built(pe, impl)
    toks = tokens(2, 9)
    real = apply({"params": params}, toks)
    pad = jnp.full((2, 3), 7, jnp.int32)  # any token id: padding is marked by the mask, not the id
    right = apply({"params": params}, jnp.concatenate([toks, pad], 1),
                  padding_mask=jnp.arange(12)[None].repeat(2, 0) < 9)
    close(right[:, :9], real)
    left = apply({"params": params}, jnp.concatenate([pad, toks], 1),
                 padding_mask=jnp.arange(12)[None].repeat(2, 0) >= 3)
    close(left[:, 3:], real)


@pytest.mark.parametrize("pe,impl", CASES)
def test_left_padded_generate_equals_each_prompt_alone(pe, impl):
    lm, params, apply = built(pe, impl)
    short, long = tokens(1, 3, seed=2), tokens(1, 6, seed=3)
    batch = jnp.concatenate([jnp.concatenate([jnp.zeros((1, 3), jnp.int32), short], 1), long])
    mask = jnp.asarray([[False] * 3 + [True] * 3, [True] * 6])
    together = jaxpe.generate(lm, params, batch, max_new_tokens=4, padding_mask=mask)
    np.testing.assert_array_equal(together[0, 3:], jaxpe.generate(lm, params, short, max_new_tokens=4)[0])
    np.testing.assert_array_equal(together[1], jaxpe.generate(lm, params, long, max_new_tokens=4)[0])
    # and the logits of the generated sequence match an unpadded forward pass
    full = apply({"params": params}, together[:1, 3:])
    padded = apply({"params": params}, together[:1], padding_mask=jnp.arange(10)[None] >= 3)
    close(padded[:, 3:], full, tol=5e-5)


@pytest.mark.parametrize("pe", INDEX_BASED)
def test_caller_positions_are_consistent_with_the_cache(pe):
    lm = model(pe)
    params = init(lm)
    toks = tokens(2, 7)
    positions = jnp.asarray([[3, 4, 5, 6, 7, 8, 9], [0, 2, 4, 6, 8, 10, 12]])
    full = lm.apply({"params": params}, toks, positions=positions)
    assert not np.allclose(full, lm.apply({"params": params}, toks), atol=1e-4)  # positions are used
    cache = jaxpe.init_cache(lm, 2, 7)
    prefill, updated = lm.apply({"params": params, "cache": cache}, toks[:, :4], decode=True,
                                positions=positions[:, :4], mutable=["cache"])
    close(prefill, full[:, :4])
    cache = updated["cache"]
    for t in range(4, 7):
        step, updated = lm.apply({"params": params, "cache": cache}, toks[:, t:t + 1], decode=True,
                                 positions=positions[:, t:t + 1], mutable=["cache"])
        close(step[:, 0], full[:, t])
        cache = updated["cache"]


@pytest.mark.parametrize("pe", ("rope", "alibi", "relative"))
def test_relative_encodings_ignore_a_shift_of_all_positions(pe):
    lm = model(pe)
    params = init(lm)
    toks = tokens(1, 8)
    close(lm.apply({"params": params}, toks, positions=jnp.arange(8)[None] + 11), lm.apply({"params": params}, toks))


def numpy_window_attention(x, params, *, heads, window):
    """Independent restatement: causal softmax attention restricted to i − j < window, no positions."""
    x = np.asarray(x, np.float64)
    q = np.einsum("bld,dhe->bhle", x, np.asarray(params["query"]["kernel"], np.float64))
    k = np.einsum("bld,dhe->bhle", x, np.asarray(params["key"]["kernel"], np.float64))
    v = np.einsum("bld,dhe->bhle", x, np.asarray(params["value"]["kernel"], np.float64))
    k, v = np.repeat(k, heads // k.shape[1], 1), np.repeat(v, heads // v.shape[1], 1)
    logits = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    i, j = np.arange(x.shape[1])[:, None], np.arange(x.shape[1])[None]
    logits = np.where((j <= i) & (i - j < window), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    out = (p / p.sum(-1, keepdims=True)) @ v  # [B, H, L, D]
    return np.einsum("bhle,hed->bld", out, np.asarray(params["out"]["kernel"], np.float64))


@pytest.mark.parametrize("window", (1, 3, 8, 40))
def test_window_equals_numpy_masked_attention(window):
    layer = jaxpe.Attention(num_heads=4, num_kv_heads=2, head_dim=8, pe=jaxpe.pe_config("none"), window=window)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 11, 16))
    params = nn.meta.unbox(layer.init(jax.random.PRNGKey(1), x)["params"])
    close(layer.apply({"params": params}, x), numpy_window_attention(x, params, heads=4, window=window), tol=1e-4)


@pytest.mark.parametrize("pe,impl", CASES)
def test_window_of_one_is_attention_to_oneself_and_a_long_window_is_none(pe, impl):
    pe_config = jaxpe.pe_config(pe)
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 10, 16))
    layer = lambda window: jaxpe.Attention(num_heads=2, num_kv_heads=1, head_dim=8, pe=pe_config, max_len=MAX_LEN,
                                           impl=impl, window=window)
    params = layer(None).init(jax.random.PRNGKey(1), x)["params"]
    apply = {window: jax.jit(functools.partial(layer(window).apply, {"params": params})) for window in (None, 1, 10)}
    close(apply[10](x), apply[None](x))
    alone = jnp.stack([apply[None](x[:, t:t + 1])[:, 0] for t in range(10)], axis=1)  # one compile, ten calls
    close(apply[1](x), alone)


@pytest.mark.parametrize("pe,impl", [("rope", "auto"), ("cope", "blockwise"), ("corope", "blockwise"),
                                     ("cope_gated", "auto")])
def test_windowed_generation_equals_the_windowed_forward_pass(pe, impl):
    lm = model(pe, impl, window=3)
    params = init(lm)
    out = jaxpe.generate(lm, params, tokens(2, 4), max_new_tokens=5)
    cache = jaxpe.init_cache(lm, 2, 9)
    step_logits, _ = lm.apply({"params": params, "cache": cache}, out, decode=True, mutable=["cache"])
    close(lm.apply({"params": params}, out), step_logits)
    greedy = jnp.argmax(lm.apply({"params": params}, out)[:, 3:-1], -1)
    np.testing.assert_array_equal(greedy, out[:, 4:])


def test_param_dtype_is_apart_from_compute_dtype():
    lm = model("cope", param_dtype="bfloat16")
    params = init(lm)
    dtypes = {jax.tree_util.keystr(path): leaf.dtype for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    tables = {path for path in dtypes if "pos_emb" in path}
    assert tables and all(dtypes[path] == jnp.float32 for path in tables)
    assert all(dtype == jnp.bfloat16 for path, dtype in dtypes.items() if path not in tables)
    assert lm.apply({"params": params}, tokens(1, 6)).dtype == jnp.float32
    with pytest.raises(ValueError, match="param_dtype"):
        jaxpe.ModelConfig(vocab_size=5, param_dtype="float64")


def test_every_parameter_has_logical_axis_names():
    for pe in jaxpe.PE_NAMES:
        lm = model(pe, layer_pe=(pe, "none") if pe != "none" else ())
        boxed = jax.eval_shape(lm.init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]  # names only
        leaves = jax.tree_util.tree_leaves(boxed, is_leaf=lambda leaf: isinstance(leaf, nn.LogicallyPartitioned))
        plain = [leaf for leaf in leaves if not isinstance(leaf, nn.LogicallyPartitioned)]
        assert not plain, f"{pe}: parameters without logical axis names: {[leaf.shape for leaf in plain]}"
        assert all(len(leaf.names) == leaf.value.ndim for leaf in leaves)


SHARDED = textwrap.dedent("""
    import flax.linen as nn, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxpe
    from jaxpe.sharding import TENSOR_PARALLEL_RULES
    assert jax.device_count() == 8, jax.devices()
    for pe in ("rope", "cope", "corope", "relative"):
        config = jaxpe.ModelConfig(vocab_size=32, d_model=32, num_layers=2, num_heads=8, num_kv_heads=4, max_len=16,
                                   pe=pe, dropout=0.0, mlp="swiglu")
        lm = jaxpe.TransformerLM(config)
        tokens = jax.random.randint(jax.random.PRNGKey(0), (4, 16), 0, 32)
        init = lambda: nn.meta.unbox(lm.init(jax.random.PRNGKey(1), tokens)["params"])
        apply = jax.jit(lambda p, t: lm.apply({"params": p}, t))  # jit: one compile, not one per op
        expected = apply(jax.jit(init)(), tokens)  # on one device
        mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "model"))
        abstract = jax.eval_shape(lm.init, jax.random.PRNGKey(1), tokens)["params"]
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, TENSOR_PARALLEL_RULES)
        params = jax.jit(init, out_shardings=shardings)()
        assert params["block0"]["attn"]["query"]["kernel"].sharding.spec == P(None, "model", None)
        assert params["block0"]["mlp"]["up"]["kernel"].sharding.spec == P(None, "model")
        batch = jax.device_put(tokens, NamedSharding(mesh, P("data", None)))
        with mesh:
            got = apply(params, batch)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5, rtol=2e-5)
        print(pe, "ok")
""")


@pytest.mark.slow
def test_tensor_parallel_over_heads_equals_single_device():
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("ok") == 4


def test_bad_token_inputs_are_named():
    lm = model("rope")
    params = init(lm)
    toks = tokens(2, 5)
    with pytest.raises(TypeError, match="segment_ids"):
        lm.apply({"params": params}, toks, segment_ids=jnp.zeros((2, 5)))
    with pytest.raises(ValueError, match="segment_ids"):
        lm.apply({"params": params}, toks, segment_ids=jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(TypeError, match="positions"):
        lm.apply({"params": params}, toks, positions=jnp.zeros((2, 5)))
    with pytest.raises(ValueError, match="positions"):
        lm.apply({"params": params}, toks, positions=jnp.zeros((3, 5), jnp.int32))
    with pytest.raises(TypeError, match="padding_mask"):
        lm.apply({"params": params}, toks, padding_mask=jnp.ones((2, 5), jnp.int32))
    with pytest.raises(ValueError, match="padding_mask"):
        lm.apply({"params": params}, toks, padding_mask=jnp.ones((2, 6), bool))
    for window in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="window"):
            jaxpe.ModelConfig(vocab_size=5, window=window)
    with pytest.raises(ValueError, match="left padding"):
        jaxpe.generate(lm, params, toks, max_new_tokens=2, padding_mask=jnp.arange(5)[None].repeat(2, 0) < 3)


def test_visibility_mask_by_hand():
    from jaxpe.softmax_attention import visibility_mask
    mask = visibility_mask(4, 4, segment_ids=jnp.asarray([[0, 0, 1, 1]]), window=2)[0]
    expected = np.asarray([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], bool)
    np.testing.assert_array_equal(mask, expected)


def test_corope_rotary_dim_and_scaling_give_the_published_frequencies():
    d, r, theta = 16, 8, 500.0
    expected = np.concatenate([theta ** (-np.arange(0, r, 2) / r) / 2.0, np.zeros((d - r) // 2)])  # linear factor 2
    config = jaxpe.ModelConfig(vocab_size=VOCAB, d_model=32, num_heads=2, num_layers=1, max_len=MAX_LEN, pe="corope",
                               pe_options={"theta": theta, "rotary_dim": r, "scaling": {"type": "linear", "factor": 2}})
    hash(config)  # nested options are stored hashably
    core = config.pe_config.core(head_dim=d, max_len=MAX_LEN, impl="reference")
    np.testing.assert_allclose(core.inv_freq, expected, rtol=1e-6)
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (1, 9, 2, d)) for i in range(3))
    ctx = jaxpe.AttentionContext(x=jnp.zeros((1, 9, 32)), q_pos=jnp.arange(9)[None])
    got = core.apply({}, q, k, v, ctx)
    close(got, jaxpe.corope_attention(q, k, v, inv_freq=jnp.asarray(expected, jnp.float32), impl="reference"))
    assert not np.allclose(got, jaxpe.corope_attention(q, k, v, theta=theta, impl="reference"), atol=1e-4)
    for rope_type in ("dynamic", "yarn"):
        with pytest.raises(ValueError, match="Co-RoPE"):
            jaxpe.pe_config("corope", scaling={"rope_type": rope_type, "factor": 2.0,
                                               "original_max_position_embeddings": 16})
    with pytest.raises(ValueError, match="rotary_dim"):
        jaxpe.pe_config("corope", rotary_dim=32).core(head_dim=16, max_len=8, impl="auto")


def test_nnx_layers_take_the_token_inputs():
    from flax import nnx
    import jaxpe.nnx
    lm = jaxpe.nnx.TransformerLM(jaxpe.ModelConfig(vocab_size=VOCAB, d_model=16, num_layers=1, num_heads=2,
                                                   max_len=MAX_LEN, pe="cope", dropout=0.0), rngs=nnx.Rngs(0))
    run = nnx.jit(lambda lm, toks, **masks: lm(toks, deterministic=True, **masks))  # a compile per shape, not per op
    toks = tokens(1, 9)
    segments = jnp.asarray([[0] * 4 + [1] * 5])
    packed = run(lm, toks, segment_ids=segments)
    close(packed[:, 4:], run(lm, toks[:, 4:]))
    padded = run(lm, jnp.concatenate([toks, toks[:, :2]], 1), padding_mask=jnp.arange(11)[None] < 9)
    close(padded[:, :9], run(lm, toks))
