"""The measurement behind impl="auto" on CPU: the dense path against the blockwise one, per encoding and length.

For CoPE and Co-RoPE, at each length L, times forward and forward+backward (the gradient of sum(o · cotangent)
with respect to q, k, v and CoPE's table) of
- "dense": what auto runs below its threshold (CoPE by causal query blocks, `jaxpe.cope.cope_attention_causal`;
  Co-RoPE's dense reference), and
- "blockwise": the O(L·block) path,
alternating the two in rounds within one process, so that a noisy machine slows both alike; the ratio per round is
blockwise / dense and its median is reported. B batch, L length, H heads (Hq = Hkv), D head dim, npos = L + 1
(CoPE's default table).

    python benchmarks/auto_dispatch.py --out results/bench/auto_dispatch_cpu.json   # the committed measurement
    python benchmarks/auto_dispatch.py --out FILE --lengths 128,256 --rounds 3
    python benchmarks/auto_dispatch.py --out FILE --max-dense-seconds 10   # go on to longer lengths

The crossover per encoding is the shortest measured length from which blockwise's forward+backward is no slower
(within TIE) at every longer measured length too; `jaxpe/dispatch.py` holds it (BLOCKWISE_MIN_LENGTH), and
tests/test_dispatch.py checks that the two agree. A consumer of the library, kept beside it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

from jaxpe.cope import cope_attention_causal, cope_attention_reference
from jaxpe.corope import corope_attention_reference
from jaxpe.kernels.cope_blockwise import cope_attention_blockwise
from jaxpe.kernels.corope_blockwise import corope_attention_blockwise

PATHS = ("dense", "blockwise")


def _attention(op: str, path: str, length: int) -> Callable[..., jax.Array]:
    """attention(q, k, v, *extra) -> [B, L, H, D] for one encoding and path, causal, default sm_scale."""
    if op == "cope":
        if path == "dense":
            dense = cope_attention_causal if length > 1 else cope_attention_reference
            return lambda q, k, v, e: dense(q, k, v, e, sm_scale=q.shape[-1] ** -0.5)
        return lambda q, k, v, e: cope_attention_blockwise(q, k, v, e, sm_scale=q.shape[-1] ** -0.5)
    if path == "dense":
        return lambda q, k, v: corope_attention_reference(q, k, v, theta=10000.0, sm_scale=q.shape[-1] ** -0.5)
    return lambda q, k, v: corope_attention_blockwise(q, k, v, theta=10000.0, sm_scale=q.shape[-1] ** -0.5)


def _problems(op: str, length: int, *, batch: int, heads: int, head_dim: int) -> dict[tuple[str, str], tuple]:
    """{(path, mode): (compiled function, arguments)} for mode "fwd" and "fwd+bwd"."""
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    q, k, v = (jax.random.normal(kk, (batch, length, heads, head_dim)) for kk in keys[:3])
    extra = (0.1 * jax.random.normal(keys[3], (length + 1, head_dim)),) if op == "cope" else ()
    cotangent = jax.random.normal(keys[4], q.shape)
    args = (q, k, v, *extra)
    problems = {}
    for path in PATHS:
        attention = _attention(op, path, length)

        def loss(*a, attention=attention):
            return jnp.sum(attention(*a[:-1]) * a[-1])

        grad = jax.grad(loss, argnums=tuple(range(len(args))))
        problems[path, "fwd"] = (jax.jit(attention).lower(*args).compile(), args)
        problems[path, "fwd+bwd"] = (jax.jit(grad).lower(*args, cotangent).compile(), (*args, cotangent))
    return problems


def _time(compiled, args, repeats: int) -> float:
    """Median seconds of `repeats` runs (after one warm-up run)."""
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(op: str, length: int, *, rounds: int, repeats: int, batch: int, heads: int, head_dim: int) -> dict:
    """One row: median times (ms) of both paths in both modes, and the median per-round ratio blockwise / dense."""
    problems = _problems(op, length, batch=batch, heads=heads, head_dim=head_dim)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in problems}
    for _ in range(rounds):
        for key, (compiled, args) in problems.items():
            times[key].append(_time(compiled, args, repeats))
    row: dict = {"op": op, "length": length}
    for mode in ("fwd", "fwd+bwd"):
        for path in PATHS:
            row[f"{path}_{mode}_ms"] = 1e3 * statistics.median(times[path, mode])
        row[f"ratio_{mode}"] = statistics.median(
            b / d for b, d in zip(times["blockwise", mode], times["dense", mode]))
    return row


TIE = 1.05  # blockwise at most 5 % slower counts as no slower: ties go to blockwise, which holds O(L·block) memory


def crossover(rows: list[dict], op: str) -> int | None:
    """The shortest measured length from which blockwise's forward+backward is no slower than dense (ratio <= TIE)
    at every longer measured length too; None when dense is faster at the longest measured length."""
    ratios = sorted((row["length"], row["ratio_fwd+bwd"]) for row in rows if row["op"] == op)
    best = None
    for length, ratio in reversed(ratios):
        if ratio > TIE:
            break
        best = length
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="cope,corope")
    parser.add_argument("--lengths", default="8,16,32,64,256,512,1024,2048")
    parser.add_argument("--max-dense-seconds", type=float, default=2.0,
                        help="stop an encoding's sweep after the length whose dense forward+backward took longer")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True, metavar="FILE", help="the JSON report")
    args = parser.parse_args(argv)
    ops = args.ops.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    for op in ops:
        for length in lengths:
            rows.append(measure(op, length, rounds=args.rounds, repeats=args.repeats, batch=args.batch,
                                heads=args.heads, head_dim=args.head_dim))
            print(json.dumps(rows[-1]), flush=True)
            if rows[-1]["dense_fwd+bwd_ms"] > 1e3 * args.max_dense_seconds:
                break
    report = {
        "device": {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
                   "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                   "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None},
        "versions": {"python": platform.python_version(), "jax": jax.__version__},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {"lengths": lengths, "max_dense_seconds": args.max_dense_seconds, "batch": args.batch,
                   "heads": args.heads, "head_dim": args.head_dim, "rounds": args.rounds,
                   "repeats": args.repeats, "npos": "L + 1"},
        "rows": rows,
        "tie": TIE,
        "crossover": {op: crossover(rows, op) for op in ops},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(report["crossover"]))


if __name__ == "__main__":
    main()
