"""jaxpe's layers as Flax NNX modules: `TransformerLM`, `Attention`, `AMSPE`, the encodings' modules, `generate`.

Each NNX layer wraps its linen twin. It builds the linen module, creates the parameters at construction (the linen
`init` on a small zero input, keys from `rngs`), keeps them as `nnx.Param`s under `params` (the linen "params" tree:
same names, shapes and initialisers) and its decoding cache as `nnx.Cache`s under `cache`, and calls the linen `apply`.
So outputs equal the linen layer's for the same parameters, every registered encoding works unchanged, and linen
parameters (a jaxpe.train checkpoint) load with `load_linen_params`, boxed or not. `pe` is a config or a name.

Dropout follows NNX: `deterministic` is an attribute (False at construction: training) that `model.eval()`,
`model.train()` and `nnx.view(model, deterministic=...)` set and a call may override; masks draw from the layer's own
fork of the `dropout` stream (its `default` stream when it has none) of the `rngs` given at construction, as
`nnx.Dropout` keeps, or from the `rngs` a call passes (an nnx.Rngs, nnx.RngStream or key, as `nnx.Dropout`
takes). A layer holds no reference to the caller's `rngs`, so Flax's scan-over-layers recipe works: build a stack
with `nnx.split_rngs(splits=N)` over `nnx.vmap(in_axes=(0,), out_axes=0)` of a function making one layer (every
parameter and dropout key gets a leading axis of N), run it with `nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)`
over a function calling one; `transform_metadata={nnx.PARTITION_NAME: None}` (or a mesh axis name) on both keeps the
parameters' logical axis names in step with the stacked axis. Decoding follows `nnx.MultiHeadAttention`:
`init_cache(batch_size, length)`, then each call with `decode=True` appends to the cache.
Needs flax >= 0.12.2 (older NNX does not run on jax >= 0.10); `nnx.view` works with these modules from flax 0.12.5.

B batch, L length, Hq query heads, Hkv key/value heads, D head dim, V vocabulary.
"""
from __future__ import annotations

from typing import Any, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import meta

from jaxpe.amspe import AMSPE as LinenAMSPE
from jaxpe.attention import Attention as LinenAttention
from jaxpe.attention_core import AttentionContext
from jaxpe.decoding import generate as linen_generate
from jaxpe.model import ModelConfig
from jaxpe.model import TransformerLM as LinenTransformerLM
from jaxpe.registry import PEConfig, as_pe_config, position_tables, table_hint
from jaxpe.sharding import unbox_params
from jaxpe.validation import check_bool, check_int, is_int

__all__ = ["AMSPE", "Attention", "AttentionCore", "LinenLayer", "PositionEmbedding", "TransformerLM", "core",
           "embedding", "generate"]


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _variables(tree: Any, kind: type[nnx.Variable]) -> Any:
    """A linen collection (nested dict of arrays, or of `nn.LogicallyPartitioned` boxes) as a nested dict of NNX
    variables of type `kind`; a box's logical axis names become the variable's sharding metadata."""
    def variable(leaf: Any) -> nnx.Variable:
        if isinstance(leaf, meta.AxisMetadata):
            return kind(**leaf.to_nnx_metadata(), eager_sharding=False)  # shard later, under the user's mesh
        return kind(leaf)

    return nnx.data(jax.tree.map(variable, tree, is_leaf=lambda leaf: isinstance(leaf, meta.AxisMetadata)))


def _values(tree: Any) -> Any:
    """The arrays of a nested dict of NNX variables."""
    return jax.tree.map(lambda var: var[...], tree, is_leaf=_is_variable)


def _paths(tree: Any) -> dict[str, Any]:
    """{path as keystr: leaf} of a nested dict of arrays."""
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


DropoutRngs = nnx.Rngs | nnx.RngStream | jax.Array | None  # where a call's dropout key comes from, as in nnx.Dropout


def _dropout_stream(rngs: nnx.Rngs) -> nnx.RngStream | None:
    """The `dropout` stream of `rngs` (its `default` stream when it has none), None when it has neither."""
    try:
        return rngs["dropout"]
    except KeyError:
        return None


_NO_CACHE = "decode=True needs a cache: call init_cache(batch_size, length) first"


