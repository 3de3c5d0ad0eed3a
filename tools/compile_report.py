"""Compile every fused kernel for an H100 (sm_90a) on a machine without a GPU, and report what it costs.

    python tools/compile_report.py --out results/compile           # the full grid: sm90a.json and sm90a.md there
    python tools/compile_report.py --out /some/dir --quick         # D 64, GQA, npos 64 only
    python tools/compile_report.py --no-write --ops cope           # print the table only
    python tools/compile_report.py --no-write --paths triton       # the native Triton kernels only

A command-line tool beside the library, not part of it: it imports the kernels from jaxpe.kernels (cope_pallas,
corope_pallas, fox_pallas, stickbreaking_pallas; cope_triton, corope_triton, stickbreaking_triton) and is not
installed with the wheel; `make compile-report` runs it into results/compile/.

Two paths, the same grid and budgets: "pallas", the Pallas kernels through XLA's Triton compiler, and "triton", the
native Triton kernels through Triton's own compiler (as jax-triton compiles them when they run). Ops: CoPE, Co-RoPE
and stick-breaking attention ("stickbreaking") on both paths; forgetting attention (FoX, "fox") on the Pallas path,
its only fused one (OP_PATHS).

How, pallas (no GPU needed): each op and its gradient are lowered for CUDA
(`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`); every `stablehlo.custom_call` to
`__gpu$xla.gpu.triton` carries the Pallas kernel as Triton MLIR bytecode (`mhlo.backend_config`: name, ir,
num_warps, num_stages). XLA's own Triton compiler, shipped in the CUDA plugin of jax (`jax-cuda13-plugin`, the
version of the installed jaxlib), turns it into PTX for compute capability 9.0 (`.target sm_90a`) and gives the
shared memory; `ptxas -v --gpu-name=sm_90a` (from the `nvidia-cuda-nvcc` wheel) gives registers and spills. A bad
setting can abort the Triton compiler, so kernels compile in subprocesses (each compiles one kernel after another,
and a crash ends only the kernel it was compiling). Shared memory over the limit
compiles without complaint; the report checks it against SMEM_LIMIT_BYTES itself. ptxas needs minutes and GBs on
Co-RoPE's megabytes of PTX: it is skipped over --max-ptx-mib and capped at --ptxas-memory-gib (the row says so).
Works with jax 0.10 only: from 0.11 on, jax's CUDA plugin no longer hands XLA's Triton compiler to Python.

How, triton: each op and its gradient are traced (`jax.jit(f).trace(...)`, nothing runs) with
`jaxpe.kernels._triton_launch.launch` replaced by a recorder (`_recorded_launches`, the tool's only hook into the
kernels), which keeps every launch (the @triton.jit function, its arguments' avals and Python scalars, out_shapes,
grid, num_warps, num_stages, constexprs) and returns zeros. Each launch is compiled as the installed jax-triton
compiles it: parameter types from its own `get_triton_type` (0.3; Python floats are fp64) or `get_type_id` (0.4; fp32
where they fit), scalars equal to 1 as constexprs,
array pointers 16-byte aligned, fp fusion on; `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))` in
a subprocess gives the PTX (the very PTX jax-triton embeds; a test checks) and `metadata.shared`; the same `ptxas -v`
gives registers and spills. These rows need triton and jax-triton; without them they are skipped, saying why.

Letters: B batch, L length, N query heads, K key/value heads, D head dim, P = npos (CoPE's table rows).
Kernels per op: "forward" (inference), "forward_train" (the forward that saves residuals for the gradient: on the
pallas path when it differs; on the triton path the inference forward's kernel again, compiled once) and "backward"
(one fused kernel: dq, dk, dv and the position/gate gradients).
"""
from __future__ import annotations

import argparse
import ast
import atexit
import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import pathlib
import platform
import queue
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, ClassVar, Iterable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp

from cuda_tools import ToolchainMissing, cuda_tool_version, find_cuda_tool  # tools/cuda_tools.py, beside this file

TRITON_CALL = "__gpu$xla.gpu.triton"
GPU_NAME = "sm_90a"  # ptxas target: H100/H200 with the Hopper-only instructions Triton emits (wgmma)
TRITON_ARCH = "9.0"  # compute capability as XLA's Triton compiler takes it
TRITON_TARGET = ("cuda", 90, 32)  # Triton's own GPUTarget: backend, compute capability, warp size
LOWERED_FOR = "NVIDIA H100"  # the abstract device jax >= 0.12 reads the GPU generation from
SMEM_LIMIT_BYTES = 232448  # sm_90: 227 KiB of shared memory per block (opt-in maximum)
# Spilled bytes per thread (stores and loads each) each kernel role may have: none in the forward kernels, whose
# tiles fit the register file; up to 512 in the fused backward, which holds dq, dk, dv and the position gradients.
SPILL_BUDGET_BYTES = {"forward": 0, "forward_train": 0, "backward": 512}
PLUGINS = ("jax-cuda13-plugin", "jax-cuda12-plugin")
OPS = ("cope", "corope", "fox", "stickbreaking")
PATHS = ("pallas", "triton")  # Pallas kernels through XLA's Triton compiler; native Triton kernels through Triton's
OP_PATHS = {"cope": PATHS, "corope": PATHS, "fox": ("pallas",), "stickbreaking": PATHS}  # each op's paths
DTYPES = ("float32", "bfloat16")
HEAD_DIMS = (64, 128, 256)
HEADS = ((8, 2), (8, 8))  # (N, K): GQA with groups of 4, and MHA
NPOS = (64, 513)  # CoPE table rows: a small table, and block 512 + 1 (the layer's default)
LENGTH = 1024
# ptxas on Co-RoPE's PTX: 4.6 MiB (D 64) took 45 s and 2.2 GB, 9.5 MiB (D 128) 2.7 min and 6.9 GB, 13-19 MiB
# (D 256) over 10 minutes and past 10 GB. Larger PTX is not given to ptxas, and ptxas no more memory than this.
MAX_PTX_MIB = 12.0
PTXAS_MEMORY_GIB = 8.0
_RESULT_PREFIX = "@@compile_report "
SCRIPT = pathlib.Path(__file__).resolve()  # the compile subprocesses run this file again, with --serve


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """What compiles the kernels: the plugin's distribution name and version, and a ptxas."""

    plugin: str
    plugin_version: str
    ptxas: str
    ptxas_version: str


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration of an op: inputs q [B, L, N, D], k/v [B, L, K, D] (and a CoPE table [P, D], FoX's running
    sum of log forget gates [B, L, N])."""

    op: str  # OPS
    dtype: str  # "float32" or "bfloat16"
    head_dim: int
    q_heads: int
    kv_heads: int
    npos: int | None = None  # CoPE only
    length: int = LENGTH
    batch: int = 1

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op={self.op!r} must be one of {OPS}")
        if (self.op == "cope") != (self.npos is not None):
            raise ValueError(f"npos={self.npos} must be given for cope and only for cope (op={self.op!r})")
        jnp.dtype(self.dtype)  # raises on an unknown name

    @property
    def id(self) -> str:
        npos = f"-P{self.npos}" if self.npos is not None else ""
        return f"{self.op}-{_short_dtype(self.dtype)}-D{self.head_dim}-N{self.q_heads}K{self.kv_heads}{npos}"


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One Triton call of a case, lowered for the GPU: the kernel's role, its Triton name and settings, its IR."""

    path: ClassVar[str] = "pallas"
    case: Case
    role: str  # "forward", "forward_train", "backward" (or the Triton name when it says none of these)
    name: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]
    ir: bytes = dataclasses.field(repr=False)  # Triton MLIR bytecode


