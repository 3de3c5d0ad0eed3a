"""The native Triton stick-breaking kernels (`jaxpe.kernels.stickbreaking_triton`) against the dense reference
`jaxpe.stickbreaking_attention(impl="reference")` and the NumPy restatement: the output, the remainder and the
gradients of a loss of both with respect to q, k, v (and a traced sm_scale).

One covering sweep (not the Cartesian product): every value of L ∈ {1, 7, 40, 64, 77, 128, 130} (64 and 128
multiples of the blocks: loads without row masks), G ∈ {1, 2, 4} (MQA among them), D ∈ {32, 64, 96, 128, 256} (96:
masked columns), float32/float16, attend_current, packed documents, sliding windows, large logits (|z| ≈ 30, where
σ saturates) and a traced sm_scale each appear, with small, mixed and default block sizes (query blocks larger and
smaller than key blocks: the unmasked tiles before a query block's first row start at different keys). Without a
GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), which multiplies bfloat16
dots wrongly (an upstream limitation): the bfloat16 cases run on a GPU only.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_harness import assert_matches, assert_matches_elementwise, float32_products, square_intermediates_of_grad

import jaxpe
import numpy_reference as ref

pytest.importorskip("triton")

# the native kernels' sweep settings: TRITON_INTERPRET=1 or not, tolerances with float16, bfloat16 on a GPU only
from test_kernels_cope_triton import (BFLOAT16_ON_GPU, GPU_TOLERANCES, INTERPRETED, TOLERANCES,  # noqa: E402
                                      documents)

from jaxpe.kernels import _triton_launch  # noqa: E402  (after the importorskip: it imports triton)
from jaxpe.kernels.stickbreaking_pallas import BlockSizes  # noqa: E402
from jaxpe.kernels.stickbreaking_triton import default_blocks, stickbreaking_attention_triton  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Case:
    length: int  # L
    head_dim: int  # D
    groups: int  # G = Hq / Hkv
    dtype: str
    kv_heads: int = 1  # Hkv
    blocks: BlockSizes | None = BlockSizes(16, 16, 16, 16)  # None: the defaults
    attend_current: bool = False
    documents: bool = False  # packed documents (segment_ids)
    window: int | None = None
    large: bool = False  # logits of about ±30 on feature 0
    traced_scale: bool = False  # sm_scale an argument of the differentiated function

    def __str__(self) -> str:
        flags = [name for name in ("attend_current", "documents", "large", "traced_scale") if getattr(self, name)]
        flags += [] if self.window is None else [f"W{self.window}"]
        blocks = "default" if self.blocks is None else "x".join(map(str, dataclasses.astuple(self.blocks)))
        return "-".join([f"L{self.length}-D{self.head_dim}-H{self.groups * self.kv_heads}/{self.kv_heads}-"
                         f"{self.dtype}-blocks{blocks}", *flags])


CASES = [
    Case(length=1, head_dim=32, groups=1, dtype="float32", attend_current=True, traced_scale=True),
    Case(length=7, head_dim=64, groups=2, dtype="float16", large=True),
    Case(length=130, head_dim=32, groups=4, dtype="float32", documents=True, blocks=BlockSizes(64, 16, 16, 32)),
    Case(length=77, head_dim=96, groups=1, dtype="float32", kv_heads=2, window=20, attend_current=True,
         blocks=BlockSizes(16, 32, 32, 16)),
    Case(length=128, head_dim=128, groups=2, dtype="float16", blocks=None),
    Case(length=64, head_dim=64, groups=4, dtype="float32", large=True, blocks=BlockSizes(32, 16, 16, 32)),
    Case(length=40, head_dim=256, groups=1, dtype="float32", documents=True, window=9),
    Case(length=130, head_dim=64, groups=1, dtype="float32", kv_heads=2, attend_current=True, traced_scale=True,
         blocks=None),
]
GPU_CASES = [
    Case(length=300, head_dim=128, groups=4, dtype="bfloat16", documents=True, blocks=None),
    Case(length=130, head_dim=64, groups=1, dtype="bfloat16", kv_heads=2, window=50, attend_current=True,
         traced_scale=True, blocks=None),
]


def make_inputs(case: Case) -> tuple[list[jax.Array], dict, tuple[jax.Array, jax.Array]]:
    """(args, options, cotangents): q [1, L, Hq, D], k, v [1, L, Hkv, D] (then sm_scale when traced), the keyword
    options the kernel and the reference share, and float32 cotangents of the output and the remainder."""
    keys = jax.random.split(jax.random.PRNGKey(case.length * 7 + case.head_dim + case.groups), 6)
    hkv, d = case.kv_heads, case.head_dim
    hq = hkv * case.groups
    q = jax.random.normal(keys[0], (1, case.length, hq, d))
    k, v = (jax.random.normal(key, (1, case.length, hkv, d)) for key in keys[1:3])
    if case.large:  # feature 0 carries ±a on both sides, so that D^−½·q·k ≈ ±30
        a = float(np.sqrt(30.0 * np.sqrt(d)))
        signs = jnp.sign(jax.random.normal(keys[3], (1, case.length, hkv)))
        q = q.at[..., 1:].multiply(0.3).at[..., 0].set(a)
        k = k.at[..., 1:].multiply(0.3).at[..., 0].set(a * signs)
    args = [x.astype(case.dtype) for x in (q, k, v)]
    if case.traced_scale:
        args.append(jnp.asarray(d ** -0.5, jnp.float32))
    options = dict(window=case.window, attend_current=case.attend_current,
                   segment_ids=documents(1, case.length, case.length) if case.documents else None)
    return args, options, (jax.random.normal(keys[4], q.shape), jax.random.normal(keys[5], q.shape[:3]))


def attention(impl, case: Case, options: dict):
    """impl(q, k, v, sm_scale, **options) -> (out, remainder) as a function of the case's args."""
    def call(q, k, v, *rest):
        return impl(q, k, v, rest[0] if case.traced_scale else case.head_dim ** -0.5, **options)

    return call


