"""Edge inputs of the library behave the same in every impl: empty sequences, degenerate shapes and scales, AM-SPE's
detail level, a NaN row of the CoPE position table reaching only the queries that use it, 64-bit document ids, NumPy
windows, and bfloat16 in Triton's interpreter."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe

IMPLS = ("reference", "blockwise", "pallas")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ["cope", "corope"])
@pytest.mark.parametrize("batch, length", [(2, 0), (0, 8)], ids=["no tokens", "no sequences"])
def test_empty_sequence_gives_an_empty_output_like_dot_product_attention(op, impl, batch, length):
    q = jnp.zeros((batch, length, 4, 16))
    k = jnp.zeros((batch, length, 2, 16))
    want = jax.nn.dot_product_attention(q, k, k, is_causal=True)
    if op == "cope":
        attend = lambda q: jaxpe.cope_attention(q, k, k, jnp.zeros((8, 16)), impl=impl)  # noqa: E731
    else:
        attend = lambda q: jaxpe.corope_attention(q, k, k, impl=impl)  # noqa: E731
    got, grad = jax.jit(attend)(q), jax.grad(lambda q: attend(q).sum())(q)
    assert got.shape == want.shape == grad.shape == q.shape and got.dtype == q.dtype


@pytest.mark.parametrize("op", ["cope", "corope"])
@pytest.mark.parametrize("shape", [(1, 8, 0, 16), (1, 8, 2, 0)])
def test_zero_heads_or_head_dim_is_a_clear_error(op, shape):
    x = jnp.zeros(shape)
    with pytest.raises(ValueError, match=f"heads and head dim must be >= 1, got Hq={shape[2]}, Hkv={shape[2]}, "
                                         f"D={shape[3]}"):
        if op == "cope":
            jaxpe.cope_attention(x, x, x, jnp.zeros((4, max(shape[3], 1))))
        else:
            jaxpe.corope_attention(x, x, x)


@pytest.mark.parametrize("op", ["cope", "corope"])
@pytest.mark.parametrize("sm_scale", [0.0, -1.0, float("nan"), float("inf")])
def test_sm_scale_must_be_positive_and_finite(op, sm_scale):
    x = jnp.ones((1, 8, 2, 16))
    with pytest.raises(ValueError, match="sm_scale=.* must be > 0 and finite"):
        if op == "cope":
            jaxpe.cope_attention(x, x, x, jnp.zeros((4, 16)), sm_scale=sm_scale)
        else:
            jaxpe.corope_attention(x, x, x, sm_scale=sm_scale)


@pytest.mark.parametrize("detail_level", [-0.1, 1.5, float("nan")])
def test_amspe_detail_level_out_of_range_is_an_error(detail_level):
    x = jnp.zeros((1, 4, 8))
    module = jaxpe.AMSPE(8, max_len=16)
    params = module.init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="detail_level=.* must be in \\[0, 1\\]"):
        module.apply(params, x, detail_level=detail_level)
    with pytest.raises(ValueError, match="detail_level=.* must be in \\[0, 1\\]"):
        jaxpe.pe_config("amspe", detail_level=detail_level)


def test_amspe_detail_level_bounds_are_allowed():
    x = jnp.zeros((1, 4, 8))
    module = jaxpe.AMSPE(8, max_len=16)
    params = module.init(jax.random.PRNGKey(0), x)
    for level in (0.0, 1.0):
        assert np.isfinite(np.asarray(module.apply(params, x, detail_level=level))).all()


def used_rows(q, k, npos: int) -> np.ndarray:
    """[L, npos] bool: table rows that query i interpolates with nonzero weight for some visible key, from the
    positions alone (independent of how any impl evaluates the logits)."""
    p = np.asarray(jaxpe.cope_positions(q, k, npos=npos, sm_scale=q.shape[-1] ** -0.5))[0, 0]  # [L, L] head 0
    length = p.shape[0]
    visible = np.tril(np.ones((length, length), bool))
    rows = np.zeros((length, npos), bool)
    for r in range(npos):
        rows[:, r] = ((np.abs(p - r) < 1.0) & visible).any(axis=1)
    return rows


@pytest.mark.parametrize("row", [3, 5, 8])  # row 0 serves every query (its own key)
def test_a_nan_row_of_the_position_table_reaches_only_the_queries_that_use_it(row):
    kq, kk, ke = jax.random.split(jax.random.PRNGKey(5), 3)
    q = jax.random.normal(kq, (1, 40, 1, 16))
    k = jax.random.normal(kk, (1, 40, 1, 16))
    pos_emb = jax.random.normal(ke, (9, 16))
    poisoned = pos_emb.at[row].set(jnp.nan)
    users = used_rows(q, k, 9)[:, row]
    assert users.any() and not users.all()  # the case separates the two kinds of query
    for impl in IMPLS:
        clean = np.asarray(jaxpe.cope_attention(q, k, k, pos_emb, impl=impl))[0, :, 0]
        got = np.asarray(jaxpe.cope_attention(q, k, k, poisoned, impl=impl))[0, :, 0]
        np.testing.assert_array_equal(np.isnan(got).any(axis=-1), users, err_msg=impl)
        np.testing.assert_allclose(got[~users], clean[~users], rtol=1e-5, atol=1e-6, err_msg=impl)


# Every encoding's layer, and a model, at length 0 or batch 0: an empty output (and gradient), like
# jax.nn.dot_product_attention.
@pytest.mark.parametrize("pe", jaxpe.PE_NAMES)
@pytest.mark.parametrize("empty", [np.s_[:, :0], np.s_[:0]], ids=["no tokens", "no sequences"])
def test_attention_layer_at_length_zero_gives_an_empty_output_and_gradient(pe, empty):
    layer = jaxpe.Attention(num_heads=4, num_kv_heads=2, head_dim=8, pe=pe, max_len=16)
    x = jnp.ones((2, 6, 32))
    params = layer.init(jax.random.PRNGKey(0), x)
    out = layer.apply(params, x[empty])
    grad = jax.grad(lambda x: layer.apply(params, x).sum())(x[empty])
    assert out.shape == grad.shape == x[empty].shape


@pytest.mark.parametrize("pe", ["rope", "cope", "corope"])
@pytest.mark.parametrize("empty", [np.s_[:, :0], np.s_[:0]], ids=["no tokens", "no sequences"])
def test_model_at_length_zero_gives_empty_logits(pe, empty):
    model = jaxpe.TransformerLM(jaxpe.ModelConfig(vocab_size=10, d_model=16, num_heads=2, num_layers=1, pe=pe,
                                                  max_len=16))
    tokens = jnp.zeros((2, 4), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tokens)
    assert model.apply(params, tokens[empty]).shape == tokens[empty].shape + (10,)


@pytest.mark.parametrize("pe", ["rope", "cope", "corope"])
@pytest.mark.parametrize("sampling", [{}, dict(temperature=1.0, top_k=3, top_p=0.9, eos_id=2)],
                         ids=["greedy", "sampled"])
def test_generate_from_no_prompts_gives_no_rows(pe, sampling):
    """An empty batch of prompts [0, P]: tokens [0, P + N] and lengths [0], as a batch of one gives [1, P + N]."""
    model = jaxpe.TransformerLM(jaxpe.ModelConfig(vocab_size=10, d_model=16, num_heads=2, num_layers=1, pe=pe,
                                                  max_len=16, dropout=0.0))
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 3), jnp.int32))["params"]
    def run(prompt: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jaxpe.generate(model, params, prompt, max_new_tokens=4, rng=jax.random.PRNGKey(1),
                              return_lengths=True, **sampling)

    tokens, lengths = run(jnp.ones((0, 3), jnp.int32))
    one, one_length = run(jnp.ones((1, 3), jnp.int32))
    assert tokens.shape == (0, 7) and lengths.shape == (0,) and one.shape == (1, 7) and one_length.shape == (1,)
    assert tokens.dtype == one.dtype and lengths.dtype == one_length.dtype


def _lists(x: jax.Array) -> list:
    return np.asarray(x).tolist()


_Q = jnp.ones((2, 8, 4, 8))
_TABLE = jnp.zeros((8, 8))
_NOT_ARRAYS = {  # a list where an array belongs: a TypeError naming the argument, not an AttributeError
    "q": lambda: jaxpe.cope_attention(_lists(_Q), _Q, _Q, _TABLE),
    "k": lambda: jaxpe.corope_attention(_Q, _lists(_Q), _Q),
    "pos_emb": lambda: jaxpe.cope_attention(_Q, _Q, _Q, _lists(_TABLE)),
    "gate_k": lambda: jaxpe.cope_attention(_Q, _Q, _Q, _TABLE, gate_k=_lists(_Q)),
    "talking_heads": lambda: jaxpe.cope_positions(_Q, _Q, npos=8, talking_heads=_lists(jnp.eye(4))),
    "mask": lambda: jaxpe.corope_mileage(_Q, _Q, mask=_lists(jnp.ones((1, 8, 8), bool))),
    "x": lambda: jaxpe.Attention(num_heads=4, num_kv_heads=4, head_dim=8, pe="cope").init(
        jax.random.PRNGKey(0), [[[0.0] * 32] * 8]),
    "tokens": lambda: jaxpe.TransformerLM(jaxpe.ModelConfig(vocab_size=10, d_model=16, num_heads=2, num_layers=1,
                                                            pe="rope", max_len=16)).init(jax.random.PRNGKey(0),
                                                                                         [[1, 2, 3]]),
}


@pytest.mark.parametrize("name", sorted(_NOT_ARRAYS))
def test_a_list_where_an_array_belongs_is_a_type_error_naming_the_argument(name):
    with pytest.raises(TypeError, match=f"^{name} must be a jax or NumPy array"):
        _NOT_ARRAYS[name]()


@pytest.mark.parametrize("op", ["positions", "mileage"])
@pytest.mark.parametrize("mask, error, message", [
    (jnp.ones((1, 8, 8), jnp.int32), TypeError, "mask must be a bool array"),
    (jnp.ones((1, 8, 7), bool), ValueError, r"mask must have shape \[B\|1, Lq=8, Lk=8\] with B=2"),
    (jnp.ones((3, 8, 8), bool), ValueError, "mask must have shape"),
    (jnp.ones((2, 4, 8, 8), bool), ValueError, "mask must have shape"),
])
def test_an_explicit_mask_is_checked(op, mask, error, message):
    with pytest.raises(error, match=message):
        if op == "positions":
            jaxpe.cope_positions(_Q, _Q, npos=8, mask=mask)
        else:
            jaxpe.corope_mileage(_Q, _Q, mask=mask)


@pytest.mark.parametrize("op", ["positions", "mileage"])
def test_position_functions_check_causal_and_sm_scale(op):
    fn = (lambda **kw: jaxpe.cope_positions(_Q, _Q, npos=8, **kw)) if op == "positions" else (
        lambda **kw: jaxpe.corope_mileage(_Q, _Q, **kw))
    with pytest.raises(ValueError, match="causal=1 must be a bool"):
        fn(causal=1)
    for bad in ("a", [1.0], 1 + 2j, object()):
        with pytest.raises(TypeError, match="sm_scale must be a real scalar"):
            fn(sm_scale=bad)
    with pytest.raises(ValueError, match="sm_scale=-1.0 must be > 0"):
        fn(sm_scale=-1.0)


@pytest.mark.parametrize("gate_k, error, message", [
    (jnp.ones((2, 5, 4, 8)), ValueError, r"gate_k must match k's shape, got gate_k.shape=\(2, 5, 4, 8\)"),
    (jnp.ones((2, 8, 1, 8)), ValueError, r"gate_k must match k's shape, got gate_k.shape=\(2, 8, 1, 8\)"),
    (jnp.ones((2, 8, 4, 8), jnp.bfloat16), TypeError, "gate_k must match k's dtype, got gate_k.dtype=bfloat16"),
])
def test_cope_positions_checks_gate_k_against_k_as_cope_attention_does(gate_k, error, message):
    """Gate keys of another length (once a broadcasting error naming no argument), other key/value heads (once
    counted silently with another grouping of the query heads) or another dtype are refused naming gate_k."""
    with pytest.raises(error, match=message):
        jaxpe.cope_positions(_Q, _Q, npos=8, gate_k=gate_k)
    with pytest.raises(error, match=message):
        jaxpe.cope_attention(_Q, _Q, _Q, _TABLE, gate_k=gate_k)


def test_mileage_without_causality_needs_one_length():
    with pytest.raises(ValueError, match="causal=False is self-attention: q and k must have the same length"):
        jaxpe.corope_mileage(_Q[:, :4], _Q, causal=False, mask=jnp.ones((1, 4, 8), bool))


@pytest.mark.parametrize("name", ["dtype", "param_dtype"])
@pytest.mark.parametrize("value", [jnp.int32, "bogus", 3])
def test_attention_dtypes_must_be_floating_point(name, value):
    with pytest.raises(TypeError, match=f"{name}=.* must be a floating-point dtype"):
        jaxpe.Attention(num_heads=2, num_kv_heads=2, head_dim=4, pe="rope", **{name: value})


@pytest.mark.parametrize("offset", [-1, 10])
def test_model_called_eagerly_with_token_ids_outside_the_vocabulary_is_an_error(offset):
    model = jaxpe.TransformerLM(jaxpe.ModelConfig(vocab_size=10, d_model=16, num_heads=2, num_layers=1, pe="cope",
                                                  max_len=16))
    tokens = jnp.zeros((2, 4), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tokens)
    bad = tokens.at[1, 2].set(offset)
    with pytest.raises(ValueError, match=rf"tokens ids must be in \[0, vocab_size=10\), got ids from {min(offset, 0)}"
                                         rf" to {max(offset, 0)}"):
        model.apply(params, bad)
    traced = jax.jit(model.apply)(params, bad)  # unchecked: NaN past the vocabulary, a negative id from the end
    if offset < 0:
        np.testing.assert_array_equal(traced, jax.jit(model.apply)(params, bad.at[1, 2].set(10 + offset)))
    else:
        assert jnp.isnan(traced).any()


_X = jnp.ones((1, 8, 2, 4))
_STATIC_NUMBERS = {  # a static setting given as a bool, a string or None: named in the error, never taken as 1 or 0
    "corope_attention theta": lambda value: jaxpe.corope_attention(_X, _X, _X, theta=value),
    "sinusoidal_table theta": lambda value: jaxpe.sinusoidal_table(8, 8, theta=value),
    "rope_frequencies theta": lambda value: jaxpe.rope_frequencies(8, theta=value),
    "apply_rope theta": lambda value: jaxpe.apply_rope(_X, jnp.arange(8), theta=value),
}


@pytest.mark.parametrize("value", [True, False, "10000", None, 0, -2.0, float("nan")])
@pytest.mark.parametrize("where", sorted(_STATIC_NUMBERS))
def test_a_static_number_that_is_not_one_is_an_error_naming_it(where, value):
    name = where.split()[1]
    with pytest.raises(ValueError, match=f"{name}={value!r} must be > 0 and finite".replace("(", "\\(")):
        _STATIC_NUMBERS[where](value)


@pytest.mark.parametrize("theta", [500, 500.0, np.float32(500.0), np.int64(500), jnp.float32(500.0), np.asarray(500.0)])
def test_theta_as_a_numpy_or_jax_scalar_is_the_python_number(theta):
    """RoPE's frequencies θ^(−2k/D), D = 4: [1, 500^(−1/2)], whatever scalar type carries θ."""
    freqs, factor = jaxpe.rope_frequencies(4, theta=theta)
    np.testing.assert_allclose(freqs, [1.0, 500.0 ** -0.5], rtol=1e-6)
    assert factor == 1.0
    want = jaxpe.corope_attention(_X, _X, _X, theta=500.0, impl="reference")
    np.testing.assert_array_equal(jaxpe.corope_attention(_X, _X, _X, theta=theta, impl="reference"), want)


