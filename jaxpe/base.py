"""What every encoding, layer and kernel shares, below all of them (it imports nothing of jaxpe): the dtype the XLA
paths compute in, the rotary frequencies, the gate logits' precision, and the input checks of the public entry
points, one set for every layer (the kernels call them, jaxpe re-exports them from `jaxpe.validation`). Each check
raises ValueError (TypeError for a dtype) with a message that names the argument and its value.

B batch, L length, Hq query heads, Hkv key/value heads, D head dim, npos table rows.
"""
from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def compute_dtype(*arrays: jax.Array) -> jnp.dtype:
    """The dtype the XLA paths (reference and blockwise) keep softmax statistics, CoPE's gates and positions and
    rotary angles in, for floating inputs `arrays`: float64 where one is float64 (x64 mode), else float32 (bfloat16
    and float16 inputs included). The Pallas and Triton kernels compute in float32 whatever the inputs. Promoted
    under jax's standard rules, whatever a user's jax.numpy_dtype_promotion (its "strict" refuses bfloat16 with
    float32)."""
    with jax.numpy_dtype_promotion("standard"):
        return jnp.promote_types(jnp.float32, jnp.result_type(*arrays))


def bidirectional_refusal(impl: str) -> ValueError:
    """The error of a fused path (impl "pallas" or "triton") asked for bidirectional attention."""
    return ValueError(f"causal=False is not supported by impl={impl!r} (the fused kernels are causal); "
                      f"impl='blockwise' and impl='reference' are bidirectional with causal=False")


