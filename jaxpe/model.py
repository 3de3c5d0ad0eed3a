"""A decoder-only Transformer language model with any registered encoding (generation: jaxpe.decoding).

B batch, L length, V vocabulary, d d_model.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.attention import Attention, check_token_inputs, decode_positions, default_positions
from jaxpe.cope import CoPEConfig
from jaxpe.dropout import Dropout
from jaxpe.kv_cache import check_cache
from jaxpe.registry import PEConfig, pe_config, pe_names
from jaxpe.sharding import check_restored_params, partitioned
from jaxpe.softmax_attention import fold_padding
from jaxpe.validation import (check_array, check_bool, check_choice, check_fraction, check_impl, check_optional_int,
                              check_token_ids, check_window, is_int)

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
DTYPES = ("float32", "bfloat16", "float16")
# What a rematerialised block keeps for the backward (`jax.checkpoint` policies): "none" runs no remat (every
# intermediate is kept), "dots" keeps the products with the weights (projections, MLP) and recomputes the rest,
# attention's [B, H, L, L] products included, "full" keeps only each block's input and recomputes the block.
REMAT_POLICIES = {"none": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable, "full": None}
UNFILLED = ("vocab_size", "max_len")  # fields that may wait as None until the data is known


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of TransformerLM. `pe_options` may be given as a dict; it is stored as sorted pairs.

    Which encoding each layer's attention uses is a per-layer pattern, `layer_pe`, cycled over the layers as gemma's
    `attention_types`: ("cope", "none") puts CoPE on layers 0, 2, 4, ... and no positions on the others. The pattern
    must name `pe`, which takes `pe_options` (and owns a table shared by all layers, CoPE's `shared_table`); the other
    names take their defaults. Additive encodings act on the token embeddings whatever the pattern. Older configs
    gave the pattern as CoPE's `every`/`other_layers` options; they still work and mean
    `layer_pe=("cope",) + (other_layers,) * (every − 1)`.

    `vocab_size` and `max_len` may be None, "not known yet", in a config that an application completes from its data
    (as jaxpe.train does from its task); building a model from such a config is an error (`check_filled`).
    """

    vocab_size: int | None = None  # token ids are 0..vocab_size-1; None: not known yet, filled from the data
    d_model: int = 256  # width of the residual stream
    num_layers: int = 4  # Transformer blocks
    num_heads: int = 4  # query heads
    num_kv_heads: int | None = None  # key/value heads (GQA); None means num_heads (MHA), 1 is MQA
    mlp_dim: int | None = None  # MLP hidden width; None means 4·d_model
    max_len: int | None = 512  # position-table rows, default CoPE npos − 1; None: from the data
    dropout: float = 0.1  # dropout on embeddings, attention output and MLP output
    norm: str = "layernorm"  # "layernorm" or "rmsnorm"
    prenorm: bool = True  # pre-norm (x + f(norm(x))) or post-norm (norm(x + f(x)), the paper's counting runs)
    mlp: str = "gelu"  # "gelu" or "swiglu"
    tie_embeddings: bool = True  # output logits through the token embedding matrix
    pe: str = "rope"  # encoding name from the registry (jaxpe.PE_NAMES)
    pe_options: Mapping[str, Any] | tuple[tuple[str, Any], ...] = ()  # that encoding's config fields, e.g. {"npos": 64}
    layer_pe: tuple[str, ...] = ()  # encoding of each layer's attention, cycled, e.g. ("cope", "none"); () = pe in all
    dtype: str = "float32"  # compute dtype: float32, bfloat16, float16 (not in jaxpe.train); logits, positions float32
    param_dtype: str = "float32"  # dtype of the weights (as dtype); position parameters stay float32
    impl: str = "auto"  # implementation of CoPE/Co-RoPE attention: auto, reference, blockwise, pallas
    window: int | None = None  # sliding-window attention: each token sees itself and the window − 1 before it
    causal: bool = True  # False: bidirectional attention in every layer (an encoder; no decoding)
    remat: str = "none"  # rematerialise each block: "none", "dots" (keep weight products) or "full" (keep inputs)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pe_options", _option_pairs(self.pe_options))
        if isinstance(self.layer_pe, list):
            object.__setattr__(self, "layer_pe", tuple(self.layer_pe))
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "max_len"):
            value = getattr(self, name)
            if value is None and name in UNFILLED:
                continue
            if not is_int(value, 1):
                raise ValueError(f"{name}={value!r} must be a positive int")
            object.__setattr__(self, name, int(value))  # NumPy ints too, kept JSON-serialisable
        for name in ("num_kv_heads", "mlp_dim"):
            value = getattr(self, name)
            check_optional_int(name, value, 1)
            if value is not None:
                object.__setattr__(self, name, int(value))
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of num_heads={self.num_heads}")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        check_fraction("dropout", self.dropout, one=False)
        object.__setattr__(self, "dropout", float(self.dropout))  # a NumPy float too, kept JSON-serialisable
        for name, choices in (("norm", NORMS), ("mlp", MLPS), ("dtype", DTYPES), ("param_dtype", DTYPES)):
            check_choice(name, getattr(self, name), choices)
        for name in ("prenorm", "tie_embeddings", "causal"):
            check_bool(name, getattr(self, name))
        check_choice("remat", self.remat, tuple(REMAT_POLICIES))
        check_impl(self.impl)
        check_window(self.window)
        if self.window is not None:
            object.__setattr__(self, "window", int(self.window))  # NumPy ints too, kept JSON-serialisable
        # the encodings resolved once: the config is frozen, so every later read returns these objects
        pe = pe_config(self.pe, **dict(self.pe_options))  # validates the name and its options
        object.__setattr__(self, "_pe_config", pe)
        self._check_layer_pe()
        if self.layer_pe:
            pattern = self.layer_pe
        elif isinstance(pe, CoPEConfig):
            pattern = (self.pe,) + (pe.other_layers,) * (pe.every - 1)
        else:
            pattern = (self.pe,)
        object.__setattr__(self, "_layer_pattern", pattern)
        layer_configs = {name: pe if name == self.pe else pe_config(name) for name in set(pattern)}
        object.__setattr__(self, "_layer_pe_configs", tuple(layer_configs[name] for name in pattern))
        self._check_pattern_attends()
        for config in layer_configs.values():
            config.check_causal(self.causal)
            config.check_layer(head_dim=self.head_dim, impl=self.impl, causal=self.causal)

    def _check_layer_pe(self) -> None:
        """ValueError unless `layer_pe` is () or registered names including `pe`, given once (not also as `every`)."""
        if not isinstance(self.layer_pe, tuple) or not all(isinstance(name, str) for name in self.layer_pe):
            raise ValueError(f"layer_pe={self.layer_pe!r} must be a tuple of encoding names")
        if not self.layer_pe:
            return
        unknown = [name for name in self.layer_pe if name not in pe_names()]
        if unknown:
            raise ValueError(f"layer_pe={self.layer_pe!r}: unknown encoding(s) {unknown}; choose from {pe_names()}")
        if self.pe not in self.layer_pe:
            raise ValueError(f"layer_pe={self.layer_pe!r} must name pe={self.pe!r} (its layers take pe_options)")
        pe = self.pe_config
        if isinstance(pe, CoPEConfig) and pe.every != 1:
            raise ValueError(f"layer_pe={self.layer_pe!r} and CoPE's every={pe.every} both give the per-layer "
                             "pattern; give layer_pe only")

    def _check_pattern_attends(self) -> None:
        """ValueError when the per-layer pattern names an additive encoding besides `pe`: additive tables act once on
        the token embeddings, so those layers would silently get no positions."""
        additive = sorted({config.name for config in self._layer_pe_configs
                           if config.name != self.pe and config.additive})
        if additive:
            raise ValueError(f"the per-layer pattern {self.layer_pattern!r} names additive encoding(s) {additive}, "
                             "which act on the token embeddings, not inside a layer; use 'none' for layers without "
                             "positions")

    def check_filled(self) -> None:
        """ValueError naming the fields still None (not known yet): a model needs them all."""
        missing = [name for name in UNFILLED if getattr(self, name) is None]
        if missing:
            unset = ", ".join(f"{name}=None" for name in missing)
            raise ValueError(f"ModelConfig {unset}: fill them in before building a model, "
                             f"e.g. dataclasses.replace(config, {missing[0]}=...)")

    @property
    def pe_config(self) -> PEConfig:
        """The encoding's config object (resolved once, at construction)."""
        return self._pe_config

    @property
    def layer_pattern(self) -> tuple[str, ...]:
        """The encoding names cycled over the layers: `layer_pe`, else CoPE's `every`/`other_layers`, else (pe,)."""
        return self._layer_pattern

    def layer_pe_config(self, index: int) -> PEConfig:
        """The encoding config of layer `index`'s attention: `pe` with `pe_options`, another name with its defaults."""
        return self._layer_pe_configs[index % len(self._layer_pe_configs)]

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def compute_dtype(self) -> Any:
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self) -> Any:
        return jnp.dtype(self.param_dtype)


