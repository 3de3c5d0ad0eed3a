"""Scattered global-memory access for the native Triton kernels (`cope_triton.py`, `corope_triton.py`) that keeps
the layout its operands already have.

Triton's coalescing pass gives a tl.load or tl.atomic_add of scattered addresses a blocked layout of its own, so the
pointers and values cross shared memory to it (and a masked atomic becomes a branch around each instruction). When
compiled for a GPU (FAST), these issue one PTX instruction per element in place instead; in Triton's interpreter
(not FAST), the plain tl.load and tl.atomic_add.
"""
import triton
import triton.language as tl


@triton.jit
def gather(ptrs, FAST: tl.constexpr):
    """Float32 values at ptrs (a tensor of pointers), every one a valid address. FAST (compiled for a GPU): one
    `ld.global.nc` per element in the layout ptrs has, where a tl.load of scattered addresses would get a layout of
    its own from Triton's coalescing pass, the pointers and the values crossing shared memory to it and back."""
    if FAST:
        values = tl.inline_asm_elementwise("ld.global.nc.f32 $0, [$1];", "=r,l", [ptrs], dtype=tl.float32,
                                           is_pure=True, pack=1)
    else:
        values = tl.load(ptrs)
    return values


@triton.jit
def scatter_add(ptrs, values, mask, FAST: tl.constexpr):
    """Relaxed atomic adds of float32 values at ptrs (pointers of their shape) where mask. FAST (compiled for a
    GPU): one predicated `red.global.add.f32` per element in the layout the values have (as `gather`, no trip
    through shared memory)."""
    if FAST:
        addresses = ptrs.to(tl.int64, bitcast=True)  # Triton 3.6 cannot broadcast pointers with floats here
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $3, 0; @p red.global.add.f32 [$1], $2; "
                                  "mov.b32 $0, 0; }", "=r,l,f,r", [addresses, values, mask.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.atomic_add(ptrs, values, mask=mask, sem="relaxed")