@dataclasses.dataclass(frozen=True)
class TritonLaunch:
    """One launch of a native Triton kernel of a case, recorded while tracing: its role, the launch's name and
    settings, and `spec`, what Triton compiles (JSON: the @triton.jit function as "module:name", each parameter's
    Triton type as jax-triton gives it, the constexprs, the 16-byte aligned pointer parameters)."""

    path: ClassVar[str] = "triton"
    case: Case
    role: str  # "forward", "forward_train", "backward" (or the launch's name when it says none of these)
    name: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]
    spec: str = dataclasses.field(repr=False)


@dataclasses.dataclass(frozen=True)
class Row:
    """What compiling one kernel gave: ptxas's registers and spills (bytes per thread), Triton's shared memory."""

    path: str  # "pallas" or "triton"
    op: str
    dtype: str
    head_dim: int
    q_heads: int
    kv_heads: int
    npos: int | None
    length: int
    batch: int
    kernel: str
    name: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack_frame: int | None = None
    smem_bytes: int | None = None
    ptx_bytes: int | None = None
    triton_seconds: float | None = None
    ptxas_seconds: float | None = None
    error: str | None = None  # lowering, Triton or ptxas failure; the numbers above are then partly missing

    @property
    def case_id(self) -> str:
        return Case(self.op, self.dtype, self.head_dim, self.q_heads, self.kv_heads, self.npos, self.length,
                    self.batch).id

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> Row:
        """A row read back from the JSON report."""
        return cls(**{**row, "grid": tuple(row["grid"])})

    def launch_problems(self) -> list[str]:
        """Why this kernel would not run on an H100: it did not compile, or its shared memory is over the limit."""
        found = [f"failed: {self.error}"] if self.error is not None else []
        if self.smem_bytes is not None and self.smem_bytes > SMEM_LIMIT_BYTES:
            found.append(f"shared memory {self.smem_bytes} > {SMEM_LIMIT_BYTES} bytes")
        return found

    def spill_problems(self) -> list[str]:
        """Spills over the budget of this kernel's role (unknown when ptxas did not finish)."""
        budget = SPILL_BUDGET_BYTES.get(self.kernel)
        if budget is None:
            return [f"no spill budget for a {self.kernel!r} kernel (roles: {', '.join(SPILL_BUDGET_BYTES)})"]
        if self.spill_stores is None or self.spill_loads is None:
            return ["spills unknown: ptxas did not finish"]
        if max(self.spill_stores, self.spill_loads) > budget:
            return [f"spills {self.spill_stores}/{self.spill_loads} bytes (store/load) > {budget}"]
        return []

    def problems(self) -> list[str]:
        """Every way this kernel misses its budgets (an empty list: within all of them)."""
        return self.launch_problems() + (self.spill_problems() if self.error is None else [])


def _short_dtype(dtype: str) -> str:
    return {"float32": "f32", "bfloat16": "bf16"}.get(dtype, dtype)


def default_cases(ops: Sequence[str] = OPS, dtypes: Sequence[str] = DTYPES, head_dims: Sequence[int] = HEAD_DIMS,
                  heads: Sequence[tuple[int, int]] = HEADS, npos: Sequence[int] = NPOS,
                  length: int = LENGTH) -> list[Case]:
    """Every combination (npos for CoPE only), in op, dtype, D, heads, npos order."""
    cases = []
    for op in ops:
        for dtype in dtypes:
            for head_dim in head_dims:
                for n, k in heads:
                    for p in (npos if op == "cope" else (None,)):
                        cases.append(Case(op, dtype, head_dim, n, k, p, length))
    return cases


