"""jaxpe: positional encodings for JAX/Flax, contextual (CoPE, Co-RoPE), data-dependent attention (FoX,
stick-breaking) and classic.

Pure functions first, thin linen modules on top; every encoding is also selectable by name (`PE_NAMES`).
Shapes: B batch, L length, H heads (Hq query, Hkv key/value), D head dim.
"""
# Imported in registry order: none, learned, sinusoidal, amspe, rope, alibi, relative, cope, cope_gated,
# cope_rope, corope, fox, stickbreaking.
from jaxpe import none, learned, sinusoidal, amspe, rope, alibi, relative, cope, cope_gated, corope  # noqa: F401,I001
from jaxpe import fox, stickbreaking  # noqa: F401,I001
from jaxpe.alibi import alibi_bias, alibi_slopes
from jaxpe.amspe import AMSPE
from jaxpe.attention import Attention
from jaxpe.attention_core import AttentionContext, AttentionCore
from jaxpe.cope import cope_attention, cope_positions
from jaxpe.corope import corope_attention, corope_mileage
from jaxpe.decoding import generate, init_cache
from jaxpe.fox import forgetting_attention
from jaxpe.model import ModelConfig, TransformerLM
from jaxpe.registry import PEConfig, pe_config, pe_names, register
from jaxpe.rope import apply_rope
from jaxpe.rope_scaling import hf_rope_options, rope_frequencies
from jaxpe.sharding import TENSOR_PARALLEL_RULES
from jaxpe.stickbreaking import stickbreaking_attention
from jaxpe.tables import sinusoidal_table

PE_NAMES = pe_names()

__all__ = [
    "AMSPE", "Attention", "AttentionContext", "AttentionCore", "ModelConfig", "PEConfig", "PE_NAMES",
    "TENSOR_PARALLEL_RULES", "TransformerLM", "alibi_bias", "alibi_slopes", "apply_rope", "cope_attention",
    "cope_positions", "corope_attention", "corope_mileage", "forgetting_attention", "generate", "hf_rope_options",
    "init_cache", "pe_config", "pe_names", "register", "rope_frequencies", "sinusoidal_table",
    "stickbreaking_attention",
]
