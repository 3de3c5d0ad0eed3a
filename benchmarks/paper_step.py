"""The paper preset's training step (or another --preset's), as the sweep runs it: ms per model-step, compile seconds.

For each encoding: the counting task at the `paper` preset (4 layers, width 256, batch 64, block 512), the seeds
stacked as one program (jaxpe.train.Trainer with seeds) and K steps a dispatch over the training set kept on the
device (jaxpe.train.feed), beside one model alone at K = 1 (the loop as it ran before: a host batch a step) and, with
--alone-at-k, one model at K (so that what stacking changes shows apart from what K does). glibc's malloc is set as
the entry points set it (jaxpe.train._malloc). Each
variant: its compile seconds (the first dispatch less a timed one), then the median of --repeats timed dispatches.
Reports ms per dispatch-step and per model-step (a step of S stacked models counts S model-steps), the ratio to the
single model, and with --profile DIR a jax.profiler trace of one dispatch of each variant (TensorBoard's profile
plugin or Perfetto reads it).

    python benchmarks/paper_step.py --out results/bench/paper_step_h200.json             # on a GPU, ~3 min
    python benchmarks/paper_step.py --quick --out FILE                                      # CPU, tiny sizes
    python benchmarks/paper_step.py --preset cpu-small --pe cope --dtype float32 --steps-per-dispatch 50 \
        --alone-at-k --out results/bench/paper_step_cpu_small.json                         # CPU, ~1 min
    python benchmarks/paper_step.py --preset cpu-small --pe cope --dtype float32 --steps-per-dispatch 50 \
        --alone-at-k --seeds-at-once 1,3 --set run.pad_to=block --out FILE       # stacked seeds in turn / side by side

Writes --out: device, versions, date, the config and every variant's figures.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
import time
from typing import Any

import jax
import numpy as np

from jaxpe.train import Trainer, _malloc, build_config, build_task
from jaxpe.train.config import build_model, longest_length
from jaxpe.train.feed import Feed

QUICK = ["task.seq_len=32", "task.max_steps=8", "task.n_train=256", "model.d_model=32", "model.num_layers=1",
         "model.num_heads=2", "optim.batch_size=8", "run.num_devices=1"]


def timed(fn: Any, repeats: int) -> tuple[float, list[float]]:
    """(seconds of the first call, seconds per step of each of `repeats` further calls); fn() returns what to wait
    for and the steps it ran."""
    start = time.perf_counter()
    jax.block_until_ready(fn()[0])
    first = time.perf_counter() - start
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        result, steps = fn()
        jax.block_until_ready(result)
        seconds.append((time.perf_counter() - start) / steps)
    return first, seconds


def variant(preset: str, pe: str, dtype: str, seeds: tuple[int, ...] | None, per_dispatch: int,
            overrides: list[str], repeats: int, profile: pathlib.Path | None) -> dict[str, Any]:
    """One encoding's step as one program of `seeds` (None: one model) at `per_dispatch` steps a dispatch."""
    config = build_config(preset=preset, task="counting", pe=pe,
                          overrides=[f"model.dtype={dtype}", f"run.steps_per_dispatch={per_dispatch}", *overrides])
    task = build_task(config)
    trainer = Trainer(model=build_model(config.model, task.vocab_size, longest_length(task)), config=config,
                      seq_len=task.seq_len, seeds=seeds)
    feed = Feed(trainer, task)
    state = [trainer.init_state()]
    position = [0]

    def dispatch() -> tuple[Any, int]:
        if per_dispatch == 1 and not feed.on_device:
            batch = trainer.put(trainer.pad(task.train_batch(position[0], config.optim.batch_size)))
            state[0], metrics = trainer.train_step(state[0], batch)
            steps = 1
        else:
            chunk = feed.steps(position[0], per_dispatch)
            state[0], metrics = trainer.train_steps(state[0], chunk.data, chunk.rows, np.int32(chunk.steps),
                                                    chunk.length)
            steps = chunk.steps
        position[0] += steps
        return metrics, steps

    first, seconds = timed(dispatch, repeats)
    if profile is not None:
        name = f"{pe}_{dtype}_{'x'.join(map(str, seeds or (0,)))}_{per_dispatch}_{config.run.seeds_at_once}"
        with jax.profiler.trace(str(profile / name)):
            jax.block_until_ready(dispatch()[0])
    median = statistics.median(seconds)
    members = trainer.members
    return {"pe": pe, "dtype": dtype, "members": members, "steps_per_dispatch": per_dispatch,
            "compile_s": round(first - median * per_dispatch, 2), "step_s": [round(s, 5) for s in seconds],
            "ms_per_step": round(1000 * median, 3), "ms_per_model_step": round(1000 * median / members, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pe", default="cope,relative,learned,corope")
    parser.add_argument("--dtype", default="float32,bfloat16")
    parser.add_argument("--seeds", type=int, default=3, help="models stacked in the program (default 3)")
    parser.add_argument("--steps-per-dispatch", type=int, default=100)
    parser.add_argument("--seeds-at-once", default="0",
                        help="run.seeds_at_once of the stacked variant, comma-separated for one variant each "
                             "(default 0: auto, one on a CPU, all on an accelerator)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--preset", default="paper", help="the training preset (default paper)")
    parser.add_argument("--alone-at-k", action="store_true",
                        help="also time one model at K steps a dispatch (what stacking alone changes)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a CPU")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every variant (e.g. run.pad_to=block: every batch at the full "
                             "block), repeatable")
    parser.add_argument("--profile", type=pathlib.Path, help="write a jax.profiler trace of each variant here")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    _malloc.keep_freed_memory()  # as jaxpe-train does: a step reuses the pages the last one freed
    overrides = [*(QUICK if args.quick else []), *args.set]
    per_dispatch = 4 if args.quick else args.steps_per_dispatch
    rows = []
    for pe in args.pe.split(","):
        for dtype in args.dtype.split(","):
            alone = variant(args.preset, pe, dtype, None, 1, overrides, args.repeats * 10, args.profile)
            alone_k = (variant(args.preset, pe, dtype, None, per_dispatch, overrides, args.repeats, args.profile)
                       if args.alone_at_k else None)
            rows += [alone] + ([alone_k] if alone_k else [])
            line = f"{pe} {dtype}: alone {alone['ms_per_model_step']:.2f} ms"
            if alone_k:
                line += f", alone at K {alone_k['ms_per_model_step']:.2f} ms"
            for at_once in args.seeds_at_once.split(","):
                stacked = variant(args.preset, pe, dtype, tuple(range(args.seeds)), per_dispatch,
                                  [*overrides, f"run.seeds_at_once={at_once}"], args.repeats, args.profile)
                stacked["seeds_at_once"] = int(at_once)
                stacked["model_step_vs_alone"] = round(stacked["ms_per_model_step"] / alone["ms_per_model_step"], 3)
                if alone_k:
                    stacked["model_step_vs_alone_at_k"] = round(stacked["ms_per_model_step"]
                                                                / alone_k["ms_per_model_step"], 3)
                rows.append(stacked)
                line += (f", {args.seeds} stacked ({at_once} at once) {stacked['ms_per_model_step']:.2f} ms per "
                         f"model-step (compile {stacked['compile_s']:.0f} s)")
            print(line, flush=True)
    device = jax.devices()[0]
    result = {"benchmark": "benchmarks/paper_step.py", "preset": args.preset, "quick": args.quick,
              "overrides": overrides, "rows": rows,
              "environment": {"device": f"{device.platform}:{device.device_kind}", "jax": jax.__version__,
                              "python": platform.python_version(), "numpy": np.__version__,
                              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
