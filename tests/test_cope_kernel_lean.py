"""The lean CoPE kernels: O(L) residuals and backward memory, the interpolation's edge cases (positions on
table rows, at 0 and at P − 1, npos = 2), lengths that are no multiple of a block, and forward and backward blocks
that differ (with documents, windows, GQA, gate_k, per-head tables). Outputs and every gradient are compared with
the dense reference `jaxpe.cope_attention(impl="reference")` in interpret mode.
"""
from __future__ import annotations

import functools

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_harness import assert_matches_elementwise, equations, outputs_and_grads

import jaxpe
from jaxpe.kernels.cope_pallas import BlockSizes, cope_attention_pallas

NAMES = ["out", "dq", "dk", "dv", "dpos_emb", "dgate_k"]


def inputs(length: int, *, q_heads: int = 2, kv_heads: int = 1, d: int = 32, npos: int = 8, per_head: bool = False,
           gate_k: bool = False, seed: int = 0, dtype=jnp.float32) -> tuple:
    """q [2, L, N, D], k/v [2, L, K, D], pos_emb [P, D] or [N, P, D], gate_k or None."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(keys[0], (2, length, q_heads, d))
    k, v = (jax.random.normal(kk, (2, length, kv_heads, d)) for kk in keys[1:3])
    pos_emb = jax.random.normal(keys[3], ((q_heads,) if per_head else ()) + (npos, d))
    gk = jax.random.normal(keys[4], k.shape) if gate_k else None
    cast = lambda x: None if x is None else x.astype(dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(pos_emb), cast(gk)


def assert_matches_reference(q, k, v, pos_emb, gate_k=None, *, blocks: BlockSizes | None = None,
                             segment_ids=None, window: int | None = None, context: str) -> None:
    """The kernel's output and gradients of sum(o · cotangent) against the dense reference's."""
    sm_scale = q.shape[-1] ** -0.5
    options = dict(sm_scale=sm_scale, segment_ids=segment_ids, window=window)
    args = (q, k, v, pos_emb) + (() if gate_k is None else (gate_k,))
    cotangent = jax.random.normal(jax.random.PRNGKey(99), q.shape)

    def kernel(q, k, v, e, gk=None):
        return cope_attention_pallas(q, k, v, e, gk, block_sizes=blocks, interpret=True, **options)

    def reference(q, k, v, e, gk=None):
        return jaxpe.cope_attention(q, k, v, e, gate_k=gk, impl="reference", **options)

    got = outputs_and_grads(kernel, args, cotangent)
    want = outputs_and_grads(reference, args, cotangent, compiler_options=None)
    assert_matches_elementwise(got, want, names=NAMES[:len(want)], dtype=jnp.dtype(q.dtype).name, context=context)


def saturated(q, kg, open_keys: np.ndarray):
    """q and gate keys kg with every gate logit ±40 (sigmoid 1.0 or ~4e-18 in float32): key j's gate is open for
    every query iff open_keys[j]. Positions are then whole numbers: they land exactly on table rows. (Gate keys
    apart from k, so that the attention logits stay moderate and the gradients well conditioned.)"""
    d = q.shape[-1]
    a = float(np.sqrt(40.0 * np.sqrt(d)))
    signs = jnp.where(jnp.asarray(open_keys), 1.0, -1.0)[None, :, None]
    q = q.at[..., 1:].multiply(0.1).at[..., 0].set(a)
    return q, kg.at[..., 1:].multiply(0.1).at[..., 0].set(a * signs)


def _shapes(jaxpr: jex_core.Jaxpr) -> list[tuple[int, ...]]:
    """The shape of every value read or written in the jaxpr, nested jaxprs (loops, custom VJPs, kernels) included."""
    return [tuple(getattr(var.aval, "shape", ())) for eqn in equations(jaxpr) for var in (*eqn.invars, *eqn.outvars)]


@pytest.mark.parametrize("gate_k", [False, True], ids=["gates_from_k", "gate_k"])
def test_gradient_holds_nothing_of_size_length_squared_over_block(gate_k: bool):
    """No value in the forward's residuals or the backward has L·L/64 elements or more (L = 4096: every O(L) array
    of these shapes is smaller), traced for the GPU; the dense reference's gradient does (the probe works)."""
    length = 4096
    q, k, v, pos_emb, gk = (jax.ShapeDtypeStruct(x.shape, x.dtype) if x is not None else None
                            for x in inputs(8, d=16, npos=16, gate_k=gate_k))
    q, k, v = (jax.ShapeDtypeStruct((1, length) + x.shape[2:], x.dtype) for x in (q, k, v))
    gk = None if gk is None else jax.ShapeDtypeStruct(k.shape, k.dtype)
    limit = length * length // 64

    def big(attention) -> list[tuple[int, ...]]:
        args = (q, k, v, pos_emb) + (() if gk is None else (gk,))
        grad = jax.grad(lambda *a: jnp.sum(attention(*a)), argnums=tuple(range(len(args))))
        return [s for s in _shapes(jax.make_jaxpr(grad)(*args).jaxpr) if int(np.prod(s)) >= limit]

    assert big(lambda q, k, v, e, g=None: jaxpe.cope_attention(q, k, v, e, gate_k=g, sm_scale=0.25,
                                                                 impl="reference"))
    assert big(lambda q, k, v, e, g=None: cope_attention_pallas(q, k, v, e, g, sm_scale=0.25,
                                                                  interpret=False)) == []