class LinenLayer(nnx.Module):
    """An NNX module owning the variables of a linen module and applying it; the base of every layer here.

    `linen` is the linen module, `params` its "params" tree as `nnx.Param`s, `cache` its "cache" tree as `nnx.Cache`s
    (None until `init_cache`).
    """

    def __init__(self, module: nn.Module, *sample: Any, rngs: nnx.Rngs, **sample_kwargs: Any) -> None:
        """Create the parameters by running `module.init` on the sample inputs with a key from `rngs.params`."""
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be an nnx.Rngs, got rngs={rngs!r}")
        self.linen = module
        variables = module.init({"params": rngs.params()}, *sample, **sample_kwargs)
        self.params = _variables(variables.get("params", {}), nnx.Param)
        self.cache = nnx.data(None)

    def linen_params(self) -> Any:
        """The parameters as a linen "params" tree of arrays: `self.linen.apply({"params": ...}, ...)` takes it."""
        return _values(self.params)

    def load_linen_params(self, params: Any) -> None:
        """Set the parameters from a linen "params" tree with the same names and shapes (e.g. a jaxpe.train state):
        arrays, the `nn.LogicallyPartitioned` boxes that `init` gives, or the {'value': array} dicts that an orbax
        restore of boxes without a target gives."""
        mine = _paths(self.linen_params())
        theirs = _paths(nn.meta.unbox(params))
        if set(theirs) != set(mine):
            theirs = _paths(unbox_params(params))
        if set(theirs) != set(mine):
            missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
            raise ValueError(f"params must have the tree of this layer's parameters: missing {missing[:4]}"
                             f"{' ...' if len(missing) > 4 else ''}, unexpected {extra[:4]}"
                             f"{' ...' if len(extra) > 4 else ''}")
        for path, var in jax.tree_util.tree_leaves_with_path(self.params, is_leaf=_is_variable):
            value, name = theirs[jax.tree_util.keystr(path)], path[-1].key
            if var[...].shape != jnp.shape(value):
                hint = f"; {table_hint(name, jnp.shape(value)[-2])}" if name in position_tables() else ""
                raise ValueError(f"params{jax.tree_util.keystr(path)} must have shape {var[...].shape}, "
                                 f"got {jnp.shape(value)}{hint}")
        for path, var in jax.tree_util.tree_leaves_with_path(self.params, is_leaf=_is_variable):
            var[...] = jnp.asarray(theirs[jax.tree_util.keystr(path)], var[...].dtype)

    def _init_cache(self, *sample: Any, **sample_kwargs: Any) -> None:
        """Zero the cache for a decoding call on inputs shaped like `sample` (shapes from jax.eval_shape; nothing is
        computed)."""
        shapes = jax.eval_shape(lambda: self.linen.init(jax.random.key(0), *sample, **sample_kwargs))
        self.cache = _variables(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes.get("cache", {})),
                                nnx.Cache)

    def _apply(self, *args: Any, cache: bool = False, cache_optional: bool = False,
               dropout_key: jax.Array | None = None, **kwargs: Any) -> Any:
        """Call the linen module; `cache` reads and updates the cache (a decoding call), which `init_cache` must have
        made unless `cache_optional` and the module keeps none; `dropout_key` draws the dropout masks."""
        variables = {"params": self.linen_params()}
        rngs = {} if dropout_key is None else {"dropout": dropout_key}
        if not cache:
            return self.linen.apply(variables, *args, rngs=rngs, **kwargs)
        if self.cache is None and not cache_optional:
            raise ValueError(_NO_CACHE)
        if self.cache is not None:
            variables["cache"] = _values(self.cache)
        out, updated = self.linen.apply(variables, *args, rngs=rngs, mutable=["cache"], **kwargs)
        if self.cache is None:
            if updated.get("cache"):  # it keeps one, which this call would have made from its own inputs
                raise ValueError(_NO_CACHE)
            return out
        for var, value in zip(jax.tree.leaves(self.cache, is_leaf=_is_variable), jax.tree.leaves(updated["cache"])):
            var[...] = value
        return out


