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
import numpy as np

from jaxpe.train import distributed
from jaxpe.train.checkpoint import Checkpoints
from jaxpe.train.config import RunConfig
from jaxpe.train.evaluate import metrics_from_sums
from jaxpe.train.feed import Feed
from jaxpe.train.step import Metrics, TrainState
from jaxpe.train.tasks import Split, Task
from jaxpe.train.tasks.base import scored_lengths
from jaxpe.train.trainer import Trainer
from jaxpe.train.workdir import write_atomically

log = logging.getLogger(__name__)

# the checkpoint meta key of each member's train metric sums not yet recorded at the step it saves (a run stopped by
# its time limit between two records), for the resumed run's next record
UNLOGGED = "unlogged_train_sums"


class NonFiniteLossError(FloatingPointError):
    """The loss, the gradient norm or the updated parameters became NaN/inf; the run stopped. `seeds`: the run.seed
    of each run whose did (of seeds trained together, the members that failed; () where not told)."""

    def __init__(self, message: str, seeds: Sequence[int] = ()):
        super().__init__(message)
        self.seeds = tuple(seeds)


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
            lines = self.path.read_text(encoding="utf-8").splitlines()
            kept = [line for line in lines if self._step(line) <= resume_step]
            write_atomically(self.path, "".join(line + "\n" for line in kept))  # a kill here keeps every record
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
        with self.path.open("a", encoding="utf-8") as f:
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
    """Metrics of the evaluation splits written to the members' logs: `splits` of all_splits (() = all), all at the
    last step.

    `results` (one dict a member, in the trainer's seed order) and `step` are the latest evaluation's;
    `best_metric(step, member)` ranks that member's checkpoint of that step.
    """

    def __init__(self, trainer: Trainer, all_splits: Mapping[str, Split], splits: Sequence[str],
                 metrics_logs: Sequence[MetricsLog], *, every: int, metric: str, best_split: str):
        self.trainer, self.metrics_logs, self.metric, self.best_split = trainer, metrics_logs, metric, best_split
        self.all_splits = all_splits
        self.splits = {k: v for k, v in all_splits.items() if not splits or k in splits}
        self.periods, self.last_step = (every,), trainer.config.run.steps
        self.results: list[dict[str, dict[str, float]]] = []
        self.step: int | None = None

    def __call__(self, step: int, state: TrainState) -> None:
        splits = self.all_splits if step == self.last_step else self.splits
        self.results, self.step = self.trainer.evaluate_members(state.params, splits), step
        for metrics_log, results in zip(self.metrics_logs, self.results, strict=True):
            for name, values in results.items():
                metrics_log.write({"step": step, "split": name, **values})

    def best_metric(self, step: int, member: int = 0) -> dict[str, float] | None:
        """{"<best split>/<metric>": value} when this step was evaluated on the best split, else None."""
        if self.step != step or self.best_split not in self.results[member]:
            return None
        return {f"{self.best_split}/{self.metric}": self.results[member][self.best_split][self.metric]}


class Checkpointing(Hook):
    """Saves each member's state (one Checkpoints a member, in the trainer's seed order) every `every` steps, ranked
    by the evaluation of the same step; `last_saved` is the newest good checkpoint's step (the resumed one at first).
    `configs` (each member's run config, as a dict) go into its checkpoints' meta, so that a reader can tell which
    run wrote them."""

    def __init__(self, trainer: Trainer, checkpoints: Sequence[Checkpoints], evaluation: Evaluation, *, every: int,
                 last_saved: int | None, configs: Sequence[Mapping[str, Any]] | None = None):
        self.trainer, self.checkpoints, self.evaluation = trainer, checkpoints, evaluation
        self.periods, self.last_saved, self.configs = (every,), last_saved, configs

    def __call__(self, step: int, state: TrainState, unlogged: Sequence[Mapping[str, Any]] | None = None) -> None:
        """Saves `step`; `unlogged`: each member's train metric sums since its last record (TrainLog.check), kept in
        the meta (UNLOGGED) for the resumed run's first record."""
        states = self.trainer.unstack(state)
        for member, (checkpoints, member_state) in enumerate(zip(self.checkpoints, states, strict=True)):
            meta = {"step": step, "data_position": step,
                    **({"config": self.configs[member]} if self.configs is not None else {}),
                    **({UNLOGGED: {name: np.asarray(value).item() for name, value in unlogged[member].items()}}
                       if unlogged is not None else {})}
            checkpoints.save(step, member_state, meta, self.evaluation.best_metric(step, member))
        self.last_saved = step

    def last_good(self) -> str:
        """Where the newest good checkpoints are, in words."""
        where = ", ".join(str(c.directory) for c in self.checkpoints)
        return "none" if self.last_saved is None else f"step {self.last_saved} in {where}"