@pytest.mark.parametrize("npos", [2, 4, 64])
def test_positions_on_table_rows(npos: int):
    """Saturated gates put every position on a whole table row: 0 (closed gates up to the diagonal), rows in
    between, and P − 1 (clamped); the interpolation reads one row, and the kernel's floor must agree."""
    length = 70
    q, k, v, pos_emb, gk = inputs(length, npos=npos, seed=npos, gate_k=True)
    open_keys = (np.arange(length) % 3 == 0) | (np.arange(length) > 60)
    q, gk = saturated(q, gk, open_keys)
    blocks = BlockSizes(16, 16, 16, 32)
    assert_matches_reference(q, k, v, pos_emb, gk, blocks=blocks, context=f"saturated npos={npos}")


def test_rejects_a_table_of_one_row():
    """npos = 1 has no interpolation (lo = hi = 0 for every position): the entry point refuses it, as the reference
    does; npos = 2, the smallest table, runs in test_positions_on_table_rows and the odd-length test."""
    q, k, v, _, _ = inputs(8)
    with pytest.raises(ValueError, match="npos=1 must be"):
        cope_attention_pallas(q, k, v, jnp.zeros((1, q.shape[-1])), sm_scale=0.2, interpret=True)


@pytest.mark.parametrize("length", [1, 37, 100])
@pytest.mark.parametrize("npos", [2, 300])
def test_lengths_that_are_no_multiple_of_a_block(length: int, npos: int):
    """Padded rows and keys change nothing; a table far longer than the sequence (P − 1 never reached) too."""
    q, k, v, pos_emb, gk = inputs(length, npos=npos, gate_k=length == 37, seed=length)
    assert_matches_reference(q, k, v, pos_emb, gk, blocks=BlockSizes(32, 16, 16, 32),
                             context=f"L={length} npos={npos}")


@pytest.mark.parametrize("blocks", [BlockSizes(64, 16, 16, 32), BlockSizes(16, 32, 64, 16), BlockSizes(32, 64, 32, 16)],
                         ids=str)