class _DropoutLayer(LinenLayer):
    """A LinenLayer with dropout of rate `dropout_rate`, on unless `deterministic` (the attribute, or the call's
    override); `rngs` is its own fork of the dropout stream, drawn from only when the rate is above 0 (as
    `nnx.Dropout`)."""

    def __init__(self, module: nn.Module, *sample: Any, rngs: nnx.Rngs, deterministic: bool, dropout_rate: float,
                 **sample_kwargs: Any) -> None:
        check_bool("deterministic", deterministic)  # as the linen field: a non-bool would reach the first call
        super().__init__(module, *sample, rngs=rngs, **sample_kwargs)
        stream = _dropout_stream(rngs)
        self.rngs = None if stream is None else stream.fork()
        self.dropout_rate = dropout_rate
        self.deterministic = deterministic

    def set_view(self, deterministic: bool | None = None) -> None:
        """What `nnx.view(model, deterministic=...)` calls."""
        if deterministic is not None:
            check_bool("deterministic", deterministic)
            self.deterministic = deterministic

    def _deterministic(self, deterministic: bool | None) -> bool:
        return self.deterministic if deterministic is None else deterministic

    def _dropout_key(self, deterministic: bool, rngs: DropoutRngs = None) -> jax.Array | None:
        """None when `deterministic` or the rate is 0 (nothing to draw), else the dropout key: as `nnx.Dropout`, from
        the call's `rngs` when given (an nnx.Rngs' `dropout` stream, else its `default` one; an nnx.RngStream; or
        a key), else the next of the layer's own stream."""
        if deterministic or self.dropout_rate == 0.0:
            return None
        stream = self.rngs if rngs is None else _dropout_stream(rngs) if isinstance(rngs, nnx.Rngs) else rngs
        if stream is None:
            raise ValueError("dropout (deterministic=False) needs a 'dropout' or 'default' stream in the rngs given "
                             "at construction, e.g. nnx.Rngs(params=0, dropout=1), or in the call's rngs")
        if isinstance(stream, nnx.RngStream):
            return stream()
        if isinstance(stream, jax.Array):
            return stream
        raise TypeError(f"rngs must be an nnx.Rngs, an nnx.RngStream or a PRNG key, got rngs={rngs!r}")


def _check_cache_size(batch_size: int, length: int) -> None:
    for name, value in (("batch_size", batch_size), ("length", length)):
        if not is_int(value, 1):
            raise ValueError(f"{name}={value!r} must be a positive int")


