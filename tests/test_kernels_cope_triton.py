"""The native Triton CoPE kernels (`jaxpe.kernels.cope_triton`) against the dense reference
`jaxpe.cope_attention(impl="reference")`: the output and the gradients of sum(o · cotangent) with respect to q, k,
v, pos_emb (and gate_k, and a traced sm_scale).

One covering sweep (not the Cartesian product): every value of L ∈ {1, 7, 40, 64, 77, 128, 130, 300} (64 and 128
multiples of the blocks: loads without row masks), G ∈ {1, 2, 4} (MQA among them), D ∈ {32, 64, 96, 128, 256} (96:
masked columns), float32/float16, saturated gate logits (|logit| ≈ 40), small and large npos (P − 1 never reached),
shared and per-head tables, gates from k and from a separate gate_k, packed documents, sliding windows and a traced
sm_scale each appear, with small, mixed and default block sizes. Without a GPU the kernels run in Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1), which multiplies bfloat16 dots wrongly (an upstream
limitation): the bfloat16 cases run on a GPU only.
"""
from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_harness import (GPU_TOLERANCE, TOLERANCE, assert_close, assert_matches_elementwise, float32_products,
                            outputs_and_grads, square_intermediates_of_grad)

import jaxpe

pytest.importorskip("triton")

from jaxpe.kernels import _triton_launch  # noqa: E402  (after the importorskip: it imports triton)
from jaxpe.kernels.cope_pallas import BlockSizes  # noqa: E402
from jaxpe.kernels.cope_triton import cope_attention_triton  # noqa: E402

INTERPRETED = _triton_launch.interpreted()
# float16 against the float16 reference on the CPU: ~3× the largest errors seen over the sweep. On a GPU bfloat16's
# bounds (float16 rounds finer).
TOLERANCES = {**TOLERANCE, "float16": {"out": (3e-3, 3e-3), "grad": (3e-2, 3e-3)}}
GPU_TOLERANCES = {**GPU_TOLERANCE, "float16": GPU_TOLERANCE["bfloat16"]}
BFLOAT16_ON_GPU = [pytest.mark.gpu,
                   pytest.mark.skipif(INTERPRETED, reason="bfloat16 sweeps run compiled on a GPU: in Triton's "
                                                          "interpreter the kernels compute on float32 copies "
                                                          "(test_edge_inputs.py checks that path)")]


@dataclasses.dataclass(frozen=True)
class Case:
    length: int  # L
    head_dim: int  # D
    groups: int  # G = Hq / Hkv
    npos: int  # P
    dtype: str
    kv_heads: int = 1  # Hkv
    blocks: BlockSizes | None = BlockSizes(16, 16, 16, 16)  # None: the defaults
    saturated: bool = False  # every gate logit ±40
    per_head: bool = False  # pos_emb [Hq, P, D]
    gate_k: bool = False  # gates from a separate gate_k
    documents: bool = False  # packed documents (segment_ids)
    window: int | None = None
    traced_scale: bool = False  # sm_scale an argument of the differentiated function

    def __str__(self) -> str:
        flags = [name for name in ("saturated", "per_head", "gate_k", "documents", "traced_scale")
                 if getattr(self, name)]
        flags += [] if self.window is None else [f"W{self.window}"]
        blocks = "default" if self.blocks is None else "x".join(map(str, dataclasses.astuple(self.blocks)))
        return "-".join([f"L{self.length}-D{self.head_dim}-H{self.groups * self.kv_heads}/{self.kv_heads}-"
                         f"P{self.npos}-{self.dtype}-blocks{blocks}", *flags])


