"""The native Triton backward kernels add in place (inline `red.global.add`) only values each thread owns alone.

An inline PTX add runs once per thread that holds an element, and a tile smaller than its layout's span repeats
elements across warps: an H100 run found CoPE's ∂L/∂z counted twice at 32-row query blocks on 4 warps (and dq,
dpos_emb wrong with it), which Triton's interpreter cannot show. Here each backward launch is recorded as the op's
gradient makes it, compiled by Triton for sm_90 on CPU, and every tensor an inline add reads is held to its
layout: no dimension of the layout spans more than the tensor. The configurations are those that repeated (query
blocks of 16 and 32 rows at 4 warps, float32 and float16, 8 warps) beside the defaults. Needs triton and jax-triton
(`make test-compile`); elsewhere it skips, saying why.
"""
from __future__ import annotations

import json
import math
import re

import jax
import jax.numpy as jnp
import pytest

from test_compile_report import cr, needs_triton


def layout_span(layout: str) -> tuple[int, ...]:
    """Elements a distributed layout spans per dimension before it repeats: an mma accumulator layout (v2: 16×8 per
    warp; v3: 16×n, n its instruction's columns) times its warps, a blocked layout's sizePerThread × threadsPerWarp ×
    warpsPerCTA. Raises ValueError for any other layout (a slice, a linear layout), which the checks do not read."""
    fields = {name: [int(x) for x in values.split(",")]
              for name, values in re.findall(r"(\w+) = \[([\d, ]+)\]", layout)}
    if layout.startswith("#ttg.nvidia_mma"):
        version = int(re.search(r"versionMajor = (\d+)", layout).group(1))
        per_warp = (16, 8) if version == 2 else tuple(fields["instrShape"][:2])
        return tuple(p * w for p, w in zip(per_warp, fields["warpsPerCTA"]))
    if layout.startswith("#ttg.blocked"):
        return tuple(math.prod(x) for x in zip(fields["sizePerThread"], fields["threadsPerWarp"],
                                               fields["warpsPerCTA"]))
    raise ValueError(f"layout {layout!r} is neither an mma nor a blocked layout")


def repeated(shape: tuple[int, ...], layout: str) -> bool:
    """Whether a tensor of this shape holds some element in more than one thread of the layout."""
    return any(size < span for size, span in zip(shape, layout_span(layout)))


def in_place_adds(ttgir: str) -> list[tuple[tuple[int, ...], str]]:
    """(shape, layout) of every tensor that an inline `red.global` reads in a kernel's TTGIR."""
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.[^\n]+)$", ttgir, re.M))
    found = []
    for line in ttgir.splitlines():
        if "red.global" in line:
            for dims, name in re.findall(r"tensor<([\dx]+)x\w+, (#\w+)>", line):
                found.append((tuple(int(d) for d in dims.split("x")), layouts[name]))
    return found


def backward_ttgir(op: str, dtype: str, head_dim: int, length: int, heads: tuple[int, int], *,
                   blocks: dict | None = None, num_warps: int | None = None, tmp_path) -> tuple[dict, str]:
    """(the constexprs, Triton's TTGIR for sm_90) of the backward launch of op's gradient at these settings."""
    q = jax.ShapeDtypeStruct((1, length, heads[0], head_dim), dtype)
    k = jax.ShapeDtypeStruct((1, length, heads[1], head_dim), dtype)
    if op == "cope":
        from jaxpe.kernels.cope_pallas import BlockSizes
        from jaxpe.kernels.cope_triton import cope_attention_triton

        table = jax.ShapeDtypeStruct((16, head_dim), dtype)

        def loss(q, k, v, table):
            return cope_attention_triton(q, k, v, table, sm_scale=0.125, block_sizes=BlockSizes(**(blocks or {})),
                                         num_warps=num_warps).astype(jnp.float32).sum()
        args = (q, k, k, table)
    else:
        from jaxpe.kernels.corope_triton import BlockSizes, corope_attention_triton

        def loss(q, k, v):
            return corope_attention_triton(q, k, v, sm_scale=0.125, block_sizes=BlockSizes(**(blocks or {})),
                                           num_warps=num_warps).astype(jnp.float32).sum()
        args = (q, k, k)
    jax.clear_caches()
    try:
        with cr._recorded_launches() as launches:
            jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))).trace(*args)
    finally:
        jax.clear_caches()
    (launch,) = [launch for launch in launches if "backward" in launch["name"]]
    spec = json.loads(cr._triton_spec(launch["kernel"], launch["params"], launch["constexprs"]))
    compiled = cr.compile_triton_spec(spec, num_warps=launch["num_warps"], num_stages=launch["num_stages"],
                                      cache_dir=tmp_path)
    return spec["constexprs"] | {"num_warps": launch["num_warps"]}, compiled.asm["ttgir"]