def rotary_frequencies(head_dim: int, theta: float | jax.Array, pairs: jax.Array | None = None,
                       dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """ω_d = θ^(−2d/D) in `dtype` for the rotary pairs d (default: all of 0 .. D/2 − 1, shape [D/2])."""
    if pairs is None:
        pairs = jnp.arange(head_dim // 2, dtype=dtype)
    return jnp.asarray(theta, dtype) ** (-2.0 * pairs.astype(dtype) / head_dim)


# The precision of gate logits q·k in the XLA paths (reference and blockwise): float32-accurate. On recent GPUs XLA
# multiplies float32 in TF32 by default, and a TF32 error in one gate moves every position counted past it; CoPE's
# interpolation has kinks at integer positions, so a moved position can flip a whole row's gate gradient. The same
# as the default on CPU.
GATE_PRECISION = lax.Precision.HIGHEST


def check_float(name: str, x: jax.Array) -> None:
    """Raise TypeError unless `x` is a floating-point array."""
    dtype = jnp.asarray(x).dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got {name}.dtype={dtype}")


def check_wide_float(name: str, x: jax.Array) -> None:
    """Raise TypeError unless `x` is a floating-point array of 16 bits or more: jax promotes 8-bit floats
    (float8_e4m3fn, ...) to nothing implicitly, so they cannot meet the float32 statistics of the attention maths."""
    check_float(name, x)
    if jnp.dtype(x.dtype).itemsize < 2:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {name}.dtype={x.dtype} (8-bit "
                        f"floats have no implicit promotion in jax: cast them, e.g. {name}.astype(jnp.bfloat16))")


def check_rank(name: str, x: jax.Array, rank: int, dims: str) -> None:
    """Raise TypeError unless `x` is an array, ValueError unless it has `rank` axes (`dims` names them, e.g.
    "B L H D")."""
    check_array(name, x, dims)
    if x.ndim != rank:
        raise ValueError(f"{name} must have shape [{dims}], got {name}.shape={tuple(x.shape)}")


def check_positive(name: str, value: float) -> None:
    """Raise ValueError unless `value` is a real number > 0 and finite: a Python or NumPy number or a concrete 0-d real
    array, not a bool, a string or None (a static setting such as theta; a traced value is refused by name)."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not real and getattr(value, "ndim", None) == 0 and (jnp.issubdtype(value.dtype, jnp.floating)
                                                           or jnp.issubdtype(value.dtype, jnp.integer)):
        try:
            value, real = float(value), True
        except jax.errors.ConcretizationTypeError:
            raise ValueError(f"{name} must be a concrete number (a static setting), got a traced value") from None
    if not real or not 0 < value < float("inf"):
        raise ValueError(f"{name}={value!r} must be > 0 and finite")


def is_int(value: object, minimum: int) -> bool:
    """An int (NumPy's too, not a bool) >= minimum: a size or a count given as a static setting."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def check_positive_int(name: str, value: int) -> None:
    """Raise ValueError unless `value` is an int >= 1 (NumPy's too), not a bool (a block size of the blockwise
    paths)."""
    if not is_int(value, 1):
        raise ValueError(f"{name}={value!r} must be a positive int")


def check_npos(npos: int, name: str = "npos") -> None:
    """A position table needs at least two rows: an int (NumPy's too, not a bool) >= 2."""
    if not is_int(npos, 2):
        raise ValueError(f"{name}={npos!r} must be an int >= 2")


def check_even_head_dim(d: int) -> None:
    """Rotary encodings pair dimension d with d + D/2."""
    if d % 2 or d < 2:
        raise ValueError(f"head dim D={d} must be even and >= 2 for rotary encodings")


def computed_dtype(x: jax.Array | np.ndarray) -> np.dtype:
    """The dtype jax computes `x` in: a NumPy float64 array is float32 without jax_enable_x64."""
    return jax.dtypes.canonicalize_dtype(x.dtype)


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[int, int]:
    """Validate q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D]; return (Hkv, G = Hq // Hkv)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_rank(name, x, 4, "B L H D")
        check_wide_float(name, x)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k.shape={k.shape}, v.shape={v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must share batch and head dim, got q.shape={q.shape}, k.shape={k.shape}")
    if not (computed_dtype(q) == computed_dtype(k) == computed_dtype(v)):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype=}, {k.dtype=}, {v.dtype=}")
    hq, hkv = q.shape[2], k.shape[2]
    if hq < 1 or hkv < 1 or q.shape[3] < 1:
        raise ValueError(f"heads and head dim must be >= 1, got Hq={hq}, Hkv={hkv}, D={q.shape[3]}")
    if hq % hkv:
        raise ValueError(f"query heads must be a multiple of key/value heads, got Hq={hq}, Hkv={hkv}")
    return hkv, hq // hkv


def check_same_length(q: jax.Array, k: jax.Array) -> None:
    """Self-attention: Lq == Lk."""
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must have the same length, got Lq={q.shape[1]}, Lk={k.shape[1]}")


def check_pos_emb(pos_emb: jax.Array, num_heads: int, head_dim: int) -> None:
    """pos_emb must be [npos, D] or [Hq, npos, D] with npos >= 2."""
    check_array("pos_emb", pos_emb, "npos D")
    check_float("pos_emb", pos_emb)
    if pos_emb.ndim not in (2, 3) or pos_emb.shape[-1] != head_dim or (
            pos_emb.ndim == 3 and pos_emb.shape[0] != num_heads):
        raise ValueError(f"pos_emb must have shape [npos, D={head_dim}] or [Hq={num_heads}, npos, D={head_dim}], "
                         f"got pos_emb.shape={tuple(pos_emb.shape)}")
    check_npos(pos_emb.shape[-2])


def check_gate_k(gate_k: jax.Array, k: jax.Array) -> None:
    """Separate gate keys have k's shape (ValueError) and dtype (TypeError)."""
    check_array("gate_k", gate_k, "B L Hkv D")
    if gate_k.shape != k.shape:
        raise ValueError(f"gate_k must match k's shape, got gate_k.shape={tuple(gate_k.shape)}, "
                         f"k.shape={tuple(k.shape)}")
    if computed_dtype(gate_k) != computed_dtype(k):
        raise TypeError(f"gate_k must match k's dtype, got gate_k.dtype={gate_k.dtype}, k.dtype={k.dtype}")


def check_cope_inputs(q: jax.Array, k: jax.Array, v: jax.Array, pos_emb: jax.Array,
                      gate_k: jax.Array | None = None, *, sm_scale: float | jax.Array | None = None) -> None:
    """CoPE attention: q [B, L, Hq, D], k/v/gate_k [B, L, Hkv, D], pos_emb [npos, D] or [Hq, npos, D],
    sm_scale as `check_sm_scale` takes it."""
    check_qkv(q, k, v)
    check_same_length(q, k)
    if gate_k is not None:
        check_gate_k(gate_k, k)
    check_pos_emb(pos_emb, q.shape[2], q.shape[3])
    check_sm_scale(sm_scale)


def check_corope_inputs(q: jax.Array, k: jax.Array, v: jax.Array, *, theta: float,
                        sm_scale: float | None = None) -> None:
    """Co-RoPE attention: q [B, L, Hq, D], k/v [B, L, Hkv, D] with D even, theta > 0, sm_scale > 0 (None: the
    default D^−½)."""
    check_qkv(q, k, v)
    check_same_length(q, k)
    check_even_head_dim(q.shape[3])
    check_positive("theta", theta)
    check_sm_scale(sm_scale)


def scale_or_default(sm_scale: float | jax.Array | None, head_dim: int) -> float | jax.Array:
    """sm_scale, or where it is None the default of every attention function and kernel: head_dim^−½."""
    return head_dim ** -0.5 if sm_scale is None else sm_scale


def check_sm_scale(sm_scale: float | jax.Array | None) -> None:
    """sm_scale: None (the default D^−½) or a real scalar > 0. A traced scalar (a learned temperature, or one computed
    under jit) is accepted: its value is checked only where it is concrete."""
    if sm_scale is None:
        return
    scalar = (isinstance(sm_scale, numbers.Real) and not isinstance(sm_scale, bool)) or (
        hasattr(sm_scale, "dtype") and hasattr(sm_scale, "ndim") and sm_scale.ndim == 0)
    dtype = jnp.result_type(sm_scale) if scalar else None
    if dtype is None or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"sm_scale must be a real scalar, got sm_scale={sm_scale!r}")
    try:
        value = float(sm_scale)
    except jax.errors.ConcretizationTypeError:
        return
    check_positive("sm_scale", value)


def check_array(name: str, x: object, dims: str) -> None:
    """Raise TypeError unless `x` is an array (jax or NumPy), not a list or a scalar; `dims` names its axes."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype") or not hasattr(x, "ndim"):
        raise TypeError(f"{name} must be a jax or NumPy array [{dims}], got {type(x).__name__}")


def _check_per_token(name: str, x: jax.Array, batch: int, length: int, *, dtype_ok: bool, kind: str) -> None:
    """An array [B, L] with one entry per token: TypeError unless an array whose dtype is of `kind` (dtype_ok),
    ValueError unless its shape is [B, L]."""
    check_array(name, x, "B, L")
    if not dtype_ok(x.dtype):
        raise TypeError(f"{name} must be {kind} [B, L], got {name}.dtype={x.dtype}")
    if x.shape != (batch, length):
        raise ValueError(f"{name} must have shape [B={batch}, L={length}], got {name}.shape={tuple(x.shape)}")


def check_segment_ids(segment_ids: jax.Array | None, batch: int, length: int) -> None:
    """Packed documents: None, or integer ids [B, L]; keys attend only to queries with the same id."""
    if segment_ids is not None:
        _check_per_token("segment_ids", segment_ids, batch, length,
                         dtype_ok=lambda dtype: jnp.issubdtype(dtype, jnp.integer), kind="an integer array")


def check_window(window: int | None) -> None:
    """Sliding window: None (the whole causal prefix) or an int >= 1, the query itself and window − 1 keys before."""
    if window is not None and not is_int(window, 1):
        static = "; a static setting, not a jax array or a traced value" if isinstance(window, jax.Array) else ""
        raise ValueError(f"window={window!r} must be None or an int >= 1 (the query and the window − 1 keys before "
                         f"it{static})")


def document_ids(segment_ids: jax.Array | np.ndarray) -> jax.Array:
    """Integer document ids [B, L] as int32 ids [B, L] equal where they are equal: ids of 32 bits or fewer cast
    (which keeps different ids different), wider ones (NumPy's default int64, 64-bit hashes) replaced by their rank
    in their row."""
    if jnp.dtype(segment_ids.dtype).itemsize <= 4:
        return jnp.asarray(segment_ids).astype(jnp.int32)
    if isinstance(segment_ids, np.ndarray):  # on the host: without jax_enable_x64 jax would wrap them to 32 bits
        return jnp.asarray(np.unique(segment_ids, return_inverse=True)[1].reshape(segment_ids.shape), jnp.int32)
    return jax.vmap(jnp.searchsorted)(jnp.sort(segment_ids, axis=-1), segment_ids).astype(jnp.int32)


def open_attention(q: jax.Array, *, causal: bool, segment_ids: jax.Array | None, window: int | None
                   ) -> tuple[bool, jax.Array | None, int | None]:
    """The opening every attention entry point shares, after its own checks of q, k, v: causal a bool,
    segment_ids [B, L] integer (or None) and the window. Returns (empty, segment_ids as int32 (`document_ids`),
    window): empty when there is no query (the entry returns jnp.zeros(q.shape, q.dtype), as
    jax.nn.dot_product_attention gives), and the window a Python int, or None where it covers every key at this
    length (a symbolic length, under jax.export, keeps it)."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal={causal!r} must be a bool")
    check_segment_ids(segment_ids, q.shape[0], q.shape[1])
    check_window(window)
    length = q.shape[1]
    if window is not None and isinstance(length, int) and window >= length:
        window = None
    segment_ids = None if segment_ids is None else document_ids(segment_ids)
    return length == 0 or q.shape[0] == 0, segment_ids, None if window is None else int(window)


def check_attention_mask(mask: jax.Array | None, batch: int, lq: int, lk: int) -> None:
    """An explicit attention mask: None, or a bool array [B|1, Lq, Lk], True where the key is visible."""
    if mask is None:
        return
    check_array("mask", mask, "B|1 Lq Lk")
    if mask.dtype != jnp.bool_:
        raise TypeError(f"mask must be a bool array [B|1, Lq, Lk] (True: visible), got mask.dtype={mask.dtype}")
    if mask.ndim != 3 or mask.shape[0] not in (1, batch) or tuple(mask.shape[1:]) != (lq, lk):
        raise ValueError(f"mask must have shape [B|1, Lq={lq}, Lk={lk}] with B={batch}, got mask.shape="
                         f"{tuple(mask.shape)}")


def check_padding_mask(padding_mask: jax.Array | None, batch: int, length: int) -> None:
    """Padding: None, or a bool array [B, L], True on real tokens."""
    if padding_mask is not None:
        _check_per_token("padding_mask", padding_mask, batch, length, dtype_ok=lambda dtype: dtype == jnp.bool_,
                         kind="a bool array (True: a real token)")