CASES = [
    Case(length=1, head_dim=32, groups=1, npos=2, dtype="float32", traced_scale=True),
    Case(length=7, head_dim=64, groups=2, npos=4, dtype="float16", saturated=True, gate_k=True),
    Case(length=130, head_dim=32, groups=4, npos=64, dtype="float32", per_head=True, documents=True,
         blocks=BlockSizes(64, 16, 16, 32)),
    Case(length=300, head_dim=64, groups=1, npos=320, dtype="float32", kv_heads=2, gate_k=True, documents=True,
         window=100, blocks=BlockSizes(64, 32, 32, 64)),
    Case(length=130, head_dim=128, groups=2, npos=5, dtype="float16", gate_k=True, window=40, blocks=None),
    Case(length=64, head_dim=96, groups=4, npos=3, dtype="float32", per_head=True, gate_k=True, traced_scale=True,
         blocks=BlockSizes(16, 32, 32, 16)),
    Case(length=77, head_dim=64, groups=2, npos=8, dtype="float16", kv_heads=2, saturated=True, documents=True,
         window=30),
    Case(length=128, head_dim=32, groups=1, npos=16, dtype="float32", saturated=True, blocks=None),
    Case(length=40, head_dim=256, groups=1, npos=6, dtype="float32", gate_k=True),
]
GPU_CASES = [
    Case(length=300, head_dim=128, groups=4, npos=16, dtype="bfloat16", gate_k=True, documents=True, blocks=None),
    Case(length=130, head_dim=64, groups=1, npos=64, dtype="bfloat16", kv_heads=2, per_head=True, window=50,
         traced_scale=True, blocks=None),
]


def documents(batch: int, length: int, seed: int) -> jax.Array:
    """Document ids [B, L] int32: about one boundary per 25 tokens, at random."""
    starts = np.random.default_rng(seed).random((batch, length)) < 0.04
    return jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)


def make_inputs(case: Case) -> tuple[list[jax.Array], dict, jax.Array]:
    """(args, options, cotangent): args q [1, L, Hq, D], k, v [1, L, Hkv, D], pos_emb (then gate_k, then sm_scale
    when traced), the keyword options shared by the kernel and the reference, and a float32 cotangent like q."""
    keys = jax.random.split(jax.random.PRNGKey(case.length * 7 + case.head_dim + case.groups), 6)
    hkv, d = case.kv_heads, case.head_dim
    hq = hkv * case.groups
    q = jax.random.normal(keys[0], (1, case.length, hq, d))
    k, v, gate_k = (jax.random.normal(key, (1, case.length, hkv, d)) for key in keys[1:4])
    pos_emb = jax.random.normal(keys[4], ((hq,) if case.per_head else ()) + (case.npos, d))
    if case.saturated:  # feature 0 carries ±a on both sides, so that sm_scale·q·kg ≈ ±40
        a = float(np.sqrt(40.0 * np.sqrt(d)))
        signs = jnp.sign(jax.random.normal(keys[5], (1, case.length, hkv)))
        q = q.at[..., 1:].multiply(0.3).at[..., 0].set(a)
        gate_keys = (gate_k if case.gate_k else k).at[..., 1:].multiply(0.3).at[..., 0].set(a * signs)
        gate_k, k = (gate_keys, k) if case.gate_k else (gate_k, gate_keys)
    args = [x.astype(case.dtype) for x in (q, k, v, pos_emb)] + ([gate_k.astype(case.dtype)] if case.gate_k else [])
    if case.traced_scale:
        args.append(jnp.asarray(d ** -0.5, jnp.float32))
    options = dict(window=case.window, segment_ids=documents(1, case.length, case.length) if case.documents else None)
    return args, options, jax.random.normal(keys[5], q.shape)


def names(case: Case) -> list[str]:
    return ["out", "dq", "dk", "dv", "dpos_emb"] + ["dgate_k"] * case.gate_k + ["dsm_scale"] * case.traced_scale


def attention(impl, case: Case, options: dict):
    """impl(q, k, v, pos_emb, gate_k, sm_scale, **options) as a function of the case's args."""
    def call(q, k, v, pos_emb, *rest):
        gate_k = rest[0] if case.gate_k else None
        sm_scale = rest[-1] if case.traced_scale else case.head_dim ** -0.5
        return impl(q, k, v, pos_emb, gate_k, sm_scale, **options)

    return call


def triton_kernel(blocks: BlockSizes | None):
    return lambda q, k, v, e, gk, s, **o: cope_attention_triton(q, k, v, e, gk, sm_scale=s, block_sizes=blocks, **o)


@float32_products
def reference_impl(q, k, v, e, gk, s, **options):
    return jaxpe.cope_attention(q, k, v, e, sm_scale=s, gate_k=gk, impl="reference", **options)