def outputs_and_grads(fn, args: list[jax.Array], cotangents: tuple[jax.Array, jax.Array]) -> list[jax.Array]:
    """[out, remainder, d args...] of sum(out·c_out) + sum(remainder·c_rem)."""
    out, vjp = jax.vjp(fn, *args)
    grads = vjp(tuple(c.astype(o.dtype) for c, o in zip(cotangents, out)))
    return [*out, *grads]


def triton_kernel(blocks: BlockSizes | None):
    return lambda q, k, v, s, **o: stickbreaking_attention_triton(q, k, v, sm_scale=s, block_sizes=blocks, **o)


@float32_products
def reference_impl(q, k, v, s, **options):
    out, remainder = jaxpe.stickbreaking_attention(q, k, v, sm_scale=s, impl="reference", return_remainder=True,
                                                   **options)
    return out, remainder.astype(jnp.float32)


def assert_matches_reference(case: Case) -> None:
    """Every output and gradient elementwise within the dtype's tolerance; with large logits the gradients within
    the tolerance's rtol times max(1, max |want|) per array instead. Where σ saturates, the backward's
    ∂L/∂z = A·w·σ(−z) − σ(z)·(do·o + ρ − S) subtracts two sums of the size of do·o (as the authors' kernels and the
    blockwise path do), whose float32 rounding (~1e-7 of them) is left where the exact gradient is about 0."""
    args, options, cotangents = make_inputs(case)
    got = jax.jit(lambda *a: outputs_and_grads(attention(triton_kernel(case.blocks), case, options), a,
                                               cotangents))(*args)
    want = jax.jit(lambda *a: outputs_and_grads(attention(reference_impl, case, options), a, cotangents))(*args)
    names = ["out", "remainder", "dq", "dk", "dv"] + ["dsm_scale"] * case.traced_scale
    table = TOLERANCES if INTERPRETED else GPU_TOLERANCES
    if case.large:
        assert_matches_elementwise(got[:2], want[:2], names=names[:2], dtype=case.dtype, context=str(case),
                                   table={case.dtype: {**table[case.dtype], "grad": table[case.dtype]["out"]}})
        assert_matches(got[2:], want[2:], names=names[2:], tolerance=(table[case.dtype]["grad"][1],) * 2,
                       context=str(case))
    else:
        assert_matches_elementwise(got, want, names=names, dtype=case.dtype, context=str(case), table=table)


@pytest.mark.parametrize("case", [*CASES, *(pytest.param(case, marks=BFLOAT16_ON_GPU) for case in GPU_CASES)],
                         ids=str)
def test_matches_reference(case: Case):
    """The sweep, and bfloat16 on a GPU."""
    assert_matches_reference(case)


