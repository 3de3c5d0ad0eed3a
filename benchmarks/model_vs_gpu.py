"""benchmarks/kernel_cost.py's model beside a GPU's timings: per kernel, the model's bound (clocks per logit, from
the SASS of an H100) and the clocks per logit the GPU spent (time × SM clock × SMs / logits), and their ratio.

    python benchmarks/model_vs_gpu.py --cost results/cost/kernel_cost.json \
        --bench results/bench/bench_gpu_h200_native_32768.json --out results/bench/model_vs_h200

The timings are benchmarks/attention.py's (impl "triton" and the cuDNN anchor, bfloat16); a backward's time is its
forward + backward case less its forward case. Logits: B·Hq·L(L+1)/2 (causal). The model's bound for a kernel is
that of the loop its time goes to at L: CoPE's clamped-position tiles (at L ≫ npos almost every tile is past the
row's last live position), Co-RoPE's key-block loops (the backward's rotary walk and its gates-only walk), and for the
anchor, jax's Pallas flash attention at its default tiles (plain attention, a stand-in for cuDNN's own kernel).
Writes <out>.json (both inputs' provenance, the clock assumed, rows) and <out>.md.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

SM_CLOCK_MHZ = {"NVIDIA H200": 1980, "NVIDIA H100 80GB HBM3": 1980}  # the SXM parts' maximum SM clock
SMS = {"NVIDIA H200": 132, "NVIDIA H100 80GB HBM3": 132}


def _model_loops(cost: dict, op: str, kernel: str, head_dim: int, dtype: str) -> dict[str, float]:
    """Loop name -> bound (clk/logit) of the triton kernel at GQA 8/2 (CoPE at npos 64)."""
    for row in cost["kernels"]:
        if (row["path"], row["op"], row["kernel"], row["head_dim"], row["dtype"], row["q_heads"], row["kv_heads"]) \
                == ("triton", op, kernel, head_dim, dtype, 8, 2) and row.get("npos") in (None, 64):
            return {loop["name"]: loop["per_logit"]["bound"] for loop in row["loops"]}
    raise KeyError(f"no triton {op} {kernel} D {head_dim} {dtype} at GQA 8/2 in the cost report")


def _plain_bound(cost: dict, kernel: str, head_dim: int, dtype: str) -> float:
    """Plain attention's bound at its default tiles (every loop of the kernel summed)."""
    for row in cost["plain"]:
        if (row["variant"], row["kernel"], row["head_dim"], row["dtype"]) == ("defaults", kernel, head_dim, dtype):
            return sum(loop["per_logit"]["bound"] for loop in row["loops"])
    raise KeyError(f"no plain {kernel} D {head_dim} {dtype} at its defaults in the cost report")


def model_bound(cost: dict, op: str, mode: str, head_dim: int, dtype: str) -> float:
    """The model's clk/logit for one (op, mode) as this module's docstring says."""
    kernel = "forward" if mode == "fwd" else "backward"
    if op == "rope":
        return _plain_bound(cost, kernel, head_dim, dtype)
    loops = _model_loops(cost, op, kernel, head_dim, dtype)
    if op == "cope":
        return loops["clamped"]
    return sum(loops.values())


def compare(cost: dict, bench: dict) -> list[dict]:
    """Rows (op, mode, D, model clk/logit, measured ms and clk/logit, measured ÷ model) for every (op, D) timed in
    both modes; the backward's time is fwd+bwd less fwd."""
    clock_hz, sms = SM_CLOCK_MHZ[bench["device_kind"]] * 1e6, SMS[bench["device_kind"]]
    times = {(r["op"], r["impl"], r["head_dim"], r["mode"]): r for r in bench["rows"] if "time_ms" in r}
    rows = []
    for (op, impl, head_dim, mode), row in sorted(times.items()):
        if mode != "fwd" or impl not in ("triton", "anchor") or (op, impl, head_dim, "fwd+bwd") not in times:
            continue
        both = times[(op, impl, head_dim, "fwd+bwd")]
        logits = row["batch"] * row["heads"] * row["length"] * (row["length"] + 1) / 2
        for pass_, ms in (("fwd", row["time_ms"]), ("bwd", both["time_ms"] - row["time_ms"])):
            measured = ms * 1e-3 * clock_hz * sms / logits
            bound = model_bound(cost, op, pass_, head_dim, row["dtype"])
            rows.append({"op": op, "impl": impl, "pass": pass_, "head_dim": head_dim, "length": row["length"],
                         "dtype": row["dtype"], "time_ms": ms, "measured_clk_per_logit": measured,
                         "model_clk_per_logit": bound, "measured_over_model": measured / bound})
    return rows


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| op | pass | D | L | time (ms) | measured clk/logit | model clk/logit | measured ÷ model |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = "plain (cuDNN)" if r["op"] == "rope" else r["op"]
        lines.append(f"| {name} | {r['pass']} | {r['head_dim']} | {r['length']} | {r['time_ms']:.1f} | "
                     f"{r['measured_clk_per_logit']:.2f} | {r['model_clk_per_logit']:.2f} | "
                     f"{r['measured_over_model']:.1f}× |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cost", type=Path, required=True, help="benchmarks/kernel_cost.py's JSON")
    parser.add_argument("--bench", type=Path, required=True, help="benchmarks/attention.py's JSON from a GPU")
    parser.add_argument("--out", type=Path, required=True, help="output path without suffix")
    args = parser.parse_args(argv)
    cost, bench = json.loads(args.cost.read_text(encoding="utf-8")), json.loads(args.bench.read_text(encoding="utf-8"))
    if bench["device_kind"] not in SM_CLOCK_MHZ:
        parser.error(f"--bench: no SM clock known for {bench['device_kind']!r} (known: {sorted(SM_CLOCK_MHZ)})")
    rows = compare(cost, bench)
    clock = SM_CLOCK_MHZ[bench["device_kind"]]
    report = {"cost_report": {"path": str(args.cost), "date": cost["date"],
                              "kernel_sources_sha256": cost["kernel_sources_sha256"]},
              "bench": {"path": str(args.bench), "device_kind": bench["device_kind"], "date": bench["date"],
                        "jax_version": bench["jax_version"]},
              "sm_clock_mhz": clock, "sms": SMS[bench["device_kind"]], "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    header = (f"## The cost model beside {bench['device_kind']} timings ({bench['date'][:10]}, jax "
              f"{bench['jax_version']}); model of kernel sources {cost['kernel_sources_sha256'][:12]}\n\n"
              f"Measured clk/logit = time × {clock} MHz × {SMS[bench['device_kind']]} SMs / causal logits.")
    args.out.with_suffix(".md").write_text(markdown(rows, header), encoding="utf-8")


if __name__ == "__main__":
    main()
