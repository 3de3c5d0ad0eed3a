"""Experiments on workdirs: train and evaluate one run, read a run back, re-evaluate its checkpoint, compare encodings.

`train_and_evaluate(config, workdir)` wires task, model, mesh, checkpoints, hooks and evaluation (the CLI and the
notebooks call it); `restore_run(workdir, step=None)` reads a finished or interrupted run back, for
`evaluate_checkpoint` and the notebooks alike. A workdir that holds checkpoints belongs to one experiment:
`check_same_run` refuses to resume it with another config.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from jaxpe.model import TransformerLM
from jaxpe.train import distributed, evaluate, plots
from jaxpe.train.checkpoint import Checkpoints
from jaxpe.train.config import TrainConfig, from_dict, load_config, to_dict
from jaxpe.train.loop import Checkpointing, Evaluation, MetricsLog, TrainLog, progress_bar, train_loop
from jaxpe.train.step import TrainState
from jaxpe.train.tasks import Task
from jaxpe.train.trainer import Trainer, build_model, build_task, longest_length

log = logging.getLogger(__name__)

# Run fields that may change between a run and its resumption: length, bookkeeping and the device layout.
RESUMABLE_RUN_FIELDS = ("steps", "log_every", "eval_every", "checkpoint_every", "keep", "async_checkpoints",
                        "eval_batch_size", "eval_splits", "num_devices", "fsdp", "progress", "tensorboard")


def train_and_evaluate(
    config: TrainConfig, workdir: str | pathlib.Path, *, task: Task | None = None, model: Any = None
) -> dict[str, Any]:
    """Trains (resuming from workdir's checkpoints if any), evaluates every split, writes results.

    task: a jaxpe.train.tasks Task (default: built from config.task); model: a flax module with
    jaxpe.TransformerLM's call signature (default: built from config.model, filled in from the task).
    Writes in workdir: config.json, metrics.jsonl, tb/ (TensorBoard, see MetricsLog), checkpoints/, result.json,
    result.md, result.png; only process 0 writes files (checkpoints are saved by every process together).
    Returns the result dict. Raises NonFiniteLossError on a NaN/inf loss (the last checkpoint written is the
    last good one).
    """
    workdir = pathlib.Path(workdir).absolute()
    is_main = jax.process_index() == 0
    check_same_run(workdir, config)
    if is_main:
        workdir.mkdir(parents=True, exist_ok=True)
        evaluate.write_json(workdir / "config.json", to_dict(config))
    task = task if task is not None else build_task(config)
    model = model if model is not None else build_model(config.model, task.vocab_size, longest_length(task))
    trainer = Trainer(model=model, config=config, seq_len=task.seq_len)
    run = config.run
    splits = task.eval_splits()
    best_split = "valid" if "valid" in splits else next(iter(splits))

    checkpoints, state, problems = None, None, []
    if run.checkpoint_every:
        checkpoints = Checkpoints(workdir / "checkpoints", keep=run.keep, best_metric=f"{best_split}/{task.metric}",
                                  async_save=run.async_checkpoints)
        state, _, problems = checkpoints.restore_latest(trainer.abstract_state())
    resumed_from = None if state is None else int(distributed.to_host(state.step))
    if state is None:
        state = trainer.init_state()
    start = resumed_from or 0
    if resumed_from is not None:
        log.info("resuming from the checkpoint at step %d in %s", start, workdir)

    metrics_log = MetricsLog(workdir, resume_step=start, enabled=is_main, tensorboard=run.tensorboard)
    progress = progress_bar(run, start, enabled=is_main)
    evaluation = Evaluation(trainer, splits, run.eval_splits, metrics_log, every=run.eval_every, metric=task.metric,
                            best_split=best_split)
    checkpointing = None if checkpoints is None else Checkpointing(checkpoints, evaluation, every=run.checkpoint_every,
                                                                   last_saved=resumed_from)
    train_log = TrainLog(metrics_log, periods=(run.log_every, run.checkpoint_every),
                         tokens_per_step=config.optim.batch_size * task.seq_len, start=start,
                         checkpointing=checkpointing, progress=progress)
    hooks = [train_log, evaluation, *([checkpointing] if checkpointing is not None else [])]
    try:
        state = train_loop(trainer, task, state, start=start, train_log=train_log, hooks=hooks, progress=progress)
        # the last step's evaluation covers every split; a run resumed at its end evaluates its final state
        final = evaluation.results if evaluation.step == run.steps else trainer.evaluate(state.params, splits)
    finally:
        metrics_log.close()
        if progress is not None:
            progress.close()
        if checkpoints is not None:
            checkpoints.wait()
            checkpoints.close()

    result = {
        "task": config.task.name, "pe": config.model.pe, "seed": run.seed, "metric": task.metric,
        "steps": run.steps, "resumed_from": resumed_from, "checkpoint_problems": problems,
        "splits": final, "config": to_dict(config), "encoding": _resolved_encoding(model),
        "environment": evaluate.environment(),
    }
    if is_main:
        evaluate.write_json(workdir / "result.json", result)
        (workdir / "result.md").write_text(evaluate.results_markdown([result], metric=task.metric, splits=list(final),
                                                                     label_keys=("task", "pe", "seed")))
        plots.run_summary(workdir / "metrics.jsonl", result, workdir / "result.png")
    return result


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_same_run(workdir: pathlib.Path, config: TrainConfig) -> None:
    """ValueError when `config` would resume a checkpoint in `workdir` whose run (config.json) differs from it in
    anything but RESUMABLE_RUN_FIELDS: that would mix two experiments in one set of checkpoints and metrics.
    Without a checkpoint to resume, the run starts afresh and replaces what is there. The saved config is read back
    first, so that a field added since it was written (with its default) is no difference."""
    path, saved_steps = workdir / "config.json", workdir / "checkpoints"
    resumes = config.run.checkpoint_every and saved_steps.is_dir() and any(
        p.name.isdigit() for p in saved_steps.iterdir())
    if not (resumes and path.is_file()):
        return
    saved, new = _flat(to_dict(load_config(path))), _flat(to_dict(config))
    allowed = {f"run.{name}" for name in RESUMABLE_RUN_FIELDS}
    changed = sorted(k for k in saved.keys() | new.keys() if k not in allowed and saved.get(k) != new.get(k))
    if changed:
        diff = ", ".join(f"{k}: {saved.get(k, '<unset>')!r} -> {new.get(k, '<unset>')!r}" for k in changed)
        raise ValueError(f"workdir={str(workdir)!r} holds a run with another config ({diff}); "
                         "use a new workdir, or the saved config to resume it")


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


def restore_run(workdir: str | pathlib.Path, step: int | None = None) -> Run:
    """The run in `workdir` (its config.json) at its latest checkpoint, or at checkpoint `step`."""
    workdir = pathlib.Path(workdir).absolute()
    config_path = workdir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{str(workdir)!r} holds no config.json; is it a jaxpe-train workdir?")
    config = load_config(config_path)
    task = build_task(config)
    model = build_model(config.model, task.vocab_size, longest_length(task))
    trainer = Trainer(model=model, config=config, seq_len=task.seq_len)
    checkpoints = Checkpoints(workdir / "checkpoints", keep=config.run.keep, best_metric="unused", async_save=False)
    try:
        steps = checkpoints.all_steps()
        if not steps or (step is not None and step not in steps):
            raise ValueError(f"{step=}: no such checkpoint in {workdir / 'checkpoints'} (have {steps})")
        state, _ = checkpoints.restore(step if step is not None else steps[-1], trainer.abstract_state())
    finally:
        checkpoints.close()
    return Run(config=config, task=task, model=model, trainer=trainer, state=state)


def evaluate_checkpoint(workdir: str | pathlib.Path, *, step: int | None = None) -> dict[str, Any]:
    """Evaluates a run's checkpoint (the latest, or `step`) on every split; writes eval.json and eval.md."""
    workdir = pathlib.Path(workdir).absolute()
    run = restore_run(workdir, step)
    splits = run.trainer.evaluate(run.state.params, run.task.eval_splits())
    result = {"task": run.config.task.name, "pe": run.config.model.pe, "seed": run.config.run.seed,
              "metric": run.task.metric, "step": int(distributed.to_host(run.state.step)), "splits": splits}
    table = evaluate.results_markdown([result], metric=run.task.metric, splits=list(splits),
                                      label_keys=("task", "pe", "seed", "step"))
    if jax.process_index() == 0:
        evaluate.write_json(workdir / "eval.json", result)
        (workdir / "eval.md").write_text(table)
    return {**result, "table": table}


def compare_encodings(
    configs: Sequence[TrainConfig], seeds: Sequence[int], workdir: str | pathlib.Path
) -> dict[str, Any]:
    """Trains every (config, seed) in workdir/<pe>/seed<seed> and writes one comparison: compare.json,
    compare.md and compare.png (mean ± std over seeds). Each run resumes by itself; one that finished with
    the same config is read back from its result.json, so a rerun or a wider sweep redoes nothing.

    configs: one per encoding (same task), e.g. build_config(preset=..., pe=pe) for each pe.
    """
    if not configs or not seeds:
        raise ValueError(f"configs ({len(configs)}) and {seeds=} must both be non-empty")
    if any(c.task != configs[0].task for c in configs):
        raise ValueError(f"configs must share one task config, got {[c.task for c in configs]}")
    workdir = pathlib.Path(workdir).absolute()
    results = []
    for config in configs:
        for seed in seeds:
            run_config = dataclasses.replace(config, run=dataclasses.replace(config.run, seed=seed))
            run_dir = workdir / config.model.pe / f"seed{seed}"
            finished = _finished_result(run_dir, run_config)
            if finished is not None:
                log.info("%s seed %d finished before with this config: reusing %s", config.model.pe, seed,
                         run_dir / "result.json")
                results.append(finished)
                continue
            log.info("training %s seed %d", config.model.pe, seed)
            results.append(train_and_evaluate(run_config, run_dir))
    metric = results[0]["metric"]
    splits = list(build_task(configs[0]).eval_splits())  # the task's order (result.json sorts its keys)
    rows = evaluate.summarize_seeds(results)
    table = evaluate.results_markdown(rows, metric=metric, splits=splits, label_keys=("pe", "seeds"))
    task_name = configs[0].task.name
    comparison = {"task": task_name, "metric": metric, "splits": splits, "rows": rows, "seeds": list(seeds),
                  "environment": evaluate.environment(), "runs": results}
    if jax.process_index() == 0:
        evaluate.write_json(workdir / "compare.json", comparison)
        (workdir / "compare.md").write_text(f"# {task_name}: {metric}, lower is better\n\n{table}")
        plots.result_bars(rows, metric=metric, splits=splits, path=workdir / "compare.png")
    return {**comparison, "table": table}


def _finished_result(run_dir: pathlib.Path, config: TrainConfig) -> dict[str, Any] | None:
    """result.json of a run in run_dir that finished with `config` (its saved config read back equals it), else None."""
    path = run_dir / "result.json"
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    try:
        saved = from_dict(result["config"])
    except (KeyError, ValueError):
        return None
    return result if saved == config else None
