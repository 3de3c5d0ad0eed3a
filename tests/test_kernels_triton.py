"""The Pallas kernels lower to Triton on a machine without a GPU.

`jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))` runs Pallas's Triton lowering (jaxpr -> Triton MLIR)
for a GPU target on CPU. That catches what the interpreter cannot: primitives Triton lowering does not support,
block shapes it rejects, and the kernels silently falling back to something else (the fused forward must be one
Triton call, its gradient two: the forward that saves residuals and one fused backward). On the captured Triton IR we check two rules that the later
Triton compilation (only on a GPU) enforces: every tensor dimension is a power of two, and every `tt.dot` operand
is at least 16 in each dimension. What remains for a GPU is Triton's own compilation and numerics (`gpu`-marked
classes in test_kernels_cope.py and test_kernels_corope.py).
"""
from __future__ import annotations

import functools
import re
from typing import Callable

import jax
import jax.numpy as jnp
import pytest

from jaxpe.kernels import cope_pallas as cope_kernel
from jaxpe.kernels import corope_pallas as corope_kernel

TRITON_CALL = "__gpu$xla.gpu.triton"
TENSOR_SHAPE = r"tensor<((?:\d+x)+)[a-z!]"  # the dims of a ranked tensor type, e.g. "64x32x" of tensor<64x32xf32>
CASES = [  # (L, Hq, Hkv, D, npos, dtype, small blocks)
    (128, 2, 2, 64, 16, jnp.float32, False),
    (300, 6, 2, 64, 33, jnp.float32, True),  # ragged length, GQA G=3, npos not a power of two
    (77, 4, 4, 96, 8, jnp.bfloat16, False),  # head dim padded to 128
    (1000, 3, 1, 128, 65, jnp.bfloat16, False),  # MQA
    (40, 2, 1, 32, 2, jnp.float32, True),
]


@pytest.fixture
def triton_modules(monkeypatch) -> list[str]:
    """Collects the Triton IR text of every pallas_call lowered for a GPU while the test runs. The hook is jax's
    private lowering function: when it moves, the rule checks cannot run, and the test says so as a skip."""
    try:
        from jax._src.pallas.triton import lowering
    except ImportError as error:
        pytest.skip(f"Triton IR rule checks need jax._src.pallas.triton.lowering, which this jax lacks ({error})")
    if not hasattr(lowering, "lower_jaxpr_to_triton_module"):
        pytest.skip("Triton IR rule checks need jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module, which "
                    f"this jax {jax.__version__} lacks")
    modules: list[str] = []
    lower = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm())
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", capture)
    return modules


def lowered_for_gpu(fn: Callable, *args: jax.ShapeDtypeStruct) -> str:
    """StableHLO text of `fn` lowered for CUDA (no GPU needed). The target is an abstract H100: jax >= 0.12 reads
    the GPU generation from the abstract mesh's device when no GPU is present (earlier versions do not ask)."""
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Auto,), abstract_device=h100)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def triton_rule_violations(module: str) -> list[str]:
    """Tensor types with a dimension that is not a power of two, and `tt.dot` operands under 16 in a dimension."""
    problems = []
    for shape in re.findall(TENSOR_SHAPE, module):
        dims = [int(d) for d in shape.rstrip("x").split("x")]
        if any(d & (d - 1) for d in dims):
            problems.append(f"non-power-of-two tensor {shape}")
    for line in module.splitlines():
        if "tt.dot" in line:
            for shape in re.findall(TENSOR_SHAPE, line.rpartition(":")[2]):
                if min(int(d) for d in shape.rstrip("x").split("x")) < 16:
                    problems.append(f"tt.dot operand {shape} under 16: {line.strip()}")
    return problems


def _inputs(length, hq, hkv, d, dtype):
    q = jax.ShapeDtypeStruct((2, length, hq, d), dtype)
    kv = jax.ShapeDtypeStruct((2, length, hkv, d), dtype)
    return q, kv


def _cope(case) -> tuple[Callable, Callable, tuple]:
    length, hq, hkv, d, npos, dtype, small = case
    blocks = cope_kernel.BlockSizes(16, 16, 32, 16) if small else None
    fn = functools.partial(cope_kernel.cope_attention_pallas, sm_scale=d ** -0.5, block_sizes=blocks,
                           interpret=False)
    q, kv = _inputs(length, hq, hkv, d, dtype)
    args = (q, kv, kv, jax.ShapeDtypeStruct((hq, npos, d), dtype))
    grad = jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))
    return fn, grad, args


def _corope(case) -> tuple[Callable, Callable, tuple]:
    length, hq, hkv, d, _, dtype, small = case
    blocks = corope_kernel.BlockSizes(16, 16, 16, 16, 16) if small else None
    fn = functools.partial(corope_kernel.corope_attention_pallas, theta=10000.0, sm_scale=d ** -0.5,
                           block_sizes=blocks, interpret=False)
    q, kv = _inputs(length, hq, hkv, d, dtype)
    grad = jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    return fn, grad, (q, kv, kv)


EVERY_KERNEL = pytest.mark.parametrize("build", [_cope, _corope], ids=["cope", "corope"])
EVERY_CASE = pytest.mark.parametrize("case", CASES, ids=lambda c: f"L{c[0]}-H{c[1]}/{c[2]}-D{c[3]}-npos{c[4]}-"
                                                                  f"{jnp.dtype(c[5]).name}{'-small' if c[6] else ''}")


@EVERY_KERNEL
@EVERY_CASE
def test_kernels_lower_to_one_triton_call_forward_and_two_backward(build, case):
    """Public API only: the forward is one Triton call, its gradient two (residual-saving forward, fused backward)."""
    fn, grad, args = build(case)
    assert lowered_for_gpu(fn, *args).count(TRITON_CALL) == 1
    assert lowered_for_gpu(grad, *args).count(TRITON_CALL) == 2


@EVERY_KERNEL
@EVERY_CASE
def test_triton_ir_obeys_the_gpu_compiler_rules(build, case, triton_modules):
    """The captured Triton IR of the forward and the gradient (three modules, each with a tt.dot): every tensor
    dimension a power of two, every tt.dot operand at least 16 in each dimension."""
    fn, grad, args = build(case)
    lowered_for_gpu(fn, *args)
    lowered_for_gpu(grad, *args)
    assert len(triton_modules) == 1 + 2
    assert all("tt.dot" in module and re.findall(TENSOR_SHAPE, module) for module in triton_modules)
    assert [p for module in triton_modules for p in triton_rule_violations(module)] == []


def test_rule_checker_flags_what_triton_rejects():
    bad = ("%1 = tt.load %0 : tensor<48x64x!tt.ptr<f32>>\n"
           "%2 = tt.dot %a, %b, %c : tensor<8x64xf32> * tensor<64x64xf32> -> tensor<8x64xf32>")
    problems = triton_rule_violations(bad)
    assert any("non-power-of-two tensor 48x64x" in p for p in problems)
    assert any("tt.dot operand 8x64x under 16" in p for p in problems)
    assert triton_rule_violations("%3 = tt.dot %a, %b, %c : tensor<16x32xbf16> * tensor<32x16xbf16> -> "
                                  "tensor<16x16xf32>") == []
