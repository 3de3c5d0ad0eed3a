"""kernels._common.sincos, the polynomial sin/cos of the Co-RoPE kernels, against numpy float64."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.kernels._common import SINCOS_MAX_ARG, sincos

TOLERANCE = 1e-6  # max |error| the kernels may add per angle


def errors(x: np.ndarray) -> tuple[float, float]:
    """Max |sincos − (sin, cos)| with the float32 inputs taken exactly (float64 numpy as the truth)."""
    s, c = jax.jit(sincos)(jnp.asarray(x, jnp.float32))
    exact = np.asarray(x, np.float32).astype(np.float64)
    return (float(np.max(np.abs(np.asarray(s, np.float64) - np.sin(exact)))),
            float(np.max(np.abs(np.asarray(c, np.float64) - np.cos(exact)))))


def test_dense_sweep_of_the_angles_that_occur():
    # Co-RoPE's angles are Δ·ω with 0 ≤ Δ ≤ L and ω ≤ 1; negative ones too, for good measure.
    x = np.linspace(-SINCOS_MAX_ARG, SINCOS_MAX_ARG, 8_000_001, dtype=np.float32)
    assert max(errors(x)) <= TOLERANCE


def test_small_angles_and_every_float_near_quadrant_boundaries():
    small = np.geomspace(1e-30, 1.0, 100_000, dtype=np.float32)
    x = [small, -small, np.float32([0.0, -0.0])]
    for k in list(range(-64, 65)) + [1000, 4095, 10430, 20861, -20861]:  # k·π/4 near the reduction's switches
        centre = np.float32(k * np.pi / 4)
        x.append(centre + np.arange(-2000, 2001, dtype=np.float32) * np.spacing(np.abs(centre) + np.float32(1.0)))
    assert max(errors(np.concatenate(x))) <= TOLERANCE


@pytest.mark.parametrize("scale", [1.0, 2048.0, 16384.0, SINCOS_MAX_ARG])
def test_random_angles(scale):
    x = np.random.default_rng(0).uniform(-scale, scale, 1_000_000).astype(np.float32)
    assert max(errors(x)) <= TOLERANCE


def test_shapes_dtypes_and_identity():
    x = jnp.linspace(-100.0, 100.0, 24).reshape(2, 3, 4)
    s, c = sincos(x)
    assert s.shape == c.shape == (2, 3, 4) and s.dtype == c.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(s) ** 2 + np.asarray(c) ** 2, 1.0, atol=1e-6)
    s0, c0 = sincos(jnp.zeros(()))
    assert float(s0) == 0.0 and float(c0) == 1.0


def test_derivatives_are_cos_and_minus_sin():
    x = jnp.linspace(-3000.0, 3000.0, 1001)
    d_sin = jax.vmap(jax.grad(lambda t: sincos(t)[0]))(x)
    d_cos = jax.vmap(jax.grad(lambda t: sincos(t)[1]))(x)
    exact = np.asarray(x, np.float64)
    np.testing.assert_allclose(np.asarray(d_sin), np.cos(exact), atol=TOLERANCE)
    np.testing.assert_allclose(np.asarray(d_cos), -np.sin(exact), atol=TOLERANCE)
