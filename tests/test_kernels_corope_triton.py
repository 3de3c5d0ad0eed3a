"""Co-RoPE's native Triton kernels (kernels/corope_triton.py) against jaxpe's dense reference: outputs and every
gradient.

A covering sweep of L ∈ {1, 7, 48, 130, 300}, D ∈ {32, 64, 96, 128} (96: padded tiles), G ∈ {1, 2, 3, 4} (MQA
included), batch 1 and 2, float32 and float16, saturated gates (|logit| ≥ 30), packed documents, sliding windows,
caller-given rotary frequencies, a traced sm_scale, default and hand-picked blocks (rectangular, several rotary chunks,
several heads per program). Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), which multiplies bfloat16 dots wrongly: bfloat16 runs compiled on a GPU only, as does the whole
sweep.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("triton")

from kernel_harness import (GPU_TOLERANCE, TOLERANCE, assert_matches_elementwise, float32_products,  # noqa: E402
                            outputs_and_grads, square_intermediates_of_grad)
from test_kernels_corope import THETA, Case, make_inputs, reference  # noqa: E402

import jaxpe  # noqa: E402
from jaxpe.kernels import _triton_launch  # noqa: E402  (after the importorskip: it imports triton)
from jaxpe.base import rotary_frequencies  # noqa: E402
from jaxpe.kernels.corope_triton import BlockSizes, corope_attention_triton  # noqa: E402

KEY = jax.random.PRNGKey(1)
NAMES = ["o", "dq", "dk", "dv"]
# float16 keeps 3 more mantissa bits than bfloat16: the kernels round P to float16 for the PV and dV dots (the
# reference multiplies in float32).
TRITON_TOLERANCE = {**TOLERANCE, "float16": {"out": (2e-3, 2e-3), "grad": (2e-2, 4e-3)}}
TRITON_GPU_TOLERANCE = {**GPU_TOLERANCE, "float16": TRITON_TOLERANCE["float16"]}


@dataclasses.dataclass(frozen=True)
class Options:
    """What a case changes beyond `Case`: the batch, documents (segment ids), a window, caller frequencies, kernel
    blocks, and the blocks used where the kernels are compiled (a GPU) instead of interpreted. Large rotary chunks
    keep the interpreter fast but take a compiler minutes: the [block_d, block_q, block_k] rotary temporaries
    unroll (block_d 64 over 32×64 backward tiles: 10 MiB of PTX and 270 s in Triton alone, where these take a few
    seconds)."""

    batch: int = 1
    documents: bool = False
    window: int | None = None
    inv_freq: bool = False
    blocks: BlockSizes | None = None
    gpu_blocks: BlockSizes | None = None

    def __str__(self) -> str:
        parts = [f"B{self.batch}"] * (self.batch > 1) + ["docs"] * self.documents
        parts += [f"w{self.window}"] * (self.window is not None)
        return "-".join(parts + ["inv_freq"] * self.inv_freq + ["blocks"] * (self.blocks is not None)) or "plain"


def segment_ids(batch: int, length: int) -> jax.Array:
    """[B, L] contiguous documents of random lengths in each row."""
    return jnp.sort(jax.random.randint(jax.random.PRNGKey(7), (batch, length), 0, 4), axis=1).astype(jnp.int32)


def frequencies(head_dim: int) -> jax.Array:
    """[D/2] scaled frequencies whose last quarter does not rotate (partial rotary)."""
    omega = 0.5 * rotary_frequencies(head_dim, THETA)
    return jnp.where(jnp.arange(head_dim // 2) < 3 * head_dim // 8, omega, 0.0)


def keywords(case: Case, options: Options) -> dict:
    """The keyword arguments both attentions take for `options`."""
    return dict(theta=THETA, segment_ids=segment_ids(options.batch, case.length) if options.documents else None,
                window=options.window, inv_freq=frequencies(case.head_dim) if options.inv_freq else None)


def run(attention, case: Case, options: Options) -> list[jax.Array]:
    """[o, dq, dk, dv] of attention(q, k, v, sm_scale=D^−½, **keywords) on `make_inputs(case, ·)` of
    options.batch keys, concatenated along the batch."""
    rows = [make_inputs(case, key) for key in jax.random.split(KEY, options.batch)]
    q, k, v, cotangent = (jnp.concatenate(x, axis=0) for x in zip(*rows))
    given = keywords(case, options)
    return outputs_and_grads(lambda q, k, v: attention(q, k, v, sm_scale=q.shape[-1] ** -0.5, **given), (q, k, v),
                             cotangent)


def triton_attention(options: Options):
    compiled = not _triton_launch.interpreted()
    blocks = options.gpu_blocks if compiled and options.gpu_blocks is not None else options.blocks
    return functools.partial(corope_attention_triton, block_sizes=blocks)


@float32_products
def reference_attention(q, k, v, **given):
    return jaxpe.corope_attention(q, k, v, impl="reference", **given)


SMALL = BlockSizes(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16, block_d=16)
# (case, options): each value of every axis appears; the blocks keep the interpreter fast and vary the tiling, and
# the GPU blocks vary it as much in chunks a compiler unrolls in seconds.
SWEEP = [
    (Case(1, 32, 1, 2, "float32"), Options()),
    # G = 3: one head per program. The default blocks here (on a GPU) cut D 64 into 32 one-pair backward chunks,
    # which the interpreter runs op by op (two minutes); there, 16-pair chunks.
    (Case(7, 64, 2, 3, "float16"), Options(batch=2, documents=True, blocks=BlockSizes(block_d=16),
                                           gpu_blocks=BlockSizes())),
    (Case(48, 32, 1, 4, "float16"), Options(batch=2, window=20)),  # default blocks: 4 heads, 4 rotary chunks
    (Case(64, 64, 2, 2, "float32"), Options(inv_freq=True, window=24, blocks=SMALL)),
    (Case(130, 96, 1, 4, "float32", saturated=True),
     Options(blocks=BlockSizes(block_q=32, block_k=64, block_q_bwd=64, block_k_bwd=32, block_d=16, block_h=4,
                               block_h_bwd=4),
             gpu_blocks=BlockSizes(block_q=32, block_k=16, block_q_bwd=16, block_k_bwd=32, block_d=4, block_h=4,
                                   block_h_bwd=4))),
    (Case(130, 128, 2, 1, "float16", saturated=True),
     Options(documents=True, blocks=BlockSizes(block_q=64, block_k=32, block_q_bwd=32, block_k_bwd=64,
                                               block_d=64),
             gpu_blocks=BlockSizes(block_q=32, block_k=32, block_q_bwd=32, block_k_bwd=16, block_d=8, block_d_bwd=2))),
    (Case(300, 32, 1, 2, "float32"),
     Options(documents=True, window=100, blocks=BlockSizes(block_q=64, block_k=64, block_q_bwd=64, block_k_bwd=64,
                                                           block_d=16),
             gpu_blocks=BlockSizes(block_q=64, block_k=16, block_q_bwd=16, block_k_bwd=64, block_d=2, block_d_bwd=1))),
    (Case(300, 64, 1, 4, "float16", saturated=True),
     Options(window=40, blocks=BlockSizes(block_q=64, block_k=32, block_q_bwd=64, block_k_bwd=32, block_d=32),
             gpu_blocks=BlockSizes(block_q=16, block_k=64, block_q_bwd=32, block_k_bwd=32, block_d=8, block_h=2,
                                   block_d_bwd=2, block_h_bwd=2))),
]
IDS = [f"{case}-{options}" for case, options in SWEEP]


def assert_matches_reference(case: Case, options: Options, table: dict) -> None:
    assert_matches_elementwise(run(triton_attention(options), case, options),
                               run(reference_attention, case, options), names=NAMES, dtype=case.dtype,
                               context=f"{case}-{options}", table=table)


class TestCoRoPETriton:
    """The sweep in Triton's interpreter, or compiled when a GPU runs the tests (then with the GPU's float32
    tolerance: TF32 dots)."""

    @pytest.mark.parametrize("case, options", SWEEP, ids=IDS)
    def test_matches_reference(self, case, options):
        table = TRITON_GPU_TOLERANCE if jax.default_backend() == "gpu" else TRITON_TOLERANCE
        assert_matches_reference(case, options, table)

    def test_traced_sm_scale(self):
        """sm_scale as an operand (a learned temperature): its gradient too, Σ dq·q / sm_scale."""
        case = Case(40, 32, 1, 2, "float32")
        q, k, v, cotangent = make_inputs(case, KEY)
        scale = jnp.float32(0.3)

        def attention(impl):
            if impl == "triton":
                return lambda q, k, v, s: corope_attention_triton(q, k, v, theta=THETA, sm_scale=s, window=30,
                                                                  block_sizes=SMALL)
            return lambda q, k, v, s: reference_attention(q, k, v, theta=THETA, sm_scale=s, window=30)

        got, want = (outputs_and_grads(attention(impl), (q, k, v, scale), cotangent) for impl in ("triton", "ref"))
        table = TRITON_GPU_TOLERANCE if jax.default_backend() == "gpu" else TRITON_TOLERANCE
        assert_matches_elementwise(got, want, names=[*NAMES, "dsm_scale"], dtype="float32",
                                   context=f"{case} traced sm_scale", table=table)


@pytest.mark.gpu
class TestCoRoPETritonBfloat16:
    """bfloat16, compiled: the interpreter multiplies bfloat16 dots wrongly."""

    @pytest.mark.parametrize("case, options", [
        (Case(130, 64, 2, 2, "bfloat16", saturated=True), Options(documents=True)),
        (Case(300, 128, 1, 4, "bfloat16"), Options(window=100)),
        (Case(77, 256, 1, 1, "bfloat16"), Options(inv_freq=True)),
    ], ids=str)
    def test_matches_reference(self, case, options):
        assert_matches_reference(case, options, TRITON_GPU_TOLERANCE)


def test_backward_never_builds_length_squared(key):
    """jax.grad's jaxpr holds no [.., L, .., L, ..] value (L = 512); the dense reference does (the probe works)."""
    length = 512
    q, k, v, _ = make_inputs(Case(length, 32, 1, 2, "float32"), key)
    assert square_intermediates_of_grad(reference, q, k, v, size=length)
    kernel = lambda q, k, v: corope_attention_triton(q, k, v, theta=THETA, sm_scale=0.2)  # noqa: E731
    assert square_intermediates_of_grad(kernel, q, k, v, size=length) == []


