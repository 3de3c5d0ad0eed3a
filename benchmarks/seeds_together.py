"""Three seeds as one program against three separate runs: jaxpe-compare, whole commands, side by side.

Both sides run `jaxpe-compare --task counting --pe PE --seeds 0,1,2 --preset cpu-small` in a fresh workdir and a fresh
subprocess (compilation included, as a user pays it): "separate" with --separate-seeds and one step a dispatch (the
runs one after another, as jaxpe trained them before), "together" with the seeds stacked and vmapped through one
step and run.steps_per_dispatch steps a dispatch (the training set on the device). Rounds alternate the sides, so a
change of load hits both; the ratio of the medians is the figure (these machines are noisy). Also reports how close
the two sides' results are (test and len_x2 answer error, each seed).

    python benchmarks/seeds_together.py --out results/bench/seeds_together_cpu.json            # ~10 min, 2 cores
    python benchmarks/seeds_together.py --rounds 1 --steps 100 --out FILE                     # quicker

Writes --out: device, versions, date, the commands, each round's seconds, medians and the ratio together / separate.
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


def command(workdir: pathlib.Path, pe: str, steps: int, together: bool, per_dispatch: int) -> list[str]:
    """The jaxpe-compare command line of one side."""
    main = "import sys; from jaxpe.train.cli import compare_main; sys.exit(compare_main(sys.argv[1:]))"
    side = [f"run.steps_per_dispatch={per_dispatch}"] if together else ["--separate-seeds"]
    return [sys.executable, "-c", main, "--task", "counting", "--pe", pe, "--seeds", SEEDS, "--preset", "cpu-small",
            "--workdir", str(workdir), f"run.steps={steps}", "run.progress=false", "run.tensorboard=false", *side]


def run_side(pe: str, steps: int, together: bool, per_dispatch: int) -> tuple[float, dict]:
    """Seconds of one whole command in a fresh workdir, and its compare.json."""
    with tempfile.TemporaryDirectory(prefix="seeds-") as tmp:
        workdir = pathlib.Path(tmp) / "cmp"
        start = time.perf_counter()
        subprocess.run(command(workdir, pe, steps, together, per_dispatch), check=True, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[1])})
        seconds = time.perf_counter() - start
        return seconds, json.loads((workdir / "compare.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pe", default="cope", help="encoding (default cope)")
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps (cpu-small's 500 by default)")
    parser.add_argument("--steps-per-dispatch", type=int, default=50, help="the together side's (default 50)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both sides, alternating (default 2)")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {"separate": [], "together": []}
    errors: dict[str, dict] = {}
    for _ in range(args.rounds):
        for side in ("separate", "together"):
            took, comparison = run_side(args.pe, args.steps, side == "together", args.steps_per_dispatch)
            seconds[side].append(took)
            errors[side] = {f"seed{r['seed']}": {split: round(100 * r["splits"][split]["seq_error"], 2)
                                                 for split in ("test", "len_x2")} for r in comparison["runs"]}
            print(f"{side}: {took:.1f} s", flush=True)
    medians = {side: statistics.median(values) for side, values in seconds.items()}
    import jax  # here: the sides ran in their own processes

    result = {
        "benchmark": "benchmarks/seeds_together.py", "pe": args.pe, "task": "counting", "preset": "cpu-small",
        "seeds": SEEDS, "steps": args.steps, "steps_per_dispatch": args.steps_per_dispatch,
        "commands": {side: " ".join(command(pathlib.Path("WORKDIR"), args.pe, args.steps, side == "together",
                                            args.steps_per_dispatch)[3:]) for side in seconds},
        "seconds": seconds, "median_s": medians, "ratio_together_over_separate": medians["together"] / medians["separate"],
        "answer_error_pct": errors,
        "environment": {"device": f"{jax.devices()[0].platform}:{jax.devices()[0].device_kind}",
                        "cores": os.cpu_count(), "jax": jax.__version__, "python": platform.python_version(),
                        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"together / separate: {result['ratio_together_over_separate']:.2f} (medians {medians})")


if __name__ == "__main__":
    main()
