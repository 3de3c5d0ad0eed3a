"""What the fused kernels share: the limits of the Pallas Triton path and whether this machine can run it."""
from __future__ import annotations

import importlib.util

MAX_HEAD_DIM = 256  # the largest head dim D the fused kernels take (tiles pad D to a power of two)
MIN_COMPUTE_CAPABILITY = 8.0  # Ampere: Triton's bfloat16 tensor-core dots


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