def default_jobs() -> int:
    """Compiles at a time: one per CPU, with room for a ptxas at its memory cap (plus 2 GB) beside each."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        memory_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2 ** 30
    except (ValueError, OSError, AttributeError):
        return max(1, cpus // 2)
    return max(1, min(cpus, int(memory_gib // (PTXAS_MEMORY_GIB + 2))))


# ---------------------------------------------------------------------------------------------------- toolchain


def find_toolchain(ptxas: str | None = None) -> Toolchain:
    """The installed CUDA plugin (same version as jaxlib) and a ptxas that knows sm_90a, or ToolchainMissing.

    ptxas: a path; else $PTXAS, the nvidia-cuda-nvcc wheel (nvidia/cu13/bin, nvidia/cuda_nvcc/bin), then PATH."""
    jaxlib_version = importlib.metadata.version("jaxlib")
    install = (f"install them with:\n    pip install 'jax-cuda13-plugin=={jaxlib_version}'\n"
               f"    pip install --no-deps nvidia-cuda-nvcc\n"
               "(or run `make test-compile`, which makes .venv-compile with both). In a venv without a GPU, set "
               "JAX_PLATFORMS=cpu so that jax does not try to start CUDA.")
    plugin = plugin_version = None
    for name in PLUGINS:
        try:
            plugin, plugin_version = name, importlib.metadata.version(name)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    if plugin is None:
        raise ToolchainMissing("the compile report needs XLA's Triton compiler from jax's CUDA plugin "
                               f"(jax-cuda13-plugin=={jaxlib_version}) and ptxas (nvidia-cuda-nvcc); {install}")
    if plugin_version != jaxlib_version:
        raise ToolchainMissing(f"{plugin}=={plugin_version} does not match jaxlib=={jaxlib_version}; {install}")
    from jax._src.lib import triton  # jax has no public API for XLA's Triton compiler

    if not hasattr(triton, "compile"):
        raise ToolchainMissing(f"jax {jax.__version__} no longer exposes XLA's Triton compiler to Python (the CUDA "
                               "plugin registers it up to jax 0.10; from 0.11 on, XLA compiles Triton calls only "
                               "inside its own GPU compile): run the report with jax 0.10, as .venv-compile does "
                               "(make test-compile)")
    path = find_cuda_tool("ptxas", ptxas, ("cu13/bin", "cuda_nvcc/bin"))
    if path is None:
        raise ToolchainMissing(f"ptxas not found (looked at $PTXAS, the nvidia-cuda-nvcc wheel and PATH); {install}")
    return Toolchain(plugin, plugin_version, path, cuda_tool_version(path))


def triton_unavailable() -> str | None:
    """Why the native Triton kernels cannot be compiled here (None when they can): they need triton (its compiler, not
    its interpreter) and jax-triton (the parameter types they are compiled with)."""
    from jaxpe.kernels import _triton_launch  # jax-triton as the kernels import it (Triton 3.6's driver name)

    try:
        importlib.import_module("triton.compiler")
        _triton_launch._import_jax_triton()
        importlib.import_module("jax_triton.triton_lib")
    except Exception as e:  # noqa: BLE001 - jax-triton refuses to import on some jaxlibs
        release = "jax-triton==0.3.1" if sys.version_info < (3, 12) else "jax-triton>=0.4.1,<0.5"  # jax 0.10; >= 0.11
        return (f"the native Triton kernels need triton and jax-triton ({type(e).__name__}: {e}); install them with:\n"
                f"    pip install triton\n    pip install --no-deps '{release}' absl-py")
    if _triton_launch.interpreted():
        return ("Triton was imported with TRITON_INTERPRET=1: its @triton.jit kernels are the interpreter's, which its "
                "compiler does not take; run with TRITON_INTERPRET=0")
    return None


# ----------------------------------------------------------------------------------------------------- lowering


def _attention(case: Case, path: str = "pallas") -> tuple[Callable[..., jax.Array], tuple[jax.ShapeDtypeStruct, ...]]:
    """The op of the path with its default block sizes and warps (one output: stick-breaking's remainder is left
    out), and the abstract inputs of the case."""
    dtype = jnp.dtype(case.dtype)
    q = jax.ShapeDtypeStruct((case.batch, case.length, case.q_heads, case.head_dim), dtype)
    kv = jax.ShapeDtypeStruct((case.batch, case.length, case.kv_heads, case.head_dim), dtype)
    sm_scale = case.head_dim ** -0.5
    if path not in OP_PATHS[case.op]:
        raise ValueError(f"{case.op} has no {path} kernels (its paths: {OP_PATHS[case.op]})")
    module = importlib.import_module(kernel_module(case.op, path))  # the triton ones import triton
    options = {} if path == "triton" else {"interpret": False}
    if case.op == "cope":
        fn = functools.partial(module.cope_attention_pallas if path == "pallas" else module.cope_attention_triton,
                               sm_scale=sm_scale, **options)
        return fn, (q, kv, kv, jax.ShapeDtypeStruct((case.npos, case.head_dim), dtype))
    if case.op == "corope":
        entry = module.corope_attention_pallas if path == "pallas" else module.corope_attention_triton
        return functools.partial(entry, theta=10000.0, sm_scale=sm_scale, **options), (q, kv, kv)
    if case.op == "fox":
        fn = functools.partial(module.forgetting_attention_pallas, sm_scale=sm_scale, **options)
        return fn, (q, kv, kv, jax.ShapeDtypeStruct((case.batch, case.length, case.q_heads), jnp.float32))
    entry = module.stickbreaking_attention_pallas if path == "pallas" else module.stickbreaking_attention_triton
    sb = functools.partial(entry, sm_scale=sm_scale, **options)
    return lambda q, k, v: sb(q, k, v)[0], (q, kv, kv)


def _gradient(fn: Callable[..., jax.Array], nargs: int) -> Callable[..., tuple[jax.Array, ...]]:
    """The gradient of fn's output sum with respect to every input."""
    return jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=tuple(range(nargs)))


def _lowered_for_gpu(fn: Callable, args: tuple[jax.ShapeDtypeStruct, ...]) -> Any:
    """The StableHLO module of `fn` lowered for CUDA. jax >= 0.12 reads the GPU generation from the abstract mesh's
    device when no GPU is present (earlier versions do not ask)."""
    h100 = jax.sharding.AbstractDevice(device_kind=LOWERED_FOR, num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Auto,), abstract_device=h100)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")


def _triton_calls(module: Any) -> list[dict[str, Any]]:
    """The backend configs of every Triton custom call in the module, in program order."""
    found = []

    def walk(operation: Any) -> None:
        for region in operation.regions:
            for block in region.blocks:
                for op in block.operations:
                    attrs = op.operation.attributes
                    if (op.operation.name == "stablehlo.custom_call"
                            and attrs["call_target_name"].value == TRITON_CALL):
                        config = attrs["mhlo.backend_config"]
                        found.append({"name": config["name"].value, "ir": config["ir"].value_bytes,
                                      "num_warps": config["num_warps"].value,
                                      "num_stages": config["num_stages"].value,
                                      "grid": tuple(config[f"grid_{a}"].value for a in "xyz")})
                    walk(op.operation)

    walk(module.operation)
    return found


def _role(name: str, training: bool) -> str:
    if "backward" in name:
        return "backward"
    if "forward" in name:
        return "forward_train" if training else "forward"
    return name


def lower_kernels(case: Case) -> list[Kernel]:
    """The case's kernels for the GPU: the inference forward, then those of the gradient (forward with residuals,
    backward), each distinct IR once."""
    fn, args = _attention(case)
    grad = _gradient(fn, len(args))
    kernels, seen = [], set()
    for training, f in ((False, fn), (True, grad)):
        for call in _triton_calls(_lowered_for_gpu(f, args)):
            if call["ir"] in seen:
                continue
            seen.add(call["ir"])
            kernels.append(Kernel(case, _role(call["name"], training), call["name"], call["num_warps"],
                                  call["num_stages"], call["grid"], call["ir"]))
    return kernels


@contextlib.contextmanager
def _recorded_launches() -> Iterator[list[dict[str, Any]]]:
    """While open, `_triton_launch.launch` (and that name in every module that imported it) is a recorder: each call
    appends {kernel, params (the avals of array arguments and outputs, and the Python scalars), grid, num_warps,
    num_stages, name, constexprs} to the list yielded, and returns zeros of the output shapes."""
    from jaxpe.kernels import _triton_launch

    original = _triton_launch.launch
    launches: list[dict[str, Any]] = []

    def record(kernel: Any, args: Sequence[Any], *, out_shapes: Sequence[jax.ShapeDtypeStruct], grid: tuple[int, ...],
               num_warps: int, num_stages: int, zeroed: Sequence[int] = (), name: str = "",
               **constexprs: Any) -> list[jax.Array]:
        del zeroed  # how the outputs start does not change the compiled kernel
        outputs = [jax.core.ShapedArray(s.shape, s.dtype) for s in out_shapes]
        launches.append({"kernel": kernel, "params": [getattr(a, "aval", a) for a in args] + outputs,
                         "grid": tuple(grid) + (1,) * (3 - len(grid)), "num_warps": num_warps,
                         "num_stages": num_stages, "name": name or kernel.__name__, "constexprs": constexprs})
        return [jnp.zeros(s.shape, s.dtype) for s in out_shapes]

    importers = [m for name, m in list(sys.modules.items())
                 if name.startswith("jaxpe.") and getattr(m, "launch", None) is original]
    for module in importers:
        module.launch = record
    try:
        yield launches
    finally:
        for module in importers:
            module.launch = original


