"""Choosing an implementation for the contextual attentions: reference, blockwise, pallas, or auto."""
from __future__ import annotations

import functools
import warnings

import jax

from jaxpe.kernels._common import pallas_unsupported
from jaxpe.validation import check_impl

# On CPU the dense reference wins below this length for forward passes (measured by benchmarks/attention.py: the
# crossover lies between 256 and 512); blockwise (O(L·block) memory) from here on.
BLOCKWISE_MIN_LENGTH = 512


def resolve_impl(impl: str, length: int, head_dim: int) -> str:
    """The implementation `impl` stands for at this length and head dim.

    "auto" is "pallas" where the fused kernels compile (an NVIDIA GPU of compute capability 8.0 or more, D <= 256);
    on CPU the dense "reference" below BLOCKWISE_MIN_LENGTH and "blockwise" from it; on any other accelerator (TPU,
    ROCm, older GPUs, larger heads) "blockwise", with one warning that says why.
    """
    check_impl(impl)
    if impl != "auto":
        return impl
    backend = jax.default_backend()
    if backend == "cpu":
        return "blockwise" if length >= BLOCKWISE_MIN_LENGTH else "reference"
    reason = pallas_unsupported(head_dim, backend=backend,
                                compute_capability=getattr(jax.devices()[0], "compute_capability", None))
    if reason is None:
        return "pallas"
    _warn_once(f"jaxpe: impl='auto' runs the 'blockwise' path instead of the fused 'pallas' kernels: {reason}")
    return "blockwise"


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)
