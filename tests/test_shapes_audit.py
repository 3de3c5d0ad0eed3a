"""The public attention entry points at shapes and arguments the rest of the suite does not use: GQA groups of 3,
as many key/value heads as query heads, lengths 1 to 17, head dims that are not powers of two, 16-bit dtypes, batch
1 and 3, NumPy flags and NumPy float64 inputs, under jit, vmap and grad, through every impl that runs on CPU.
Values and directional derivatives against the float64 NumPy restatements (tests/numpy_reference.py) and their
central differences."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
import numpy_reference as ref

OPS = ("cope", "corope", "fox", "stickbreaking")


def _triton_interprets() -> bool:
    """Whether impl="triton" runs here in Triton's interpreter (triton installed, TRITON_INTERPRET=1)."""
    from jaxpe.kernels._triton_launch import unavailable  # loads Triton: only the tests that run it ask

    return unavailable() is None and jax.default_backend() == "cpu"


def _inputs(op: str, batch: int, length: int, hq: int, hkv: int, dim: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Float64 q [B, L, Hq, D], k and v [B, L, Hkv, D], and CoPE's table [L + 2, D] (no clamping) or FoX's log forget
    gates [B, L, Hq] (in [−0.5, −0.01])."""
    rng = np.random.default_rng(seed)
    arrays = dict(q=rng.standard_normal((batch, length, hq, dim)), k=rng.standard_normal((batch, length, hkv, dim)),
                  v=rng.standard_normal((batch, length, hkv, dim)))
    if op == "cope":
        arrays["extra"] = 0.5 * rng.standard_normal((length + 2, dim))
    if op == "fox":
        arrays["extra"] = -rng.uniform(0.01, 0.5, (batch, length, hq))
    return arrays


def _rounded(arrays: dict[str, np.ndarray], dtype: jnp.dtype) -> dict[str, np.ndarray]:
    """The arrays rounded to `dtype` and back to float64: the inputs both sides of a comparison compute from."""
    return {name: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64) for name, x in arrays.items()}


def _jaxpe(op: str, impl: str, **options: object) -> Callable[..., jax.Array]:
    """op's public function of (q, k, v, extra) with `options`."""
    def attend(q: jax.Array, k: jax.Array, v: jax.Array, extra: jax.Array | None) -> jax.Array:
        if op == "cope":
            return jaxpe.cope_attention(q, k, v, extra, impl=impl, **options)
        if op == "corope":
            return jaxpe.corope_attention(q, k, v, impl=impl, **options)
        if op == "fox":
            return jaxpe.forgetting_attention(q, k, v, extra, impl=impl, **options)
        return jaxpe.stickbreaking_attention(q, k, v, impl=impl, **options)
    return attend


def _numpy(op: str, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """op's causal attention by the NumPy restatement, float64 [B, L, Hq, D]."""
    q, k, v, extra = arrays["q"], arrays["k"], arrays["v"], arrays.get("extra")
    if op == "cope":
        return ref.cope_attention(q, k, v, extra)
    if op == "corope":
        return ref.corope_attention(q, k, v)
    if op == "fox":
        return ref.forgetting_attention(q, k, v, extra)
    return ref.stickbreaking_attention(q, k, v)[0]


# (op, impl, B, L, Hq, Hkv, D, dtype): a sample of the product, every class of each axis at least once per op.
SWEEP = [
    ("cope", "reference", 3, 3, 3, 1, 160, "float32"),
    ("cope", "blockwise", 1, 17, 5, 5, 24, "float16"),
    ("cope", "pallas", 1, 17, 6, 2, 80, "bfloat16"),
    ("cope", "triton", 1, 2, 6, 2, 8, "float32"),
    ("cope", "triton", 1, 1, 1, 1, 112, "float16"),
    ("corope", "reference", 1, 17, 12, 4, 24, "bfloat16"),
    ("corope", "blockwise", 3, 3, 6, 2, 48, "float32"),
    ("corope", "pallas", 1, 17, 3, 1, 112, "float32"),
    ("corope", "triton", 1, 3, 5, 5, 8, "float16"),
    ("fox", "reference", 1, 17, 5, 5, 160, "float16"),
    ("fox", "blockwise", 3, 2, 12, 4, 112, "bfloat16"),
    ("fox", "pallas", 1, 17, 3, 1, 8, "float32"),
    ("fox", "pallas", 3, 3, 1, 1, 96, "float16"),
    ("stickbreaking", "reference", 3, 2, 6, 2, 8, "bfloat16"),
    ("stickbreaking", "blockwise", 1, 17, 1, 1, 80, "float32"),
    ("stickbreaking", "pallas", 1, 17, 12, 4, 48, "float16"),
    ("stickbreaking", "triton", 1, 17, 3, 1, 24, "bfloat16"),
    ("stickbreaking", "triton", 3, 3, 5, 5, 8, "float32"),
]


@pytest.mark.parametrize("op, impl, batch, length, hq, hkv, dim, dtype", SWEEP,
                         ids=["-".join(map(str, case)) for case in SWEEP])
def test_values_and_gradients_at_unused_shapes(op, impl, batch, length, hq, hkv, dim, dtype):
    """jit(vmap over the batch) of each impl == the NumPy restatement; the derivative of Σ out·c along a random
    direction of (q, k, v) == the restatement's central difference. 16-bit: the inputs rounded on both sides, and the
    derivative, a sum of terms that cancel (each of q, k and v contributes ~10x the total) rounded to 16 bits each,
    within 2 % of the terms' size."""
    if impl == "triton" and not _triton_interprets():
        pytest.skip("impl='triton' needs triton and jax-triton in Triton's interpreter")
    dtype = jnp.dtype(dtype)
    wide = dtype == jnp.float32
    arrays = _rounded(_inputs(op, batch, length, hq, hkv, dim), dtype)
    rng = np.random.default_rng(1)
    cot = rng.standard_normal((batch, length, hq, dim))
    direction = {name: rng.standard_normal(arrays[name].shape) for name in ("q", "k", "v")}
    attend = _jaxpe(op, impl)
    fox = op == "fox"  # FoX's gates are per token, vmapped with q; CoPE's table is shared
    batched = jax.jit(jax.vmap(lambda q, k, v, e: attend(q[None], k[None], v[None], e[None] if fox else e)[0],
                               in_axes=(0, 0, 0, 0 if fox else None)))
    args = [jnp.asarray(arrays[name], dtype) for name in ("q", "k", "v")]
    extra = None if "extra" not in arrays else jnp.asarray(arrays["extra"], dtype)
    got = batched(*args, extra)
    assert got.dtype == dtype and got.shape == (batch, length, hq, dim)
    np.testing.assert_allclose(np.asarray(got, np.float64), _numpy(op, arrays), atol=2e-4 if wide else 3e-2)

    loss = lambda q, k, v: jnp.sum(attend(q, k, v, extra).astype(jnp.float32) * cot)  # noqa: E731
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    slopes = [float(np.sum(np.asarray(g, np.float64) * direction[name])) for g, name in zip(grads, "qkv")]
    eps = 1e-5
    shifted = [np.sum(_numpy(op, {**arrays, **{n: arrays[n] + s * eps * direction[n] for n in "qkv"}}) * cot)
               for s in (1.0, -1.0)]
    want = (shifted[0] - shifted[1]) / (2 * eps)
    scale = abs(want) + 1.0 if wide else 1.0 + sum(abs(slope) for slope in slopes)
    assert abs(sum(slopes) - want) <= (1e-3 if wide else 2e-2) * scale, (slopes, want)


@pytest.mark.parametrize("op", OPS)
def test_a_numpy_bool_flag_is_that_bool(op):
    """causal=np.bool_(True) (and stick-breaking's attend_current and return_remainder) computes what True does, as a
    size may be a NumPy integer; they were refused ("causal=np.True_ must be a bool")."""
    arrays = _inputs(op, 1, 5, 2, 1, 8)
    args = [jnp.asarray(arrays[name], jnp.float32) for name in ("q", "k", "v")]
    extra = None if "extra" not in arrays else jnp.asarray(arrays["extra"], jnp.float32)
    if op == "stickbreaking":
        out, remainder = _jaxpe(op, "reference", attend_current=np.bool_(False), return_remainder=np.bool_(True))(
            *args, extra)
        want, want_remainder = ref.stickbreaking_attention(arrays["q"], arrays["k"], arrays["v"])
        np.testing.assert_allclose(remainder, want_remainder, atol=1e-5)
    else:
        out, want = _jaxpe(op, "reference", causal=np.bool_(True))(*args, extra), _numpy(op, arrays)
    np.testing.assert_allclose(out, want, atol=1e-5)


def test_the_position_functions_take_a_numpy_bool():
    """cope_positions and corope_mileage with causal=np.bool_(True): the restatements' positions and mileage."""
    arrays = _inputs("corope", 1, 5, 2, 1, 8)
    q, k = (jnp.asarray(arrays[name], jnp.float32) for name in ("q", "k"))
    np.testing.assert_allclose(jaxpe.cope_positions(q, k, npos=4, causal=np.bool_(True)),
                               ref.cope_positions(arrays["q"], arrays["k"], npos=4), atol=1e-5)
    np.testing.assert_allclose(jaxpe.corope_mileage(q, k, causal=np.bool_(True)),
                               ref.corope_mileage(arrays["q"], arrays["k"]), atol=1e-5)


@pytest.mark.parametrize("op, impl", [("cope", "triton"), ("corope", "pallas"), ("corope", "triton"),
                                      ("fox", "pallas"), ("stickbreaking", "pallas"), ("stickbreaking", "triton")])
def test_numpy_float64_inputs_are_float32_in_the_fused_paths(op, impl):
    """Without jax_enable_x64 a NumPy float64 array is a float32 one to jax: every path computes it in float32, as
    "reference", "blockwise" and CoPE's "pallas" did (these fused paths refused it, "q.dtype=float64 is not
    supported by impl=...")."""
    if impl == "triton" and not _triton_interprets():
        pytest.skip("impl='triton' needs triton and jax-triton in Triton's interpreter")
    assert not jax.config.jax_enable_x64
    arrays = _inputs(op, 1, 5, 3, 1, 8)
    out = _jaxpe(op, impl)(arrays["q"], arrays["k"], arrays["v"], arrays.get("extra"))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, _numpy(op, arrays), atol=1e-5)


@pytest.mark.parametrize("op, impl", [("cope", "pallas"), ("corope", "blockwise"), ("fox", "pallas"),
                                      ("stickbreaking", "reference")])
def test_numpy_float64_keys_beside_float32_queries_are_float32(op, impl):
    """q a float32 jax array, k, v (and CoPE's table, FoX's gates) NumPy float64 arrays (the default of np.random):
    without jax_enable_x64 all are float32 to jax, and attention computes the restatement in float32."""
    assert not jax.config.jax_enable_x64
    arrays = _inputs(op, 1, 5, 3, 1, 8)
    out = _jaxpe(op, impl)(jnp.asarray(arrays["q"], jnp.float32), arrays["k"], arrays["v"], arrays.get("extra"))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, _numpy(op, arrays), atol=1e-5)