def _triton_type_namer() -> Callable[[Any], str]:
    """The installed jax-triton's function naming a launch parameter's Triton type ("*bf16", "i32", "fp32"):
    `get_triton_type` in 0.3.x, `get_type_id` in 0.4.x."""
    from jaxpe.kernels import _triton_launch  # jax-triton as the kernels import it (Triton 3.6's driver name)

    triton_lib = _triton_launch._import_jax_triton().triton_lib
    return getattr(triton_lib, "get_triton_type", None) or triton_lib.get_type_id


def _triton_spec(kernel: Any, params: Sequence[Any], constexprs: dict[str, Any]) -> str:
    """What Triton compiles for one launch, as jax-triton builds it (0.3's `get_or_create_triton_kernel`, 0.4's
    `KernelSpecialization.build`): every parameter's type from jax-triton, scalars equal to 1 and the constexprs as
    constexprs, array pointers 16-byte aligned; JSON for the compile subprocess (COMPILERS["triton"])."""
    fn = getattr(kernel, "fn", kernel)  # the Python function of the @triton.jit kernel
    names = list(inspect.signature(fn).parameters)
    arrays = [i for i, p in enumerate(params) if isinstance(p, jax.core.ShapedArray)]
    type_name = _triton_type_namer()
    signature = {names[i]: type_name(p) for i, p in enumerate(params)}
    constants = {**constexprs, **{names[i]: 1 for i, p in enumerate(params) if i not in arrays and p == 1}}
    signature.update({name: "constexpr" for name in constants})
    return json.dumps({"kernel": f"{fn.__module__}:{fn.__name__}", "signature": signature, "constexprs": constants,
                       "aligned": arrays})


def record_triton_kernels(case: Case) -> list[TritonLaunch]:
    """The case's native Triton kernels as the op and its gradient launch them (traced, never run): the inference
    forward, then the gradient's forward and backward; each distinct launch once per role (the gradient's forward is
    usually the inference forward: two rows, one compile)."""
    fn, args = _attention(case, "triton")
    kernels: list[TritonLaunch] = []
    jax.clear_caches()  # the kernel modules' jitted entries would reuse earlier traces and launch nothing
    try:
        for training, f in ((False, fn), (True, _gradient(fn, len(args)))):
            with _recorded_launches() as launches:
                jax.jit(f).trace(*args)
            for launch in launches:
                kernel = TritonLaunch(case, _role(launch["name"], training), launch["name"], launch["num_warps"],
                                      launch["num_stages"], launch["grid"],
                                      _triton_spec(launch["kernel"], launch["params"], launch["constexprs"]))
                if kernel not in kernels:
                    kernels.append(kernel)
    finally:
        jax.clear_caches()  # nor may later traces (the kernels launched for real) reuse the recorder's
    return kernels


def case_kernels(case: Case, path: str) -> list[Kernel] | list[TritonLaunch]:
    """The case's kernels on one path (PATHS)."""
    return record_triton_kernels(case) if path == "triton" else lower_kernels(case)


# ---------------------------------------------------------------------------------------------------- compiling


def _row(kernel: Kernel | TritonLaunch, **numbers: Any) -> Row:
    c = kernel.case
    return Row(kernel.path, c.op, c.dtype, c.head_dim, c.q_heads, c.kv_heads, c.npos, c.length, c.batch, kernel.role,
               kernel.name, kernel.num_warps, kernel.num_stages, kernel.grid, **numbers)


def parse_ptxas(text: str) -> dict[str, int]:
    """Registers, spill stores/loads and stack frame (bytes per thread) from `ptxas -v` output (one kernel)."""
    numbers = {}
    if m := re.search(r"Used (\d+) registers", text):
        numbers["registers"] = int(m.group(1))
    if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text):
        numbers["stack_frame"], numbers["spill_stores"], numbers["spill_loads"] = map(int, m.groups())
    return numbers


def _tail(text: str, lines: int = 6) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


class _Processes:
    """The compile subprocesses running now, so that an interrupted report ends them instead of orphaning them."""

    def __init__(self) -> None:
        self._live: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self.stopping = False

    @contextlib.contextmanager
    def tracked(self, process: subprocess.Popen) -> Iterator[subprocess.Popen]:
        """`process` killed by `kill_all` while the block runs (killed at once, and KeyboardInterrupt, if already
        stopping)."""
        with self._lock:
            if self.stopping:
                process.kill()
                raise KeyboardInterrupt
            self._live.add(process)
        try:
            yield process
        finally:
            with self._lock:
                self._live.discard(process)

    def run(self, command: list[str], timeout: float | None, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
        """subprocess.run, tracked; raises subprocess.TimeoutExpired after killing the process."""
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        with self.tracked(process):
            try:
                stdout, stderr = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                raise
        return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)

    def kill_all(self) -> None:
        with self._lock:
            self.stopping = True
            for process in self._live:
                process.kill()


class _Once:
    """Results by key, each computed once even when threads ask at the same time (ptxas per distinct PTX: the forward
    that saves residuals often compiles to the very same PTX as the inference forward)."""

    def __init__(self) -> None:
        self._results: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def get(self, key: str, compute: Callable[[], Any]) -> Any:
        with self._lock:
            future = self._results.get(key)
            owner = future is None
            if owner:
                future = self._results[key] = concurrent.futures.Future()
        if owner:
            try:
                future.set_result(compute())
            except BaseException as e:
                future.set_exception(e)
        return future.result()

    def forget(self, key: str) -> None:
        """The next `get` of `key` computes it again."""
        with self._lock:
            self._results.pop(key, None)


