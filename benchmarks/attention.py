"""Benchmark of the contextual attentions: time and peak memory, forward and forward+backward.

CoPE and Co-RoPE through the public `jaxpe.cope_attention` / `jaxpe.corope_attention` with impl = reference,
blockwise, pallas, triton (the native kernels; on a GPU where jax-triton is installed), and with --ops forgetting
(`jaxpe.forgetting_attention`, gates σ of a fixed draw; no triton impl) and stick-breaking attention
(`jaxpe.stickbreaking_attention`); plain RoPE attention through `jax.nn.dot_product_attention` (cuDNN on GPU) is the
anchor.
B batch, L length, Hq query heads, G = Hq // Hkv, D head dim, npos CoPE table rows.

    python benchmarks/attention.py --out results/bench            # GPU sweep at training shapes: B 4, Hq 16,
                                                                  # L 1024 .. 16384, D 64 and 128, G 1 and 4
    python benchmarks/attention.py --out results/bench --quick    # CPU-sized sweep (B 1, Hq 8; without --quick
                                                                  # L 512 .. 32768 on CPU)
    python benchmarks/attention.py --out DIR --ops fox,stickbreaking --impls pallas,triton,anchor --lengths 4096
    python benchmarks/attention.py --out DIR --lengths 1024,4096 --impls blockwise,anchor --ops cope
    python benchmarks/attention.py --out DIR --lengths 4096,32768 --groups 4 --impls pallas,triton,anchor  # GPU paths

Peak memory: on GPU, `peak_bytes_in_use` of the device, each case in a fresh subprocess so the peak is its own;
on CPU, the compiled executable's memory analysis (temp + argument + output bytes), and cases above
--cpu-memory-cap-gib are compiled but not run. Out-of-memory and compile failures are recorded per case.
Writes <name>.json (device, jax version, date, config, rows) and <name>.md to --out (name: bench_<backend>).
A consumer of the library, kept beside it rather than inside (as jax keeps its benchmarks/).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxpe
from jaxpe.dispatch import PATHS

OPS = ("cope", "corope", "fox", "stickbreaking")
IMPLS = ("reference", "blockwise", "pallas", "triton", "anchor")
GPU_LENGTHS = (1024, 2048, 4096, 8192, 16384)  # the lengths people train at
CPU_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
MODES = ("fwd", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class Case:
    """One measurement: `op` is "cope", "corope" or "rope" (the anchor, impl "anchor")."""

    op: str
    impl: str
    length: int
    head_dim: int
    groups: int
    mode: str
    batch: int
    heads: int
    npos: int
    dtype: str


def _attention(case: Case):
    """(attention(q, k, v, *extra), extra inputs) for the case."""
    if case.op == "cope":
        pos_emb = 0.1 * jax.random.normal(jax.random.PRNGKey(3), (case.npos, case.head_dim))
        return (lambda q, k, v, e: jaxpe.cope_attention(q, k, v, e, impl=case.impl)), (pos_emb.astype(case.dtype),)
    if case.op == "corope":
        return (lambda q, k, v: jaxpe.corope_attention(q, k, v, impl=case.impl)), ()
    if case.op == "fox":
        shape = (case.batch, case.length, case.heads)
        log_fgate = jax.nn.log_sigmoid(2.0 + jax.random.normal(jax.random.PRNGKey(3), shape))
        return (lambda q, k, v, g: jaxpe.forgetting_attention(q, k, v, g, impl=case.impl)), (log_fgate,)
    if case.op == "stickbreaking":
        return (lambda q, k, v: jaxpe.stickbreaking_attention(q, k, v, impl=case.impl)), ()

    # cuDNN's fused flash attention on a GPU (XLA's own path there materialises L×L logits), XLA's on CPU.
    implementation = "cudnn" if jax.default_backend() == "gpu" else None

    def rope_attention(q, k, v):
        positions = jnp.arange(q.shape[1])
        q, k = jaxpe.apply_rope(q, positions), jaxpe.apply_rope(k, positions)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=q.shape[-1] ** -0.5,
                                            implementation=implementation)

    return rope_attention, ()


def _problem(case: Case):
    """(function to time, its arguments): the attention output, or the gradients of sum(o · cotangent)."""
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    hkv = case.heads // case.groups
    q = jax.random.normal(keys[0], (case.batch, case.length, case.heads, case.head_dim), case.dtype)
    k, v = (jax.random.normal(kk, (case.batch, case.length, hkv, case.head_dim), case.dtype) for kk in keys[1:3])
    attention, extra = _attention(case)
    args = (q, k, v, *extra)
    if case.mode == "fwd":
        return attention, args
    cotangent = jax.random.normal(keys[3], q.shape, case.dtype)  # an argument, not a constant XLA would fold

    def loss(*a):
        return jnp.sum(attention(*a[:-1]).astype(jnp.float32) * a[-1].astype(jnp.float32))

    return jax.grad(loss, argnums=tuple(range(len(args)))), (*args, cotangent)


def _load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _is_oom(error: Exception) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "Out of memory" in text


def measure(case: Case, *, repeats: int, cpu_memory_cap: float, max_interpret_length: int,
            predicted_s: float = 0.0, slow_s: float = float("inf")) -> dict:
    """Time and peak memory of one case; errors recorded. The first run is timed; if it took under 2 s, the
    median of `repeats` more timings is reported instead (each of back-to-back runs when one takes under 50 ms). A
    case predicted to take over `slow_s` is compiled (so its memory is known) but not run."""
    row = dataclasses.asdict(case)
    on_gpu = jax.default_backend() == "gpu"
    if case.impl in ("pallas", "triton") and not on_gpu and case.length > max_interpret_length:
        return row | {"error": f"skipped: {case.impl} interpreted above L={max_interpret_length} on CPU"}
    try:
        fn, args = _problem(case)
        compiled = jax.jit(fn).lower(*args).compile()
    except Exception as error:  # noqa: BLE001 - every failure is a result to record
        return row | {"error": ("out of memory: " if _is_oom(error) else "compile failed: ") + _short(error)}
    if not on_gpu:
        analysis = compiled.memory_analysis()
        peak = analysis.temp_size_in_bytes + analysis.argument_size_in_bytes + analysis.output_size_in_bytes
        row["peak_bytes"] = int(peak)
        if peak > cpu_memory_cap:
            return row | {"error": f"not run: needs {peak / 2**30:.1f} GiB > cap {cpu_memory_cap / 2**30:.1f} GiB"}
    if predicted_s > slow_s:
        return row | {"error": f"not run: predicted {predicted_s:.0f} s > --slow-s {slow_s:.0f}"}
    try:
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times = [time.perf_counter() - start]
        # Short runs are timed back to back, `calls` per timing, so the launch overhead is not what is measured.
        calls = 1 if times[0] > 0.05 else min(100, int(0.05 / max(times[0], 1e-6)) + 1)
        for _ in range(repeats if times[0] <= 2.0 else 0):
            start = time.perf_counter()
            for _ in range(calls):
                result = compiled(*args)
            jax.block_until_ready(result)
            times.append((time.perf_counter() - start) / calls)
        times = times[1:] or times
    except Exception as error:  # noqa: BLE001
        return row | {"error": ("out of memory: " if _is_oom(error) else "run failed: ") + _short(error)}
    row["time_ms"] = 1e3 * statistics.median(times)
    if on_gpu:
        stats = jax.devices()[0].memory_stats() or {}
        row["peak_bytes"] = int(stats.get("peak_bytes_in_use", 0)) or None
    return row


def _short(error: Exception) -> str:
    return " ".join(str(error).split())[:300]


def _cases(args: argparse.Namespace) -> list[Case]:
    cases = []
    for length in args.lengths:
        for head_dim in args.head_dims:
            for groups in args.groups:
                for mode in MODES:
                    common = dict(length=length, head_dim=head_dim, groups=groups, mode=mode, batch=args.batch,
                                  heads=args.heads, npos=args.npos, dtype=args.dtype)
                    if "anchor" in args.impls:
                        cases.append(Case(op="rope", impl="anchor", **common))
                    for op in args.ops:
                        cases += [Case(op=op, impl=impl, **common) for impl in args.impls
                                  if (op, impl) in PATHS]  # fox: no triton
    return cases


def _run_in_subprocess(case: Case, args: argparse.Namespace) -> dict:
    """GPU: a fresh process per case, so that the device's peak memory is this case's alone."""
    command = [sys.executable, str(Path(__file__).resolve()), "--case", json.dumps(dataclasses.asdict(case)),
               "--repeats", str(args.repeats)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.case_timeout)
    except subprocess.TimeoutExpired:
        return dataclasses.asdict(case) | {"error": f"timed out after {args.case_timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return dataclasses.asdict(case) | {"error": "crashed: " + _short(Exception(done.stderr[-600:]))}
    return json.loads(lines[-1])


def _ratio(row: dict, base: dict | None) -> str:
    if base is None or "time_ms" not in row or "time_ms" not in base:
        return ""
    return f"{row['time_ms'] / base['time_ms']:.2f}"


def write_report(out: Path, stem: str, report: dict, text: str) -> None:
    """out/stem.json (the report) and out/stem.md (its Markdown `text`); benchmarks/tiles.py writes its own so."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (out / f"{stem}.md").write_text(text, encoding="utf-8")