def test_a_traced_theta_is_refused_by_name():
    with pytest.raises(ValueError, match="theta must be a concrete number"):
        jax.jit(lambda theta: jaxpe.rope_frequencies(8, theta=theta))(500.0)


@pytest.mark.parametrize("args", [(True, 8), (8, True), (False, 8), (8.0, 8)])
def test_sinusoidal_table_sizes_are_ints_not_bools(args):
    with pytest.raises(ValueError, match="(length|dim)=.* must be a positive int"):
        jaxpe.sinusoidal_table(*args)


@pytest.mark.parametrize("block", [True, 0, 2.0])
def test_blockwise_block_sizes_are_ints_not_bools(block):
    with pytest.raises(ValueError, match="block_k=.* must be a positive int"):
        jaxpe.kernels.cope_blockwise.cope_attention_blockwise(_X, _X, _X, jnp.zeros((4, 4)), sm_scale=0.5,
                                                               block_k=block)


@pytest.mark.parametrize("positions", [jnp.ones(8, bool), jnp.ones(8, jnp.complex64)])
def test_rope_positions_must_be_numbers(positions):
    with pytest.raises(TypeError, match="positions must be an integer or floating-point array"):
        jaxpe.apply_rope(_X, positions)


@pytest.mark.parametrize("theta", [True, "10000", 0, float("inf")])
def test_a_hf_config_rope_theta_that_is_not_a_number_is_an_error(theta):
    """(A null rope_theta is an absent one: the default 10000, as transformers reads it.)"""
    with pytest.raises(ValueError, match=f"rope_theta={theta!r} must be > 0 and finite"):
        jaxpe.hf_rope_options({"rope_theta": theta, "hidden_size": 8, "num_attention_heads": 2})


