"""Command-line entry points: jaxpe-train, jaxpe-eval, jaxpe-compare.

  jaxpe-train --task flipflop --pe cope --preset cpu-small --workdir runs/ff model.num_layers=2
  jaxpe-eval --workdir runs/ff
  jaxpe-compare --task flipflop --pe cope,rope,learned --seeds 0,1 --preset cpu-small --workdir runs/cmp

Each parses its flags and calls one function of jaxpe.train.loop. A workdir that already holds
checkpoints resumes. Multi-host: pass --coordinator/--num-processes/--process-id (or set
JAXPE_COORDINATOR, JAXPE_NUM_PROCESSES, JAXPE_PROCESS_ID) in every process.
"""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from jaxpe.train import distributed, evaluate, loop
from jaxpe.train.config import build_config, preset_names


def _config_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--task", help="task name (counting, flipflop, selective_copy, lm)")
    parser.add_argument("--preset", help=f"preset file in train/presets/: {', '.join(preset_names())}")
    parser.add_argument("--workdir", required=True, help="directory for checkpoints, metrics and results")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. model.num_layers=2 task.nvars=3 model.pe_options.npos=32")
    _multihost_flags(parser)
    return parser


def _multihost_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--coordinator", help="host:port of process 0 (multi-host; env JAXPE_COORDINATOR)")
    parser.add_argument("--num-processes", type=int, help="processes in the run (env JAXPE_NUM_PROCESSES)")
    parser.add_argument("--process-id", type=int, help="this process's index (env JAXPE_PROCESS_ID)")


def _start(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)


def train_main(argv: Sequence[str] | None = None) -> int:
    """jaxpe-train: one run; prints the result table."""
    parser = _config_parser("Train one model on one task (resumes from --workdir's checkpoints).")
    parser.add_argument("--pe", help="positional encoding (a jaxpe.PE_NAMES entry)")
    args = parser.parse_args(argv)
    try:
        config = build_config(preset=args.preset, task=args.task, pe=args.pe, overrides=args.overrides)
    except ValueError as error:
        parser.error(str(error))
    _start(args)
    try:
        result = loop.train_and_evaluate(config, args.workdir)
    except loop.NonFiniteLossError as error:
        print(f"jaxpe-train: {error}", file=sys.stderr)
        return 1
    print(evaluate.results_markdown([result], metric=result["metric"], splits=list(result["splits"]),
                                    label_keys=("task", "pe", "seed")), end="")
    return 0


def eval_main(argv: Sequence[str] | None = None) -> int:
    """jaxpe-eval: evaluates a run's latest (or --step) checkpoint on every split."""
    parser = argparse.ArgumentParser(description="Evaluate a checkpoint on in-distribution, OOD and longer splits.")
    parser.add_argument("--workdir", required=True, help="a jaxpe-train workdir")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    _multihost_flags(parser)
    args = parser.parse_args(argv)
    _start(args)
    try:
        result = loop.evaluate_checkpoint(args.workdir, step=args.step)
    except ValueError as error:
        parser.error(str(error))
    print(result["table"], end="")
    return 0


def compare_main(argv: Sequence[str] | None = None) -> int:
    """jaxpe-compare: several encodings x seeds -> one table (JSON, Markdown, PNG)."""
    parser = _config_parser("Train several encodings and seeds on one task and compare them.")
    parser.add_argument("--pe", default="cope,rope,learned", help="comma-separated encodings")
    parser.add_argument("--seeds", default="0", help="comma-separated model seeds")
    args = parser.parse_args(argv)
    try:
        pes = [p for p in args.pe.split(",") if p]
        configs = [build_config(preset=args.preset, task=args.task, pe=pe, overrides=args.overrides) for pe in pes]
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError as error:
        parser.error(str(error))
    _start(args)
    try:
        comparison = loop.compare_encodings(configs, seeds, args.workdir)
    except loop.NonFiniteLossError as error:
        print(f"jaxpe-compare: {error}", file=sys.stderr)
        return 1
    print(f"\n{comparison['task']}: {comparison['metric']} (%, lower is better), mean ± std over seeds {args.seeds}\n")
    print(comparison["table"], end="")
    return 0
