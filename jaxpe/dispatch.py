"""Choosing an implementation for the contextual attentions: reference, blockwise, pallas, or auto."""
from __future__ import annotations

import jax

from jaxpe.validation import check_impl

# On CPU the dense reference wins below this length for forward passes (measured by kernels/bench.py: the
# crossover lies between 256 and 512); blockwise (O(L·block) memory) from here on.
BLOCKWISE_MIN_LENGTH = 512


def resolve_impl(impl: str, length: int) -> str:
    """Map "auto" to "pallas" on GPU, else "blockwise" from BLOCKWISE_MIN_LENGTH and "reference" below it."""
    check_impl(impl)
    if impl != "auto":
        return impl
    if jax.default_backend() == "gpu":
        return "pallas"
    return "blockwise" if length >= BLOCKWISE_MIN_LENGTH else "reference"
