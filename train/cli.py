"""Command-line entry points: jaxpe-train, jaxpe-eval, jaxpe-compare.

  jaxpe-train --task flipflop --pe cope --preset cpu-small --workdir runs/ff model.num_layers=2
  jaxpe-train --config runs/ff/config.json --workdir runs/ff-seed1 run.seed=1   # rerun a saved run, changed
  jaxpe-train --preset cpu-small --pe cope --show-config                        # the resolved config; no run
  jaxpe-eval --workdir runs/ff
  jaxpe-compare --task flipflop --pe cope,rope,learned --seeds 0,1 --preset cpu-small --workdir runs/cmp

Each parses its flags and calls one function of jaxpe.train.experiments. A workdir that already holds
checkpoints resumes; a workdir holds one run (jaxpe.train.workdir). A failure is one line on stderr, `<prog>: error:
...`: exit status 2 for a bad config, data or workdir (or one too large for the memory), 1 for a busy workdir, a NaN
loss, a full disk or a permission problem; 3 when --time-limit stopped training (checkpointed: the same command
resumes); Ctrl-C exits 130. --debug shows the traceback. Multi-host: see jaxpe.train.distributed.initialize (TPU
pods, Slurm, Open MPI and $JAX_COORDINATOR_ADDRESS are detected; --coordinator/--num-processes/--process-id or
$JAXPE_COORDINATOR, $JAXPE_NUM_PROCESSES, $JAXPE_PROCESS_ID set it explicitly). Only these entry points make the
process-wide settings (a stderr handler added to the root logger's own, host CPU devices, glibc's malloc settings of
jaxpe.train._malloc).
"""
from __future__ import annotations

import argparse
import errno
import logging
import os
import pathlib
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

import jax

from jaxpe import PE_NAMES
from jaxpe.train import _malloc, distributed, experiments
from jaxpe.train.config import (MAX_SEED, TrainConfig, build_config, format_config, load_config, preset_names,
                                resolve_task)
from jaxpe.train.loop import NonFiniteLossError, TimeLimitReached, TrainingInterrupted
from jaxpe.train.tables import comparison_heading, results_markdown, show
from jaxpe.train.tasks import TASK_NAMES
from jaxpe.train.workdir import WorkdirBusyError

PRECEDENCE = ("config precedence, later wins: the defaults (or the saved run of --config), --preset, --task and --pe "
              "(a task or encoding other than the one already set starts from its own default options, then the "
              "preset's options for it), key=value overrides")
RUN_OUTPUTS = ("config.json", "corpus.json", "metrics.jsonl", "result.json", "result.md", "result.png", "checkpoints/",
               "tb/")


def _config_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=PRECEDENCE)
    parser.add_argument("--task", choices=TASK_NAMES, metavar="TASK", help=f"task: {', '.join(TASK_NAMES)}")
    parser.add_argument("--preset", type=path_arg, metavar="NAME|FILE", help=f"preset: {', '.join(preset_names())}; "
                        "or a path to a JSON preset file (one that ends in .json or exists)")
    parser.add_argument("--config", type=path_arg, metavar="FILE", help="start from a run's saved config.json "
                        "(reruns it; --preset, --task, --pe and key=value apply on top)")
    parser.add_argument("--workdir", type=directory,
                        help="directory for checkpoints, metrics and results (not with --show-config)")
    parser.add_argument("--show-config", action="store_true",
                        help="print the resolved config (every key, with its comment) and exit without training")
    parser.add_argument("--time-limit", type=seconds, metavar="SECONDS",
                        help="stop training after this many seconds, at the end of a dispatch, with a checkpoint of "
                             "that step; exit status 3 (rerun the same command to go on)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, before, between or after the flags, e.g. model.num_layers=2 "
                             "task.nvars=3 model.pe_options.npos=32")
    _multihost_flags(parser)
    return parser


def _multihost_flags(parser: argparse.ArgumentParser) -> None:
    """--debug, and the multi-host flags (every entry point has both)."""
    parser.add_argument("--debug", action="store_true", help="on an error, show the Python traceback too")
    group = parser.add_argument_group("multi-host", "not needed on TPU pods, under Slurm (srun) or Open MPI (mpirun), "
                                      "or with $JAX_COORDINATOR_ADDRESS set: those are detected")
    group.add_argument("--coordinator", help="host:port of process 0 (env JAXPE_COORDINATOR)")
    group.add_argument("--num-processes", type=int, help="processes in the run (env JAXPE_NUM_PROCESSES)")
    group.add_argument("--process-id", type=int, help="this process's index (env JAXPE_PROCESS_ID)")


