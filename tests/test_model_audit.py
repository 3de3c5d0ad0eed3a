"""The model-level API as a program uses it: a hand-written decoding loop after a masked prefill and with each call's
own mask or document ids, the gate-network CoPE's positions after a left-padded prefill, generation up to a position
table's last row, sampling at a vanishing temperature, a raw PRNG key of the wrong shape, `generate` exported with a
symbolic batch, and prefill + decode = full forward with an odd GQA group in bfloat16 for every encoding.

References are identities: decoding equals the full forward pass over the same tokens and masks, or over a row's real
tokens alone; a greedy token is the argmax of the full forward pass; sampling as temperature → 0 is the argmax; an
exported program equals the eager call.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
from jaxpe.decoding import sample_tokens

V = 11


def build(pe: str, **fields) -> tuple[jaxpe.TransformerLM, dict]:
    """A 1-layer model (width 24, 6 query heads in 3 groups) and its parameters."""
    config = dict(vocab_size=V, d_model=24, num_layers=1, num_heads=6, num_kv_heads=3, max_len=8, pe=pe, dropout=0.0)
    model = jaxpe.TransformerLM(jaxpe.ModelConfig(**{**config, **fields}))
    return model, nn.meta.unbox(model.init(jax.random.PRNGKey(1), jnp.zeros((1, 4), jnp.int32))["params"])


def tokens(batch: int, length: int, seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.PRNGKey(seed), (batch, length), 0, V, dtype=jnp.int32)


LEFT_PADDED = jnp.array([[True] * 8, [False, False] + [True] * 6])  # row 1 left-padded by 2
PACKED = jnp.array([[0, 0, 1, 1, 1, 1, 1, 1], [3] * 8])  # row 0: a document of 2 tokens, then one of 6
MASKS = {  # name: (what the prefill of 5 tokens takes, what each later call takes, [B, 8] each)
    "padding_mask": ({"padding_mask": LEFT_PADDED}, {}),
    "padding_mask in every call": ({"padding_mask": LEFT_PADDED}, {"padding_mask": LEFT_PADDED}),
    "segment_ids": ({"segment_ids": jnp.zeros((2, 8), jnp.int32)}, {}),
    "packed segment_ids in every call": ({"segment_ids": PACKED}, {"segment_ids": PACKED}),
}


@pytest.mark.parametrize("masks", MASKS)
def test_a_hand_written_decode_goes_on_from_each_rows_last_position(masks):
    """Prefill 5 tokens with a padding mask or document ids, then feed 3 tokens one at a time without positions
    (with or without their own mask or ids): the logits are the full forward pass's over the 8 tokens, same masks."""
    model, params = build("rope")
    toks = tokens(2, 8)
    prefill, later = MASKS[masks]
    step = jax.jit(lambda cache, t, kw: model.apply({"params": params, "cache": cache}, t, decode=True,
                                                    mutable=["cache"], **kw))
    logits, state = step(jaxpe.init_cache(model, 2, 8), toks[:, :5], {k: v[:, :5] for k, v in prefill.items()})
    decoded = [logits]
    for t in range(5, 8):
        logits, state = step(state["cache"], toks[:, t:t + 1], {k: v[:, t:t + 1] for k, v in later.items()})
        decoded.append(logits)
    decoded = jnp.concatenate(decoded, axis=1)  # [B, 8, V]
    full = model.apply({"params": params}, toks, **prefill)
    real = prefill.get("padding_mask", jnp.ones((2, 8), bool))  # a padded token's own output is meaningless
    np.testing.assert_allclose(decoded[real], full[real], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("pe", ["rope", "alibi"])
def test_an_attention_layer_decoding_after_a_left_padded_prefill_goes_on_from_each_rows_position(pe):
    """jaxpe.Attention on its own: a prefill of 5 (row 1 left-padded by 2), then 2 inputs one at a time without
    positions or mask: each row's outputs are the layer's on its real inputs alone."""
    layer = jaxpe.Attention(num_heads=4, num_kv_heads=2, head_dim=8, pe=pe, max_len=16)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 7, 24))
    params = layer.init(jax.random.PRNGKey(1), x)["params"]
    shapes = jax.eval_shape(lambda: layer.init(jax.random.PRNGKey(1), x, decode=True))["cache"]
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    mask = jnp.array([[True] * 5, [False, False, True, True, True]])
    out, state = layer.apply({"params": params, "cache": cache}, x[:, :5], decode=True, padding_mask=mask,
                             mutable=["cache"])
    decoded = [out]
    for t in (5, 6):
        out, state = layer.apply({"params": params, "cache": state["cache"]}, x[:, t:t + 1], decode=True,
                                 mutable=["cache"])
        decoded.append(out)
    decoded = jnp.concatenate(decoded, axis=1)  # [2, 7, 24]
    for row, first in enumerate((0, 2)):
        alone = layer.apply({"params": params}, x[row:row + 1, first:])
        np.testing.assert_allclose(decoded[row:row + 1, first:], alone, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("pe", ["cope_gated", "cope_rope"])
def test_gate_network_positions_skip_the_padding_of_a_decoding_prefill(pe):
    """The gate network's soft positions sum the gates of the row's own document: a left-padded prefill (row 1
    padded by 1, row 2 by 3) then 2 decoded tokens give each row's logits run alone. A position table of std 1 makes
    a shifted position visible in the logits."""
    model, params = build(pe)
    params["block0"]["attn"]["pe"]["pos_table"] = jax.random.normal(jax.random.PRNGKey(2), (9, 4))
    toks = tokens(3, 7)
    mask = jnp.arange(5)[None] >= jnp.array([[0], [1], [3]])  # [3, 5]
    logits, state = model.apply({"params": params, "cache": jaxpe.init_cache(model, 3, 7)}, toks[:, :5], decode=True,
                                padding_mask=mask, mutable=["cache"])
    decoded = [logits]
    for t in (5, 6):
        logits, state = model.apply({"params": params, "cache": state["cache"]}, toks[:, t:t + 1], decode=True,
                                    mutable=["cache"])
        decoded.append(logits)
    decoded = jnp.concatenate(decoded, axis=1)  # [3, 7, V]
    for row, first in enumerate((0, 1, 3)):
        alone = model.apply({"params": params}, toks[row:row + 1, first:])
        np.testing.assert_allclose(decoded[row:row + 1, first:], alone, atol=2e-5, rtol=2e-5)


def test_a_table_encoding_generates_until_the_tokens_fed_fill_its_table():
    """A prompt of 4 and 5 new tokens feeds 8 tokens (the last generated one is never fed) to a table of max_len=8
    rows: every generated token is the argmax of the full forward pass; one more new token is refused."""
    model, params = build("learned")
    prompt = tokens(3, 4)
    out = jaxpe.generate(model, params, prompt, max_new_tokens=5)  # [3, 9]
    logits = model.apply({"params": params}, out[:, :-1])  # the 8 tokens fed
    np.testing.assert_array_equal(out[:, 4:], jnp.argmax(logits[:, 3:], axis=-1))
    with pytest.raises(ValueError, match="exceeds max_len=8"):
        jaxpe.generate(model, params, prompt, max_new_tokens=6)


@pytest.mark.parametrize("options", [{}, {"top_k": 2}, {"top_p": 0.5}], ids=str)
def test_a_vanishing_temperature_samples_the_argmax(options):
    """logits / temperature overflow float32 at temperature 1e-37; sampling must still approach the argmax."""
    logits = jnp.array([[200.0, 300.0, 100.0], [-200.0, -100.0, -300.0]])
    for seed in range(3):
        sampled = sample_tokens(logits, jax.random.PRNGKey(seed), temperature=1e-37, **options)
        np.testing.assert_array_equal(sampled, [1, 1])


@pytest.mark.parametrize("rng", [jnp.zeros((3,), jnp.uint32), jnp.zeros((1, 2), jnp.uint32)], ids=["[3]", "[1, 2]"])
def test_a_raw_key_of_the_wrong_shape_is_refused_by_name(rng):
    model, params = build("rope")
    with pytest.raises(ValueError, match="rng must be one PRNG key"):
        jaxpe.generate(model, params, tokens(2, 3), max_new_tokens=2, rng=rng, temperature=1.0)


def test_generate_exports_with_a_symbolic_batch():
    """jax.export of generate (left-padded prompts, a stop token) with a symbolic batch runs at batch 1 and 3 and
    equals the eager call."""
    model, params = build("cope")
    run = lambda p, prompt, mask: jaxpe.generate(model, p, prompt, max_new_tokens=3, padding_mask=mask, eos_id=2)
    (b,) = jax.export.symbolic_shape("b")
    exported = jax.export.export(jax.jit(run))(
        params, jax.ShapeDtypeStruct((b, 4), jnp.int32), jax.ShapeDtypeStruct((b, 4), jnp.bool_))
    prompt, mask = tokens(3, 4), jnp.array([[True] * 4, [False, True, True, True], [True] * 4])
    for rows in (slice(0, 1), slice(0, 3)):
        np.testing.assert_array_equal(exported.call(params, prompt[rows], mask[rows]),
                                      run(params, prompt[rows], mask[rows]))


@pytest.mark.parametrize("pe", jaxpe.PE_NAMES)
def test_odd_gqa_bfloat16_decoding_from_one_token_equals_the_full_forward(pe):
    """5 query heads sharing 1 key/value head, width 40, bfloat16 compute with float32 weights, untied, RMSNorm,
    SwiGLU, post-norm: a prefill of 1 token then 4 decoded ones give the full forward's logits within bfloat16's
    rounding (a tenth of their spread)."""
    model, params = build(pe, d_model=40, num_heads=5, num_kv_heads=1, dtype="bfloat16", tie_embeddings=False,
                          norm="rmsnorm", mlp="swiglu", prenorm=False)
    toks = tokens(3, 5)
    step = jax.jit(lambda cache, t: model.apply({"params": params, "cache": cache}, t, decode=True, mutable=["cache"]))
    logits, state = step(jaxpe.init_cache(model, 3, 5), toks[:, :1])
    decoded = [logits]
    for t in range(1, 5):
        logits, state = step(state["cache"], toks[:, t:t + 1])
        decoded.append(logits)
    full = model.apply({"params": params}, toks)
    np.testing.assert_allclose(jnp.concatenate(decoded, axis=1), full, atol=0.1 * float(full.std()))


@pytest.mark.parametrize("name", ["max_new_tokens", "top_k"])
def test_a_traced_size_of_generate_says_it_must_be_static(name):
    """max_new_tokens and top_k fix shapes: passed through jit as traced values they are refused in words."""
    model, params = build("rope")
    options = dict(max_new_tokens=2, rng=jax.random.PRNGKey(0), temperature=1.0)
    run = jax.jit(lambda value: jaxpe.generate(model, params, tokens(2, 3), **{**options, name: value}))
    with pytest.raises(ValueError, match=f"{name} must be a Python int, not a traced value"):
        run(2)
