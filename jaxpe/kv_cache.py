"""Decoding caches kept in the linen "cache" collection: write the new time steps, read the whole cache."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def update_cache(module: nn.Module, name: str, new: jax.Array, index: jax.Array) -> jax.Array:
    """Write new [B, Lq, ...] at time `index` into cache variable `name` [B, S, ...]; return the whole cache.

    The initialising call (the variable does not exist yet) creates it with new's shape — call it with an input of
    the full cache length S — and returns `new` unchanged.
    """
    initialised = module.has_variable("cache", name)
    var = module.variable("cache", name, jnp.zeros, new.shape, new.dtype)
    if not initialised:
        return new
    var.value = jax.lax.dynamic_update_slice_in_dim(var.value, new.astype(var.value.dtype), index, axis=1)
    return var.value