@functools.lru_cache(maxsize=None)
def reference(case: Case) -> list[jax.Array]:
    """The dense reference's outputs and gradients, compiled with XLA's default options (at optimisation level 0,
    FAST_COMPILE, XLA's CPU backend returns NaN in some of its gradients)."""
    args, options, cotangent = make_inputs(case)
    return outputs_and_grads(attention(reference_impl, case, options), args, cotangent, compiler_options=None)


def assert_matches_reference(case: Case) -> None:
    """Every output and gradient elementwise within the dtype's tolerance; in 16-bit, d sm_scale beside its own
    rounding bound (`scale_gradient_slack`)."""
    args, options, cotangent = make_inputs(case)
    got = outputs_and_grads(attention(triton_kernel(case.blocks), case, options), args, cotangent)
    want = reference(case)
    table = TOLERANCES if INTERPRETED else GPU_TOLERANCES
    if case.traced_scale and case.dtype != "float32":
        atol, rtol = table[case.dtype]["grad"]
        slack = scale_gradient_slack(args[0], want[1], sm_scale=float(args[-1]))
        assert_close(got[-1], want[-1], tolerance=(atol + slack, rtol), context=f"dsm_scale of {case}")
        got, want = got[:-1], want[:-1]
    assert_matches_elementwise(got, want, names=names(case)[:len(got)], dtype=case.dtype, context=str(case),
                               table=table)


def scale_gradient_slack(q: jax.Array, dq: jax.Array, *, sm_scale: float) -> float:
    """What 16-bit rounding may add to d sm_scale = Σ q·dq / sm_scale (dq = ∂L/∂q): a sum whose terms cancel
    (in these cases their root sum of squares is about 20 times the sum, their magnitudes over a thousand times),
    each carrying the rounding of the kernel's 16-bit dot operands, so its error scales with the terms, not with
    the sum: 2⁻⁸ times their root sum of squares."""
    terms = np.asarray(q, np.float64) * np.asarray(dq, np.float64) / sm_scale
    return float(2.0 ** -8 * np.sqrt(np.sum(terms ** 2)))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case: Case):
    assert_matches_reference(case)


@pytest.mark.parametrize("case", [pytest.param(case, marks=BFLOAT16_ON_GPU) for case in GPU_CASES], ids=str)
def test_bfloat16_matches_reference(case: Case):
    assert_matches_reference(case)


def test_backward_never_builds_a_length_squared_array():
    """jax.grad's jaxpr holds no [.., L, .., L, ..] value (L = 1000), with gate_k and documents; the dense
    reference's does (the probe works)."""
    length, d = 1000, 32
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    q, k, v, gate_k = (jax.random.normal(key, (1, length, 2, d)) for key in keys[:4])
    pos_emb = jax.random.normal(keys[4], (16, d))
    segment_ids = documents(1, length, 0)
    kernel = functools.partial(cope_attention_triton, sm_scale=0.2, segment_ids=segment_ids, window=300)
    reference_fn = functools.partial(jaxpe.cope_attention, sm_scale=0.2, impl="reference")
    assert square_intermediates_of_grad(reference_fn, q, k, v, pos_emb, size=length)
    assert square_intermediates_of_grad(kernel, q, k, v, pos_emb, gate_k, size=length) == []


def test_differentiable_once_only():
    """jax.grad of jax.grad reaches the kernels' own rules, which say what to use instead."""
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 16, 1, 16))
    pos_emb = jnp.ones((4, 16))

    def loss(q):
        return jnp.sum(cope_attention_triton(q, q, q, pos_emb, sm_scale=0.25))

    with pytest.raises(NotImplementedError, match="impl='triton' is differentiable once"):
        jax.grad(lambda q: jnp.sum(jax.grad(loss)(q)))(q)


def test_no_queries_give_an_empty_output():
    q = jnp.zeros((2, 0, 2, 32))
    out = cope_attention_triton(q, q, q, jnp.zeros((4, 32)), sm_scale=0.1)
    assert out.shape == q.shape and out.dtype == q.dtype