def test_second_derivative_raises():
    q = jnp.ones((1, 16, 2, 32))
    kv = jnp.ones((1, 16, 1, 32))
    loss = lambda q: jnp.sum(corope_attention_triton(q, kv, kv, theta=THETA, sm_scale=0.2))  # noqa: E731
    with pytest.raises(NotImplementedError, match="differentiable once"):
        jax.grad(lambda q: jnp.sum(jax.grad(loss)(q)))(q)


def test_empty_length_gives_zeros():
    q = jnp.ones((1, 0, 2, 32))
    out = corope_attention_triton(q, q[:, :, :1], q[:, :, :1], theta=THETA, sm_scale=0.2)
    assert out.shape == q.shape and out.dtype == q.dtype


def test_block_sizes_validated():
    with pytest.raises(ValueError, match="block_k=24"):
        BlockSizes(block_k=24)
    with pytest.raises(ValueError, match="block_d=3"):
        BlockSizes(block_d=3)
    with pytest.raises(ValueError, match="block_h_bwd=0"):
        BlockSizes(block_h_bwd=0)
    fitted = BlockSizes(block_h=4, block_h_bwd=3).fitted(length=7, head_dim=96, groups=6)
    assert (fitted.block_q, fitted.block_h, fitted.block_h_bwd, fitted.block_d) == (16, 2, 2, 4)
    assert BlockSizes().fitted(length=64, head_dim=4, groups=4).block_d == 2  # capped at D/2
    assert BlockSizes().fitted(length=64, head_dim=256, groups=4).block_d == 2
    wide = {dtype: BlockSizes().fitted(length=64, head_dim=256, groups=4, dtype=dtype).block_h
            for dtype in (jnp.float32, jnp.bfloat16)}
    assert wide == {jnp.float32: 1, jnp.bfloat16: 2}  # float32's split gate dot leaves registers for one head
    with pytest.raises(ValueError, match="block_d_bwd=6"):
        BlockSizes(block_d_bwd=6)


