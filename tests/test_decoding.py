"""jaxpe.generate (jaxpe/decoding.py): top-k and top-p against greedy and against hand-computed truncated
distributions, stop tokens per row, one compiled program for repeated eager calls, a traced temperature under jit,
generation past max_len equal to the full forward's argmax, the table-bound encodings' refusal, the cache's refusal
to overflow, and the options' checks."""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpe
import jaxpe.nnx
from jaxpe.decoding import sample_tokens

V, B, P, N, MAX_LEN = 16, 2, 4, 8, 8


def make_config(pe: str = "rope", **fields) -> jaxpe.ModelConfig:
    return jaxpe.ModelConfig(**{**dict(vocab_size=V, d_model=16, num_layers=1, num_heads=2, max_len=MAX_LEN, pe=pe,
                                       dropout=0.0), **fields})


def prompt_for(seed: int) -> jax.Array:
    return jax.random.randint(jax.random.PRNGKey(seed), (B, P), 0, V, dtype=jnp.int32)


def init(model: jaxpe.TransformerLM) -> dict:
    return nn.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(1), jnp.zeros((B, P), jnp.int32))["params"])


@pytest.fixture(scope="module")
def rope_lm():
    model = jaxpe.TransformerLM(make_config())
    return model, init(model)


def test_top_k_one_and_tiny_top_p_equal_greedy(rope_lm):
    model, params = rope_lm
    greedy = jaxpe.generate(model, params, prompt_for(0), max_new_tokens=N)
    sample = lambda **option: jaxpe.generate(model, params, prompt_for(0), max_new_tokens=N, temperature=1.5,
                                             rng=jax.random.PRNGKey(3), **option)
    np.testing.assert_array_equal(sample(top_k=1), greedy)
    np.testing.assert_array_equal(sample(top_p=1e-6), greedy)
    assert not np.array_equal(sample(top_p=1.0), greedy)  # at this temperature untruncated sampling does differ


# Probabilities of tokens 0..5 stored in a shuffled order, so the sampler must map its choices back to token ids.
PROBS = np.array([0.06, 0.25, 0.04, 0.4, 0.1, 0.15])


def truncated(temperature: float, keep: list[int]) -> np.ndarray:
    """The hand-written target: p^(1/temperature) over the kept token ids, renormalised."""
    out = np.zeros_like(PROBS)
    out[keep] = PROBS[keep] ** (1.0 / temperature)
    return out / out.sum()


# Ranking 3 (0.4) > 1 (0.25) > 5 (0.15) > 4 (0.1) > 0 (0.06) > 2 (0.04). top_p=0.6 keeps 3 (0.4 < 0.6) and 1 (0.65
# reaches 0.6). top_k=4 then top_p=0.9: the top four renormalised have cumulative 0.444, 0.722, 0.889 before 4, so all
# four stay. Temperature 2 weighs by p^(1/2): shares 0.277, 0.219, 0.170, 0.139, ... so top_p=0.6 keeps 3, 1, 5.
CASES = [
    (dict(temperature=1.0, top_k=3), truncated(1.0, [3, 1, 5])),
    (dict(temperature=1.0, top_p=0.6), truncated(1.0, [3, 1])),
    (dict(temperature=1.0, top_p=1.0), truncated(1.0, [0, 1, 2, 3, 4, 5])),
    (dict(temperature=1.0, top_k=4, top_p=0.9), truncated(1.0, [3, 1, 5, 4])),
    (dict(temperature=2.0, top_k=2), truncated(2.0, [3, 1])),
    (dict(temperature=2.0, top_p=0.6), truncated(2.0, [3, 1, 5])),
    (dict(temperature=1.0, top_k=99), truncated(1.0, [0, 1, 2, 3, 4, 5])),
]


@pytest.mark.parametrize(("options", "expected"), CASES, ids=[str(options) for options, _ in CASES])
def test_sampling_matches_the_hand_computed_truncated_distribution(options, expected):
    draws = 40_000
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS, jnp.float32)), (draws, PROBS.size))
    tokens = jax.jit(sample_tokens, static_argnames="top_k")(logits, jax.random.PRNGKey(0), **options)
    chex.assert_shape(tokens, (draws,))
    freq = np.bincount(np.asarray(tokens), minlength=PROBS.size) / draws
    np.testing.assert_array_equal(freq[expected == 0], 0.0)  # truncated tokens are never drawn
    np.testing.assert_allclose(freq, expected, atol=0.012)  # 4.9 standard errors of a frequency near 0.5