def test_hf_config_sizes_are_ints_not_bools():
    with pytest.raises(ValueError, match="hidden_size and num_attention_heads"):
        jaxpe.hf_rope_options({"hidden_size": 8, "num_attention_heads": True})


def _attention(npos: object, pe: str) -> jax.Array:
    layer = jaxpe.Attention(num_heads=2, num_kv_heads=1, head_dim=4, pe=jaxpe.pe_config(pe, npos=npos))
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 8, 6))
    return layer.apply(layer.init(jax.random.PRNGKey(1), x), x)


_QN = jax.random.normal(jax.random.PRNGKey(2), (1, 8, 2, 4))
_SIZES = {  # a size given as a NumPy integer computes what its Python int does
    "cope blockwise block_k, block_q": lambda n: jaxpe.kernels.cope_blockwise.cope_attention_blockwise(
        _QN, _QN[::-1], _QN, jnp.ones((5, 4)), sm_scale=0.5, block_k=n, block_q=n + 1),
    "corope blockwise block_k": lambda n: jaxpe.kernels.corope_blockwise.corope_attention_blockwise(
        _QN, _QN[::-1], _QN, theta=100.0, sm_scale=0.5, block_k=n),
    "CoPE npos": lambda n: _attention(n, "cope"),
    "relative npos": lambda n: _attention(n, "relative"),
    "rope_frequencies rotary_dim": lambda n: jaxpe.rope_frequencies(2 * n)[0],
}


