"""CoPE attention under the transformations researchers wrap around it, for every impl (pallas in interpret mode on
CPU): shard_map with its default checks, x64 mode, float16/bfloat16, jax.export with a symbolic batch and length, a
traced sm_scale, grad of grad, and bidirectional attention (causal=False). References: the dense reference (its
autodiff), the float64 NumPy restatement of tests/numpy_reference.py, and a bidirectional one written here from the
maths. GQA (Hq 4, Hkv 2) and MHA (Hq 2, Hkv 2).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as npr
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from kernel_harness import assert_half_precision_matches, assert_matches, outputs_and_grads
from transformation_harness import bidirectional_visibility, float64, float64_values, softmax_average

import jaxpe
from jaxpe.kernels.cope_blockwise import cope_attention_blockwise

HEAD_DIM = 8
NPOS = 6  # small enough that long rows clamp
GQA, MHA = (4, 2), (2, 2)  # (Hq, Hkv)
NAMES = ["o", "dq", "dk", "dv", "dpos_emb"]
FLOAT32 = (2e-5, 2e-4)  # max |error| / max(1, max |want|) for the output and the gradients


def inputs(batch: int, length: int, heads: tuple[int, int], dtype=jnp.float32, seed: int = 0
           ) -> tuple[jax.Array, ...]:
    """q [B, L, Hq, D], k/v [B, L, Hkv, D], a position table [NPOS, D] and an output cotangent [B, L, Hq, D]."""
    kq, kk, kv, ke, kc = jax.random.split(jax.random.PRNGKey(seed), 5)
    hq, hkv = heads
    return (jax.random.normal(kq, (batch, length, hq, HEAD_DIM)).astype(dtype),
            jax.random.normal(kk, (batch, length, hkv, HEAD_DIM)).astype(dtype),
            jax.random.normal(kv, (batch, length, hkv, HEAD_DIM)).astype(dtype),
            jax.random.normal(ke, (NPOS, HEAD_DIM)).astype(dtype),
            jax.random.normal(kc, (batch, length, hq, HEAD_DIM)).astype(dtype))


def attention(impl: str, **options) -> callable:
    """jaxpe.cope_attention with `impl` and `options` fixed: a function of q, k, v, pos_emb."""
    return functools.partial(jaxpe.cope_attention, impl=impl, **options)


# --- shard_map (check_vma=True, the default) -----------------------------------------------------------------------

SHARD_CASES = [  # (axis split, impl, heads, length): each impl with GQA and MHA, each split over every impl
    ("batch", "reference", GQA, 16), ("batch", "blockwise", MHA, 16), ("batch", "pallas", GQA, 16),
    pytest.param("batch", "auto", MHA, 512, marks=pytest.mark.slow), ("heads", "reference", MHA, 16),
    ("heads", "blockwise", GQA, 16),
    ("heads", "pallas", MHA, 16), ("heads", "auto", GQA, 48),
]


@pytest.mark.parametrize("split, impl, heads, length", SHARD_CASES)
def test_shard_map_matches_unsharded(split, impl, heads, length):
    """Data-parallel (batch over 2 devices) and head-parallel (kv heads over 2 devices, so GQA groups stay whole)
    under shard_map's default checks, the position table replicated: output and gradients (the table's summed over
    devices) equal the unsharded call. "auto" runs blockwise at L = 512, the dense path by query blocks at 48."""
    q, k, v, pos_emb, cotangent = inputs(2, length, heads)
    spec = P("x") if split == "batch" else P(None, None, "x")
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    fn = attention(impl)
    sharded = jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec, P()), out_specs=spec)
    want = outputs_and_grads(fn, (q, k, v, pos_emb), cotangent)
    got = outputs_and_grads(sharded, (q, k, v, pos_emb), cotangent)
    assert_matches(got, want, names=NAMES, tolerance=(1e-6, 1e-5), context=f"{split}-parallel {impl}")


def test_shard_map_blockwise_documents_window_and_traced_scale():
    """Packed documents and a window, batch-parallel (the segment ids shard with the batch), sm_scale an operand."""
    q, k, v, pos_emb, cotangent = inputs(2, 24, GQA)
    segment_ids = jnp.array([[0] * 10 + [1] * 14, [0] * 5 + [1] * 19], jnp.int32)
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    fn = lambda q, k, v, e, seg, s: cope_attention_blockwise(q, k, v, e, sm_scale=s, block_k=8,  # noqa: E731
                                                             block_q=8, segment_ids=seg, window=6)
    sharded = jax.shard_map(fn, mesh=mesh, in_specs=(P("x"),) * 3 + (P(), P("x"), P()), out_specs=P("x"))
    want = outputs_and_grads(lambda q, k, v, e, s: attention("reference", sm_scale=s, segment_ids=segment_ids,
                                                             window=6)(q, k, v, e), (q, k, v, pos_emb, 0.3), cotangent)
    got = outputs_and_grads(lambda q, k, v, e, s: sharded(q, k, v, e, segment_ids, s), (q, k, v, pos_emb, 0.3),
                            cotangent)
    assert_matches(got, want, names=NAMES + ["dsm_scale"], tolerance=FLOAT32,
                   context="blockwise, documents, window, shard_map")


# --- x64 mode ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl, heads, length", [
    ("reference", GQA, 16), ("blockwise", GQA, 40), ("pallas", MHA, 16),
    pytest.param("auto", MHA, 520, marks=pytest.mark.slow)])
def test_x64_keeps_float32(impl, heads, length):
    """Under jax_enable_x64, float32 inputs: float32 outputs and gradients equal to the reference without x64, and
    no float64 value anywhere in the computation (the gradient's jaxpr)."""
    q, k, v, pos_emb, cotangent = inputs(1, length, heads)
    fn = attention(impl, sm_scale=0.3)
    want = outputs_and_grads(attention("reference", sm_scale=0.3), (q, k, v, pos_emb), cotangent)
    with jax.enable_x64(True):
        got = outputs_and_grads(fn, (q, k, v, pos_emb), cotangent)
        grad = jax.grad(lambda *args: jnp.sum(fn(*args) * cotangent), argnums=(0, 1, 2, 3))
        assert float64_values(grad, q, k, v, pos_emb) == []
    assert_matches(got, want, names=NAMES, tolerance=FLOAT32, context=f"x64 {impl} L{length}")


# --- float16 / bfloat16 --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl, dtype, length", [
    ("reference", jnp.float16, 16), ("blockwise", jnp.bfloat16, 40), ("pallas", jnp.bfloat16, 16),
    *(pytest.param(impl, jnp.float16, length, marks=pytest.mark.slow)
      for impl, length in (("blockwise", 511), ("pallas", 1000), ("auto", 512)))])
