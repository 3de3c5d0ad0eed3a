"""The fused paths' own checks: the dtypes they take, their tuning arguments, and one refusal and one opening for
every fused entry. The input checks every layer shares are in jaxpe/base.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpe.base import bidirectional_refusal, check_corope_inputs, open_attention
from jaxpe.kernels._common import check_head_dim
from jaxpe.kernels.corope_blockwise import check_inv_freq

# What every fused kernel (Pallas and native Triton) takes, as cuDNN's attention does: float32 and 16-bit inputs, which
# they compute in float32. float64 (x64 mode) runs on the XLA paths, which compute in float64 for it.
FUSED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_pallas_settings(block_sizes: object, kind: type, *, num_warps: int | None, num_stages: int | None
                          ) -> None:
    """The tuning arguments of a fused kernel: block_sizes None or a `kind` (that kernel's BlockSizes), num_warps and
    num_stages None or positive ints."""
    if block_sizes is not None and not isinstance(block_sizes, kind):
        raise TypeError(f"block_sizes must be a {kind.__name__} or None, got {type(block_sizes).__name__}")
    for name, value in (("num_warps", num_warps), ("num_stages", num_stages)):
        if value is not None and not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name}={value!r} must be a positive int or None")


def fused_refusal(q: jax.Array, *, impl: str, causal: bool = True) -> Exception | None:
    """The error the fused path `impl` ("pallas" or "triton") of any operation raises for these inputs, None when it
    takes them: the fused kernels are causal, take FUSED_DTYPES and static shapes, not jax.export's symbolic ones.
    impl='reference' takes them all (impl='auto' picks a path that does)."""
    if not causal:
        return bidirectional_refusal(impl)
    if q.dtype not in FUSED_DTYPES:
        names = [jnp.dtype(dtype).name for dtype in FUSED_DTYPES]
        return TypeError(f"q.dtype={q.dtype} is not supported by impl={impl!r}, which takes {', '.join(names[:-1])} "
                         f"or {names[-1]}: impl='blockwise' and impl='reference' take any floating dtype, float64 "
                         f"included, and impl='auto' runs one of them for these inputs")
    if not all(isinstance(size, int) for size in q.shape):
        return ValueError(f"q.shape={tuple(q.shape)} is symbolic (jax.export), and impl={impl!r} needs static "
                          f"shapes: impl='auto' and impl='reference' export with a symbolic batch and length")
    return None


def check_fused(q: jax.Array, refusal: Exception | None, *, block_sizes: object, blocks_type: type,
                num_warps: int | None, num_stages: int | None) -> None:
    """The checks every fused entry shares: raises `refusal` (the path's `fused_refusal` of these inputs, or None),
    then checks the head dim and the tuning arguments (`check_pallas_settings`)."""
    if refusal is not None:
        raise refusal
    check_head_dim(q.shape[3])
    check_pallas_settings(block_sizes, blocks_type, num_warps=num_warps, num_stages=num_stages)


def open_fused(q: jax.Array, refusal: Exception | None, *, block_sizes: object, blocks_type: type,
               num_warps: int | None, num_stages: int | None, causal: bool = True,
               segment_ids: jax.Array | None, window: int | None) -> tuple[bool, jax.Array | None, int | None]:
    """`check_fused`, then `open_attention`'s (empty, segment_ids, window): the opening of an entry that checks its
    own inputs (CoPE's and Co-RoPE's, which users call directly)."""
    check_fused(q, refusal, block_sizes=block_sizes, blocks_type=blocks_type, num_warps=num_warps,
                num_stages=num_stages)
    return open_attention(q, causal=causal, segment_ids=segment_ids, window=window)


def open_corope_fused(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str, theta: float,
                      sm_scale: float | jax.Array | None, inv_freq: jax.Array | None, causal: bool,
                      segment_ids: jax.Array | None, window: int | None, block_sizes: object, kind: type,
                      num_warps: int | None, num_stages: int | None) -> tuple[bool, jax.Array | None, int | None]:
    """The opening of Co-RoPE's fused entries (impl "pallas" or "triton", block_sizes None or a `kind`): q [B, L, Hq,
    D], k/v [B, L, Hkv, D] and inv_freq [D/2] checked, then `open_fused`'s (empty, segment_ids, window)."""
    check_corope_inputs(q, k, v, theta=theta, sm_scale=sm_scale)
    check_inv_freq(inv_freq, q.shape[3])
    return open_fused(q, fused_refusal(q, impl=impl, causal=causal), block_sizes=block_sizes, blocks_type=kind,
                      num_warps=num_warps, num_stages=num_stages, causal=causal, segment_ids=segment_ids,
                      window=window)
