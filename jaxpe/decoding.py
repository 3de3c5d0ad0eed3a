"""Autoregressive generation with the KV cache: prefill the prompt, then one token at a time, greedy or sampled
(temperature, top-k, top-p), with stop tokens that finish each row on its own.

`generate` is jitted internally with the model and the static settings as the compiled program's key, so repeated
eager calls with the same shapes and options reuse one program; it also runs inside a caller's own `jax.jit`.

B batch, P prompt length, N max_new_tokens, V vocabulary, S cache length (the P + N − 1 tokens fed to the model).
"""
from __future__ import annotations

import functools
import numbers
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.attention import check_token_inputs, default_positions
from jaxpe.model import TransformerLM
from jaxpe.softmax_attention import fold_padding
from jaxpe.validation import check_array, check_token_ids, is_int

__all__ = ["generate", "init_cache", "sample_tokens"]


def init_cache(model: TransformerLM, batch_size: int, length: int) -> Any:
    """A zeroed decoding cache for `length` tokens (shapes from jax.eval_shape; nothing is computed).

    A decoding call that writes past `length` is an error (see `jaxpe.kv_cache.update_cache`)."""
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model must be a jaxpe.TransformerLM, got {type(model).__name__}")
    for name, value, minimum in (("batch_size", batch_size, 0), ("length", length, 1)):
        if not is_int(value, minimum):
            raise ValueError(f"{name}={value!r} must be an int >= {minimum}")
    return _zero_cache(model, int(batch_size), int(length))