class TrainLog(Hook):
    """The train records (mean loss, accuracy and throughput since the last record; one a member) and the NaN/inf
    check.

    Due every `log_every` steps and at every checkpoint step (a NaN state is never saved). `add` collects the steps'
    metrics on device; a record syncs them to the host once. Throughput: `tokens_per_s`, the tokens of the
    batches as computed (B × padded length), and `real_tokens_per_s`, those up to each sequence's end (its last
    scored token: padding left out); each member's record counts its own model's tokens. `tokens_per_step` counts a
    step that `add` is not told its tokens.
    """

    def __init__(self, trainer: Trainer, metrics_logs: Sequence[MetricsLog], *, periods: tuple[int, ...],
                 tokens_per_step: int = 0, start: int, checkpointing: Checkpointing | None, progress: Any,
                 unlogged: Sequence[Mapping[str, Any] | None] = ()):
        """`unlogged`: each member's sums since its last record as the checkpoint resumed from holds them (its meta's
        UNLOGGED: a run stopped by its time limit between records), None for none; the next record counts them."""
        self.trainer, self.metrics_logs, self.periods = trainer, metrics_logs, periods
        self.tokens_per_step, self.checkpointing, self.progress = tokens_per_step, checkpointing, progress
        self.pending: Metrics | None = None  # sums since the last record: on device, or carried over from a checkpoint
        given = next((sums for sums in unlogged if sums), None)
        if given is not None:  # dtypes as the step's: the counts int32 (JSON ints), the sums float32
            members = [{name: np.asarray((sums or {}).get(name, 0), np.int32 if isinstance(value, int) else np.float32)
                        for name, value in given.items()} for sums in unlogged]
            self.pending = members[0] if trainer.seeds is None else jax.tree.map(lambda *x: np.stack(x), *members)
        self.restart_clock(start)

    def add(self, metrics: Metrics, *, tokens: int | None = None, real_tokens: int | None = None,
            steps: int = 1) -> None:
        """The metric sums of `steps` steps, and their tokens: padded (B × L of the batches computed) and real
        (padding left out)."""
        self.pending = metrics if self.pending is None else jax.tree.map(jnp.add, self.pending, metrics)
        tokens = self.tokens_per_step * steps if tokens is None else tokens
        self.tokens += tokens
        self.real_tokens += tokens if real_tokens is None else real_tokens

    def restart_clock(self, step: int) -> None:
        """tokens/s counts from here: it measures training only, not the hooks' time."""
        self.clock, self.clock_step, self.tokens, self.real_tokens = time.perf_counter(), step, 0, 0

    def check(self, step: int) -> list[dict[str, np.ndarray]]:
        """Each member's metric sums since the last record (on the host), without recording them; NonFiniteLossError
        when a member's loss, gradient or parameters became NaN/inf (its state must not be saved)."""
        members = self.trainer.unstack(distributed.to_host(self.pending))
        bad = [self.trainer.seed(i) for i, sums in enumerate(members) if sums["nonfinite"]]
        if bad:
            last_good = "none" if self.checkpointing is None else self.checkpointing.last_good()
            losses = ", ".join(f"{float(sums['nll'])}" for sums in members)
            raise NonFiniteLossError(f"loss, gradient or parameters became NaN/inf by step {step} (seed "
                                     f"{', '.join(map(str, bad))}; loss sum {losses}); stopped. Last good checkpoint: "
                                     f"{last_good}", seeds=bad)
        return members

    def __call__(self, step: int, state: TrainState) -> None:
        members, self.pending = self.check(step), None
        seconds = max(time.perf_counter() - self.clock, 1e-9)
        records = []
        for metrics_log, sums in zip(self.metrics_logs, members, strict=True):
            metrics = metrics_from_sums(sums)
            record = {"step": step, "split": "train", "loss": metrics["loss"], "accuracy": 1.0 - metrics["token_error"],
                      "tokens_per_s": self.tokens / seconds, "real_tokens_per_s": self.real_tokens / seconds}
            metrics_log.write(record)
            records.append(record)
        if self.progress is not None:
            loss = sum(r["loss"] for r in records) / len(records)
            accuracy = sum(r["accuracy"] for r in records) / len(records)
            self.progress.set_postfix(loss=f"{loss:.4f}", acc=f"{accuracy:.3f}",
                                      tok_s=f"{records[0]['tokens_per_s'] * len(records):.0f}",
                                      real_tok_s=f"{records[0]['real_tokens_per_s'] * len(records):.0f}")


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