def _run_ptxas(ptxas: str, ptx: bytes, *, timeout: float | None, memory_gib: float | None,
               processes: _Processes) -> dict[str, Any]:
    """ptxas -v on one kernel's PTX: its numbers and seconds, or an error."""
    with tempfile.TemporaryDirectory(prefix="jaxpe-ptxas-") as tmp:
        ptx_path = pathlib.Path(tmp, "kernel.ptx")
        ptx_path.write_bytes(ptx)
        command = [ptxas, "-v", f"--gpu-name={GPU_NAME}", str(ptx_path), "-o", str(ptx_path.with_suffix(".cubin"))]
        if memory_gib is not None:  # a cap on its address space: ptxas then fails cleanly instead of swamping the host
            command = ["sh", "-c", f'ulimit -v {int(memory_gib * 2 ** 20)} && exec "$0" "$@"', *command]
        start = time.perf_counter()
        try:
            out = processes.run(command, timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"ptxas timed out after {timeout} s"}
        seconds = round(time.perf_counter() - start, 2)
    result: dict[str, Any] = {"ptxas_seconds": seconds, **parse_ptxas(out.stdout + out.stderr)}
    if "Memory allocation failure" in out.stderr + out.stdout:
        result["error"] = f"ptxas ran out of memory: over its cap of {memory_gib} GiB (--ptxas-memory-gib)"
    elif out.returncode != 0 or "registers" not in result:
        result["error"] = f"ptxas exited {out.returncode}: {_tail(out.stderr + out.stdout)}"
    return result


COMPILERS = ("xla", "triton")  # XLA's Triton compiler (Pallas' Triton IR) and Triton's own (recorded launches)
PATH_COMPILERS = {"pallas": "xla", "triton": "triton"}


def _compile_input(kernel: Kernel | TritonLaunch) -> tuple[str, bytes]:
    """The kernel's compiler (COMPILERS) and its input: the Triton MLIR bytecode (pallas) or the launch's spec
    (triton)."""
    return PATH_COMPILERS[kernel.path], kernel.spec.encode() if isinstance(kernel, TritonLaunch) else kernel.ir


def _to_ptx(kernel: Kernel | TritonLaunch, *, timeout: float | None, processes: _Processes) -> dict[str, Any]:
    """The path's Triton compiler in a subprocess (a bad setting aborts the compiler): {ptx, smem_bytes, seconds}
    or {error}."""
    compiler, source = _compile_input(kernel)
    return triton_to_ptx(compiler, source, kernel.num_warps, kernel.num_stages, timeout=timeout, processes=processes)