def test_through_the_public_function_equals_the_numpy_restatement():
    """impl="triton" from jaxpe.stickbreaking_attention (GQA 4/2, attend_current) against tests/numpy_reference.py,
    remainder included."""
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    q = jax.random.normal(keys[0], (2, 19, 4, 16))
    k, v = (jax.random.normal(key, (2, 19, 2, 16)) for key in keys[1:])
    out, remainder = jaxpe.stickbreaking_attention(q, k, v, impl="triton", attend_current=True, return_remainder=True)
    want, want_remainder = ref.stickbreaking_attention(*map(np.asarray, (q, k, v)), attend_current=True)
    atol, rtol = (2e-5, 2e-5) if INTERPRETED else GPU_TOLERANCES["float32"]["out"]  # TF32 products on a GPU
    np.testing.assert_allclose(out, want, atol=atol, rtol=rtol)
    np.testing.assert_allclose(remainder, want_remainder, atol=atol / 10, rtol=rtol)


def test_the_layer_runs_the_triton_kernels():
    """A TransformerLM with stick-breaking attention and impl="triton" gives the impl="reference" model's logits and
    gradients (the same parameters)."""
    config = jaxpe.ModelConfig(vocab_size=11, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_len=24,
                               pe="stickbreaking", dropout=0.0, impl="triton")
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 24), 0, 11)
    params = jaxpe.TransformerLM(config).init(jax.random.PRNGKey(1), tokens)

    def loss(impl: str):
        model = jaxpe.TransformerLM(dataclasses.replace(config, impl=impl))
        return lambda p: jnp.mean(model.apply(p, tokens) ** 2)

    got, want = (jax.value_and_grad(loss(impl))(params) for impl in ("triton", "reference"))
    tol = 1e-5 if INTERPRETED else GPU_TOLERANCES["float32"]["out"][1]  # TF32 products on a GPU
    np.testing.assert_allclose(got[0], want[0], rtol=tol)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(g, w, atol=tol, rtol=10 * tol)


def test_default_blocks_fit_the_length():
    """Short sequences shrink the default tiles to the next power of two >= L (>= 16): one tile, no wasted rows."""
    args, options, _ = make_inputs(Case(length=20, head_dim=64, groups=1, dtype="float32", blocks=None))
    seen = []
    launch = _triton_launch.launch

    def recording(kernel, *rest, **kwargs):
        seen.append((kwargs["BLOCK_Q"], kwargs["BLOCK_K"]))
        return launch(kernel, *rest, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("jaxpe.kernels.stickbreaking_triton.launch", recording)
        stickbreaking_attention_triton(*args, sm_scale=0.125, **options)
    assert default_blocks(64, jnp.float32).block_q > 32 and seen == [(32, 32)]


def test_backward_never_builds_a_length_squared_array():
    """jax.grad's jaxpr holds no [.., L, .., L, ..] value (L = 1000), with documents and a window; the dense
    reference's does (the probe works)."""
    length = 1000
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    q, k, v = (jax.random.normal(key, (1, length, 2, 16)) for key in keys)
    segment_ids = documents(1, length, 0)
    kernel = functools.partial(stickbreaking_attention_triton, sm_scale=0.2, segment_ids=segment_ids, window=300)
    reference_fn = functools.partial(jaxpe.stickbreaking_attention, sm_scale=0.2, impl="reference",
                                     return_remainder=True)
    both = lambda fn: lambda *a: sum(jnp.sum(x) for x in fn(*a))  # noqa: E731
    assert square_intermediates_of_grad(both(reference_fn), q, k, v, size=length)
    assert square_intermediates_of_grad(both(kernel), q, k, v, size=length) == []


def test_differentiable_once_only():
    """jax.grad of jax.grad reaches the kernels' own rule, which says what to use instead."""
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 16, 1, 16))
    first = jax.grad(lambda x: jnp.sum(stickbreaking_attention_triton(x, q, q, sm_scale=0.25)[0]))
    with pytest.raises(Exception, match="triton"):
        jax.grad(lambda x: jnp.sum(first(x)))(q)


@pytest.mark.parametrize(("options", "match"), [
    (dict(block_sizes=(16, 16, 16, 16)), "block_sizes"),
    (dict(num_warps=0), "num_warps"),
])
def test_bad_tuning_arguments_name_themselves(options, match):
    q = jnp.zeros((1, 8, 1, 16))
    with pytest.raises((TypeError, ValueError), match=match):
        stickbreaking_attention_triton(q, q, q, sm_scale=0.25, **options)


def test_refuses_float64_naming_the_paths_that_take_it():
    """The native kernels take float32 and 16-bit inputs; float64 is refused with what runs it instead."""
    with jax.enable_x64(True):
        q = jnp.zeros((1, 8, 1, 16), jnp.float64)
        with pytest.raises(TypeError, match="impl='triton'.*blockwise"):
            stickbreaking_attention_triton(q, q, q, sm_scale=0.25)
