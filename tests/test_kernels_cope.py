"""CoPE kernels (blockwise JAX and Pallas) against the dense reference `jaxpe.cope_attention(impl="reference")`.

One covering sweep (not the Cartesian product): every value of L ∈ {1, 7, 64, 130, 300}, D ∈ {32, 64, 128},
G ∈ {1, 2, 4}, both block sizes, float32/bfloat16, saturated gate logits (|logit| ≥ 30), small and large npos,
shared and per-head tables, gates from k and from a separate gate_k, each appear, and most pairs of them.
Outputs and the gradients of sum(o · cotangent) w.r.t. q, k, v, pos_emb (and gate_k) are compared.
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
from jaxpe.kernels.cope_pallas import BlockSizes, cope_attention_pallas
from jaxpe.kernels.cope_blockwise import cope_attention_blockwise


@dataclasses.dataclass(frozen=True)
class Case:
    length: int
    head_dim: int
    groups: int  # G = Hq // Hkv
    npos: int
    dtype: str
    small_blocks: bool = False
    saturated: bool = False  # every gate logit pushed to ±40
    per_head: bool = False  # pos_emb [Hq, npos, D]
    gate_k: bool = False  # gates from a separate gate_k

    def __str__(self):
        flags = [name for name in ("small_blocks", "saturated", "per_head", "gate_k") if getattr(self, name)]
        return "-".join([f"L{self.length}-D{self.head_dim}-G{self.groups}-npos{self.npos}-{self.dtype}", *flags])


CASES = [
    Case(length=1, head_dim=32, groups=1, npos=2, dtype="float32", small_blocks=True),
    Case(length=7, head_dim=64, groups=2, npos=4, dtype="bfloat16", saturated=True, gate_k=True),
    Case(length=64, head_dim=128, groups=4, npos=8, dtype="float32", small_blocks=True, gate_k=True),
    Case(length=130, head_dim=32, groups=4, npos=64, dtype="bfloat16", per_head=True),
    Case(length=300, head_dim=64, groups=1, npos=16, dtype="float32", small_blocks=True, saturated=True,
         per_head=True),
    Case(length=130, head_dim=128, groups=2, npos=5, dtype="float32", small_blocks=True, saturated=True,
         gate_k=True),
    Case(length=300, head_dim=32, groups=2, npos=320, dtype="float32", gate_k=True),
    Case(length=64, head_dim=64, groups=1, npos=3, dtype="bfloat16", per_head=True, gate_k=True),
]
BATCH, KV_HEADS = 2, 1
NAMES = ["out", "dq", "dk", "dv", "dpos_emb", "dgate_k"]


def make_inputs(case: Case) -> tuple[jax.Array, ...]:
    """q [B, L, Hq, D], k/v [B, L, Hkv, D], pos_emb, gate_k or None, cotangent [B, L, Hq, D] (float32)."""
    keys = jax.random.split(jax.random.PRNGKey(case.length * 1000 + case.head_dim + case.groups), 6)
    hq, d = KV_HEADS * case.groups, case.head_dim
    q = jax.random.normal(keys[0], (BATCH, case.length, hq, d))
    k = jax.random.normal(keys[1], (BATCH, case.length, KV_HEADS, d))
    v = jax.random.normal(keys[2], (BATCH, case.length, KV_HEADS, d))
    pos_emb = jax.random.normal(keys[3], ((hq,) if case.per_head else ()) + (case.npos, d))
    gate_k = jax.random.normal(keys[4], k.shape) if case.gate_k else None
    if case.saturated:
        # Gate logits sm_scale·q·kg ≈ ±40: feature 0 carries ±a on both sides, the rest is small.
        a = np.sqrt(40.0 * np.sqrt(d))
        signs = jnp.sign(jax.random.normal(keys[5], k.shape[:3]))
        q = q.at[..., 1:].multiply(0.3).at[..., 0].set(a)
        kg = (k if gate_k is None else gate_k).at[..., 1:].multiply(0.3).at[..., 0].set(a * signs)
        k, gate_k = (kg, None) if gate_k is None else (k, kg)
    dtype = jnp.dtype(case.dtype)
    cotangent = jax.random.normal(keys[5], q.shape)
    cast = lambda x: None if x is None else x.astype(dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(pos_emb), cast(gate_k), cotangent


def run(attention, case: Case, **options) -> list[jax.Array]:
    """attention(q, k, v, pos_emb, gate_k) on the case's inputs -> [out, dq, dk, dv, dpos_emb(, dgate_k)]."""
    q, k, v, pos_emb, gate_k, cotangent = make_inputs(case)
    args = (q, k, v, pos_emb) + (() if gate_k is None else (gate_k,))
    return outputs_and_grads(lambda q, k, v, e, gk=None: attention(q, k, v, e, gk), args, cotangent, **options)