class _Compiler:
    """A compile subprocess that stays up (this script with --serve): one request a line on its stdin, one result a
    line on its stdout. Starting Python with jax and Triton costs about a second, as much as compiling many a
    kernel; a crash or a timeout ends the subprocess (the request gets the error), and the next request starts
    another."""

    REQUESTS = 40  # then a fresh subprocess, so that what the compilers keep between kernels stays small

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, str(SCRIPT), "--serve"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env=dict(os.environ, JAX_PLATFORMS="cpu", TRITON_INTERPRET="0"))
        self.served = 0
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: collections.deque[str] = collections.deque(maxlen=20)
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._stderr.extend, args=(self.process.stderr,), daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def compile(self, request: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        """{smem_bytes, seconds} or {error} of one request (`_serve`'s)."""
        self.served += 1
        self._stderr.clear()  # what an error shows: this request's
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except OSError:
            return self._ended()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return self._timed_out(timeout)
            if line is None:
                return self._ended()
            if _RESULT_PREFIX in line:  # after whatever the compilers wrote to the same line, if anything
                if deadline is not None and time.monotonic() > deadline:  # a result past the timeout is none
                    return self._timed_out(timeout)
                return json.loads(line.split(_RESULT_PREFIX, 1)[1])

    def _timed_out(self, timeout: float) -> dict[str, Any]:
        self.process.kill()
        self.process.wait()  # ended, not reused
        return {"error": f"Triton compile timed out after {timeout} s"}

    def _ended(self) -> dict[str, Any]:
        status = self.process.wait()
        return {"error": f"Triton compile exited {status}: {_tail(''.join(self._stderr))}"}

    def usable(self) -> bool:
        return self.process.poll() is None and self.served < self.REQUESTS

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


class _Compilers:
    """This process's idle compile subprocesses: one per thread compiling at a time, closed when Python exits."""

    def __init__(self) -> None:
        self._idle: list[_Compiler] = []
        self._lock = threading.Lock()
        atexit.register(self.close)

    def compile(self, request: dict[str, Any], *, timeout: float | None, processes: _Processes) -> dict[str, Any]:
        """`_Compiler.compile` in an idle subprocess (or a new one), tracked by `processes` while it compiles."""
        with self._lock:
            compiler = self._idle.pop() if self._idle else None
        if compiler is None:
            compiler = _Compiler()
        try:
            with processes.tracked(compiler.process):
                result = compiler.compile(request, timeout)
        except BaseException:
            compiler.close()
            raise
        if compiler.usable():
            with self._lock:
                self._idle.append(compiler)
        else:
            compiler.close()
        return result

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for compiler in idle:
            compiler.close()


_COMPILERS = _Compilers()
# Triton -> PTX results of this process, by compiler, input and settings: the report and the cost model
# (benchmarks/kernel_cost.py) compile many of the same kernels, in CI in one process.
_PTX = _Once()


def triton_to_ptx(compiler: str, source: bytes, num_warps: int, num_stages: int, *, timeout: float | None,
                  processes: _Processes) -> dict[str, Any]:
    """`compiler` (COMPILERS) on `source` in a compile subprocess: {ptx, smem_bytes, seconds} or {error}; once per
    process for the same compiler, source and settings."""
    key = hashlib.sha256(b"\0".join([compiler.encode(), source, f"{num_warps}/{num_stages}".encode()])).hexdigest()
    result = _PTX.get(key, lambda: _compiled_to_ptx(compiler, source, num_warps, num_stages, timeout=timeout,
                                                    processes=processes))
    if "error" in result:  # a timeout or a crash may pass: the next call compiles again
        _PTX.forget(key)
    return result


def _compiled_to_ptx(compiler: str, source: bytes, num_warps: int, num_stages: int, *, timeout: float | None,
                     processes: _Processes) -> dict[str, Any]:
    """`triton_to_ptx`, uncached."""
    with tempfile.TemporaryDirectory(prefix="jaxpe-compile-") as tmp:
        source_path, ptx_path = pathlib.Path(tmp, "kernel.in"), pathlib.Path(tmp, "kernel.ptx")
        source_path.write_bytes(source)
        result = _COMPILERS.compile({"compiler": compiler, "input": str(source_path), "ptx": str(ptx_path),
                                     "num_warps": num_warps, "num_stages": num_stages},
                                    timeout=timeout, processes=processes)
        return result if "error" in result else {**result, "ptx": ptx_path.read_bytes()}


def compile_kernel(kernel: Kernel | TritonLaunch, toolchain: Toolchain, *, timeout: float | None = 1800.0,
                   max_ptx_mib: float | None = MAX_PTX_MIB, ptxas_memory_gib: float | None = PTXAS_MEMORY_GIB,
                   ptx_dir: pathlib.Path | None = None, processes: _Processes | None = None,
                   ptxas_results: _Once | None = None) -> Row:
    """Triton -> PTX in a subprocess (`triton_to_ptx`: once per process for the same kernel), then ptxas -v;
    failures become row.error. `ptxas_results` shares the work of identical PTX between calls.

    ptxas is not run on PTX over max_ptx_mib and is stopped at ptxas_memory_gib (None: no limit; see MAX_PTX_MIB).
    """
    processes = processes or _Processes()
    compiled = _to_ptx(kernel, timeout=timeout, processes=processes)
    if "error" in compiled:
        return _row(kernel, error=compiled["error"])
    ptx = compiled["ptx"]
    if ptx_dir is not None:
        ptx_dir.mkdir(parents=True, exist_ok=True)
        (ptx_dir / f"{kernel.path}-{kernel.case.id}-{kernel.role}.ptx").write_bytes(ptx)
    from_triton = dict(smem_bytes=compiled["smem_bytes"], ptx_bytes=len(ptx),
                       triton_seconds=round(compiled["seconds"], 2))
    if max_ptx_mib is not None and len(ptx) > max_ptx_mib * 2 ** 20:
        return _row(kernel, **from_triton,
                    error=f"ptxas not run: {len(ptx) / 2 ** 20:.1f} MiB of PTX > {max_ptx_mib} MiB (--max-ptx-mib)")
    from_ptxas = (ptxas_results or _Once()).get(
        hashlib.sha256(ptx).hexdigest(),
        lambda: _run_ptxas(toolchain.ptxas, ptx, timeout=timeout, memory_gib=ptxas_memory_gib, processes=processes))
    return _row(kernel, **from_triton, **from_ptxas)


def _compile_xla(ir_path: str, ptx_path: str, num_warps: int, num_stages: int) -> dict[str, Any]:
    """Subprocess side: XLA's Triton compiler (registered by the CUDA plugin when jax starts its backends) on Triton
    MLIR bytecode; the PTX written to ptx_path."""
    jax.config.update("jax_platforms", "cpu")
    jax.devices()  # loads the plugin, which registers its Triton compiler
    from jax._src.lib import triton  # the only way in: jax has no public API for XLA's Triton compiler

    if not triton.has_compilation_handler("cuda"):
        raise RuntimeError("jax's CUDA plugin did not register a Triton compiler (is it the version of jaxlib?)")
    start = time.perf_counter()
    result = triton.compile("cuda", pathlib.Path(ir_path).read_bytes(), TRITON_ARCH, num_warps=num_warps,
                            num_ctas=1, num_stages=num_stages)
    seconds = time.perf_counter() - start
    pathlib.Path(ptx_path).write_text(result.asm, encoding="utf-8")
    return {"smem_bytes": int(result.smem_bytes), "seconds": seconds}


def compile_triton_spec(spec: Mapping[str, Any], *, num_warps: int, num_stages: int, cache_dir: str | os.PathLike):
    """Triton's own compiler, with jax-triton's options, on one recorded launch (`_triton_spec`, read back): the
    CompiledKernel (its .asm holds the TTGIR and PTX). cache_dir should be empty, so that it compiles, not looks up."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    triton.knobs.cache.dir = str(cache_dir)
    module, _, name = spec["kernel"].partition(":")
    source = ASTSource(fn=getattr(importlib.import_module(module), name), signature=spec["signature"],
                       constexprs=spec["constexprs"], attrs={(i,): [["tt.divisibility", 16]] for i in spec["aligned"]})
    return triton.compile(source, target=GPUTarget(*TRITON_TARGET), options={
        "num_warps": num_warps, "num_stages": num_stages, "num_ctas": 1, "enable_fp_fusion": True})


def _compile_triton(spec_path: str, ptx_path: str, num_warps: int, num_stages: int) -> dict[str, Any]:
    """Subprocess side: `compile_triton_spec` on a spec file, its PTX written to ptx_path."""
    spec = json.loads(pathlib.Path(spec_path).read_text(encoding="utf-8"))
    start = time.perf_counter()
    compiled = compile_triton_spec(spec, num_warps=num_warps, num_stages=num_stages,
                                   cache_dir=pathlib.Path(ptx_path).parent / "triton-cache")
    seconds = time.perf_counter() - start
    pathlib.Path(ptx_path).write_text(compiled.asm["ptx"], encoding="utf-8")
    return {"smem_bytes": int(compiled.metadata.shared), "seconds": seconds}


def _serve() -> None:
    """Subprocess side of `_Compiler`: for each request line on stdin, its compiler's result (or the error it
    raised) as one line on stdout; ends at the end of stdin."""
    compile_with = {"xla": _compile_xla, "triton": _compile_triton}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result = compile_with[request["compiler"]](request["input"], request["ptx"], request["num_warps"],
                                                       request["num_stages"])
        except Exception as e:  # noqa: BLE001  a kernel the compiler refuses is a result, not the end of the server
            result = {"error": f"Triton compile failed: {type(e).__name__}: {_tail(str(e))}"}
        print(_RESULT_PREFIX + json.dumps(result), flush=True)


def compile_cases(cases: Iterable[Case], toolchain: Toolchain, *, paths: Sequence[str] = PATHS, jobs: int = 1,
                  timeout: float | None = 1800.0, max_ptx_mib: float | None = MAX_PTX_MIB,
                  ptxas_memory_gib: float | None = PTXAS_MEMORY_GIB, ptx_dir: pathlib.Path | None = None,
                  progress: Callable[[Row], None] | None = None) -> list[Row]:
    """Every kernel of every case on every path, `jobs` compiles at a time; rows in case order, each case's Pallas
    rows then its Triton rows.

    Cases lower (or record) one after the other here while their kernels compile in subprocesses, the likely longest
    first (native Triton, Co-RoPE, large D, float32), so that the short ones fill in at the end. Each ptxas of a
    Co-RoPE kernel can take several GB of memory (up to ptxas_memory_gib each): mind `jobs`."""
    cases = list(cases)
    longest_first = sorted(((i, path) for i in range(len(cases)) for path in paths if path in OP_PATHS[cases[i].op]),
                           key=lambda item: (
        item[1] != "triton", cases[item[0]].op != "corope", -cases[item[0]].head_dim,
        cases[item[0]].dtype != "float32"))
    rows: dict[tuple[int, int, int], Row] = {}
    processes, ptxas_results = _Processes(), _Once()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        try:
            futures = {}
            for i, path in longest_first:
                try:
                    kernels = case_kernels(cases[i], path)
                except Exception as e:  # noqa: BLE001  a kernel that does not lower is a result, not a crash
                    failed = (TritonLaunch(cases[i], "lowering", "", 0, 0, (0, 0, 0), "") if path == "triton"
                              else Kernel(cases[i], "lowering", "", 0, 0, (0, 0, 0), b""))
                    rows[i, PATHS.index(path), 0] = row = _row(
                        failed, error=f"lowering failed: {type(e).__name__}: {e}")
                    if progress is not None:
                        progress(row)
                    continue
                for j, kernel in enumerate(kernels):
                    futures[pool.submit(compile_kernel, kernel, toolchain, timeout=timeout, max_ptx_mib=max_ptx_mib,
                                        ptxas_memory_gib=ptxas_memory_gib, ptx_dir=ptx_dir, processes=processes,
                                        ptxas_results=ptxas_results)] = i, PATHS.index(path), j
            for future in concurrent.futures.as_completed(futures):
                rows[futures[future]] = row = future.result()
                if progress is not None:
                    progress(row)
        except BaseException:  # interrupted: end the compilers rather than leave them running
            processes.kill_all()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return [rows[key] for key in sorted(rows)]


# ------------------------------------------------------------------------------------------------------ reports


def kernel_module(op: str, path: str) -> str:
    """The name of the module that holds an op's kernels of one path (OP_PATHS): jaxpe.kernels.{op}_{path}."""
    return f"jaxpe.kernels.{op}_{path}"


