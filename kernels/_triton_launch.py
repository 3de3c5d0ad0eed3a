"""Launching jaxpe's native Triton kernels (`cope_triton.py`, `corope_triton.py`) from JAX: one function, `launch`,
that hides where they run.

- Compiled (Triton imported without TRITON_INTERPRET=1): through jax-triton's `triton_call`, which compiles the kernel
  for the GPU being lowered for (the local one, or sm_90 when lowering for CUDA on a machine without a GPU:
  `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`). jax-triton 0.3.x (jax 0.10) takes `out_shape=`,
  0.4.x (jax >= 0.11) `out_type=`; both bind the outputs to the kernel's last parameters, so inputs and outputs are
  passed in parameter order and only the keyword differs. 0.4.1's dead-code rule takes jax 0.11's two arguments and
  jax 0.12 passes three: `_patch_dce_rule` registers one that takes either. 0.4.x warns that `zeroed_outputs` is
  deprecated (in favour of refs that jax 0.10 lacks); the warning is silenced here, where that choice is made.
  0.4.x imports `TMA_TF32` from Triton's CUDA driver module, which Triton 3.6 (the release torch 2.11 pins) lacks,
  and on that ImportError it silently drops its whole CUDA backend; `_import_jax_triton` supplies Triton 3.7's value
  first (it only describes TMA tensors, which jaxpe's kernels never take).
- Interpreted (TRITON_INTERPRET=1 set before Triton is imported, as its interpreter requires): on CPU, through
  `jax.pure_callback`, on NumPy arrays wrapped in the few tensor methods the interpreter calls (`HostTensor`); no
  torch. The interpreter multiplies bfloat16 dots wrongly (it reads their raw bits), so bfloat16 arrays reach it
  as float32 and outputs come back rounded to bfloat16 (the kernels then compute as on float32 inputs). Triton
  3.6's interpreter (the release torch 2.11 pins) holds every scalar as a one-element array and takes it as a loop
  bound with `int()`, which NumPy 2.5 refuses for arrays of one dimension; `_interpreter_scalars` gives it Triton
  3.7's squeeze first.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

EXTRA = "pip install 'jaxpe[triton]'"  # triton and the jax-triton release of the installed jax
GPU_COMPUTE_CAPABILITY = 90  # what to compile for when lowering for CUDA without a GPU: an H100


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1 when it was imported)."""
    import triton  # optional: imported only for impl='triton'

    return bool(triton.knobs.runtime.interpret)


def unavailable() -> str | None:
    """Why impl="triton" cannot run in this process, in words (None when it can)."""
    if importlib.util.find_spec("triton") is None:
        return f"impl='triton' needs the triton package: {EXTRA}"
    if interpreted():
        return None
    if importlib.util.find_spec("jax_triton") is None:
        return f"impl='triton' needs jax-triton to compile its kernels: {EXTRA}"
    try:
        _import_jax_triton()
    except Exception as error:  # noqa: BLE001 - jax-triton refuses to import on a jaxlib without CUDA
        return (f"impl='triton' compiles through jax-triton, which does not import here ({error}); on CPU set "
                f"TRITON_INTERPRET=1 before importing triton to run the kernels in Triton's interpreter")
    return None


def require() -> None:
    """ValueError naming what to install or set unless impl="triton" can run."""
    reason = unavailable()
    if reason is not None:
        raise ValueError(reason)


def launch(kernel: Any, args: Sequence[jax.Array | int | float], *, out_shapes: Sequence[jax.ShapeDtypeStruct],
           grid: tuple[int, ...], num_warps: int, num_stages: int, zeroed: Sequence[int] = (),
           name: str = "", **constexprs: Any) -> list[jax.Array]:
    """Run `kernel[grid](*args, *outputs, **constexprs)` and return the outputs.

    args: the kernel's non-constexpr parameters before its outputs, in order (arrays, or Python ints and floats for
    scalar parameters); out_shapes: one per output parameter, which follow; zeroed: indices of outputs that start
    as zeros (accumulated into with atomics), the others start undefined; constexprs: the constexpr parameters.
    """
    require()
    if interpreted():
        return _launch_interpreted(kernel, args, out_shapes=out_shapes, grid=grid, **constexprs)
    return _launch_compiled(kernel, args, out_shapes=out_shapes, grid=grid, num_warps=num_warps,
                            num_stages=num_stages, zeroed=zeroed, name=name, **constexprs)


