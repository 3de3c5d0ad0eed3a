"""Choosing an implementation for the contextual attentions (reference, blockwise, pallas, triton, or auto) and
running it for the platform the call is lowered for."""
from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpe.kernels._checks import fused_refusal
from jaxpe.kernels._common import pallas_unsupported
from jaxpe.validation import check_impl

ENCODINGS = ("cope", "corope")

# On CPU, "auto" runs the dense path below these lengths and "blockwise" from them on: the shortest length from
# which blockwise's forward+backward was no slower (within 5 %) at every longer measured length
# (benchmarks/auto_dispatch.py, its output in results/bench/auto_dispatch_cpu.json; tests/test_dispatch.py holds the
# two together).
BLOCKWISE_MIN_LENGTH = {"cope": 2048, "corope": 8}
# Below those lengths the dense path still stays within memory: at most this many entries per [B, Hq, L, L] array
# (256 MiB in float32), beyond which "auto" runs blockwise at any length.
DENSE_MAX_ENTRIES = 2**26
# The GPU that lowering for CUDA on a machine without one targets: an H100, as kernels/_triton_launch.py compiles for.
LOWERING_COMPUTE_CAPABILITY = "9.0"
# The fused paths of an NVIDIA GPU, the faster first, by the cost per logit of every kernel compiled for an H100
# (benchmarks/kernel_cost.py's model, results/cost/kernel_cost.json; tests/test_kernel_cost.py holds the two together)
# and by timings on an H200 (results/bench/bench_gpu_h200_native_4096.md: forward+backward through the Pallas kernels
# 2.3-3.4x the native ones'). "auto" runs the first one installed ("triton" needs jax-triton: `jaxpe[triton]`), and
# "blockwise" where that one refuses the inputs: never a slower fused path where a faster one is installed.
GPU_PREFERENCE = {"cope": ("triton", "pallas"), "corope": ("triton", "pallas")}
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")  # jax's CUDA plugins (jax[cuda13], jax[cuda12])


# Every path of every contextual operation: (operation, impl) -> "module:function", imported when the path first runs
# (Pallas and Triton load only for their own paths). One signature, path(call, compiled) -> the operation's output:
# `call` is the operation's checked inputs and options (its module's `Call`), `compiled` True where the call is lowered
# for CUDA (the Pallas kernels then compile rather than interpret). A new operation adds its paths here and its rows
# of ENCODINGS or UNFUSED_KERNELS.
PATHS = {
    ("cope", "reference"): "jaxpe.cope:reference_path",
    ("cope", "blockwise"): "jaxpe.cope:blockwise_path",
    ("cope", "pallas"): "jaxpe.cope:pallas_path",
    ("cope", "triton"): "jaxpe.cope:triton_path",
    ("corope", "reference"): "jaxpe.corope:reference_path",
    ("corope", "blockwise"): "jaxpe.corope:blockwise_path",
    ("corope", "pallas"): "jaxpe.corope:pallas_path",
    ("corope", "triton"): "jaxpe.corope:triton_path",
    ("fox", "reference"): "jaxpe.fox:reference_path",
    ("fox", "blockwise"): "jaxpe.fox:blockwise_path",
    ("fox", "pallas"): "jaxpe.fox:pallas_path",
    ("stickbreaking", "reference"): "jaxpe.stickbreaking:reference_path",
    ("stickbreaking", "blockwise"): "jaxpe.stickbreaking:blockwise_path",
    ("stickbreaking", "pallas"): "jaxpe.stickbreaking:pallas_path",
    ("stickbreaking", "triton"): "jaxpe.stickbreaking:triton_path",
}


def _load(name: str) -> Callable[..., Any]:
    """The function a table names ("module:function"); the module is imported once (sys.modules)."""
    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)


def run_path(operation: str, impl: str, call: Any, compiled: bool = False) -> Any:
    """The output of path `impl` of `operation` (PATHS) on its checked call."""
    return _load(PATHS[(operation, impl)])(call, compiled)


def refusal(impl: str, call: Any) -> Exception | None:
    """The error path `impl` of any operation raises for this call (its q and causal), None where it takes it: every
    fused path ("pallas", "triton") refuses what kernels/_checks.fused_refusal does, the check its entry makes (asked
    here without loading Pallas or Triton: bidirectional calls, float64, symbolic shapes); "auto" runs "blockwise"
    instead. The other paths take every checked call."""
    if impl not in ("pallas", "triton"):
        return None
    return fused_refusal(_as_jax_arrays(call).q, impl=impl, causal=call.causal)


def _as_jax_arrays(call: Any) -> Any:
    """The call (a NamedTuple) with its NumPy arrays as the jax arrays jax computes with: a NumPy float64 array is
    float32 without jax_enable_x64, as the XLA paths take it, so that the fused paths, which check their dtype
    before any jax operation, see the same (they refused it as float64)."""
    return type(call)(*(jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in call))