def pe_list(text: str) -> list[str]:
    """A --pe of several encodings (jaxpe-compare, benchmarks/paper_sweep.py): comma-separated names, each known and
    given once (argparse type: ArgumentTypeError says why)."""
    pes = [p for p in text.split(",") if p]
    unknown = [p for p in pes if p not in PE_NAMES]
    if not pes or unknown:
        raise argparse.ArgumentTypeError(f"unknown encoding(s) {unknown or text!r}; choose from {', '.join(PE_NAMES)}")
    _no_repeats(pes, text)
    return pes


def _no_repeats(values: Sequence[object], text: str) -> None:
    repeated = sorted({str(v) for v in values if values.count(v) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{text!r} repeats {', '.join(repeated)}: give each once")


def path_arg(text: str) -> str:
    """A path flag (argparse type): a leading ~ is the home directory, which a shell does not expand after a flag's
    '=' (--workdir=~/runs)."""
    return os.path.expanduser(text)


def directory(text: str) -> str:
    """A --workdir: a path (`path_arg`), not empty (an empty one would be the current directory; argparse type)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} names no directory; give a path (. for the current directory)")
    return path_arg(text)


def seconds(text: str) -> float:
    """A --time-limit: a number of seconds > 0 (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0 seconds")
    return value


def step_number(text: str) -> int:
    """A --step: a checkpoint's step, an integer >= 1 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1 (checkpoints are saved after a step)")
    return value


def int_list(text: str, *, minimum: int, maximum: int | None = None) -> list[int]:
    """Comma-separated integers in [minimum, maximum] (None: no upper bound), each given once (argparse type, through
    functools.partial): ASCII digits around each comma, no empty entry ("0,,1" is refused, not read as 0,1)."""
    parts = [s.strip() for s in text.split(",")]
    values = [int(s) for s in parts] if all(s.isascii() and s.isdigit() for s in parts) else []
    bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    if not values or any(v < minimum or maximum is not None and v > maximum for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated integers {bound}, e.g. "
                                         f"{minimum},{minimum + 1}")
    _no_repeats(values, text)
    return values


def seed_list(text: str) -> list[int]:
    """A --seeds (jaxpe-compare, benchmarks/paper_sweep.py): distinct run.seed values, 0 to MAX_SEED (argparse type)."""
    return int_list(text, minimum=0, maximum=MAX_SEED)


def _resolve(parser: argparse.ArgumentParser, args: argparse.Namespace, pes: Sequence[str | None]) -> list[TrainConfig]:
    """One config per encoding; a bad preset, config file or key=value is a usage error (exit 2). With
    --show-config, prints them and exits 0; otherwise --workdir is required."""
    try:
        saved = load_config(args.config) if args.config else None
        configs = [build_config(config=saved, preset=args.preset, task=args.task, pe=pe, overrides=args.overrides)
                   for pe in pes]
        for config in configs:
            resolve_task(config.task)  # the task's options (a wrong type is a TypeError) before any run starts
        shown = [format_config(c) for c in configs] if args.show_config else []
    except (TypeError, ValueError) as error:  # a config value of the wrong type (task options raise TypeError)
        if args.debug:
            raise
        parser.error(str(error))
    if args.show_config:
        for config, text in zip(configs, shown):
            heading = f"model.pe={config.model.pe}: " if len(configs) > 1 else ""
            show(f"# {heading}resolved config, one key=value override a line (precedence: see --help)\n{text}")
        parser.exit(0)
    if args.workdir is None:
        parser.error("the following arguments are required: --workdir")
    return configs


class _CurrentStderr(logging.StreamHandler):
    """A handler that writes to sys.stderr as it is at each record, not to the stream it was when the handler was
    made: once the command ends, a later capture of stderr (a notebook cell's, pytest's) gets the lines, and a closed
    earlier one is never written to."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)  # not StreamHandler's, which would set the stream once

    @property
    def stream(self) -> TextIO:
        return sys.stderr


def _is_bare_default(handler: logging.Handler) -> bool:
    """Whether `handler` is what a bare `logging.basicConfig()` makes: a plain StreamHandler in basicConfig's format
    on stderr. absl makes one on the root logger when it logs before logging is configured (orbax does, at import);
    beside _CurrentStderr it would print every line twice."""
    return (type(handler) is logging.StreamHandler and handler.stream not in (sys.stdout, sys.__stdout__)
            and getattr(handler.formatter, "_fmt", None) == logging.BASIC_FORMAT)


def _log_to_stderr() -> None:
    """jaxpe's INFO lines on stderr: a _CurrentStderr on the root logger, added once per process (however many
    commands run), beside the handlers a notebook or program set up before calling a command (kept: their files and
    streams get the lines too), in place of a bare basicConfig() handler (_is_bare_default). The root level stays as
    it is (WARNING by default: the libraries' INFO chatter stays off); the jaxpe loggers pass INFO."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if _is_bare_default(h)]:
        root.removeHandler(handler)
    if not any(isinstance(handler, _CurrentStderr) for handler in root.handlers):
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    logging.getLogger("jaxpe").setLevel(logging.INFO)


def _start(args: argparse.Namespace) -> None:
    """Logging (_log_to_stderr), then the multi-host setup."""
    _log_to_stderr()
    distributed.split_host_cpu()
    _malloc.keep_freed_memory()
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)


def _os_error(error: BaseException) -> OSError | None:
    """The OSError behind `error` (itself, or in its chain of causes), else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _guarded(parser: argparse.ArgumentParser, args: argparse.Namespace, body: Callable[[], int]) -> int:
    """Runs the command; a failure ends in one line on stderr (_failure; the traceback only with --debug)."""
    try:
        return body()
    except (Exception, KeyboardInterrupt) as error:
        status = None if args.debug else _failure(parser.prog, error)
        if status is None:
            raise
        return status


def _failure(prog: str, error: BaseException) -> int | None:
    """Prints the one line for a failure and returns the exit status: a bad config, data or workdir, or one too large
    for the memory or to store as an integer, `<prog>: error: ...` exit 2; a busy workdir, NaN loss, full disk or
    permission problem exit 1; the time limit exit 3; Ctrl-C exit 130. None for an unexpected error (its traceback is
    shown)."""
    if isinstance(error, TimeLimitReached):
        if error.checkpointed:
            print(f"{prog}: time limit reached: stopped at step {error.step} with a checkpoint; rerun the same "
                  "command to resume", file=sys.stderr)
        else:
            print(f"{prog}: time limit reached: stopped at step {error.step}; run.checkpoint_every=0 saved nothing "
                  "to resume from", file=sys.stderr)
        return 3
    if isinstance(error, KeyboardInterrupt):  # TrainingInterrupted too
        at = f" at step {error.step}" if isinstance(error, TrainingInterrupted) else ""
        print(f"{prog}: interrupted{at}; rerun the same command to resume", file=sys.stderr)
        return 130
    if isinstance(error, (WorkdirBusyError, NonFiniteLossError, ImportError)):
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, ImportError) else 1  # ImportError: an optional extra a setting needs (jaxpe[hf])
    if isinstance(error, (MemoryError, OverflowError)) or (not isinstance(error, ValueError)
                                                           and "RESOURCE_EXHAUSTED" in str(error)):
        return _report_memory(prog, error)  # RESOURCE_EXHAUSTED: XLA's out of memory
    if _os_error(error) is not None or "No space left on device" in str(error):
        return _report_os_error(prog, error)
    if isinstance(error, ValueError):
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    return None


def _report_memory(prog: str, error: BaseException) -> int:
    """One line for a config too large for this machine's memory, or for a NumPy or jax integer (an OverflowError;
    exit 2: a size in it must come down)."""
    what = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
    kind = "a setting too large to store as an integer" if isinstance(error, OverflowError) else "out of memory"
    print(f"{prog}: error: {kind} ({what}); lower the sizes of the config: optim.batch_size, "
          "run.eval_batch_size, task.seq_len, the task's set sizes or the model's (model.d_model, model.num_layers)",
          file=sys.stderr)
    return 2


def _report_os_error(prog: str, error: BaseException) -> int:
    """One line for a full disk or a permission problem (from orbax or TensorStore as well), naming the path."""
    os_error = _os_error(error)
    if os_error is not None:
        what = os_error.strerror or errno.errorcode.get(os_error.errno or 0, str(os_error))
        where = os_error.filename if os_error.filename else f"({str(error).splitlines()[0][:300]})"
        print(f"{prog}: error: {what}: {where}", file=sys.stderr)
    else:
        print(f"{prog}: error: no space left on device ({str(error).splitlines()[0][:300]})", file=sys.stderr)
    return 1


def _print_outputs(workdir: str | pathlib.Path, names: Sequence[str]) -> None:
    """Process 0's last line (stderr, after the table on stdout): where the outputs are; TensorBoard's command."""
    if jax.process_index() != 0:
        return
    workdir = pathlib.Path(workdir).absolute()
    present = [name for name in names if (workdir / name).exists()]
    line = f"outputs in {workdir}: {', '.join(present)}"
    if (workdir / "tb").is_dir() or any(workdir.glob("*/*/tb")):
        line += f" (tensorboard --logdir {shlex.quote(str(workdir))})"  # a command to paste: spaces quoted
    sys.stdout.flush()
    print(line, file=sys.stderr)


def train_main(argv: Sequence[str] | None = None) -> int:
    """jaxpe-train: one run; prints the result table and where the outputs are."""
    parser = _config_parser("jaxpe-train", "Train one model on one task (resumes from --workdir's checkpoints).")
    parser.add_argument("--pe", choices=PE_NAMES, metavar="PE", help=f"positional encoding: {', '.join(PE_NAMES)}")
    args = parser.parse_intermixed_args(argv)

    def body() -> int:
        [config] = _resolve(parser, args, [args.pe])
        _start(args)
        result = experiments.train_and_evaluate(config, args.workdir, time_limit=args.time_limit)
        show(results_markdown([result], metric=result["metric"], splits=list(result["splits"]),
                              label_keys=("task", "pe", "seed")))
        _print_outputs(args.workdir, RUN_OUTPUTS)
        return 0

    return _guarded(parser, args, body)


def eval_main(argv: Sequence[str] | None = None) -> int:
    """jaxpe-eval: evaluates a run's latest readable (or --step) checkpoint on every split."""
    parser = argparse.ArgumentParser(prog="jaxpe-eval",
                                     description="Evaluate a checkpoint on in-distribution, OOD and longer splits.")
    parser.add_argument("--workdir", type=directory, required=True, help="a jaxpe-train workdir")
    parser.add_argument("--step", type=step_number, help="checkpoint step (default: the latest readable one)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar over the evaluated sequences on stderr (default: the run's run.progress)")
    _multihost_flags(parser)
    args = parser.parse_args(argv)

    def body() -> int:
        _start(args)
        result = experiments.evaluate_checkpoint(args.workdir, step=args.step, progress=args.progress)
        show(result["table"])
        if result["unwritten"]:
            sys.stdout.flush()
            print(f"jaxpe-eval: {result['unwritten']}", file=sys.stderr)
        else:
            _print_outputs(args.workdir, ("eval.json", "eval.md"))
        return 0

    return _guarded(parser, args, body)


def refuse_seed_override(parser: argparse.ArgumentParser, overrides: Sequence[str]) -> None:
    """A usage error (exit 2) when `overrides` set run.seed: the runs of several seeds (--seeds) set each run's own,
    and compare_encodings would drop the override unseen."""
    given = [o for o in overrides if o.partition("=")[0].strip() == "run.seed"]
    if given:
        parser.error(f"{given[-1]!r}: {parser.prog} trains the seeds of --seeds (each run's run.seed); "
                     f"give --seeds {given[-1].partition('=')[2].strip() or 'N'} instead")


def compare_main(argv: Sequence[str] | None = None) -> int:
    """jaxpe-compare: several encodings x seeds -> one table (JSON, Markdown, PNG)."""
    parser = _config_parser("jaxpe-compare", "Train several encodings and seeds on one task and compare them.")
    parser.add_argument("--pe", type=pe_list, default="cope,rope,learned",
                        help=f"comma-separated encodings from: {', '.join(PE_NAMES)} (default: cope,rope,learned)")
    parser.add_argument("--seeds", type=seed_list, default="0",
                        help=f"comma-separated model seeds, 0 to {MAX_SEED} (default: 0)")
    parser.add_argument("--separate-seeds", action="store_true",
                        help="train an encoding's seeds one after another (default: as one program, their models "
                             "stacked and vmapped through one step)")
    args = parser.parse_intermixed_args(argv)

    def body() -> int:
        configs = _resolve(parser, args, args.pe)
        refuse_seed_override(parser, args.overrides)
        _start(args)
        comparison = experiments.compare_encodings(configs, args.seeds, args.workdir,
                                                   seeds_together=not args.separate_seeds, time_limit=args.time_limit)
        show(f"\n{comparison_heading(comparison['task'], comparison['metric'], args.seeds)}\n\n{comparison['table']}")
        _print_outputs(args.workdir, ("compare.json", "compare.md", "compare.png", *(f"{pe}/" for pe in args.pe)))
        return 0

    return _guarded(parser, args, body)
