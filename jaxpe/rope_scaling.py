"""RoPE frequencies as Hugging Face models configure them: the `rope_scaling` types of a `config.json`.

R rotary dim (the first R dims of each head rotate, R <= D); the R/2 unscaled frequencies are ω_d = θ^(−2d/R),
d = 0 .. R/2 − 1, and λ_d = 2π/ω_d is a pair's wavelength. A scaling dict names its type under "rope_type" (or the
older "type"; "default" or no dict: unscaled) and changes ω, and for YaRN also the magnitude of cos and sin:

- "linear" (position interpolation): ω_d / factor, the same as positions / factor.
- "dynamic" (dynamic NTK): at the current sequence length s = max position + 1, only when s > L0 =
  original_max_position_embeddings, the base becomes θ·(factor·s/L0 − (factor − 1))^(R/(R − 2)). Stateless: s is
  that of the positions at hand (transformers keeps the largest s seen until a sequence shorter than L0 resets it).
- "yarn": the pairs that turn more than beta_fast (32) times over L0 keep ω_d, those that turn fewer than beta_slow
  (1) times get ω_d / factor, a linear ramp over pair index between (its ends floored/ceiled unless truncate=False);
  cos and sin are multiplied by attention_factor, default 0.1·ln(factor) + 1 (or the ratio of that with `mscale`
  and with `mscale_all_dim` when both are given, as DeepSeek configs do).
- "llama3": λ_d < L0/high_freq_factor keeps ω_d, λ_d > L0/low_freq_factor gets ω_d / factor, in between
  (1 − s)·ω_d/factor + s·ω_d with s = (L0/λ_d − low_freq_factor) / (high_freq_factor − low_freq_factor).

The definitions are those of transformers' `modeling_rope_utils` (`_compute_linear_scaling_rope_parameters`,
`_compute_dynamic_ntk_parameters`, `_compute_yarn_parameters`, `_compute_llama3_parameters`). Where transformers reads
the model's `max_position_embeddings` (dynamic's L0; YaRN's L0 and factor when the dict lacks them), the dict here
must carry `original_max_position_embeddings`: `hf_rope_options` fills it from a whole `config.json`.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.base import rotary_frequencies
from jaxpe.validation import check_float_dtype, check_positive, is_finite_number, is_int

SCALING_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
_REQUIRED = {  # keys each type needs besides its type
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_OPTIONAL = {"yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")}


def rope_scaling_dict(scaling: Mapping | tuple | list | None) -> dict[str, Any] | None:
    """Validate a Hugging Face `rope_scaling` dict (or its (key, value) pairs); return it with its type under
    "rope_type" (no "type") and null entries dropped, or None when it asks for no scaling. ValueError naming the key
    otherwise: unknown type or key, a missing key, a factor below 1, a bad value."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        try:
            scaling = dict(scaling)
        except (TypeError, ValueError):
            raise ValueError(f"scaling={scaling!r} must be a Hugging Face rope_scaling dict, its (key, value) pairs, "
                             f"or None") from None
    # NumPy scalars as the Python numbers they hold: checked as such, and a config holding them stays JSON-serialisable
    entries = {key: value.item() if isinstance(value, np.generic) else value for key, value in scaling.items()
               if value is not None}
    for key in entries:
        if not isinstance(key, str):
            raise ValueError(f"rope_scaling keys must be strings, got {key!r}")
    rope_type, legacy = entries.pop("rope_type", None), entries.pop("type", None)
    if rope_type is not None and legacy is not None and rope_type != legacy:
        raise ValueError(f"rope_scaling gives rope_type={rope_type!r} and type={legacy!r}; give one")
    rope_type = rope_type if rope_type is not None else legacy if legacy is not None else "default"
    if rope_type not in SCALING_TYPES:
        raise ValueError(f"rope_scaling rope_type={rope_type!r} is not supported; choose one of {SCALING_TYPES}")
    required, optional = _REQUIRED[rope_type], _OPTIONAL.get(rope_type, ())
    for key in entries:
        if key not in required + optional:
            raise ValueError(f"unknown key {key!r} in rope_scaling for rope_type={rope_type!r}; "
                             f"valid keys: {sorted(required + optional)}")
    for key in required:
        if key not in entries:
            raise ValueError(f"rope_scaling for rope_type={rope_type!r} needs the key {key!r}")
    if rope_type == "default":
        return None
    factor = entries["factor"]
    if not is_finite_number(factor) or factor < 1:
        raise ValueError(f"rope_scaling factor={factor!r} must be a number >= 1")
    length = entries.get("original_max_position_embeddings")
    if length is not None and not is_int(length, 1):
        raise ValueError(f"rope_scaling original_max_position_embeddings={length!r} must be a positive int")
    for key in ("low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow"):
        if key in entries and (not is_finite_number(entries[key]) or entries[key] <= 0):
            raise ValueError(f"rope_scaling {key}={entries[key]!r} must be a number > 0")
    for key in ("mscale", "mscale_all_dim"):
        if key in entries and (not is_finite_number(entries[key]) or entries[key] < 0):
            raise ValueError(f"rope_scaling {key}={entries[key]!r} must be a number >= 0")
    if "truncate" in entries and not isinstance(entries["truncate"], bool):
        raise ValueError(f"rope_scaling truncate={entries['truncate']!r} must be true or false")
    if rope_type == "llama3" and entries["high_freq_factor"] <= entries["low_freq_factor"]:
        raise ValueError(f"rope_scaling high_freq_factor={entries['high_freq_factor']!r} must be greater than "
                         f"low_freq_factor={entries['low_freq_factor']!r}")
    if rope_type == "yarn" and entries.get("beta_fast", 32) < entries.get("beta_slow", 1):
        raise ValueError(f"rope_scaling beta_fast={entries.get('beta_fast', 32)!r} must be >= "
                         f"beta_slow={entries.get('beta_slow', 1)!r}")
    return {"rope_type": rope_type, **entries}