@pytest.mark.parametrize("where", sorted(_SIZES))
@pytest.mark.parametrize("cast", [np.int32, np.int64, np.uint8])
def test_a_size_as_a_numpy_integer_is_that_int(where, cast):
    np.testing.assert_array_equal(_SIZES[where](cast(3)), _SIZES[where](3))


def test_model_config_sizes_as_numpy_integers_are_stored_as_ints():
    """A config built from NumPy values (a sweep's grid) holds Python ints: it compares equal and serialises to JSON."""
    sizes = dict(vocab_size=16, d_model=8, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=16, max_len=12)
    config = jaxpe.ModelConfig(**{name: np.int64(value) for name, value in sizes.items()}, pe="cope")
    assert all(type(getattr(config, name)) is int for name in sizes)
    assert config == jaxpe.ModelConfig(**sizes, pe="cope")
    assert json.loads(json.dumps(dataclasses.asdict(config)))["d_model"] == 8


@pytest.mark.parametrize("make", [
    lambda: jaxpe.ModelConfig(d_model=True, num_heads=1),
    lambda: jaxpe.ModelConfig(d_model=np.float64(8.0), num_heads=1),
    lambda: jaxpe.kernels.corope_blockwise.corope_attention_blockwise(_QN, _QN, _QN, theta=1.0, sm_scale=1.0,
                                                                   block_k=np.float32(4)),
    lambda: _attention(np.bool_(True), "cope"),
], ids=["config bool", "config float", "block float", "npos numpy bool"])
def test_a_size_that_is_not_an_integer_is_still_refused(make):
    with pytest.raises(ValueError, match="must be a(n)? (positive )?int"):
        make()


