"""CoPE with packed documents, padding and sliding windows (every impl), and x-transformers' CoPE variants.

The references are not the code tested: a NumPy restatement of CoPE (arXiv 2405.18719) with a visibility mask written
from its definition (key j visible to query i iff j ≤ i, same document, i − j < window), and the identity that a
packed row equals its documents run on their own (through the plain causal reference, no mask). Pallas runs in
interpret mode on tiny shapes; blockwise and Pallas use small blocks so that several blocks, partial blocks and
skipped blocks are exercised.
"""
from __future__ import annotations

import functools

import jax
import jax.extend.core as jex_core
import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_harness import TOLERANCE
from kernel_harness import assert_close as harness_assert_close

import jaxpe
from jaxpe.attention_core import AttentionContext
from jaxpe.cope import CoPEConfig
from jaxpe.kernels.cope_pallas import BlockSizes, cope_attention_pallas
from jaxpe.kernels.cope_blockwise import cope_attention_blockwise
from jaxpe.softmax_attention import PAD_SEGMENT

SM_SCALE = 0.25
IMPLS = ("reference", "blockwise", "pallas")


# --- an independent NumPy restatement --------------------------------------------------------------------------

def np_visible(length: int, segment_ids=None, window=None, batch: int = 1) -> np.ndarray:
    """[B, L, L] bool from the definition: j ≤ i, same document, i − j < window."""
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    mask = np.broadcast_to(j <= i, (batch, length, length)).copy()
    if window is not None:
        mask &= i - j < window
    if segment_ids is not None:
        ids = np.asarray(segment_ids)
        mask &= ids[:, :, None] == ids[:, None, :]
    return mask


