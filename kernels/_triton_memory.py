"""Scattered global-memory access for the native Triton kernels (`cope_triton.py`, `corope_triton.py`) that keeps
the layout its operands already have.

Triton's coalescing pass gives a tl.load or tl.atomic_add of scattered addresses a blocked layout of its own, so the
pointers and values cross shared memory to it (and a masked atomic becomes a branch around each instruction). When
compiled for a GPU (FAST), these issue one PTX instruction per element in place instead; in Triton's interpreter
(not FAST), the plain tl.load and tl.atomic_add.

An element of a layout may be held by several threads: a tile with fewer rows or columns than its layout covers
repeats in the warps beyond them. A load repeated is harmless; an add repeated counts twice, and Triton's own atomics
mask the copies where inline PTX cannot. So an add is issued in place only where every element has one owner
(`scatter_in_place`).
"""
import triton
import triton.language as tl

from jaxpe.kernels._triton_launch import interpreted


@triton.jit
def gather_pair(ptrs, FAST: tl.constexpr):
    """Float32 values at ptrs and at ptrs + 1 (tensors of pointers, both addresses valid). FAST (compiled for a
    GPU): two `ld.global.nc` per element in the layout ptrs has, where a tl.load of scattered addresses would get a
    layout of its own from Triton's coalescing pass (the pointers and the values crossing shared memory to it and
    back), both from one address register (the second at +4 bytes); else two tl.load."""
    if FAST:
        first, second = tl.inline_asm_elementwise("ld.global.nc.f32 $0, [$2]; ld.global.nc.f32 $1, [$2+4];",
                                                  "=r,=r,l", [ptrs], dtype=(tl.float32, tl.float32), is_pure=True,
                                                  pack=1)
    else:
        first, second = tl.load(ptrs), tl.load(ptrs + 1)
    return first, second


def scatter_in_place(rows: int, num_warps: int) -> bool:
    """Whether `scatter_add` may add in place values [rows, C] (C >= 8) in the layout of a tensor-core product's
    result, compiled for a GPU: true where rows >= 16 · num_warps. Triton gives such a layout 16 rows per warp along
    the rows and the rest of the warps along the columns (mma v2: 8 columns each), and a product whose result feeds
    another product all its warps along the rows; with rows for every warp, both choices (and Hopper's warpgroup
    products, whose instruction spans the columns) hold each element once. Fewer rows: a 32-row tile at 4 warps
    stacked along the rows repeats in two warps, and an add in place counted it twice."""
    return not interpreted() and rows >= 16 * num_warps


@triton.jit
def scatter_add(ptrs, values, mask, IN_PLACE: tl.constexpr):
    """Relaxed atomic adds of float32 values at ptrs (pointers of their shape) where mask. IN_PLACE
    (`scatter_in_place`: compiled for a GPU, each element held by one thread): one predicated `red.global.add.f32` per
    element in the layout the values have (as `gather_pair`, no trip through shared memory); else tl.atomic_add, which
    masks repeated copies itself."""
    if IN_PLACE:
        addresses = ptrs.to(tl.int64, bitcast=True)  # Triton 3.6 cannot broadcast pointers with floats here
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $3, 0; @p red.global.add.f32 [$1], $2; "
                                  "mov.b32 $0, 0; }", "=r,l,f,r", [addresses, values, mask.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.atomic_add(ptrs, values, mask=mask, sem="relaxed")
