"""Hostile inputs of the public API that once slipped through: each must be a ValueError or TypeError naming the
argument (never a bare jax or flax error from deep inside, nor a silently wrong result), and NumPy scalars must be
accepted where Python numbers are."""
from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpe
import jaxpe.nnx
from jaxpe.amspe import AMSPE
from jaxpe.learned import LearnedPE
from jaxpe.sinusoidal import SinusoidalPE

ADDITIVE = {"amspe": lambda: AMSPE(8, max_len=16), "learned": lambda: LearnedPE(max_len=16),
            "sinusoidal": lambda: SinusoidalPE(max_len=16)}


@pytest.mark.parametrize("name", sorted(ADDITIVE))
def test_an_additive_table_refuses_integer_embeddings(name):
    """x + table cast to int would round every position away (AM-SPE's table is in (-1, 1): all zeros)."""
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        ADDITIVE[name]().init(jax.random.key(0), jnp.ones((1, 3, 8), jnp.int32))


@pytest.mark.parametrize("name", sorted(ADDITIVE))
@pytest.mark.parametrize("positions, error, message", [
    (jnp.ones((1, 3)), TypeError, "positions must be an integer array"),
    (jnp.ones((1, 4), jnp.int32), ValueError, r"positions must have shape \[B=1, L=3\] or \[L\]"),
])
def test_an_additive_table_checks_its_positions(name, positions, error, message):
    with pytest.raises(error, match=message):
        ADDITIVE[name]().init(jax.random.key(0), jnp.ones((1, 3, 8)), positions=positions)


def test_amspe_rows_at_given_positions_are_the_table_rows():
    x = jnp.zeros((2, 3, 8))
    positions = jnp.array([[4, 0, 2], [1, 1, 5]])
    module = AMSPE(8, max_len=16)
    params = module.init(jax.random.key(0), x)
    full = module.apply(params, jnp.zeros((1, 16, 8)))[0]  # [16, 8]: every row at its index
    np.testing.assert_allclose(module.apply(params, x, positions=positions), full[positions], rtol=1e-6)


@pytest.mark.parametrize("detail_level, error", [("0.5", TypeError), (jnp.array([0.5, 0.2]), ValueError),
                                                 (True, TypeError)])
def test_amspe_detail_level_must_be_a_number(detail_level, error):
    with pytest.raises(error, match="detail_level"):
        AMSPE(8).init(jax.random.key(0), jnp.ones((1, 3, 8)), detail_level)


@pytest.mark.parametrize("coarse_scale", [0.0, -1.0, float("nan"), "10"])
def test_amspe_coarse_scale_is_checked_as_its_config_checks_it(coarse_scale):
    with pytest.raises(ValueError, match="coarse_scale"):
        AMSPE(8, coarse_scale=coarse_scale).init(jax.random.key(0), jnp.ones((1, 3, 8)))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "2", True, None])
def test_sinusoidal_table_scale_must_be_a_finite_number(scale):
    with pytest.raises(ValueError, match="scale="):
        jaxpe.sinusoidal_table(3, 4, scale=scale)


def test_sinusoidal_table_scale_as_a_numpy_number():
    np.testing.assert_allclose(jaxpe.sinusoidal_table(3, 4, scale=np.float32(2.0)),
                               jaxpe.sinusoidal_table(3, 4, scale=2.0))


@pytest.mark.parametrize("k_len", [-1, 2.0, True, "3"])
def test_alibi_bias_key_length_must_be_an_int(k_len):
    with pytest.raises(ValueError, match="k_len="):
        jaxpe.alibi_bias(jnp.arange(3), k_len, 4)


def test_alibi_bias_key_positions_must_have_the_key_length():
    with pytest.raises(ValueError, match=r"k_pos must have shape \[B\|1, Lk=3\]"):
        jaxpe.alibi_bias(jnp.arange(3), 3, 2, k_pos=jnp.arange(4)[None])