def test_sampling_cases_are_what_the_comment_says():
    """The nucleus arithmetic behind CASES, restated: the smallest prefix of the ranking whose mass reaches p."""
    def nucleus(probs: np.ndarray, p: float) -> list[int]:
        order, kept, mass = np.argsort(-probs, kind="stable"), [], 0.0
        for token in order:
            kept.append(int(token))
            mass += probs[token]
            if mass >= p - 1e-12:
                return kept
        return kept

    assert nucleus(PROBS, 0.6) == [3, 1]
    top4 = np.where(np.isin(np.arange(6), [3, 1, 5, 4]), PROBS, 0.0)
    assert nucleus(top4 / top4.sum(), 0.9) == [3, 1, 5, 4]
    assert nucleus(truncated(2.0, list(range(6))), 0.6) == [3, 1, 5]


def first_stop(row: np.ndarray, stop_ids: set[int]) -> int | None:
    hits = [i for i, token in enumerate(row) if int(token) in stop_ids]
    return hits[0] if hits else None


def test_stop_token_ends_rows_independently(rope_lm):
    """eos is chosen as a token the greedy run emits at different steps in the two rows; each row must end there,
    pad afterwards, and report its own length; the other decoding stays the greedy one."""
    model, params = rope_lm
    prompt = prompt_for(5)
    greedy = np.asarray(jaxpe.generate(model, params, prompt, max_new_tokens=N))[:, P:]  # [B, N]
    finishes = {token: tuple(first_stop(row, {token}) for row in greedy) for token in range(V)}
    eos = next(token for token, steps in finishes.items() if steps[0] is not None and steps[0] != steps[1])
    pad = V - 1
    tokens, lengths = jaxpe.generate(model, params, prompt, max_new_tokens=N, eos_id=eos, pad_id=pad,
                                     return_lengths=True)
    chex.assert_shape(tokens, (B, P + N))
    for row in range(B):
        step = finishes[eos][row]
        length = N if step is None else step + 1
        assert int(lengths[row]) == length
        np.testing.assert_array_equal(tokens[row, :P], prompt[row])
        np.testing.assert_array_equal(tokens[row, P:P + length], greedy[row, :length])
        np.testing.assert_array_equal(tokens[row, P + length:], pad)
    assert len(set(np.asarray(lengths).tolist())) == B


def test_a_set_of_stop_tokens_ends_each_row_at_its_first(rope_lm):
    model, params = rope_lm
    prompt = prompt_for(6)
    greedy = np.asarray(jaxpe.generate(model, params, prompt, max_new_tokens=N))[:, P:]
    stop = {int(greedy[0, 2]), int(greedy[1, 1])}  # both rows end, so decoding stops early
    tokens, lengths = jaxpe.generate(model, params, prompt, max_new_tokens=N, eos_id=stop, pad_id=0,
                                     return_lengths=True)
    for row in range(B):
        length = first_stop(greedy[row], stop) + 1
        assert int(lengths[row]) == length
        np.testing.assert_array_equal(tokens[row, P:P + length], greedy[row, :length])
        np.testing.assert_array_equal(tokens[row, P + length:], 0)


class CountingLM(jaxpe.TransformerLM):
    """TransformerLM counting how often its Python code runs: once per trace under jit, every call when eager."""

    def __call__(self, tokens, **kwargs):
        TRACES.append(tokens.shape)
        return super().__call__(tokens, **kwargs)


TRACES: list = []


def test_a_second_eager_call_reuses_the_compiled_program(rope_lm):
    model, params = CountingLM(make_config()), rope_lm[1]
    TRACES.clear()
    first = jaxpe.generate(model, params, prompt_for(0), max_new_tokens=N, temperature=0.7,
                           rng=jax.random.PRNGKey(0))
    traced = len(TRACES)
    assert traced > 0
    again = jaxpe.generate(model, params, prompt_for(1), max_new_tokens=N, temperature=0.9,
                           rng=jax.random.PRNGKey(1))  # new values, same shapes and static options
    assert len(TRACES) == traced
    assert not np.array_equal(first, again)