# --- compiled: jax-triton --------------------------------------------------------------------------------------------


TRITON_3_7_TMA_TF32 = 11  # triton.backends.nvidia.driver.TMA_TF32 from Triton 3.7 on


def _import_jax_triton() -> Any:
    """`import jax_triton`, after giving Triton 3.6's CUDA driver module the name jax-triton 0.4.x imports from it."""
    if importlib.util.find_spec("triton.backends.nvidia") is not None:
        from triton.backends.nvidia import driver  # optional: Triton, only for impl="triton"

        if not hasattr(driver, "TMA_TF32"):
            driver.TMA_TF32 = TRITON_3_7_TMA_TF32
    import jax_triton  # optional, and it refuses to import on a jaxlib without CUDA

    return jax_triton


@functools.cache
def _jax_triton() -> Any:
    """jax_triton, with its dead-code rule made to take jax 0.12's arguments."""
    jax_triton = _import_jax_triton()
    _patch_dce_rule(jax_triton)
    return jax_triton


def _patch_dce_rule(jax_triton: Any) -> None:
    """Register a dead-code rule for jax-triton's primitive that keeps every input and takes the arguments of every
    jax release (jax 0.12 passes a third)."""
    from jax._src.interpreters import partial_eval as pe  # private: where jax keeps the dead-code rules

    primitive = getattr(jax_triton.triton_lib, "triton_kernel_call_p", None)
    if primitive is None or primitive not in pe.dce_rules:
        return

    def keep_every_input(used_outputs: list[bool], *rest: Any) -> tuple[list[bool], Any]:
        eqn = rest[-1]
        return [True] * len(eqn.invars), eqn

    pe.dce_rules[primitive] = keep_every_input


def _compute_capability() -> int | None:
    """The local GPU's compute capability, or GPU_COMPUTE_CAPABILITY when there is none (lowering for CUDA on CPU)."""
    if any(device.platform == "gpu" for device in jax.devices()):
        return None  # jax-triton reads it from the device
    return GPU_COMPUTE_CAPABILITY


def _launch_compiled(kernel: Any, args: Sequence[jax.Array | int | float], *,
                     out_shapes: Sequence[jax.ShapeDtypeStruct], grid: tuple[int, ...], num_warps: int,
                     num_stages: int, zeroed: Sequence[int], name: str, **constexprs: Any) -> list[jax.Array]:
    jt = _jax_triton()
    parameters = inspect.signature(jt.triton_call).parameters  # jax-triton 0.4's API, or 0.3's
    shapes = {"out_type" if "out_type" in parameters else "out_shape": list(out_shapes)}
    # FMA contraction asked for by name, as the kernels were timed: jax-triton 0.3 passes enable_fp_fusion=True itself,
    # 0.4 leaves it to Triton's default, which Triton 3.10 turns off
    fusion = ({"backend_options": {"enable_fp_fusion": True}} if "backend_options" in parameters
              else {"enable_fp_fusion": True})
    is_array = [isinstance(a, jax.Array) or hasattr(a, "shape") for a in args]

    def call(*arrays: jax.Array) -> list[jax.Array]:
        given = iter(arrays)
        kernel_args = [next(given) if flag else a for a, flag in zip(args, is_array)]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="zeroed_outputs is deprecated", category=DeprecationWarning)
            return list(jt.triton_call(*kernel_args, kernel=kernel, grid=grid, num_warps=num_warps,
                                       num_stages=num_stages, zeroed_outputs=tuple(zeroed),
                                       compute_capability=_compute_capability(), name=name or kernel.__name__,
                                       **shapes, **fusion, **constexprs))

    return list(_one_member_at_a_time(call)(*[a for a, flag in zip(args, is_array) if flag]))


