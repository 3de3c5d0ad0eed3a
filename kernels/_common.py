"""What the kernels and their blockwise paths share: the limits of the Pallas Triton path, whether this machine can
run it, and the numerical pieces the kernels need (mask value, CoPE's interpolation, sincos, 2-D dots, tile sizes,
the sm_scale policy and first-order rule of every fused path).

D head dim, P table rows. What every encoding shares (compute dtype, rotary frequencies, input checks) is in
jaxpe/base.py.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxpe.base import scale_or_default

MAX_HEAD_DIM = 256  # the largest head dim D the fused kernels take (tiles pad D to a power of two)
MIN_COMPUTE_CAPABILITY = 8.0  # Ampere: Triton's bfloat16 tensor-core dots
MIN_BLOCK = 16  # the smallest tile side: Triton's dots need operands of at least 16 in each dimension
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # a finite logit for masked keys (exp gives exactly 0)
# Base-2 pieces as one PTX instruction sequence each ($1 the float32 argument, $0 the result) for the kernels compiled
# for a GPU: the SFU's approximate ex2 and lg2, where libdevice's exp2, log1p and log are long sequences.
# log2(1 + 2^x) (softplus in base 2, −log2 σ(−x·ln 2)), absolute error about 2^−22; x itself from x > 24 on, where
# 1 + 2^x rounds to 2^x (and beyond 128 would overflow).
SOFTPLUS2_PTX = ("{ .reg .f32 t; .reg .pred big; setp.gt.f32 big, $1, 0f41C00000; ex2.approx.ftz.f32 t, $1; "
                 "add.f32 t, t, 0f3F800000; lg2.approx.ftz.f32 $0, t; @big mov.f32 $0, $1; }")
EXP2_PTX = "ex2.approx.ftz.f32 $0, $1;"  # 2^x, results below 2^−126 flushed to 0


def check_head_dim(head_dim: int) -> None:
    """The fused kernels take 1 <= D <= MAX_HEAD_DIM."""
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D={head_dim} must be in [1, {MAX_HEAD_DIM}] for the fused kernels "
                         f"(impl='blockwise' has no limit)")


def pallas_unsupported(head_dim: int, *, backend: str, compute_capability: str | None) -> str | None:
    """Why the fused kernels cannot run compiled here (None when they can).

    backend is `jax.default_backend()`; compute_capability that of the first device ("9.0" on an H100, "gfx90a" on
    a ROCm GPU, None off GPU).
    """
    if backend != "gpu":
        return (f"the fused kernels lower through Pallas's Triton backend, which targets NVIDIA GPUs, and the "
                f"backend here is {backend!r}")
    if importlib.util.find_spec("jax.experimental.pallas.triton") is None:
        return "this jax has no Pallas Triton backend (jax.experimental.pallas.triton)"
    if compute_capability is None or compute_capability.startswith("gfx"):
        return f"the GPU is not an NVIDIA CUDA device (compute capability {compute_capability!r})"
    try:
        capability = float(compute_capability)
    except ValueError:
        return f"the GPU's compute capability {compute_capability!r} is not a CUDA version"
    if capability < MIN_COMPUTE_CAPABILITY:
        return f"the GPU's compute capability {compute_capability} is below {MIN_COMPUTE_CAPABILITY} (Ampere)"
    if head_dim > MAX_HEAD_DIM:
        return f"head dim D={head_dim} is over the fused kernels' limit of {MAX_HEAD_DIM}"
    return None


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def tile_extent(n: int) -> int:
    """The smallest power of two >= max(n, MIN_BLOCK): what a tile side or a padded head dim must be for Triton."""
    return max(MIN_BLOCK, next_power_of_two(n))


def check_block_sizes(blocks: Any) -> None:
    """A kernel's frozen `BlockSizes`: each field None (the default for the problem) or, by its name, block_h* a
    positive int (query heads per program), block_d* a power of two >= 1 (an elementwise width), any other a power of
    two >= MIN_BLOCK (a side of a dot's operand)."""
    for field in dataclasses.fields(blocks):
        value = getattr(blocks, field.name)
        if value is None:
            continue
        if field.name.startswith("block_h"):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field.name}={value!r} must be a positive int (or None)")
            continue
        least = 1 if field.name.startswith("block_d") else MIN_BLOCK
        if not isinstance(value, int) or value < least or value & (value - 1):
            raise ValueError(f"{field.name}={value!r} must be a power of two >= {least} (or None)")