def run_chosen(operation: str, choice: Choice, call: Any) -> Any:
    """`run_for_platform` over the table: the chosen path of `operation` for each platform the call is lowered for, on
    the call's NumPy arrays as jax arrays (`_as_jax_arrays`)."""
    call = _as_jax_arrays(call)
    return run_for_platform(choice, lambda impl, compiled: run_path(operation, impl, call, compiled))


class Choice(NamedTuple):
    """The implementation for each platform a call may be lowered for: `cuda` (NVIDIA GPUs) and `other` (CPU, TPU,
    ROCm). The same impl in both unless "auto" was traced on CPU with a CUDA plugin installed."""

    cuda: str
    other: str


def resolve_impl(impl: str, length: int, head_dim: int, *, encoding: str, batch_heads: int, causal: bool = True,
                 dense: bool = False, kernel_refusal: Callable[[str], object | None] | None = None) -> Choice:
    """The implementations `impl` stands for, for `encoding` ("cope" or "corope") at this length, head dim and
    batch × query heads.

    "auto" is a fused path where the fused kernels compile (an NVIDIA GPU of compute capability 8.0 or more,
    D <= 256): the first of GPU_PREFERENCE[encoding] that runs here ("triton" with jax-triton installed, else
    "pallas"), or "blockwise" where that one refuses the inputs; on CPU the dense "reference" below
    BLOCKWISE_MIN_LENGTH[encoding] while batch_heads·L² <= DENSE_MAX_ENTRIES, "blockwise" otherwise; on any other
    accelerator (TPU, ROCm, older GPUs, larger heads) "blockwise", with one warning that says why. Traced on CPU
    with a CUDA plugin installed (`cuda_lowering`), "auto" is that CPU choice for every platform but CUDA, and for
    CUDA what a GPU would pick (for an H100): `run_for_platform` then lowers the one that fits the platform. A
    symbolic length or batch (`jax.export` with shape polymorphism) is "blockwise" everywhere: it runs at any length
    in O(L·block) memory. This is the one place that chooses; the entry points have refused what an explicit impl
    cannot run.

    causal=False: "auto" never picks a fused path (the fused kernels are causal; asked for by name, a ValueError).
    dense: the call needs the dense path
    (keys from a decoding cache under a mask, extra logits, CoPE's dense-only variants): "reference" whatever `impl`.
    kernel_refusal: kernel_refusal(fused) gives the reason the fused path `fused` ("triton" or "pallas") refuses these
    inputs (None: it runs them); "auto" then runs "blockwise".
    """
    check_impl(impl, causal=causal)
    if encoding not in ENCODINGS:
        raise ValueError(f"{encoding=} must be one of {ENCODINGS}")
    if dense:
        return Choice("reference", "reference")
    if impl != "auto":
        return Choice(impl, impl)
    if not isinstance(length, int) or not isinstance(batch_heads, int):
        return Choice("blockwise", "blockwise")
    backend = jax.default_backend()
    if backend == "cpu":
        small = length < BLOCKWISE_MIN_LENGTH[encoding] and batch_heads * length**2 <= DENSE_MAX_ENTRIES
        other = "reference" if small else "blockwise"
        if not cuda_lowering():
            return Choice(other, other)
        reason = pallas_unsupported(head_dim, backend="gpu", compute_capability=LOWERING_COMPUTE_CAPABILITY)
        return Choice(_fused_unless_refused(reason, causal, encoding, kernel_refusal), other)
    reason = pallas_unsupported(head_dim, backend=backend,
                                compute_capability=getattr(jax.devices()[0], "compute_capability", None))
    if reason is not None:
        _warn_once(f"jaxpe: impl='auto' runs the 'blockwise' path instead of the fused 'pallas' kernels: {reason}")
    chosen = _fused_unless_refused(reason, causal, encoding, kernel_refusal)
    return Choice(chosen, chosen)


def _fused_unless_refused(reason: str | None, causal: bool, encoding: str,
                          kernel_refusal: Callable[[str], object | None] | None) -> str:
    """The first fused path of GPU_PREFERENCE[encoding] that can run here, if it takes the inputs; "blockwise" when
    the platform cannot run the fused kernels (`reason`), the call is bidirectional or that path refuses it."""
    if reason is not None or not causal:
        return "blockwise"
    fused = next(f for f in GPU_PREFERENCE[encoding] if f != "triton" or triton_compiles())
    return fused if kernel_refusal is None or kernel_refusal(fused) is None else "blockwise"


@functools.cache
def triton_compiles() -> bool:
    """Whether impl="triton" compiles its kernels for the GPU here: triton and jax-triton import, and Triton is not
    set to interpret (TRITON_INTERPRET=1 runs the kernels on the host)."""
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("jax_triton") is None:
        return False
    from jaxpe.kernels._triton_launch import interpreted, unavailable  # imports triton

    return not interpreted() and unavailable() is None


