"""Co-RoPE kernels (blockwise and Pallas) against jaxpe's dense reference: outputs and gradients.

One sweep, a covering selection of L ∈ {1, 7, 64, 130, 300}, D ∈ {32, 64, 128}, G ∈ {1, 2, 4}, two block
configurations, float32/bfloat16 and saturated gates (|logit| ≥ 30). The Pallas sweep runs in interpret mode on
CPU and compiled (Triton) on a GPU.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_harness import (TOLERANCE, assert_matches_elementwise, float32_products, gpu_and_interpreted,
                            outputs_and_grads, square_intermediates_of_grad)

import jaxpe
from jaxpe.kernels.corope_pallas import BlockSizes, corope_attention_pallas
from jaxpe.kernels.corope_blockwise import corope_attention_blockwise

THETA = 10000.0
KEY = jax.random.PRNGKey(0)
SMALL_BLOCKS = BlockSizes(block_q=16, block_k=16, block_d=16, block_q_bwd=16, block_k_bwd=16)
RECT_BLOCKS = BlockSizes(block_q=32, block_k=16, block_d=32, block_q_bwd=16, block_k_bwd=32)
WIDE_BLOCKS = BlockSizes(block_q=16, block_k=32, block_d=64, block_q_bwd=32, block_k_bwd=16)


@dataclasses.dataclass(frozen=True)
class Case:
    length: int
    head_dim: int
    kv_heads: int
    groups: int
    dtype: str
    saturated: bool = False

    def __str__(self):
        sat = "-saturated" if self.saturated else ""
        return f"L{self.length}-D{self.head_dim}-Hkv{self.kv_heads}-G{self.groups}-{self.dtype}{sat}"


# (case, Pallas block sizes, blockwise block_k): each value of every axis appears, pairs of axes mostly covered.
SWEEP = [
    (Case(1, 32, 1, 2, "float32"), SMALL_BLOCKS, 16),
    (Case(7, 64, 2, 1, "bfloat16"), BlockSizes(), 4),
    (Case(64, 32, 1, 4, "float32", saturated=True), SMALL_BLOCKS, 16),
    (Case(64, 128, 1, 4, "bfloat16"), WIDE_BLOCKS, 32),
    (Case(130, 128, 1, 1, "float32"), RECT_BLOCKS, 64),
    (Case(130, 32, 2, 2, "bfloat16", saturated=True), RECT_BLOCKS, 16),
    (Case(300, 64, 1, 2, "float32"), BlockSizes(), 128),
    (Case(300, 32, 1, 4, "bfloat16", saturated=True), WIDE_BLOCKS, 64),
]
IDS = [str(case) for case, _, _ in SWEEP]
# The Pallas kernels compile slowly in interpret mode: a 6-case subset that still covers every value of every axis.
PALLAS_SWEEP = [SWEEP[i] for i in (0, 1, 3, 4, 5, 7)]
PALLAS_IDS = [IDS[i] for i in (0, 1, 3, 4, 5, 7)]

NAMES = ["o", "dq", "dk", "dv"]


def make_inputs(case: Case, key: jax.Array) -> tuple[jax.Array, ...]:
    """q [1, L, Hkv·G, D], k/v [1, L, Hkv, D] and an output cotangent.

    Saturated: the leader queries and the keys share one large component (pair D/2 − 1, the slowest frequency)
    of size a with sm_scale·a² = 40, random sign on the keys, so every gate logit is ±40 ± O(1).
    """
    kq, kk, kv, kc, ks = jax.random.split(key, 5)
    hq = case.kv_heads * case.groups
    q = jax.random.normal(kq, (1, case.length, hq, case.head_dim))
    k = jax.random.normal(kk, (1, case.length, case.kv_heads, case.head_dim))
    v = jax.random.normal(kv, (1, case.length, case.kv_heads, case.head_dim))
    if case.saturated:
        big = np.sqrt(40.0 * np.sqrt(case.head_dim))
        sign = jnp.where(jax.random.bernoulli(ks, 0.5, (1, case.length, case.kv_heads)), 1.0, -1.0)
        slot = case.head_dim // 2 - 1
        q = q.at[:, :, :: case.groups, slot].set(big)
        k = k.at[:, :, :, slot].set(big * sign)
    dtype = jnp.dtype(case.dtype)
    cotangent = jax.random.normal(kc, (1, case.length, hq, case.head_dim))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), cotangent


def run(attention, case: Case) -> list[jax.Array]:
    """attention(q, k, v) on `make_inputs(case, KEY)` -> [o, dq, dk, dv]."""
    q, k, v, cotangent = make_inputs(case, KEY)
    return outputs_and_grads(attention, (q, k, v), cotangent)


@float32_products
def reference(q, k, v):
    return jaxpe.corope_attention(q, k, v, theta=THETA, sm_scale=q.shape[-1] ** -0.5, impl="reference")


@functools.lru_cache(maxsize=None)
def reference_results(case: Case) -> list[jax.Array]:
    """The dense reference's [o, dq, dk, dv] on `make_inputs(case, KEY)`, computed once per case."""
    return run(reference, case)