def _option_pairs(options: Any) -> tuple[tuple[str, Any], ...]:
    """`pe_options` as (name, value) pairs: a dict's sorted by name, a nested dict (a rope_scaling) as sorted pairs
    too, so that the config hashes; ValueError unless a dict or pairs keyed by option names."""
    pairs = sorted(options.items(), key=lambda pair: str(pair[0])) if isinstance(options, Mapping) else options
    if not isinstance(pairs, (tuple, list)) or not all(
            isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str) for pair in pairs):
        raise ValueError(f"pe_options={options!r} must be a dict of the encoding's options, e.g. {{'npos': 64}}")
    return tuple((key, tuple(sorted((k, _plain(v)) for k, v in value.items())) if isinstance(value, Mapping) else
                   _plain(value)) for key, value in pairs)


def _plain(value: Any) -> Any:
    """A NumPy scalar as the Python number it holds (a config stays JSON-serialisable); anything else as it is."""
    return value.item() if isinstance(value, np.generic) else value


def _norm(config: ModelConfig, name: str) -> nn.Module:
    kw = dict(dtype=config.compute_dtype, param_dtype=config.weight_dtype, name=name,
              scale_init=partitioned(nn.initializers.ones, "embed"))
    if config.norm == "rmsnorm":
        return nn.RMSNorm(**kw)
    return nn.LayerNorm(bias_init=partitioned(nn.initializers.zeros, "embed"), **kw)


