"""NoPE: no positional information beyond the causal mask.

Attention is plain causal softmax attention (`jaxpe.attention_core.PlainCore`); there are no parameters.
"""
from __future__ import annotations

import dataclasses

from jaxpe.registry import PEConfig, register


@register("none")
@dataclasses.dataclass(frozen=True)
class NoPEConfig(PEConfig):
    """No positional information beyond the causal mask."""
