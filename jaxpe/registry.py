"""Encodings chosen by name: one frozen config dataclass per encoding, registered under its string name.

An encoding acts in one of two places:
- on token embeddings (`embedding` returns a module called as `module(x, positions)`, x [B, L, d_model]);
- inside attention (`core` returns a linen module answering `jaxpe.attention_core.AttentionCore`:
  `core(q, k, v, ctx)` -> [B, Lq, Hq, D], q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D], ctx an `AttentionContext`).
Adding an encoding is one file plus one `@register` line.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, TypeVar

import flax.linen as nn

from jaxpe.attention_core import PlainCore

_REGISTRY: dict[str, type["PEConfig"]] = {}
C = TypeVar("C", bound=type["PEConfig"])


@dataclasses.dataclass(frozen=True)
class PEConfig:
    """Base of every encoding config. Subclasses are frozen dataclasses registered by name."""

    name: ClassVar[str] = ""

    def embedding(self, *, d_model: int, max_len: int) -> nn.Module | None:
        """The module added to token embeddings, or None when the encoding acts in attention."""
        return None

    def core(self, *, head_dim: int, max_len: int, impl: str) -> nn.Module:
        """The attention core (an `AttentionCore`); plain softmax attention unless overridden."""
        return PlainCore()

    def shared_table_shape(self, *, head_dim: int, num_heads: int, max_len: int) -> tuple[int, ...] | None:
        """Shape of a position table shared by all layers, owned by the model; None when there is none."""
        return None


def register(name: str) -> Callable[[C], C]:
    """Class decorator: register an encoding config under `name`."""

    def wrap(cls: C) -> C:
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
    return cls(**options)