def _jaxpe_imports(name: str, path: pathlib.Path) -> set[str]:
    """The jaxpe modules that module `name` (source at `path`) imports by name: `from a.b import c` counts a.b.c
    when that is a module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = importlib.util.resolve_name("." * node.level + (node.module or ""), name.rpartition(".")[0])
            package = module.startswith("jaxpe") and importlib.util.find_spec(module).submodule_search_locations
            for alias in node.names:
                child = f"{module}.{alias.name}"
                found.add(child if package and importlib.util.find_spec(child) else module)
    return {module for module in found if module == "jaxpe" or module.startswith("jaxpe.")}


def kernel_sources(paths: Sequence[str] = ("pallas",)) -> dict[str, pathlib.Path]:
    """The sources the compiled kernels of these paths are made of: the kernel modules and every jaxpe module they
    import, directly or through one another (for triton: _triton_launch), by module name. By default the Pallas
    kernels' (benchmarks/kernel_cost.py's fingerprint); the report's covers PATHS."""
    sources: dict[str, pathlib.Path] = {}
    todo = [kernel_module(op, path) for path in paths for op in OPS if path in OP_PATHS[op]]
    while todo:
        name = todo.pop()
        if name not in sources:
            sources[name] = pathlib.Path(importlib.util.find_spec(name).origin)
            todo.extend(_jaxpe_imports(name, sources[name]))
    return dict(sorted(sources.items()))


def kernel_sources_sha256(paths: Sequence[str] = ("pallas",)) -> str:
    """A fingerprint of the kernel sources (kernel_sources) the numbers belong to."""
    digest = hashlib.sha256()
    for name, path in kernel_sources(paths).items():
        digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def report(rows: Sequence[Row], toolchain: Toolchain, *, seconds: float | None = None,
           settings: dict[str, Any] | None = None, skipped: dict[str, str] | None = None,
           command: str = "python tools/compile_report.py") -> dict[str, Any]:
    """The JSON report: the command, target, versions, date, the fingerprint of every path's kernel sources, the
    run's settings, the paths skipped (path: why) and the rows."""
    versions = {"python": platform.python_version(), "jax": jax.__version__,
                "jaxlib": importlib.metadata.version("jaxlib"), toolchain.plugin: toolchain.plugin_version,
                "ptxas": toolchain.ptxas_version}
    if any(row.path == "triton" for row in rows):
        versions.update({name: importlib.metadata.version(name) for name in ("triton", "jax-triton")})
    return {
        "command": command,
        "target": {"gpu_name": GPU_NAME, "triton_arch": TRITON_ARCH, "triton_target": list(TRITON_TARGET),
                   "lowered_for": LOWERED_FOR, "smem_limit_bytes": SMEM_LIMIT_BYTES,
                   "spill_budget_bytes": SPILL_BUDGET_BYTES},
        "versions": versions,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "kernel_sources_sha256": kernel_sources_sha256(PATHS),
        "settings": settings or {},
        "skipped": skipped or {},
        "wall_seconds": None if seconds is None else round(seconds, 1),
        "rows": [dataclasses.asdict(row) for row in rows],
    }


def _cell(value: Any, fmt: str = "{}") -> str:
    return "—" if value is None else fmt.format(value)


def _settings_sentence(data: dict[str, Any]) -> str:
    settings, seconds = data.get("settings") or {}, data.get("wall_seconds")
    parts = []
    if seconds is not None:
        parts.append(f"The whole run took {seconds / 60:.0f} min with {settings.get('jobs', '?')} compiles at a time")
    if settings.get("max_ptx_mib"):
        parts.append(f"ptxas was not run on PTX over {settings['max_ptx_mib']:g} MiB")
    if settings.get("ptxas_memory_gib"):
        parts.append(f"nor allowed over {settings['ptxas_memory_gib']:g} GiB of memory")
    skipped = "".join(f" No {path} rows: {why}" for path, why in (data.get("skipped") or {}).items())
    return ((" " + "; ".join(parts) + ".") if parts else "") + skipped


