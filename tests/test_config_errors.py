"""Bad settings fail where they are made, in words: every option of every registered encoding config and every
ModelConfig field at construction (a ValueError naming the option and its value); jaxpe.Attention's fields at
construction; `pe` given as a name in linen and NNX; boxed/unboxed parameter mix-ups either load or name the fix;
a position table of another size names the option that sets it."""
import dataclasses
import math
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxpe
import jaxpe.nnx
from jaxpe.registry import _REGISTRY

# {encoding: {option: [bad values]}}; a value may be (value, text the error must contain) when the message words it
# otherwise. Every option of every registered config must be listed (test_every_option_is_covered).
BAD_OPTIONS = {
    "none": {},
    "learned": {"init_std": [0, -0.1, "0.02", True, math.nan]},
    "sinusoidal": {"theta": [0, "1e4", None], "amplitude": [0.0, -1, "1", math.inf]},
    "amspe": {"coarse_scale": [0, "10", False], "detail_level": [1.5, -0.1, "0.5", None], "amplitude": [0, "x"]},
    "rope": {"theta": [-1.0, "10000"], "rotary_dim": [3, 0, True, 8.0], "interleaved": [1, "yes", None],
             "scaling": [({"rope_type": "bogus"}, "rope_type='bogus'"), (5, "scaling=5")]},
    "alibi": {},
    "relative": {"npos": [1, 0, 2.5, "64", True]},
    "cope": {"npos": [1, "8", 4.0], "gates": ["key", 1], "per_head": [1, "no"], "shared_table": [0, "yes"],
             "add_relative": [1], "every": [0, True, 2.0, "2"],
             "other_layers": [("learned", "additive"), ("sinusoidal", "additive"), ("amspe", "additive"),
                              ("cope", "other_layers='cope'"), "bogus", None],
             "soft_onehot": [1, "true"], "soft_onehot_temp": [0, -0.05, None, "0.1"], "talking_heads": ["yes", 0]},
    "cope_gated": {"max_pos": [1, "16", 8.0]},
    "cope_rope": {"max_pos": [1, 0], "theta": [0, "1e4"]},
    "corope": {"theta": [0, "x", math.nan], "rotary_dim": [5, -2, False],
               "scaling": [({"rope_type": "dynamic", "factor": 2.0}, "rope_type='dynamic'")]},
    "fox": {},
    "stickbreaking": {"attend_current": [1, "yes", None]},
}
CASES = [(pe, option, *(bad if isinstance(bad, tuple) else (bad, f"{option}={bad!r}")))
         for pe, options in BAD_OPTIONS.items() for option, values in options.items() for bad in values]


def test_every_option_is_covered():
    assert set(BAD_OPTIONS) == set(jaxpe.PE_NAMES)
    for name, cls in _REGISTRY.items():
        assert set(BAD_OPTIONS[name]) == {field.name for field in dataclasses.fields(cls)}, name


@pytest.mark.parametrize(("pe", "option", "value", "text"), CASES,
                         ids=[f"{pe}-{option}-{value!r}" for pe, option, value, _ in CASES])
def test_bad_option_fails_at_construction(pe, option, value, text):
    with pytest.raises(ValueError, match=re.escape(text)):
        jaxpe.pe_config(pe, **{option: value})
    # The same option given to a model config fails there too, before any model is built.
    with pytest.raises(ValueError, match=re.escape(text)):
        jaxpe.ModelConfig(vocab_size=8, d_model=16, num_heads=2, pe=pe, pe_options={option: value})


def test_good_options_still_build():
    assert jaxpe.pe_config("cope", npos=8, every=2, other_layers="rope", soft_onehot_temp=1).other_layers == "rope"
    assert jaxpe.pe_config("amspe", detail_level=1).detail_level == 1
    assert jaxpe.pe_config("rope", theta=500, rotary_dim=4, interleaved=True).theta == 500
    assert jaxpe.pe_config("relative", npos=2).npos == 2


def test_additive_flag_matches_the_embedding():
    for name in jaxpe.PE_NAMES:
        config = jaxpe.pe_config(name)
        assert config.additive == (config.embedding(d_model=8, max_len=4) is not None), name


