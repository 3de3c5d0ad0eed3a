"""CoPE kernels (blockwise JAX and Pallas) against the dense reference `jaxpe.cope_attention(impl="reference")`.

One covering sweep (not the Cartesian product): every value of L ∈ {1, 7, 64, 130, 300}, D ∈ {32, 64, 128},
G ∈ {1, 2, 4}, both block sizes, float32/bfloat16, saturated gate logits (|logit| ≥ 30), small and large npos,
shared and per-head tables, gates from k and from a separate gate_k, each appear, and most pairs of them.
Outputs and the gradients of sum(o · cotangent) w.r.t. q, k, v, pos_emb (and gate_k) are compared.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
import numpy as np
import pytest

import jaxpe
from jaxpe.kernels.cope_attention import BlockSizes, cope_attention_pallas
from jaxpe.kernels.cope_blockwise import cope_attention_blockwise


class Case(NamedTuple):
    length: int
    head_dim: int
    groups: int  # G = Hq // Hkv
    npos: int
    small_blocks: bool
    dtype: str
    saturated: bool  # every gate logit pushed to ±40
    per_head: bool  # pos_emb [Hq, npos, D]
    gate_k: bool  # gates from a separate gate_k


CASES = [
    Case(1, 32, 1, 2, True, "float32", False, False, False),
    Case(7, 64, 2, 4, False, "bfloat16", True, False, True),
    Case(64, 128, 4, 8, True, "float32", False, False, True),
    Case(130, 32, 4, 64, False, "bfloat16", False, True, False),
    Case(300, 64, 1, 16, True, "float32", True, True, False),
    Case(130, 128, 2, 5, True, "float32", True, False, True),
    Case(300, 32, 2, 320, False, "float32", False, False, True),
    Case(64, 64, 1, 3, False, "bfloat16", False, True, True),
]
BATCH, KV_HEADS = 2, 1
# max |error| ≤ tol · max(1, max |reference|), per input dtype.
TOLERANCE = {"float32": 2e-4, "bfloat16": 3e-2}
# Triton rounds float32 matmul inputs to tf32 by default.
GPU_TOLERANCE = {"float32": 1e-2, "bfloat16": 3e-2}


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


def outputs_and_grads(attention, case: Case) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """attention(q, k, v, pos_emb, gate_k) -> its output and the gradients of sum(o · cotangent)."""
    q, k, v, pos_emb, gate_k, cotangent = make_inputs(case)
    args = (q, k, v, pos_emb) + (() if gate_k is None else (gate_k,))

    @jax.jit
    def run(*args):
        out, vjp = jax.vjp(lambda *a: attention(*a[:4], a[4] if len(a) > 4 else None), *args)
        return out, vjp(cotangent.astype(out.dtype))

    return run(*args)


@functools.lru_cache(maxsize=None)
def reference(case: Case) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    sm_scale = case.head_dim ** -0.5
    return outputs_and_grads(
        lambda q, k, v, e, gk: jaxpe.cope_attention(q, k, v, e, sm_scale=sm_scale, gate_k=gk, impl="reference"),
        case)


def assert_matches(case: Case, got, want, tolerance: dict[str, float]) -> None:
    tol = tolerance[case.dtype]
    names = ["out", "dq", "dk", "dv", "dpos_emb", "dgate_k"]
    flat_got = [got[0], *got[1]]
    flat_want = [want[0], *want[1]]
    assert len(flat_got) == len(flat_want)
    for name, x, y in zip(names, flat_got, flat_want):
        chex.assert_shape(x, y.shape)
        assert x.dtype == y.dtype, (name, x.dtype, y.dtype)
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert np.all(np.isfinite(x)), name
        scale = max(1.0, float(np.max(np.abs(y))))
        err = float(np.max(np.abs(x - y)))
        assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol} · {scale:.3g} for {case}"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_blockwise_matches_reference(case: Case):
    block_k, block_q = (16, 32) if case.small_blocks else (128, 512)
    sm_scale = case.head_dim ** -0.5
    got = outputs_and_grads(
        lambda q, k, v, e, gk: cope_attention_blockwise(q, k, v, e, gk, sm_scale=sm_scale, block_k=block_k,
                                                        block_q=block_q), case)
    assert_matches(case, got, reference(case), TOLERANCE)


class _PallasSweep:
    """The kernel sweep; INTERPRET selects the Pallas interpreter (CPU CI) or the Triton lowering (GPU).

    Two siblings rather than a subclass of the GPU class: pytest collects marks along the MRO, so a subclass of
    a `gpu`-marked class would be skipped on CPU too."""

    INTERPRET: bool
    TOLERANCE: dict[str, float]

    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_matches_reference(self, case: Case):
        blocks = BlockSizes(16, 16, 32, 16) if case.small_blocks else BlockSizes(64, 32, 64, 32)
        sm_scale = case.head_dim ** -0.5
        got = outputs_and_grads(
            lambda q, k, v, e, gk: cope_attention_pallas(q, k, v, e, gk, sm_scale=sm_scale, block_sizes=blocks,
                                                         interpret=self.INTERPRET), case)
        assert_matches(case, got, reference(case), self.TOLERANCE)


@pytest.mark.gpu
class TestCopePallas(_PallasSweep):
    INTERPRET = False
    TOLERANCE = GPU_TOLERANCE


class TestCopePallasInterpret(_PallasSweep):
    INTERPRET = True
    TOLERANCE = TOLERANCE


def _avals(jaxpr: jex_core.Jaxpr):
    """Every intermediate aval in a jaxpr and its sub-jaxprs (scan/while/cond bodies, custom VJPs, kernels)."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield var.aval
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jex_core.ClosedJaxpr):
                    yield from _avals(sub.jaxpr)
                elif isinstance(sub, jex_core.Jaxpr):
                    yield from _avals(sub)


def _has_square(fn, *args, length: int) -> bool:
    """Whether jax.grad(fn) builds any array with two axes of size >= length."""
    jaxpr = jax.make_jaxpr(jax.grad(fn, argnums=(0, 1, 2, 3)))(*args).jaxpr
    return any(sum(n >= length for n in getattr(a, "shape", ())) >= 2 for a in _avals(jaxpr))


@pytest.mark.parametrize("impl", ["blockwise", "pallas"])
def test_backward_never_builds_a_length_squared_array(impl: str):
    length, d = 1000, 32
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    q, k, v = (jax.random.normal(kk, (1, length, 2, d)) for kk in keys[:3])
    pos_emb = jax.random.normal(keys[3], (16, d))
    kernel = {
        "blockwise": functools.partial(cope_attention_blockwise, sm_scale=0.2, block_k=64, block_q=128),
        "pallas": functools.partial(cope_attention_pallas, sm_scale=0.2, interpret=True),
    }[impl]
    reference_fn = functools.partial(jaxpe.cope_attention, sm_scale=0.2, impl="reference")
    assert _has_square(lambda *a: jnp.sum(reference_fn(*a)), q, k, v, pos_emb, length=length)  # the check can fail
    assert not _has_square(lambda *a: jnp.sum(kernel(*a)), q, k, v, pos_emb, length=length)


def test_rejects_bad_inputs():
    q = jnp.zeros((1, 8, 2, 32))
    k = jnp.zeros((1, 8, 1, 32))
    with pytest.raises(ValueError, match="npos"):
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
    with pytest.raises(ValueError, match="block_q=24"):
        BlockSizes(block_q=24)
    with pytest.raises(ValueError, match="block_k=8"):
        BlockSizes(block_k=8)
