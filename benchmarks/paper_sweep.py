"""The CoPE paper's Table 3 (counting; Golovneva et al., arXiv 2405.18719) at its scale, in resumable slices.

A cell is one (variables, encoding): its seeds train as one program (jaxpe.train.experiments.compare_encodings,
seeds stacked, run.steps_per_dispatch steps a dispatch, the training set on the device), in
DEST/counting_<n>var/<pe>/seed<s>/ as jaxpe-compare lays runs out. The sweep first prints its plan (each cell: done,
cut at a step, or to do; the estimated minutes; how many calls of --time-limit the rest takes), then runs cells in
order (3 variables first) while the time left allows: a cell is started only when its estimate fits (the first of a
call always starts), and one that overruns stops at the end of a dispatch with a checkpoint (exit status 3). Called
again on the same DEST it goes on where it stopped: runs finished with the same config (their result.json) are never
redone, a cut cell resumes from its checkpoints; a run finished with other overrides is a cell to do (another
run.steps: trained from its last kept checkpoint, or afresh) or refused (another model, task, optimizer or seed), as
jaxpe-compare does.

DEST keeps what matters and little else: each run's config.json, metrics.jsonl, result.json/md; each variable
count's compare.json/md; sweep.json (the plan, every finished cell's measured seconds, compile seconds and
seconds per step, the device, versions and date). A finished run's checkpoints are deleted (--keep-checkpoints keeps
them); a cut cell's stay, and are what resuming needs.

    benchmarks/paper_sweep_gpu.sh DEST                    # on one GPU: as much of the table as 9 minutes allow
    benchmarks/paper_sweep_gpu.sh --dry-run DEST          # on CPU at a tiny scale: the same steps, in CI
    python benchmarks/paper_sweep.py DEST --plan-only      # print the plan and exit
    python benchmarks/paper_sweep.py run.steps=800 DEST    # key=value overrides anywhere: DEST is the word without '='

Exit status: 0 when the whole table is done, 3 when time ran out first (run again), 2 for bad arguments or a config
the task refuses (one line on stderr).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import pathlib
import shutil
import sys
import time
from typing import Any

import jax
import jax.monitoring

from jaxpe.train import TimeLimitReached, build_config, compare_encodings
from jaxpe.train.cli import int_list, pe_list, refuse_seed_override, seconds, seed_list
from jaxpe.train.config import MAX_SEED, TrainConfig, build_task, resolve_task
from jaxpe.train.tasks.base import Task, json_object
from jaxpe.train.experiments import finished_result, latest_checkpoint_step, seed_config
from jaxpe.train.workdir import write_json

NVARS = (3, 1, 5)  # the paper's columns, the 3-variable one first (its headline)
PES = ("cope", "relative", "learned")  # the paper's rows: CoPE, relative, absolute
SEEDS = (0, 1, 2)
PAPER = ["run.steps_per_dispatch=100", "run.eval_every=1600", "run.checkpoint_every=1600", "run.keep=1",
         "run.eval_splits=valid", "run.tensorboard=false", "run.progress=false"]
# A few runs of a few steps on CPU: every step of the sweep, in seconds.
DRY_RUN = ["task.seq_len=24", "task.max_steps=5", "task.n_train=64", "task.n_valid=16", "task.n_test=16",
           "model.d_model=16", "model.num_layers=1", "model.num_heads=2", "optim.batch_size=8",
           "optim.warmup_steps=2", "run.steps=6", "run.log_every=2", "run.eval_every=0", "run.checkpoint_every=2",
           "run.steps_per_dispatch=2", "run.eval_batch_size=16", "run.keep=1", "run.tensorboard=false",
           "run.progress=false", "run.num_devices=1"]
# Seconds per step of 3 stacked seeds at the paper preset, before this DEST measured any: an H200 at jax 0.11.2,
# from one run at a time (jaxpe-train, 19 ms a step for CoPE, ~17 for the others) with the three seeds' steps
# costing 1.5x one step when stacked (the GPU was mostly idle). Measured cells replace them (sweep.json).
GUESS_S_PER_STEP = {"cope": 0.030, "relative": 0.026, "learned": 0.026}
SETUP_S = 90.0  # data generation, compilation and evaluations of one cell, before it is measured
CALL_S = 540.0  # one call of the device's 10-minute limit, less the machine's own start


@dataclasses.dataclass
class Cell:
    nvars: int
    pe: str
    config: TrainConfig
    dest: pathlib.Path  # DEST/counting_<n>var
    tasks: dict[int, Task]  # every cell's, by variable count: built once, when a cell's result.json is checked

    @property
    def name(self) -> str:
        return f"{self.nvars}var/{self.pe}"

    def run_dirs(self, seeds: tuple[int, ...]) -> list[pathlib.Path]:
        return [self.dest / self.pe / f"seed{s}" for s in seeds]

    def task(self) -> Task:
        """The cell's task, built on first need and shared by the cells of its variable count."""
        if self.nvars not in self.tasks:
            self.tasks[self.nvars] = build_task(self.config)
        return self.tasks[self.nvars]

    def state(self, seeds: tuple[int, ...]) -> tuple[str, int]:
        """("done" | "cut" | "todo", the step its seeds reached). Done when every seed's result.json is a run that
        finished with this cell's config, as compare_encodings reuses it; a result of other overrides (run.steps,
        optim.learning_rate, ...) is not, and compare_encodings trains or refuses that run when the cell's turn comes.
        """
        dirs = self.run_dirs(seeds)
        if all((d / "result.json").is_file() for d in dirs) and all(
                finished_result(d, seed_config(self.config, s), self.task()) is not None for d, s in zip(dirs, seeds)):
            return "done", self.config.run.steps
        steps = [latest_checkpoint_step(d) or 0 for d in dirs]
        return ("cut", min(steps)) if any(steps) else ("todo", 0)