MODEL_FIELDS = dict(vocab_size=8, d_model=32, num_layers=2, num_heads=4, max_len=16)
BAD_MODEL = {
    "vocab_size": [0, "8", True, 8.0], "d_model": [0, 7.5, ("30", "d_model='30'"), (30, "d_model=30")],
    "num_layers": [0, -1, None], "num_heads": [0, (3, "num_heads=3"), "4"], "num_kv_heads": [0, 3, "2", True],
    "mlp_dim": [0, "64", 1.5], "max_len": [0, 1.5, "16"], "dropout": [1.0, -0.1, "0.1", None, math.nan],
    "norm": ["batchnorm", None], "prenorm": [1, "false", None], "mlp": ["relu", 0], "tie_embeddings": [0, "yes"],
    "pe": [("bogus", "pe='bogus'"), (3, "pe=3")],
    "pe_options": [({"npos": 1}, "npos=1"), ({"bogus": 1}, "'bogus'"), ([1, 2], "pe_options=[1, 2]"),
                   ({3: 1}, "pe_options=")],
    "layer_pe": [(("cope", "bogus"), "'bogus'"), (("learned", "cope"), "additive"), (("rope",), "must name pe")],
    "dtype": ["float64", None], "param_dtype": ["int8"], "impl": ["fast", None, ["auto"]], "window": [0, 2.5, "4"],
    "causal": [1, "no"], "remat": ["some", None],
}
MODEL_CASES = [(field, *(bad if isinstance(bad, tuple) else (bad, f"{field}={bad!r}")))
               for field, values in BAD_MODEL.items() for bad in values]


def test_every_model_field_is_covered():
    assert set(BAD_MODEL) == {field.name for field in dataclasses.fields(jaxpe.ModelConfig)}


@pytest.mark.parametrize(("field", "value", "text"), MODEL_CASES,
                         ids=[f"{field}-{value!r}" for field, value, _ in MODEL_CASES])
def test_bad_model_field_fails_at_construction(field, value, text):
    fields = {**MODEL_FIELDS, "pe": "cope", field: value}
    with pytest.raises(ValueError, match=re.escape(text)):
        jaxpe.ModelConfig(**fields)


BAD_ATTENTION = [("num_heads", 0), ("num_kv_heads", 3), ("head_dim", 0), ("head_dim", True), ("max_len", "16"),
                 ("dropout", 1.0), ("dropout", "0.1"), ("impl", "fast"), ("window", 0), ("pe", "bogus")]


@pytest.mark.parametrize(("field", "value"), BAD_ATTENTION)
def test_bad_attention_field_fails_at_construction(field, value):
    fields = {**dict(num_heads=4, num_kv_heads=2, head_dim=8, pe="rope"), field: value}
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r}")):
        jaxpe.Attention(**fields)  # construction, before any input is seen
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r}")):  # NNX takes the same fields
        jaxpe.nnx.Attention(32, **fields, rngs=nnx.Rngs(0))


def test_pe_of_another_type_is_a_type_error():
    for make in (lambda: jaxpe.Attention(num_heads=2, num_kv_heads=2, head_dim=8, pe=3),
                 lambda: jaxpe.nnx.Attention(16, num_heads=2, num_kv_heads=2, head_dim=8, pe=3, rngs=nnx.Rngs(0))):
        with pytest.raises(TypeError, match="pe must be an encoding name .* got pe=3"):
            make()


@pytest.mark.parametrize("pe", ["cope", "corope", "relative", "alibi"])
def test_pe_by_name_equals_its_default_config(pe):
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 16))
    fields = dict(num_heads=2, num_kv_heads=2, head_dim=8, max_len=16)
    by_name, by_config = jaxpe.Attention(**fields, pe=pe), jaxpe.Attention(**fields, pe=jaxpe.pe_config(pe))
    assert by_name.pe == jaxpe.pe_config(pe)
    params = by_config.init(jax.random.PRNGKey(0), x)
    chex.assert_trees_all_equal(by_name.init(jax.random.PRNGKey(0), x), params)
    np.testing.assert_array_equal(by_name.apply(params, x), by_config.apply(params, x))
    layer = jaxpe.nnx.Attention(16, **fields, pe=pe, rngs=nnx.Rngs(0), deterministic=True)
    twin = jaxpe.nnx.Attention(16, **fields, pe=jaxpe.pe_config(pe), rngs=nnx.Rngs(0), deterministic=True)
    np.testing.assert_array_equal(layer(x), twin(x))
    core = jaxpe.nnx.core(pe, num_heads=2, num_kv_heads=2, head_dim=8, d_model=16, max_len=16, rngs=nnx.Rngs(0))
    chex.assert_trees_all_equal_shapes(core.linen_params(), nn.meta.unbox(params["params"]).get("pe", {}))


def test_embedding_by_name():
    emb = jaxpe.nnx.embedding("learned", d_model=16, max_len=8, rngs=nnx.Rngs(0))
    assert emb.linen_params()["table"].shape == (8, 16)
    assert jaxpe.nnx.embedding("rope", d_model=16, max_len=8, rngs=nnx.Rngs(0)) is None


# --- boxed and unboxed parameters -------------------------------------------------------------------------------------

CONFIG = jaxpe.ModelConfig(vocab_size=11, d_model=16, num_layers=2, num_heads=2, max_len=16, pe="cope", dropout=0.0)
TOKENS = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 11


def restored_without_target(tree, directory) -> dict:
    """`tree` saved with orbax and restored with no target (what a user gets from a plain restore)."""
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / "params", tree)
    checkpointer.wait_until_finished()
    return checkpointer.restore(directory / "params")


