"""Decoding caches kept in the linen "cache" collection: write the new time steps, read the whole cache.

A cache holds S time steps and writing past its end is an error, never a silent overwrite: an eager call raises a
ValueError; under jit, where the write index is traced, the overflowing write stores NaN in a floating cache (keys,
values), which makes that call's attention output and every later one NaN. (A checkify check would give words
instead, but its effect takes every jitted decoding step off jax's fast dispatch path.) `jaxpe.generate` sizes its
cache from the prompt and max_new_tokens, so it never overflows.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def check_cache(module: nn.Module, batch: int, batched: str) -> None:
    """ValueError, in words, where a decoding call (decode=True) of `batch` sequences cannot write its cache: not
    initialising and the "cache" collection not mutable (flax would raise ScopeCollectionNotFound, or refuse the write
    to an immutable collection), or a cache made for another batch size (jax would fail on the shapes of a slice
    update or a broadcast). `batched` names a cache variable of `module` whose first axis is the batch."""
    if module.is_initializing():
        return
    if not module.is_mutable_collection("cache"):
        raise ValueError("decode=True needs the 'cache' collection, mutable: each call writes its keys and values "
                         "there; model.apply({'params': params, 'cache': cache}, ..., decode=True, mutable=['cache']), "
                         "with the cache from jaxpe.init_cache(model, batch_size, length) or from init(..., "
                         "decode=True)")
    if module.has_variable("cache", batched):
        cached = module.get_variable("cache", batched).shape[0]
        if cached != batch:
            raise ValueError(f"decode=True with a batch of B={batch} sequences, but the cache was made for "
                             f"batch_size={cached}: each row of the batch goes on from its own cached row; make a "
                             f"cache for this batch (jaxpe.init_cache(model, {batch}, length), or init_cache({batch}, "
                             "length) of a jaxpe.nnx layer)")


def update_cache(module: nn.Module, name: str, new: jax.Array, index: jax.Array) -> jax.Array:
    """Write new [B, Lq, ...] at time `index` into cache variable `name` [B, S, ...]; return the whole cache.

    The initialising call (the variable does not exist yet) creates it with new's shape — call it with an input of
    the full cache length S — and returns `new` unchanged. index + Lq > S is an error (see the module docstring): a
    ValueError when `index` is concrete; when traced, NaN written to a floating cache.
    """
    initialised = module.has_variable("cache", name)
    var = module.variable("cache", name, jnp.zeros, new.shape, new.dtype)
    if not initialised:
        return new
    size, length = var.value.shape[1], new.shape[1]
    where = f"cache {name!r} of S={size} time steps"
    if length > size:
        raise ValueError(f"cannot write {length} time steps into the {where}: initialise a longer cache")
    if isinstance(index, jax.core.Tracer):
        if jnp.issubdtype(new.dtype, jnp.inexact):
            new = jnp.where(index + length <= size, new, jnp.nan)
    elif int(index) + length > size:
        raise ValueError(f"decoding past the end of the {where}: index={int(index)} + {length} new steps; "
                         "initialise a longer cache")
    var.value = jax.lax.dynamic_update_slice_in_dim(var.value, new.astype(var.value.dtype), index, axis=1)
    return var.value
