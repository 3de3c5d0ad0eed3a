"""jaxpe under jax flags a user sets for their whole program: `jax.debug_infs` on the dense attention paths and the
sampler (no infinite intermediate on ordinary inputs, such as rows that see no key), `jax_default_prng_impl`
changed at runtime (generate draws a raw key with the implementation set at the call) and
`jax_numpy_dtype_promotion="strict"` (the training metrics, and bfloat16 inputs to the contextual attentions). Each
flag is set by a context manager or restored in `finally`."""
from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
from jaxpe.decoding import sample_tokens
from jaxpe.softmax_attention import masked_softmax_attention, qk_logits
from jaxpe.train.evaluate import compute_metrics

B, L, H, D = 2, 8, 2, 8
# row 0 starts with two padding tokens, keys its real tokens do not see
PADDING = np.array([[False, False] + [True] * (L - 2), [True] * L])
SEGMENTS = np.array([[0] * 3 + [1] * (L - 3), [0] * L])
# causal, query 0 seeing no key: its output and derivatives are zeros (masked_softmax_attention)
NO_KEY_FOR_QUERY_0 = np.tril(np.ones((1, L, L), bool)) & (np.arange(L) > 0)[None, :, None]


@contextlib.contextmanager
def default_prng_impl(name: str) -> Iterator[None]:
    """jax_default_prng_impl set to `name`, the previous implementation restored afterwards."""
    previous = jax.config.jax_default_prng_impl
    jax.config.update("jax_default_prng_impl", name)
    try:
        yield
    finally:
        jax.config.update("jax_default_prng_impl", previous)


def qkv() -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v [B, L, H, D] float32."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    return tuple(jax.random.normal(key, (B, L, H, D)) for key in keys)


TABLE = jax.random.normal(jax.random.PRNGKey(1), (L + 1, D)) * 0.1
LOG_FGATE = -jax.random.uniform(jax.random.PRNGKey(2), (B, L, H))
# the dense paths (impl="reference"), each with a mask under which some rows see few keys or none
DENSE: dict[str, Callable[..., jax.Array]] = {
    "cope padding": lambda q, k, v: jaxpe.cope_attention(q, k, v, TABLE, impl="reference", padding_mask=PADDING),
    "cope bidirectional padding": lambda q, k, v: jaxpe.cope_attention(
        q, k, v, TABLE, impl="reference", causal=False, padding_mask=PADDING),
    "corope window": lambda q, k, v: jaxpe.corope_attention(q, k, v, impl="reference", window=2,
                                                            padding_mask=PADDING),
    "softmax, a query seeing no key": lambda q, k, v: masked_softmax_attention(qk_logits(q, k), v,
                                                                               NO_KEY_FOR_QUERY_0),
    "fox documents": lambda q, k, v: jaxpe.forgetting_attention(q, k, v, LOG_FGATE, impl="reference",
                                                                segment_ids=SEGMENTS),
    # not dense: Co-RoPE's bidirectional blockwise walk ("auto" on CPU from L 8), whose strict half leaves its first
    # row seeing no key
    "corope bidirectional blockwise": lambda q, k, v: jaxpe.corope_attention(q, k, v, impl="blockwise", causal=False),
}