def test_nnx_loads_boxed_and_restored_params(tmp_path):
    boxed = jaxpe.TransformerLM(CONFIG).init(jax.random.PRNGKey(3), TOKENS)["params"]
    plain = nn.meta.unbox(boxed)
    expected = jaxpe.TransformerLM(CONFIG).apply({"params": plain}, TOKENS)
    restored = restored_without_target(boxed, tmp_path)
    assert set(restored["embed"]["embedding"]) == {"value"}  # what orbax gives for a box without a target
    for params in (boxed, restored):
        model = jaxpe.nnx.TransformerLM(CONFIG, rngs=nnx.Rngs(0), deterministic=True)
        model.load_linen_params(params)
        chex.assert_trees_all_equal(model.linen_params(), plain)
        np.testing.assert_array_equal(model(TOKENS), expected)


def test_linen_apply_of_restored_boxes_names_the_fix(tmp_path):
    model = jaxpe.TransformerLM(CONFIG)
    restored = restored_without_target(model.init(jax.random.PRNGKey(3), TOKENS)["params"], tmp_path)
    with pytest.raises(ValueError, match=re.escape("is a dict {'value': array}")) as err:
        model.apply({"params": restored}, TOKENS)
    assert "restore with a target" in str(err.value) and "flax.linen.meta.unbox(params)" in str(err.value)
    assert len(str(err.value)) < 600  # no array in the message
    layer = jaxpe.Attention(num_heads=2, num_kv_heads=2, head_dim=8, pe="rope")
    x = jnp.ones((1, 4, 16))
    restored = restored_without_target(layer.init(jax.random.PRNGKey(0), x)["params"], tmp_path / "attention")
    with pytest.raises(ValueError, match="restore with a target"):
        layer.apply({"params": restored}, x)


def test_nnx_load_of_another_tree_names_the_paths():
    model = jaxpe.nnx.TransformerLM(CONFIG, rngs=nnx.Rngs(0))
    params = model.linen_params()
    del params["block1"]
    with pytest.raises(ValueError, match="params must have the tree") as err:
        model.load_linen_params({**params, "extra": jnp.zeros(3)})
    assert "['block1']['attn']['key']['kernel']" in str(err.value) and "['extra']" in str(err.value)
    assert len(str(err.value)) < 600


# --- a position table sized by max_len ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("pe", "options", "option"), [("cope", {}, "npos"), ("cope", {"shared_table": True}, "npos"),
                                                       ("relative", {}, "npos"), ("cope_gated", {}, "max_pos")])
def test_table_of_another_max_len_names_its_option(pe, options, option):
    short = dataclasses.replace(CONFIG, pe=pe, pe_options=options)
    params = jaxpe.TransformerLM(short).init(jax.random.PRNGKey(0), TOKENS)["params"]  # tables of 16 + 1 rows
    longer = dataclasses.replace(short, max_len=32)  # the default table size follows max_len: 33 rows
    with pytest.raises(ValueError, match=re.escape(f"{option}=17")) as err:
        jaxpe.TransformerLM(longer).apply({"params": params}, TOKENS)
    assert f"{option}=33" in str(err.value) and "max_len + 1" in str(err.value)
    model = jaxpe.nnx.TransformerLM(longer, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=re.escape(f"set {option}=17")):
        model.load_linen_params(params)
    # Setting the option as the error says loads them, and the longer model runs past the old max_len.
    fixed = dataclasses.replace(longer, pe_options={**options, option: 17})
    tokens = jnp.zeros((1, 24), jnp.int32)
    assert jaxpe.TransformerLM(fixed).apply({"params": params}, tokens).shape == (1, 24, 11)


@dataclasses.dataclass(frozen=True)
class _UnregisteredConfig(jaxpe.PEConfig):
    """An encoding config no test registers."""


@pytest.mark.parametrize("name, error, message", [
    ("rope", ValueError, "encoding name='rope' is already registered"),
    (3, TypeError, "encoding name must be a str, got 3"),
    ("", ValueError, "encoding name='' must be a Python identifier"),
    ("my,pe", ValueError, "encoding name='my,pe' must be a Python identifier"),
])
def test_register_rejects_names_the_command_line_could_not_read_back(name, error, message):
    with pytest.raises(error, match=re.escape(message)):
        jaxpe.register(name)(_UnregisteredConfig)
    assert _UnregisteredConfig not in [type(jaxpe.pe_config(n)) for n in jaxpe.pe_names()]


def test_register_decorates_encoding_configs_only():
    with pytest.raises(TypeError, match="decorates a dataclass subclassing jaxpe.PEConfig, got <class 'int'>"):
        jaxpe.register("never_registered")(int)
    assert "never_registered" not in jaxpe.pe_names()
