"""Co-RoPE with packed documents, padding, sliding windows and caller-given frequencies, in every implementation.

Checked against things the code under test did not derive: `restated` below (Co-RoPE restated from its definition with
the mileage as a_ii − a_ij of a forward cumsum, and a visibility mask written from the definition), plain softmax
attention (Co-RoPE with every ω = 0), and identities: a packed row equals its documents run on their own, padding
changes nothing, θ^(−2d/D) passed as inv_freq equals the default. Pallas runs in interpret mode on CPU.

B batch, L length, N query heads, K key/value heads, D head dim.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_harness import FAST_COMPILE, TOLERANCE
from kernel_harness import assert_close as harness_assert_close

import jaxpe
from jaxpe.attention_core import AttentionContext
from jaxpe.corope import CoRoPECore
from jaxpe.kernels.corope_pallas import BlockSizes, corope_attention_pallas
from jaxpe.kernels.corope_blockwise import corope_attention_blockwise
from jaxpe.softmax_attention import PAD_SEGMENT

THETA = 10000.0
D = 16
SM_SCALE = D ** -0.5
BLOCKWISE_BLOCK = 8
PALLAS_BLOCKS = BlockSizes(block_q=16, block_k=16, block_d=16, block_q_bwd=16, block_k_bwd=16)
IMPLS = ["reference", "blockwise", "pallas"]
NAMES = ["o", "dq", "dk", "dv"]
OMEGA = THETA ** (-2.0 * np.arange(D // 2) / D)


# --- independent restatement -------------------------------------------------------------------------------------

def visible(length: int, segment_ids: np.ndarray | None = None, window: int | None = None, batch: int = 1
            ) -> np.ndarray:
    """[B, L, L] bool: key j visible to query i iff j ≤ i, same document, i − j < window."""
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    mask = (j <= i) & ((i - j < window) if window is not None else True)
    mask = np.broadcast_to(mask, (batch if segment_ids is None else len(segment_ids), length, length))
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return mask


def restated(q, k, v, mask, omega):
    """Co-RoPE by its definition, dense, float32: z_ij = sigmoid(sm_scale·q^leader_i·k_j) on visible keys (0 elsewhere),
    a_ij = Σ_{t≤j} z_it, Δ_ij = a_ii − a_ij, score = sm_scale·Σ_d (E_A cos Δω_d − E_B sin Δω_d), softmax over the
    visible keys. q [B, L, N, D], k/v [B, L, K, D], mask [B, L, L], omega [D/2] -> [B, L, N, D]."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    hi = jax.lax.Precision.HIGHEST
    leaders = q[:, :, ::groups]
    z = jax.nn.sigmoid(SM_SCALE * jnp.einsum("bikd,bjkd->bkij", leaders, k, precision=hi))
    z = jnp.where(mask[:, None], z, 0.0)
    a = jnp.cumsum(z, axis=-1)
    delta = jnp.diagonal(a, axis1=-2, axis2=-1)[..., None] - a  # [B, K, L, L]
    delta = jnp.repeat(delta, groups, axis=1)
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    half = q.shape[-1] // 2
    q1, q2, k1, k2 = q[..., :half], q[..., half:], k[..., :half], k[..., half:]
    pair = lambda x, y: jnp.einsum("bihd,bjhd->bhijd", x, y, precision=hi)
    e_a, e_b = pair(q1, k1) + pair(q2, k2), pair(q2, k1) - pair(q1, k2)
    phi = delta[..., None] * jnp.asarray(omega, jnp.float32).reshape(1, 1, 1, 1, -1)
    scores = SM_SCALE * jnp.sum(e_a * jnp.cos(phi) - e_b * jnp.sin(phi), axis=-1)
    p = jax.nn.softmax(jnp.where(mask[:, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhij,bjhd->bihd", p, v, precision=hi)


def plain_attention(q, k, v):
    """Causal softmax(sm_scale·q·k) v with GQA, float32."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    hi = jax.lax.Precision.HIGHEST
    s = SM_SCALE * jnp.einsum("bihd,bjhd->bhij", q, k, precision=hi)
    s = jnp.where(visible(q.shape[1])[:, None], s, -jnp.inf)
    return jnp.einsum("bhij,bjhd->bihd", jax.nn.softmax(s, axis=-1), v, precision=hi)


# --- runners (jitted once per implementation and static setting, reused across inputs) ----------------------------

def attention(impl: str, q, k, v, *, segment_ids=None, window=None, inv_freq=None):
    options = dict(theta=THETA, sm_scale=SM_SCALE, segment_ids=segment_ids, window=window, inv_freq=inv_freq)
    if impl == "reference":
        return jaxpe.corope_attention(q, k, v, impl="reference", **options)
    if impl == "blockwise":
        return corope_attention_blockwise(q, k, v, block_k=BLOCKWISE_BLOCK, **options)
    return corope_attention_pallas(q, k, v, block_sizes=PALLAS_BLOCKS, interpret=True, **options)


def with_grads(f):
    """(q, k, v, *rest, ct) -> [f(q, k, v, *rest), d/dq, d/dk, d/dv of sum(f·ct)], jitted."""
    def run(q, k, v, *rest):
        *rest, ct = rest
        out, pullback = jax.vjp(lambda q, k, v: f(q, k, v, *rest), q, k, v)
        return [out, *pullback(ct.astype(out.dtype))]
    return jax.jit(run, compiler_options=FAST_COMPILE)


@functools.cache
def runner(impl: str, window: int | None = None):
    """(q, k, v, segment_ids, inv_freq, ct) -> [o, dq, dk, dv] of one implementation."""
    return with_grads(lambda q, k, v, seg, freq: attention(impl, q, k, v, segment_ids=seg, window=window,
                                                           inv_freq=freq))


restated_run = with_grads(restated)  # (q, k, v, mask, omega, ct)


def assert_close(got, want, *, dtype="float32", context="", exact=False):
    """[o, dq, dk, dv] against want's, every element within the kernel tests' tolerance for dtype (exact: 1e-6)."""
    for index, (name, x, y) in enumerate(zip(NAMES, got, want)):
        tolerance = (1e-6, 1e-6) if exact else TOLERANCE[dtype]["grad" if index else "out"]
        harness_assert_close(x, y, tolerance=tolerance, context=f"{name} of {context}")


def normal(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


# --- packed documents and padding --------------------------------------------------------------------------------

# Row 0 packs documents 5 (tokens 0–9 and 19–26: documents need not be contiguous), 7 and 9; row 1 is right-padded,
# row 2 left-padded. Each is compared with the same tokens run alone (right-padded to 30 with junk, no segment ids).
PACKED_IDS = np.array([[5] * 10 + [7] * 9 + [5] * 8 + [9] * 10,
                       [1] * 30 + [PAD_SEGMENT] * 7,
                       [PAD_SEGMENT] * 7 + [2] * 30], np.int32)
ALONE_LEN = 30


def _documents() -> list[tuple[int, np.ndarray]]:
    """(packed row, token positions) of each document, in the order of the batch run alone."""
    docs = [(0, np.flatnonzero(PACKED_IDS[0] == doc)) for doc in (5, 7, 9)]
    return docs + [(1, np.arange(30)), (2, np.arange(7, 37))]


@functools.cache
def packing_runs(impl: str):
    """(packed [o, dq, dk, dv] [3, 37, ...], alone [o, dq, dk, dv] [5, 30, ...]); N 4, K 2."""
    rng = np.random.default_rng(1)
    alone = [normal(rng, (5, ALONE_LEN, heads, D)) for heads in (4, 2, 2, 4)]
    packed = [3.0 * normal(rng, (3, 37, heads, D)) for heads in (4, 2, 2)]  # junk where padded
    packed.append(np.zeros((3, 37, 4, D), np.float32))  # the loss reads only real tokens
    for index, (row, positions) in enumerate(_documents()):
        n = len(positions)
        alone[3][index, n:] = 0.0
        for x, a in zip(packed, alone):
            x[row, positions] = a[index, :n]
    got_packed = runner(impl)(*packed[:3], PACKED_IDS, None, packed[3])
    got_alone = runner(impl)(*alone[:3], None, None, alone[3])
    return got_packed, got_alone


@pytest.mark.parametrize("impl", IMPLS)
def test_packed_row_equals_documents_run_alone(impl):
    packed, alone = packing_runs(impl)
    for index, (row, positions) in enumerate(_documents()[:3]):
        assert_close([x[row, positions] for x in packed], [x[index, :len(positions)] for x in alone],
                     context=f"{impl}, document {index} of the packed row")


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_never_changes_real_tokens(impl):
    packed, alone = packing_runs(impl)
    for index, (row, positions) in enumerate(_documents()[3:], start=3):
        side = "right" if row == 1 else "left"
        assert_close([x[row, positions] for x in packed], [x[index] for x in alone], context=f"{impl}, {side} padding")
        pads = np.setdiff1d(np.arange(37), positions)
        for name, x in zip(NAMES[1:], packed[1:]):  # nothing real reads a padded token
            np.testing.assert_allclose(np.asarray(x[row, pads]), 0.0, atol=1e-6, err_msg=f"{name} at {side} padding")


# --- sliding windows (with documents, GQA 4:1, L not a multiple of any block) -------------------------------------

WINDOW_LEN = 40
WINDOW_IDS = np.array([[0] * WINDOW_LEN, [0] * 15 + [1] * 25], np.int32)


def window_inputs(dtype=jnp.float32):
    """q, k, v, ct: N 4, K 1 (one group of four)."""
    rng = np.random.default_rng(2)
    return tuple(jnp.asarray(normal(rng, (2, WINDOW_LEN, heads, D)), dtype) for heads in (4, 1, 1, 4))


@pytest.mark.parametrize("window", [1, 5, 21, 100], ids=["w1", "w5-under-a-block", "w21-spans-blocks", "w100-over-L"])
@pytest.mark.parametrize("impl", IMPLS)
def test_window_matches_restated(impl, window):
    q, k, v, ct = window_inputs()
    got = runner(impl, window)(q, k, v, WINDOW_IDS, None, ct)
    want = restated_run(q, k, v, visible(WINDOW_LEN, WINDOW_IDS, window), OMEGA, ct)
    assert_close(got, want, context=f"{impl}, window {window}")


@pytest.mark.parametrize("impl", ["blockwise", "pallas"])
def test_window_skips_blocks_outside_it(impl):
    """A visited tile multiplies its masked NaN values by 0 (NaN), as the window-less runs show; with window 5:
    - key 0 is NaN: no query from the third block on (rows ≥ 2·block) may visit key block 0 (forward and backward);
    - the last query is NaN: no key block before the last two may meet the last query block in the backward
      (the dk/dv walk over query blocks)."""
    block = BLOCKWISE_BLOCK if impl == "blockwise" else PALLAS_BLOCKS.block_q
    padded = -(-WINDOW_LEN // block) * block
    q, k, v, ct = (np.array(x) for x in window_inputs())
    bad_k, bad_v, bad_q = k.copy(), v.copy(), q.copy()
    bad_k[:, 0] = bad_v[:, 0] = np.nan
    bad_q[:, -1] = np.nan
    clean = 2 * block  # rows and keys from here on never meet key block 0
    early = padded - 2 * block  # keys before this never meet the last query block
    for window, check in ((5, np.isfinite), (100, lambda x: ~np.isfinite(x))):  # window ≥ L: every block visited
        o, dq, dk, dv = runner(impl, window)(q, bad_k, bad_v, WINDOW_IDS, None, ct)
        for name, x in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
            assert np.all(check(np.asarray(x[0, clean:]))), f"{name} with key 0 NaN, {impl}, window {window}"
        _, _, dk, dv = runner(impl, window)(bad_q, k, v, WINDOW_IDS, None, ct)
        for name, x in (("dk", dk), ("dv", dv)):
            assert np.all(check(np.asarray(x[0, :early]))), f"{name} with the last query NaN, {impl}, window {window}"


# --- caller-given frequencies ------------------------------------------------------------------------------------

def freq_inputs():
    """q, k, v, ct shaped as the documents run alone (the same executables)."""
    rng = np.random.default_rng(3)
    return tuple(normal(rng, (5, ALONE_LEN, heads, D)) for heads in (4, 2, 2, 4))


@pytest.mark.parametrize("impl", IMPLS)
def test_inv_freq(impl):
    q, k, v, ct = freq_inputs()
    run = runner(impl)  # one executable for every inv_freq value (a traced argument)
    scaled = (OMEGA / 4.0).astype(np.float32)
    scaled[-3:] = 0.0  # partial rotary: the last three pairs do not rotate
    want = restated_run(q, k, v, visible(ALONE_LEN, batch=5), scaled, ct)
    assert_close(run(q, k, v, None, jnp.asarray(scaled), ct), want, context=f"{impl}, scaled partial inv_freq")
    default = run(q, k, v, None, None, ct)
    assert_close(run(q, k, v, None, jnp.asarray(OMEGA, jnp.float32), ct), default, exact=True,
                 context=f"{impl}, inv_freq = θ^(−2d/D) against the default")
    zero = run(q, k, v, None, jnp.zeros(D // 2, jnp.float32), ct)
    assert_close(zero, with_grads(plain_attention)(q, k, v, ct), context=f"{impl}, inv_freq = 0 is plain attention")


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_inv_freq_is_a_constant(impl):
    q, k, v, _ = freq_inputs()
    loss = lambda f: jnp.sum(attention(impl, q, k, v, inv_freq=f))
    grad = jax.jit(jax.grad(loss), compiler_options=FAST_COMPILE)(jnp.asarray(OMEGA, jnp.float32))
    np.testing.assert_array_equal(grad, 0.0)


# --- bfloat16, the public entry point and the layer core -----------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_smoke(impl):
    q, k, v, ct = window_inputs(jnp.bfloat16)
    got = runner(impl, 21)(q, k, v, WINDOW_IDS, None, ct)
    assert all(x.dtype == jnp.bfloat16 for x in got)
    want = restated_run(q, k, v, visible(WINDOW_LEN, WINDOW_IDS, 21), OMEGA, ct)
    assert_close(got, want, dtype="bfloat16", context=f"{impl}, bfloat16")


@pytest.mark.parametrize("impl", IMPLS)
def test_public_entry_passes_everything_through(impl):
    q, k, v, _ = window_inputs()
    freq = jnp.asarray(OMEGA / 2.0, jnp.float32)
    public = functools.partial(jaxpe.corope_attention, window=7, impl=impl)
    got = jax.jit(public, compiler_options=FAST_COMPILE)(q, k, v, segment_ids=WINDOW_IDS, inv_freq=freq)
    want = restated_run(q, k, v, visible(WINDOW_LEN, WINDOW_IDS, 7), freq, jnp.zeros_like(q))[0]
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_core_reads_documents_window_and_frequencies_from_the_context():
    q, k, v, _ = window_inputs()
    freq = tuple(float(w) for w in OMEGA / 3.0)
    core = CoRoPECore(impl="blockwise", inv_freq=freq)
    pos = jnp.broadcast_to(jnp.arange(WINDOW_LEN), (2, WINDOW_LEN))
    ctx = AttentionContext(x=q[..., 0], q_pos=pos, k_pos=pos, segment_ids=WINDOW_IDS, window=9)
    want = restated_run(q, k, v, visible(WINDOW_LEN, WINDOW_IDS, 9), np.asarray(freq), jnp.zeros_like(q))[0]
    apply = jax.jit(core.apply, compiler_options=FAST_COMPILE)
    np.testing.assert_allclose(apply({}, q, k, v, ctx), want, atol=2e-5)
    dense = AttentionContext(x=q[..., 0], q_pos=pos, k_pos=pos, mask=jnp.asarray(visible(WINDOW_LEN, WINDOW_IDS, 9)))
    np.testing.assert_allclose(apply({}, q, k, v, dense), want, atol=2e-5)
    with pytest.raises(ValueError, match="inv_freq"):
        CoRoPECore(inv_freq=(1.0, 0.5)).apply({}, q, k, v, ctx)


# --- argument checks ---------------------------------------------------------------------------------------------

ENTRIES = {
    "public": lambda q, k, v, **kw: jaxpe.corope_attention(q, k, v, impl="reference", **kw),
    "blockwise": lambda q, k, v, **kw: corope_attention_blockwise(q, k, v, theta=THETA, sm_scale=SM_SCALE, **kw),
    "pallas": lambda q, k, v, **kw: corope_attention_pallas(q, k, v, theta=THETA, sm_scale=SM_SCALE,
                                                            interpret=True, **kw),
}
BAD = [
    (dict(segment_ids=jnp.zeros((2, 8), jnp.float32)), TypeError, "segment_ids"),
    (dict(segment_ids=jnp.zeros((2, 9), jnp.int32)), ValueError, "segment_ids"),
    (dict(segment_ids=jnp.zeros((8,), jnp.int32)), ValueError, "segment_ids"),
    (dict(window=0), ValueError, "window"),
    (dict(window=-3), ValueError, "window"),
    (dict(window=2.5), ValueError, "window"),
    (dict(window=True), ValueError, "window"),
    (dict(inv_freq=jnp.ones(D, jnp.float32)), ValueError, "inv_freq"),
    (dict(inv_freq=jnp.ones((1, D // 2), jnp.float32)), ValueError, "inv_freq"),
    (dict(inv_freq=jnp.ones(D // 2, jnp.int32)), TypeError, "inv_freq"),
    (dict(inv_freq=jnp.full(D // 2, jnp.nan, jnp.float32)), ValueError, "inv_freq"),
    (dict(inv_freq=jnp.full(D // 2, jnp.inf, jnp.float32)), ValueError, "inv_freq"),
]


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("kwargs, error, name", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_invalid_arguments(entry, kwargs, error, name):
    q = jnp.ones((2, 8, 2, D))
    k = jnp.ones((2, 8, 1, D))
    with pytest.raises(error, match=name):
        ENTRIES[entry](q, k, k, **kwargs)
