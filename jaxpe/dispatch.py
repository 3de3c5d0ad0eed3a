"""Choosing an implementation for the contextual attentions: reference, blockwise, pallas, or auto."""
from __future__ import annotations

import functools
import warnings
from typing import Callable

import jax

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


def resolve_impl(impl: str, length: int, head_dim: int, *, encoding: str, batch_heads: int, causal: bool = True,
                 dense: bool = False, kernel_refusal: Callable[[], str | None] | None = None) -> str:
    """The implementation `impl` stands for, for `encoding` ("cope" or "corope") at this length, head dim and
    batch × query heads.

    "auto" is "pallas" where the fused kernels compile (an NVIDIA GPU of compute capability 8.0 or more, D <= 256);
    on CPU the dense "reference" below BLOCKWISE_MIN_LENGTH[encoding] while batch_heads·L² <= DENSE_MAX_ENTRIES,
    "blockwise" otherwise; on any other
    accelerator (TPU, ROCm, older GPUs, larger heads) "blockwise", with one warning that says why. A symbolic length
    or batch (`jax.export` with shape polymorphism) is "blockwise" everywhere: it runs at any length in O(L·block)
    memory. This is the one place that chooses; the entry points have refused what an explicit impl cannot run.

    causal=False: "auto" never picks "pallas" (the fused kernels are causal). dense: the call needs the dense path
    (keys from a decoding cache under a mask, extra logits, CoPE's dense-only variants): "reference" whatever `impl`.
    kernel_refusal: where "auto" would pick "pallas", a function giving the reason the fused kernel refuses these
    inputs (None: it runs them); "auto" then runs "blockwise".
    """
    check_impl(impl)
    if encoding not in ENCODINGS:
        raise ValueError(f"{encoding=} must be one of {ENCODINGS}")
    if dense:
        return "reference"
    if impl != "auto":
        return impl
    if not isinstance(length, int) or not isinstance(batch_heads, int):
        return "blockwise"
    backend = jax.default_backend()
    if backend == "cpu":
        small = length < BLOCKWISE_MIN_LENGTH[encoding] and batch_heads * length**2 <= DENSE_MAX_ENTRIES
        return "reference" if small else "blockwise"
    reason = pallas_unsupported(head_dim, backend=backend,
                                compute_capability=getattr(jax.devices()[0], "compute_capability", None))
    if reason is not None:
        _warn_once(f"jaxpe: impl='auto' runs the 'blockwise' path instead of the fused 'pallas' kernels: {reason}")
        return "blockwise"
    if not causal or (kernel_refusal is not None and kernel_refusal() is not None):
        return "blockwise"
    return "pallas"


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)