def test_nnx_sizes_as_numpy_integers_and_bools():
    from flax import nnx
    import jaxpe.nnx
    config = jaxpe.ModelConfig(vocab_size=16, d_model=8, num_layers=1, num_heads=2, max_len=8, dropout=0.0)
    model = jaxpe.nnx.TransformerLM(config, rngs=nnx.Rngs(0))
    model.init_cache(np.int64(2), np.int32(8))
    with pytest.raises(ValueError, match="batch_size=True must be a positive int"):
        model.init_cache(True, 8)
    layer = jaxpe.nnx.Attention(np.int64(6), num_heads=2, num_kv_heads=1, head_dim=4, pe="cope", rngs=nnx.Rngs(0))
    assert type(layer.d_model) is int


def _attend(op: str, impl: str, **options) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """op's public function of (q, k) (k also the values; CoPE's table and FoX's gates fixed) with `options`."""
    table = jnp.asarray(0.3 * np.random.default_rng(5).standard_normal((8, 16)), jnp.float32)  # the same under x64
    calls = {"cope": lambda q, k: jaxpe.cope_attention(q, k, k, table.astype(q.dtype), impl=impl, **options),
             "corope": lambda q, k: jaxpe.corope_attention(q, k, k, impl=impl, **options),
             "fox": lambda q, k: jaxpe.forgetting_attention(q, k, k, jnp.full(q.shape[:3], -0.2), impl=impl,
                                                            **options),
             "stickbreaking": lambda q, k: jaxpe.stickbreaking_attention(q, k, k, impl=impl, **options)}
    return calls[op]


