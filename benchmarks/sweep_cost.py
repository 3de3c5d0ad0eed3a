"""What a counting sweep costs at a preset: seconds per training step per encoding on this machine, the step's FLOPs,
and the sweep's time from them, on this CPU and at an assumed GPU throughput.

Each preset is measured in its own subprocess as results/run_cpu_medium.sh runs its training: one CPU device and one
XLA thread (one run per core, two side by side). Per encoding, the counting task's training batches `0 .. steps-1`
(3 variables) run twice through the jitted train step, each cut to its padded length as the trainer cuts it: the
first pass compiles every length it meets, the second is timed. Seconds per step is the second pass's mean, so the
mix of lengths is the task's own. FLOPs per step are XLA's cost analysis of the compiled step at each length, over
the same batches.

    python benchmarks/sweep_cost.py --out results/bench/sweep_cost_cpu.json                  # cpu-medium and paper
    python benchmarks/sweep_cost.py --out FILE --presets cpu-medium --steps 20 --pes cope,relative

The sweep is 6 encodings x `--settings` variable counts x `--seeds` seeds at the preset's run.steps (or
`--sweep-steps`), run `--parallel` at a time. On a GPU, FLOPs / (`--gpu-utilisation` x `--gpu-peak-tflops`): an
H100's dense bf16 peak at a stated fraction, an estimate, not a measurement (a model this small is more likely bound
by kernel launches than by FLOPs, so the estimate is a lower bound on GPU time).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PES = ("cope", "relative", "learned", "rope", "none", "corope")


def _flops(compiled: Any) -> float:
    """XLA's FLOP count of a compiled program (cost_analysis is a dict, or a list of one in older jax)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost.get("flops", float("nan")))


def measure_preset(preset: str, pes: list[str], steps: int) -> dict[str, Any]:
    """{pe: {"seconds_per_step", "flops_per_step", "mean_length", ...}} of `preset`'s counting step, in this
    process."""
    import jax

    from jaxpe.train.config import build_config
    from jaxpe.train.experiments import validate_config
    from jaxpe.train.tasks.base import scored_lengths
    from jaxpe.train.trainer import Trainer

    rows = {}
    for pe in pes:
        config = build_config(preset=preset, task="counting", pe=pe,
                              overrides=["task.nvars=3", "run.num_devices=1", "run.progress=false"])
        task, model = validate_config(config)
        trainer = Trainer(model=model, config=config, seq_len=task.seq_len)
        batches = [trainer.pad(task.train_batch(i, config.optim.batch_size)) for i in range(steps)]
        state = trainer.init_state()
        compiled: dict[int, Any] = {}  # padded length -> the step compiled for it (timed and counted alike)
        for batch in batches:  # the first pass compiles each length
            length = batch["inputs"].shape[1]
            if length not in compiled:
                compiled[length] = trainer.train_step.lower(state, trainer.put(batch)).compile()
            state, _ = compiled[length](state, trainer.put(batch))
        jax.block_until_ready(state)
        start = time.perf_counter()
        for batch in batches:
            state, _ = compiled[batch["inputs"].shape[1]](state, trainer.put(batch))
        jax.block_until_ready(state)
        seconds = (time.perf_counter() - start) / steps
        lengths = [batch["inputs"].shape[1] for batch in batches]
        rows[pe] = {"seconds_per_step": seconds,
                    "flops_per_step": statistics.fmean(_flops(compiled[length]) for length in lengths),
                    "mean_length": statistics.fmean(lengths), "real_tokens_per_step": statistics.fmean(
                        float(scored_lengths(batch["weights"]).sum()) for batch in batches),
                    "run_steps": config.run.steps, "batch_size": config.optim.batch_size,
                    "block": task.seq_len}
        print(f"{preset} {pe}: {seconds:.3f} s/step, {rows[pe]['flops_per_step'] / 1e9:.1f} GFLOP/step",
              file=sys.stderr, flush=True)
    return rows


