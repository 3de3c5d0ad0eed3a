"""What the native Triton kernels with one program per (query block, batch, query head) share (`cope_triton.py`,
`stickbreaking_triton.py`): rows of [B, L, H, D] arrays loaded, stored and atomically added with explicit pointers
and only the masks that can fail (no input is padded: D is tiled at Dp, the next power of two, and rows past L are
masked), a tile's visibility, the first key block a query block sees, and the strides the launches pass.

Letters: B batch, L length, H heads, D head dim (Dp its tile). Tiles are [block_q, block_k].
"""
from __future__ import annotations

import math

import jax
import triton
import triton.language as tl


@triton.jit
def visible(rows, cols, seg_rows, seg_ptr, length, WINDOW: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
             MASK_DEAD: tl.constexpr, live):
    """[block_q, block_k] bool: key `cols` visible from row `rows` (causal, inside the window, the same document),
    with MASK_DEAD from `live` rows (< L) only. seg_ptr points at the batch row's document ids [L]."""
    mask = cols[None, :] <= rows[:, None]
    if MASK_DEAD:
        mask = mask & live[:, None]
    if WINDOW > 0:
        mask = mask & (rows[:, None] - cols[None, :] < WINDOW)
    if HAS_SEGMENTS:
        seg_cols = tl.load(seg_ptr + cols, mask=cols < length, other=-1)
        mask = mask & (seg_rows[:, None] == seg_cols[None, :])
    return mask


@triton.jit
def aligned(index, stride, ALIGN: tl.constexpr):
    """index·stride (element offsets, a scalar or [n]) marked as a multiple of ALIGN, so that loads along D
    vectorise: jax-triton gives integer arguments no divisibility, and every q/k/v stride is a multiple of D. (The
    mark goes on the product computed here: on a function's argument it would be lost.)"""
    offset = index * stride
    if ALIGN > 1:
        offset = tl.multiple_of(offset, ALIGN)
    return offset


@triton.jit
def program_rows(length, stride_qb, stride_qh, stride_kb, stride_kh, GROUPS: tl.constexpr, BLOCK_Q: tl.constexpr,
                 BLOCK_D: tl.constexpr, ALIGN: tl.constexpr):
    """What a program over (query block, batch, query head) of the grid (L / BLOCK_Q, B, Hq) starts from: b, h, its
    first row row0, rows [BLOCK_Q], dims [BLOCK_D], live (rows < L), and the element offsets of its query head's
    [L, D] rows in [B, L, Hq, D] arrays (q_head) and of its kv head's (h // GROUPS) in [B, L, Hkv, D] ones (kv_head)."""
    block, b, h = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    row0 = block * BLOCK_Q
    rows = row0 + tl.arange(0, BLOCK_Q)
    q_head = aligned(b, stride_qb, ALIGN) + aligned(h, stride_qh, ALIGN)
    kv_head = aligned(b, stride_kb, ALIGN) + aligned(h // GROUPS, stride_kh, ALIGN)
    return b, h, row0, rows, tl.arange(0, BLOCK_D), rows < length, q_head, kv_head


@triton.jit
def document_rows(SEG, b, stride_segb, rows, live, HAS_SEGMENTS: tl.constexpr):
    """(seg_ptr, seg_rows): the batch row's document ids [L] in SEG [B, L] and the rows' own (the rows themselves,
    unread, without documents)."""
    seg_ptr = SEG + b * stride_segb
    seg_rows = rows
    if HAS_SEGMENTS:
        seg_rows = tl.load(seg_ptr + rows, mask=live, other=-1)
    return seg_ptr, seg_rows


@triton.jit
def in_bounds(rows, dims, length, EVEN_L: tl.constexpr, MASK_D: tl.constexpr):
    """The mask of [rows, dims] inside [L, D], with only the checks that can fail (EVEN_L: every row < L; MASK_D
    0: every column < D, else D), for the load or store to broadcast."""
    if EVEN_L:
        mask = (dims < MASK_D)[None, :]
    elif MASK_D == 0:
        mask = (rows < length)[:, None]
    else:
        mask = (rows < length)[:, None] & (dims < MASK_D)[None, :]
    return mask


@triton.jit
def load_rows(ptr, rows, dims, length, stride_l, ALIGN: tl.constexpr, EVEN_L: tl.constexpr,
               MASK_D: tl.constexpr):
    """[rows, dims] of a [L, ·, D] array whose head is at `ptr` (0 past L and past D)."""
    ptrs = ptr + aligned(rows, stride_l, ALIGN)[:, None] + dims[None, :]
    if EVEN_L and MASK_D == 0:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=in_bounds(rows, dims, length, EVEN_L, MASK_D), other=0.0)
    return tile


@triton.jit
def store_rows(ptr, rows, dims, value, length, stride_l, ALIGN: tl.constexpr, EVEN_L: tl.constexpr,
                MASK_D: tl.constexpr):
    """Store value [rows, Dp] into a [L, ·, D] array whose head is at `ptr` (rows < L, columns < D)."""
    ptrs = ptr + aligned(rows, stride_l, ALIGN)[:, None] + dims[None, :]
    if EVEN_L and MASK_D == 0:
        tl.store(ptrs, value)
    else:
        tl.store(ptrs, value, mask=in_bounds(rows, dims, length, EVEN_L, MASK_D))


@triton.jit
def add_rows(ptr, rows, dims, value, length, stride_l, ALIGN: tl.constexpr, EVEN_L: tl.constexpr,
              MASK_D: tl.constexpr):
    """Atomically add value [rows, Dp] (float32) into a [L, ·, D] float32 array whose head is at `ptr`."""
    ptrs = ptr + aligned(rows, stride_l, ALIGN)[:, None] + dims[None, :]
    if EVEN_L and MASK_D == 0:
        tl.atomic_add(ptrs, value, sem="relaxed")
    else:
        tl.atomic_add(ptrs, value, mask=in_bounds(rows, dims, length, EVEN_L, MASK_D), sem="relaxed")


@triton.jit
def first_key_block(row0, WINDOW: tl.constexpr, BLOCK_K: tl.constexpr):
    """The first key block that row `row0` (or any later row) can see: 0 without a window."""
    first = 0
    if WINDOW > 0:
        first = tl.maximum(row0 - (WINDOW - 1), 0) // BLOCK_K
    return first


def strides(x: jax.Array) -> tuple[int, ...]:
    """Row-major element strides of `x` (what jax-triton and the interpreter pass: contiguous buffers)."""
    return tuple(math.prod(x.shape[i + 1:]) for i in range(x.ndim))
