"""Model-level properties for every encoding: causality, GQA = MHA with repeated heads, prefill + decode = full forward
(with and without a sliding window), jit/vmap/grad, pmap over 8 simulated devices, bf16 within a fraction of the
logits' spread, and the paper-size config through jax.eval_shape."""
import dataclasses

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe

ENCODINGS = jaxpe.PE_NAMES
ATTENTION_ENCODINGS = ("none", "rope", "alibi", "relative", "cope", "cope_gated", "cope_rope", "corope")
COPE_OPTIONS = (
    {"gates": "sep_keys"}, {"gates": "values"}, {"per_head": True}, {"add_relative": True},
    {"shared_table": True, "every": 2}, {"npos": 3},
)
VOCAB = 13
BF16_FRACTION_OF_SPREAD = 0.1  # bf16 logits within this fraction of the float32 logits' standard deviation


def tiny(pe: str, **kw) -> jaxpe.ModelConfig:
    """A 2-layer model of width 32 (4 query heads, 2 kv heads, head dim 8) over VOCAB tokens."""
    base = dict(vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_len=24, pe=pe, dropout=0.0)
    base.update(kw)
    return jaxpe.ModelConfig(**base)


def tokens(key: jax.Array, b: int = 2, length: int = 10) -> jax.Array:
    return jax.random.randint(key, (b, length), 0, VOCAB, dtype=jnp.int32)


def init(config: jaxpe.ModelConfig, toks: jax.Array):
    model = jaxpe.TransformerLM(config)
    return model, nn.meta.unbox(model.init(jax.random.PRNGKey(1), toks)["params"])


def decode_logits(model, params, toks, prefill: int) -> jax.Array:
    """Prefill the cache with toks[:, :prefill], then feed the rest one token at a time; all the logits."""
    step = jax.jit(lambda cache, t: model.apply({"params": params, "cache": cache}, t, decode=True, mutable=["cache"]))
    logits, state = step(jaxpe.init_cache(model, toks.shape[0], toks.shape[1]), toks[:, :prefill])
    outs = [logits]
    for t in range(prefill, toks.shape[1]):
        logits, state = step(state["cache"], toks[:, t:t + 1])
        outs.append(logits)
    return jnp.concatenate(outs, axis=1)


@pytest.mark.parametrize("pe", ENCODINGS)
def test_causal_and_decode_matches_full_forward(pe, key):
    toks = tokens(key)
    model, params = init(tiny(pe), toks)
    forward = jax.jit(lambda t: model.apply({"params": params}, t))
    full = forward(toks)
    chex.assert_shape(full, (2, 10, VOCAB))
    changed = toks.at[:, 6:].set((toks[:, 6:] + 5) % VOCAB)
    after = forward(changed)
    np.testing.assert_allclose(full[:, :6], after[:, :6], atol=1e-5, rtol=1e-5)
    assert not np.allclose(full[:, 6:], after[:, 6:], atol=1e-3)
    np.testing.assert_allclose(decode_logits(model, params, toks, prefill=4), full, atol=2e-5, rtol=2e-5)


WINDOWED = [(pe, "auto") for pe in ENCODINGS] + [("cope", "blockwise"), ("corope", "blockwise")]


