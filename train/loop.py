"""The training loop: a Trainer's steps over a task's batches, with periodic actions (hooks) between them.

After every step the loop runs the hooks that are due, in their order: `TrainLog` (the train metrics record and the
NaN/inf check), `Evaluation` (metrics of the evaluation splits), `Checkpointing` (an orbax save, ranked by the
evaluation of the same step). A hook is due after every step that is a multiple of one of its periods, and after the
last step. The metrics of the run go to `MetricsLog`: metrics.jsonl and TensorBoard event files.
"""
from __future__ import annotations

import json
import logging
import pathlib
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxpe.train import distributed
from jaxpe.train.checkpoint import Checkpoints
from jaxpe.train.config import RunConfig
from jaxpe.train.evaluate import metrics_from_sums
from jaxpe.train.step import Metrics, TrainState
from jaxpe.train.tasks import Split, Task
from jaxpe.train.tasks.base import scored_lengths
from jaxpe.train.trainer import Trainer

log = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient norm became NaN/inf; the run stopped."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during the loop; `step` is the last step completed."""

    def __init__(self, step: int):
        super().__init__(f"interrupted at step {step}")
        self.step = step


class MetricsLog:
    """The run's metrics in the workdir, written by process 0: metrics.jsonl, and TensorBoard event files in tb/ when
    `tensorboard` is set and tensorboardX is installed (scalars `<split>/<metric>`, e.g. train/loss, valid/token_error).

    On resume, records past the resume step are dropped: lines of metrics.jsonl, and TensorBoard events through
    the writer's purge_step (TensorBoard hides older events from that step on).
    """

    def __init__(self, workdir: pathlib.Path, *, resume_step: int, enabled: bool, tensorboard: bool):
        self.path, self.enabled = workdir / "metrics.jsonl", enabled
        if enabled and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if self._step(line) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.writer = None
        if enabled and tensorboard:
            self.writer = _tensorboard_writer(workdir / "tb", purge_step=resume_step + 1 if resume_step else None)

    @staticmethod
    def _step(line: str) -> float:
        """The record's step; a line cut short by a kill counts as past any resume point."""
        try:
            return json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            return float("inf")

    def write(self, record: Mapping[str, Any]) -> None:
        """One record {"step": int, "split": str, metric: number, ...}."""
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for name, value in record.items():
                if name not in ("step", "split") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(f"{record['split']}/{name}", value, global_step=record["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _tensorboard_writer(logdir: pathlib.Path, *, purge_step: int | None) -> Any:
    """A tensorboardX SummaryWriter, or None (with a note) when tensorboardX is not installed.

    Its event file name ends in the time in nanoseconds: tensorboardX names files by the second and opens them for
    writing, so a resume within the same second would otherwise overwrite the run it resumes; TensorBoard reads files
    in name order, so the resumed run's file (and its purge) still comes after.
    """
    try:
        from tensorboardX import SummaryWriter  # an optional extra (jaxpe[tensorboard]): absent is fine
    except ImportError:
        log.info("tensorboardX is not installed: no TensorBoard event files (pip install 'jaxpe[tensorboard]'); "
                 "metrics.jsonl has every metric")
        return None
    return SummaryWriter(str(logdir), purge_step=purge_step, filename_suffix=f".{time.time_ns():020d}")


def progress_bar(run: RunConfig, start: int, *, enabled: bool) -> Any:
    """A tqdm bar over the run's steps (None when run.progress is off or this is not process 0)."""
    if not (run.progress and enabled):
        return None
    from tqdm.auto import tqdm  # here, not at the top: in Jupyter without ipywidgets it warns as it is imported

    return tqdm(total=run.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)


class Hook:
    """A periodic action `hook(step, state)`: due after every step that is a multiple of one of `periods` (0: none)
    and after the last step."""

    periods: tuple[int, ...] = ()

    def due(self, step: int, last_step: int) -> bool:
        return step == last_step or any(period and step % period == 0 for period in self.periods)

    def __call__(self, step: int, state: TrainState) -> None:
        raise NotImplementedError


class Evaluation(Hook):
    """Metrics of the evaluation splits written to the log: `splits` of all_splits (() = all), all at the last step.

    `results` and `step` are the latest evaluation's; `best_metric(step)` ranks a checkpoint of that step.
    """

    def __init__(self, trainer: Trainer, all_splits: Mapping[str, Split], splits: Sequence[str],
                 metrics_log: MetricsLog, *, every: int, metric: str, best_split: str):
        self.trainer, self.metrics_log, self.metric, self.best_split = trainer, metrics_log, metric, best_split
        self.all_splits = all_splits
        self.splits = {k: v for k, v in all_splits.items() if not splits or k in splits}
        self.periods, self.last_step = (every,), trainer.config.run.steps
        self.results: dict[str, dict[str, float]] = {}
        self.step: int | None = None

    def __call__(self, step: int, state: TrainState) -> None:
        splits = self.all_splits if step == self.last_step else self.splits
        self.results, self.step = self.trainer.evaluate(state.params, splits), step
        for name, values in self.results.items():
            self.metrics_log.write({"step": step, "split": name, **values})

    def best_metric(self, step: int) -> dict[str, float] | None:
        """{"<best split>/<metric>": value} when this step was evaluated on the best split, else None."""
        if self.step != step or self.best_split not in self.results:
            return None
        return {f"{self.best_split}/{self.metric}": self.results[self.best_split][self.metric]}


class Checkpointing(Hook):
    """Saves the state every `every` steps, ranked by the evaluation of the same step; `last_saved` is the newest
    good checkpoint's step (the resumed one at first). `config` (the run's, as a dict) goes into every checkpoint's
    meta, so that a reader can tell which run wrote it."""

    def __init__(self, checkpoints: Checkpoints, evaluation: Evaluation, *, every: int, last_saved: int | None,
                 config: Mapping[str, Any] | None = None):
        self.checkpoints, self.evaluation, self.periods, self.last_saved = checkpoints, evaluation, (every,), last_saved
        self.config = config

    def __call__(self, step: int, state: TrainState) -> None:
        meta = {"step": step, "data_position": step, **({"config": self.config} if self.config is not None else {})}
        self.checkpoints.save(step, state, meta, self.evaluation.best_metric(step))
        self.last_saved = step

    def last_good(self) -> str:
        """Where the newest good checkpoint is, in words."""
        where = self.checkpoints.directory
        return "none" if self.last_saved is None else f"step {self.last_saved} in {where}"


class TrainLog(Hook):
    """The train record (mean loss, accuracy and throughput since the last record) and the NaN/inf check.

    Due every `log_every` steps and at every checkpoint step (a NaN state is never saved). `add` collects each
    step's metrics on device; a record syncs them to the host once. Throughput: `tokens_per_s`, the tokens of the
    batches as computed (B × padded length), and `real_tokens_per_s`, those up to each sequence's end (its last
    scored token: padding left out). `tokens_per_step` counts a step that `add` is not told its tokens.
    """

    def __init__(self, metrics_log: MetricsLog, *, periods: tuple[int, ...], tokens_per_step: int = 0, start: int,
                 checkpointing: Checkpointing | None, progress: Any):
        self.metrics_log, self.periods, self.tokens_per_step = metrics_log, periods, tokens_per_step
        self.checkpointing, self.progress = checkpointing, progress
        self.pending: Metrics | None = None  # device-side sums since the last record
        self.restart_clock(start)

    def add(self, metrics: Metrics, *, tokens: int | None = None, real_tokens: int | None = None) -> None:
        """One step's metrics, and its tokens: padded (B × L of the batch computed) and real (padding left out)."""
        self.pending = metrics if self.pending is None else jax.tree.map(jnp.add, self.pending, metrics)
        tokens = self.tokens_per_step if tokens is None else tokens
        self.tokens += tokens
        self.real_tokens += tokens if real_tokens is None else real_tokens

    def restart_clock(self, step: int) -> None:
        """tokens/s counts from here: it measures training only, not the hooks' time."""
        self.clock, self.clock_step, self.tokens, self.real_tokens = time.perf_counter(), step, 0, 0

    def __call__(self, step: int, state: TrainState) -> None:
        sums, self.pending = distributed.to_host(self.pending), None
        if sums["nonfinite"]:
            last_good = "none" if self.checkpointing is None else self.checkpointing.last_good()
            raise NonFiniteLossError(f"loss or gradient became NaN/inf by step {step} (loss sum {float(sums['nll'])}); "
                                     f"stopped. Last good checkpoint: {last_good}")
        metrics = metrics_from_sums(sums)
        seconds = max(time.perf_counter() - self.clock, 1e-9)
        record = {"step": step, "split": "train", "loss": metrics["loss"], "accuracy": 1.0 - metrics["token_error"],
                  "tokens_per_s": self.tokens / seconds, "real_tokens_per_s": self.real_tokens / seconds}
        self.metrics_log.write(record)
        if self.progress is not None:
            self.progress.set_postfix(loss=f"{record['loss']:.4f}", acc=f"{record['accuracy']:.3f}",
                                      tok_s=f"{record['tokens_per_s']:.0f}",
                                      real_tok_s=f"{record['real_tokens_per_s']:.0f}")


class _SigintAtStepEnd:
    """While the loop runs (in the main thread), the first Ctrl-C only sets `requested`, and the loop stops at the
    end of the step: a KeyboardInterrupt raised in the middle of a checkpoint save or a jax call could leave orbax's
    threads waiting. A second Ctrl-C interrupts at once, as usual."""

    def __init__(self):
        self.requested, self.installed, self.previous = False, False, signal.default_int_handler

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, self.previous)

    def __enter__(self) -> _SigintAtStepEnd:
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            self.previous = signal.default_int_handler if previous is None else previous
            signal.signal(signal.SIGINT, self._handler)
            self.installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self.installed:
            signal.signal(signal.SIGINT, self.previous)


def train_loop(trainer: Trainer, task: Task, state: TrainState, *, start: int, train_log: TrainLog,
               hooks: Sequence[Hook], progress: Any = None) -> TrainState:
    """Steps start + 1 .. run.steps on the task's training batches; after each, the due hooks in order.

    Batch `step - 1` of the task trains step `step` (the data position is the step, whatever the padding), cut by
    `trainer.pad` to the length it needs.

    train_log collects every step's metrics (it is one of the hooks too); progress is a tqdm bar or None.
    Ctrl-C stops the loop at the end of the step (a second one at once): TrainingInterrupted with the last step
    completed.
    """
    last_step, batch_size = trainer.config.run.steps, trainer.config.optim.batch_size
    serial = distributed.one_program_at_a_time(trainer.mesh)  # then the next batch is built while a step runs
    done, running = start, None
    try:
        with _SigintAtStepEnd() as sigint:
            for step in range(start + 1, last_step + 1):
                batch = task.train_batch(step - 1, batch_size)
                real_tokens = int(scored_lengths(batch["weights"]).sum())
                batch = trainer.pad(batch, "train")
                jax.block_until_ready(running)
                state, metrics = trainer.train_step(state, trainer.put(batch))
                running = metrics if serial else None
                train_log.add(metrics, tokens=batch["inputs"].size, real_tokens=real_tokens)
                due = [hook for hook in hooks if hook.due(step, last_step)]
                if due:
                    jax.block_until_ready(running)  # hooks run programs too (evaluation)
                    for hook in due:
                        hook(step, state)
                    train_log.restart_clock(step)
                if progress is not None:
                    progress.update(1)
                done = step
                if sigint.requested:
                    raise TrainingInterrupted(step)
    except KeyboardInterrupt as interrupt:
        if isinstance(interrupt, TrainingInterrupted):
            raise
        raise TrainingInterrupted(done) from None
    jax.block_until_ready(running)  # the caller's next program (the final evaluation) waits for the last step
    return state