def check_rotary_dim(rotary_dim: int, head_dim: int | None = None) -> None:
    """Raise ValueError unless rotary_dim is an even int >= 2 (and <= head_dim when given)."""
    if not is_int(rotary_dim, 2) or rotary_dim % 2:
        raise ValueError(f"{rotary_dim=} must be an even int >= 2")
    if head_dim is not None and rotary_dim > head_dim:
        raise ValueError(f"{rotary_dim=} must be <= the head dim D={head_dim}")


def rope_frequencies(rotary_dim: int, *, theta: float = 10000.0, scaling: Mapping | tuple | None = None,
                     length: jax.Array | int | None = None, dtype: Any = jnp.float32) -> tuple[jax.Array, float]:
    """The rotary frequencies ω [rotary_dim/2] in `dtype` (float32, or float64 for float64 inputs) and the factor
    that multiplies cos and sin (1.0 except YaRN).

    `scaling` is a Hugging Face `rope_scaling` dict (see the module docstring). `length` is the current sequence
    length (max position + 1), read only by "dynamic"; it may be traced. None: the original length (unscaled)."""
    check_rotary_dim(rotary_dim)
    check_positive("theta", theta)
    if dtype is None:
        raise TypeError("dtype=None must be a floating-point dtype (e.g. jnp.float32)")
    check_float_dtype("dtype", dtype)  # an integer dtype was ignored (float32 frequencies came back)
    spec = rope_scaling_dict(scaling)
    if spec is None:
        return rotary_frequencies(rotary_dim, theta, dtype=dtype), 1.0
    rope_type, factor = spec["rope_type"], float(spec["factor"])
    if rope_type == "dynamic" and rotary_dim == 2:
        raise ValueError(f"{rotary_dim=} must be > 2 for dynamic NTK scaling (its exponent is R/(R − 2))")
    freqs = rotary_frequencies(rotary_dim, theta, dtype=dtype)  # [R/2]
    if rope_type == "linear":
        return freqs / factor, 1.0
    original = spec["original_max_position_embeddings"]
    if rope_type == "dynamic":
        if length is None:
            return freqs, 1.0
        seq_len = jnp.maximum(jnp.asarray(length, dtype), float(original))  # scaled only past the original
        base = theta * (factor * seq_len / original - (factor - 1.0)) ** (rotary_dim / (rotary_dim - 2))
        return rotary_frequencies(rotary_dim, base, dtype=dtype), 1.0
    if rope_type == "llama3":
        low, high = float(spec["low_freq_factor"]), float(spec["high_freq_factor"])
        wavelength = 2 * math.pi / freqs
        smooth = (original / wavelength - low) / (high - low)  # 0 at λ = L0/low, 1 at λ = L0/high
        medium = (1 - smooth) * freqs / factor + smooth * freqs
        scaled = jnp.where(wavelength > original / low, freqs / factor, freqs)
        return jnp.where((wavelength >= original / high) & (wavelength <= original / low), medium, scaled), 1.0
    # yarn
    beta_fast, beta_slow = spec.get("beta_fast", 32), spec.get("beta_slow", 1)
    turns_to_dim = lambda turns: rotary_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))
    low, high = turns_to_dim(beta_fast), turns_to_dim(beta_slow)  # pair index where a pair turns beta times over L0
    if spec.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rotary_dim // 2) - low) / (high - low), 0.0, 1.0).astype(dtype)  # 1: interpolate
    freqs = freqs / factor * ramp + freqs * (1 - ramp)
    attention_factor = spec.get("attention_factor")
    if attention_factor is None:
        mscale = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
        if spec.get("mscale") and spec.get("mscale_all_dim"):
            attention_factor = mscale(spec["mscale"]) / mscale(spec["mscale_all_dim"])
        else:
            attention_factor = mscale(1.0)
    return freqs, float(attention_factor)