def markdown(data: dict[str, Any]) -> str:
    """The report as a Markdown table, one row per kernel, with the budget verdict."""
    v = data["versions"]
    lines = [
        f"# Fused kernels compiled for {data['target']['gpu_name']} without a GPU",
        "",
        f"`{data['command']}`, {data['date']}: "
        + ", ".join(f"{k} {val}" for k, val in v.items())
        + f". Kernel sources sha256 {data['kernel_sources_sha256'][:12]}. B 1, default block sizes and warps. "
        "Paths: pallas, the Pallas kernels through XLA's Triton compiler; triton, the native Triton kernels through "
        "Triton's own compiler, as jax-triton compiles them. Registers and spills per thread from `ptxas -v`; shared "
        f"memory from the path's Triton compiler (limit {data['target']['smem_limit_bytes']} bytes). Budget: no "
        "spills in forward kernels, ≤ 512 bytes in the backward kernel."
        + _settings_sentence(data),
        "",
        "| path | op | dtype | D | N/K | npos | L | kernel | warps/stages | registers | spill store/load B | smem B "
        "| PTX KiB | Triton s | ptxas s | budget |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        row = Row.from_dict(r)
        problems = row.problems()
        verdict = "ok" if not problems else "; ".join(problems)
        spills = "—" if row.spill_stores is None else f"{row.spill_stores} / {row.spill_loads}"
        lines.append(
            f"| {row.path} | {row.op} | {_short_dtype(row.dtype)} | {row.head_dim} | {row.q_heads}/{row.kv_heads} "
            f"| {_cell(row.npos)} | {row.length} | {row.kernel} | {row.num_warps}/{row.num_stages} "
            f"| {_cell(row.registers)} | {spills} | {_cell(row.smem_bytes)} "
            f"| {_cell(None if row.ptx_bytes is None else row.ptx_bytes / 1024, '{:.0f}')} "
            f"| {_cell(row.triton_seconds, '{:.1f}')} | {_cell(row.ptxas_seconds, '{:.1f}')} | {verdict} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------- CLI


def _csv(kind: Callable[[str], Any]) -> Callable[[str], tuple]:
    return lambda text: tuple(kind(item.strip()) for item in text.split(",") if item.strip())


def _dtype(name: str) -> str:
    return {"f32": "float32", "bf16": "bfloat16"}.get(name, name)


def _heads(text: str) -> tuple[int, int]:
    n, _, k = text.partition("/")
    return int(n), int(k or n)


def add_grid_arguments(parser: argparse.ArgumentParser) -> None:
    """The grid's options, shared with benchmarks/kernel_cost.py: --ops, --paths, --dtypes, --head-dims, --heads,
    --npos and --quick."""
    parser.add_argument("--ops", type=_csv(str), default=OPS, help=",".join(OPS))
    parser.add_argument("--paths", type=_csv(str), default=PATHS, help="pallas,triton (the kernels' paths)")
    parser.add_argument("--dtypes", type=_csv(_dtype), default=DTYPES, help="float32,bfloat16 (or f32,bf16)")
    parser.add_argument("--head-dims", type=_csv(int), default=HEAD_DIMS, help="64,128,256")
    parser.add_argument("--heads", type=_csv(_heads), default=HEADS, help="query/kv heads: 8/2,8/8")
    parser.add_argument("--npos", type=_csv(int), default=NPOS, help="CoPE table rows: 64,513")
    parser.add_argument("--quick", action="store_true", help="D 64, heads 8/2, npos 64 only")


def grid_name(parser: argparse.ArgumentParser, args: argparse.Namespace, stem: str, *, full: bool = True) -> str:
    """Checks --ops and --paths, narrows the grid for --quick, and names the output files: --name, else `stem` for
    the whole grid (and `full`, what the caller's own options add), `stem`-quick or `stem`-subset."""
    for option, values, known in (("--ops", args.ops, OPS), ("--paths", args.paths, PATHS)):
        for value in values:
            if value not in known:
                parser.error(f"{option}: {value!r} is not one of {known}")
    full = full and (args.paths, args.ops, args.dtypes, args.head_dims, args.heads, args.npos) == (
        PATHS, OPS, DTYPES, HEAD_DIMS, HEADS, NPOS)
    if args.quick:
        args.head_dims, args.heads, args.npos = (64,), ((8, 2),), (64,)
    return args.name or (f"{stem}-quick" if args.quick else stem if full else f"{stem}-subset")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python tools/compile_report.py", description=__doc__.split("\n")[0])
    add_grid_arguments(parser)
    parser.add_argument("--length", type=int, default=LENGTH)
    parser.add_argument("--jobs", type=int, default=default_jobs(),
                        help="compiles at a time (default: a CPU and 10 GB of memory each)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per compile step")
    parser.add_argument("--max-ptx-mib", type=float, default=MAX_PTX_MIB,
                        help="skip ptxas on larger PTX, which takes GBs of memory (0: no limit)")
    parser.add_argument("--ptxas-memory-gib", type=float, default=PTXAS_MEMORY_GIB,
                        help="memory cap of each ptxas (0: none); jobs × this must fit the machine")
    parser.add_argument("--ptxas", help="path to ptxas (default: $PTXAS, the nvidia-cuda-nvcc wheel, PATH)")
    parser.add_argument("--out", type=pathlib.Path, metavar="DIR",
                        help="folder for NAME.json and NAME.md (required unless --no-write)")
    parser.add_argument("--name", help="file stem (default: sm90a for the full grid, sm90a-quick, sm90a-subset)")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--ptx-dir", type=pathlib.Path, help="also keep each kernel's PTX there")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # a compile subprocess (_Compiler)
    args = parser.parse_args(argv)
    if args.out is None and not (args.no_write or args.serve):
        parser.error("--out DIR is required (or --no-write to print the table only)")
    args.name = grid_name(parser, args, "sm90a", full=args.length == LENGTH)
    return args


def show_and_write(data: dict[str, Any], text: str, out: pathlib.Path | None, name: str) -> None:
    """Prints the report's Markdown `text`; writes out/name.json (`data`) and out/name.md unless `out` is None."""
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        (out / f"{name}.md").write_text(text, encoding="utf-8")
        print(f"wrote {out / name}.json and .md", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.serve:
        _serve()
        return 0
    try:
        toolchain = find_toolchain(args.ptxas)
    except ToolchainMissing as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    jax.config.update("jax_platforms", "cpu")  # lowering for CUDA needs no GPU; do not start CUDA here
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` ends the compilers too (KeyboardInterrupt)
    cases = default_cases(args.ops, args.dtypes, args.head_dims, args.heads, args.npos, args.length)
    skipped = {}
    if "triton" in args.paths and (why := triton_unavailable()) is not None:
        skipped["triton"] = why
        print(f"skipping the triton rows: {why}", file=sys.stderr)
    paths = tuple(path for path in args.paths if path not in skipped)
    print(f"compiling {len(cases)} configurations ({', '.join(paths)}) for {GPU_NAME} with {toolchain.plugin} "
          f"{toolchain.plugin_version}, ptxas {toolchain.ptxas_version}, {args.jobs} at a time", file=sys.stderr)
    start = time.perf_counter()

    def progress(row: Row) -> None:
        what = (f"{row.registers} registers, spills {row.spill_stores}/{row.spill_loads} B, smem {row.smem_bytes} B, "
                f"{(row.triton_seconds or 0) + (row.ptxas_seconds or 0):.1f} s") if row.error is None else row.error
        print(f"[{time.perf_counter() - start:6.0f} s] {row.path} {row.case_id} {row.kernel}: {what}",
              file=sys.stderr, flush=True)

    try:
        rows = compile_cases(cases, toolchain, paths=paths, jobs=args.jobs, timeout=args.timeout,
                             max_ptx_mib=args.max_ptx_mib or None, ptxas_memory_gib=args.ptxas_memory_gib or None,
                             ptx_dir=args.ptx_dir, progress=progress)
    except KeyboardInterrupt:
        print("interrupted: the compilers were stopped, nothing written", file=sys.stderr)
        return 130
    settings = {"jobs": args.jobs, "timeout_s": args.timeout, "max_ptx_mib": args.max_ptx_mib or None,
                "ptxas_memory_gib": args.ptxas_memory_gib or None}
    data = report(rows, toolchain, seconds=time.perf_counter() - start, settings=settings, skipped=skipped,
                  command=shlex.join(["python", "tools/compile_report.py", *argv]))
    show_and_write(data, markdown(data), None if args.no_write else args.out, args.name)
    return 1 if any(row.error for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