def assert_matches_reference(case: Case, attention, table: dict = TOLERANCE):
    if case.saturated:
        q, k, _, _ = make_inputs(case, KEY)
        leaders = q[:, :, :: case.groups].astype(jnp.float32)
        logits = jnp.einsum("btkd,bskd->bkts", leaders, k.astype(jnp.float32)) * case.head_dim ** -0.5
        assert float(jnp.min(jnp.abs(logits))) >= 30.0
    assert_matches_elementwise(run(attention, case), reference_results(case), names=NAMES, dtype=case.dtype,
                               context=str(case), table=table)


class _PallasSweep:
    """Pallas kernel sweep; INTERPRET chooses the Pallas interpreter (CPU) or the Triton lowering (GPU, where float32
    dots outside the gates may run in TF32: GPU_TOLERANCE)."""

    INTERPRET: bool
    TOLERANCE: dict

    @pytest.mark.parametrize("case, block_sizes, block_k", PALLAS_SWEEP, ids=PALLAS_IDS)
    def test_matches_reference(self, case, block_sizes, block_k):
        del block_k
        attention = lambda q, k, v: corope_attention_pallas(
            q, k, v, theta=THETA, sm_scale=q.shape[-1] ** -0.5, block_sizes=block_sizes, interpret=self.INTERPRET)
        assert_matches_reference(case, attention, self.TOLERANCE)


TestCoRoPEPallas, TestCoRoPEPallasInterpret = gpu_and_interpreted(_PallasSweep, "TestCoRoPEPallas")


class TestCoRoPEBlockwise:
    @pytest.mark.parametrize("case, block_sizes, block_k", SWEEP, ids=IDS)
    def test_matches_reference(self, case, block_sizes, block_k):
        del block_sizes
        attention = lambda q, k, v: corope_attention_blockwise(
            q, k, v, theta=THETA, sm_scale=q.shape[-1] ** -0.5, block_k=block_k)
        assert_matches_reference(case, attention)


@pytest.mark.parametrize("kernel", [
    functools.partial(corope_attention_blockwise, theta=THETA, sm_scale=0.2, block_k=64),
    functools.partial(corope_attention_pallas, theta=THETA, sm_scale=0.2, interpret=True)], ids=["blockwise", "pallas"])
def test_backward_never_builds_length_squared(kernel, key):
    """jax.grad's jaxpr holds no [.., L, .., L, ..] value (L = 512); the dense reference does (the probe works)."""
    length = 512
    q, k, v, _ = make_inputs(Case(length, 32, 1, 2, "float32"), key)
    assert square_intermediates_of_grad(reference, q, k, v, size=length)
    assert square_intermediates_of_grad(kernel, q, k, v, size=length) == []


def test_block_sizes_validated():
    for field, value in (("block_q", 24), ("block_q_bwd", 8), ("block_d", 3)):
        with pytest.raises(ValueError, match=f"{field}={value}"):
            BlockSizes(**{field: value})
    BlockSizes(block_d=1)  # block_d is elementwise only: any power of two


@pytest.mark.parametrize("kernel", ["blockwise", "pallas"])
def test_bad_inputs_raise(kernel):
    attention = {"blockwise": corope_attention_blockwise, "pallas": corope_attention_pallas}[kernel]
    q = jnp.zeros((1, 8, 4, 32))
    kv = jnp.zeros((1, 8, 2, 32))
    with pytest.raises(ValueError, match="head dim D=31 must be even"):
        attention(q[..., :31], kv[..., :31], kv[..., :31], theta=THETA, sm_scale=0.2)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention(q[:, :, :3], kv, kv, theta=THETA, sm_scale=0.2)
    with pytest.raises(ValueError, match="theta=-1.0"):
        attention(q, kv, kv, theta=-1.0, sm_scale=0.2)