@functools.lru_cache(maxsize=None)
def reference(case: Case) -> list[jax.Array]:
    """The dense reference's outputs and gradients, computed once per case. Compiled with XLA's default options:
    at optimisation level 0 (FAST_COMPILE) XLA's CPU backend returns NaN in some of its gradients (jax 0.10, 0.12)."""
    sm_scale = case.head_dim ** -0.5
    return run(float32_products(lambda q, k, v, e, gk: jaxpe.cope_attention(q, k, v, e, sm_scale=sm_scale, gate_k=gk,
                                                                             impl="reference")),
               case, compiler_options=None)


def assert_matches_reference(case: Case, got: list[jax.Array], table: dict = TOLERANCE) -> None:
    want = reference(case)
    assert_matches_elementwise(got, want, names=NAMES[:len(want)], dtype=case.dtype, context=str(case), table=table)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_blockwise_matches_reference(case: Case):
    block_k, block_q = (16, 32) if case.small_blocks else (128, 512)
    sm_scale = case.head_dim ** -0.5
    got = run(lambda q, k, v, e, gk: cope_attention_blockwise(q, k, v, e, gk, sm_scale=sm_scale, block_k=block_k,
                                                               block_q=block_q), case)
    assert_matches_reference(case, got)


class _PallasSweep:
    """The kernel sweep; INTERPRET selects the Pallas interpreter (CPU CI) or the Triton lowering (GPU)."""

    INTERPRET: bool
    TOLERANCE: dict

    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_matches_reference(self, case: Case):
        blocks = BlockSizes(16, 16, 32, 16) if case.small_blocks else BlockSizes(64, 32, 64, 32)
        sm_scale = case.head_dim ** -0.5
        got = run(lambda q, k, v, e, gk: cope_attention_pallas(q, k, v, e, gk, sm_scale=sm_scale, block_sizes=blocks,
                                                                interpret=self.INTERPRET), case)
        assert_matches_reference(case, got, self.TOLERANCE)


TestCopePallas, TestCopePallasInterpret = gpu_and_interpreted(_PallasSweep, "TestCopePallas")


@pytest.mark.parametrize("kernel", [
    functools.partial(cope_attention_blockwise, sm_scale=0.2, block_k=64, block_q=128),
    functools.partial(cope_attention_pallas, sm_scale=0.2, interpret=True)], ids=["blockwise", "pallas"])
def test_backward_never_builds_a_length_squared_array(kernel):
    """jax.grad's jaxpr holds no [.., L, .., L, ..] value (L = 1000); the dense reference does (the probe works)."""
    length, d = 1000, 32
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    q, k, v = (jax.random.normal(kk, (1, length, 2, d)) for kk in keys[:3])
    pos_emb = jax.random.normal(keys[3], (16, d))
    reference_fn = functools.partial(jaxpe.cope_attention, sm_scale=0.2, impl="reference")
    assert square_intermediates_of_grad(reference_fn, q, k, v, pos_emb, size=length)
    assert square_intermediates_of_grad(kernel, q, k, v, pos_emb, size=length) == []


def test_rejects_bad_inputs():
    q = jnp.zeros((1, 8, 2, 32))
    k = jnp.zeros((1, 8, 1, 32))
    with pytest.raises(ValueError, match="npos=1 must be"):
        cope_attention_blockwise(q, k, k, jnp.zeros((1, 32)), sm_scale=0.1)
    with pytest.raises(ValueError, match="pos_emb"):
        cope_attention_pallas(q, k, k, jnp.zeros((4, 16)), sm_scale=0.1)
    with pytest.raises(ValueError, match="gate_k"):
        cope_attention_pallas(q, k, k, jnp.zeros((4, 32)), jnp.zeros((1, 8, 2, 32)), sm_scale=0.1)
    with pytest.raises(ValueError, match="Hq=3, Hkv=2"):
        cope_attention_blockwise(jnp.zeros((1, 8, 3, 32)), jnp.zeros((1, 8, 2, 32)), jnp.zeros((1, 8, 2, 32)),
                                 jnp.zeros((4, 32)), sm_scale=0.1)
    with pytest.raises(TypeError, match="q.dtype"):
        cope_attention_blockwise(q.astype(jnp.int32), k, k, jnp.zeros((4, 32)), sm_scale=0.1)
    with pytest.raises(ValueError, match="sm_scale=0.0 must be > 0"):
        cope_attention_blockwise(q, k, k, jnp.zeros((4, 32)), sm_scale=0.0)
    with pytest.raises(ValueError, match="block_k=0 must be a positive int"):
        cope_attention_blockwise(q, k, k, jnp.zeros((4, 32)), sm_scale=0.1, block_k=0)
    with pytest.raises(ValueError, match="block_q=24"):
        BlockSizes(block_q=24)
    with pytest.raises(ValueError, match="block_k=8"):
        BlockSizes(block_k=8)
