"""Tile and warp variants of the native Triton kernels (impl="triton"), timed on a GPU with the forward and the
backward apart, so that a kernel's defaults (`cope_triton.default_num_warps`, `corope_triton.BlockSizes.default`)
rest on a measurement and not only on benchmarks/kernel_cost.py's model.

    python benchmarks/tiles.py --out results/bench                     # every variant, D 64 and 128, bfloat16
    python benchmarks/tiles.py --out DIR --ops corope --dtypes bfloat16,float32 --length 8192

Each row: one (op, variant, D, dtype); the forward is the jitted attention, the backward the jitted application of
its VJP to a cotangent (residuals computed once, outside the timing), each the median of --repeats timings of
back-to-back calls, beside the default variant's times (× default). All variants of one configuration run in one
process, one after another, so their ratios share the machine's state. B 1, GQA --heads/--kv-heads, causal.
Writes tiles_<backend>.json (device, jax and triton versions, date, rows) and .md to --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from attention import write_report  # benchmarks/attention.py, beside this file

OPS = ("cope", "corope")

# name -> BlockSizes fields and num_warps, for each op; "default" is every default.
VARIANTS: dict[str, dict[str, dict]] = {
    "cope": {
        "default": {},
        "8 warps": {"num_warps": 8},
        "32-row tiles": {"blocks": {"block_q": 32, "block_q_bwd": 32}},
        "32-row backward tiles": {"blocks": {"block_q_bwd": 32}},
        "64-row forward tiles": {"blocks": {"block_q": 64}},
    },
    "corope": {
        "default": {},
        "bwd 2 heads": {"blocks": {"block_h_bwd": 2}},
        "bwd 2 pairs": {"blocks": {"block_d_bwd": 2}},
        "bwd 16 keys": {"blocks": {"block_k_bwd": 16}},
        "8 warps": {"num_warps": 8},
        "bwd 2 heads, 4 pairs, 8 warps": {"blocks": {"block_h_bwd": 2, "block_d_bwd": 4}, "num_warps": 8},
    },
}


@dataclasses.dataclass(frozen=True)
class Config:
    """One problem: op, L, D, dtype, Hq query heads over Hkv key/value heads, npos CoPE table rows."""

    op: str
    length: int
    head_dim: int
    dtype: str
    heads: int
    kv_heads: int
    npos: int


def _attention(config: Config, variant: dict) -> tuple[Callable, tuple[jax.Array, ...]]:
    """(attention over the differentiable inputs, those inputs) for one variant."""
    keys = jax.random.split(jax.random.PRNGKey(config.length + config.head_dim), 4)
    q = jax.random.normal(keys[0], (1, config.length, config.heads, config.head_dim), config.dtype)
    k, v = (jax.random.normal(kk, (1, config.length, config.kv_heads, config.head_dim), config.dtype)
            for kk in keys[1:3])
    if config.op == "cope":
        from jaxpe.kernels.cope_pallas import BlockSizes
        from jaxpe.kernels.cope_triton import cope_attention_triton

        pos_emb = (0.1 * jax.random.normal(keys[3], (config.npos, config.head_dim))).astype(config.dtype)
        blocks = BlockSizes(**variant.get("blocks", {}))

        def cope(q, k, v, pos_emb):
            return cope_attention_triton(q, k, v, pos_emb, sm_scale=config.head_dim ** -0.5, block_sizes=blocks,
                                         num_warps=variant.get("num_warps"))

        return cope, (q, k, v, pos_emb)
    from jaxpe.kernels.corope_triton import BlockSizes, corope_attention_triton

    blocks = BlockSizes(**variant.get("blocks", {}))

    def corope(q, k, v):
        return corope_attention_triton(q, k, v, sm_scale=config.head_dim ** -0.5, block_sizes=blocks,
                                       num_warps=variant.get("num_warps"))

    return corope, (q, k, v)


def _median_ms(fn: Callable, args: tuple, repeats: int) -> float:
    """Median over `repeats` timings of back-to-back calls (enough for 20 ms each), after a warm-up call."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    calls = max(1, min(50, int(0.02 / max(time.perf_counter() - start, 1e-6))))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            result = fn(*args)
        jax.block_until_ready(result)
        times.append((time.perf_counter() - start) / calls)
    return 1e3 * statistics.median(times)