def test_traced_temperature_under_jit(rope_lm):
    model, params = rope_lm
    prompt, key = prompt_for(2), jax.random.PRNGKey(4)
    run = jax.jit(lambda temperature, rng: jaxpe.generate(model, params, prompt, max_new_tokens=N,
                                                          temperature=temperature, rng=rng, top_k=5))
    np.testing.assert_array_equal(run(0.0, key), jaxpe.generate(model, params, prompt, max_new_tokens=N))
    np.testing.assert_array_equal(run(1.3, key), jaxpe.generate(model, params, prompt, max_new_tokens=N,
                                                                temperature=1.3, rng=key, top_k=5))


@pytest.mark.parametrize("pe", ["rope", "corope", "cope", "alibi"])
def test_generation_past_max_len_equals_the_full_forward_argmax(rope_lm, pe):
    """Prefill + step-by-step decode past max_len == the argmax of one full forward over the output."""
    model = jaxpe.TransformerLM(make_config(pe))
    params = init(model) if pe == "cope" else rope_lm[1]  # rope, corope and alibi own no parameters
    new = 2 * MAX_LEN  # P + new = 3·max_len
    out = jaxpe.generate(model, params, prompt_for(7), max_new_tokens=new)
    chex.assert_shape(out, (B, P + new))
    logits = np.asarray(jax.jit(model.apply)({"params": params}, out))[:, P - 1:-1]  # [B, new, V] predicting out[:, P:]
    chosen = np.take_along_axis(logits, np.asarray(out)[:, P:, None], axis=-1)[..., 0]
    np.testing.assert_array_less(logits.max(axis=-1) - chosen, 1e-5)  # the chosen token is the argmax (up to ties)


@pytest.mark.parametrize("pe", ["learned", "sinusoidal", "amspe"])
def test_table_bound_encodings_refuse_to_pass_max_len(pe):
    model = jaxpe.TransformerLM(make_config(pe))
    params = jax.eval_shape(lambda: init(model))  # shapes suffice: the check comes first
    with pytest.raises(ValueError, match=rf"exceeds max_len={MAX_LEN}: pe='{pe}' adds its position table "
                                         rf"\[max_len={MAX_LEN}, d_model=16\]"):
        jaxpe.generate(model, params, prompt_for(0), max_new_tokens=MAX_LEN - P + 2)  # MAX_LEN + 1 tokens fed


def test_decoding_past_the_cache_end_is_an_error(rope_lm):
    model, params = rope_lm
    prompt = prompt_for(3)

    def step(cache, tokens):
        return model.apply({"params": params, "cache": cache}, tokens, decode=True, mutable=["cache"])

    jitted = jax.jit(step)
    _, state = jitted(jaxpe.init_cache(model, B, P + 1), prompt)
    logits, state = jitted(state["cache"], prompt[:, :1])  # the last slot
    assert np.isfinite(np.asarray(logits)).all()
    with pytest.raises(ValueError, match=r"past the end of the cache 'cached_key' of S=5 time steps: index=5"):
        step(state["cache"], prompt[:, :1])  # eager: the index is concrete
    logits, state = jitted(state["cache"], prompt[:, :1])  # traced index: poisoned, not clamped
    assert np.isnan(np.asarray(logits)).all()
    logits, _ = jitted(state["cache"], prompt[:, :1])
    assert np.isnan(np.asarray(logits)).all()


@pytest.mark.parametrize("batch", [1, B + 1])
def test_decoding_another_batch_than_the_cache_names_both(rope_lm, batch):
    """A cache made for B rows, called with another number of sequences: jax failed on a slice update's or a
    broadcast's shapes (a TypeError or ValueError naming no argument); now the linen and NNX model and layer say
    which batch sizes differ, under jit too, and a call of the cache's batch still decodes."""
    model, params = rope_lm
    want = rf"decode=True with a batch of B={batch} sequences, but the cache was made for batch_size={B}"
    tokens = jnp.zeros((batch, 1), jnp.int32)
    step = lambda cache, tokens: model.apply({"params": params, "cache": cache}, tokens, decode=True,  # noqa: E731
                                             mutable=["cache"])
    cache = jaxpe.init_cache(model, B, P)
    for run in (step, jax.jit(step)):
        with pytest.raises(ValueError, match=want):
            run(cache, tokens)
    assert np.isfinite(np.asarray(step(cache, prompt_for(0)[:, :1])[0])).all()
    layer = jaxpe.Attention(num_heads=2, num_kv_heads=1, head_dim=8, pe="cope")
    variables = layer.init(jax.random.PRNGKey(0), jnp.zeros((B, P, 16)), decode=True)
    with pytest.raises(ValueError, match=want):
        layer.apply(variables, jnp.zeros((batch, 1, 16)), decode=True, mutable=["cache"])
    nnx_layer = jaxpe.nnx.Attention(16, num_heads=2, num_kv_heads=1, head_dim=8, pe="cope", rngs=nnx.Rngs(0))
    nnx_layer.init_cache(B, P)
    with pytest.raises(ValueError, match=want):
        nnx_layer(jnp.zeros((batch, 1, 16)), decode=True)
    nnx_model = jaxpe.nnx.TransformerLM(make_config(), rngs=nnx.Rngs(0))
    nnx_model.init_cache(B, P)
    with pytest.raises(ValueError, match=want):
        nnx_model(tokens, decode=True)


