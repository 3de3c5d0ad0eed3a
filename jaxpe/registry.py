"""Encodings chosen by name: one frozen config dataclass per encoding, registered under its string name.

An encoding acts in one of two places:
- on token embeddings (`additive`; `embedding` returns a module called as `module(x, positions)`, x [B, L, d_model]);
- inside attention (`core` returns a linen module answering `jaxpe.attention_core.AttentionCore`:
  `core(q, k, v, ctx)` -> [B, Lq, Hq, D], q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D], ctx an `AttentionContext`).
Every config checks its options in `__post_init__`: a bad one is a ValueError naming it and its value.
Adding an encoding is one file plus one `@register` line.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping, TypeVar

import flax.linen as nn
import jax
import numpy as np

from jaxpe.attention_core import PlainCore

_REGISTRY: dict[str, type["PEConfig"]] = {}
C = TypeVar("C", bound=type["PEConfig"])


@dataclasses.dataclass(frozen=True)
class PEConfig:
    """Base of every encoding config. Subclasses are frozen dataclasses registered by name."""

    name: ClassVar[str] = ""
    additive: ClassVar[bool] = False  # acts on the token embeddings (`embedding` gives a module), not in attention
    # The option that sets the rows of the encoding's position tables (None: max_len + 1), and those tables' names.
    size_option: ClassVar[str | None] = None
    tables: ClassVar[tuple[str, ...]] = ()

    def embedding(self, *, d_model: int, max_len: int) -> nn.Module | None:
        """The module added to token embeddings, or None when the encoding acts in attention."""
        return None

    def check_layer(self, *, head_dim: int, impl: str, causal: bool = True) -> None:
        """ValueError when this encoding cannot run in attention of head dim `head_dim` with implementation `impl`, in
        the direction `causal` (a layer checks at its construction; `core` checks again, causal)."""

    def core(self, *, head_dim: int, max_len: int, impl: str) -> nn.Module:
        """The attention core (an `AttentionCore`); plain softmax attention unless overridden."""
        return PlainCore()

    def shared_table_shape(self, *, head_dim: int, num_heads: int, max_len: int) -> tuple[int, ...] | None:
        """Shape of a position table shared by all layers, owned by the model; None when there is none."""
        return None

    def causal_only(self) -> str | None:
        """Why this encoding runs causal attention only (a phrase), or None: it also runs bidirectionally
        (causal=False, an encoder)."""
        return None

    def check_causal(self, causal: bool) -> None:
        """ValueError naming the encoding when `causal` is False and it runs causal attention only."""
        reason = None if causal else self.causal_only()
        if reason is not None:
            both = [name for name in pe_names() if _REGISTRY[name]().causal_only() is None]
            raise ValueError(f"causal=False: pe={self.name!r} runs causal attention only: {reason}; bidirectional "
                             f"attention takes {both}")

    def table_rows(self, max_len: int) -> int | None:
        """Rows of the position tables: the `size_option`, else max_len + 1 (the block size + 1); None without
        tables."""
        if self.size_option is None:
            return None
        rows = getattr(self, self.size_option)
        return max_len + 1 if rows is None else rows

    def check_params(self, params: Mapping[str, Any], *, max_len: int) -> None:
        """ValueError naming `size_option` and the value that loads them when `params` (this encoding's parameters
        in a layer, or the model's shared table) hold a position table of another size."""
        rows = self.table_rows(max_len)
        for name in self.tables:
            if name in params:
                got = np.shape(jax.tree.leaves(params[name])[0])[-2]
                if got != rows:
                    default = "" if getattr(self, self.size_option) is not None else f" (max_len + 1, {max_len=})"
                    raise ValueError(f"position table {name!r} has {got} rows, but pe={self.name!r} here has "
                                     f"{self.size_option}={rows}{default}: {table_hint(name, got)}")


def position_tables() -> dict[str, str]:
    """{parameter name of a position table: the encoding option that sets its rows} over every registered encoding."""
    return {table: cls.size_option for cls in _REGISTRY.values() for table in cls.tables}


def table_hint(name: str, rows: int) -> str:
    """How to load the position table `name` (one of `position_tables()`) that has `rows` rows."""
    option = position_tables()[name]
    return (f"its rows are the encoding's {option} (by default max_len + 1, so they change with max_len); set "
            f"{option}={rows} (in a ModelConfig: pe_options={{'{option}': {rows}}}) to load it")


def register(name: str) -> Callable[[C], C]:
    """Class decorator: register an encoding config (a dataclass subclassing PEConfig) under `name`, a Python
    identifier (it is read back from `--pe a,b` lists and `model.pe=<name>` overrides)."""
    if not isinstance(name, str):
        raise TypeError(f"encoding name must be a str, got {name!r}")
    if not name.isidentifier():
        raise ValueError(f"encoding name={name!r} must be a Python identifier (letters, digits, underscores)")

    def wrap(cls: C) -> C:
        if not (isinstance(cls, type) and issubclass(cls, PEConfig) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"register({name!r}) decorates a dataclass subclassing jaxpe.PEConfig, got {cls!r}")
        if name in _REGISTRY:
            raise ValueError(f"encoding {name=} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def pe_names() -> tuple[str, ...]:
    """Every registered encoding name."""
    return tuple(_REGISTRY)


def pe_config(name: str, **options: Any) -> PEConfig:
    """Build the config of encoding `name`; an unknown name or option is a ValueError naming it."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown encoding pe={name!r}; choose one of {pe_names()}")
    cls = _REGISTRY[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    for option in options:
        if option not in fields:
            raise ValueError(f"unknown option {option!r} for pe={name!r}; valid options: {sorted(fields)}")
    # NumPy scalars as the Python numbers they hold, so that the config stays JSON-serialisable
    return cls(**{option: value.item() if isinstance(value, np.generic) else value
                  for option, value in options.items()})


def as_pe_config(pe: PEConfig | str) -> PEConfig:
    """A layer's `pe`: a config as given, or an encoding name with its default options (`pe_config(name)`)."""
    if isinstance(pe, PEConfig):
        return pe
    if isinstance(pe, str):
        return pe_config(pe)
    raise TypeError(f"pe must be an encoding name (one of {pe_names()}) or a jaxpe.PEConfig from "
                    f"jaxpe.pe_config(name, **options), got pe={pe!r}")