@pytest.mark.parametrize("pe, impl", WINDOWED)
def test_windowed_decode_matches_the_windowed_forward(pe, impl, key):
    """window=3 (each token sees itself and the 2 before it): prefill 4 tokens, then decode one at a time with the
    cache; every step's logits equal the windowed full forward's. The window matters: the unwindowed forward agrees
    on the first 3 tokens only."""
    toks = tokens(key)
    model, params = init(tiny(pe, impl=impl, window=3), toks)
    windowed = model.apply({"params": params}, toks)
    unwindowed = jaxpe.TransformerLM(tiny(pe, impl=impl)).apply({"params": params}, toks)
    np.testing.assert_allclose(windowed[:, :3], unwindowed[:, :3], atol=1e-5, rtol=1e-5)
    assert not np.allclose(windowed[:, 3:], unwindowed[:, 3:], atol=1e-3)
    np.testing.assert_allclose(decode_logits(model, params, toks, prefill=4), windowed, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("options", COPE_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_cope_options_causal_and_decode(options, key):
    toks = tokens(key)
    model, params = init(tiny("cope", pe_options=options, num_layers=3), toks)
    forward = jax.jit(lambda t: model.apply({"params": params}, t))
    full = forward(toks)
    changed = toks.at[:, 5:].set((toks[:, 5:] + 3) % VOCAB)
    np.testing.assert_allclose(full[:, :5], forward(changed)[:, :5], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(decode_logits(model, params, toks, prefill=3), full, atol=2e-5, rtol=2e-5)


def test_cope_option_parameters(key):
    """Options change the parameter tree the way the paper describes them."""
    toks = tokens(key)
    shapes = lambda opts: jax.tree_util.tree_map(jnp.shape, init(tiny("cope", pe_options=opts, num_layers=4), toks)[1])
    default = shapes({})
    assert default["block0"]["attn"]["pe"]["pos_emb"] == (25, 8)  # npos = max_len + 1, [npos, D]
    assert shapes({"per_head": True})["block1"]["attn"]["pe"]["pos_emb"] == (4, 25, 8)
    shared = shapes({"shared_table": True, "every": 2, "npos": 16})
    assert shared["shared_pos_emb"] == (16, 8)
    assert "pe" not in shared["block0"]["attn"] and "pe" not in shared["block1"]["attn"]  # table lives in the model
    every = shapes({"every": 2})
    assert "pe" in every["block0"]["attn"] and "pe" not in every["block1"]["attn"] and "pe" in every["block2"]["attn"]
    assert shapes({"gates": "sep_keys"})["block0"]["attn"]["pe"]["gate_key"]["kernel"] == (32, 2, 8)
    assert shapes({"add_relative": True})["block0"]["attn"]["pe"]["rel_table"] == (25, 8)


def test_layer_pattern(key):
    """layer_pe cycles encodings over the layers (gemma's attention_types); CoPE's older every/other_layers options
    mean the same pattern: the same parameters, the same logits."""
    toks = tokens(key)
    pattern = tiny("cope", num_layers=4, layer_pe=["cope", "relative"], pe_options={"npos": 6})
    older = tiny("cope", num_layers=4, pe_options={"npos": 6, "every": 2, "other_layers": "relative"})
    assert pattern.layer_pe == pattern.layer_pattern == older.layer_pattern == ("cope", "relative")
    assert tiny("rope").layer_pattern == ("rope",)
    model, params = init(pattern, toks)
    shapes = jax.tree_util.tree_map(jnp.shape, params)
    assert shapes == jax.tree_util.tree_map(jnp.shape, init(older, toks)[1])
    assert shapes["block2"]["attn"]["pe"]["pos_emb"] == (6, 8)
    assert shapes["block3"]["attn"]["pe"]["rel_table"] == (25, 8)
    np.testing.assert_array_equal(model.apply({"params": params}, toks),
                                  jaxpe.TransformerLM(older).apply({"params": params}, toks))


def repeat_kv_params(params, groups: int):
    """MHA parameters equivalent to GQA ones: every key/value (and gate-key) head repeated `groups` times."""
    def fix(path, leaf):
        names = [getattr(p, "key", "") for p in path]
        if any(n in ("key", "value", "gate_key") for n in names) and names[-1] == "kernel":
            return jnp.repeat(leaf, groups, axis=1)
        return leaf
    return jax.tree_util.tree_map_with_path(fix, params)


@pytest.mark.parametrize("pe", [p for p in ATTENTION_ENCODINGS if p != "corope"] + ["cope:sep_keys"])
def test_gqa_equals_mha_with_repeated_heads(pe, key):
    name, _, gates = pe.partition(":")
    options = {"gates": gates} if gates else {}
    toks = tokens(key)
    gqa_model, gqa_params = init(tiny(name, pe_options=options), toks)
    mha_model = jaxpe.TransformerLM(tiny(name, pe_options=options, num_kv_heads=4))
    mha_params = repeat_kv_params(gqa_params, 2)
    chex.assert_trees_all_equal_shapes(mha_params, nn.meta.unbox(mha_model.init(jax.random.PRNGKey(0), toks)["params"]))
    np.testing.assert_allclose(mha_model.apply({"params": mha_params}, toks),
                               gqa_model.apply({"params": gqa_params}, toks), atol=1e-5, rtol=1e-5)


def test_corope_gqa_shares_the_leader_mileage(key):
    """Co-RoPE with GQA is NOT MHA with repeated heads: the group's mileage comes from its leader head, so the
    GQA result equals MHA only where every query head of a group equals its leader."""
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (1, 9, 2, 8))
    k = jax.random.normal(kk, (1, 9, 1, 8))
    v = jax.random.normal(kv, (1, 9, 1, 8))
    q_same = jnp.concatenate([q[:, :, :1], q[:, :, :1]], axis=2)
    gqa = jaxpe.corope_attention(q_same, k, v, impl="reference")
    mha = jaxpe.corope_attention(q_same, jnp.repeat(k, 2, 2), jnp.repeat(v, 2, 2), impl="reference")
    np.testing.assert_allclose(gqa, mha, atol=1e-5)
    gqa = jaxpe.corope_attention(q, k, v, impl="reference")
    mha = jaxpe.corope_attention(q, jnp.repeat(k, 2, 2), jnp.repeat(v, 2, 2), impl="reference")
    np.testing.assert_allclose(gqa[:, :, 0], mha[:, :, 0], atol=1e-5)  # the leader head itself agrees
    assert not np.allclose(gqa[:, :, 1], mha[:, :, 1], atol=1e-3)  # the follower uses the leader's mileage


@pytest.mark.parametrize("pe", ENCODINGS)
def test_grads_reach_every_encoding_parameter_and_bf16_tracks_float32(pe, key):
    """Under jit: a finite loss and gradients, non-zero for every parameter of the first layer's encoding (and the
    additive table); bf16 compute within BF16_FRACTION_OF_SPREAD of the float32 logits' spread."""
    toks = tokens(key)
    model, params = init(tiny(pe), toks)

    @jax.jit
    def loss(p, t):
        logits = model.apply({"params": p}, t)
        return -jnp.mean(jax.nn.log_softmax(logits)[:, :-1].take(0, axis=-1))

    value, grads = jax.value_and_grad(loss)(params, toks)
    assert np.isfinite(value)
    norms = jax.tree_util.tree_map(lambda g: float(jnp.linalg.norm(g)), grads)
    assert all(np.isfinite(n) for n in jax.tree_util.tree_leaves(norms))
    if "pos_embed" in norms:
        assert any(n > 0 for n in jax.tree_util.tree_leaves(norms["pos_embed"]))
    pe_grads = norms["block0"]["attn"].get("pe", {})
    assert all(n > 0 for n in jax.tree_util.tree_leaves(pe_grads)), pe_grads
    # bf16 compute stays within a stated fraction of the float32 logits' spread: bf16 keeps 8 significant bits
    # (unit roundoff 2^-8), and at this size the largest difference is ~0.035 of the spread (std ~0.1).
    f32 = model.apply({"params": params}, toks)
    bf16 = jaxpe.TransformerLM(tiny(pe, dtype="bfloat16")).apply({"params": params}, toks)
    assert bf16.dtype == jnp.float32
    spread = float(jnp.std(f32))
    assert spread > 0.02, spread  # the logits are not flat: the bound below means something
    assert float(jnp.max(jnp.abs(bf16 - f32))) <= BF16_FRACTION_OF_SPREAD * spread


@pytest.mark.parametrize("fn", ["cope", "corope"])
def test_pure_functions_vmap_over_a_leading_axis_and_keep_bf16(fn, key):
    """cope_attention / corope_attention under jax.vmap over an extra leading axis equal a loop over it; bf16 inputs
    give bf16 outputs close to float32's (unit-normal inputs: outputs of order 1)."""
    kq, kk, kv, ke = jax.random.split(key, 4)
    q = jax.random.normal(kq, (3, 2, 12, 4, 16))
    k = jax.random.normal(kk, (3, 2, 12, 2, 16))
    v = jax.random.normal(kv, (3, 2, 12, 2, 16))
    emb = jax.random.normal(ke, (8, 16))
    if fn == "cope":
        f = lambda q, k, v: jaxpe.cope_attention(q, k, v, emb, impl="reference")
    else:
        f = lambda q, k, v: jaxpe.corope_attention(q, k, v, impl="reference")
    batched = jax.jit(jax.vmap(f))(q, k, v)
    for i in range(3):
        np.testing.assert_allclose(batched[i], f(q[i], k[i], v[i]), atol=1e-5, rtol=1e-5)
    half = f(q[0].astype(jnp.bfloat16), k[0].astype(jnp.bfloat16), v[0].astype(jnp.bfloat16))
    assert half.dtype == jnp.bfloat16
    np.testing.assert_allclose(half.astype(jnp.float32), f(q[0], k[0], v[0]), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("pe", ["rope", "cope", "corope", "learned"])
def test_pmap_over_eight_devices_matches_single_device(pe, key):
    assert jax.local_device_count() == 8
    toks = tokens(key, b=8, length=8)
    model, params = init(tiny(pe), toks)
    single = model.apply({"params": params}, toks)
    sharded = jax.pmap(lambda t: model.apply({"params": params}, t))(toks[:, None])
    np.testing.assert_allclose(sharded[:, 0], single, atol=1e-5, rtol=1e-5)


def test_generate_greedy_matches_argmax_of_full_forward(key):
    toks = tokens(key, b=2, length=4)
    model, params = init(tiny("cope"), toks)
    out = jaxpe.generate(model, params, toks, max_new_tokens=5)
    chex.assert_shape(out, (2, 9))
    np.testing.assert_array_equal(out[:, :4], toks)
    # Each generated token is the argmax of a full (causal) forward pass over what came before it.
    logits = model.apply({"params": params}, out)
    np.testing.assert_array_equal(out[:, 4:], jnp.argmax(logits[:, 3:-1], axis=-1))
    learned, learned_params = init(tiny("learned"), toks)  # its table has max_len rows: nothing is generated past
    with pytest.raises(ValueError, match="exceeds max_len"):
        jaxpe.generate(learned, learned_params, toks, max_new_tokens=30)


@pytest.mark.parametrize("pe", ENCODINGS)
def test_paper_config_shapes(pe):
    """The counting setup of the paper (4 layers, hidden 256, 4 heads, block 512, post-norm, tied) via eval_shape."""
    config = jaxpe.ModelConfig(vocab_size=64, d_model=256, num_layers=4, num_heads=4, max_len=512, prenorm=False,
                               dropout=0.1, pe=pe)
    model = jaxpe.TransformerLM(config)
    toks = jax.ShapeDtypeStruct((64, 512), jnp.int32)
    params = jax.eval_shape(lambda t: model.init(jax.random.PRNGKey(0), t), toks)["params"]
    logits = jax.eval_shape(lambda p, t: model.apply({"params": p}, t), params, toks)
    assert logits.shape == (64, 512, 64) and logits.dtype == jnp.float32
    n_params = sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params))
    assert 3.1e6 < n_params < 3.5e6  # 4 × (4·256² + 2·256·1024) + embeddings (+ small encoding tables)


CONFIG_ERRORS = [  # (fields changed from `tiny`, the error's words)
    (dict(pe="rope", num_kv_heads=3), "num_heads=4 must be a multiple of num_kv_heads=3"),
    (dict(pe="cop"), "unknown encoding pe='cop'"),
    (dict(pe="cope", pe_options={"nops": 3}), "unknown option 'nops' for pe='cope'"),
    (dict(pe="cope", pe_options={"npos": 1}), "npos=1 must be an int >= 2"),
    (dict(pe="rope", layer_pe=("none",)), r"layer_pe=\('none',\) must name pe='rope'"),
    (dict(pe="rope", layer_pe=("rope", "cop")), r"unknown encoding\(s\) \['cop'\]"),
    (dict(pe="cope", layer_pe=("cope", "none"), pe_options={"every": 2}),
     "CoPE's every=2 both give the per-layer pattern"),
    (dict(pe="rope", norm="batchnorm"), "norm='batchnorm'"),
    (dict(pe="rope", d_model=30), "d_model=30 must be a multiple of num_heads=4"),
]


@pytest.mark.parametrize(("fields", "match"), CONFIG_ERRORS, ids=[m for _, m in CONFIG_ERRORS])
def test_model_config_errors_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        tiny(**fields)


def test_model_build_errors_name_the_input():
    """Errors that only a built model can see: the table length, the token dtype (a head dim the encoding cannot
    take is refused with the config)."""
    with pytest.raises(ValueError, match="head dim D=5 must be even"):
        tiny("rope", d_model=20, num_kv_heads=None)
    with pytest.raises(ValueError, match="exceeds the position table's max_len=24"):
        model = jaxpe.TransformerLM(tiny("learned"))
        model.init(jax.random.PRNGKey(0), jnp.zeros((1, 30), jnp.int32))
    with pytest.raises(TypeError, match="tokens must be an int array"):
        jaxpe.TransformerLM(tiny("rope")).init(jax.random.PRNGKey(0), jnp.zeros((1, 4)))


def test_vocab_size_and_max_len_may_wait_for_the_data():
    """An application's config may leave vocab_size and max_len None (jaxpe.train fills them from its task); a model
    built from it is an error naming them, and the filled config builds."""
    unfilled = tiny("cope", vocab_size=None, max_len=None)
    with pytest.raises(ValueError, match=r"ModelConfig vocab_size=None, max_len=None: fill them in"):
        jaxpe.TransformerLM(unfilled).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
    filled = dataclasses.replace(unfilled, vocab_size=VOCAB, max_len=24)
    assert filled == tiny("cope") and jaxpe.ModelConfig(VOCAB).max_len == 512
    with pytest.raises(ValueError, match="max_len=0 must be a positive int"):
        tiny("rope", max_len=0)


@pytest.mark.parametrize("options", [dict(pe="cope", pe_options={"every": 2, "other_layers": "learned"}),
                                     dict(pe="rope", layer_pe=("rope", "amspe"))])
def test_a_layer_pattern_naming_an_additive_encoding_is_refused(options):
    """Additive tables act once on the embeddings; a pattern naming one would leave those layers without positions."""
    with pytest.raises(ValueError, match="names additive encoding"):
        jaxpe.ModelConfig(vocab_size=16, **options)


@pytest.mark.parametrize("bad", [-1, 16])
def test_generate_refuses_token_ids_outside_the_vocabulary(bad):
    config = jaxpe.ModelConfig(vocab_size=16, d_model=16, num_layers=1, num_heads=2, max_len=16, dropout=0.0)
    model = jaxpe.TransformerLM(config)
    prompt = jnp.array([[1, 2, bad]], jnp.int32)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 3), jnp.int32))["params"]
    with pytest.raises(ValueError, match=f"token ids must be in \\[0, vocab_size=16\\), got ids from {min(bad, 1)}"):
        jaxpe.generate(model, params, prompt, max_new_tokens=2)