def test_nnx_generate_takes_the_same_options(rope_lm):
    model, params = rope_lm
    nnx_model = nnx.jit(lambda: jaxpe.nnx.TransformerLM(make_config(), rngs=nnx.Rngs(0)))()
    nnx_model.load_linen_params(params)
    options = dict(max_new_tokens=N, temperature=0.8, top_k=4, top_p=0.9, rng=jax.random.PRNGKey(2), eos_id=3,
                   return_lengths=True)
    tokens, lengths = jaxpe.nnx.generate(nnx_model, prompt_for(4), **options)
    expected_tokens, expected_lengths = jaxpe.generate(model, params, prompt_for(4), **options)
    np.testing.assert_array_equal(tokens, expected_tokens)
    np.testing.assert_array_equal(lengths, expected_lengths)


BAD = [
    (dict(top_k=0), "top_k=0"), (dict(top_k=2.5), "top_k=2.5"), (dict(top_k=True), "top_k=True"),
    (dict(top_p=0.0), "top_p=0.0"), (dict(top_p=1.5), "top_p=1.5"), (dict(top_p=float("nan")), "top_p=nan"),
    (dict(temperature=-1.0), "temperature=-1.0"), (dict(temperature=float("nan")), "temperature=nan"),
    (dict(temperature=float("inf")), "temperature=inf"), (dict(temperature=1.0, rng=None), "needs an rng"),
    (dict(eos_id=V), f"eos_id={V}"), (dict(eos_id=-1), "eos_id=-1"), (dict(eos_id=[]), r"eos_id=\[\]"),
    (dict(eos_id=[1, "2"]), "eos_id="), (dict(eos_id=3, pad_id=V), f"pad_id={V}"),
    (dict(max_new_tokens=0), "max_new_tokens=0"), (dict(temperature=1.0, rng=3), "rng must be one PRNG key"),
]


@pytest.mark.parametrize(("options", "match"), BAD, ids=[m for _, m in BAD])
def test_bad_options_raise_value_errors_naming_them(rope_lm, options, match):
    model, params = rope_lm
    with pytest.raises(ValueError, match=match):
        jaxpe.generate(model, params, prompt_for(0), **{"max_new_tokens": 2, **options})


def test_top_p_one_keeps_every_token_though_the_sums_round(monkeypatch):
    """top_p=1 is no nucleus cut: over 1000 tokens the float32 running sums of the sorted probabilities reach 1 before
    the least likely tokens (31 of 4 x 1000 here), which a cut at `mass before < top_p` dropped."""
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 1000)) * 3, jnp.float32)
    seen, draw = [], jax.random.categorical

    def categorical(rng: jax.Array, values: jax.Array, axis: int) -> jax.Array:  # the logits the draw is made from
        seen.append(values)
        return draw(rng, values, axis=axis)

    monkeypatch.setattr(jax.random, "categorical", categorical)
    for top_p in (1.0, jnp.float32(1.0)):  # concrete, and as a traced value would be
        sample_tokens(logits, jax.random.PRNGKey(0), temperature=1.0, top_p=top_p)
        assert (np.asarray(seen.pop()) > np.finfo(np.float32).min).all()  # none cut
    sample_tokens(logits, jax.random.PRNGKey(0), temperature=1.0, top_p=0.9)  # a real cut still cuts
    assert (np.asarray(seen.pop()) == np.finfo(np.float32).min).any()
