"""Co-RoPE attention under the transformations researchers wrap around it, for every impl (pallas in interpret mode
on CPU): shard_map with its default checks, x64 mode, float16/bfloat16, jax.export with a symbolic batch and length,
a traced sm_scale, grad of grad, and bidirectional attention (causal=False). References: the dense reference (its
autodiff), the float64 NumPy restatement of tests/numpy_reference.py, and a bidirectional one written here from the
maths. GQA (Hq 4, Hkv 2) and MHA (Hq 2, Hkv 2).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as npr
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from kernel_harness import FAST_COMPILE, assert_half_precision_matches, assert_matches, outputs_and_grads
from transformation_harness import bidirectional_visibility, float64, float64_values, softmax_average

import jaxpe
from jaxpe.kernels.corope_blockwise import corope_attention_blockwise

THETA = 10000.0
HEAD_DIM = 8
GQA, MHA = (4, 2), (2, 2)  # (Hq, Hkv)
NAMES = ["o", "dq", "dk", "dv"]
FLOAT32 = (2e-5, 2e-4)  # max |error| / max(1, max |want|) for the output and the gradients


def inputs(batch: int, length: int, heads: tuple[int, int], dtype=jnp.float32, seed: int = 0
           ) -> tuple[jax.Array, ...]:
    """q [B, L, Hq, D], k/v [B, L, Hkv, D] and an output cotangent [B, L, Hq, D], standard normal (drawn by NumPy:
    eager jax.random would compile for every shape)."""
    rng = np.random.default_rng(seed)
    hq, hkv = heads
    return tuple(jnp.asarray(rng.standard_normal((batch, length, h, HEAD_DIM)), dtype) for h in (hq, hkv, hkv, hq))


def attention(impl: str, **options) -> callable:
    """jaxpe.corope_attention with `impl` and `options` fixed: a function of q, k, v."""
    return functools.partial(jaxpe.corope_attention, theta=THETA, impl=impl, **options)


def compiled(fn: callable, *args: jax.Array) -> jax.Array:
    """fn(*args), compiled at once and cheaply (compile time dominates these tests)."""
    return jax.jit(fn).lower(*args).compile(FAST_COMPILE)(*args)


@functools.cache
def reference_run(batch: int, length: int, heads: tuple[int, int]) -> list[jax.Array]:
    """The dense reference's output and gradients on `inputs(batch, length, heads)` (computed once per module)."""
    q, k, v, cotangent = inputs(batch, length, heads)
    return outputs_and_grads(attention("reference"), (q, k, v), cotangent)


# --- shard_map (check_vma=True, the default) -----------------------------------------------------------------------

SHARD_CASES = [  # (axis split, impl, heads): every impl, GQA and MHA, batch- and head-parallel (blockwise
    # batch-parallel with documents below)
    ("heads", "reference", GQA), ("heads", "blockwise", MHA), ("heads", "pallas", GQA), ("batch", "auto", MHA)]


@pytest.mark.parametrize("split, impl, heads", SHARD_CASES)
def test_shard_map(split, impl, heads):
    """Data-parallel (batch over 2 devices) and head-parallel (kv heads over 2 devices, so GQA groups stay whole)
    under shard_map's default checks: output and gradients equal the unsharded dense reference's."""
    q, k, v, cotangent = inputs(2, 16, heads)
    spec = P("x") if split == "batch" else P(None, None, "x")
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    sharded = jax.shard_map(attention(impl), mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    got = outputs_and_grads(sharded, (q, k, v), cotangent)
    assert_matches(got, reference_run(2, 16, heads), names=NAMES, tolerance=FLOAT32,
                   context=f"{split}-parallel {impl}")


def test_shard_map_blockwise_documents_window_sm_scale():
    """Batch-parallel blockwise over several blocks with packed documents, a window and a traced, replicated
    sm_scale: its gradient (computed per shard) sums over the shards."""
    q, k, v, cotangent = inputs(2, 24, GQA)
    segment_ids = jnp.array([[0] * 10 + [1] * 14, [0] * 5 + [1] * 19], jnp.int32)
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))

    def blockwise(q, k, v, seg, sm_scale):
        return corope_attention_blockwise(q, k, v, theta=THETA, sm_scale=sm_scale, block_k=8, segment_ids=seg,
                                          window=6)

    sharded = jax.shard_map(blockwise, mesh=mesh, in_specs=(P("x"),) * 4 + (P(),), out_specs=P("x"))
    reference = lambda q, k, v, s: attention("reference", sm_scale=s, segment_ids=segment_ids, window=6)(q, k, v)
    got = outputs_and_grads(lambda q, k, v, s: sharded(q, k, v, segment_ids, s), (q, k, v, 0.3), cotangent)
    want = outputs_and_grads(reference, (q, k, v, 0.3), cotangent)
    assert_matches(got, want, names=NAMES + ["d sm_scale"], tolerance=FLOAT32, context="blockwise under shard_map")


