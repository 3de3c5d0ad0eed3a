"""The fused paths under jax_enable_x64: impl "pallas" and "triton" of CoPE, Co-RoPE and stick-breaking attention,
and FoX's Pallas one, take float32 and 16-bit inputs (float64 is a TypeError, which "auto" never meets) and give,
forward and backward, what they give without x64 (as jax.nn.dot_product_attention does); their kernels index in int32
(no 64-bit value is computed inside a Pallas kernel or handed to one), and the Pallas kernels' gradient lowers for
CUDA. On CPU: Pallas in interpret mode, Triton in its interpreter (which multiplies bfloat16 dots wrongly, so its 16-bit
case is float16)."""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
from jaxpe.kernels.cope_pallas import cope_attention_pallas
from jaxpe.kernels.corope_pallas import corope_attention_pallas
from jaxpe.kernels.fox_pallas import forgetting_attention_pallas
from jaxpe.kernels.stickbreaking_pallas import stickbreaking_attention_pallas
from kernel_harness import equations, outputs_and_grads

B, L, HQ, HKV, D, NPOS = 1, 24, 4, 2, 8, 6  # L not a block multiple: the kernels pad it
KERNEL_CALLS = ("pallas_call", "pure_callback")  # a Pallas kernel; a Triton launch in the interpreter


def attention(encoding: str, impl: str) -> Callable[..., jax.Array]:
    """encoding's public function of (q, k, v, e): e is CoPE's table, FoX's log forget gates its first column's
    −softplus per query head, unread by the others."""
    if encoding == "cope":
        return lambda q, k, v, e: jaxpe.cope_attention(q, k, v, e, impl=impl)
    if encoding == "fox":
        return lambda q, k, v, e: jaxpe.forgetting_attention(
            q, k, v, -jax.nn.softplus(jnp.broadcast_to(e[:HQ, 0].astype(jnp.float32), (B, L, HQ))), impl=impl)
    if encoding == "stickbreaking":
        return lambda q, k, v, e: jaxpe.stickbreaking_attention(q, k, v, impl=impl)
    return lambda q, k, v, e: jaxpe.corope_attention(q, k, v, impl=impl)


def inputs(dtype: jnp.dtype) -> tuple[jax.Array, ...]:
    kq, kk, kv, ke, kc = jax.random.split(jax.random.PRNGKey(4), 5)
    shapes = ((B, L, HQ, D), (B, L, HKV, D), (B, L, HKV, D), (NPOS, D), (B, L, HQ, D))
    scales = (1.0, 1.0, 1.0, 0.3, 1.0)
    return tuple((s * jax.random.normal(key, shape)).astype(dtype)
                 for key, shape, s in zip((kq, kk, kv, ke, kc), shapes, scales))


@pytest.mark.parametrize("encoding, impl, dtype", [
    ("cope", "pallas", jnp.bfloat16), ("corope", "pallas", jnp.float32), ("corope", "pallas", jnp.bfloat16),
    ("cope", "triton", jnp.float32), ("corope", "triton", jnp.float16), ("fox", "pallas", jnp.bfloat16),
    ("stickbreaking", "pallas", jnp.float32), ("stickbreaking", "triton", jnp.float16)])
def test_fused_paths_under_x64_as_without(encoding, impl, dtype):
    """Output and gradients (q, k, v and CoPE's table) in the input dtype, equal to the same impl's without x64."""
    *args, cotangent = inputs(dtype)
    fn = attention(encoding, impl)
    want = outputs_and_grads(fn, args, cotangent)
    with jax.enable_x64(True):
        got = outputs_and_grads(fn, args, cotangent)
    for name, g, w in zip(("out", "dq", "dk", "dv", "d pos_emb"), got, want):
        assert g.dtype == w.dtype == dtype, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=1e-6, rtol=1e-6,
                                   err_msg=f"{encoding} {impl} {name}")


