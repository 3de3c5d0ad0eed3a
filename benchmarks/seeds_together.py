"""Three seeds as one program against three separate runs: whole commands, side by side.

Every side trains CoPE on counting (cpu-small) for seeds 0, 1 and 2 in fresh workdirs and fresh subprocesses
(compilation included, as a user pays it): "together", `jaxpe-compare --seeds 0,1,2` with the seeds stacked and
vmapped through one step and run.steps_per_dispatch steps a dispatch (the training set on the device); "separate",
the same command with --separate-seeds and one step a dispatch (the runs one after another in one process, as
jaxpe-compare trained them before); "processes", three `jaxpe-train` commands one after another, run.seed 0, 1, 2 (what
a user without jaxpe-compare runs). Rounds alternate the sides, so a change of load hits all; the ratios of the
medians are the figures (these machines are noisy). Also reports how close the sides' results are (test and len_x2
answer error, each seed).

    python benchmarks/seeds_together.py --out results/bench/seeds_together_cpu.json            # ~10 min, 2 cores
    python benchmarks/seeds_together.py --rounds 1 --steps 100 --out FILE                     # quicker

Writes --out: device, versions, date, the commands, each round's seconds, medians and the ratios of together to
separate and to processes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

SEEDS = "0,1,2"
SIDES = ("separate", "together", "processes")
SPLITS = ("test", "len_x2")


def commands(workdir: pathlib.Path, pe: str, steps: int, side: str, per_dispatch: int) -> list[list[str]]:
    """The command lines of one side (SIDES): one jaxpe-compare, or a jaxpe-train per seed (workdir/seedN)."""
    task = ["--task", "counting", "--pe", pe, "--preset", "cpu-small"]
    overrides = [f"run.steps={steps}", "run.progress=false", "run.tensorboard=false"]
    if side == "processes":
        main = "import sys; from jaxpe.train.cli import train_main; sys.exit(train_main(sys.argv[1:]))"
        return [[sys.executable, "-c", main, *task, "--workdir", str(workdir / f"seed{seed}"), *overrides,
                 f"run.seed={seed}"] for seed in SEEDS.split(",")]
    main = "import sys; from jaxpe.train.cli import compare_main; sys.exit(compare_main(sys.argv[1:]))"
    side_options = ["--separate-seeds"] if side == "separate" else [f"run.steps_per_dispatch={per_dispatch}"]
    return [[sys.executable, "-c", main, *task, "--seeds", SEEDS, "--workdir", str(workdir), *side_options,
             *overrides]]


def run_side(pe: str, steps: int, side: str, per_dispatch: int) -> tuple[float, dict[str, dict[str, float]]]:
    """Seconds of one side's whole commands in a fresh workdir, and each seed's answer error (%) per split."""
    with tempfile.TemporaryDirectory(prefix="seeds-") as tmp:
        workdir = pathlib.Path(tmp) / "runs"
        start = time.perf_counter()
        for line in commands(workdir, pe, steps, side, per_dispatch):
            subprocess.run(line, check=True, capture_output=True,
                           env={**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[1])})
        seconds = time.perf_counter() - start
        if side == "processes":
            runs = [json.loads((workdir / f"seed{seed}" / "result.json").read_text(encoding="utf-8"))
                    for seed in SEEDS.split(",")]
        else:
            runs = json.loads((workdir / "compare.json").read_text(encoding="utf-8"))["runs"]
        return seconds, {f"seed{r['seed']}": {split: round(100 * r["splits"][split]["seq_error"], 2)
                                              for split in SPLITS} for r in runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pe", default="cope", help="encoding (default cope)")
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps (cpu-small's 500 by default)")
    parser.add_argument("--steps-per-dispatch", type=int, default=50, help="the together side's (default 50)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every side, alternating (default 2)")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    errors: dict[str, dict] = {}
    for _ in range(args.rounds):
        for side in SIDES:
            took, errors[side] = run_side(args.pe, args.steps, side, args.steps_per_dispatch)
            seconds[side].append(took)
            print(f"{side}: {took:.1f} s", flush=True)
    medians = {side: statistics.median(values) for side, values in seconds.items()}
    import jax  # here: the sides ran in their own processes

    result = {
        "benchmark": "benchmarks/seeds_together.py", "pe": args.pe, "task": "counting", "preset": "cpu-small",
        "seeds": SEEDS, "steps": args.steps, "steps_per_dispatch": args.steps_per_dispatch,
        "commands": {side: [" ".join(line[3:]) for line in commands(pathlib.Path("WORKDIR"), args.pe, args.steps,
                                                                    side, args.steps_per_dispatch)]
                     for side in SIDES},
        "seconds": seconds, "median_s": medians,
        "ratio_together_over_separate": medians["together"] / medians["separate"],
        "ratio_together_over_processes": medians["together"] / medians["processes"],
        "answer_error_pct": errors,
        "environment": {"device": f"{jax.devices()[0].platform}:{jax.devices()[0].device_kind}",
                        "cores": os.cpu_count(), "jax": jax.__version__, "python": platform.python_version(),
                        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"together / separate: {result['ratio_together_over_separate']:.2f}, together / processes: "
          f"{result['ratio_together_over_processes']:.2f} (medians {medians})")


if __name__ == "__main__":
    main()