@pytest.mark.parametrize("name", ["rope", "corope", "cope_rope"])
@pytest.mark.parametrize("theta", [0.0, -1.0, float("nan"), float("inf")])
def test_rotary_configs_refuse_a_non_positive_theta(name, theta):
    with pytest.raises(ValueError, match="theta=.* must be > 0 and finite"):
        jaxpe.pe_config(name, theta=theta)


@pytest.mark.parametrize("pe", ["cope", "corope", "rope", "learned"])
def test_a_float16_model_runs_trains_and_decodes_as_float32_does(pe):
    """float16 compute (GPUs without bfloat16): logits float32 and within float16's rounding of the float32 model's,
    gradients finite, greedy decoding equal to the full forward's argmax."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 50, (2, 24)), jnp.int32)
    models = {dtype: jaxpe.TransformerLM(jaxpe.ModelConfig(vocab_size=50, d_model=32, num_layers=2, num_heads=4,
                                                           max_len=64, pe=pe, dtype=dtype))
              for dtype in ("float32", "float16")}
    params = models["float32"].init(jax.random.PRNGKey(0), tokens)
    logits = {dtype: model.apply(params, tokens) for dtype, model in models.items()}
    assert logits["float16"].dtype == jnp.float32
    np.testing.assert_allclose(logits["float16"], logits["float32"], atol=5e-3)
    grads = jax.grad(lambda p: models["float16"].apply(p, tokens).mean())(params)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    generated = jaxpe.generate(models["float16"], params["params"], tokens[:, :8], max_new_tokens=1)
    last = models["float16"].apply(params, tokens[:, :8])[:, -1]  # [B, V]
    np.testing.assert_array_equal(generated[:, -1], jnp.argmax(last, -1))