def cells(dest: pathlib.Path, nvars: tuple[int, ...], pes: tuple[str, ...], overrides: list[str]) -> list[Cell]:
    """One cell per (variables, encoding), its config checked down to the task's options (ValueError, TypeError)."""
    tasks: dict[int, Task] = {}
    todo = [Cell(n, pe, build_config(preset="paper", task="counting", pe=pe,
                                     overrides=[f"task.nvars={n}", *overrides]), dest / f"counting_{n}var", tasks)
            for n in nvars for pe in pes]
    for cell in todo:
        resolve_task(cell.config.task)
    return todo


def estimate_s(cell: Cell, from_step: int, measured: dict[str, Any], dry_run: bool) -> float:
    """Seconds to finish `cell` from `from_step`: the DEST's own measurement of this encoding if any, else the
    guess above (the dry run: none, so that every cell starts and a short --time-limit cuts it)."""
    if dry_run:
        return 0.0
    seen = measured.get(cell.pe)
    per_step = seen["s_per_step"] if seen else GUESS_S_PER_STEP.get(cell.pe, 0.05)
    setup = seen["setup_s"] if seen else SETUP_S
    return setup + per_step * (cell.config.run.steps - from_step)


def seconds_per_step(cell: Cell, seeds: tuple[int, ...], *, since: int) -> float | None:
    """Seconds per step of the cell's seeds trained as one program past step `since` (this call's training), from
    their metrics.jsonl: each train record covers the steps since the one before it, in its tokens over its
    tokens_per_s; the first record past `since` is left out (its interval holds the compilation). None with fewer
    than two such records."""
    tokens_per_step = cell.config.optim.batch_size * cell.config.task.options.get("seq_len", 512)
    seconds, steps = 0.0, 0
    for run_dir in cell.run_dirs(seeds):
        lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
        records = [r for r in map(json.loads, lines) if r["split"] == "train" and r["step"] > since]
        for before, record in zip(records, records[1:]):
            seconds += tokens_per_step * (record["step"] - before["step"]) / record["tokens_per_s"]
            steps += record["step"] - before["step"]
    return seconds / steps if steps else None


