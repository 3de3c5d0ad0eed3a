"""The lean Co-RoPE Pallas kernels: any chunk width of rotary pairs, head dims that are no multiple of it,
odd lengths, large groups, the kernels' sincos, and O(L) memory (no array of L²/32 elements or more in the
forward and backward at L = 4096). Interpret mode, against the dense reference and NumPy."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_harness import assert_matches_elementwise, equations, outputs_and_grads

import jaxpe
from jaxpe.kernels import corope_pallas as kernel
from jaxpe.kernels.corope_pallas import BlockSizes, corope_attention_pallas

THETA = 10000.0
SMALL = dict(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)


def inputs(length: int, head_dim: int, q_heads: int, kv_heads: int, seed: int = 0) -> tuple[jax.Array, ...]:
    """q [2, L, N, D], k/v [2, L, K, D] and an output cotangent, float32."""
    kq, kk, kv, kc = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (jax.random.normal(kq, (2, length, q_heads, head_dim)),
            jax.random.normal(kk, (2, length, kv_heads, head_dim)),
            jax.random.normal(kv, (2, length, kv_heads, head_dim)),
            jax.random.normal(kc, (2, length, q_heads, head_dim)))


def check(length: int, head_dim: int, q_heads: int, kv_heads: int, blocks: BlockSizes) -> None:
    q, k, v, cotangent = inputs(length, head_dim, q_heads, kv_heads)
    sm_scale = head_dim ** -0.5
    want = outputs_and_grads(lambda *a: jaxpe.corope_attention(*a, theta=THETA, sm_scale=sm_scale, impl="reference"),
                             (q, k, v), cotangent)
    got = outputs_and_grads(lambda *a: corope_attention_pallas(*a, theta=THETA, sm_scale=sm_scale, block_sizes=blocks,
                                                               interpret=True), (q, k, v), cotangent)
    assert_matches_elementwise(got, want, names=["o", "dq", "dk", "dv"], dtype="float32",
                               context=f"L{length} D{head_dim} Hq{q_heads} Hkv{kv_heads} {blocks}")


@pytest.mark.parametrize("length, head_dim, block_d", [
    (33, 18, 4),  # 9 pairs: the last chunk of 4 half padding
    (33, 18, 8),
    (77, 6, 1),  # one pair per chunk
    (17, 10, 2),
    (50, 64, 16),  # wide chunks still work
])
def test_chunk_widths_and_odd_lengths(length, head_dim, block_d):
    check(length, head_dim, 4, 2, BlockSizes(block_d=block_d, **SMALL))


@pytest.mark.parametrize("q_heads, kv_heads", [(8, 1), (6, 2)])
def test_large_and_uneven_groups(q_heads, kv_heads):
    """MQA (G = 8: eight programs add to one dk, dv and the leader's dq) and G = 3."""
    check(40, 16, q_heads, kv_heads, BlockSizes(**SMALL))


def test_default_blocks_rectangular_tiles():
    """The defaults (D 32 f32, G 2: forward 16×32 tiles of 2 heads, backward 16×32) on a length no block divides."""
    check(70, 32, 2, 1, BlockSizes())


def test_default_block_sizes():
    """Up to 4 heads per forward program (a divisor of G), 16 rows; 32 rows for one head while a q row is ≤ 512
    bytes; the backward 16 × 32 tiles, 2 heads; chunks of 4 pairs; 8 warps."""
    fwd = lambda d, t, g: (BlockSizes.default(d, t, groups=g).block_h, BlockSizes.default(d, t, groups=g).block_q)
    assert [fwd(64, jnp.float32, g) for g in (1, 2, 3, 4, 5, 6, 8)] == [(1, 32), (2, 16), (3, 16), (4, 16), (1, 32),
                                                                        (3, 16), (4, 16)]
    assert fwd(256, jnp.float32, 1) == (1, 16) and fwd(256, jnp.bfloat16, 1) == (1, 32)
    blocks = BlockSizes.default(128, jnp.float32, groups=4)
    assert (blocks.block_k, blocks.block_d, blocks.block_q_bwd, blocks.block_k_bwd, blocks.block_h_bwd) == (32, 4, 16,
                                                                                                          32, 2)
    assert kernel.default_num_warps(128) == 8
    fitted = BlockSizes(block_h=4, block_h_bwd=4).fitted(length=100, head_dim=64, dtype=jnp.float32, groups=6)
    assert (fitted.block_h, fitted.block_h_bwd) == (3, 3)  # the largest divisor of G = 6 not above 4


@pytest.mark.parametrize("block_h, block_h_bwd", [(1, 4), (2, 1), (4, 2)])
def test_heads_per_program(block_h, block_h_bwd):
    """Programs of 1, 2 or 4 heads of a group (trig shared) give the same as the reference (G = 4)."""
    check(35, 16, 8, 2, BlockSizes(block_h=block_h, block_h_bwd=block_h_bwd, **SMALL))


def test_kernel_sincos_against_numpy():
    """The kernels' sincos within 1e-6 of float64 NumPy over Co-RoPE's angles Δ·ω ∈ [0, 32768], and negative."""
    x = np.concatenate([np.linspace(0.0, 32768.0, 400_001), -np.linspace(0.0, 100.0, 10_001),
                        (np.arange(1, 20_000) * np.pi / 2)]).astype(np.float32)
    sin, cos = jax.jit(kernel.sincos)(jnp.asarray(x))
    exact = x.astype(np.float64)
    assert np.max(np.abs(np.asarray(sin, np.float64) - np.sin(exact))) < 1e-6
    assert np.max(np.abs(np.asarray(cos, np.float64) - np.cos(exact))) < 1e-6


def large_intermediates(fn, args: tuple[jax.Array, ...], size: int) -> list[tuple[int, ...]]:
    """Shapes of every value of fn's jaxpr (nested jaxprs and kernels included) with `size` elements or more."""
    shapes = (tuple(getattr(var.aval, "shape", ())) for eqn in equations(jax.make_jaxpr(fn)(*args).jaxpr)
              for var in eqn.outvars)
    return [shape for shape in shapes if int(np.prod(shape, dtype=np.int64)) >= size]


def test_memory_is_linear_in_length():
    """At L = 4096 (B 1, N 2, K 1, D 32), no value of the forward and backward (the residuals, the kernels' blocks,
    the gradient accumulators) has L²/32 elements or more; the dense reference's do (the probe works). Per-key-block
    carries [B, K, L/32, L], as a backward split into dq and dk/dv kernels keeps, would be exactly that size."""
    length = 4096
    q = jnp.zeros((1, length, 2, 32))
    kv = jnp.zeros((1, length, 1, 32))
    size = length * length // 32

    def grad_of(attention):
        return jax.grad(lambda *a: jnp.sum(attention(*a)), argnums=(0, 1, 2))

    reference = lambda *a: jaxpe.corope_attention(*a, theta=THETA, sm_scale=0.2, impl="reference")
    pallas = lambda *a: corope_attention_pallas(*a, theta=THETA, sm_scale=0.2, interpret=True)
    assert large_intermediates(grad_of(reference), (q, kv, kv), size)
    assert large_intermediates(grad_of(pallas), (q, kv, kv), size) == []