# --- x64 mode ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl, heads, length", [("reference", GQA, 16), ("blockwise", MHA, 300), ("pallas", GQA, 16)])
def test_x64_keeps_float32(impl, heads, length):
    """Under jax_enable_x64, float32 inputs: float32 outputs and gradients equal to the reference's without x64
    (300: three blocks), and no float64 value anywhere in the computation (the gradient's jaxpr)."""
    q, k, v, cotangent = inputs(2, length, heads)
    fn = attention(impl)
    with jax.enable_x64(True):
        got = outputs_and_grads(fn, (q, k, v), cotangent)
        grad = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent), argnums=(0, 1, 2))
        assert float64_values(grad, q, k, v) == []
    assert_matches(got, reference_run(2, length, heads), names=NAMES, tolerance=FLOAT32, context=f"x64 {impl}")


# --- float16 / bfloat16 --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl, dtype, length", [("blockwise", jnp.bfloat16, 40), ("auto", jnp.float16, 512),
                                                  ("pallas", jnp.float16, 40)])
def test_half_precision(impl, dtype, length):
    """float16 and bfloat16 at every length (float16 at 512 under impl='auto' refused before, and by impl='pallas'
    until its kernels took what the native ones take): outputs and gradients in the input dtype, close to the float32
    reference on the same rounded inputs (every path computes in float32)."""
    q, k, v, cotangent = inputs(1, length, (2, 1), dtype)
    assert_half_precision_matches(attention(impl), attention("reference"), (q, k, v), cotangent, names=NAMES,
                                  context=f"{impl} {jnp.dtype(dtype).name} L{length}")


# --- jax.export with symbolic batch and length ---------------------------------------------------------------------

@pytest.mark.parametrize("impl, heads, lengths, documents", [
    ("reference", GQA, (9, 21), False), ("blockwise", MHA, (21, 530), True)])
def test_export_symbolic_batch_and_length(impl, heads, lengths, documents):
    """Exported once with batch and length symbolic, run at two batches and lengths (past a block of 128 for
    blockwise, there with segment ids [b, l], a window and causal=False): at the short length the NumPy
    restatement's output, at the long one that of the function not exported."""
    b, length = jax.export.symbolic_shape("b, l")
    hq, hkv = heads
    fn = lambda q, k, v, seg: attention(impl)(q, k, v)  # noqa: E731
    if documents:
        fn = lambda q, k, v, seg: attention(impl, segment_ids=seg, window=5, causal=False)(q, k, v)  # noqa: E731
    shapes = [jax.ShapeDtypeStruct((b, length, h, HEAD_DIM), jnp.float32) for h in (hq, hkv, hkv)]
    exported = jax.export.export(jax.jit(fn))(*shapes, jax.ShapeDtypeStruct((b, length), jnp.int32))
    for batch, n in zip((2, 1), lengths):
        q, k, v, _ = inputs(batch, n, heads, seed=n)
        seg = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) * 3 // n, (batch, n))  # three documents
        if n == lengths[0]:
            want = (bidirectional_corope(*float64(q, k, v), sm_scale=HEAD_DIM ** -0.5, segment_ids=np.asarray(seg),
                                         window=5) if documents else npr.corope_attention(*float64(q, k, v)))
        else:
            want = compiled(fn, q, k, v, seg)
        np.testing.assert_allclose(compiled(exported.call, q, k, v, seg), want, atol=1e-5, rtol=0)


def test_export_pallas_refuses_symbolic_shapes():
    b, length = jax.export.symbolic_shape("b, l")
    shapes = [jax.ShapeDtypeStruct((b, length, h, HEAD_DIM), jnp.float32) for h in GQA + (2,)]
    with pytest.raises(ValueError, match="symbolic.*impl='pallas'"):
        jax.export.export(jax.jit(attention("pallas")))(*shapes)


# --- a traced sm_scale (a learned temperature) ---------------------------------------------------------------------