def test_half_precision(impl, dtype, length):
    """float16 and bfloat16 at every length (blocks of 128: 511, 512 and 1000 = 7·128 + 104): outputs and gradients
    in the input dtype, close to the float32 reference on the same (rounded) inputs."""
    q, k, v, pos_emb, cotangent = inputs(1, length, (2, 1), dtype)
    assert_half_precision_matches(attention(impl), attention("reference"), (q, k, v, pos_emb), cotangent, names=NAMES,
                                  context=f"{impl} {jnp.dtype(dtype).name} L{length}")


# --- jax.export with symbolic batch and length ---------------------------------------------------------------------

@pytest.mark.parametrize("impl, heads, lengths, options", [
    ("reference", GQA, (9, 21), {}),
    ("reference", MHA, (9, 21), {"causal": False, "window": 4}),
    ("blockwise", MHA, (21, 530), {}),
    ("blockwise", GQA, (13, 520), {"window": 5, "causal": False}),
    ("auto", GQA, (9, 30), {}),
])
def test_export_symbolic_batch_and_length(impl, heads, lengths, options):
    """Exported once with batch and length symbolic, run at two batches and lengths (one past 512 for blockwise):
    the same output as the function not exported."""
    b, length = jax.export.symbolic_shape("b, l")
    hq, hkv = heads
    fn = attention(impl, **options)
    shapes = [jax.ShapeDtypeStruct((b, length, h, HEAD_DIM), jnp.float32) for h in (hq, hkv, hkv)]
    exported = jax.export.export(jax.jit(fn))(*shapes, jax.ShapeDtypeStruct((NPOS, HEAD_DIM), jnp.float32))
    for batch, n in zip((1, 2), lengths):
        q, k, v, pos_emb, _ = inputs(batch, n, heads, seed=n)
        np.testing.assert_allclose(exported.call(q, k, v, pos_emb), jax.jit(fn)(q, k, v, pos_emb), atol=1e-5, rtol=0)