def sweep_hours(rows: dict[str, Any], *, steps: int | None, settings: int, seeds: int, parallel: int,
                seconds_key: str = "seconds_per_step") -> float:
    """Hours for every encoding in rows x settings x seeds at `steps` each (each row's run_steps when None), `parallel`
    runs at a time (the runs spread evenly)."""
    total = sum(row[seconds_key] * (steps or row["run_steps"]) for row in rows.values())
    return total * settings * seeds / parallel / 3600


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--presets", default="cpu-medium,paper")
    parser.add_argument("--pes", default=",".join(PES))
    parser.add_argument("--steps", type=int, default=0, help="batches timed per encoding (0: 50 at cpu-medium, "
                        "6 at any other preset)")
    parser.add_argument("--sweep-steps", default="cpu-medium=20000",
                        help="preset=steps the sweep runs, where it is not the preset's run.steps")
    parser.add_argument("--settings", type=int, default=2, help="variable counts in the sweep (3 and 5)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time (one per core)")
    parser.add_argument("--gpu-peak-tflops", type=float, default=989.0, help="an H100 SXM's dense bf16 peak")
    parser.add_argument("--gpu-utilisation", type=float, default=0.25)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    pes = [pe for pe in args.pes.split(",") if pe]
    unknown = sorted(set(pes) - set(PES))
    if unknown:
        parser.error(f"--pes: unknown {unknown}; choose from {', '.join(PES)}")
    if args.worker:  # one preset, in the environment the parent set up; rows as JSON on stdout
        print(json.dumps(measure_preset(args.worker, pes, args.steps)))
        return
    sweep_steps = dict(item.split("=") for item in args.sweep_steps.split(",") if item)
    env = dict(os.environ, JAXPE_CPU_DEVICES="1", JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_multi_thread_eigen=false".strip())
    presets = {}
    for preset in [p for p in args.presets.split(",") if p]:
        steps = args.steps or (50 if preset == "cpu-medium" else 6)
        done = subprocess.run([sys.executable, __file__, "--out", args.out, "--pes", ",".join(pes),
                               "--steps", str(steps), "--worker", preset], env=env, check=True,
                              stdout=subprocess.PIPE, text=True)
        rows = json.loads(done.stdout.splitlines()[-1])
        gpu = args.gpu_peak_tflops * 1e12 * args.gpu_utilisation
        for row in rows.values():
            row["gpu_seconds_per_step_estimate"] = row["flops_per_step"] / gpu
        run_steps = int(sweep_steps[preset]) if preset in sweep_steps else None
        kw = dict(steps=run_steps, settings=args.settings, seeds=args.seeds, parallel=args.parallel)
        presets[preset] = {
            "encodings": rows, "steps_timed": steps, "sweep_steps": run_steps or next(iter(rows.values()))["run_steps"],
            "sweep_hours_cpu": sweep_hours(rows, **kw),
            "sweep_hours_gpu_estimate": sweep_hours(rows, **{**kw, "parallel": 1},
                                                    seconds_key="gpu_seconds_per_step_estimate"),
        }
    import jax
    import jaxlib

    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": {"backend": "cpu", "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                   "load_average": list(os.getloadavg())},
        "versions": {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__},
        "how": "one CPU device, one XLA thread per run; task counting, 3 variables",
        "sweep": {"settings": args.settings, "seeds": args.seeds, "parallel_cpu": args.parallel,
                  "gpu": {"peak_tflops": args.gpu_peak_tflops, "utilisation": args.gpu_utilisation,
                          "note": "an estimate from FLOPs, runs one after another on one GPU; not measured"}},
        "presets": presets,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    for preset, entry in presets.items():
        print(f"{preset}: sweep of {entry['sweep_steps']} steps: {entry['sweep_hours_cpu']:.1f} h on this CPU "
              f"({args.parallel} at a time), {entry['sweep_hours_gpu_estimate']:.2f} h on one GPU (estimate)")


if __name__ == "__main__":
    main()
