"""Co-RoPE on CPU: the blockwise path against jaxpe's dense reference and the seed's dense PyTorch code.

Config: B 1, Hq 8, Hkv 8, D 64, float32, θ = 10⁴, sm_scale = D^−½, random normal q, k, v.
1. blockwise vs `impl="reference"`, forward and forward+backward (a vjp with a random cotangent), at each of
   --lengths (default 1024, 2048): medians of --repeats runs, the two impls interleaved in one process so that their
   ratio is fair on a shared machine;
2. the blockwise forward+backward at --long-length (default 16384) in a subprocess of its own: wall time of one
   compiled run and the subprocess's peak resident memory (getrusage ru_maxrss);
3. the seed's dense PyTorch reference (github Superposition09m/Co-RoPE, `corope-exp/corope_attn_gqa_pytorch.py`,
   run as it is, imported from --seed-file, that file of a checkout) at --seed-length (default 1024), forward and
   forward+backward, when --torch-python (default $TORCH_PYTHON) is given; its peak memory too.
Writes --out: device, versions, date, config, times, ratios.

    python benchmarks/corope_cpu.py --out results/bench/corope_cpu.json \
        --torch-python TORCH_VENV/bin/python --seed-file CO_ROPE/corope-exp/corope_attn_gqa_pytorch.py
    python benchmarks/corope_cpu.py --out FILE --lengths 1024 --long-length 0 --seed-length 0    # quick
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

B, HQ, HKV, D, THETA = 1, 8, 8, 64, 10000.0
SEED_PATH = "corope-exp/corope_attn_gqa_pytorch.py"
ROOT = Path(__file__).resolve().parent.parent


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def _jax_functions(length: int):
    """{(impl, mode): jitted function of (q, k, v, do)} and the inputs."""
    import jax
    import jax.numpy as jnp

    import jaxpe

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (B, length, HQ, D), jnp.float32)
    k, v = (jax.random.normal(key, (B, length, HKV, D), jnp.float32) for key in keys[1:3])
    do = jax.random.normal(keys[3], (B, length, HQ, D), jnp.float32)
    functions = {}
    for impl in ("reference", "blockwise"):
        attention = lambda q, k, v, impl=impl: jaxpe.corope_attention(q, k, v, theta=THETA, impl=impl)
        functions[impl, "fwd"] = jax.jit(lambda q, k, v, do, f=attention: f(q, k, v))
        functions[impl, "fwd+bwd"] = jax.jit(lambda q, k, v, do, f=attention: jax.vjp(f, q, k, v)[1](do))
    return functions, (q, k, v, do)


def _time(function, inputs) -> float:
    import jax

    start = time.perf_counter()
    jax.block_until_ready(function(*inputs))
    return time.perf_counter() - start


def measure_jax(length: int, repeats: int) -> dict:
    """Medians (s) of blockwise and reference, forward and forward+backward, interleaved."""
    functions, inputs = _jax_functions(length)
    for function in functions.values():  # compile and warm up
        _time(function, inputs)
    times = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            times[name].append(_time(function, inputs))
    row = {"length": length, "repeats": repeats}
    for (impl, mode), values in times.items():
        row[f"{impl}_{mode}_s"] = statistics.median(values)
    for mode in ("fwd", "fwd+bwd"):
        row[f"blockwise_over_reference_{mode}"] = row[f"blockwise_{mode}_s"] / row[f"reference_{mode}_s"]
    return row


def long_worker(length: int) -> dict:
    """One compiled blockwise forward+backward at `length` (run in a subprocess: its peak RSS is its own)."""
    functions, inputs = _jax_functions(length)
    function = functions["blockwise", "fwd+bwd"]
    start = time.perf_counter()
    compiled = function.lower(*inputs).compile()
    compile_s = time.perf_counter() - start
    run_s = _time(compiled, inputs)
    return {"length": length, "compile_s": compile_s, "blockwise_fwd+bwd_s": run_s, "peak_rss_gib": _peak_rss_gib()}


def seed_worker(seed_file: str, length: int, repeats: int, mode: str) -> dict:
    """The seed's attention_pytorch (imported from its file as it is) on this config: the median time of `mode`
    ("fwd", or "fwd+bwd" through their manual backward), then the peak RSS of this process."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("corope_seed", seed_file)
    seed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seed)
    torch.manual_seed(0)
    q = torch.randn(B, HQ, length, D, requires_grad=True)  # the seed's layout: (B, H, N, D)
    k = torch.randn(B, HKV, length, D, requires_grad=True)
    v = torch.randn(B, HKV, length, D, requires_grad=True)
    do = torch.randn(B, HQ, length, D)

    def run():
        if mode == "fwd":
            with torch.no_grad():
                seed.attention_pytorch(q, k, v, True, D ** -0.5, THETA)
        else:
            out = seed.attention_pytorch(q, k, v, True, D ** -0.5, THETA)
            torch.autograd.grad(out, (q, k, v), do)

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return {"mode": mode, "length": length, "repeats": repeats, "torch_version": torch.__version__,
            "torch_threads": torch.get_num_threads(), f"seed_{mode}_s": statistics.median(times),
            f"seed_{mode}_peak_rss_gib": _peak_rss_gib()}