class TransformerLM(_DropoutLayer):
    """tokens [B, L] int -> logits [B, L, V] float32: jaxpe.TransformerLM as an NNX module.

    `model.config` is the ModelConfig. With `decode=True` each call appends its tokens to the KV cache made by
    `init_cache` (prefill with many, then one at a time); `jaxpe.nnx.generate` does this for you.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, deterministic: bool = False) -> None:
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a jaxpe.ModelConfig, got config={config!r}")
        super().__init__(LinenTransformerLM(config), jnp.zeros((1, 1), jnp.int32), rngs=rngs,
                         deterministic=deterministic, dropout_rate=config.dropout)
        self.config = config

    def __call__(self, tokens: jax.Array, *, deterministic: bool | None = None, decode: bool = False,
                 positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 padding_mask: jax.Array | None = None, rngs: DropoutRngs = None) -> jax.Array:
        """positions, segment_ids, padding_mask [B, L] as in jaxpe.TransformerLM; `rngs` (an nnx.Rngs, nnx.RngStream
        or key) draws this call's dropout masks instead of the model's own stream, as in `nnx.Dropout`."""
        deterministic = self._deterministic(deterministic)
        return self._apply(tokens, deterministic=deterministic, decode=decode, cache=decode,
                           dropout_key=self._dropout_key(deterministic, rngs), positions=positions,
                           segment_ids=segment_ids, padding_mask=padding_mask)

    def init_cache(self, batch_size: int, length: int) -> None:
        """Zero the KV cache for `batch_size` sequences of up to `length` tokens: beyond config.max_len for the
        encodings acting in attention, as `jaxpe.init_cache` (those adding a table of max_len rows refuse it)."""
        _check_cache_size(batch_size, length)
        self._init_cache(jnp.zeros((batch_size, length), jnp.int32), decode=True)


class Attention(_DropoutLayer):
    """Self-attention x [B, L, d_model] -> [B, L, d_model], causal or (causal=False) bidirectional: jaxpe.Attention
    as an NNX module. Rematerialised as NNX does it, `nnx.remat(lambda layer, x: layer(x))(layer, x)`, with dropout
    on or off (`deterministic` is an attribute, not traced).

    Takes jaxpe.Attention's fields plus `d_model`, the input width (linen reads it from the first input); `pe` is a
    config or an encoding name. When `pe` shares one position table across layers (CoPE with shared_table=True),
    every call must pass it as `pos_emb`.
    """

    def __init__(self, d_model: int, *, num_heads: int, num_kv_heads: int, head_dim: int, pe: PEConfig | str,
                 max_len: int = 512, dropout: float = 0.0, impl: str = "auto", dtype: Any = jnp.float32,
                 window: int | None = None, param_dtype: Any = jnp.float32, causal: bool = True, rngs: nnx.Rngs,
                 deterministic: bool = False) -> None:
        if not is_int(d_model, 1):
            raise ValueError(f"{d_model=} must be a positive int")
        pe = as_pe_config(pe)
        module = LinenAttention(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, pe=pe,
                                max_len=max_len, dropout=dropout, impl=impl, dtype=dtype, window=window,
                                param_dtype=param_dtype, causal=causal)
        self.d_model = int(d_model)
        self.shared_table_shape = pe.shared_table_shape(head_dim=head_dim, num_heads=num_heads, max_len=max_len)
        x, kwargs = self._sample(1, 1)
        super().__init__(module, x, rngs=rngs, deterministic=deterministic, dropout_rate=module.dropout, **kwargs)

    def _sample(self, batch_size: int, length: int) -> tuple[jax.Array, dict[str, Any]]:
        pos_emb = None if self.shared_table_shape is None else jnp.zeros(self.shared_table_shape)
        return jnp.zeros((batch_size, length, self.d_model)), {"pos_emb": pos_emb}

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None, decode: bool = False,
                 pos_emb: jax.Array | None = None, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, padding_mask: jax.Array | None = None,
                 rngs: DropoutRngs = None) -> jax.Array:
        """positions, segment_ids, padding_mask [B, L] as in jaxpe.Attention; `rngs` (an nnx.Rngs, nnx.RngStream or
        key) draws this call's dropout mask instead of the layer's own stream, as in `nnx.Dropout`."""
        deterministic = self._deterministic(deterministic)
        return self._apply(x, deterministic=deterministic, decode=decode, cache=decode,
                           dropout_key=self._dropout_key(deterministic, rngs), pos_emb=pos_emb, positions=positions,
                           segment_ids=segment_ids, padding_mask=padding_mask)

    def init_cache(self, batch_size: int, length: int) -> None:
        """Zero the key/value cache for `batch_size` sequences of up to `length` tokens."""
        _check_cache_size(batch_size, length)
        x, kwargs = self._sample(batch_size, length)
        self._init_cache(x, decode=True, **kwargs)


class AMSPE(LinenLayer):
    """x [B, L, d_model] -> x + adaptive PE: jaxpe.AMSPE as an NNX module; params["alpha"] of shape (1,)."""

    def __init__(self, d_model: int, max_len: int = 5000, coarse_scale: float = 10.0, amplitude: float = 1.0, *,
                 rngs: nnx.Rngs) -> None:
        check_int("d_model", d_model, 1)  # before the sample input of that width
        module = LinenAMSPE(d_model=d_model, max_len=max_len, coarse_scale=coarse_scale, amplitude=amplitude)
        super().__init__(module, jnp.zeros((1, 1, d_model)), rngs=rngs)

    def __call__(self, x: jax.Array, detail_level: float = 0.5, *, positions: jax.Array | None = None) -> jax.Array:
        return self._apply(x, detail_level, positions=positions)


class PositionEmbedding(LinenLayer):
    """x [B, L, d_model] -> x + positions' embedding: an additive encoding's module, built by `embedding`."""

    def __init__(self, module: nn.Module, *, d_model: int, rngs: nnx.Rngs) -> None:
        super().__init__(module, jnp.zeros((1, 1, d_model)), rngs=rngs)

    def __call__(self, x: jax.Array, *, positions: jax.Array | None = None) -> jax.Array:
        """positions [B, L] or None (0..L-1)."""
        return self._apply(x, positions=positions)


class AttentionCore(LinenLayer):
    """An encoding's attention core, built by `core`: (q [B, Lq, Hq, D], k, v [B, Lk, Hkv, D], ctx) -> [B, Lq, Hq, D].

    Called as its linen twin (`jaxpe.attention_core.AttentionCore`), `ctx` a `jaxpe.attention_core.AttentionContext`;
    encodings that cache while decoding (CoPE "sep_keys", the gate-network CoPE, FoX) need `init_cache` before a call
    with `ctx.decode`, the others decode without one.
    """

    def __init__(self, module: nn.Module, *, num_heads: int, num_kv_heads: int, head_dim: int, d_model: int,
                 shared_table_shape: tuple[int, ...] | None, rngs: nnx.Rngs) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim, self.d_model = num_heads, num_kv_heads, head_dim, d_model
        self.shared_table_shape = shared_table_shape
        super().__init__(module, *self._sample(1, 1, decode=False), rngs=rngs)

    def _sample(self, batch_size: int, length: int, *, decode: bool) -> tuple[Any, ...]:
        """Zero inputs (q, k, v, ctx) for `batch_size` sequences of `length` tokens."""
        q = jnp.zeros((batch_size, length, self.num_heads, self.head_dim))
        kv = jnp.zeros((batch_size, length, self.num_kv_heads, self.head_dim))
        pos_emb = None if self.shared_table_shape is None else jnp.zeros(self.shared_table_shape)
        ctx = AttentionContext(x=jnp.zeros((batch_size, length, self.d_model)), decode=decode, pos_emb=pos_emb,
                               q_pos=jnp.zeros((batch_size, length), jnp.int32))
        return q, kv, kv, ctx

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttentionContext) -> jax.Array:
        return self._apply(q, k, v, ctx, cache=ctx.decode, cache_optional=True)

    def init_cache(self, batch_size: int, length: int) -> None:
        """Zero the encoding's own decoding cache (if it has one) for `length` keys."""
        _check_cache_size(batch_size, length)
        self._init_cache(*self._sample(batch_size, length, decode=True))