def np_cope(q, k, v, pos_emb, *, mask, gate_k=None, soft_onehot_temp=None, talking_heads=None) -> np.ndarray:
    """CoPE in float64: gates σ(sm_scale·q·kg) (optionally mixed across heads first) zeroed where invisible,
    p = reverse cumsum clamped to npos − 1, linear interpolation (or the soft one-hot readout) of z = q·e,
    softmax of sm_scale·(q·k + pos) over visible keys, times v."""
    q, k, v, e = (np.asarray(x, np.float64) for x in (q, k, v, pos_emb))
    kg = k if gate_k is None else np.asarray(gate_k, np.float64)
    groups, npos = q.shape[2] // k.shape[2], e.shape[-2]
    k, v, kg = (np.repeat(x, groups, axis=2) for x in (k, v, kg))
    visible = mask[:, None]  # [B, 1, L, L]
    s = SM_SCALE * np.einsum("bihd,bjhd->bhij", q, kg)
    if talking_heads is not None:
        s = np.einsum("gh,bhij->bgij", np.asarray(talking_heads, np.float64), np.where(visible, s, 0.0))
    g = np.where(visible, 1.0 / (1.0 + np.exp(-s)), 0.0)
    p = np.minimum(np.flip(np.cumsum(np.flip(g, -1), -1), -1), npos - 1)
    z = np.einsum("bihd,pd->bhip", q, e) if e.ndim == 2 else np.einsum("bihd,hpd->bhip", q, e)
    if soft_onehot_temp is None:
        lo = np.floor(p).astype(int)
        hi, w = np.minimum(lo + 1, npos - 1), p - lo
        pos = (1 - w) * np.take_along_axis(z, lo, -1) + w * np.take_along_axis(z, hi, -1)
    else:
        a = -np.abs(p[..., None] - np.arange(npos)) / soft_onehot_temp
        w = np.exp(a - a.max(-1, keepdims=True))
        pos = np.einsum("bhijp,bhip->bhij", w / w.sum(-1, keepdims=True), z)
    logits = np.where(visible, SM_SCALE * (np.einsum("bihd,bjhd->bhij", q, k) + pos), -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bhij,bjhd->bihd", probs / probs.sum(-1, keepdims=True), v)


# --- the implementations under test ------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("impl", "window"))
def attention(impl: str, q, k, v, pos_emb, gate_k=None, *, segment_ids=None, window=None):
    """CoPE through one impl, with small blocks (blockwise BK 8, C 16; Pallas 16)."""
    if impl == "blockwise":
        return cope_attention_blockwise(q, k, v, pos_emb, gate_k, sm_scale=SM_SCALE, block_k=8, block_q=16,
                                        segment_ids=segment_ids, window=window)
    if impl == "pallas":
        blocks = BlockSizes(16, 16, 16, 16)
        return cope_attention_pallas(q, k, v, pos_emb, gate_k, sm_scale=SM_SCALE, block_sizes=blocks, interpret=True,
                                     segment_ids=segment_ids, window=window)
    return jaxpe.cope_attention(q, k, v, pos_emb, sm_scale=SM_SCALE, gate_k=gate_k, segment_ids=segment_ids,
                                window=window, impl="reference")


def inputs(seed: int, *, batch: int, length: int, heads: int, kv_heads: int, npos: int = 6, dim: int = 16,
           per_head: bool = False, gate_k: bool = False, dtype=jnp.float32):
    """q [B, L, Hq, D], k/v (and gate_k) [B, L, Hkv, D], pos_emb [npos, D] or [Hq, npos, D], cotangent (float32)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, length, heads, dim))
    k, v = (rng.standard_normal((batch, length, kv_heads, dim)) for _ in range(2))
    pos_emb = rng.standard_normal(((heads,) if per_head else ()) + (npos, dim))
    gk = rng.standard_normal(k.shape) if gate_k else None
    cotangent = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    cast = lambda x: None if x is None else jnp.asarray(x, dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(pos_emb), cast(gk), cotangent


def assert_close(got, want, dtype: str, what: str, kind: str = "out") -> None:
    """Every element within the kernel tests' tolerance for dtype and kind ("out" or "grad")."""
    harness_assert_close(got, want, tolerance=TOLERANCE[dtype][kind], context=what)


# --- packed documents and padding ----------------------------------------------------------------------------------

PAD = int(PAD_SEGMENT)
LENGTH = 36
# Row 0: three documents of 12 tokens, document 0 not contiguous (tokens 0–6 and 19–23). Row 1: left padding, one
# document, right padding.
PACKED_IDS = np.array([[0] * 7 + [1] * 12 + [0] * 5 + [2] * 12,
                       [PAD] * 5 + [7] * 12 + [PAD] * 19], np.int32)


def documents(ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(row, token indices) of every real document."""
    return [(b, np.flatnonzero(ids[b] == d)) for b in range(ids.shape[0]) for d in np.unique(ids[b]) if d != PAD]


@functools.lru_cache(maxsize=None)
def packed_case():
    """Inputs (GQA Hq 4 / Hkv 2, per-head table, gate_k) and the expected output and gradients, every document run on
    its own: outputs by NumPy, gradients of Σ_real out·cotangent by the plain causal reference (no mask)."""
    q, k, v, e, gk, cot = inputs(1, batch=2, length=LENGTH, heads=4, kv_heads=2, per_head=True, gate_k=True)
    cot = cot * (PACKED_IDS != PAD)[:, :, None, None]
    docs = documents(PACKED_IDS)  # every document has 12 tokens: run them alone as one batch
    gather = lambda x: jnp.asarray(np.stack([np.asarray(x)[b, idx] for b, idx in docs]))  # noqa: E731
    alone = [gather(x) for x in (q, k, v)] + [e, gather(gk)]
    plain = functools.partial(jaxpe.cope_attention, sm_scale=SM_SCALE, impl="reference")  # causal, no mask
    alone_grads = jax.jit(lambda args, cot: jax.vjp(lambda q, k, v, e, gk: plain(q, k, v, e, gate_k=gk),
                                                    *args)[1](cot))(alone, gather(cot))
    alone_out = np_cope(*alone[:4], gate_k=alone[4], mask=np_visible(12, batch=len(docs)))
    out = np.zeros(q.shape)
    grads = [np.zeros(x.shape) for x in (q, k, v, e, gk)]
    for n, (b, idx) in enumerate(docs):
        out[b, idx] = alone_out[n]
        for total, part in zip(grads[:3] + grads[4:], alone_grads[:3] + alone_grads[4:]):
            total[b, idx] += np.asarray(part[n])
    grads[3] = np.asarray(alone_grads[3])
    return (q, k, v, e, gk, cot), out, grads


@pytest.mark.parametrize("impl", IMPLS)
def test_packed_and_padded_rows_equal_documents_run_alone(impl: str):
    (q, k, v, e, gk, cot), want_out, want_grads = packed_case()
    ids = jnp.asarray(PACKED_IDS)

    def run(q, k, v, e, gk):
        out, pullback = jax.vjp(lambda *a: attention(impl, *a, segment_ids=ids), q, k, v, e, gk)
        return out, pullback(cot)

    out, grads = jax.jit(run)(q, k, v, e, gk)
    real = PACKED_IDS != PAD
    assert_close(np.asarray(out)[real], want_out[real], "float32", f"{impl} out")
    for name, got, want in zip(("dq", "dk", "dv", "dpos_emb", "dgate_k"), grads, want_grads):
        assert_close(got, want, "float32", f"{impl} {name}", "grad")  # padded tokens get no gradient


def test_padding_is_the_same_however_much_there_is():
    """Left- and right-padding a document by different amounts (blockwise; the block boundaries move) never changes
    its tokens' outputs."""
    q, k, v, e, _, _ = inputs(2, batch=1, length=20, heads=2, kv_heads=1)
    alone = attention("blockwise", q, k, v, e)
    left = [(0, 0), (5, 0), (0, 0), (0, 0)]
    padded_reference = jaxpe.cope_attention(*(jnp.pad(x, left, constant_values=9.0) for x in (q, k, v)), e,
                                            sm_scale=SM_SCALE, padding_mask=jnp.arange(25)[None] >= 5,
                                            impl="reference")  # keys at padding: no gate, no weight
    assert_close(padded_reference[:, 5:], alone, "float32", "padding_mask")
    paddings = ((0, 13), (13, 0), (3, 10))  # right, left, both: rows of 33

    def padded(x):
        return jnp.concatenate([jnp.pad(x, [(0, 0), pad, (0, 0), (0, 0)], constant_values=5.0) for pad in paddings])

    ids = jnp.asarray([[PAD] * left + [3] * 20 + [PAD] * right for left, right in paddings], jnp.int32)
    out = attention("blockwise", padded(q), padded(k), padded(v), e, segment_ids=ids)
    for row, (left, right) in enumerate(paddings):
        assert_close(out[row:row + 1, left:left + 20], alone, "float32", f"padding {left}, {right}")


# --- sliding windows -------------------------------------------------------------------------------------------------

WINDOW_IDS = np.array([[0] * 15 + [1] * 21, [4] * 36], np.int32)


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
@pytest.mark.parametrize("window, documents", [(1, False), (5, True), (20, False), (100, True)])
def test_window_matches_numpy(impl: str, window: int, documents: bool):
    """Windows 1, < block, spanning blocks, > L; with and without documents."""
    q, k, v, e, _, _ = inputs(3, batch=2, length=LENGTH, heads=4, kv_heads=1)
    ids = WINDOW_IDS if documents else None
    out = attention(impl, q, k, v, e, segment_ids=None if ids is None else jnp.asarray(ids), window=window)
    want = np_cope(q, k, v, e, mask=np_visible(LENGTH, ids, window, batch=2))
    assert_close(out, want, "float32", f"{impl} window={window} documents={documents}")


@pytest.mark.parametrize("window", [1, 20])
def test_pallas_window_forward_matches_numpy(window: int):
    q, k, v, e, _, _ = inputs(4, batch=1, length=LENGTH, heads=2, kv_heads=1)
    out = attention("pallas", q, k, v, e, window=window)
    assert_close(out, np_cope(q, k, v, e, mask=np_visible(LENGTH, None, window)), "float32",
                 f"pallas window={window}")


@pytest.mark.parametrize("impl", ["blockwise", "pallas"])
def test_window_gradients_match_the_dense_reference(impl: str):
    """Window 5 (< block: the Pallas forward/dq kernels skip key blocks, dk/dv skips query blocks) with documents;
    the output against NumPy, the gradients against the dense reference under the same mask."""
    args, want = window_case("reference")
    got = window_case(impl)[1]
    assert_close(got[0], np_cope(*args[:4], gate_k=args[4], mask=np_visible(LENGTH, WINDOW_IDS, 5, batch=2)),
                 "float32", f"{impl} out")
    for name, x, y in zip(("dq", "dk", "dv", "dpos_emb", "dgate_k"), got[1:], want[1:]):
        assert_close(x, y, "float32", f"{impl} {name}", "grad")


@functools.lru_cache(maxsize=None)
def window_case(impl: str):
    """Inputs and [out, dq, dk, dv, dpos_emb, dgate_k] of `impl` with documents and window 5."""
    q, k, v, e, gk, cot = inputs(5, batch=2, length=LENGTH, heads=4, kv_heads=2, gate_k=True)
    ids = jnp.asarray(WINDOW_IDS)

    @jax.jit
    def run(*args):
        out, pullback = jax.vjp(lambda *a: attention(impl, *a, segment_ids=ids, window=5), *args)
        return [out, *pullback(cot)]

    return (q, k, v, e, gk), run(q, k, v, e, gk)


def test_pallas_window_never_reads_skipped_blocks():
    """Window 5, blocks of 16, L 48. Batch row 0: keys 0–15 (k, v, gate_k) are NaN, so any query block that loads key
    block 0 gets NaN (0·NaN in probs·v); rows 32–47 (first key block 1) and their dq must come out finite and right.
    Batch row 1: the cotangent of rows 32–47 is NaN, so the dk/dv kernel of key block 0 must stop before query block 2:
    dk, dv, dgate_k of keys 0–15 finite and right. 'Right' is the dense reference on the clean inputs."""
    q, k, v, e, gk, cot = inputs(10, batch=2, length=48, heads=2, kv_heads=1, gate_k=True)
    nan = jnp.nan
    poisoned = [x.at[0, :16].set(nan) for x in (k, v, gk)]
    bad_cot = cot.at[1, 32:].set(nan)

    def run(impl, q, k, v, e, gk, cot):
        out, pullback = jax.vjp(lambda *a: attention(impl, *a, window=5), q, k, v, e, gk)
        return [out, *pullback(cot)]

    got = jax.jit(functools.partial(run, "pallas"))(q, poisoned[0], poisoned[1], e, poisoned[2], bad_cot)
    want = jax.jit(functools.partial(run, "reference"))(q, k, v, e, gk, cot)
    assert_close(got[0][0, 32:], want[0][0, 32:], "float32", "out of rows 32-47")
    assert_close(got[1][0, 32:], want[1][0, 32:], "float32", "dq of rows 32-47", "grad")
    for name, index in (("dk", 2), ("dv", 3), ("dgate_k", 5)):
        assert_close(got[index][1, :16], want[index][1, :16], "float32", f"{name} of keys 0-15", "grad")
    assert np.isnan(np.asarray(got[0][0, 16:32])).any()  # the poison reaches the blocks that are walked


def _scan_chains(jaxpr: jex_core.Jaxpr, outer: int = 1) -> list[int]:
    """For every scan in `jaxpr` (nested jaxprs included), the product of its length and those of the scans around
    it: how many times its body runs. Raises if a while loop (a dynamic trip count) is found."""
    found = []
    for eqn in jaxpr.eqns:
        assert eqn.primitive.name != "while", "a key-block loop with a dynamic trip count"
        inner = outer * eqn.params["length"] if eqn.primitive.name == "scan" else outer
        if eqn.primitive.name == "scan":
            found.append(inner)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jex_core.ClosedJaxpr):
                    found += _scan_chains(sub.jaxpr, inner)
                elif isinstance(sub, jex_core.Jaxpr):
                    found += _scan_chains(sub, inner)
    return found


@pytest.mark.parametrize("length", [1024, 2048])
def test_window_skips_key_blocks(length: int):
    """Windowed blockwise (W 64, BK 16, C 64) walks L/C chunks × (C/BK + ⌈(W − 1)/BK⌉) = L/16 · 2 key blocks in the
    forward and in the backward, static trip counts (no while loop): linear in L, not the L²/(2·BK²) of causal."""
    q = jnp.zeros((1, length, 2, 16))
    k = jnp.zeros((1, length, 1, 16))
    pos_emb = jnp.zeros((8, 16))
    f = functools.partial(cope_attention_blockwise, sm_scale=SM_SCALE, block_k=16, block_q=64, window=64)
    blocks = length // 64 * (4 + 4)
    forward = max(_scan_chains(jax.make_jaxpr(f)(q, k, k, pos_emb).jaxpr))
    assert forward == blocks
    grad = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2, 3)))(q, k, k, pos_emb)
    assert max(_scan_chains(grad.jaxpr)) == blocks
    assert blocks * 8 < (length // 16) ** 2 / 2  # far fewer than the causal tiles


# --- GQA, bf16 -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_smoke(impl: str):
    q, k, v, e, _, _ = inputs(6, batch=2, length=24, heads=4, kv_heads=2, dtype=jnp.bfloat16)
    out = attention(impl, q, k, v, e, segment_ids=jnp.asarray(WINDOW_IDS[:, 4:28]), window=9)
    assert out.dtype == jnp.bfloat16
    want = np_cope(*(np.asarray(x, np.float32) for x in (q, k, v, e)), mask=np_visible(24, WINDOW_IDS[:, 4:28], 9, 2))
    assert_close(out, want, "bfloat16", f"{impl} bfloat16")


# --- x-transformers' variants ----------------------------------------------------------------------------------------

def test_variants_match_numpy():
    q, k, v, e, gk, _ = inputs(7, batch=2, length=24, heads=4, kv_heads=2, gate_k=True)
    mix = jnp.asarray(np.random.default_rng(8).standard_normal((4, 4)), jnp.float32)
    ids = WINDOW_IDS[:, 4:28]
    variant = jax.jit(functools.partial(jaxpe.cope_attention, sm_scale=SM_SCALE),
                      static_argnames=("window", "soft_onehot_temp"))
    for options, ids_, window in ((dict(soft_onehot_temp=0.05), None, None), (dict(soft_onehot_temp=0.7), ids, 7),
                                  (dict(talking_heads=mix), ids, 7), (dict(soft_onehot_temp=0.3, talking_heads=mix),
                                                                      None, None)):
        out = variant(q, k, v, e, gate_k=gk, window=window,
                      segment_ids=None if ids_ is None else jnp.asarray(ids_), **options)
        want = np_cope(q, k, v, e, gate_k=gk, mask=np_visible(24, ids_, window, 2), **options)
        assert_close(out, want, "float32", f"{sorted(options)} window={window}")
    plain = np_cope(q, k, v, e, mask=np_visible(24, batch=2))
    soft = np_cope(q, k, v, e, mask=np_visible(24, batch=2), soft_onehot_temp=0.05)
    assert np.max(np.abs(plain - soft)) > 1e-3  # the readout differs from interpolation: the test can fail


def _core_output(config: CoPEConfig, q, k, v, ctx: AttentionContext, *, params=None):
    core = config.core(head_dim=q.shape[3], max_len=q.shape[1], impl="auto")
    params = jax.jit(core.init)(jax.random.PRNGKey(0), q, k, v, ctx) if params is None else params
    return jax.jit(core.apply)(params, q, k, v, ctx), params


def test_core_passes_documents_windows_and_variants():
    """CoPECore: documents and window reach the function (fast path) and the dense path (ctx.mask); talking heads
    start as plain CoPE (identity) and learn a mix; soft one-hot reads the table through the softmax."""
    q, k, v, e, _, _ = inputs(9, batch=2, length=24, heads=4, kv_heads=2, npos=6)
    ids = jnp.asarray(WINDOW_IDS[:, 4:28])
    pos = jnp.broadcast_to(jnp.arange(24), (2, 24))
    ctx = AttentionContext(x=jnp.zeros((2, 24, 8)), q_pos=pos, k_pos=pos, segment_ids=ids, window=6, pos_emb=e)
    mask = np_visible(24, WINDOW_IDS[:, 4:28], 6, 2)
    plain_out, _ = _core_output(CoPEConfig(), q, k, v, ctx)
    assert_close(plain_out, np_cope(q, k, v, e, mask=mask), "float32", "core")
    dense_ctx = AttentionContext(x=ctx.x, q_pos=pos, k_pos=pos, mask=jnp.asarray(mask), pos_emb=e)
    assert_close(_core_output(CoPEConfig(), q, k, v, dense_ctx)[0], plain_out, "float32", "dense mask")
    talking_out, params = _core_output(CoPEConfig(talking_heads=True), q, k, v, ctx)
    np.testing.assert_array_equal(nn.meta.unbox(params)["params"]["talking_heads"], np.eye(4))
    assert_close(talking_out, plain_out, "float32", "talking heads at init")
    mix = jnp.asarray(np.random.default_rng(1).standard_normal((4, 4)), jnp.float32)
    mixed, _ = _core_output(CoPEConfig(talking_heads=True), q, k, v, ctx, params={"params": {"talking_heads": mix}})
    assert_close(mixed, np_cope(q, k, v, e, mask=mask, talking_heads=mix), "float32", "talking heads")
    soft, _ = _core_output(CoPEConfig(soft_onehot=True, soft_onehot_temp=0.2), q, k, v, dense_ctx)
    assert_close(soft, np_cope(q, k, v, e, mask=mask, soft_onehot_temp=0.2), "float32", "soft one-hot")


def test_core_parameters_carry_logical_axis_names():
    q, k, v, _, _, _ = inputs(11, batch=1, length=8, heads=4, kv_heads=2)
    pos = jnp.broadcast_to(jnp.arange(8), (1, 8))
    ctx = AttentionContext(x=jnp.ones((1, 8, 12)), q_pos=pos, k_pos=pos)
    config = CoPEConfig(gates="sep_keys", per_head=True, add_relative=True, talking_heads=True, npos=5)
    params = config.core(head_dim=16, max_len=8, impl="auto").init(jax.random.PRNGKey(0), q, k, v, ctx)["params"]
    boxed = lambda leaf: isinstance(leaf, nn.LogicallyPartitioned)  # noqa: E731
    leaves = jax.tree_util.tree_leaves(params, is_leaf=boxed)
    assert len(leaves) == 4 and all(boxed(leaf) and len(leaf.names) == leaf.value.ndim for leaf in leaves)
    assert params["pos_emb"].names == ("heads", "positions", "head_dim")


# --- errors ----------------------------------------------------------------------------------------------------------

def test_rejects_bad_settings():
    q = jnp.zeros((1, 8, 2, 16))
    k = jnp.zeros((1, 8, 1, 16))
    e = jnp.zeros((4, 16))
    for fn in (functools.partial(cope_attention_blockwise, sm_scale=0.1),
               functools.partial(cope_attention_pallas, sm_scale=0.1, interpret=True),
               functools.partial(jaxpe.cope_attention, impl="reference")):
        with pytest.raises(ValueError, match=r"segment_ids must have shape \[B=1, L=8\]"):
            fn(q, k, k, e, segment_ids=jnp.zeros((1, 7), jnp.int32))
        with pytest.raises(TypeError, match="segment_ids must be an integer array"):
            fn(q, k, k, e, segment_ids=jnp.zeros((1, 8)))
        for window in (0, True, 2.0):
            with pytest.raises(ValueError, match=f"window={window!r} must be None or an int >= 1"):
                fn(q, k, k, e, window=window)
    for impl in ("blockwise", "pallas"):
        for options in (dict(soft_onehot_temp=0.1), dict(talking_heads=jnp.eye(2))):
            with pytest.raises(ValueError, match=f"impl='{impl}' cannot run CoPE's soft one-hot readout or talking"):
                jaxpe.cope_attention(q, k, k, e, impl=impl, **options)
        with pytest.raises(ValueError, match=f"impl='{impl}' cannot run"):
            CoPEConfig(talking_heads=True).core(head_dim=16, max_len=8, impl=impl)
    for temp in (0.0, -1.0, float("inf"), float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="soft_onehot_temp="):
            CoPEConfig(soft_onehot=True, soft_onehot_temp=temp)
        with pytest.raises(ValueError, match="soft_onehot_temp="):
            jaxpe.cope_attention(q, k, k, e, soft_onehot_temp=temp)
    for name in ("soft_onehot", "talking_heads"):
        with pytest.raises(ValueError, match=f"{name}=1 must be a bool"):
            CoPEConfig(**{name: 1})
    with pytest.raises(ValueError, match=r"talking_heads must be a float \[Hq=2, Hq=2\]"):
        jaxpe.cope_attention(q, k, k, e, talking_heads=jnp.eye(3))
    CoPEConfig(soft_onehot=True, talking_heads=True).core(head_dim=16, max_len=8, impl="reference")  # accepted