MMA_V2 = "#ttg.nvidia_mma<{{versionMajor = 2, versionMinor = 0, warpsPerCTA = [{}, {}], instrShape = [16, 8]}}>"


@pytest.mark.parametrize("shape, warps, want", [
    ((32, 32), (4, 1), True),  # rows span 64: warps 2, 3 repeat warps 0, 1 (the H100's twice-counted ∂L/∂z)
    ((32, 32), (1, 4), False),  # columns span 32
    ((32, 16), (1, 4), True),  # columns span 32 over 16
    ((16, 16), (1, 4), True),
    ((64, 32), (4, 1), False),
    ((64, 16), (4, 1), False),
])
def test_repeated_reads_mma_layouts(shape, warps, want):
    assert repeated(shape, MMA_V2.format(*warps)) is want


def test_repeated_reads_warpgroup_and_blocked_layouts():
    wgmma = "#ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 1], instrShape = [16, 32, 16]}>"
    assert layout_span(wgmma) == (64, 32)
    assert repeated((64, 32), wgmma) is False and repeated((64, 16), wgmma) is True
    blocked = ("#ttg.blocked<{sizePerThread = [1, 4], threadsPerWarp = [4, 8], warpsPerCTA = [4, 1], "
               "order = [1, 0]}>")
    assert layout_span(blocked) == (16, 32)
    assert repeated((16, 32), blocked) is False and repeated((8, 32), blocked) is True
    with pytest.raises(ValueError, match="neither"):
        layout_span("#ttg.slice<{dim = 1, parent = #mma}>")


def test_in_place_adds_reads_each_operand():
    ttgir = (f"#mma = {MMA_V2.format(4, 1)}\n"
             "%1 = tt.elementwise_inline_asm \"{ .reg .pred p; @p red.global.add.f32 [$1], $2; }\" "
             "{pure = false} %a, %b : tensor<32x32xi64, #mma>, tensor<32x32xf32, #mma> -> tensor<32x32xi32, #mma>\n"
             "%2 = tt.elementwise_inline_asm \"ld.global.nc.f32 $0, [$1];\" %c : tensor<8x8xi64, #mma>\n")
    assert in_place_adds(ttgir) == [((32, 32), MMA_V2.format(4, 1))] * 3


CONFIGS = [  # (op, dtype, D, L, (Hq, Hkv), blocks, num_warps); the first five repeated on the H100
    ("cope", "float32", 32, 128, (1, 1), None, None),
    ("cope", "float16", 64, 16, (2, 1), {"block_q": 16, "block_k": 16, "block_q_bwd": 16, "block_k_bwd": 16}, None),
    ("cope", "float32", 128, 256, (8, 2), None, None),
    ("cope", "bfloat16", 64, 256, (8, 2), None, None),
    ("cope", "float32", 64, 256, (4, 1), {"block_q_bwd": 64, "block_k_bwd": 32}, None),
    ("cope", "bfloat16", 64, 256, (8, 2), {"block_q_bwd": 64}, 8),
    ("corope", "bfloat16", 64, 256, (8, 2), None, None),
    ("corope", "bfloat16", 64, 256, (8, 2), None, 8),
    ("corope", "float32", 128, 256, (8, 8), None, None),
]


@needs_triton
@pytest.mark.parametrize("op, dtype, head_dim, length, heads, blocks, num_warps", CONFIGS,
                         ids=[f"{c[0]}-{c[1]}-D{c[2]}-L{c[3]}-{c[5]}-w{c[6]}" for c in CONFIGS])
def test_backward_adds_in_place_only_owned_values(op, dtype, head_dim, length, heads, blocks, num_warps, tmp_path):
    constexprs, ttgir = backward_ttgir(op, dtype, head_dim, length, heads, blocks=blocks, num_warps=num_warps,
                                       tmp_path=tmp_path)
    adds = in_place_adds(ttgir)
    for shape, layout in adds:
        assert not repeated(shape, layout), f"{shape} in {layout} ({constexprs})"
    if op == "cope":  # in place exactly where the rule allows it, so a kernel at 16 rows a warp keeps its fast adds
        assert bool(adds) == (constexprs["BLOCK_Q"] >= 16 * constexprs["num_warps"]), constexprs