def _subprocess(command: list[str], timeout: float, memory_cap_gib: float | None = None) -> dict:
    """Run a worker; its last stdout line is its JSON row. memory_cap_gib: RLIMIT_AS of the worker, so that a dense
    run that needs too much fails in the worker instead of waking the kernel's OOM killer on a shared machine."""
    def cap() -> None:
        if memory_cap_gib:
            limit = int(memory_cap_gib * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              preexec_fn=cap if memory_cap_gib else None)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-800:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _summary(report: dict) -> dict:
    """The targets, read off the measurements (None where a measurement is missing)."""
    rows = {row["length"]: row for row in report["blockwise_vs_reference"]}
    long, seed = report.get("long", {}), report.get("seed_pytorch", {})
    summary = {}
    if 2048 in rows:
        ratio = rows[2048]["blockwise_over_reference_fwd"]
        summary["blockwise_over_reference_fwd_at_2048"] = {"value": ratio, "target": "<= 0.6", "met": ratio <= 0.6}
    if "blockwise_fwd+bwd_s" in long:
        met = long["blockwise_fwd+bwd_s"] <= 600 and long["peak_rss_gib"] <= 4
        summary[f"fwd+bwd_at_{long['length']}"] = {"seconds": long["blockwise_fwd+bwd_s"],
                                                   "peak_rss_gib": long["peak_rss_gib"],
                                                   "target": "<= 600 s and <= 4 GiB", "met": met}
    for mode in ("fwd", "fwd+bwd"):
        if f"seed_over_blockwise_{mode}" in seed:
            ratio = seed[f"seed_over_blockwise_{mode}"]
            summary[f"seed_pytorch_over_blockwise_{mode}"] = {"value": ratio, "target": ">= 5", "met": ratio >= 5}
    return summary