def compile_seconds() -> list[float]:
    """A running total of XLA compile seconds in this process (jax.monitoring's backend-compile events)."""
    total = [0.0]

    def listen(event: str, seconds: float, **_: Any) -> None:
        if event.endswith("backend_compile_duration"):
            total[0] += seconds

    jax.monitoring.register_event_duration_secs_listener(listen)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paper_sweep.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", metavar="DEST", help="the sweep's directory (made if absent; reused to resume): the "
                        "one word that is neither a flag nor key=value, before or after the overrides")
    parser.add_argument("--dry-run", action="store_true", help="a tiny scale on CPU: a few runs of a few steps")
    parser.add_argument("--time-limit", type=seconds, default=CALL_S,
                        help=f"seconds for this call, > 0 (default {CALL_S:.0f})")
    parser.add_argument("--nvars", type=functools.partial(int_list, minimum=1), default=",".join(map(str, NVARS)),
                        help="variable counts >= 1, in order, each once (default 3,1,5)")
    parser.add_argument("--pe", type=pe_list, default=",".join(PES), help="encodings (default cope,relative,learned)")
    parser.add_argument("--seeds", type=seed_list, default=",".join(map(str, SEEDS)),
                        help=f"seeds, 0 to {MAX_SEED}, each once (default 0,1,2)")
    parser.add_argument("--plan-only", action="store_true", help="print the plan and exit")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep finished runs' checkpoints")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides on top, anywhere among DEST and the flags")
    args = parser.parse_intermixed_args(argv)
    start = time.time()
    nvars, seeds = tuple(args.nvars), tuple(args.seeds)
    dest, given = _dest_and_overrides(parser, [args.dest, *args.overrides])
    refuse_seed_override(parser, given)
    if dest.exists() and not dest.is_dir():
        parser.error(f"DEST {str(dest)!r} exists and is not a directory")
    overrides = [*(DRY_RUN if args.dry_run else PAPER), *given]
    try:
        todo = cells(dest, nvars, tuple(args.pe), overrides)
        record_path = dest / "sweep.json"
        record = (json_object(record_path.read_text(encoding="utf-8"), str(record_path)) if record_path.is_file()
                  else {"cells": {}, "measured": {}})
        states = [cell.state(seeds) for cell in todo]  # builds the task of a cell with results, which may refuse it
    except (TypeError, ValueError) as error:  # a config value of the wrong type (task options raise TypeError)
        parser.error(str(error))

    plan, left = [], 0.0
    for cell, (state, step) in zip(todo, states):
        minutes = 0.0 if state == "done" else estimate_s(cell, step, record["measured"], args.dry_run) / 60
        left += minutes
        plan.append({"cell": cell.name, "state": state, "step": step, "estimated_min": round(minutes, 1)})
    calls = math.ceil(left * 60 / CALL_S) if left else 0
    print(f"paper sweep in {dest} ({'dry run, CPU' if args.dry_run else jax.devices()[0].device_kind}): "
          f"{len(todo)} cells x {len(seeds)} seeds")
    for row in plan:
        print(f"  {row['cell']:<16} {row['state']:<4} step {row['step']:>6}  ~{row['estimated_min']:.1f} min")
    print(f"  left: ~{left:.0f} min, {calls} call(s) of {CALL_S / 60:.0f} min; this call: {args.time_limit:.0f} s",
          flush=True)
    record["plan"] = plan
    if args.plan_only:
        return 0

    compiled = compile_seconds()
    dest.mkdir(parents=True, exist_ok=True)
    ran = False  # the first cell of a call always starts: a cell longer than a call is cut, and resumed next call
    for cell in todo:
        state, step = cell.state(seeds)
        if state == "done":
            continue
        remaining = args.time_limit - (time.time() - start)
        estimate = estimate_s(cell, step, record["measured"], args.dry_run)
        if estimate > remaining and state == "todo" and ran and not args.dry_run:
            print(f"{cell.name}: ~{estimate / 60:.1f} min does not fit the {remaining / 60:.1f} min left; stopping")
            _write(record_path, record)
            return 3
        began, compile_before, ran = time.time(), compiled[0], True
        try:
            compare_encodings([cell.config], seeds, cell.dest, time_limit=max(remaining, 1.0))
        except TimeLimitReached as stop:
            print(f"{cell.name}: time limit reached at step {stop.step} (checkpointed); run again to resume")
            _write(record_path, record)
            return 3
        except ValueError as error:  # a config the task or its data refuse (compare_encodings checks before training)
            print(f"{parser.prog}: error: {cell.name}: {error}", file=sys.stderr)
            _write(record_path, record)
            return 2
        took, compile_s = time.time() - began, compiled[0] - compile_before
        steps_run = cell.config.run.steps - step
        measured = seconds_per_step(cell, seeds, since=step)
        s_per_step = measured if measured is not None else max(took - compile_s, 0.0) / max(steps_run, 1)
        record["cells"][cell.name] = {"seconds": round(took, 1), "compile_s": round(compile_s, 1),
                                      "steps": steps_run, "s_per_step_3_seeds": round(s_per_step, 5),
                                      "ms_per_model_step": round(1000 * s_per_step / len(seeds), 3)}
        record["measured"][cell.pe] = {"s_per_step": s_per_step, "setup_s": max(took - s_per_step * steps_run, 0.0)}
        print(f"{cell.name}: {took:.0f} s ({compile_s:.0f} s compiling), "
              f"{1000 * s_per_step / len(seeds):.2f} ms per model-step", flush=True)
        if not args.keep_checkpoints:
            for run_dir in cell.run_dirs(seeds):
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        _write(record_path, record)
    for n in nvars:  # a variable count whose cells are all done: its compare.json over every encoding
        done = [cell for cell in todo if cell.nvars == n]
        if all(cell.state(seeds)[0] == "done" for cell in done):
            compare_encodings([cell.config for cell in done], seeds, done[0].dest)
    return 0


def _dest_and_overrides(parser: argparse.ArgumentParser, words: list[str]) -> tuple[pathlib.Path, list[str]]:
    """DEST and the key=value overrides from the positional words, in any order: argparse gives DEST the first, an
    override too when it comes first; here a word with '=' is always an override. A usage error (exit 2) unless
    exactly one word is DEST, and it is not empty."""
    dests = [word for word in words if "=" not in word]
    if len(dests) != 1:
        got = f"got {', '.join(map(repr, dests))}" if dests else "got only key=value overrides"
        parser.error(f"give one DEST, the sweep's directory, beside the key=value overrides ({got})")
    if not dests[0].strip():
        parser.error(f"DEST {dests[0]!r} names no directory; give a path (. for the current directory)")
    return pathlib.Path(dests[0]), [word for word in words if "=" in word]


def _write(path: pathlib.Path, record: dict[str, Any]) -> None:
    """sweep.json with where and when it ran."""
    device = jax.devices()[0]
    record["environment"] = {"device": f"{device.platform}:{device.device_kind}", "jax": jax.__version__,
                             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, record)


if __name__ == "__main__":
    sys.exit(main())