def _one_member_at_a_time(call: Any) -> Any:
    """`call` (arrays -> list of arrays) under `vmap` as a loop over the members (`lax.map`): jax-triton's primitive
    refuses vmap, and a kernel launched once a member at the sizes people vmap (seeds of a model, an ensemble) still
    fills the GPU. The interpreted path does the same through pure_callback's vmap_method="sequential"."""
    mapped = jax.custom_batching.custom_vmap(call)

    @mapped.def_vmap
    def rule(axis_size: int, in_batched: Sequence[bool], *arrays: jax.Array) -> tuple[list[jax.Array], list[bool]]:
        del axis_size

        def member(batched: Sequence[jax.Array]) -> list[jax.Array]:
            given = iter(batched)
            return mapped(*[next(given) if flag else a for a, flag in zip(arrays, in_batched)])

        outs = jax.lax.map(member, [a for a, flag in zip(arrays, in_batched) if flag])
        return list(outs), [True] * len(outs)

    return mapped


# --- interpreted: Triton's interpreter on NumPy arrays ---------------------------------------------------------------


class _Dtype:
    """A dtype as the interpreter names it (torch's spelling: "torch.float32")."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__


# One object per dtype name: Triton caches an argument's type by the id() of its dtype object, and a fresh object per
# launch can take a freed one's address and be read as that one's type (a float32 q read as int32).
_dtype = functools.cache(_Dtype)


class _Storage:
    """The memory of a HostTensor: the interpreter copies "to the host" and back through it (a no-op here)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def cpu(self) -> _Storage:
        return self

    def copy_(self, other: _Storage) -> None:
        del other  # the same memory


class HostTensor:
    """A C-contiguous NumPy array with the tensor methods Triton's interpreter calls (data_ptr, dtype, storage)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self._storage = _Storage(array)
        self.dtype = _dtype(str(array.dtype))

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self) -> _Storage:
        return self._storage

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return self.array.shape

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def new_empty(self, *args: Any, **kwargs: Any) -> HostTensor:
        del args, kwargs
        return HostTensor(np.empty(0, self.array.dtype))

    def set_(self, storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> HostTensor:
        del offset, size, stride  # the whole storage: HostTensors are never views
        self.array, self._storage = storage.array, storage
        return self


def _host_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype the interpreter computes right in: bfloat16's is float32 (which holds it exactly), others their own."""
    return np.dtype(np.float32) if dtype == jax.numpy.bfloat16 else np.dtype(dtype)


@functools.cache
def _interpreter_scalars() -> None:
    """Make Triton 3.6's interpreter index with its one-element scalars (`range(0, n)` on a kernel argument or a
    program id) under NumPy >= 2.5, as Triton 3.7's does: `int(data.squeeze())` where it calls `int(data)`."""
    import triton  # optional: imported only for impl='triton'
    from triton.runtime import interpreter  # optional, as triton above

    if tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 7):
        return
    patch_tensor = interpreter._patch_lang_tensor  # private: where the interpreter gives tensors Python's protocols

    def with_squeezed_index(tensor: Any, scope: Any) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = with_squeezed_index


def _launch_interpreted(kernel: Any, args: Sequence[jax.Array | int | float], *,
                        out_shapes: Sequence[jax.ShapeDtypeStruct], grid: tuple[int, ...],
                        **constexprs: Any) -> list[jax.Array]:
    _interpreter_scalars()
    is_array = [isinstance(a, jax.Array) or hasattr(a, "shape") for a in args]
    arrays = [a for a, flag in zip(args, is_array) if flag]

    def host(*host_arrays: np.ndarray) -> list[np.ndarray]:
        inputs = iter(HostTensor(np.ascontiguousarray(a, _host_dtype(a.dtype))) for a in host_arrays)
        outputs = [HostTensor(np.zeros(s.shape, _host_dtype(s.dtype))) for s in out_shapes]
        kernel_args = [next(inputs) if flag else a for a, flag in zip(args, is_array)]
        kernel[grid](*kernel_args, *outputs, **constexprs)
        return [o.array.astype(s.dtype) for o, s in zip(outputs, out_shapes)]

    results = jax.pure_callback(host, [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shapes], *arrays,
                                vmap_method="sequential")
    return list(results)