def hf_rope_options(config: Mapping) -> dict[str, Any]:
    """The `RoPEConfig` options (theta, rotary_dim, interleaved, scaling) of a Hugging Face `config.json` dict, so
    that `jaxpe.pe_config("rope", **hf_rope_options(config))` rotates as that model does.

    Reads `rope_theta` (GPT-NeoX: `rotary_emb_base`), `partial_rotary_factor` (GPT-NeoX: `rotary_pct`; GPT-J:
    `rotary_dim`), `head_dim` or hidden_size / num_attention_heads (GPT-J: n_embd / n_head), `rope_scaling` (newer
    files: `rope_parameters`, which may also hold rope_theta and partial_rotary_factor) and
    `max_position_embeddings`. GPT-J and CodeGen rotate interleaved pairs, the others half-split pairs. rotary_dim
    is None when the whole head rotates; the jaxpe model's head dim (d_model / num_heads) should be the config's."""
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a dict read from a Hugging Face config.json, got {type(config).__name__}")
    rope = config.get("rope_parameters")
    if rope is None:
        rope = config.get("rope_scaling") or {}
    rope = dict(rope)
    if any(isinstance(value, Mapping) for value in rope.values()):
        raise ValueError("rope parameters per layer type (a dict of dicts) are not supported; pass one of them")
    theta = _first(rope.pop("rope_theta", None), config.get("rope_theta"), config.get("rotary_emb_base"), 10000.0)
    partial = _first(rope.pop("partial_rotary_factor", None), config.get("partial_rotary_factor"),
                     config.get("rotary_pct"), 1.0)
    head_dim = config.get("head_dim")
    if head_dim is None:
        hidden = _first(config.get("hidden_size"), config.get("n_embd"), None)  # GPT-J and CodeGen: n_embd, n_head
        heads = _first(config.get("num_attention_heads"), config.get("n_head"), None)
        if not (is_int(hidden, 0) and is_int(heads, 1)):
            raise ValueError(f"config needs head_dim, or hidden_size and num_attention_heads; got {hidden=}, {heads=}")
        head_dim = int(hidden) // int(heads)
    rotary_dim = config.get("rotary_dim") or int(head_dim * partial)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    max_positions = config.get("max_position_embeddings")
    if rope_type == "dynamic" and max_positions is not None:
        rope["original_max_position_embeddings"] = max_positions  # transformers reads the model's length here
    if rope_type == "yarn":
        if rope.get("original_max_position_embeddings") is None and max_positions is not None:
            rope["original_max_position_embeddings"] = max_positions
        if rope.get("factor") is None and max_positions is not None and rope.get("original_max_position_embeddings"):
            rope["factor"] = max_positions / rope["original_max_position_embeddings"]
    scaling = rope_scaling_dict(rope)
    check_positive("rope_theta", theta)
    check_rotary_dim(rotary_dim, head_dim)
    return {"theta": float(theta), "rotary_dim": None if rotary_dim == head_dim else rotary_dim,
            "interleaved": config.get("model_type") in ("gptj", "codegen"), "scaling": scaling}


def _first(*values: Any) -> Any:
    """The first value that is not None (None if all are)."""
    return next((value for value in values if value is not None), None)