def cuda_lowering() -> bool:
    """Whether "auto" stages a CUDA choice beside the CPU one: the default backend is CPU and one of jax's CUDA
    plugins is installed, so that lowering for CUDA here (`lower(lowering_platforms=("cuda",))`, `jax.export`) is
    what this environment is set up for. Without a plugin the CUDA branch is not traced: it costs tracing time, and a
    second derivative, which the CPU paths take, fails while tracing the fused kernels' branch."""
    return jax.default_backend() == "cpu" and _cuda_plugin_installed()


@functools.cache
def _cuda_plugin_installed() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in CUDA_PLUGINS)


def run_for_platform(choice: Choice, run: Callable[[str, bool], jax.Array]) -> jax.Array:
    """run(impl, compiled) for the platform being lowered for. Where the choice is one impl and nothing depends on the
    platform, run(impl, False) (compiled=False: the Pallas kernels interpret or not by the backend). Otherwise
    `lax.platform_dependent`: run(choice.cuda, True) for CUDA (compiled: Pallas lowered to Triton, not interpreted)
    and run(choice.other, False) for every other platform; so also "pallas" traced on CPU with a CUDA plugin
    installed, interpreted on CPU and lowered to Triton for CUDA. Both branches are traced; only the lowered one is
    compiled.

    Differentiated, a conditional's residuals are those of all its branches, each branch returning zeros for the
    others': the dense path's [B, H, L/3..L, L] residuals would become arrays of zeros in the CUDA program. So a dense
    "reference" branch is rematerialised (`jax.checkpoint`: its residuals are its inputs; its backward recomputes
    its forward)."""
    if choice.cuda == choice.other and not (choice.cuda == "pallas" and cuda_lowering()):
        return run(choice.other, False)
    other = lambda: run(choice.other, False)  # noqa: E731
    if choice.other == "reference":
        other = jax.checkpoint(other)
    return lax.platform_dependent(cuda=lambda: run(choice.cuda, True), default=other)


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


# The encodings whose fused kernels "auto" does not pick (not yet compiled and timed on a GPU): "auto" runs their
# dense reference below this length (while batch_heads·L² <= DENSE_MAX_ENTRIES) and "blockwise" from it on, on
# every platform. From one noisy CPU measurement (2 shared cores; forward+backward, B 1, H 4, D 32), not yet a
# committed benchmark as BLOCKWISE_MIN_LENGTH's: blockwise / dense took 3.7 / 8.1 ms (FoX) and 11.5 / 87.9 ms
# (stick-breaking) at L = 256, 46 / 779 and 194 / 3289 ms at L = 1024; below 256 the two were within the noise.
UNFUSED_BLOCKWISE_MIN_LENGTH = {"fox": 256, "stickbreaking": 256}
# The fused paths they have, run only when asked for by name.
UNFUSED_KERNELS = {"fox": ("pallas",), "stickbreaking": ("pallas", "triton")}


def resolve_unfused_impl(impl: str, length: int, *, encoding: str, batch_heads: int, causal: bool = True) -> str:
    """The implementation `impl` stands for, for an encoding of UNFUSED_BLOCKWISE_MIN_LENGTH: "reference",
    "blockwise" or a fused path of UNFUSED_KERNELS as asked, "auto" by length (above), or "reference" at a symbolic
    length or batch (jax.export: the blockwise tiling needs static sizes); a fused path the encoding lacks, one
    asked for bidirectional attention (causal=False), or "blockwise" at a symbolic length is a ValueError."""
    check_impl(impl, causal=causal)
    if encoding not in UNFUSED_BLOCKWISE_MIN_LENGTH:
        raise ValueError(f"{encoding=} must be one of {tuple(UNFUSED_BLOCKWISE_MIN_LENGTH)}")
    if impl in ("pallas", "triton") and impl not in UNFUSED_KERNELS[encoding]:
        fused = " or ".join(repr(name) for name in UNFUSED_KERNELS[encoding])
        raise ValueError(f"impl={impl!r}: {encoding} has no such fused kernel; use impl='blockwise' (O(L·block) "
                         f"memory), 'reference' (dense), 'auto'{' or ' + fused if fused else ''}")
    if impl == "blockwise" and not isinstance(length, int):
        raise ValueError(f"impl='blockwise' of {encoding} needs a static length (its key blocks are sized when "
                         f"tracing), got the symbolic length L={length} (jax.export); use impl='auto' or "
                         f"'reference', which export with a symbolic batch and length")
    if impl != "auto":
        return impl
    if not isinstance(length, int) or not isinstance(batch_heads, int):  # symbolic shapes (jax.export)
        return "reference"
    small = length < UNFUSED_BLOCKWISE_MIN_LENGTH[encoding] and batch_heads * length**2 <= DENSE_MAX_ENTRIES
    return "reference" if small else "blockwise"
