"""What the fused kernels' gradient keeps in memory, measured from the program itself (no GPU needed).

For the fused CoPE and Co-RoPE kernels (the compiled path, `interpret=False`: the kernels stay `pallas_call`s, nothing
runs), traces the forward + backward of `sum(attention(q, k, v))` at each length and walks every array the program
creates outside the kernels — residuals saved by the custom VJP, kernel outputs, XLA glue — recording the largest
and the sum of all of them (an upper bound on the peak: not all are live at once). An O(L) backward has a largest
array that grows linearly in L. For comparison, a backward split into a dq kernel and a dk/dv kernel saves two
arrays of per-key-block partial sums of Hq·L·L/block_k floats each (one, block_k 64, is the `split` column,
before_bytes in the JSON), and the dense reference holds L×L arrays.
B batch, L length, Hq/Hkv heads, D head dim, P CoPE table rows.

    python benchmarks/kernel_memory.py --out results/bench/kernel_memory.json   # L 4096, 16384, 32768; prints too
    python benchmarks/kernel_memory.py --out FILE --lengths 1024,65536
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from jaxpe.kernels.cope_pallas import cope_attention_pallas
from jaxpe.kernels.corope_pallas import corope_attention_pallas


def _arrays(jaxpr: jex_core.Jaxpr) -> list[tuple[tuple[int, ...], int]]:
    """(shape, bytes) of every array a jaxpr's equations produce, through nested jaxprs but not into kernels."""
    found = []
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            aval = var.aval
            if hasattr(aval, "shape") and hasattr(aval, "dtype"):
                found.append((tuple(aval.shape), math.prod(aval.shape) * jnp.dtype(aval.dtype).itemsize))
        if eqn.primitive.name == "pallas_call":
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jex_core.Jaxpr):
                    found.extend(_arrays(inner))
    return found


def measure(op: str, length: int, *, batch: int, heads: int, kv_heads: int, head_dim: int, npos: int
            ) -> dict[str, Any]:
    """Largest and total bytes of the arrays in the gradient program of one configuration."""
    q = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((batch, length, kv_heads, head_dim), jnp.float32)
    scale = head_dim ** -0.5
    if op == "cope":
        extra = (jax.ShapeDtypeStruct((npos, head_dim), jnp.float32),)
        attend = lambda q, k, v, e: cope_attention_pallas(q, k, v, e, sm_scale=scale, interpret=False)
    else:
        extra = ()
        attend = lambda q, k, v: corope_attention_pallas(q, k, v, theta=10000.0, sm_scale=scale, interpret=False)
    grad = jax.grad(lambda *a: attend(*a).sum(), argnums=tuple(range(3 + len(extra))))
    arrays = _arrays(jax.make_jaxpr(grad)(q, kv, kv, *extra).jaxpr)
    shape, largest = max(arrays, key=lambda a: a[1])
    inputs = 4 * (2 * math.prod(q.shape) + 2 * math.prod(kv.shape))  # q, k, v and the output, float32
    return {"op": op, "length": length, "largest_bytes": largest, "largest_shape": list(shape),
            "total_bytes": sum(b for _, b in arrays), "inputs_bytes": inputs,
            "before_bytes": 4 * batch * heads * length * (length // 64),  # one per-key-block partial sum, block_k 64
            "dense_bytes": 4 * batch * heads * length * length}


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,16384,32768")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", default="8/2", help="query/kv heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--npos", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True, metavar="FILE", help="the JSON report")
    args = parser.parse_args(argv)
    heads, kv_heads = (int(x) for x in args.heads.split("/"))
    rows = [measure(op, int(length), batch=args.batch, heads=heads, kv_heads=kv_heads, head_dim=args.head_dim,
                    npos=args.npos)
            for op in ("cope", "corope") for length in args.lengths.split(",")]
    print(f"B {args.batch}, Hq/Hkv {heads}/{kv_heads}, D {args.head_dim}, P {args.npos}, float32; MiB")
    print("| op | L | largest array (shape) | sum of all arrays | q, k, v, out | split: one per-key-block sum "
          "| dense L×L |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['length']} | {_mib(r['largest_bytes'])} {tuple(r['largest_shape'])} | "
              f"{_mib(r['total_bytes'])} | {_mib(r['inputs_bytes'])} | {_mib(r['before_bytes'])} | "
              f"{_mib(r['dense_bytes'])} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax": jax.__version__, "python": platform.python_version(), "device": "none (traced, not run)",
        "config": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}, indent=1) + "\n",
        encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
