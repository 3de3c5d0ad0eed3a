"""Experiments on workdirs: train and evaluate one run, read a run back, re-evaluate its checkpoint, compare encodings.

`train_and_evaluate(config, workdir)` wires task, model, mesh, checkpoints, hooks and evaluation (the CLI and the
notebooks call it); `restore_run(workdir, step=None)` reads a finished or interrupted run back, for
`evaluate_checkpoint` and the notebooks alike. A workdir belongs to one run (jaxpe.train.workdir): a lock is held
while a run writes there, and `check_same_run` refuses another config. Everything is checked (`validate_config`)
before anything is written.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import math
import numbers
import os
import pathlib
import platform
import time
from collections.abc import Mapping, Sequence
from typing import Any

import flax
import jax

from jaxpe.model import TransformerLM
from jaxpe.train import distributed, plots
from jaxpe.train.checkpoint import Checkpoints
from jaxpe.train.config import (TaskConfig, TrainConfig, build_model, build_task, from_dict, load_config,
                                longest_length, resolve_config, to_dict)
from jaxpe.train.loop import (UNLOGGED, Checkpointing, Evaluation, MetricsLog, NonFiniteLossError, TimeLimitReached,
                              TrainLog, progress_bar, train_loop)
from jaxpe.train.tables import comparison_heading, results_markdown, summarize_seeds
from jaxpe.train.step import TrainState
from jaxpe.train.tasks import Task
from jaxpe.train.tasks.base import host_memory_bytes
from jaxpe.train.trainer import Trainer, batch_sizes, members_at_once, run_mesh
from jaxpe.train.workdir import (NONFINITE_NAME, RESUMABLE_MODEL_FIELDS, REUSABLE_RESULT_FIELDS, check_same_corpus,
                                 check_same_run, check_workdir, check_workdir_kind, checkpoint_steps,
                                 config_differences, locked_workdir, resolved_pair, workdir_path, write_corpus,
                                 write_json)

log = logging.getLogger(__name__)


def train_and_evaluate(
    config: TrainConfig, workdir: str | pathlib.Path, *, task: Task | None = None, model: Any = None,
    time_limit: float | None = None,
) -> dict[str, Any]:
    """Trains (resuming from workdir's checkpoints if any), evaluates every split, writes results.

    task: a jaxpe.train.tasks Task (default: built from config.task); model: a flax module with
    jaxpe.TransformerLM's call signature (default: built from config.model, filled in from the task).
    time_limit: seconds after which training stops at the end of a dispatch, checkpoints that step and raises
    TimeLimitReached (run it again to resume); None: no limit.
    Writes in workdir: config.json (the config resolved with the task, config.resolve_config: every task option,
    model.vocab_size and max_len filled in), corpus.json (lm: its corpus' fingerprint, checked on resuming; see
    jaxpe.train.workdir.check_same_corpus), metrics.jsonl, tb/ (TensorBoard, see MetricsLog), checkpoints/,
    result.json, result.md, result.png; only process 0 writes files (checkpoints are saved by every process together).
    Returns the result dict. Raises NonFiniteLossError on a NaN/inf loss (the last checkpoint written is the
    last good one).
    """
    check_configs([config], "config")
    workdir = workdir_path(workdir)
    if task is None:
        task, built = validate_config(config)
        model = built if model is None else model
        warn_schedule([config])
    elif model is None:
        model = build_model(config.model, task.vocab_size, longest_length(task))
    check_tokens(task, config.optim.batch_size)
    (result,) = train_seeds([config], [workdir], task=task, model=model, time_limit=time_limit)
    return result


def train_seeds(configs: Sequence[TrainConfig], workdirs: Sequence[str | pathlib.Path], *, task: Task, model: Any,
                time_limit: float | None = None) -> list[dict[str, Any]]:
    """Runs of one configuration that differ only in run.seed, trained as one program (their models stacked and
    vmapped through one jitted step, jaxpe.train.trainer), each written to its own workdir as train_and_evaluate
    writes a run: the same files, and results equal to separate runs' up to float rounding. One config trains
    alone. task and model: as train_and_evaluate's, built for configs[0]; each config is saved resolved with the
    task (config.resolve_config). A member whose loss becomes NaN/inf stops the program: the others then train on
    without it from their checkpoints, so that they end as their separate runs do, and the NonFiniteLossError is
    raised after; the failed run's workdir keeps a note of it (NONFINITE_NAME, until it finishes), so that
    compare_encodings trains it apart, after the others."""
    check_time_limit(time_limit)
    for argument, given in (("configs", configs), ("workdirs", workdirs)):
        if isinstance(given, (str, os.PathLike, TrainConfig)) or not isinstance(given, Sequence):
            raise TypeError(f"{argument}={given!r:.80} must be a list, an entry per run (train_and_evaluate trains "
                            "one run)")
    check_configs(configs, "configs")
    workdirs = [workdir_path(workdir, f"workdirs[{index}]") for index, workdir in enumerate(workdirs)]
    if len(configs) != len(workdirs) or not configs:
        raise ValueError(f"configs ({len(configs)}) and workdirs ({len(workdirs)}) must pair up, at least one each")
    seeds = [c.run.seed for c in configs]
    if len(set(seeds)) != len(seeds) or any(dataclasses.replace(c, run=dataclasses.replace(c.run, seed=seeds[0]))
                                            != configs[0] for c in configs):
        raise ValueError(f"configs must differ in run.seed only, each seed once; got seeds {seeds}")
    most = stackable(model, configs[0], task)
    if most is not None and len(configs) > most:
        held, memory = held_bytes(model, configs[0], task, len(configs)), mesh_memory(configs[0])[1]
        raise ValueError(f"seeds {seeds}: {len(configs)} runs stacked hold {held / 2**30:.3g} GiB "
                         f"(their parameters and optimizer state, and the logits and layer inputs of the runs a step "
                         f"computes side by side, run.seeds_at_once), more than the {memory / 2**30:.3g} GiB "
                         f"of memory here; train at most {most} together")
    given, configs = configs, [resolve_config(c, task) for c in configs]  # saved resolved (config.json, checkpoints)
    deadline = None if time_limit is None else time.time() + time_limit
    try:
        return _train_seeds_locked(configs, workdirs, task, model, deadline)
    except NonFiniteLossError as error:
        if jax.process_index() == 0:
            for config, workdir in zip(configs, workdirs):
                if config.run.seed in error.seeds:
                    write_json(workdir / NONFINITE_NAME, {"seed": config.run.seed, "error": str(error)})
        finite = [i for i, config in enumerate(configs) if config.run.seed not in error.seeds]
        if not error.seeds or not finite or len(finite) == len(configs):
            raise
        log.warning("seed(s) %s: loss, gradient or parameters NaN/inf; training seed(s) %s on without them",
                    ", ".join(map(str, error.seeds)), ", ".join(str(configs[i].run.seed) for i in finite))
        train_seeds([given[i] for i in finite], [workdirs[i] for i in finite], task=task, model=model,
                    time_limit=None if deadline is None else max(deadline - time.time(), 0.0))
        raise


def _train_seeds_locked(configs: Sequence[TrainConfig], workdirs: Sequence[pathlib.Path], task: Task, model: Any,
                        deadline: float | None) -> list[dict[str, Any]]:
    """train_seeds of configs resolved with the task, under each workdir's lock."""
    seeds, is_main = [c.run.seed for c in configs], jax.process_index() == 0
    for config, workdir in zip(configs, workdirs):
        check_same_run(workdir, config, task)
    with contextlib.ExitStack() as locks:
        for config, workdir in zip(configs, workdirs):
            locks.enter_context(locked_workdir(workdir, is_main=is_main))
            check_same_run(workdir, config, task)  # again under the lock: a run that ended just before may have written
            if is_main:
                write_json(workdir / "config.json", to_dict(config))
                write_corpus(workdir, task)
        trainer = Trainer(model=model, config=configs[0], seq_len=task.seq_len,
                          seeds=None if len(configs) == 1 else tuple(seeds))
        return _train_members(trainer, configs, workdirs, task, is_main, deadline=deadline)


def check_configs(configs: Sequence[Any], argument: str) -> None:
    """TypeError naming `argument` when one of `configs` is no TrainConfig (a nested dict, say)."""
    for config in configs:
        if not isinstance(config, TrainConfig):
            raise TypeError(f"{argument}: {config!r:.80} is no TrainConfig; make one with jaxpe.train.build_config"
                            "(...), or from nested dicts with jaxpe.train.config.from_dict({...})")


def check_time_limit(time_limit: float | None) -> None:
    """A TypeError unless `time_limit` is None (no limit) or a number of seconds; a ValueError when it is NaN or
    negative (0 stops at the end of the first dispatch)."""
    if time_limit is None:
        return
    if isinstance(time_limit, bool) or not isinstance(time_limit, numbers.Real):
        raise TypeError(f"time_limit={time_limit!r} must be a number of seconds, or None for no limit")
    if not time_limit >= 0:
        raise ValueError(f"time_limit={time_limit!r} must be >= 0 seconds, or None for no limit")


def validate_config(config: TrainConfig, task: Task | None = None) -> tuple[Task, TransformerLM]:
    """Checks what TrainConfig's own checks cannot see alone (the task's options and data, its splits named in
    run.eval_splits, the model against the task, the devices for the batch sizes); returns the task (`task` if given:
    config.task's, built before) and the model, built once here. The encoding and its options were resolved and
    checked when config.model was made. ValueError names the key."""
    task = build_task(config) if task is None else task
    splits = list(task.eval_splits())
    unknown = [name for name in config.run.eval_splits if name not in splits]
    if unknown:
        raise ValueError(f"run.eval_splits: unknown split(s) {unknown} for task {config.task.name!r}; "
                         f"choose from {', '.join(splits)}")
    longest, max_len = longest_length(task), config.model.max_len
    if max_len is not None and max_len < longest and config.model.pe_config.additive:
        raise ValueError(f"model.max_len={max_len} is shorter than the longest sequence of task "
                         f"{config.task.name!r} ({longest} tokens, training or evaluation), which pe="
                         f"{config.model.pe!r}'s position table must hold; leave it unset (none) to take the task's")
    run_mesh(config)  # the devices and batch sizes, as the Trainer will make its mesh
    model = build_model(config.model, task.vocab_size, longest)
    check_model_fits(model, config, task)
    return task, model


def warn_schedule(configs: Sequence[TrainConfig]) -> None:
    """Logs once for each distinct schedule among `configs` whose warmup is as long as the run (the learning rate
    never reaches its peak)."""
    for warmup, steps in sorted({(c.optim.warmup_steps, c.run.steps) for c in configs}):
        if warmup >= steps:
            log.warning("optim.warmup_steps=%d >= run.steps=%d: the learning rate never reaches optim.learning_rate",
                        warmup, steps)


def memory_bytes(devices: Sequence[jax.Device] | None = None) -> int:
    """The memory `devices` (default: the local ones) give a data-parallel run, which needs the same bytes on each: as
    many times the smallest bytes_limit among them as there are devices; on CPUs, which report none and share the
    host, the host's physical memory."""
    devices = jax.local_devices() if devices is None else devices
    limits = [(device.memory_stats() or {}).get("bytes_limit") for device in devices]
    if all(limits):
        return len(limits) * int(min(limits))
    return host_memory_bytes()


def mesh_memory(config: TrainConfig) -> tuple[int, int]:
    """(copies, bytes): the copies of a run's parameters and optimizer state its mesh holds (run_mesh: one on each
    device, the same host's CPU devices too; one spread over them with run.fsdp) and the memory of the mesh's devices
    (memory_bytes)."""
    devices = list(run_mesh(config).devices.flat)
    return 1 if config.run.fsdp else len(devices), memory_bytes(devices)


def state_size(model: TransformerLM) -> tuple[int, int]:
    """(parameters, bytes of the parameters and Adam's two moments) of `model`, from jax.eval_shape (nothing is
    allocated) of its first layers, one period of its layer pattern (ModelConfig.layer_pattern): a block's parameters
    depend only on its place in the pattern, so block j counts once for each layer i with i ≡ j modulo the period
    (tracing every layer of a very deep model would never end)."""
    config = model.config
    layers = config.num_layers
    period = min(layers, len(config.layer_pattern))
    first = TransformerLM(dataclasses.replace(config, num_layers=period))
    params = jax.eval_shape(lambda: first.init(jax.random.key(0), jax.numpy.zeros((1, 1), jax.numpy.int32)))["params"]
    repeats = {f"block{j}": len(range(j, layers, period)) for j in range(period)}  # TransformerLM's block names
    count = size = 0
    for name, tree in params.items():
        for leaf in jax.tree.leaves(tree):
            n = repeats.get(name, 1) * math.prod(leaf.shape)
            count, size = count + n, size + n * leaf.dtype.itemsize
    return count, 3 * size


def step_bytes(model: TransformerLM, config: TrainConfig, task: Task) -> tuple[int, int]:
    """(logits, layer inputs): bytes that one run's step holds beside its state, at least, from the shapes alone.

    Training: the float32 logits of a micro-batch [b, L, V] (b = optim.batch_size / optim.grad_accum, L the task's
    training length, V the vocabulary) and their gradient, with each layer's input [b, L, d_model] in the compute
    dtype, which the backward keeps whatever model.remat; evaluation: the float32 logits of an evaluation batch
    [run.eval_batch_size, longest length, V], where that is more. A lower bound: attention scores, MLP activations and
    the workspace XLA adds are not counted."""
    c = model.config
    rows = config.optim.batch_size // config.optim.grad_accum * task.seq_len
    logits = max(2 * rows * c.vocab_size * 4, config.run.eval_batch_size * longest_length(task) * c.vocab_size * 4)
    return logits, c.num_layers * rows * c.d_model * c.compute_dtype.itemsize


def held_bytes(model: TransformerLM, config: TrainConfig, task: Task, runs: int = 1) -> int:
    """Bytes `runs` runs of `model` stacked as one program hold at least, over the run's mesh: each run's parameters
    and Adam's moments (state_size) in as many copies as the mesh holds (mesh_memory), and the step's activations
    (step_bytes, split over the mesh) of the runs a step computes side by side (trainer.members_at_once)."""
    return _held(config, runs, mesh_memory(config)[0], state_size(model)[1], sum(step_bytes(model, config, task)))


def _held(config: TrainConfig, runs: int, copies: int, state: int, step: int) -> int:
    """held_bytes from its parts: `copies` of each run's `state` bytes, `step` bytes for each run computed at once."""
    return runs * copies * state + members_at_once(config.run.seeds_at_once, runs,
                                                   jax.local_devices()[0].platform) * step


def check_model_fits(model: TransformerLM, config: TrainConfig, task: Task) -> None:
    """ValueError, naming the size keys, when the model's parameters with Adam's two moments (state_size), in as many
    copies as the run's mesh holds, and what a step holds beside them (step_bytes: the logits and their gradient, the
    layer inputs) exceed the mesh's memory (mesh_memory): such a run would abort XLA or exhaust the host at its first
    step rather than fail in words. Not in a multi-process run, whose state (with run.fsdp) and batch spread over
    other hosts' memory too."""
    if jax.process_count() > 1:
        return
    (count, state), (logits, layers) = state_size(model), step_bytes(model, config, task)
    copies, memory = mesh_memory(config)
    held = _held(config, 1, copies, state, logits + layers)
    if held > memory:
        c, gib = model.config, 2**30
        each = "" if copies == 1 else (f" on each of the run's {copies} devices ({copies * state / gib:.3g} GiB; "
                                       "run.fsdp=true spreads one copy over them)")
        raise ValueError(f"the model has {count:.3g} parameters, {state / gib:.3g} GiB with the optimizer's state"
                         f"{each}, and a training or evaluation step holds at least {logits / gib:.3g} GiB of logits "
                         f"(float32 [batch, length, model.vocab_size={c.vocab_size}], with their gradient in training) "
                         f"and {layers / gib:.3g} GiB of layer inputs: {held / gib:.3g} GiB, more than the "
                         f"{memory / gib:.3g} GiB of memory here; lower model.d_model, model.num_layers, model.mlp_dim "
                         "or model.max_len, or optim.batch_size (or raise optim.grad_accum), run.eval_batch_size or "
                         "the task's length")


def stackable(model: Any, config: TrainConfig, task: Task) -> int | None:
    """How many runs of `model` fit in memory stacked as one program: the most whose held_bytes fit in the mesh's
    memory (mesh_memory), at least 1. None: no bound known (a model other than a TransformerLM, or a multi-process
    run, whose state spreads over other hosts' memory too: check_model_fits)."""
    if jax.process_count() > 1 or not isinstance(model, TransformerLM):
        return None
    (copies, memory), state, step = mesh_memory(config), state_size(model)[1], sum(step_bytes(model, config, task))
    low, high = 1, max(1, memory // (copies * state))
    while low < high:  # held_bytes grows with the runs: the largest count that fits, by bisection
        middle = (low + high + 1) // 2
        low, high = (middle, high) if _held(config, middle, copies, state, step) <= memory else (low, middle - 1)
    return low


def check_tokens(task: Task, batch_size: int) -> None:
    """ValueError when the task's evaluation splits or its first training batch hold a token id outside
    [0, task.vocab_size). Inside jit such an id is no error (flax's Embed looks ids up with jnp.take, which fills an
    out-of-range row with NaN: NaN logits), so it is caught here, where the data enters from the host."""
    arrays = {f"split {name!r}": split.inputs for name, split in task.eval_splits().items()}
    arrays |= {f"split {name!r} targets": split.targets for name, split in task.eval_splits().items()}
    batch = task.train_batch(0, batch_size)
    arrays |= {"the first training batch": batch["inputs"], "the first training batch's targets": batch["targets"]}
    for what, ids in arrays.items():
        if ids.size and (ids.min() < 0 or ids.max() >= task.vocab_size):
            raise ValueError(f"task {task.name!r}: {what} holds token ids in [{ids.min()}, {ids.max()}], outside "
                             f"the vocabulary [0, {task.vocab_size})")


def _train_members(trainer: Trainer, configs: Sequence[TrainConfig], workdirs: Sequence[pathlib.Path], task: Task,
                   is_main: bool, *, deadline: float | None = None) -> list[dict[str, Any]]:
    """Trains the trainer's members (one run, or its seeds stacked; configs[i] and workdirs[i] are member i's) from
    their checkpoints, evaluates every split and writes each member's results in its workdir, as separate runs
    would. Members resume together, from the newest step all of them have a readable checkpoint of (else from
    scratch)."""
    run = trainer.config.run
    splits = task.eval_splits()
    best_split = "valid" if "valid" in splits else next(iter(splits))

    checkpoints, problems = [], [[] for _ in configs]
    resumed, metas = None, []
    if run.checkpoint_every:
        checkpoints = [Checkpoints(workdir / "checkpoints", keep=run.keep, best_metric=f"{best_split}/{task.metric}",
                                   async_save=run.async_checkpoints) for workdir in workdirs]
        resumed, metas = _restore_members(trainer, configs, task, checkpoints, problems)
    resumed_from = None if resumed is None else int(distributed.to_host(resumed.step).max())
    if resumed_from is not None and resumed_from > run.steps:  # check_same_run saw the directories; this, the state
        for c in checkpoints:
            c.close()
        raise ValueError(f"run.steps={run.steps} is below the checkpoint at step {resumed_from} in "
                         f"{str(checkpoints[0].directory)!r}; set run.steps >= {resumed_from} to resume it")
    state = trainer.init_state() if resumed is None else resumed
    start = resumed_from or 0
    during = {k: v for k, v in splits.items() if not run.eval_splits or k in run.eval_splits}
    trainer.compile_ahead(state.params, [during, splits] if run.eval_every else [splits])
    if resumed_from is not None:
        log.info("resumed from step %d (checkpoint%s in %s)", start, "s" if len(checkpoints) > 1 else "",
                 ", ".join(str(c.directory) for c in checkpoints))

    metrics_logs = [MetricsLog(workdir, resume_step=start, enabled=is_main, tensorboard=run.tensorboard)
                    for workdir in workdirs]
    progress = progress_bar(run, start, enabled=is_main)
    evaluation = Evaluation(trainer, splits, run.eval_splits, metrics_logs, every=run.eval_every, metric=task.metric,
                            best_split=best_split)
    checkpointing = None if not checkpoints else Checkpointing(
        trainer, checkpoints, evaluation, every=run.checkpoint_every, last_saved=resumed_from,
        configs=[to_dict(c) for c in configs])
    train_log = TrainLog(trainer, metrics_logs, periods=(run.log_every, run.checkpoint_every),
                         tokens_per_step=trainer.config.optim.batch_size * task.seq_len, start=start,
                         checkpointing=checkpointing, progress=progress,
                         unlogged=[meta.get(UNLOGGED) for meta in metas])
    hooks = [train_log, evaluation, *([checkpointing] if checkpointing is not None else [])]
    try:
        state = train_loop(trainer, task, state, start=start, train_log=train_log, hooks=hooks, progress=progress,
                           deadline=deadline)
        # the last step's evaluation covers every split; a run resumed at its end evaluates its final state
        final = (evaluation.results if evaluation.step == run.steps
                 else trainer.evaluate_members(state.params, splits))
    finally:
        for metrics_log in metrics_logs:
            metrics_log.close()
        if progress is not None:
            progress.close()
        for c in checkpoints:
            c.wait()
            c.close()

    results = []
    for config, workdir, member_final, member_problems in zip(configs, workdirs, final, problems, strict=True):
        result = {
            "task": config.task.name, "pe": config.model.pe, "seed": config.run.seed, "metric": task.metric,
            "steps": run.steps, "resumed_from": resumed_from, "checkpoint_problems": member_problems,
            "splits": member_final, "config": to_dict(config), "encoding": _resolved_encoding(trainer.model),
            "environment": _environment(),
        }
        if is_main:
            write_json(workdir / "result.json", result)
            table = results_markdown([result], metric=task.metric, splits=list(member_final),
                                     label_keys=("task", "pe", "seed"))
            (workdir / "result.md").write_text(table, encoding="utf-8")
            plots.run_summary(workdir / "metrics.jsonl", result, workdir / "result.png")
            (workdir / NONFINITE_NAME).unlink(missing_ok=True)
        results.append(result)
    return results


def _restore_members(trainer: Trainer, configs: Sequence[TrainConfig], task: Task,
                     checkpoints: Sequence[Checkpoints], problems: list[list[dict[str, Any]]]
                     ) -> tuple[TrainState | None, list[dict[str, Any]]]:
    """The members' newest common checkpoint, stacked as the trainer holds its state, with each member's meta; or
    (None, []): start afresh.

    Each member's newest readable checkpoint is read (unreadable ones are quarantined and noted in its `problems`);
    when they stand at different steps (a save cut between members), every member is read again at the oldest of
    them, and a member without a checkpoint there sends all back to the start. A member's checkpoints past the step
    all resume from are deleted: the members train those steps again and save them anew."""
    abstract = trainer.abstract_state()
    found, metas = [], []
    for member, (config, ckpt) in enumerate(zip(configs, checkpoints, strict=True)):
        state, meta, member_problems = ckpt.restore_latest(abstract)
        problems[member] += member_problems
        if state is None and member_problems:
            log.warning("no readable checkpoint is left in %s: training from step 0", ckpt.directory)
        if state is not None:
            _check_checkpoint_config(meta, config, task, ckpt.directory, lambda: [c.close() for c in checkpoints])
        found.append(state)
        metas.append(meta)
    if any(state is None for state in found):
        _rewind(checkpoints, 0)
        return None, []
    steps = [int(distributed.to_host(state.step)) for state in found]
    if len(set(steps)) > 1:
        common = min(steps)
        log.warning("the members' checkpoints stand at steps %s; resuming all from step %d", steps, common)
        for member, ckpt in enumerate(checkpoints):
            if steps[member] != common:
                state, metas[member], member_problems = ckpt.restore_latest(abstract, max_step=common)
                problems[member] += member_problems
                if state is None or int(distributed.to_host(state.step)) != common:
                    _rewind(checkpoints, 0)
                    return None, []
                found[member] = state
        _rewind(checkpoints, common)
    return trainer.stack(found), metas


def _rewind(checkpoints: Sequence[Checkpoints], step: int) -> None:
    """Deletes each member's checkpoints past `step`, where the members resume (0: from the start), logging them."""
    for ckpt in checkpoints:
        deleted = ckpt.delete_after(step)
        if deleted:
            log.warning("deleted the checkpoints at steps %s in %s: the members resume together from step %d",
                        deleted, ckpt.directory, step)


# The vector extensions that decide which code XLA's CPU backend emits (from the host's /proc/cpuinfo flags).
CPU_FEATURES = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile")


def cpu_name(cpuinfo: str | pathlib.Path = "/proc/cpuinfo") -> str:
    """The host CPU's model name and its CPU_FEATURES, read from cpuinfo (else platform.processor()): XLA compiles
    CPU code for the host's instruction set, so the last bits of a CPU run's numbers, and with them a long run's
    trajectory, can differ between CPUs (a run resumed on another machine goes on as that machine computes)."""
    try:
        info = pathlib.Path(cpuinfo).read_text(encoding="utf-8").splitlines()
    except OSError:
        return platform.processor()
    name = next((line.partition(":")[2].strip() for line in info if line.startswith("model name")), "")
    flags = set(next((line.partition(":")[2].split() for line in info if line.startswith("flags")), []))
    return f"{name or platform.processor()} ({' '.join(f for f in CPU_FEATURES if f in flags)})"


def _environment() -> dict[str, Any]:
    """Where and when a result was measured: device, host CPU, process/device counts, jax/flax versions, UTC date."""
    device = jax.devices()[0]
    return {
        "device": f"{device.platform}:{getattr(device, 'device_kind', '')}", "device_count": jax.device_count(),
        "process_count": jax.process_count(), "jax_version": jax.__version__, "flax_version": flax.__version__,
        "python": platform.python_version(), "machine": platform.machine(), "cpu": cpu_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _check_checkpoint_config(meta: Mapping[str, Any], config: TrainConfig, task: Task, directory: pathlib.Path,
                             on_error: Any = None) -> None:
    """ValueError when a checkpoint's meta names a config that differs from `config` (both resolved with `task`; a
    checkpoint written before checkpoints carried their config passes: config.json is all there is to compare)."""
    if "config" not in meta:
        return
    differences = config_differences(from_dict(meta["config"]), config, task)
    if differences:
        if on_error is not None:
            on_error()
        raise ValueError(f"the checkpoint at step {meta.get('step')} in {str(directory)!r} was written by a run with "
                         f"another config ({', '.join(differences)}); use a new workdir")


def _resolved_encoding(model: Any) -> dict[str, Any] | None:
    """The encoding's config with every default filled in (None for a model without a jaxpe ModelConfig)."""
    pe_config = getattr(getattr(model, "config", None), "pe_config", None)
    if pe_config is None:
        return None
    return {"name": pe_config.name, **json.loads(json.dumps(dataclasses.asdict(pe_config), default=list))}


@dataclasses.dataclass(frozen=True)
class Run:
    """A run read back from its workdir: its config, task, model (filled in from the task), Trainer and state."""

    config: TrainConfig
    task: Task
    model: TransformerLM
    trainer: Trainer
    state: TrainState


def restore_run(workdir: str | pathlib.Path, step: int | None = None, *, num_devices: int | None = None) -> Run:
    """The run in `workdir` (its config.json) at its latest readable checkpoint (an unreadable one is logged and the
    previous one used, as training does, but left in place), or at checkpoint `step`.

    The state is restored onto this process's devices, whatever device count trained it: `num_devices` devices
    (None: the run's run.num_devices where this process has that many, else the most of this process's devices
    that split the run's batches evenly, on any platform: a run of batch 4 on a host of 3 accelerators is read on 2
    of them, where run.num_devices=0 would take all 3 and refuse the batch; a multi-process run, all of them).
    Run.config is the saved config resolved with the task (model.vocab_size and max_len filled in) and
    run.num_devices set to the count used, so
    `Run.model.apply({"params": Run.state.params}, tokens)` gives the trained model's logits. A ValueError when the
    run's corpus changed since it began (jaxpe.train.workdir.check_same_corpus): Run.task would be other data.
    """
    workdir = workdir_path(workdir)
    check_workdir(workdir)
    config_path = workdir / "config.json"
    if not config_path.is_file():
        runs = sorted(str(path.parent) for path in workdir.glob("*/seed*/config.json"))
        listed = ", ".join(runs[:3]) + ", ..." * (len(runs) > 3)
        hint = (f"it holds the runs of a comparison: give one of them ({listed})" if runs
                else "is it a jaxpe-train workdir?")
        raise ValueError(f"{str(workdir)!r} holds no config.json; {hint}")
    config = load_config(config_path)
    if num_devices is None:
        saved = config.run.num_devices
        num_devices = (saved if 0 < saved <= jax.device_count() else 0 if jax.process_count() > 1
                       else distributed.dividing_count(jax.device_count(), tuple(batch_sizes(config).values())))
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, num_devices=num_devices))
    task, model = validate_config(config)
    check_same_corpus(workdir, task)  # the task rebuilt on a changed corpus is other data than the run's
    config = resolve_config(config, task)
    trainer = Trainer(model=model, config=config, seq_len=task.seq_len)
    checkpoints = Checkpoints(workdir / "checkpoints", keep=config.run.keep, best_metric="unused", async_save=False)
    try:
        steps = checkpoints.all_steps()
        if not steps:
            every = config.run.checkpoint_every
            why = ("the run saves none (run.checkpoint_every=0; its result.json holds its final evaluation)"
                   if not every else f"the run has saved none yet (run.checkpoint_every={every})")
            raise ValueError(f"no checkpoint in {workdir / 'checkpoints'}: {why}")
        if step is not None and step not in steps:
            raise ValueError(f"{step=}: no such checkpoint in {workdir / 'checkpoints'} (have {steps})")
        if step is not None:
            state, meta = checkpoints.restore(step, trainer.abstract_state())  # a ValueError naming it if unreadable
        else:
            state, meta, problems = checkpoints.restore_latest(trainer.abstract_state(), quarantine=False)
            if state is None:
                raise ValueError(f"no readable checkpoint in {workdir / 'checkpoints'}: "
                                 f"{'; '.join(p['error'] for p in problems)}")
        _check_checkpoint_config(meta, config, task, checkpoints.directory)
    finally:
        checkpoints.close()
    return Run(config=config, task=task, model=model, trainer=trainer, state=state)


def evaluate_checkpoint(workdir: str | pathlib.Path, *, step: int | None = None,
                        progress: bool | None = None) -> dict[str, Any]:
    """Evaluates a run's checkpoint (the latest readable one, or `step`) on every split; writes eval.json and eval.md.

    `progress`: a tqdm bar (stderr, process 0) over the evaluated sequences; None: as the run's run.progress.
    The result's "unwritten" is None, or a line saying what could not be written (e.g. a read-only workdir)."""
    workdir = workdir_path(workdir)
    run = restore_run(workdir, step)  # on the run's own corpus (check_same_corpus), so eval.json scores its data
    eval_splits = run.task.eval_splits()
    show = run.config.run.progress if progress is None else progress
    bar = None
    if show and jax.process_index() == 0:
        from tqdm.auto import tqdm  # here, as jaxpe.train.loop.progress_bar does: it warns in Jupyter on import

        bar = tqdm(total=sum(s.inputs.shape[0] for s in eval_splits.values()), desc="eval", unit="seq",
                   dynamic_ncols=True)
    try:
        splits = run.trainer.evaluate(run.state.params, eval_splits, on_batch=None if bar is None else bar.update)
    finally:
        if bar is not None:
            bar.close()
    result = {"task": run.config.task.name, "pe": run.config.model.pe, "seed": run.config.run.seed,
              "metric": run.task.metric, "step": int(distributed.to_host(run.state.step)), "splits": splits}
    table = results_markdown([result], metric=run.task.metric, splits=list(splits),
                             label_keys=("task", "pe", "seed", "step"))
    unwritten = None
    if jax.process_index() == 0:
        try:
            write_json(workdir / "eval.json", result)
            (workdir / "eval.md").write_text(table, encoding="utf-8")
        except OSError as error:
            unwritten = f"could not write eval.json, eval.md in {workdir}: {error.strerror or error}"
    return {**result, "table": table, "unwritten": unwritten}


def compare_encodings(
    configs: Sequence[TrainConfig], seeds: Sequence[int], workdir: str | pathlib.Path, *,
    seeds_together: bool = True, time_limit: float | None = None,
) -> dict[str, Any]:
    """Trains every (config, seed) in workdir/<pe>/seed<seed> and writes one comparison: compare.json,
    compare.md and compare.png (each encoding's mean over seeds and its 95 % interval, tables.summarize_seeds). Each
    run resumes from its own checkpoints; one that finished with the same config is read back from its result.json,
    so a rerun or a wider sweep redoes nothing.

    configs: one per encoding (same task), e.g. build_config(preset=..., pe=pe) for each pe.
    seeds_together: an encoding's unfinished seeds that stand at the same checkpoint train as one program
    (train_seeds); False: one after another.
    time_limit: seconds after which training stops at the end of a dispatch, checkpoints and raises
    TimeLimitReached (run it again to go on); runs not begun by then wait for the next call; None: no limit.
    """
    check_time_limit(time_limit)
    check_configs(configs, "configs")
    workdir = workdir_path(workdir)
    if not configs or not seeds:
        raise ValueError(f"configs ({len(configs)}) and {seeds=} must both be non-empty")
    if any(c.task != configs[0].task for c in configs):
        raise ValueError(f"configs must share one task config, got {[c.task for c in configs]}")
    pes = [c.model.pe for c in configs]
    for what, values in (("--pe encodings", pes), ("--seeds", list(seeds))):
        repeated = sorted({v for v in values if values.count(v) > 1}, key=str)
        if repeated:
            raise ValueError(f"{what} repeat {repeated}: each must appear once")
    check_workdir(workdir)
    check_workdir_kind(workdir, comparison=True)
    # Every run checked before any trains: its config (once per encoding: the seed changes nothing checked there)
    # and its workdir (a run directory holding another config is refused now, not after the runs before it).
    runs = []
    built: list[tuple[TaskConfig, Task]] = []  # each task built once (a corpus read, programs generated once)
    for config in configs:
        task, model = validate_config(config, next((t for c, t in built if c == config.task), None))
        built.append((config.task, task))
        for seed in seeds:
            run_config = seed_config(config, seed)
            run_dir = workdir / config.model.pe / f"seed{seed}"
            finished = finished_result(run_dir, run_config, task)
            if finished is None:
                check_same_run(run_dir, run_config, task)  # the corpus too (check_same_corpus)
            else:
                check_same_corpus(run_dir, task)  # a finished run on another corpus is not reused either
            runs.append((run_config, run_dir, task, model, finished))
    warn_schedule(configs)
    deadline = None if time_limit is None else time.time() + time_limit
    with locked_workdir(workdir, is_main=jax.process_index() == 0):
        return _compare(configs, seeds, workdir, runs, seeds_together=seeds_together, deadline=deadline)


def _compare(configs: Sequence[TrainConfig], seeds: Sequence[int], workdir: pathlib.Path,
             runs: Sequence[tuple[TrainConfig, pathlib.Path, Task, TransformerLM, dict[str, Any] | None]], *,
             seeds_together: bool, deadline: float | None) -> dict[str, Any]:
    """compare_encodings once every run is checked and the workdir locked."""
    results: dict[pathlib.Path, dict[str, Any]] = {}
    reused = [run_dir for _, run_dir, _, _, finished in runs if finished is not None]
    if reused:
        log.info("reused %d finished run(s) with the same config: %s", len(reused),
                 ", ".join(str(d.relative_to(workdir)) for d in reused))
    groups: dict[tuple[str, int | None], list[tuple[TrainConfig, pathlib.Path, Task, TransformerLM]]] = {}
    for run_config, run_dir, task, model, finished in runs:
        if finished is not None:
            results[run_dir] = finished
        else:
            groups.setdefault((run_config.model.pe, None if seeds_together else run_config.run.seed), []).append(
                (run_config, run_dir, task, model))
    if seeds_together:  # as they resume, in programs of as many as fit in memory
        groups = {(key[0], i): part for key, group in groups.items()
                  for i, part in enumerate(_fitting(_resumable_together(group, [g[1] for g in group]),
                                                    stackable(group[0][3], group[0][0], group[0][2])))}
    # runs stopped by a NaN/inf loss before go last: their failure again stops the comparison after the others
    finished_step = None  # the last step of the runs trained last
    for group in sorted(groups.values(), key=lambda group: any((g[1] / NONFINITE_NAME).is_file() for g in group)):
        group_configs, run_dirs = [g[0] for g in group], [g[1] for g in group]
        task, model = group[0][2], group[0][3]
        if finished_step is not None and deadline is not None and time.time() > deadline:
            raise TimeLimitReached(finished_step, True)  # runs trained past the limit end the call, as a dispatch does
        log.info("training %s seed(s) %s%s", group_configs[0].model.pe, ", ".join(str(c.run.seed) for c in
                 group_configs), " as one program" if len(group) > 1 else "")
        left = None if deadline is None else max(deadline - time.time(), 0.0)
        check_tokens(task, group_configs[0].optim.batch_size)
        for run_dir, result in zip(run_dirs, train_seeds(group_configs, run_dirs, task=task, model=model,
                                                         time_limit=left)):
            results[run_dir] = result
        finished_step = group_configs[0].run.steps
    results = [results[run_dir] for _, run_dir, _, _, _ in runs]
    metric = results[0]["metric"]
    splits = list(runs[0][2].eval_splits())  # the task's order (result.json sorts its keys)
    comparison = {"task": configs[0].task.name, "metric": metric, "splits": splits, "rows": summarize_seeds(results),
                  "seeds": list(seeds), "environment": _environment(), "runs": results}
    table = comparison_markdown(comparison)
    if jax.process_index() == 0:
        write_comparison(workdir, comparison)
    return {**comparison, "table": table}


def comparison_markdown(comparison: Mapping[str, Any]) -> str:
    """compare.md's table of a comparison: one row per encoding (pe, seeds, metric per split)."""
    return results_markdown(comparison["rows"], metric=comparison["metric"], splits=comparison["splits"],
                            label_keys=("pe", "seeds"))


def write_comparison(directory: str | pathlib.Path, comparison: Mapping[str, Any]) -> None:
    """Writes a comparison as jaxpe-compare leaves it: directory/compare.json, compare.md and compare.png."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_json(directory / "compare.json", comparison)
    heading = comparison_heading(comparison["task"], comparison["metric"], comparison["seeds"])
    (directory / "compare.md").write_text(f"# {heading}\n\n{comparison_markdown(comparison)}", encoding="utf-8")
    plots.result_bars(comparison["rows"], metric=comparison["metric"], splits=comparison["splits"],
                      path=directory / "compare.png")


def latest_checkpoint_step(run_dir: pathlib.Path) -> int | None:
    """The newest step saved in run_dir/checkpoints (orbax's step directories; unfinished saves are not steps), or
    None. A cheap look, before anything is read."""
    return max(checkpoint_steps(run_dir), default=None)


def _resumable_together(members: list[Any], run_dirs: Sequence[pathlib.Path]) -> list[list[Any]]:
    """The seeds of one encoding (`members`, one per run_dir) as the programs they resume in: all in one where they
    start afresh or every one holds a checkpoint at the oldest of their newest steps (a save cut between members:
    `_restore_members` resumes all there, so the run ends as an uninterrupted one), else grouped by newest step
    (seeds added to a cut comparison keep their progress; stacked otherwise, their last bits may differ). A seed
    whose loss became NaN/inf before (its workdir's NONFINITE_NAME) trains apart, last: the others neither go back to
    its step nor stop with it again (under a time limit they would never get past it)."""
    failed = [(run_dir / NONFINITE_NAME).is_file() for run_dir in run_dirs]
    if any(failed):
        rest = [(member, run_dir) for member, run_dir, fail in zip(members, run_dirs, failed) if not fail]
        apart = [[member] for member, fail in zip(members, failed) if fail]
        return (_resumable_together([m for m, _ in rest], [d for _, d in rest]) if rest else []) + apart
    steps = [set(checkpoint_steps(run_dir)) for run_dir in run_dirs]
    newest = [max(s, default=None) for s in steps]
    if None not in newest and all(min(newest) in s for s in steps) or set(newest) == {None}:
        return [list(members)]
    groups: dict[int | None, list[Any]] = {}
    for member, step in zip(members, newest, strict=True):
        groups.setdefault(step, []).append(member)
    return list(groups.values())


def _fitting(groups: list[list[Any]], most: int | None) -> list[list[Any]]:
    """`groups` cut into groups of at most `most` members (None: as they are)."""
    if most is None:
        return groups
    return [group[i:i + most] for group in groups for i in range(0, len(group), most)]


def seed_config(config: TrainConfig, seed: int) -> TrainConfig:
    """`config` with run.seed = `seed`: the run of one seed of a comparison."""
    return dataclasses.replace(config, run=dataclasses.replace(config.run, seed=seed))


def finished_result(run_dir: pathlib.Path, config: TrainConfig, task: Task) -> dict[str, Any] | None:
    """result.json of a run in run_dir that finished with `config` (its saved config read back equals it, both
    resolved with `task`, but for REUSABLE_RESULT_FIELDS and RESUMABLE_MODEL_FIELDS: how the same maths ran), else
    None."""
    path = run_dir / "result.json"
    if not path.is_file():
        return None
    result = json.loads(path.read_text(encoding="utf-8"))
    try:
        saved = from_dict(result["config"])
    except (KeyError, ValueError):
        return None
    saved, config = resolved_pair(saved, config, task)
    run = dataclasses.replace(saved.run, **{name: getattr(config.run, name) for name in REUSABLE_RESULT_FIELDS})
    model = dataclasses.replace(saved.model, **{name: getattr(config.model, name) for name in RESUMABLE_MODEL_FIELDS})
    return result if dataclasses.replace(saved, run=run, model=model) == config else None