def markdown(rows: list[dict], header: str) -> str:
    """Markdown table; ratios are to the RoPE anchor and to the reference of the same op, both from this run."""
    def key(r, **kw):
        return tuple((r | kw)[f] for f in ("op", "impl", "length", "head_dim", "groups", "mode"))

    index = {key(r): r for r in rows}
    lines = [header, "",
             "| op | impl | L | D | G | mode | time (ms) | × RoPE anchor | × reference | peak (MiB) | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        anchor = index.get(key(r, op="rope", impl="anchor"))
        reference = index.get(key(r, impl="reference"))
        time_ms = f"{r['time_ms']:.1f}" if "time_ms" in r else "—"
        peak = f"{r['peak_bytes'] / 2**20:.0f}" if r.get("peak_bytes") else "—"
        lines.append(f"| {r['op']} | {r['impl']} | {r['length']} | {r['head_dim']} | {r['groups']} | {r['mode']} | "
                     f"{time_ms} | {_ratio(r, anchor)} | {_ratio(r, reference) if r['impl'] != 'reference' else ''}"
                     f" | {peak} | {r.get('error', '')} |")
    return "\n".join(lines) + "\n"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        bad = [x for x in names if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {allowed}")
        return names
    return parse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/attention.py", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU-sized sweep (L 128..16384, D 64, G 1)")
    parser.add_argument("--out", type=Path, metavar="DIR", help="output folder (required)")
    parser.add_argument("--name", help="output file stem (default bench_<backend>)")
    parser.add_argument("--lengths", type=_ints, help="comma-separated sequence lengths")
    parser.add_argument("--head-dims", type=_ints, help="comma-separated head dims (default 64,128)")
    parser.add_argument("--groups", type=_ints, help="comma-separated GQA group sizes G (default 1,4)")
    parser.add_argument("--impls", type=_names(IMPLS), default=[i for i in IMPLS if i != "triton"],
                        help=f"subset of {IMPLS} (default all but triton, which needs jax-triton on a GPU)")
    parser.add_argument("--ops", type=_names(OPS), default=["cope", "corope"],
                        help=f"subset of {OPS} (default cope,corope)")
    parser.add_argument("--batch", type=int, help="B (default 4 on a GPU, 1 on CPU)")
    parser.add_argument("--heads", type=int, help="query heads Hq (default 16 on a GPU, 8 on CPU)")
    parser.add_argument("--npos", type=int, default=64, help="CoPE table rows")
    parser.add_argument("--dtype", default=None, help="input dtype (default bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case (median reported)")
    parser.add_argument("--cpu-memory-cap-gib", type=float, default=6.0, help="CPU: do not run cases above this")
    parser.add_argument("--max-interpret-length", type=int, default=256,
                        help="CPU: longest L for Pallas in interpret mode")
    parser.add_argument("--slow-s", type=float, default=None,
                        help="CPU: skip a case whose time, extrapolated as L² from the last length, exceeds this "
                             "(default 60 s with --quick, else no limit)")
    parser.add_argument("--case-timeout", type=int, default=600, help="GPU: seconds per case subprocess")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, print its row as JSON
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    cap = args.cpu_memory_cap_gib * 2**30
    if args.case:
        print(json.dumps(measure(Case(**json.loads(args.case)), repeats=args.repeats, cpu_memory_cap=cap,
                                 max_interpret_length=args.max_interpret_length)))
        return
    if args.out is None:
        parser.error("--out DIR is required")
    if args.quick:
        args.lengths = args.lengths or [128, 256, 1024, 2048, 4096, 16384]
        args.slow_s = 60.0 if args.slow_s is None else args.slow_s
        args.head_dims = args.head_dims or [64]
        args.groups = args.groups or [1]
    args.lengths = args.lengths or list(GPU_LENGTHS if on_gpu else CPU_LENGTHS)
    args.batch = args.batch or (4 if on_gpu else 1)
    args.heads = args.heads or (16 if on_gpu else 8)
    args.head_dims = args.head_dims or [64, 128]
    args.groups = args.groups or [1, 4]
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    args.slow_s = float("inf") if args.slow_s is None else args.slow_s
    if args.batch < 1 or args.heads < 1:
        raise ValueError(f"--batch={args.batch} and --heads={args.heads} must be positive")
    for name in ("lengths", "head_dims", "groups"):
        if any(x < 1 for x in getattr(args, name)):
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be positive")
    if args.heads % max(args.groups):
        raise ValueError(f"--heads={args.heads} must be a multiple of every G in --groups={args.groups}")

    load_before = _load_average()
    rows, last_time = [], {}  # series (all but length) -> (length, seconds) of its last timed case
    for case in _cases(args):
        series = dataclasses.replace(case, length=0)
        previous = last_time.get(series)
        predicted = 0.0 if previous is None else previous[1] * (case.length / previous[0]) ** 2
        row = (_run_in_subprocess(case, args) if on_gpu else
               measure(case, repeats=args.repeats, cpu_memory_cap=cap, max_interpret_length=args.max_interpret_length,
                       predicted_s=predicted, slow_s=args.slow_s))
        if "time_ms" in row:
            last_time[series] = (case.length, row["time_ms"] / 1e3)
        rows.append(row)
        print(json.dumps(row), flush=True)

    device = jax.devices()[0]
    report = {
        "device_kind": device.device_kind, "backend": jax.default_backend(), "jax_version": jax.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        # 1-minute load average before/after: on a shared machine, times scale with it.
        "load_average": [load_before, _load_average()],
        "memory_source": ("device memory_stats peak_bytes_in_use, one subprocess per case" if on_gpu else
                          "compiled memory_analysis: temp + argument + output bytes"),
        "config": {k: None if v == float("inf") else v  # strict JSON: no Infinity
                   for k, v in vars(args).items() if k not in ("case", "out", "name")},
        "rows": rows,
    }
    header = (f"## Attention benchmark: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
              f"{report['date']}\n\nB={args.batch}, Hq={args.heads}, npos={args.npos}, dtype={args.dtype}; "
              f"peak memory from {report['memory_source']}.")
    write_report(args.out, args.name or f"bench_{jax.default_backend()}", report, markdown(rows, header))


if __name__ == "__main__":
    main()