def _qk(length: int = 12, dtype: jnp.dtype = jnp.float32) -> tuple[jax.Array, jax.Array]:
    q = jax.random.normal(jax.random.PRNGKey(0), (2, length, 2, 16))
    return q.astype(dtype), q[:, :, :1].astype(dtype)


OPS = ("cope", "corope", "fox", "stickbreaking")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("impl", ["reference", "blockwise", "pallas"])
def test_64_bit_document_ids_stay_different_documents(op, impl):
    """Document ids that differ only above bit 31 (NumPy's int64, 64-bit hashes of documents) are two documents,
    eagerly from NumPy and traced under x64: the same output as ids 0 and 1 (they were cast to int32, one document)."""
    q, k = _qk()
    want = _attend(op, impl, segment_ids=np.repeat([[0, 1]], 6, axis=1).repeat(2, axis=0))(q, k)
    wide = np.repeat([[7, 7 + 2**32]], 6, axis=1).repeat(2, axis=0)
    np.testing.assert_allclose(_attend(op, impl, segment_ids=wide)(q, k), want, atol=1e-6)
    with jax.enable_x64(True):
        traced = jax.jit(lambda q, k, ids: _attend(op, impl, segment_ids=ids)(q, k))(q, k, jnp.asarray(wide))
    np.testing.assert_allclose(traced, want, atol=1e-6)


def test_64_bit_document_ids_in_a_layer_restart_positions():
    """The layer's packed documents from 64-bit ids: the same output as from ids 0 and 1 (positions restart)."""
    layer = jaxpe.Attention(num_heads=2, num_kv_heads=1, head_dim=8, pe="rope")
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 8, 16))
    params = layer.init(jax.random.PRNGKey(1), x)
    want = layer.apply(params, x, segment_ids=np.array([[0] * 4 + [1] * 4]))
    np.testing.assert_allclose(layer.apply(params, x, segment_ids=np.array([[3] * 4 + [3 + 2**40] * 4])), want,
                               atol=1e-6)


@pytest.mark.parametrize("op", OPS)
def test_a_numpy_window_is_the_same_window(op):
    """window=np.int64(3) runs every impl as window=3 (the native kernels took it as a Triton constant and failed),
    and a plain 3 after it still runs (a NumPy int equal to 3 shares jit's cache entry)."""
    q, k = _qk()
    want = _attend(op, "reference", window=3)(q, k)
    impls = ["blockwise", "pallas"] + (["triton"] if op != "fox" and _triton_interprets() else [])
    for impl in impls:
        for window in (np.int64(3), 3):
            np.testing.assert_allclose(_attend(op, impl, window=window)(q, k), want, atol=2e-5, err_msg=impl)