def test_export_blockwise_with_documents():
    """Segment ids [b, l] symbolic too."""
    b, length = jax.export.symbolic_shape("b, l")
    fn = lambda q, k, v, e, seg: attention("blockwise", segment_ids=seg, window=7)(q, k, v, e)  # noqa: E731
    shapes = [jax.ShapeDtypeStruct((b, length, h, HEAD_DIM), jnp.float32) for h in GQA + (2,)]
    exported = jax.export.export(jax.jit(fn))(*shapes, jax.ShapeDtypeStruct((NPOS, HEAD_DIM), jnp.float32),
                                              jax.ShapeDtypeStruct((b, length), jnp.int32))
    q, k, v, pos_emb, _ = inputs(2, 40, GQA)
    seg = jnp.repeat(jnp.arange(3, dtype=jnp.int32), jnp.array([15, 15, 10]), total_repeat_length=40)[None]
    seg = seg.repeat(2, axis=0)
    np.testing.assert_allclose(exported.call(q, k, v, pos_emb, seg),
                               attention("reference", segment_ids=seg, window=7)(q, k, v, pos_emb), atol=2e-5, rtol=0)


def test_export_pallas_refuses_symbolic_shapes():
    b, length = jax.export.symbolic_shape("b, l")
    shapes = [jax.ShapeDtypeStruct((b, length, h, HEAD_DIM), jnp.float32) for h in GQA + (2,)]
    with pytest.raises(ValueError, match="impl='pallas' needs static shapes.*symbolic"):
        jax.export.export(jax.jit(attention("pallas")))(*shapes, jax.ShapeDtypeStruct((NPOS, HEAD_DIM), jnp.float32))


# --- a traced sm_scale (a learned temperature) ---------------------------------------------------------------------

