"""Dropout with masks from a counter-based hash: the same Bernoulli(1 − rate) masks as `flax.linen.Dropout`, at a
fraction of the cost on CPU.

flax's Dropout draws one threefry-2x32 block (20 rounds) per element; on a CPU that is most of a small model's
dropout time, and XLA may compute it twice (once in the forward, once when it rematerialises the mask for the
backward). Here the `dropout` RNG stream gives two 32-bit seeds per call (threefry on two numbers), and element n of
the mask is a murmur3-style finaliser of (n, seeds): a bijection of n for fixed seeds, whose 32 output bits are
compared with (1 − rate)·2³² (flax's uniform has 23 bits of resolution). Elements are kept independently with
probability 1 − rate (tests/test_dropout.py checks the rate, neighbours and calls against each other), kept values
are scaled by 1 / (1 − rate) as in flax.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

_MAX_ELEMENTS = 2**32  # the counter is uint32


def _fmix32(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser (a bijection of uint32 with full avalanche)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def keep_mask(key: jax.Array, shape: tuple[int, ...], keep_prob: float) -> jax.Array:
    """bool `shape`: True with probability keep_prob, independently per element, from the PRNG key `key`."""
    size = 1
    for n in shape:
        size *= n
    if size >= _MAX_ELEMENTS:
        return jax.random.bernoulli(key, keep_prob, shape)
    seeds = jax.random.bits(key, (2,), jnp.uint32)
    counter = lax.iota(jnp.uint32, size).reshape(shape)
    bits = _fmix32(_fmix32(counter * jnp.uint32(0x9E3779B9) + seeds[0]) ^ seeds[1])
    threshold = min(round(keep_prob * 2**32), 2**32 - 1)
    return bits < jnp.uint32(threshold)


def dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
    """x with each element zeroed with probability `rate`, the others scaled by 1 / (1 − rate)."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{rate=} must be in [0, 1)")
    if rate == 0.0:
        return x
    keep = 1.0 - rate
    return lax.select(keep_mask(key, x.shape, keep), x / jnp.asarray(keep, x.dtype), jnp.zeros_like(x))


class Dropout(nn.Module):
    """`flax.linen.Dropout`'s interface (rate, deterministic, the "dropout" RNG stream) with `keep_mask`'s masks."""

    rate: float

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool) -> jax.Array:
        if deterministic or self.rate == 0.0:
            return x
        return dropout(x, self.rate, self.make_rng("dropout"))