def test_a_traced_window_says_it_must_be_static():
    q, k = _qk()
    with pytest.raises(ValueError, match="window=.* must be None or an int >= 1 .*not a jax array or a traced value"):
        jax.jit(lambda q, k, w: _attend("corope", "blockwise", window=w)(q, k))(q, k, 3)


def _triton_interprets() -> bool:
    """Whether impl="triton" runs here in Triton's interpreter (triton installed, TRITON_INTERPRET=1)."""
    from jaxpe.kernels._triton_launch import unavailable  # the reason impl="triton" cannot run, or None

    return unavailable() is None and jax.default_backend() == "cpu"


@pytest.mark.parametrize("op", ["cope", "corope", "stickbreaking"])
def test_bfloat16_in_the_triton_interpreter_is_the_float32_result_rounded(op):
    """Triton's interpreter multiplies bfloat16 dots wrongly (it reads their bits): impl="triton" hands it float32
    copies, so bfloat16 output and gradient are the float32 reference's on the same (rounded) inputs within
    bfloat16's rounding (they were 1e8 off)."""
    if not _triton_interprets():
        pytest.skip("needs triton in its interpreter (CPU, TRITON_INTERPRET=1)")
    q, k = _qk(24, jnp.bfloat16)
    cotangent = jax.random.normal(jax.random.PRNGKey(3), q.shape)
    triton, reference = _attend(op, "triton"), _attend(op, "reference")
    got = jax.vjp(triton, q, k)
    want = jax.vjp(reference, q.astype(jnp.float32), k.astype(jnp.float32))
    assert got[0].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got[0], np.float32), want[0], atol=3e-2, rtol=2e-2)
    for g, w in zip(got[1](cotangent.astype(jnp.bfloat16)), want[1](cotangent)):
        np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=6e-2, rtol=3e-2)


def _kernel_entry(module: str, name: str) -> Callable[..., jax.Array]:
    """jaxpe.kernels.<module>.<name>, skipped where its path cannot run here (a native Triton kernel without
    triton: on CPU, Triton's interpreter runs it)."""
    if module.endswith("_triton"):
        pytest.importorskip("triton")
    return getattr(__import__(f"jaxpe.kernels.{module}", fromlist=[name]), name)


@pytest.mark.parametrize("module", ["cope_blockwise", "cope_pallas", "cope_triton", "corope_blockwise",
                                    "corope_pallas", "corope_triton", "fox_blockwise", "fox_pallas",
                                    "stickbreaking_blockwise", "stickbreaking_pallas", "stickbreaking_triton"])
def test_every_kernel_entry_takes_sm_scale_none_as_the_default(module):
    """sm_scale=None at a kernel's own entry is D^−½, what the public functions' reference path takes by default
    (their input check let None through, and the entries then failed inside a float() or jnp.asarray)."""
    encoding = module.rsplit("_", 1)[0]
    name = {"fox": "forgetting_attention"}.get(encoding, f"{encoding}_attention") + "_" + module.rsplit("_", 1)[1]
    entry = _kernel_entry(module, name)
    keys = jax.random.split(jax.random.PRNGKey(7), 5)
    q = jax.random.normal(keys[0], (1, 20, 4, 16))
    k, v = (jax.random.normal(key, (1, 20, 2, 16)) for key in keys[1:3])
    table = 0.3 * jax.random.normal(keys[3], (5, 16))
    log_fgate = -jax.nn.softplus(jax.random.normal(keys[4], (1, 20, 4)))
    if encoding == "cope":
        got, want = entry(q, k, v, table, sm_scale=None), jaxpe.cope_attention(q, k, v, table, impl="reference")
    elif encoding == "corope":
        got, want = entry(q, k, v, theta=10000.0, sm_scale=None), jaxpe.corope_attention(q, k, v, impl="reference")
    elif encoding == "fox":
        got = entry(q, k, v, jnp.cumsum(log_fgate, axis=1), sm_scale=None)
        want = jaxpe.forgetting_attention(q, k, v, log_fgate, impl="reference")
    else:
        got, want = entry(q, k, v, sm_scale=None)[0], jaxpe.stickbreaking_attention(q, k, v, impl="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