@pytest.mark.parametrize("impl, heads", [("reference", GQA), ("blockwise", MHA), ("pallas", MHA)])
def test_traced_sm_scale(impl, heads):
    """jax.grad with respect to sm_scale equals the central difference of the float64 NumPy restatement; an
    sm_scale computed inside jit gives the output of the same number passed concretely."""
    q, k, v, pos_emb, cotangent = inputs(1, 10, heads)
    loss = lambda s: jnp.sum(attention(impl, sm_scale=s)(q, k, v, pos_emb) * cotangent)  # noqa: E731
    qn, kn, vn, en, cn = float64(q, k, v, pos_emb, cotangent)
    np_loss = lambda s: np.sum(npr.cope_attention(qn, kn, vn, en, sm_scale=s) * cn)  # noqa: E731
    step = 1e-5
    finite_difference = (np_loss(0.3 + step) - np_loss(0.3 - step)) / (2 * step)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(0.3), finite_difference, rtol=2e-4,
                               atol=2e-4 * max(1.0, abs(finite_difference)))
    inside = jax.jit(lambda s: attention(impl, sm_scale=2.0 * s)(q, k, v, pos_emb))(0.15)
    np.testing.assert_allclose(inside, attention(impl, sm_scale=0.3)(q, k, v, pos_emb), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_traced_sm_scale_auto_matches_reference():
    """At L = 512 "auto" runs blockwise: the gradient in sm_scale (and the others) equals the reference's."""
    q, k, v, pos_emb, cotangent = inputs(1, 512, (2, 1))
    args = (q, k, v, pos_emb, 0.3)
    got = outputs_and_grads(lambda *a: attention("auto", sm_scale=a[4])(*a[:4]), args, cotangent)
    want = outputs_and_grads(lambda *a: attention("reference", sm_scale=a[4])(*a[:4]), args, cotangent)
    assert_matches(got, want, names=NAMES + ["dsm_scale"], tolerance=FLOAT32, context="auto L512, sm_scale traced")


def test_concrete_sm_scale_is_still_checked():
    q, k, v, pos_emb, _ = inputs(1, 16, GQA)
    for impl in ("reference", "blockwise", "pallas"):
        with pytest.raises(ValueError, match="sm_scale=-1.0"):
            attention(impl, sm_scale=-1.0)(q, k, v, pos_emb)


# --- second order --------------------------------------------------------------------------------------------------

def curvature(fn: callable, args: tuple[jax.Array, ...], cotangent: jax.Array, weights: jax.Array
              ) -> list[jax.Array]:
    """The gradient in (q, k, v, pos_emb) of a function of the first-order gradients of sum(fn(...) · cotangent)."""
    def first(*args):
        return jnp.sum(fn(*args) * cotangent)

    def second(*args):
        dq, dk, dv, de = jax.grad(first, argnums=(0, 1, 2, 3))(*args)
        return jnp.sum(dq * weights) + jnp.sum(dk ** 2) + jnp.sum(dv * dk) + jnp.sum(de ** 2)

    return list(jax.jit(jax.grad(second, argnums=(0, 1, 2, 3)))(*args))


@pytest.mark.slow
@pytest.mark.parametrize("heads, options", [
    (MHA, {"causal": False}), (GQA, {"segment_ids": jnp.array([[0] * 6 + [1] * 7])})])
def test_grad_of_grad_blockwise_matches_reference(heads, options):
    """Second order (the gradient of a function of the gradient) through blockwise's custom VJP, several blocks and
    chunks, clamped rows (npos 6), against the dense reference's autodiff."""
    q, k, v, pos_emb, cotangent = inputs(1, 13, heads)
    weights = inputs(1, 13, heads, seed=1)[0]
    blockwise = functools.partial(cope_attention_blockwise, sm_scale=0.3, block_k=4, block_q=8, **options)
    want = curvature(attention("reference", sm_scale=0.3, **options), (q, k, v, pos_emb), cotangent, weights)
    got = curvature(blockwise, (q, k, v, pos_emb), cotangent, weights)
    assert_matches(got, want, names=["ddq", "ddk", "ddv", "ddpos_emb"], tolerance=(1e-4, 1e-4),
                   context=f"grad of grad {options}")


def test_grad_of_grad_pallas_refuses_clearly():
    q, k, v, pos_emb, _ = inputs(1, 16, GQA)
    first = lambda q: jnp.sum(attention("pallas")(q, k, v, pos_emb))  # noqa: E731
    with pytest.raises(NotImplementedError, match="impl='pallas' is differentiable once"):
        jax.grad(lambda q: jnp.sum(jax.grad(first)(q)))(q)


# --- bidirectional attention (causal=False) ------------------------------------------------------------------------

def bidirectional_cope(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos_emb: np.ndarray, *, sm_scale: float,
                       gate_k: np.ndarray | None = None, segment_ids: np.ndarray | None = None,
                       window: int | None = None) -> np.ndarray:
    """Bidirectional CoPE in float64 loops, from the maths: key j visible to query i iff same document and
    |i − j| < window; g_it = sigmoid(sm_scale·q_i·kg_t) for visible t, 0 otherwise; p_ij = Σ_{t=j..i} g_it for
    j ≤ i, Σ_{t=i..j} g_it for j ≥ i, clamped to npos − 1; logits sm_scale·(q_i·k_j + q_i·e[p_ij]) (interpolated);
    softmax over the visible keys."""
    b, length, hq, _ = q.shape
    groups = hq // k.shape[2]
    kg = k if gate_k is None else gate_k
    npos = pos_emb.shape[-2]
    visible = bidirectional_visibility(b, length, segment_ids=segment_ids, window=window)  # [B, L, L]
    out = np.zeros(q.shape)
    for bi, i, h in np.ndindex(b, length, hq):
        g = h // groups
        table = pos_emb if pos_emb.ndim == 2 else pos_emb[h]
        gates = [npr.sigmoid(sm_scale * q[bi, i, h] @ kg[bi, t, g]) if visible[bi, i, t] else 0.0
                 for t in range(length)]
        keys = np.flatnonzero(visible[bi, i])
        positions = [min(sum(gates[min(i, j): max(i, j) + 1]), npos - 1) for j in keys]
        logits = [sm_scale * (q[bi, i, h] @ k[bi, j, g] + npr.cope_interpolate(q[bi, i, h], table, p))
                  for j, p in zip(keys, positions)]
        out[bi, i, h] = softmax_average(logits, v[bi, keys, g])
    return out


BIDIRECTIONAL_CASES = [  # (impl, heads, documents, window, per-head table and gate_k)
    ("reference", GQA, False, None, False), ("reference", MHA, True, 4, True), ("blockwise", GQA, True, 4, True),
    ("blockwise", MHA, False, None, False), ("auto", GQA, False, 6, False)]


@pytest.mark.parametrize("impl, heads, documents, window, variants", BIDIRECTIONAL_CASES)
def test_bidirectional_matches_numpy(impl, heads, documents, window, variants):
    """causal=False against the NumPy restatement above: positions counted both ways, every visible key, documents
    (one split in the middle of another's ids) and windows symmetric; several blocks for blockwise (a direct call
    with blocks of 8)."""
    q, k, v, pos_emb, _ = inputs(2, 21, heads)
    gate_k = pos_emb_heads = None
    if variants:
        gate_k = inputs(2, 21, heads, seed=5)[1]
        pos_emb_heads = jax.random.normal(jax.random.PRNGKey(7), (heads[0], NPOS, HEAD_DIM))
    table = pos_emb if pos_emb_heads is None else pos_emb_heads
    segment_ids = jnp.array([[0] * 9 + [1] * 12, [0] * 4 + [1] * 10 + [0] * 7], jnp.int32) if documents else None
    want = bidirectional_cope(*float64(q, k, v, table), sm_scale=0.3, window=window,
                              gate_k=None if gate_k is None else np.asarray(gate_k, np.float64),
                              segment_ids=None if segment_ids is None else np.asarray(segment_ids))
    options = dict(sm_scale=0.3, causal=False, gate_k=gate_k, segment_ids=segment_ids, window=window)
    np.testing.assert_allclose(attention(impl, **options)(q, k, v, table), want, atol=2e-5, rtol=0)
    if impl == "blockwise":
        small_blocks = cope_attention_blockwise(q, k, v, table, block_k=8, block_q=8, **options)
        np.testing.assert_allclose(small_blocks, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("heads, documents, window", [(GQA, True, 5), (MHA, False, None)])
def test_bidirectional_blockwise_grads_match_reference(heads, documents, window):
    q, k, v, pos_emb, cotangent = inputs(1, 19, heads)
    segment_ids = jnp.array([[0] * 8 + [1] * 11], jnp.int32) if documents else None
    options = dict(causal=False, segment_ids=segment_ids, window=window)
    args = (q, k, v, pos_emb, 0.3)
    got = outputs_and_grads(lambda *a: cope_attention_blockwise(*a[:4], sm_scale=a[4], block_k=8, block_q=8,
                                                                **options), args, cotangent)
    want = outputs_and_grads(lambda *a: attention("reference", sm_scale=a[4], **options)(*a[:4]), args, cotangent)
    assert_matches(got, want, names=NAMES + ["dsm_scale"], tolerance=FLOAT32,
                   context=f"bidirectional {heads} window {window}")


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_bidirectional_all_gates_one_is_relative_position(impl):
    """Saturated gates (q·k ≫ 0 everywhere) count one per key: p_ij = |i − j| + 1 clamped, the relative-position
    logits q_i·e[min(|i − j| + 1, npos − 1)] on both sides (NumPy softmax over all keys)."""
    q, _, v, pos_emb, _ = inputs(1, 12, MHA)
    q = jnp.abs(q) + 1.0
    k = jnp.full(q.shape, 10.0)  # 0.3·q·k ≥ 24: sigmoid is 1 in float32, and the content logits are equal per row
    qn, kn, vn, en = float64(q, k, v, pos_emb)
    distance = np.minimum(np.abs(np.arange(12)[:, None] - np.arange(12)[None, :]) + 1, NPOS - 1)  # [i, j]
    logits = 0.3 * (np.einsum("bihd,bjhd->bhij", qn, kn) + np.einsum("bihd,ijd->bhij", qn, en[distance]))
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("bhij,bjhd->bihd", p, vn)
    got = attention(impl, sm_scale=0.3, causal=False)(q, k, v, pos_emb)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_bidirectional_diagonal_dominates_float32():
    """Rows whose own key dominates (q_i·k_i = 25, q_i·k_j ≈ 0): the two halves of blockwise's bidirectional walk
    overlap nowhere (the reversed half leaves the diagonal out), so the small weights of the other keys survive in
    float32."""
    noise, _, v, pos_emb, _ = inputs(1, HEAD_DIM, MHA)
    q = 5.0 * jnp.eye(HEAD_DIM)[None, :, None, :] + 0.01 * noise  # [1, L = D, 2, D]
    want = bidirectional_cope(*float64(q, q, v, 0.1 * pos_emb), sm_scale=0.3)
    got = cope_attention_blockwise(q, q, v, 0.1 * pos_emb, sm_scale=0.3, block_k=4, block_q=4, causal=False)
    weights_off_diagonal = np.abs(want - np.asarray(v, np.float64)).max()
    assert 1e-6 < weights_off_diagonal < 1e-1  # the diagonal dominates, the others still count
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)


def test_bidirectional_pallas_refuses_clearly():
    q, k, v, pos_emb, _ = inputs(1, 16, GQA)
    with pytest.raises(ValueError, match="causal=False is not supported by impl='pallas'"):
        attention("pallas", causal=False)(q, k, v, pos_emb)