def filled(blocks: Any, default: Any) -> dict[str, int]:
    """The fields of a kernel's `BlockSizes`, each None replaced by `default`'s."""
    given = {f.name: getattr(blocks, f.name) for f in dataclasses.fields(blocks)}
    return {name: getattr(default, name) if value is None else value for name, value in given.items()}


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of a fused kernel's forward and backward kernels, which need not match; None: the kernel's default
    (`default`, which each kernel's subclass defines for its head dim, dtype and options). Rows and keys are powers of
    two >= MIN_BLOCK (Triton dots); blocks larger than the padded sequence shrink (`fitted`). Co-RoPE's kernels,
    which tile heads and rotary pairs too, have their own."""

    block_q: int | None = None  # forward: query rows per program
    block_k: int | None = None  # forward: keys per tile
    block_q_bwd: int | None = None  # backward: query rows per program
    block_k_bwd: int | None = None  # backward: keys per tile

    def __post_init__(self) -> None:
        check_block_sizes(self)

    @classmethod
    def default(cls, head_dim: int, dtype: jnp.dtype, **options: Any) -> BlockSizes:
        """The kernel's sizes for head dim D, dtype and its options: each kernel's subclass says."""
        raise NotImplementedError(f"{cls.__qualname__} has no default block sizes")

    def fitted(self, *, length: int, head_dim: int, dtype: jnp.dtype, **options: Any) -> BlockSizes:
        """Every size given (None: `default`'s for D, dtype and the options), each capped at the next power of two
        >= length (and >= MIN_BLOCK)."""
        cap = tile_extent(length)
        sizes = filled(self, type(self).default(head_dim, dtype, **options))
        return type(self)(**{name: min(size, cap) for name, size in sizes.items()})


def triton_compiler_params(*, num_warps: int, num_stages: int) -> Any:
    """`compiler_params` that select Pallas's Triton lowering (since jax 0.9 the GPU default is Mosaic GPU)."""
    from jax.experimental.pallas import triton as pltriton  # optional in a jax build: see pallas_unsupported
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def resolve_interpret(interpret: bool | None) -> bool:
    """A fused kernel's `interpret` argument: None means the Pallas interpreter unless the backend is a GPU."""
    return jax.default_backend() != "gpu" if interpret is None else bool(interpret)


def fold_scale(q: jax.Array, sm_scale: float | jax.Array | None) -> tuple[jax.Array, float]:
    """(q, sm_scale) as the fused kernels take them, sm_scale a Python float compiled in (None: D^−½): a traced
    sm_scale (a learned temperature) multiplies q instead (every logit is linear in sm_scale·q; in q's dtype, so a
    bfloat16 q is rounded once more) and the kernels get 1.0."""
    sm_scale = scale_or_default(sm_scale, q.shape[-1])
    try:
        return q, float(sm_scale)
    except jax.errors.ConcretizationTypeError:
        return (q.astype(jnp.float32) * jnp.asarray(sm_scale, jnp.float32)).astype(q.dtype), 1.0


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def first_order_only(impl: str, call: Callable[..., Any], *operands: Any) -> Any:
    """call(*operands), a fused path's kernel launch, under a JVP rule that says why it cannot be differentiated
    forwards or twice: the kernels are differentiated once, by their operation's custom VJP, and differentiating that
    VJP's own rules (jax.grad of jax.grad, jax.hessian, jax.jvp) would differentiate the kernels."""
    return call(*operands)


@first_order_only.defjvp
def _first_order_only_jvp(impl: str, call: Callable[..., Any], primals: tuple, tangents: tuple) -> tuple:
    raise NotImplementedError(f"impl={impl!r} is differentiable once (reverse mode, a custom VJP over fused kernels): "
                              f"for second-order derivatives (jax.grad of jax.grad, jax.hessian) use impl='blockwise' "
                              f"or 'reference', and for forward mode (jax.jvp) impl='reference'")


def dot(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False, accurate: bool = False,
        interpret: bool = True) -> jax.Array:
    """2-D a @ b (aᵀ with trans_a, bᵀ with trans_b) accumulated in float32.

    `accurate` asks for float32-accurate products of float32 inputs: TF32×3 (three tensor-core TF32 products,
    ~float32 accuracy) when compiled for a GPU, IEEE float32 (`Precision.HIGHEST`) in the interpreter, where XLA's
    CPU dot has no TF32×3. Without it, float32 inputs multiply in TF32 on the GPU.
    """
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    precision = None
    if accurate and a.dtype == jnp.float32 and b.dtype == jnp.float32:
        precision = lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def fori_loop32(lower: int | jax.Array, upper: int | jax.Array, body: Callable[[jax.Array, Any], Any], init: Any
                ) -> Any:
    """`lax.fori_loop` with an int32 index also under jax_enable_x64, where Python bounds would give an int64 one
    and the Pallas kernels' Triton lowering would mix int32 and int64 indices."""
    return lax.fori_loop(jnp.int32(lower), jnp.int32(upper), body, init)


def carry_init(fill: float, shape: tuple[int, ...], dtype: jnp.dtype, *operands: jax.Array) -> jax.Array:
    """An array [shape] of `fill`, the initial value of a loop carry that the loop computes from `operands`. Under
    shard_map (check_vma) it varies over every mesh axis that an operand varies over, as the loop's result does (a
    carry's input and output types must match); elsewhere it is jnp.full."""
    init = jnp.full_like(operands[0], fill, dtype, shape=shape)
    for x in operands[1:]:
        init = init + jnp.zeros_like(x, dtype, shape=shape)
    return init


def _varying_axes(x: jax.Array) -> frozenset:
    """The manual mesh axes (inside shard_map) over which `x` varies; empty elsewhere."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10; `vma` before
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def vary_alike(*arrays: jax.Array | None) -> tuple[jax.Array | None, ...]:
    """The arrays (None passes through), each marked as varying over every manual mesh axis that one of them varies
    over. Called on a custom VJP's operands before the call: every value inside then has one manual-axis type, and
    the cotangent of an operand that did not vary (a replicated table) is summed over those axes by autodiff of the
    cast, outside the rule. A no-op outside shard_map."""
    axes = frozenset().union(*(_varying_axes(x) for x in arrays if x is not None))
    cast = lambda x, missing: lax.pcast(x, tuple(missing), to="varying")  # noqa: E731
    return tuple(x if x is None or not axes - _varying_axes(x) else cast(x, axes - _varying_axes(x))
                 for x in arrays)


def output_struct(shape: tuple[int, ...], dtype: jnp.dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """A pallas_call output's type: under shard_map (check_vma asks pallas_call for the mesh axes its outputs vary
    over) it varies over the axes `like` varies over (every operand does, see `vary_alike`); plain elsewhere."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=getattr(jax.typeof(like), "manual_axis_type", None))


class Interpolation(NamedTuple):
    """Linear interpolation at fractional positions p in [0, P − 1] between table rows lo = ⌊p⌋ and
    hi = min(lo + 1, P − 1), weight w = p − lo; at_lo and at_hi are the values read at lo and hi."""

    lo: jax.Array  # int32, like p
    hi: jax.Array  # int32, like p
    w: jax.Array  # like p
    at_lo: jax.Array
    at_hi: jax.Array

    @property
    def value(self) -> jax.Array:
        """(1 − w)·at_lo + w·at_hi. At w = 0 a non-finite at_hi adds nothing (its row is out of reach), and the
        derivative in w stays at_hi − at_lo wherever at_hi is finite (w < 1 always, so at_lo is always used)."""
        at_hi = jnp.where((self.w > 0.0) | jnp.isfinite(self.at_hi), self.at_hi, 0.0)
        return (1.0 - self.w) * self.at_lo + self.w * at_hi


def interpolate(take: Callable[[jax.Array], jax.Array], positions: jax.Array, size: int) -> Interpolation:
    """CoPE's interpolation of a table of `size` rows at `positions` (in [0, size − 1]); `take(index)` reads the
    table at int32 indices shaped like `positions`. The gradient flows through w, never through ⌊p⌋ or ⌈p⌉."""
    lo = lax.stop_gradient(jnp.floor(positions))
    w = positions - lo
    lo = lo.astype(jnp.int32)
    hi = jnp.minimum(lo + 1, size - 1)
    return Interpolation(lo, hi, w, take(lo), take(hi))


# sincos: Cody–Waite reduction by π/2 (π/2 = C1 + C2 + C3, C1 and C2 with few enough bits that k·C1 and k·C2 are
# exact in float32 for |k| < 2^15, i.e. |x| < ~51000) and Cephes's float32 minimax polynomials on [−π/4, π/4].
_TWO_OVER_PI = 0.63661977236758134308
_PIO2_1 = 1.5703125  # 8 significant bits
_PIO2_2 = 4.837512969970703125e-4  # 11 significant bits
_PIO2_3 = 7.54978995489188216e-8  # the rest of π/2
_SIN_COEFFS = (-1.6666654611e-1, 8.3321608736e-3, -1.9515295891e-4)  # sin r ≈ r + r³·P(r²)
_COS_COEFFS = (4.166664568298827e-2, -1.388731625493765e-3, 2.443315711809948e-5)  # cos r ≈ 1 − r²/2 + r⁴Q(r²)
SINCOS_MAX_ARG = 32768.0  # |x| up to which `sincos` keeps its error ≤ 1e-6 (tests/test_fast_trig.py sweeps it)


@jax.custom_jvp
def sincos(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sin x, cos x) of a float32 array from one range reduction: elementwise multiply-adds and selects only, so XLA
    vectorises it (on CPU it is ~20× faster than jnp.sin and jnp.cos in Co-RoPE's loops) and Triton lowers it inside
    the Co-RoPE kernels without libdevice. Max abs error ≤ 2e-7 for |x| ≤ SINCOS_MAX_ARG (Co-RoPE's angles Δ·ω are
    at most L); meant for those angles, not for huge |x|. Differentiable: d sin = cos·dx, d cos = −sin·dx (not the
    polynomials' own derivatives). float64 x (x64 mode) gets jnp.sin and jnp.cos, accurate to float64."""
    x = jnp.asarray(x)
    if x.dtype == jnp.float64:
        return jnp.sin(x), jnp.cos(x)
    x = x.astype(jnp.float32)
    f32 = lambda c: jnp.float32(c)
    k = jnp.floor(x * f32(_TWO_OVER_PI) + f32(0.5))  # the quadrant, x = k·π/2 + r (Triton has no round-half-even)
    r = ((x - k * f32(_PIO2_1)) - k * f32(_PIO2_2)) - k * f32(_PIO2_3)  # r in [−π/4, π/4]
    r2 = r * r
    p1, p2, p3 = (f32(c) for c in _SIN_COEFFS)
    c1, c2, c3 = (f32(c) for c in _COS_COEFFS)
    sin_r = r + r * r2 * (p1 + r2 * (p2 + r2 * p3))
    cos_r = f32(1.0) - f32(0.5) * r2 + r2 * r2 * (c1 + r2 * (c2 + r2 * c3))
    n = k.astype(jnp.int32)
    odd = (n & 1) == 1  # quadrants 1 and 3 swap sin and cos
    sin_x = jnp.where(odd, cos_r, sin_r)
    cos_x = jnp.where(odd, sin_r, cos_r)
    return jnp.where((n & 2) == 2, -sin_x, sin_x), jnp.where(((n + 1) & 2) == 2, -cos_x, cos_x)


@sincos.defjvp
def _sincos_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> tuple[tuple, tuple]:
    (x,), (dx,) = primals, tangents
    sin_x, cos_x = sincos(x)
    dx = jnp.asarray(dx, sin_x.dtype)
    return (sin_x, cos_x), (cos_x * dx, -sin_x * dx)