def value_and_grads(f: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array
                    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """f(q, k, v) [B, L, H, D] and the gradients of Σ f² with respect to q, k and v."""
    return f(q, k, v), jax.grad(lambda *x: jnp.sum(f(*x) ** 2), argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize("name", list(DENSE))
def test_dense_attention_under_debug_infs_matches_the_plain_call(name):
    """The dense softmax once put −inf at masked logits: eagerly, jax.debug_infs raised FloatingPointError on it."""
    f, (q, k, v) = DENSE[name], qkv()
    want, want_grads = value_and_grads(f, q, k, v)
    with jax.debug_infs(True), jax.debug_nans(True):
        got, got_grads = value_and_grads(f, q, k, v)
    np.testing.assert_array_equal(got, want)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_array_equal(g, w)


def test_sample_tokens_with_top_p_under_debug_infs_draws_the_same_tokens():
    """top_p once cut tokens to −inf logits: eagerly, jax.debug_infs raised FloatingPointError on them."""
    logits = jax.random.normal(jax.random.PRNGKey(3), (4, 12)) * 3.0
    draw = lambda key: sample_tokens(logits, key, temperature=0.8, top_p=0.5)  # noqa: E731
    keys = jax.random.split(jax.random.PRNGKey(4), 8)
    want = [draw(key) for key in keys]
    with jax.debug_infs(True):
        got = [draw(key) for key in keys]
    np.testing.assert_array_equal(np.stack(got), np.stack(want))
    # the nucleus itself: each draw is among the fewest most likely tokens reaching half of the probability
    probs = np.asarray(jax.nn.softmax(logits / 0.8), np.float64)
    order = np.argsort(-probs, axis=-1, kind="stable")
    before = np.cumsum(np.take_along_axis(probs, order, -1), -1) - np.take_along_axis(probs, order, -1)
    for row in range(logits.shape[0]):
        nucleus = set(order[row][before[row] < 0.5].tolist())
        assert {int(tokens[row]) for tokens in got} <= nucleus


def test_generate_draws_raw_keys_with_the_prng_impl_chosen_after_a_first_call():
    """After a first generate under threefry, jax_default_prng_impl="rbg" once refused jax.random.PRNGKey(0)
    (uint32[4]) as not a key (its shape read from a cached trace of jax.random.PRNGKey); and a raw key under
    "unsafe_rbg" after "rbg" was drawn from with rbg (the compiled program, cached by shape, kept the implementation
    it was traced with). Each raw key must draw as the typed key of the implementation set when generate is called."""
    config = jaxpe.ModelConfig(vocab_size=16, d_model=16, num_layers=1, num_heads=2, max_len=8, dropout=0.0)
    model = jaxpe.TransformerLM(config)
    prompt = jnp.zeros((2, 3), jnp.int32)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), prompt)["params"])
    sample = lambda rng: jaxpe.generate(model, params, prompt, max_new_tokens=3, temperature=1.0, rng=rng)  # noqa
    with default_prng_impl("threefry2x32"):
        sample(jax.random.PRNGKey(0))
    for impl in ("rbg", "unsafe_rbg"):
        with default_prng_impl(impl):
            raw = jax.random.PRNGKey(5)
            assert raw.shape == (4,)
            np.testing.assert_array_equal(sample(raw), sample(jax.random.wrap_key_data(raw, impl=impl)))


STRICT = {
    "cope": lambda q, k, v: jaxpe.cope_attention(q, k, v, TABLE, impl="reference"),
    "cope blockwise": lambda q, k, v: jaxpe.cope_attention(q, k, v, TABLE, impl="blockwise"),
    "corope": lambda q, k, v: jaxpe.corope_attention(q, k, v, impl="reference"),
    "corope blockwise": lambda q, k, v: jaxpe.corope_attention(q, k, v, impl="blockwise"),
    "fox": lambda q, k, v: jaxpe.forgetting_attention(q, k, v, LOG_FGATE, impl="reference"),
    "stick-breaking": lambda q, k, v: jaxpe.stickbreaking_attention(q, k, v, impl="reference"),
}


@pytest.mark.parametrize("name", list(STRICT))
def test_bfloat16_attention_under_strict_dtype_promotion_matches_the_standard_call(name):
    """The XLA paths' float32 statistics for bfloat16 inputs (jaxpe.base.compute_dtype) promoted bfloat16 with float32,
    which jax_numpy_dtype_promotion="strict" refused (TypePromotionError) in every contextual attention."""
    f, inputs = STRICT[name], [x.astype(jnp.bfloat16) for x in qkv()]
    want, want_grads = value_and_grads(f, *inputs)
    with jax.numpy_dtype_promotion("strict"):
        got, got_grads = value_and_grads(f, *inputs)
    np.testing.assert_array_equal(got, want)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_array_equal(g, w)


def test_training_metrics_under_strict_dtype_promotion_match_the_standard_ones():
    """compute_metrics (the training loss's and jaxpe-eval's sums) once multiplied the bool mask of wrong predictions
    by the float weights: jax_numpy_dtype_promotion="strict" refused it (TypePromotionError)."""
    logits = jax.random.normal(jax.random.PRNGKey(6), (3, 5, 7))
    targets = jax.random.randint(jax.random.PRNGKey(7), (3, 5), 0, 7)
    weights = jax.random.bernoulli(jax.random.PRNGKey(8), 0.6, (3, 5)).astype(jnp.float32)
    want = compute_metrics(logits, targets, weights)
    with jax.numpy_dtype_promotion("strict"):
        got = compute_metrics(logits, targets, weights)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