@pytest.mark.parametrize("impl, heads", [("reference", MHA), ("blockwise", GQA), ("pallas", GQA)])
def test_traced_sm_scale(impl, heads):
    """jax.grad with respect to sm_scale equals the central difference of the float64 NumPy restatement; an
    sm_scale computed inside jit gives the restatement's output at that number."""
    q, k, v, cotangent = inputs(1, 10, heads)
    loss = lambda s: jnp.sum(attention(impl, sm_scale=s)(q, k, v) * cotangent)  # noqa: E731
    qn, kn, vn, cn = float64(q, k, v, cotangent)
    restated = lambda s: npr.corope_attention(qn, kn, vn, theta=THETA, sm_scale=s)  # noqa: E731
    step = 1e-5
    finite_difference = np.sum((restated(0.3 + step) - restated(0.3 - step)) * cn) / (2 * step)
    np.testing.assert_allclose(compiled(jax.grad(loss), 0.3), finite_difference, rtol=0,
                               atol=2e-4 * max(1.0, abs(finite_difference)))
    inside = compiled(lambda s: attention(impl, sm_scale=2.0 * s)(q, k, v), 0.15)
    np.testing.assert_allclose(inside, restated(0.3), atol=2e-5, rtol=0)


def test_sm_scale_checks():
    """A concrete sm_scale is checked on every path."""
    q, k, v, _ = inputs(1, 16, GQA)
    for impl in ("reference", "blockwise", "pallas"):
        with pytest.raises(ValueError, match="sm_scale=-1.0"):
            attention(impl, sm_scale=-1.0)(q, k, v)


# --- second order --------------------------------------------------------------------------------------------------

def test_grad_of_grad_blockwise_matches_reference():
    """Second order (the gradient of a function of the gradient) through blockwise's custom VJP, GQA, three blocks,
    bidirectional (so both walks, causal and strict), against the dense reference's autodiff."""
    q, k, v, cotangent = inputs(1, 10, GQA)
    weights = inputs(1, 10, GQA, seed=1)[0]

    def curvature(fn):
        def second(q, k, v):
            dq, dk, dv = jax.grad(lambda *a: jnp.sum(fn(*a) * cotangent), argnums=(0, 1, 2))(q, k, v)
            return jnp.sum(dq * weights) + jnp.sum(dk ** 2) + jnp.sum(dv * dk)

        return list(compiled(jax.grad(second, argnums=(0, 1, 2)), q, k, v))

    blockwise = lambda q, k, v: corope_attention_blockwise(q, k, v, theta=THETA, sm_scale=0.3, block_k=4,  # noqa: E731
                                                           causal=False)
    want = curvature(attention("reference", sm_scale=0.3, causal=False))
    assert_matches(curvature(blockwise), want, names=["ddq", "ddk", "ddv"], tolerance=(1e-4, 1e-4),
                   context="grad of grad")


def test_grad_of_grad_pallas_refuses_clearly():
    q, k, v, _ = inputs(1, 16, GQA)
    first = lambda q: jnp.sum(attention("pallas")(q, k, v))  # noqa: E731
    with pytest.raises(NotImplementedError, match="impl='pallas' is differentiable once"):
        jax.grad(lambda q: jnp.sum(jax.grad(first)(q)))(q)


# --- bidirectional attention (causal=False) ------------------------------------------------------------------------

def bidirectional_corope(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, sm_scale: float,
                         segment_ids: np.ndarray | None = None, window: int | None = None) -> np.ndarray:
    """Bidirectional Co-RoPE in float64 loops, from the maths: key j visible to query i iff same document and
    |i − j| < window; z_it = sigmoid(sm_scale·q^leader_i·k_t) for visible t, 0 otherwise; a_ij = Σ_{t≤j} z_it;
    Δ_ij = a_ii − a_ij; score_ij = sm_scale·Σ_d (E_A cos Δω_d − E_B sin Δω_d); softmax over the visible keys."""
    b, length, hq, dim = q.shape
    groups, half = hq // k.shape[2], dim // 2
    visible = bidirectional_visibility(b, length, segment_ids=segment_ids, window=window)  # [B, L, L]
    out = np.zeros(q.shape)
    for bi, i, h in np.ndindex(b, length, hq):
        g = h // groups
        leader = q[bi, i, g * groups]
        z = [npr.sigmoid(sm_scale * leader @ k[bi, t, g]) if visible[bi, i, t] else 0.0 for t in range(length)]
        a = np.cumsum(z)
        keys = np.flatnonzero(visible[bi, i])
        scores = []
        for j in keys:
            total = 0.0
            for d in range(half):
                phi = (a[i] - a[j]) * THETA ** (-2.0 * d / dim)
                q1, q2, k1, k2 = q[bi, i, h, d], q[bi, i, h, d + half], k[bi, j, g, d], k[bi, j, g, d + half]
                total += (q1 * k1 + q2 * k2) * math.cos(phi) - (q2 * k1 - q1 * k2) * math.sin(phi)
            scores.append(sm_scale * total)
        out[bi, i, h] = softmax_average(scores, v[bi, keys, g])
    return out


