"""The public attention functions at inputs the kernel sweeps do not reach, against NumPy float64 restatements of
the formulas written here (not read from the code under test).

B batch, L length, Hq query heads, Hkv key/value heads (G = Hq // Hkv), D head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
from transformation_harness import float64_values


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def numpy_mileage(q: np.ndarray, k: np.ndarray, *, causal: bool) -> np.ndarray:
    """Co-RoPE's Δ [B, Hkv, L, L] for self-attention: z_it = σ(D^−½·q^leader_i·k_t) with leader g·G of group g;
    Δ_ij = Σ_{t=j+1..i} z_it for j ≤ i, and −Σ_{t=i+1..j} z_it for j > i when bidirectional (0 when causal)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    batch, length, hq, d = q.shape
    hkv = k.shape[2]
    out = np.zeros((batch, hkv, length, length))
    for b, g in np.ndindex(batch, hkv):
        z = _sigmoid(d ** -0.5 * q[b, :, g * (hq // hkv)] @ k[b, :, g].T)  # [L, L]
        for i, j in np.ndindex(length, length):
            if j <= i:
                out[b, g, i, j] = z[i, j + 1:i + 1].sum()
            elif not causal:
                out[b, g, i, j] = -z[i, i + 1:j + 1].sum()
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_corope_mileage_without_a_mask_counts_the_keys_after_the_query_when_bidirectional(causal):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 5, 6, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 5, 3, 8)), jnp.float32)
    got = jaxpe.corope_mileage(q, k, causal=causal)
    np.testing.assert_allclose(np.asarray(got), numpy_mileage(q, k, causal=causal), atol=2e-6)


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_corope_takes_a_numpy_float64_sm_scale_under_x64(impl):
    """`sm_scale=1 / np.sqrt(D)` is a NumPy float64: under x64 it must neither break the float32 maths (it did: a scan
    carry of float32 met float64 mileage) nor turn them float64."""
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        q = jnp.asarray(rng.normal(size=(1, 6, 4, 8)), jnp.float32)
        k = jnp.asarray(rng.normal(size=(1, 6, 2, 8)), jnp.float32)
        sm_scale = 1 / np.sqrt(8.0) / 2
        out = jaxpe.corope_attention(q, k, k, sm_scale=sm_scale, impl=impl)
        mileage = jaxpe.corope_mileage(q, k, sm_scale=sm_scale)
        want = jaxpe.corope_attention(q, k, k, sm_scale=float(sm_scale), impl=impl)
    assert out.dtype == mileage.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-6)


@pytest.mark.parametrize("op", ["cope", "corope", "fox", "stickbreaking"])
def test_a_numpy_float64_sm_scale_keeps_float32_inputs_float32_under_x64(op):
    """float32 inputs compute in float32 under x64 (tests/test_float64.py holds the layers to it); a NumPy float64
    sm_scale (1 / np.sqrt(D)) must not turn the dense paths' maths float64."""
    with jax.enable_x64(True):
        q = jnp.ones((1, 5, 2, 8), jnp.float32)
        sm_scale = 1 / np.sqrt(8.0)
        attend = {"cope": lambda q: jaxpe.cope_attention(q, q, q, jnp.zeros((4, 8), jnp.float32), sm_scale=sm_scale),
                  "corope": lambda q: jaxpe.corope_attention(q, q, q, sm_scale=sm_scale),
                  "fox": lambda q: jaxpe.forgetting_attention(q, q, q, jnp.zeros((1, 5, 2), jnp.float32),
                                                              sm_scale=sm_scale),
                  "stickbreaking": lambda q: jaxpe.stickbreaking_attention(q, q, q, sm_scale=sm_scale)}[op]
        assert float64_values(jax.grad(lambda q: attend(q).sum()), q) == []


def test_cope_positions_of_float32_inputs_are_float32_with_a_numpy_float64_sm_scale_under_x64():
    with jax.enable_x64(True):
        q = jnp.ones((1, 5, 2, 8), jnp.float32)
        for causal in (True, False):
            assert jaxpe.cope_positions(q, q, npos=4, sm_scale=np.float64(0.3), causal=causal).dtype == jnp.float32


ATTENTIONS = {"cope": lambda q, k, v: jaxpe.cope_attention(q, k, v, jnp.zeros((3, 8), jnp.float32)),
              "corope": lambda q, k, v: jaxpe.corope_attention(q, k, v),
              "fox": lambda q, k, v: jaxpe.forgetting_attention(q, k, v, jnp.zeros((1, 4, 2), jnp.float32)),
              "stickbreaking": lambda q, k, v: jaxpe.stickbreaking_attention(q, k, v),
              "cope_positions": lambda q, k, v: jaxpe.cope_positions(q, k, npos=4),
              "corope_mileage": lambda q, k, v: jaxpe.corope_mileage(q, k)}


@pytest.mark.parametrize("op", ATTENTIONS)
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_8_bit_float_inputs_are_a_type_error_naming_the_argument(op, dtype):
    """8-bit floats have no implicit promotion in jax: the maths' float32 statistics cannot meet them (it was jax's
    TypePromotionError from deep inside, naming no argument, where the fused paths' refusals call every floating dtype
    fine for 'reference' and 'blockwise')."""
    x = jnp.ones((1, 4, 2, 8), dtype)
    with pytest.raises(TypeError, match=f"q.dtype={jnp.dtype(dtype).name}"):
        ATTENTIONS[op](x, x, x)


def test_8_bit_float_forget_gates_are_a_type_error_naming_log_fgate():
    x = jnp.ones((1, 4, 2, 8), jnp.float32)
    with pytest.raises(TypeError, match="log_fgate.dtype=float8_e4m3fn"):
        jaxpe.forgetting_attention(x, x, x, jnp.zeros((1, 4, 2), jnp.float8_e4m3fn))


def test_8_bit_float_rotary_input_is_a_type_error_naming_x():
    with pytest.raises(TypeError, match="x.dtype=float8_e4m3fn"):
        jaxpe.apply_rope(jnp.ones((1, 4, 2, 8), jnp.float8_e4m3fn), jnp.arange(4))


@pytest.mark.parametrize("positions", [
    lambda q, k, **kw: jaxpe.cope_positions(q, k, npos=8, **kw),
    lambda q, k, **kw: jaxpe.corope_mileage(q, k, **kw),
], ids=["cope_positions", "corope_mileage"])
def test_more_queries_than_keys_need_a_mask(positions):
    """Without a mask the queries are the last Lq of the Lk positions: Lq > Lk has no such reading (the first
    Lq − Lk queries silently saw no key); with a mask it is the caller's layout."""
    q, k = jnp.ones((1, 5, 2, 8)), jnp.ones((1, 3, 2, 8))
    with pytest.raises(ValueError, match=r"Lq=5 > Lk=3"):
        positions(q, k)
    mask = jnp.tril(jnp.ones((1, 5, 3), bool))
    assert positions(q, k, mask=mask).shape[-2:] == (5, 3)