@pytest.mark.parametrize("k_pos", [jnp.zeros((3, 4), jnp.int32), jnp.zeros((2, 4, 1), jnp.int32)])
def test_alibi_bias_key_positions_must_have_a_batch_of_one_or_the_queries(k_pos):
    """Key positions of a third batch were a broadcasting error that named no argument."""
    with pytest.raises(ValueError, match=r"k_pos must have shape \[B\|1, Lk=4\] with B=2 \(q_pos's batch\)"):
        jaxpe.alibi_bias(jnp.zeros((2, 3), jnp.int32), 4, 2, k_pos=k_pos)


@pytest.mark.parametrize("name", ["q_pos", "k_pos"])
@pytest.mark.parametrize("positions, dtype", [(np.ones((1, 3), bool), "bool"), (np.array([["a", "b", "c"]]), "<U1"),
                                              (np.ones((1, 3), np.complex64), "complex64")])
def test_alibi_bias_positions_must_be_numbers(name, positions, dtype):
    """Bool positions were taken as 0 and 1, strings and complex ones failed inside jax naming no argument."""
    arguments = dict(q_pos=jnp.arange(3)[None], k_pos=jnp.arange(3)[None]) | {name: positions}
    with pytest.raises(TypeError, match=f"^{name} must be an integer or floating-point array, got {name}.dtype="
                                        f"{dtype}$"):
        jaxpe.alibi_bias(arguments["q_pos"], 3, 2, k_pos=arguments["k_pos"])


def test_alibi_bias_takes_key_positions_as_nested_lists_and_broadcasts_a_batch_of_one():
    """−slope_h·(i − j) by hand (slopes 2^−4, 2^−8 of two heads) for lists of positions, each side's batch of one
    broadcast to the other's."""
    q_pos, k_pos = [[5, 6], [7, 8]], [[0, 2, 4]]
    got = np.asarray(jaxpe.alibi_bias(q_pos, 3, 2, k_pos=k_pos))
    dist = np.asarray(q_pos)[:, :, None] - np.asarray(k_pos)[:, None, :]
    want = -np.array([2.0**-4, 2.0**-8])[None, :, None, None] * dist[:, None]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jaxpe.alibi_bias(q_pos[:1], 3, 2, k_pos=[[0, 2, 4], [1, 2, 3]]))[1],
                               -np.array([2.0**-4, 2.0**-8])[:, None, None] * (np.array([5, 6])[:, None]
                                                                              - np.array([1, 2, 3])[None]), rtol=1e-6)


def test_alibi_bias_with_numpy_sizes_is_the_bias():
    want = jaxpe.alibi_bias(jnp.arange(3), 3, 6)
    np.testing.assert_array_equal(jaxpe.alibi_bias(jnp.arange(3), np.int64(3), np.int32(6)), want)
    # −slope_h·(i − j) by hand, head 0 of 6: slopes of 4 heads then the odd ones of 8, 2^(−8/4) first
    np.testing.assert_allclose(want[0, 0], -0.25 * (np.arange(3)[:, None] - np.arange(3)[None]), rtol=1e-6)


@pytest.fixture(scope="module")
def rope_model():
    model = jaxpe.TransformerLM(jaxpe.ModelConfig(vocab_size=11, d_model=16, num_layers=1, num_heads=2, max_len=8))
    return model, model.init(jax.random.key(0), jnp.ones((1, 3), jnp.int32))["params"]


@pytest.mark.parametrize("option, value", [("temperature", "1"), ("temperature", True), ("top_p", "0.5"),
                                           ("top_p", True)])
def test_sampling_options_must_be_numbers(rope_model, option, value):
    model, params = rope_model
    with pytest.raises(TypeError, match=f"{option}="):
        jaxpe.generate(model, params, jnp.ones((1, 3), jnp.int32), max_new_tokens=2, rng=jax.random.key(1),
                       **{option: value})
    with pytest.raises(TypeError, match=f"{option}="):
        jaxpe.decoding.sample_tokens(jnp.zeros((1, 5)), jax.random.key(1), **{option: value})