def test_backward_chunks_default_apart_from_the_forwards_unless_block_d_is_given():
    """The backward walks 1 rotary pair per chunk by default (2 at D > 128) with up to 4 heads; a block_d given
    sets both kernels' chunks, as before block_d_bwd existed, unless block_d_bwd is given too."""
    default = BlockSizes().fitted(length=1024, head_dim=64, groups=4)
    assert (default.block_d, default.block_d_bwd, default.block_h_bwd) == (4, 1, 4)
    assert BlockSizes().fitted(length=1024, head_dim=256, groups=4).block_d_bwd == 2
    assert BlockSizes(block_d=8).fitted(length=1024, head_dim=64, groups=4).block_d_bwd == 8
    assert BlockSizes(block_d=8, block_d_bwd=2).fitted(length=1024, head_dim=64, groups=4).block_d_bwd == 2
    assert BlockSizes(block_d_bwd=64).fitted(length=1024, head_dim=20, groups=4).block_d_bwd == 16  # D/2 capped


def test_bad_inputs_raise():
    q = jnp.zeros((1, 8, 4, 32))
    kv = jnp.zeros((1, 8, 2, 32))
    attention = functools.partial(corope_attention_triton, theta=THETA, sm_scale=0.2)
    with pytest.raises(ValueError, match="head dim D=31 must be even"):
        attention(q[..., :31], kv[..., :31], kv[..., :31])
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention(q[:, :, :3], kv, kv)
    with pytest.raises(ValueError, match="head dim D=258"):
        attention(jnp.zeros((1, 8, 4, 258)), jnp.zeros((1, 8, 2, 258)), jnp.zeros((1, 8, 2, 258)))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        attention(*(x.astype(jnp.float8_e4m3fn) for x in (q, kv, kv)))
    with pytest.raises(ValueError, match="causal=False"):
        attention(q, kv, kv, causal=False)
    with pytest.raises(ValueError, match="theta=-1.0"):
        corope_attention_triton(q, kv, kv, theta=-1.0, sm_scale=0.2)
    with pytest.raises(ValueError, match="sm_scale=-0.2"):
        corope_attention_triton(q, kv, kv, theta=THETA, sm_scale=-0.2)
    with pytest.raises(TypeError, match="BlockSizes"):
        attention(q, kv, kv, block_sizes={"block_q": 16})
    with pytest.raises(ValueError, match="num_warps=0"):
        attention(q, kv, kv, num_warps=0)
    with pytest.raises(ValueError, match="window=0"):
        attention(q, kv, kv, window=0)
    with pytest.raises(ValueError, match="inv_freq must have shape"):
        attention(q, kv, kv, inv_freq=jnp.ones(8))
    with pytest.raises(TypeError, match="segment_ids must be an integer array"):
        attention(q, kv, kv, segment_ids=jnp.zeros((1, 8)))