def measure(config: Config, name: str, variant: dict, repeats: int) -> dict:
    """Forward and backward times (ms) of one variant, or its error."""
    row = dataclasses.asdict(config) | {"variant": name, "settings": variant}
    try:
        attention, args = _attention(config, variant)
        forward = jax.jit(attention)
        row["fwd_ms"] = _median_ms(forward, args, repeats)
        out, vjp = jax.vjp(attention, *args)
        cotangent = jax.random.normal(jax.random.PRNGKey(7), out.shape, out.dtype)
        backward = jax.jit(lambda vjp, cotangent: vjp(cotangent))
        row["bwd_ms"] = _median_ms(backward, (vjp, cotangent), repeats)
    except Exception as error:  # noqa: BLE001 - a variant that fails is a result
        row["error"] = " ".join(str(error).split())[:300]
    return row


def markdown(rows: list[dict], header: str) -> str:
    """Rows as a table, each time beside the default variant's of its configuration (× default)."""
    lines = [header, "", "| op | D | dtype | variant | fwd (ms) | × default | bwd (ms) | × default | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    defaults = {(r["op"], r["head_dim"], r["dtype"]): r for r in rows if r["variant"] == "default"}
    for r in rows:
        base = defaults.get((r["op"], r["head_dim"], r["dtype"]), {})
        cells = []
        for key in ("fwd_ms", "bwd_ms"):
            value, reference = r.get(key), base.get(key)
            cells += [f"{value:.3f}" if value else "",
                      f"{value / reference:.2f}" if value and reference else ""]
        lines.append(f"| {r['op']} | {r['head_dim']} | {r['dtype']} | {r['variant']} | {' | '.join(cells)} | "
                     f"{r.get('error', '')} |")
    return "\n".join(lines) + "\n"


def _list(kind: Callable[[str], object]) -> Callable[[str], list]:
    return lambda text: [kind(part) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    parser.add_argument("--ops", type=_list(str), default=list(OPS))
    parser.add_argument("--head-dims", type=_list(int), default=[64, 128])
    parser.add_argument("--dtypes", type=_list(str), default=["bfloat16"])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8, help="query heads Hq")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads Hkv (divides Hq)")
    parser.add_argument("--npos", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    for op in args.ops:
        if op not in OPS:
            parser.error(f"--ops: {op!r} is not one of {OPS}")
    if args.length < 1 or args.repeats < 1 or args.heads % args.kv_heads:
        parser.error("--length and --repeats must be positive and --kv-heads must divide --heads")
    import triton

    rows = []
    for op in args.ops:
        for head_dim in args.head_dims:
            for dtype in args.dtypes:
                config = Config(op=op, length=args.length, head_dim=head_dim, dtype=str(jnp.dtype(dtype)),
                                heads=args.heads, kv_heads=args.kv_heads, npos=args.npos)
                for name, variant in VARIANTS[op].items():
                    rows.append(measure(config, name, variant, args.repeats))
                    print(json.dumps(rows[-1]), flush=True)
    device = jax.devices()[0]
    report = {"device_kind": device.device_kind, "backend": jax.default_backend(), "jax_version": jax.__version__,
              "triton_version": triton.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "config": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}
    header = (f"## Native Triton kernels, tile and warp variants: {device.device_kind}, jax {jax.__version__}, "
              f"triton {triton.__version__}, {report['date']}\n\nB 1, L {args.length}, Hq {args.heads}, "
              f"Hkv {args.kv_heads}, causal; forward and backward timed apart.")
    write_report(args.out, f"tiles_{jax.default_backend()}", report, markdown(rows, header))


if __name__ == "__main__":
    main()