def embedding(pe: PEConfig | str, *, d_model: int, max_len: int, rngs: nnx.Rngs) -> PositionEmbedding | None:
    """The NNX module adding encoding `pe` (a config or a name) to token embeddings, or None when `pe` acts inside
    attention."""
    check_int("d_model", d_model, 1)
    check_int("max_len", max_len, 1)
    pe = as_pe_config(pe)
    module = pe.embedding(d_model=d_model, max_len=max_len)
    return None if module is None else PositionEmbedding(module, d_model=d_model, rngs=rngs)


def core(pe: PEConfig | str, *, num_heads: int, num_kv_heads: int, head_dim: int, d_model: int, max_len: int = 512,
         impl: str = "auto", rngs: nnx.Rngs) -> AttentionCore:
    """The NNX attention core of encoding `pe` (a config or a name; plain softmax attention for additive ones)."""
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("d_model", d_model), ("max_len", max_len)):
        check_int(name, value, 1)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    pe = as_pe_config(pe)
    module = pe.core(head_dim=head_dim, max_len=max_len, impl=impl)
    shared = pe.shared_table_shape(head_dim=head_dim, num_heads=num_heads, max_len=max_len)
    return AttentionCore(module, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, d_model=d_model,
                         shared_table_shape=shared, rngs=rngs)


def generate(model: TransformerLM, prompt: jax.Array, *, max_new_tokens: int, rng: jax.Array | None = None,
             temperature: float | jax.Array = 0.0, top_k: int | None = None, top_p: float | jax.Array | None = None,
             eos_id: int | Iterable[int] | None = None, pad_id: int = 0, padding_mask: jax.Array | None = None,
             return_lengths: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """prompt [B, P] int -> tokens [B, P + max_new_tokens] (and the generated lengths [B] with `return_lengths`),
    exactly as `jaxpe.generate` (jaxpe/decoding.py) with the model's parameters and the same options: temperature,
    top_k, top_p, stop tokens `eos_id` then `pad_id`, left-padded prompts with padding_mask [B, P]; dropout off. The
    model's own cache and mode are left as they are."""
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model must be a jaxpe.nnx.TransformerLM, got {type(model).__name__}")
    return linen_generate(model.linen, model.linen_params(), prompt, max_new_tokens=max_new_tokens, rng=rng,
                          temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id, pad_id=pad_id,
                          padding_mask=padding_mask, return_lengths=return_lengths)