def _zero_cache(model: TransformerLM, batch_size: int | Any, length: int) -> Any:
    """`init_cache` after its checks; `batch_size` may be a symbolic dimension (jax.export)."""
    tokens = jnp.zeros((batch_size, length), jnp.int32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens, decode=True))["cache"]
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _check_real(name: str, value: float | jax.Array) -> None:
    """TypeError unless `value` is a real number (Python's or NumPy's, not a bool) or an integer or floating-point
    array (a traced one too)."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        return
    dtype = getattr(value, "dtype", None)
    if dtype is None or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"{name}={value!r} must be a real number")


def check_temperature(temperature: float | jax.Array) -> None:
    """TypeError unless `temperature` is a real number; ValueError unless it is a scalar, and when concrete finite and
    >= 0 (a traced one is used as given)."""
    _check_real("temperature", temperature)
    if jnp.ndim(temperature) != 0:
        raise ValueError(f"temperature must be a scalar, got shape {jnp.shape(temperature)}")
    if _is_traced(temperature):
        return
    if not 0.0 <= float(temperature) < float("inf"):
        raise ValueError(f"temperature={float(temperature)!r} must be finite and >= 0 (0 is greedy)")


def _check_static(name: str, value: Any) -> None:
    """ValueError, in words, when a setting that fixes shapes (max_new_tokens, top_k) is traced."""
    if _is_traced(value):
        raise ValueError(f"{name} must be a Python int, not a traced value: it fixes shapes of the compiled program; "
                         "keep it out of jit's traced arguments (a constant, or static_argnames)")


def check_top_k(top_k: int | None) -> None:
    """ValueError unless `top_k` is None or an int >= 1 (not traced)."""
    if top_k is None:
        return
    _check_static("top_k", top_k)
    if not is_int(top_k, 1):
        raise ValueError(f"top_k={top_k!r} must be None or an int >= 1")


def check_top_p(top_p: float | jax.Array | None) -> None:
    """TypeError unless `top_p` is None or a real number; ValueError unless it is a scalar, and when concrete in
    (0, 1] (a traced one is used as given)."""
    if top_p is None:
        return
    _check_real("top_p", top_p)
    if jnp.ndim(top_p) != 0:
        raise ValueError(f"top_p must be a scalar, got shape {jnp.shape(top_p)}")
    if not _is_traced(top_p) and not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p={float(top_p)!r} must be in (0, 1]")


def sample_tokens(logits: jax.Array, rng: jax.Array | None, *, temperature: float | jax.Array = 0.0,
                  top_k: int | None = None, top_p: float | jax.Array | None = None) -> jax.Array:
    """Next tokens [B] int32 from logits [B, V]: the argmax where temperature == 0, else a draw with `rng` from
    softmax(logits / temperature) restricted to the top_k largest logits (None: all), then to the nucleus: the
    smallest set of the most likely remaining tokens whose probability (renormalised over them) reaches top_p, never
    empty. Ties keep the lower token id first. `temperature` and `top_p` may be traced scalars; `top_k` is static
    (a k beyond V keeps all V)."""
    check_temperature(temperature)
    check_top_k(top_k)
    check_top_p(top_p)
    check_array("logits", logits, "B, V")
    if logits.ndim != 2:
        raise ValueError(f"logits must have shape [B, V], got logits.shape={tuple(logits.shape)}")
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
    if not _is_traced(temperature) and float(temperature) == 0.0:
        return greedy
    if rng is None:
        raise ValueError(f"temperature={temperature!r} may be > 0, which samples and needs an rng")
    temperature = jnp.asarray(temperature, jnp.float32)
    logits = logits.astype(jnp.float32)
    # the same distribution with the largest logit at 0, so that a tiny temperature cannot overflow it to ±inf (a row
    # whose largest logit is infinite is left as it is)
    top = jnp.max(logits, axis=-1, keepdims=True)  # [B, 1]
    shifted = logits - jnp.where(jnp.isfinite(top), top, 0.0)
    scaled = shifted / jnp.where(temperature > 0, temperature, 1.0)  # [B, V]
    if top_k is None and top_p is None:
        sampled = jax.random.categorical(rng, scaled, axis=-1)
    else:
        k = scaled.shape[-1] if top_k is None else min(top_k, scaled.shape[-1])
        values, ids = jax.lax.top_k(scaled, k)  # [B, k] descending, the token ids they came from
        if top_p is not None:
            probs = jax.nn.softmax(values, axis=-1)
            mass_before = jnp.cumsum(probs, axis=-1) - probs  # 0 for the most likely: it is always kept
            top_p = jnp.asarray(top_p, jnp.float32)  # 1 keeps every token, though the sums round past it
            # cut tokens at the lowest finite logit, not −inf: no infinite intermediate (a user's jax.debug_infs),
            # and categorical's Gumbel noise (under 20 in float32) cannot lift them past the most likely (0)
            values = jnp.where((mass_before < top_p) | (top_p >= 1.0), values, jnp.finfo(values.dtype).min)
        choice = jax.random.categorical(rng, values, axis=-1)  # [B] index into the k kept
        sampled = jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]
    return jnp.where(temperature > 0, sampled.astype(jnp.int32), greedy)


def _stop_ids(eos_id: int | Iterable[int] | None, vocab_size: int) -> tuple[int, ...]:
    """The stop tokens as a sorted tuple (empty: none); ValueError unless concrete ints in [0, vocab_size)."""
    if eos_id is None:
        return ()
    if _is_traced(eos_id):
        raise ValueError("eos_id must be concrete token ids (an int or a collection of ints), got a traced value")
    ids = np.asarray(sorted(eos_id) if isinstance(eos_id, (set, frozenset)) else eos_id)
    if ids.ndim > 1 or not ids.size or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"eos_id={eos_id!r} must be an int token id or a non-empty collection of them")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"eos_id={eos_id!r} must be token ids in [0, vocab_size={vocab_size})")
    return tuple(sorted(set(ids.ravel().tolist())))


def _typed_rng(rng: jax.Array | None) -> jax.Array | None:
    """`rng` as a typed PRNG key array of shape () (None stays None): a typed key as it is, a raw uint32 key of the
    default PRNG implementation's shape ([2] for threefry, [4] for rbg) wrapped with that implementation, read now;
    ValueError for anything else. Raw keys go no further: jit's cache does not see jax_default_prng_impl, so a raw key
    reaching `_generate` would be drawn from by the implementation of the call that compiled it."""
    if rng is None:
        return None
    dtype, shape = getattr(rng, "dtype", None), jnp.shape(rng)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and shape == ():
        return rng
    # a new function each call: eval_shape caches its trace per function, and that cache does not see
    # jax_default_prng_impl either
    if dtype == jnp.uint32 and shape == jax.eval_shape(lambda: jax.random.PRNGKey(0)).shape:
        return jax.random.wrap_key_data(rng)
    raise ValueError(f"rng must be one PRNG key (jax.random.key(seed) or jax.random.PRNGKey(seed)), got "
                     f"{type(rng).__name__} of shape {shape} and dtype {dtype}")


def _check_fits_position_table(model: TransformerLM, fed: int) -> None:
    """ValueError when the encoding adds a table of max_len rows to the token embeddings (learned, sinusoidal,
    AM-SPE) and the P + N − 1 tokens fed to the model (the last generated one never is) do not fit it. Encodings
    acting in attention (rope, alibi, none, corope, relative and CoPE with their clamped distances/positions, the
    gate-network CoPE) generate past max_len."""
    c = model.config
    if fed > c.max_len and c.pe_config.embedding(d_model=c.d_model, max_len=c.max_len) is not None:
        raise ValueError(f"prompt length + max_new_tokens − 1 = {fed} (the tokens fed to the model) exceeds "
                         f"max_len={c.max_len}: pe={c.pe!r} adds its position table [max_len={c.max_len}, "
                         f"d_model={c.d_model}] to the token embeddings, which has no rows beyond it")


def generate(model: TransformerLM, params: Any, prompt: jax.Array, *, max_new_tokens: int,
             rng: jax.Array | None = None, temperature: float | jax.Array = 0.0, top_k: int | None = None,
             top_p: float | jax.Array | None = None, eos_id: int | Iterable[int] | None = None, pad_id: int = 0,
             padding_mask: jax.Array | None = None, return_lengths: bool = False
             ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """prompt [B, P] int -> tokens [B, P + N] int32 (N = max_new_tokens), and with `return_lengths` the number of
    tokens each row generated [B] int32 (its stop token included): prefill the cache with the prompt, then decode one
    token at a time.

    Sampling (`sample_tokens`): greedy when temperature == 0, else drawn with `rng` from the distribution at that
    temperature, cut to the `top_k` most likely and then to the `top_p` nucleus; `temperature` and `top_p` may be
    traced (then an rng is needed). `eos_id`, a token id or a collection of them, ends a row when it is generated:
    the row's later tokens are `pad_id`, and decoding stops early once every row has ended. A batch of prompts of
    different lengths is left-padded: padding_mask [B, P] bool is False on the padding at the start of each row; each
    row then decodes as if it had been given alone (positions start at its first token).

    The cache holds P + N − 1 tokens, so generation goes past `model.config.max_len` for every encoding acting in
    attention; those adding a table of max_len rows to the embeddings (learned, sinusoidal, amspe) raise a ValueError.
    The compiled program is cached by the model, the shapes and the static options (max_new_tokens, top_k, whether
    temperature is 0, whether top_p, rng, eos_id are given and how many stop ids): a second eager call does not
    retrace, whatever the values of temperature, top_p, eos_id and pad_id. Calling it inside `jax.jit` works too.
    """
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model must be a jaxpe.TransformerLM, got {type(model).__name__}")
    check_array("prompt", prompt, "B, P")
    if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise TypeError(f"prompt must be an int array [B, P], got shape={tuple(prompt.shape)} dtype={prompt.dtype}")
    _check_static("max_new_tokens", max_new_tokens)
    if not is_int(max_new_tokens, 1):
        raise ValueError(f"{max_new_tokens=} must be a positive int")
    check_temperature(temperature)
    check_top_k(top_k)
    check_top_p(top_p)
    greedy = not _is_traced(temperature) and float(temperature) == 0.0
    if not greedy and rng is None:
        raise ValueError(f"temperature={temperature!r} may be > 0, which samples and needs an rng")
    rng = _typed_rng(rng)
    vocab_size = model.config.vocab_size
    stop_ids = _stop_ids(eos_id, vocab_size)
    if not is_int(pad_id, 0) or pad_id >= vocab_size:
        raise ValueError(f"pad_id={pad_id!r} must be a token id in [0, vocab_size={vocab_size})")
    if not isinstance(return_lengths, bool):
        raise TypeError(f"return_lengths={return_lengths!r} must be a bool")
    b, p = prompt.shape
    if p < 1:
        raise ValueError(f"prompt must hold at least one token per row, got shape={tuple(prompt.shape)}")
    check_token_inputs(b, p, padding_mask=padding_mask)
    check_token_ids("prompt token", prompt, vocab_size)
    if padding_mask is not None and not _is_traced(padding_mask):
        if not np.all(np.asarray(padding_mask)[:, -1]):
            raise ValueError("padding_mask must mark left padding: the last prompt token of every row must be real "
                             "(padding_mask[:, -1] all True)")
    _check_fits_position_table(model, p + int(max_new_tokens) - 1)
    tokens, lengths = _generate(
        model, params, prompt, padding_mask, None if greedy else rng,
        None if greedy else jnp.asarray(temperature, jnp.float32),
        None if top_p is None else jnp.asarray(top_p, jnp.float32),
        jnp.asarray(stop_ids, jnp.int32) if stop_ids else None, jnp.asarray(pad_id, jnp.int32),
        max_new_tokens=int(max_new_tokens), top_k=None if top_k is None else int(top_k))
    return (tokens, lengths) if return_lengths else tokens


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "top_k"))
def _generate(model: TransformerLM, params: Any, prompt: jax.Array, padding_mask: jax.Array | None,
              rng: jax.Array | None, temperature: jax.Array | None, top_p: jax.Array | None,
              stop_ids: jax.Array | None, pad_id: jax.Array, *, max_new_tokens: int, top_k: int | None
              ) -> tuple[jax.Array, jax.Array]:
    """`generate` after its checks: tokens [B, P + N] int32 and generated lengths [B] int32. rng and temperature are
    None for greedy decoding, stop_ids [n_stop] int32 None without stop tokens."""
    b, p = prompt.shape
    n = max_new_tokens
    positions = default_positions(None, fold_padding(None, padding_mask), b)  # None without padding
    keys = None if rng is None else jax.random.split(rng, n)

    def pick(logits: jax.Array, i: jax.Array | int) -> jax.Array:
        if temperature is None:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return sample_tokens(logits, keys[i], temperature=temperature, top_k=top_k, top_p=top_p)

    def stops(token: jax.Array) -> jax.Array:
        return jnp.zeros(token.shape, bool) if stop_ids is None else jnp.isin(token, stop_ids)

    cache = _zero_cache(model, b, p + n - 1)
    logits, updated = model.apply({"params": params, "cache": cache}, prompt, decode=True, positions=positions,
                                  padding_mask=padding_mask, mutable=["cache"])
    first = pick(logits[:, -1], 0)  # [B]
    out = jnp.full((b, n), pad_id, jnp.int32).at[:, 0].set(first)  # [B, N]
    next_position = jnp.full((b,), p, jnp.int32) if positions is None else positions[:, -1] + 1

    def running(state: tuple[Any, ...]) -> jax.Array:
        i, done = state[0], state[4]
        return (i < n) & ~jnp.all(done)

    def step(state: tuple[Any, ...]) -> tuple[Any, ...]:
        i, cache, token, position, done, lengths, out = state
        logits, updated = model.apply({"params": params, "cache": cache}, token[:, None], decode=True,
                                      positions=position[:, None], mutable=["cache"])
        nxt = jnp.where(done, pad_id, pick(logits[:, -1], i))
        lengths = lengths + (~done).astype(jnp.int32)
        out = jax.lax.dynamic_update_slice_in_dim(out, nxt[:, None], i, axis=1)
        return i + 1, updated["cache"], nxt, position + 1, done | stops(nxt), lengths, out

    state = (jnp.array(1, jnp.int32), updated["cache"], first, next_position, stops(first),
             jnp.ones((b,), jnp.int32), out)
    if stop_ids is not None:
        state = jax.lax.while_loop(running, step, state)  # stops once every row has ended
    else:
        state = jax.lax.fori_loop(1, n, lambda _, s: step(s), state)  # a scan: a static trip count
    *_, lengths, out = state
    return jnp.concatenate([prompt.astype(jnp.int32), out], axis=1), lengths
