"""What the kernel tests share (test_kernels_cope.py, test_kernels_corope.py and their siblings): an attention's
output and gradients in one compiled run, the per-dtype, per-element tolerance assertion against a reference (and the
one-bound-per-tensor form the transformation tests use), the walk over every equation of a jaxpr, and the jaxpr probe
that finds arrays of size L×L built by a backward pass."""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence

import chex
import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest

# Compile time dominates these tests; the speed of the compiled test programs does not matter.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def outputs_and_grads(attention: Callable[..., jax.Array], args: Sequence[jax.Array], cotangent: jax.Array, *,
                      compiler_options: dict[str, object] | None = FAST_COMPILE) -> list[jax.Array]:
    """[out, d args[0], d args[1], ...]: out = attention(*args) and the gradients of sum(out · cotangent), compiled
    with `compiler_options` (None: XLA's defaults)."""

    def run(*args):
        out, pullback = jax.vjp(attention, *args)
        return [out, *pullback(cotangent.astype(out.dtype))]

    return jax.jit(run).lower(*args).compile(compiler_options)(*args)


# |got − want| ≤ atol + rtol·|want| in every element: (atol, rtol) of the outputs and of the gradients per dtype, for
# the interpreted kernels and the blockwise paths against the references on the CPU (about 3× the largest errors
# seen across the kernel and mask tests), and compiled on a GPU, where Triton rounds float32 dot inputs to TF32 (the
# float32 output's largest error seen on an H200, at L 4096 against a TF32-computed want: 0.0126 at |want| 0.05).
TOLERANCE = {"float32": {"out": (3e-5, 1e-3), "grad": (2e-4, 1e-3)},
             "bfloat16": {"out": (1e-2, 1e-2), "grad": (1e-1, 1e-2)}}
def float32_products(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """fn traced with float32 matrix products (`jax.default_matmul_precision("highest")`), for the references a GPU
    checks against: there XLA would multiply float32 in TF32, and CoPE's positions (sums of gates) would move. The
    same as the default on CPU."""
    @functools.wraps(fn)
    def traced_highest(*args, **kwargs):
        with jax.default_matmul_precision("highest"):
            return fn(*args, **kwargs)

    return traced_highest


GPU_TOLERANCE = {"float32": {"out": (2e-2, 1e-2), "grad": (6e-2, 2e-2)},
                 "bfloat16": {"out": (3e-2, 2e-2), "grad": (1.5e-1, 3e-2)}}


# Document ids [B 2, L 11] for the packed-documents cases: documents of 4, 5 and 2 tokens in the first row, of 7 and 4
# in the second (ids need not be consecutive).
DOCUMENTS = np.array([[0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 0, 3, 3, 3, 3]], np.int32)


def gpu_and_interpreted(sweep: type, name: str) -> tuple[type, type]:
    """A kernel sweep's two test classes, `name` (compiled: marked `gpu`, held to GPU_TOLERANCE) and `name`Interpret
    (the interpreter, on CPU too: TOLERANCE); `sweep` reads its INTERPRET and TOLERANCE. Siblings rather than one a
    subclass of the other: pytest collects marks along the MRO, so a subclass of the `gpu` class would skip on CPU."""
    compiled = type(name, (sweep,), {"INTERPRET": False, "TOLERANCE": GPU_TOLERANCE})
    return pytest.mark.gpu(compiled), type(f"{name}Interpret", (sweep,), {"INTERPRET": True, "TOLERANCE": TOLERANCE})


def assert_close(got: jax.Array, want: jax.Array, *, tolerance: tuple[float, float], context: str) -> None:
    """Same shape, finite, and |got − want| ≤ atol + rtol·|want| in every element, tolerance = (atol, rtol)."""
    chex.assert_shape(got, np.shape(want))
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), f"{context} is not finite"
    np.testing.assert_allclose(got, want, atol=tolerance[0], rtol=tolerance[1], err_msg=context)