def test_rejects_bad_inputs():
    q = jnp.zeros((1, 8, 2, 32))
    k = jnp.zeros((1, 8, 1, 32))
    e = jnp.zeros((4, 32))
    attention_fn = functools.partial(cope_attention_triton, sm_scale=0.1)
    with pytest.raises(ValueError, match="npos=1 must be"):
        attention_fn(q, k, k, jnp.zeros((1, 32)))
    with pytest.raises(ValueError, match="pos_emb"):
        attention_fn(q, k, k, jnp.zeros((4, 16)))
    with pytest.raises(ValueError, match="gate_k"):
        attention_fn(q, k, k, e, jnp.zeros((1, 8, 2, 32)))
    with pytest.raises(ValueError, match="Hq=3, Hkv=2"):
        attention_fn(jnp.zeros((1, 8, 3, 32)), jnp.zeros((1, 8, 2, 32)), jnp.zeros((1, 8, 2, 32)), e)
    with pytest.raises(TypeError, match="q.dtype"):
        attention_fn(q.astype(jnp.int32), k, k, e)
    with pytest.raises(ValueError, match="sm_scale=0.0 must be > 0"):
        cope_attention_triton(q, k, k, e, sm_scale=0.0)
    with pytest.raises(ValueError, match="head dim D=300"):
        attention_fn(jnp.zeros((1, 8, 2, 300)), jnp.zeros((1, 8, 1, 300)), jnp.zeros((1, 8, 1, 300)),
                     jnp.zeros((4, 300)))
    with pytest.raises(TypeError, match="block_sizes must be a BlockSizes"):
        attention_fn(q, k, k, e, block_sizes=(16, 16, 16, 16))
    with pytest.raises(ValueError, match="num_warps=0"):
        attention_fn(q, k, k, e, num_warps=0)
    with pytest.raises(ValueError, match="segment_ids must have shape"):
        attention_fn(q, k, k, e, segment_ids=jnp.zeros((1, 7), jnp.int32))
    with pytest.raises(TypeError, match="segment_ids must be an integer array"):
        attention_fn(q, k, k, e, segment_ids=jnp.zeros((1, 8)))
    with pytest.raises(ValueError, match="window=0"):
        attention_fn(q, k, k, e, window=0)


@pytest.mark.parametrize("present", [False, True])
def test_jax_triton_is_imported_with_the_driver_name_triton_3_6_lacks(monkeypatch, present: bool) -> None:
    """jax-triton 0.4.x imports TMA_TF32 from Triton's CUDA driver module and, where that fails (Triton 3.6, which
    torch 2.11 pins), silently drops its whole CUDA backend. The name is supplied with Triton 3.7's value before
    jax_triton is imported, and a Triton that has it keeps its own."""
    import sys

    driver = pytest.importorskip("triton.backends.nvidia.driver")
    if present:
        monkeypatch.setattr(driver, "TMA_TF32", 99, raising=False)
    else:
        monkeypatch.delattr(driver, "TMA_TF32", raising=False)
    fake = types.ModuleType("jax_triton")
    monkeypatch.setitem(sys.modules, "jax_triton", fake)
    assert _triton_launch._import_jax_triton() is fake
    assert driver.TMA_TF32 == (99 if present else 11)


def jax_triton_03_call(*args, kernel, out_shape, grid, name="", num_warps=None, num_stages=None,
                       compute_capability=None, enable_fp_fusion=True, zeroed_outputs=(), **metaparams):
    """jax-triton 0.3.1's triton_call: the parameters a launch passes."""


def jax_triton_04_call(*args, kernel, out_type=None, grid, name="", num_warps=None, num_stages=None,
                       compute_capability=None, backend_options=None, zeroed_outputs=(), **kwargs):
    """jax-triton 0.4.1's triton_call: the parameters a launch passes."""


@pytest.mark.parametrize("api, output, fusion", [
    (jax_triton_03_call, "out_shape", ("enable_fp_fusion", True)),
    (jax_triton_04_call, "out_type", ("backend_options", {"enable_fp_fusion": True}))])