def test_backward_blocks_differ_from_the_forwards(blocks: BlockSizes):
    """The backward rebuilds positions per row from where the forward's walk stopped, whatever its own blocks:
    with documents, a window, GQA, gate_k and per-head tables."""
    length = 150
    q, k, v, pos_emb, gk = inputs(length, q_heads=4, kv_heads=2, npos=6, per_head=True, gate_k=True, seed=3)
    segment_ids = jnp.asarray(np.stack([np.repeat([0, 1, 2], [40, 70, 40]), np.repeat([5, 6], [100, 50])]))
    assert_matches_reference(q, k, v, pos_emb, gk, blocks=blocks, context=f"documents {blocks}",
                             segment_ids=segment_ids)
    assert_matches_reference(q, k, v, pos_emb, blocks=blocks, window=45, context=f"window {blocks}")


def test_default_blocks_bfloat16_and_many_clamped_blocks():
    """Default block sizes in bfloat16, and a long row of clamped tiles (every gate open, npos small)."""
    length = 200
    q, k, v, pos_emb, _ = inputs(length, npos=5, seed=5, dtype=jnp.bfloat16)
    assert_matches_reference(q, k, v, pos_emb, context="bfloat16 defaults")
    q, k, v, pos_emb, gk = inputs(length, npos=5, seed=6, gate_k=True)
    q, gk = saturated(q, gk, np.ones(length, bool))
    assert_matches_reference(q, k, v, pos_emb, gk, context="every gate open")


@pytest.mark.parametrize("head_dim", [16, 64, 100, 256])
def test_default_block_sizes_shrink_with_the_registers_a_tile_takes(head_dim: int):
    """float32 tiles are no larger than bfloat16 ones, nor tiles with a separate gate_k than without (the compile
    report's register budget); every default is a valid BlockSizes."""
    area = lambda b: (b.block_q * b.block_k, b.block_q_bwd * b.block_k_bwd)  # noqa: E731
    for gate_k in (False, True):
        f32, bf16 = (BlockSizes.default(head_dim, dtype, gate_k=gate_k) for dtype in (jnp.float32, jnp.bfloat16))
        assert all(a <= b for a, b in zip(area(f32), area(bf16)))
    for dtype in (jnp.float32, jnp.bfloat16):
        with_gate_k, from_k = (BlockSizes.default(head_dim, dtype, gate_k=g) for g in (True, False))
        assert all(a <= b for a, b in zip(area(with_gate_k), area(from_k)))


def test_fitted_block_sizes_fill_defaults_and_shrink_to_the_length():
    """None fields take the defaults (float32, D 64, gates from k: 32 everywhere), given ones stay, and every size is
    capped at the next power of two >= L, at least 16."""
    def fit(blocks: BlockSizes, length: int) -> BlockSizes:
        return blocks.fitted(length=length, head_dim=64, dtype=jnp.float32, gate_k=False)

    assert fit(BlockSizes(), 1000) == BlockSizes(32, 32, 32, 32)
    assert fit(BlockSizes(block_q=16, block_k_bwd=64), 1000) == BlockSizes(16, 32, 32, 64)
    assert fit(BlockSizes(block_k_bwd=64), 20) == BlockSizes(32, 32, 32, 32)
    assert fit(BlockSizes(block_q=64), 5) == BlockSizes(16, 16, 16, 16)
    with pytest.raises(ValueError, match="block_q_bwd=24"):
        BlockSizes(block_q_bwd=24)


def test_gates_from_k_read_k_once():
    """With gate_k None the kernels take no gate-key operand (one q·kᵀ per tile serves logits and gates)."""
    q, k, v, pos_emb, gk = inputs(40, gate_k=True)
    kernel = functools.partial(cope_attention_pallas, sm_scale=0.2, interpret=True)

    def operands(*args) -> list[int]:
        jaxpr = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(kernel(*a)), argnums=(0, 1)))(*args).jaxpr
        return [len(eqn.invars) for eqn in equations(jaxpr) if eqn.primitive.name == "pallas_call"]

    with_gate_k, from_k = operands(q, k, v, pos_emb, gk), operands(q, k, v, pos_emb)
    assert len(with_gate_k) == len(from_k) == 2  # forward, backward
    assert [a - b for a, b in zip(with_gate_k, from_k)] == [1, 2]  # gate_k, and its zero-initialised gradient