def assert_matches_elementwise(got: Sequence[jax.Array], want: Sequence[jax.Array], *, names: Sequence[str],
                               dtype: str, context: str,
                               table: dict[str, dict[str, tuple[float, float]]] = TOLERANCE) -> None:
    """got = [out, *grads] against the reference's: same dtypes, then `assert_close` with table[dtype]["out"] for the
    output and table[dtype]["grad"] for the gradients."""
    assert len(got) == len(want) == len(names), (len(got), len(want), names)
    for index, (name, x, y) in enumerate(zip(names, got, want)):
        assert x.dtype == y.dtype, (name, x.dtype, y.dtype)
        assert_close(x, y, tolerance=table[dtype]["grad" if index else "out"], context=f"{name} of {context}")


def assert_matches(got: Sequence[jax.Array], want: Sequence[jax.Array], *, names: Sequence[str],
                   tolerance: tuple[float, float], context: str) -> None:
    """got = [out, *grads] against the reference's: same shapes and dtypes, finite, and max |got − want| ≤
    tol·max(1, max |want|), tol = tolerance[0] for the output and tolerance[1] for the gradients: one bound per
    tensor, as the transformation tests use it (the kernel tests bound every element: `assert_matches_elementwise`)."""
    assert len(got) == len(want) == len(names), (len(got), len(want), names)
    for index, (name, x, y) in enumerate(zip(names, got, want)):
        chex.assert_shape(x, y.shape)
        assert x.dtype == y.dtype, (name, x.dtype, y.dtype)
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert np.all(np.isfinite(x)), f"{name} of {context}"
        tol = tolerance[0 if index == 0 else 1]
        scale = max(1.0, float(np.max(np.abs(y))))
        chex.assert_trees_all_close(x, y, atol=tol * scale, rtol=0.0, custom_message=f"{name} of {context}")


def assert_half_precision_matches(attention: Callable[..., jax.Array], reference: Callable[..., jax.Array],
                                  args: Sequence[jax.Array], cotangent: jax.Array, *, names: Sequence[str],
                                  context: str) -> None:
    """`attention` on 16-bit `args` (all one dtype): output and gradients in that dtype, close to `reference` on the
    same rounded inputs in float32 (float16 within 1e-2 / 3e-2, bfloat16 within 3e-2 / 1e-1, as assert_matches)."""
    dtype = args[0].dtype
    got = outputs_and_grads(attention, args, cotangent)
    want = outputs_and_grads(reference, tuple(x.astype(jnp.float32) for x in args), cotangent.astype(jnp.float32))
    assert [x.dtype for x in got] == [dtype] * len(got)
    tolerance = (1e-2, 3e-2) if dtype == jnp.float16 else (3e-2, 1e-1)
    assert_matches([x.astype(jnp.float32) for x in got], want, names=names, tolerance=tolerance, context=context)


def equations(jaxpr: jex_core.Jaxpr) -> Iterator[jex_core.JaxprEqn]:
    """Every equation of `jaxpr` and of the jaxprs nested in its equations' parameters (scan/while/cond bodies,
    custom VJPs, Pallas kernels)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jex_core.ClosedJaxpr):
                    yield from equations(sub.jaxpr)
                elif isinstance(sub, jex_core.Jaxpr):
                    yield from equations(sub)


def square_intermediates_of_grad(attention: Callable[..., jax.Array], *args: jax.Array, size: int
                                 ) -> list[tuple[int, ...]]:
    """Shapes of every intermediate of jax.grad(sum(attention(*args))) with respect to every arg (nested jaxprs
    included: scan/while/cond bodies, custom VJPs, kernels) with two axes of `size` or more."""
    grad = jax.grad(lambda *a: jnp.sum(attention(*a)), argnums=tuple(range(len(args))))
    shapes = (tuple(getattr(var.aval, "shape", ())) for eqn in equations(jax.make_jaxpr(grad)(*args).jaxpr)
              for var in eqn.outvars)
    return [shape for shape in shapes if sum(dim >= size for dim in shape) >= 2]