def _load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,2048", help="comma-separated L for blockwise vs reference")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long-length", type=int, default=16384, help="0: skip the long run")
    parser.add_argument("--long-timeout", type=float, default=1800.0)
    parser.add_argument("--seed-length", type=int, default=1024, help="0: skip the seed's PyTorch reference")
    parser.add_argument("--seed-repeats", type=int, default=1)
    parser.add_argument("--seed-file", help=f"the seed's {SEED_PATH} (github Superposition09m/Co-RoPE)")
    parser.add_argument("--seed-memory-cap-gib", type=float, default=16.0, help="address-space cap of the seed runs")
    parser.add_argument("--torch-python", default=os.environ.get("TORCH_PYTHON"),
                        help="a Python interpreter with torch, for the seed's reference (default: $TORCH_PYTHON)")
    parser.add_argument("--out", type=Path, metavar="FILE", help="the JSON report (required)")
    parser.add_argument("--update", action="store_true",
                        help="keep the parts of an existing --out that this run skips (e.g. --lengths '' to redo "
                             "only the long run); each part records its own date")
    parser.add_argument("--worker", choices=("long", "seed"), help=argparse.SUPPRESS)
    parser.add_argument("--seed-mode", choices=("fwd", "fwd+bwd"), default="fwd", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker == "long":
        print(json.dumps(long_worker(args.long_length)), flush=True)
        return
    if args.worker == "seed":
        print(json.dumps(seed_worker(args.seed_file, args.seed_length, args.seed_repeats, args.seed_mode)),
              flush=True)
        return
    if args.out is None:
        parser.error("--out FILE is required")

    import jax

    import jaxpe  # noqa: F401  (its version below)

    report = {
        "benchmark": "benchmarks/corope_cpu.py", "command": " ".join(["python", "benchmarks/corope_cpu.py"] +
                                                                     (argv if argv is not None else sys.argv[1:])),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
                   "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                   "load_average_at_start": _load_average()},
        "versions": {"python": platform.python_version(), "jax": jax.__version__,
                     "jaxlib": __import__("jaxlib").__version__},
        "config": {"batch": B, "q_heads": HQ, "kv_heads": HKV, "head_dim": D, "dtype": "float32", "theta": THETA,
                   "causal": True, "blockwise_block_k": 128},
        "targets": {"blockwise_over_reference_fwd_at_2048": "<= 0.6", "long_fwd+bwd": "<= 4 GiB and <= 600 s",
                    "seed_over_blockwise_at_1024": ">= 5"},
    }
    previous = json.loads(args.out.read_text(encoding="utf-8")) if args.update and args.out.exists() else {}
    now = lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows = []
    for length in (int(x) for x in args.lengths.split(",") if x):
        rows.append(dict(measure_jax(length, args.repeats), date=now()))
        print(json.dumps(rows[-1]), flush=True)
    report["blockwise_vs_reference"] = rows or previous.get("blockwise_vs_reference", [])

    if args.long_length:
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "long",
                   "--long-length", str(args.long_length)]
        report["long"] = dict(_subprocess(command, args.long_timeout), date=now())
        print(json.dumps(report["long"]), flush=True)
    elif "long" in previous:
        report["long"] = previous["long"]

    seed_file = str(Path(args.seed_file).resolve()) if args.seed_file and Path(args.seed_file).is_file() else None
    if args.seed_length and seed_file and args.torch_python and Path(args.torch_python).exists():
        seed = {"source": f"github Superposition09m/Co-RoPE {SEED_PATH}"}
        rows_now = rows or report["blockwise_vs_reference"]
        for mode in ("fwd", "fwd+bwd"):  # one subprocess each: a dense backward may run out of memory
            command = [args.torch_python, str(Path(__file__).resolve()), "--worker", "seed", "--seed-file",
                       seed_file, "--seed-length", str(args.seed_length), "--seed-repeats", str(args.seed_repeats),
                       "--seed-mode", mode]
            result = _subprocess(command, args.long_timeout, args.seed_memory_cap_gib)
            seed.update({f"{mode}_error": result["error"]} if "error" in result else result)
            seed.pop("mode", None)
        same = [r for r in rows_now if r["length"] == args.seed_length]
        for mode in ("fwd", "fwd+bwd"):
            if same and f"seed_{mode}_s" in seed:
                seed[f"seed_over_blockwise_{mode}"] = seed[f"seed_{mode}_s"] / same[0][f"blockwise_{mode}_s"]
        report["seed_pytorch"] = dict(seed, date=now())
        print(json.dumps(seed), flush=True)
    else:
        report["seed_pytorch"] = previous.get("seed_pytorch", {"skipped": "no --torch-python or no seed file"})
    if previous:
        report["earlier_runs"] = previous.get("earlier_runs", []) + [{k: previous[k] for k in ("date", "command")}]

    report["summary"] = _summary(report)
    print(json.dumps(report["summary"]), flush=True)
    report["load_average_at_end"] = _load_average()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