_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


@jax.custom_jvp
def gelu(x: jax.Array) -> jax.Array:
    """GELU's tanh form, `jax.nn.gelu(x, approximate=True)`: x/2 · (1 + tanh(√(2/π)(x + 0.044715 x³))). Its
    tangent is slope(x)·dx with the slope written out from x and the tanh (autodiff of the formula spends several
    elementwise passes): linear in dx, so JAX transposes it for reverse mode (one elementwise backward pass) and
    differentiates it again for forward mode over reverse and higher orders."""
    return 0.5 * x * (1.0 + jnp.tanh(_GELU_C * (x + _GELU_A * x * x * x)))


@gelu.defjvp
def _gelu_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> tuple[jax.Array, jax.Array]:
    (x,), (dx,) = primals, tangents
    t = jnp.tanh(_GELU_C * (x + _GELU_A * x * x * x))
    slope = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_C * (1.0 + 3.0 * _GELU_A * x * x)
    return 0.5 * x * (1.0 + t), slope.astype(dx.dtype) * dx


class MLP(nn.Module):
    """x [B, L, d] -> [B, L, d]: GELU MLP or SwiGLU."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool) -> jax.Array:
        c = self.config
        hidden = c.mlp_dim or 4 * c.d_model
        dense = lambda features, axes, name: nn.Dense(
            features, dtype=c.compute_dtype, param_dtype=c.weight_dtype, name=name,
            kernel_init=partitioned(nn.initializers.lecun_normal(), *axes),
            bias_init=partitioned(nn.initializers.zeros, axes[1]))
        if c.mlp == "swiglu":
            h = nn.silu(dense(hidden, ("embed", "mlp"), "gate")(x)) * dense(hidden, ("embed", "mlp"), "up")(x)
        else:
            h = gelu(dense(hidden, ("embed", "mlp"), "up")(x))
        return Dropout(c.dropout)(dense(c.d_model, ("mlp", "embed"), "down")(h), deterministic=deterministic)


class Block(nn.Module):
    """One Transformer block, pre-norm or post-norm. deterministic and decode are positional, so that
    `nn.remat(Block, static_argnums=(2, 3))` holds them static."""

    config: ModelConfig
    layer_index: int

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool, decode: bool, pos_emb: jax.Array | None,
                 tokens: TokenInfo) -> jax.Array:
        c = self.config
        attn = Attention(num_heads=c.num_heads, num_kv_heads=c.kv_heads, head_dim=c.head_dim,
                         pe=c.layer_pe_config(self.layer_index), max_len=c.max_len, dropout=c.dropout, impl=c.impl,
                         dtype=c.compute_dtype, window=c.window, param_dtype=c.weight_dtype, check_inputs=False,
                         causal=c.causal, name="attn")
        mlp = MLP(c, name="mlp")
        norm1, norm2 = _norm(c, "norm1"), _norm(c, "norm2")
        kw = dict(deterministic=deterministic)
        attend = lambda h: attn(h, decode=decode, pos_emb=pos_emb, positions=tokens.positions,
                                segment_ids=tokens.segment_ids, padding_mask=tokens.padding_mask, **kw)
        if c.prenorm:
            x = x + attend(norm1(x))
            return x + mlp(norm2(x), **kw)
        x = norm1(x + attend(x))
        return norm2(x + mlp(x, **kw))


def _recomputed_after_its_cotangent(deterministic: bool) -> Any:
    """A rematerialised block called as f(block, x, pos_emb, tokens), its backward recomputing its forward only
    once the cotangent of its output has arrived.

    jax.checkpoint orders the two by an optimization barrier, which XLA's CPU compiler drops: it then recomputes
    every block's forward at the start of the backward and keeps them all, so remat saved no memory
    (benchmarks/remat_memory.py). Here the backward adds 0·cotangent to each floating residual: the same values,
    a data dependency no compiler reorders."""

    def run(mdl: nn.Module, x: jax.Array, pos_emb: jax.Array | None, tokens: TokenInfo) -> jax.Array:
        return mdl(x, deterministic, False, pos_emb, tokens)

    def forward(mdl: nn.Module, x: jax.Array, pos_emb: jax.Array | None, tokens: TokenInfo) -> tuple[Any, Any]:
        return nn.vjp(run, mdl, x, pos_emb, tokens)

    def backward(vjp_fn: Any, y_t: jax.Array) -> tuple[Any, ...]:
        zero = 0 * y_t.ravel()[0]  # a non-finite first entry makes every gradient of the block non-finite

        def after(r: Any) -> Any:
            return r + zero.astype(r.dtype) if isinstance(r, jax.Array) and jnp.issubdtype(r.dtype, jnp.floating) else r

        return tuple(jax.tree.map(after, vjp_fn)(y_t))

    return nn.custom_vjp(run, forward_fn=forward, backward_fn=backward)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenInfo:
    """What the caller says about each token, [B, L] each or None: positions (int), segment_ids (int, packed
    documents), padding_mask (bool, False on padding)."""

    positions: jax.Array | None = None
    segment_ids: jax.Array | None = None
    padding_mask: jax.Array | None = None


class TransformerLM(nn.Module):
    """tokens [B, L] int -> logits [B, L, V] float32.

    Optional, [B, L] each: `positions` (int; default: the index within each document; while decoding, each row goes
    on from its last position in the previous call, given or default) for the index-based encodings; `segment_ids`
    (int) packs several documents in a row: no attention across documents, and CoPE/Co-RoPE positions restart at
    each; `padding_mask` (bool, False on padding): padded tokens are keys no real token sees (their own outputs are
    meaningless). `decode=True` runs with the KV cache (see
    `generate`): initialise the cache with an input of the full length; a bidirectional model (config.causal False)
    does not decode. config.remat rematerialises each block in training (`REMAT_POLICIES`): the same values and
    gradients, less memory, more compute; reverse mode only (forward mode needs remat="none").
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, *, deterministic: bool = True, decode: bool = False,
                 positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 padding_mask: jax.Array | None = None) -> jax.Array:
        c = self.config
        c.check_filled()
        check_array("tokens", tokens, "B, L")
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(f"tokens must be an int array [B, L], got shape={tuple(tokens.shape)} dtype={tokens.dtype}")
        check_token_ids("tokens", tokens, c.vocab_size)
        b, length = tokens.shape
        check_token_inputs(b, length, positions=positions, segment_ids=segment_ids, padding_mask=padding_mask)
        segments = fold_padding(segment_ids, padding_mask)
        if decode:
            check_cache(self, b, "position")
            positions = self._decode_positions(positions, segments, b, length)
        else:
            positions = default_positions(positions, segments, b)
        pe = c.pe_config
        if not self.is_initializing():
            params = self.variables.get("params", {})
            check_restored_params(params)
            pe.check_params(params, max_len=c.max_len)  # the table shared by all layers
            for i in range(c.num_layers):  # each layer's own tables (its Attention trusts this check)
                layer = params.get(f"block{i}", {}).get("attn", {}).get("pe", {})
                c.layer_pe_config(i).check_params(layer, max_len=c.max_len)
        embed = nn.Embed(c.vocab_size, c.d_model, param_dtype=c.weight_dtype, name="embed",
                         embedding_init=partitioned(nn.initializers.normal(0.02), "vocab", "embed"))
        x = embed(tokens).astype(c.compute_dtype)
        additive = pe.embedding(d_model=c.d_model, max_len=c.max_len)
        if additive is not None:
            x = additive.clone(parent=self, name="pos_embed")(x, positions=positions)
        x = Dropout(c.dropout)(x, deterministic=deterministic)
        shape = pe.shared_table_shape(head_dim=c.head_dim, num_heads=c.num_heads, max_len=c.max_len)
        table_axes = ("heads", "positions", "head_dim")[-len(shape):] if shape else ()
        shared = None if shape is None else self.param(
            "shared_pos_emb", partitioned(nn.initializers.normal(0.02), *table_axes), shape, jnp.float32)
        tokens_info = TokenInfo(positions, segment_ids, padding_mask)
        for i in range(c.num_layers):
            if c.remat == "none" or decode:
                x = Block(c, i, name=f"block{i}")(x, deterministic, decode, shared, tokens_info)
            else:  # the same parameters
                remat_block = nn.remat(Block, policy=REMAT_POLICIES[c.remat], static_argnums=(2, 3))
                block = remat_block(c, i, name=f"block{i}")
                x = _recomputed_after_its_cotangent(deterministic)(block, x, shared, tokens_info)
        if c.prenorm:
            x = _norm(c, "final_norm")(x)
        if c.tie_embeddings:
            logits = embed.attend(x.astype(jnp.float32))
        else:
            unembed = nn.Dense(c.vocab_size, use_bias=False, param_dtype=c.weight_dtype, name="unembed",
                               kernel_init=partitioned(nn.initializers.lecun_normal(), "embed", "vocab"))
            logits = unembed(x.astype(jnp.float32))
        return logits.astype(jnp.float32)

    def _decode_positions(self, positions: jax.Array | None, segments: jax.Array | None, b: int, length: int
                          ) -> jax.Array | None:
        """Positions [B, L] of a decoding call's tokens: the caller's, else each token's index within its document,
        a document that goes on from the previous call going on from its position there (None when the cache is
        made). segments [B, L] int32 are the document ids, padding folded in (None: one document). Caches each row's
        next position and last document id."""
        initialised = self.has_variable("cache", "position")
        next_var = self.variable("cache", "position", lambda: jnp.zeros((b,), jnp.int32))  # [B]
        last_var = self.variable("cache", "segment", lambda: jnp.zeros((b,), jnp.int32))  # [B]
        if not initialised:
            return default_positions(positions, segments, b)
        if positions is None:
            positions = decode_positions(segments, next_var.value, last_var.value, length)
        else:
            positions = default_positions(positions, None, b)
        if length:
            next_var.value = positions[:, -1] + 1
            last_var.value = jnp.zeros((b,), jnp.int32) if segments is None else segments[:, -1]
        return positions