@pytest.mark.parametrize("args, error, message", [
    (("rope", 1, 4), TypeError, "model must be a jaxpe.TransformerLM"),
    ((None, 1.0, 4), ValueError, "batch_size=1.0"),
    ((None, 1, -1), ValueError, "length=-1"),
    ((None, 1, True), ValueError, "length=True"),
])
def test_init_cache_checks_its_arguments(rope_model, args, error, message):
    model = rope_model[0] if args[0] is None else args[0]
    with pytest.raises(error, match=message):
        jaxpe.init_cache(model, *args[1:])


def test_init_cache_takes_numpy_sizes(rope_model):
    cache = jaxpe.init_cache(rope_model[0], np.int64(2), np.int32(5))
    assert cache["block0"]["attn"]["cached_key"].shape == (2, 5, 2, 8)


def _attention(**options) -> jaxpe.Attention:
    return jaxpe.Attention(**{"num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "pe": "cope", **options})


@pytest.mark.parametrize("deterministic", ["yes", 1, None])
def test_attention_deterministic_must_be_a_bool(deterministic):
    layer = _attention(dropout=0.5)
    x = jnp.ones((2, 5, 32))
    params = layer.init(jax.random.key(0), x)
    if deterministic is None:  # the default: dropout off
        np.testing.assert_array_equal(layer.apply(params, x, deterministic), layer.apply(params, x, True))
        return
    with pytest.raises(TypeError, match=f"deterministic={deterministic!r} must be a bool"):
        layer.apply(params, x, deterministic, rngs={"dropout": jax.random.key(1)})


def test_attention_applied_to_another_width_names_it():
    layer = _attention()
    params = layer.init(jax.random.key(0), jnp.ones((2, 5, 32)))
    with pytest.raises(ValueError, match=r"x has d_model=16, but the layer's parameters were made for d_model=32"):
        layer.apply(params, jnp.ones((2, 5, 16)))


def test_attention_decoding_without_a_cache_says_how_to_make_one():
    layer = _attention()
    params = layer.init(jax.random.key(0), jnp.ones((2, 5, 32)))
    with pytest.raises(ValueError, match="decode=True needs the 'cache' collection"):
        layer.apply(params, jnp.ones((2, 1, 32)), decode=True)


def test_attention_refuses_integer_inputs():
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        _attention().init(jax.random.key(0), jnp.ones((2, 5, 32), jnp.int32))


def test_a_cope_layer_checks_a_shared_table():
    layer = _attention()
    params = layer.init(jax.random.key(0), jnp.ones((2, 5, 32)))
    with pytest.raises(ValueError, match=r"pos_emb must have shape \[npos, D=8\]"):
        layer.apply(params, jnp.ones((2, 5, 32)), pos_emb=jnp.ones((3, 4)))


@pytest.mark.parametrize("per_head", [False, True])
def test_a_layer_of_a_shared_cope_table_needs_the_table(per_head):
    """With shared_table=True the model owns the table: a linen layer called without it must say so (it made its own,
    never shared), as the NNX layer does; given the table, the layer computes what a layer owning that table does."""
    shared = jaxpe.pe_config("cope", npos=6, shared_table=True, per_head=per_head)
    x = jax.random.normal(jax.random.key(0), (2, 5, 32))
    with pytest.raises(ValueError, match="pos_emb is None.*shared_table=True.*pass it as pos_emb"):
        _attention(pe=shared).init(jax.random.key(1), x)
    with pytest.raises(ValueError, match="pos_emb is None.*pass it as pos_emb"):
        jaxpe.nnx.Attention(32, num_heads=4, num_kv_heads=2, head_dim=8, pe=shared, rngs=nnx.Rngs(0))(x)
    table = jax.random.normal(jax.random.key(2), (4, 6, 8) if per_head else (6, 8))
    params = _attention(pe=shared).init(jax.random.key(1), x, pos_emb=table)
    owning = {"params": {**params["params"], "pe": {"pos_emb": table}}}
    own = _attention(pe=jaxpe.pe_config("cope", npos=6, per_head=per_head))
    np.testing.assert_allclose(_attention(pe=shared).apply(params, x, pos_emb=table), own.apply(owning, x),
                               rtol=1e-6, atol=1e-6)
    assert "pe" not in params["params"] or "pos_emb" not in params["params"]["pe"]


@pytest.mark.parametrize("per_head, shape", [(False, (5, 8)), (False, (4, 6, 8)), (True, (6, 8)),
                                             (True, (4, 7, 8))])
def test_a_shared_cope_table_must_have_the_shape_the_config_gives(per_head, shape):
    """A table of other rows clamped positions at its own last row, not npos − 1; one without the heads axis ignored
    per_head: the layer silently ran another CoPE than its config. Both linen and NNX name the shapes."""
    shared = jaxpe.pe_config("cope", npos=6, shared_table=True, per_head=per_head)
    x = jax.random.normal(jax.random.key(0), (2, 5, 32))
    table = jnp.zeros(shape)
    want = r"pos_emb.shape=%s, but this CoPE \(shared_table=True, npos=6, per_head=%s\) reads a shared table of " \
           r"shape \(%s6, 8\)" % (re.escape(str(shape)), per_head, "4, " if per_head else "")
    with pytest.raises(ValueError, match=want):
        _attention(pe=shared).init(jax.random.key(1), x, pos_emb=table)
    layer = jaxpe.nnx.Attention(32, num_heads=4, num_kv_heads=2, head_dim=8, pe=shared, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=want):
        layer(x, pos_emb=table)


@pytest.mark.parametrize("pe, options, message", [
    (jaxpe.pe_config("rope"), {"head_dim": 7}, "head dim D=7 must be even"),
    (jaxpe.pe_config("corope", rotary_dim=16), {"head_dim": 8}, "rotary_dim"),
    (jaxpe.pe_config("cope_rope"), {"head_dim": 7}, "head dim D=7 must be even"),
    (jaxpe.pe_config("cope", soft_onehot=True), {"impl": "pallas"}, "impl='pallas' cannot run CoPE's soft one-hot"),
    (jaxpe.pe_config("fox"), {"impl": "triton"}, "impl='triton': fox has no such fused kernel"),
])
def test_a_layer_that_cannot_run_is_refused_at_construction(pe, options, message):
    """Every field of a layer is checked when it is built, combinations too (they were refused only at init)."""
    layer = {"num_heads": 2, "num_kv_heads": 1, "head_dim": 8, "pe": pe, **options}
    with pytest.raises(ValueError, match=message):
        jaxpe.Attention(**layer)
    with pytest.raises(ValueError, match=message):
        jaxpe.nnx.Attention(16, **layer, rngs=nnx.Rngs(0))
    heads = 2 * layer["head_dim"]
    with pytest.raises(ValueError, match=message):
        jaxpe.ModelConfig(vocab_size=8, d_model=heads, num_heads=2, num_layers=1, pe=pe.name,
                          pe_options=dataclasses.asdict(pe), impl=layer.get("impl", "auto"))


def test_soft_onehot_temperature_as_a_numpy_float():
    q = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
    table = 0.1 * jax.random.normal(jax.random.key(1), (6, 8))
    np.testing.assert_array_equal(jaxpe.cope_attention(q, q, q, table, soft_onehot_temp=np.float32(0.5)),
                                  jaxpe.cope_attention(q, q, q, table, soft_onehot_temp=0.5))


@pytest.mark.parametrize("op", ["fox", "stickbreaking"])
def test_blockwise_fox_and_stickbreaking_refuse_a_symbolic_length_by_name(op):
    b, length = jax.export.symbolic_shape("b, l")
    q = jax.ShapeDtypeStruct((b, length, 2, 8), jnp.float32)
    if op == "fox":
        attend = lambda q: jaxpe.forgetting_attention(q, q, q, q[..., 0], impl="blockwise")  # noqa: E731
    else:
        attend = lambda q: jaxpe.stickbreaking_attention(q, q, q, impl="blockwise")  # noqa: E731
    with pytest.raises(ValueError, match="impl='blockwise'.*static.*impl='auto' or 'reference'"):
        jax.export.export(jax.jit(attend))(q)


def test_a_model_decoding_without_a_cache_says_how_to_make_one(rope_model):
    model, params = rope_model
    tokens = jnp.ones((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="decode=True needs the 'cache' collection"):
        model.apply({"params": params}, tokens, decode=True)
    with pytest.raises(ValueError, match="decode=True needs the 'cache' collection"):
        model.apply({"params": params}, tokens, decode=True, positions=jnp.zeros((1, 1), jnp.int32))
    cache = jaxpe.init_cache(model, 1, 4)
    with pytest.raises(ValueError, match="decode=True needs the 'cache' collection, mutable"):
        model.apply({"params": params, "cache": cache}, tokens, decode=True)
    logits, _ = model.apply({"params": params, "cache": cache}, tokens, decode=True, mutable=["cache"])
    np.testing.assert_allclose(logits, model.apply({"params": params}, tokens), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sizes, message", [
    ({"num_heads": 4, "num_kv_heads": 3}, "num_heads=4 must be a multiple of num_kv_heads=3"),
    ({"d_model": 0}, "d_model=0 must be an int >= 1"),
    ({"head_dim": 8.0}, "head_dim=8.0 must be an int >= 1"),
])
def test_nnx_core_checks_its_sizes(sizes, message):
    options = {"num_heads": 2, "num_kv_heads": 2, "head_dim": 8, "d_model": 16, **sizes}
    with pytest.raises(ValueError, match=message):
        jaxpe.nnx.core("cope", **options, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("cast", [np.float32, np.int64])
def test_rope_scaling_numbers_as_numpy_scalars_are_the_python_numbers(cast):
    numpy_scaling = {"rope_type": "llama3", "factor": cast(8), "low_freq_factor": cast(1), "high_freq_factor": cast(4),
                     "original_max_position_embeddings": np.int64(64)}
    scaling = {key: value.item() if isinstance(value, np.generic) else value for key, value in numpy_scaling.items()}
    got, _ = jaxpe.rope_frequencies(16, scaling=numpy_scaling)
    np.testing.assert_array_equal(got, jaxpe.rope_frequencies(16, scaling=scaling)[0])
    assert jaxpe.pe_config("rope", scaling=numpy_scaling) == jaxpe.pe_config("rope", scaling=scaling)
    # llama3 by hand: wavelengths 2π/ω beyond L0/low = 64 are divided by the factor, below L0/high = 16 kept
    omega = 10000.0 ** (-np.arange(8) / 8)
    wavelength = 2 * np.pi / omega
    assert wavelength[0] < 16 and wavelength[-1] > 64
    np.testing.assert_allclose([got[0], got[-1]], [omega[0], omega[-1] / 8], rtol=1e-6)


def test_a_config_given_numpy_scalars_holds_python_numbers():
    """NumPy scalars are accepted where numbers are, and stored as Python's: the config stays JSON-serialisable
    (jaxpe.train writes it into every workdir)."""
    config = jaxpe.ModelConfig(vocab_size=np.int64(11), dropout=np.float32(0.25), pe="rope",
                               pe_options={"theta": np.float64(500.0),
                                           "scaling": {"rope_type": "linear", "factor": np.float32(2.0)}})
    assert json.loads(json.dumps(dataclasses.asdict(config), default=list))["dropout"] == 0.25
    assert type(config.pe_config.theta) is float and config.pe_config.scaling == (("factor", 2.0),
                                                                                  ("rope_type", "linear"))
    cope = jaxpe.pe_config("cope", npos=np.int64(8), soft_onehot_temp=np.float32(0.5))
    assert type(cope.npos) is int and type(cope.soft_onehot_temp) is float
    json.dumps(dataclasses.asdict(cope))


@pytest.mark.parametrize("name", sorted(ADDITIVE))
@pytest.mark.parametrize("position", [-1, 16])
def test_an_additive_table_refuses_positions_outside_it(name, position):
    """A negative position was read from the end of the table (jnp.take wraps it), one past it was a NaN row."""
    module, x = ADDITIVE[name](), jnp.zeros((1, 2, 8))
    params = module.init(jax.random.key(0), x)
    positions = jnp.array([[0, position]])
    with pytest.raises(ValueError, match=rf"positions must be in \[0, max_len=16\).* from {min(position, 0)} to "):
        module.apply(params, x, positions=positions)
    traced = jax.jit(lambda positions: module.apply(params, x, positions=positions))(positions)
    assert np.isfinite(traced[0, 0]).all() and np.isnan(traced[0, 1]).all()


@pytest.mark.parametrize("pe", sorted(ADDITIVE))
def test_a_jitted_model_takes_constant_positions_for_its_additive_table(pe):
    """Positions closed over by a jitted function stay concrete arrays inside it, where a jax reduction of them is
    staged: their range check read them with one (a ConcretizationTypeError). They select the table's rows: the
    logits equal the eager call's, and an out-of-range one is still refused by name."""
    config = jaxpe.ModelConfig(vocab_size=11, d_model=8, num_heads=2, num_layers=1, max_len=16, pe=pe, dropout=0.0)
    model = jaxpe.TransformerLM(config)
    tokens = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
    params = model.init(jax.random.key(0), tokens)
    positions = jnp.array([[3, 4, 5, 6], [0, 1, 2, 15]], jnp.int32)
    jitted = jax.jit(lambda params: model.apply(params, tokens, positions=positions))(params)
    eager = model.apply(params, tokens, positions=positions)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), atol=1e-6)
    assert not np.allclose(np.asarray(eager), np.asarray(model.apply(params, tokens)), atol=1e-3)
    outside = positions + 1
    with pytest.raises(ValueError, match=r"positions must be in \[0, max_len=16\).* from 1 to 16"):
        jax.jit(lambda params: model.apply(params, tokens, positions=outside))(params)


@pytest.mark.parametrize("length", ["5", True, jnp.array([5, 6])])
def test_apply_rope_length_must_be_a_number(length):
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 2}
    with pytest.raises(TypeError, match="length="):
        jaxpe.apply_rope(jnp.ones((1, 3, 2, 8)), jnp.arange(3), scaling=dynamic, length=length)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_a_16_bit_sinusoidal_table_is_the_float32_table_rounded(dtype):
    """16-bit angles of far positions were off by whole radians (rows wrong by up to 2)."""
    table = jaxpe.sinusoidal_table(5000, 16, dtype=dtype)
    want = jaxpe.sinusoidal_table(5000, 16).astype(dtype)
    assert table.dtype == dtype
    np.testing.assert_array_equal(np.asarray(table, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("make", [lambda dtype: jaxpe.sinusoidal_table(5, 4, dtype=dtype),
                                  lambda dtype: jaxpe.alibi_slopes(4, dtype=dtype),
                                  lambda dtype: jaxpe.rope_frequencies(8, dtype=dtype)],
                         ids=["sinusoidal", "alibi", "rope_frequencies"])
@pytest.mark.parametrize("dtype", [jnp.int32, None])
def test_a_table_dtype_must_be_floating(make, dtype):
    """An integer dtype rounded every ALiBi slope to 0 and was ignored by sinusoidal_table and rope_frequencies."""
    with pytest.raises(TypeError, match="dtype=.* must be a floating-point dtype"):
        make(dtype)