def chunk_end(step: int, last_step: int, hooks: Sequence[Hook], steps_per_dispatch: int) -> int:
    """The last step of the dispatch that follows `step`: `steps_per_dispatch` steps on at most, and no further than
    the first step after `step` at which a hook is due (the last step included)."""
    end = min(step + steps_per_dispatch, last_step)
    return next((s for s in range(step + 1, end) if any(hook.due(s, last_step) for hook in hooks)), end)


class TimeLimitReached(Exception):
    """The run stopped at the end of a dispatch once its time limit had passed, after checkpointing that step where
    it saves checkpoints (`checkpointed`); `step` is the last step completed. Running it again resumes there."""

    def __init__(self, step: int, checkpointed: bool):
        super().__init__(f"time limit reached at step {step}" + ("" if checkpointed else " (no checkpoints)"))
        self.step, self.checkpointed = step, checkpointed


def train_loop(trainer: Trainer, task: Task, state: TrainState, *, start: int, train_log: TrainLog,
               hooks: Sequence[Hook], progress: Any = None, deadline: float | None = None) -> TrainState:
    """Steps start + 1 .. run.steps on the task's training batches; after each, the due hooks in order.

    Batch `step - 1` of the task trains step `step` (the data position is the step, whatever the padding).
    run.steps_per_dispatch steps run as one program (Trainer.train_steps over a Feed's batches), ending early where
    a hook is due, so hooks see exactly the steps they would one at a time, or where a batch pads to another length
    than the dispatch's first (jaxpe.train.feed), so each step computes at its own length; one step a dispatch calls
    Trainer.train_step with the host batch cut by `trainer.pad` to the length it needs.

    train_log collects every step's metrics (it is one of the hooks too); progress is a tqdm bar or None.
    Ctrl-C stops the loop at the end of the dispatch (a second one at once): TrainingInterrupted with the last step
    completed. Past `deadline` (a time.time() value) the loop checkpoints the step it reached (when a Checkpointing
    hook is among `hooks`), the train sums since the last record in its meta rather than in a record (TrainLog.check),
    and raises TimeLimitReached.
    """
    last_step, batch_size = trainer.config.run.steps, trainer.config.optim.batch_size
    serial = distributed.one_program_at_a_time(trainer.mesh)  # then the next batch is built while a step runs
    feed = Feed(trainer, task)
    done, running = start, None
    try:
        with _SigintAtStepEnd() as sigint:
            while done < last_step:
                end = chunk_end(done, last_step, hooks, trainer.config.run.steps_per_dispatch)
                if end == done + 1 and not feed.on_device:
                    batch = task.train_batch(done, batch_size)
                    real_tokens = int(scored_lengths(batch["weights"]).sum())
                    batch = trainer.pad(batch, "train")
                    tokens, batch = batch["inputs"].size, trainer.put(batch)
                    jax.block_until_ready(running)
                    state, metrics = trainer.train_step(state, batch)
                else:
                    chunk = feed.steps(done, end - done)
                    end, tokens, real_tokens = done + chunk.steps, chunk.tokens, chunk.real_tokens
                    jax.block_until_ready(running)
                    state, metrics = trainer.train_steps(state, chunk.data, chunk.rows, np.int32(chunk.steps),
                                                         chunk.length)
                running = metrics if serial else None
                train_log.add(metrics, tokens=tokens, real_tokens=real_tokens, steps=end - done)
                due = [hook for hook in hooks if hook.due(end, last_step)]
                out_of_time = deadline is not None and time.time() > deadline and end < last_step
                if due or out_of_time:
                    jax.block_until_ready(running)  # hooks run programs too (evaluation)
                    # past the deadline the step is checkpointed, due or not, and the train sums not yet recorded
                    # go into the checkpoint (the NaN check first), not into a record of their own: the resumed
                    # run's next record counts them, as the uninterrupted run's does
                    unlogged = train_log.check(end) if out_of_time and train_log not in due else None
                    saves = [hook for hook in hooks if isinstance(hook, Checkpointing)] if out_of_time else []
                    for hook in due:
                        if hook not in saves:
                            hook(end, state)
                    for hook in saves:
                        hook(end, state, unlogged)
                    train_log.restart_clock(end)
                if progress is not None:
                    progress.update(end - done)
                done = end
                if sigint.requested:
                    raise TrainingInterrupted(done)
                if out_of_time:
                    raise TimeLimitReached(done, any(isinstance(hook, Checkpointing) for hook in hooks))
    except KeyboardInterrupt as interrupt:
        if isinstance(interrupt, TrainingInterrupted):
            raise
        raise TrainingInterrupted(done) from None
    jax.block_until_ready(running)  # the caller's next program (the final evaluation) waits for the last step
    return state