DOCUMENTS = jnp.array([[0] * 9 + [1] * 12, [0] * 4 + [1] * 10 + [2] * 7], jnp.int32)


@pytest.mark.parametrize("impl, heads, documents, window", [
    ("reference", MHA, True, 4), ("blockwise", GQA, True, 4), ("auto", MHA, False, None)])
def test_bidirectional_matches_numpy(impl, heads, documents, window):
    """causal=False against the NumPy restatement above: signed mileage, every visible key, documents and windows
    symmetric; blockwise in blocks of 8 (three)."""
    q, k, v, _ = inputs(2, 21, heads)
    segment_ids = DOCUMENTS if documents else None
    want = bidirectional_corope(*float64(q, k, v), sm_scale=0.3, window=window,
                                segment_ids=None if segment_ids is None else np.asarray(segment_ids))
    options = dict(theta=THETA, sm_scale=0.3, causal=False, segment_ids=segment_ids, window=window)
    if impl == "blockwise":
        fn = lambda q, k, v: corope_attention_blockwise(q, k, v, block_k=8, **options)  # noqa: E731
    else:
        fn = functools.partial(jaxpe.corope_attention, impl=impl, **options)
    np.testing.assert_allclose(compiled(fn, q, k, v), want, atol=2e-5, rtol=0)


def test_bidirectional_blockwise_grads_match_reference():
    """GQA, documents, a window, three blocks: gradients of blockwise's two walks against the dense autodiff."""
    q, k, v, cotangent = inputs(2, 21, GQA)
    options = dict(theta=THETA, sm_scale=0.3, causal=False, segment_ids=DOCUMENTS, window=5)
    got = outputs_and_grads(lambda q, k, v: corope_attention_blockwise(q, k, v, block_k=8, **options), (q, k, v),
                            cotangent)
    want = outputs_and_grads(lambda q, k, v: jaxpe.corope_attention(q, k, v, impl="reference", **options),
                             (q, k, v), cotangent)
    assert_matches(got, want, names=NAMES, tolerance=FLOAT32, context="bidirectional blockwise")


def test_bidirectional_constant_gates_is_rope_with_scaled_frequencies():
    """Leader queries orthogonal to every key make every gate sigmoid(0) = 1/2, so Δ_ij = (i − j)/2 on both sides:
    bidirectional RoPE with every ω_d halved (NumPy RoPE, softmax over all keys)."""
    q, k, v, _ = inputs(1, 12, GQA)
    pair = np.zeros(HEAD_DIM, bool)
    pair[[1, 1 + HEAD_DIM // 2]] = True  # the leaders live on rotary pair 1, the keys off it
    q = q.at[:, :, ::2].multiply(jnp.asarray(pair, jnp.float32))
    k = k * jnp.asarray(~pair, jnp.float32)[None, None, None]
    qn, kn, vn = float64(q, k, v)
    positions = np.arange(12)
    logits = 0.3 * npr.dot_logits(npr.rope(qn, positions, omega_scale=0.5), npr.rope(kn, positions, omega_scale=0.5))
    p = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("bhij,bjhd->bihd", p / p.sum(-1, keepdims=True), np.repeat(vn, 2, axis=2))
    got = compiled(functools.partial(corope_attention_blockwise, theta=THETA, sm_scale=0.3, block_k=8, causal=False),
                   q, k, v)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)


def test_bidirectional_diagonal_dominates_float32():
    """Rows whose own key dominates (unit rows u_i, q = 150·u, k = u: score_ii = 45, the others smaller by ~10):
    the two halves of blockwise's bidirectional walk share no key, so the tiny weights of the other keys survive in
    float32 (max error against float64 ≤ 2e-6)."""
    q, _, v, _ = inputs(1, 20, MHA)
    k = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
    q = 150.0 * k
    want = bidirectional_corope(*float64(q, k, v), sm_scale=0.3)
    off_diagonal = np.abs(want - np.asarray(v, np.float64)).max(axis=-1)  # ~ the weight of the other keys per row
    assert np.median(off_diagonal) < 1e-3 and off_diagonal.max() > 1e-6
    got = compiled(functools.partial(corope_attention_blockwise, theta=THETA, sm_scale=0.3, block_k=8, causal=False),
                   q, k, v)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)


def test_bidirectional_pallas_refuses_clearly():
    q, k, v, _ = inputs(1, 16, GQA)
    with pytest.raises(ValueError, match="causal=False.*impl='pallas'"):
        attention("pallas", causal=False)(q, k, v)
