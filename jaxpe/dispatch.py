"""Choosing an implementation for the contextual attentions: reference, blockwise, pallas, or auto."""
from __future__ import annotations

import functools
import warnings

import jax

from jaxpe.kernels._common import pallas_unsupported
from jaxpe.validation import check_impl

ENCODINGS = ("cope", "corope")

# On CPU, "auto" runs the dense path below these lengths and "blockwise" from them on: the shortest length from
# which blockwise's forward+backward was faster at every longer measured length (benchmarks/auto_dispatch.py, its
# output in results/bench/auto_dispatch_cpu.json; tests/test_dispatch.py holds the two together).
BLOCKWISE_MIN_LENGTH = {"cope": 512, "corope": 8}


def resolve_impl(impl: str, length: int, head_dim: int, *, encoding: str) -> str:
    """The implementation `impl` stands for, for `encoding` ("cope" or "corope") at this length and head dim.

    "auto" is "pallas" where the fused kernels compile (an NVIDIA GPU of compute capability 8.0 or more, D <= 256);
    on CPU the dense "reference" below BLOCKWISE_MIN_LENGTH[encoding] and "blockwise" from it; on any other
    accelerator (TPU, ROCm, older GPUs, larger heads) "blockwise", with one warning that says why. A symbolic length
    (`jax.export` with shape polymorphism) is "blockwise" everywhere: it runs at any length in O(L·block) memory.
    """
    check_impl(impl)
    if encoding not in ENCODINGS:
        raise ValueError(f"{encoding=} must be one of {ENCODINGS}")
    if impl != "auto":
        return impl
    if not isinstance(length, int):
        return "blockwise"
    backend = jax.default_backend()
    if backend == "cpu":
        return "blockwise" if length >= BLOCKWISE_MIN_LENGTH[encoding] else "reference"
    reason = pallas_unsupported(head_dim, backend=backend,
                                compute_capability=getattr(jax.devices()[0], "compute_capability", None))
    if reason is None:
        return "pallas"
    _warn_once(f"jaxpe: impl='auto' runs the 'blockwise' path instead of the fused 'pallas' kernels: {reason}")
    return "blockwise"


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)