def test_compiled_launch_speaks_the_installed_jax_triton_api(monkeypatch, api, output, fusion) -> None:
    """A compiled launch names the output types and FP fusion as the installed triton_call's signature does: 0.3's
    out_shape and enable_fp_fusion, 0.4's out_type and backend_options. Both are read from its one
    `inspect.signature`, so also through a wrapper (functools.wraps), whose own code names neither."""
    passed = {}

    @functools.wraps(api)
    def triton_call(*args, **kwargs):
        passed.update(kwargs)
        return [jnp.zeros(s.shape, s.dtype) for s in kwargs.get("out_type") or kwargs["out_shape"]]

    monkeypatch.setattr(_triton_launch, "_jax_triton", lambda: types.SimpleNamespace(triton_call=triton_call))
    out_shapes = [jax.ShapeDtypeStruct((4,), jnp.float32)]
    out = _triton_launch._launch_compiled(lambda: None, [jnp.ones(4)], out_shapes=out_shapes, grid=(1,), num_warps=4,
                                          num_stages=2, zeroed=(), name="probe", BLOCK=4)
    assert [x.shape for x in out] == [(4,)]
    api_names = {"out_shape", "out_type", "enable_fp_fusion", "backend_options"}
    assert {name: passed[name] for name in api_names & set(passed)} == {output: out_shapes, fusion[0]: fusion[1]}


@pytest.mark.parametrize("rows, warps, want", [(64, 4, True), (128, 4, True), (32, 4, False), (16, 1, True),
                                               (64, 8, False), (128, 8, True), (32, 2, True)])
def test_adds_in_place_only_with_16_rows_a_warp(monkeypatch, rows: int, warps: int, want: bool) -> None:
    """Compiled (not interpreted), ∂L/∂z's adds go in place exactly where the tile gives every warp 16 rows; in the
    interpreter never (tl.atomic_add there). tests/test_triton_ownership.py checks the rule on compiled layouts."""
    from jaxpe.kernels import _triton_memory

    assert _triton_memory.scatter_in_place(rows, warps) is (want and not INTERPRETED)
    monkeypatch.setattr(_triton_memory, "interpreted", lambda: False)
    assert _triton_memory.scatter_in_place(rows, warps) is want


@pytest.mark.parametrize("head_dim, dtype, gate_k, want", [
    (64, "bfloat16", False, BlockSizes(64, 32, 64, 32)),  # 64-row forward tiles (16-bit, Dp 64), 64-row backward
    (32, "float16", False, BlockSizes(64, 32, 64, 32)),
    (128, "bfloat16", False, BlockSizes(64, 32, 64, 32)),
    (64, "float32", False, BlockSizes(32, 32, 64, 32)),
    (128, "float32", False, BlockSizes(32, 32, 64, 16)),
    (256, "bfloat16", False, BlockSizes.default(256, jnp.bfloat16)),  # Dp 256 and gate_k: the Pallas defaults
    (64, "bfloat16", True, BlockSizes.default(64, jnp.bfloat16, gate_k=True)),
])
def test_default_blocks(head_dim: int, dtype: str, gate_k: bool, want: BlockSizes) -> None:
    from jaxpe.kernels.cope_triton import default_blocks

    assert default_blocks(head_dim, jnp.dtype(dtype), gate_k=gate_k, num_warps_bwd=4) == want
    assert default_blocks(64, jnp.dtype(jnp.bfloat16), gate_k=False, num_warps_bwd=8).block_q_bwd == 128


def test_given_block_sizes_are_kept_and_capped_at_the_length() -> None:
    """A user's sizes win over `default_blocks`; every size is capped at the padded length."""
    from jaxpe.kernels import cope_triton

    seen = []
    launch = cope_triton.launch

    def record(kernel, args, **kwargs):
        seen.append((kwargs["name"], kwargs["BLOCK_Q"], kwargs["BLOCK_K"]))
        return launch(kernel, args, **kwargs)

    q = jnp.ones((1, 40, 2, 64), jnp.float32)
    table = jnp.ones((8, 64), jnp.float32)
    for blocks in (BlockSizes(block_q_bwd=16), None):
        seen.clear()
        with pytest.MonkeyPatch.context() as m:
            m.setattr(cope_triton, "launch", record)
            jax.grad(lambda q: cope_attention_triton(q, q, q, table, sm_scale=0.125, block_sizes=blocks).sum())(q)
        want_bwd = 16 if blocks else 64  # 64 rows, the default for float32 at Dp 64, fit a length of 40
        assert set(seen) == {("cope_triton_forward", 32, 32), ("cope_triton_backward", want_bwd, 32)}, seen