def wide_values(fn: Callable, *args: jax.Array) -> list[str]:
    """The 64-bit values that the kernel calls in jax.grad(fn)'s jaxpr take as operands or compute inside (a Pallas
    kernel's body, nested loops included; Python constants, 64-bit under x64 until narrowed, are no equation's
    output and do not count)."""
    grad = jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=tuple(range(len(args))))
    found = []
    for call in (e for e in equations(jax.make_jaxpr(grad)(*args).jaxpr) if e.primitive.name in KERNEL_CALLS):
        inside = [var for eqn in equations(call.params["jaxpr"]) for var in eqn.outvars] if "jaxpr" in call.params \
            else []
        found += [f"{call.primitive.name}: {var.aval}" for var in (*call.invars, *inside)
                  if jnp.dtype(getattr(var.aval, "dtype", jnp.bool_)).itemsize == 8]
    return found


@pytest.mark.parametrize(("encoding", "impl"), [("cope", "pallas"), ("cope", "triton"), ("corope", "pallas"),
                                               ("corope", "triton"), ("fox", "pallas"), ("stickbreaking", "pallas"),
                                               ("stickbreaking", "triton")])
def test_kernels_index_in_int32_under_x64(encoding, impl):
    """In x64 mode no kernel of the forward or the gradient takes or computes a 64-bit value: indices, loop counters
    and tiles stay 32-bit."""
    *args, _ = inputs(jnp.float32)
    with jax.enable_x64(True):
        kernels = [e for e in equations(jax.make_jaxpr(attention(encoding, impl))(*args).jaxpr)
                   if e.primitive.name in KERNEL_CALLS]
        assert kernels, "no kernel call found"
        assert wide_values(attention(encoding, impl), *args) == []


@pytest.mark.parametrize("encoding", ["cope", "corope", "fox", "stickbreaking"])
def test_pallas_gradient_lowers_for_cuda_under_x64(encoding):
    """Lowered for CUDA (no GPU needed), the forward and the fused backward are Pallas kernels lowered to Triton (a
    64-bit index inside one is refused there)."""
    *args, _ = inputs(jnp.bfloat16)
    if encoding == "cope":
        fn = functools.partial(cope_attention_pallas, sm_scale=D**-0.5, interpret=False)
    elif encoding == "fox":
        fn = lambda q, k, v, e: forgetting_attention_pallas(  # noqa: E731
            q, k, v, jnp.cumsum(-jax.nn.softplus(jnp.ones((B, L, HQ))), axis=1), sm_scale=D**-0.5, interpret=False)
    elif encoding == "stickbreaking":
        fn = lambda q, k, v, e: stickbreaking_attention_pallas(  # noqa: E731
            q, k, v, sm_scale=D**-0.5, interpret=False)[0]
    else:
        fn = lambda q, k, v, e: corope_attention_pallas(q, k, v, theta=1e4, sm_scale=D**-0.5,  # noqa: E731
                                                        interpret=False)
    grad = jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=(0, 1, 2))
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Auto,), abstract_device=h100)
    with jax.enable_x64(True), jax.sharding.use_abstract_mesh(mesh):
        module = jax.jit(grad).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert module.count("@__gpu$xla.gpu.triton(") == 2


@pytest.mark.parametrize(("encoding", "impl"), [("cope", "pallas"), ("cope", "triton"), ("corope", "pallas"),
                                               ("corope", "triton"), ("fox", "pallas"), ("stickbreaking", "pallas"),
                                               ("stickbreaking", "triton")])
def test_fused_kernels_refuse_float64_naming_what_takes_it(encoding, impl):
    """Every fused entry takes float32 and 16-bit inputs: float64 (x64 mode) is a TypeError naming q's dtype, the
    impl and the paths that run it, before any kernel runs (CoPE's native forward used to run it, and its backward
    fail in Triton; CoPE's Pallas kernels ran it while the others refused it); "auto" runs it, as the reference
    does."""
    with jax.enable_x64(True):
        args = [x.astype(jnp.float64) for x in inputs(jnp.float32)[:4]]
        with pytest.raises(TypeError, match=f"q.dtype=float64 is not supported by impl='{impl}'.*impl='blockwise' and "
                                            f"impl='reference'.*impl='auto'"):
            jax.grad(lambda q: attention(encoding, impl)(q, *args[1:]).sum())(args[0])
        got, want = (attention(encoding, path)(*args) for path in ("auto", "reference"))
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-12, rtol=1e-12)

