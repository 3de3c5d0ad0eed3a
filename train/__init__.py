"""jaxpe's training package: tasks, an optax loop with orbax checkpoints, evaluation, a CLI.

    from jaxpe.train import build_config, train_and_evaluate
    config = build_config(preset="cpu-small", task="flipflop", pe="cope", overrides=["run.steps=200"])
    result = train_and_evaluate(config, "runs/ff-cope")

Modules: config (TrainConfig, whose `model` is jaxpe.ModelConfig, and the task and model it names), step (train
state, loss, train_step), trainer (jit and sharding; seeds stacked as one program), feed (several steps' batches a
dispatch, a fixed training set kept on the device), loop (the loop and its hooks), experiments (train_and_evaluate,
train_seeds, restore_run, evaluate_checkpoint, compare_encodings), evaluate (metrics and evaluation), tables (how
results are shown: intervals, Markdown), report (the tables' command line), workdir (one run per workdir),
checkpoint, distributed, tasks, plots, cli.
"""
from jaxpe.train.checkpoint import Checkpoints
from jaxpe.train.config import (ModelConfig, OptimConfig, RunConfig, TaskConfig, TrainConfig, apply_overrides,
                                build_config, build_model, build_task, format_config, load_config, load_preset,
                                preset_names)
from jaxpe.train.distributed import initialize, make_mesh, split_host_cpu
from jaxpe.train.evaluate import METRICS, compute_metrics, metrics_from_sums
from jaxpe.train.tasks import TASK_NAMES, make_task
from jaxpe.train.step import TrainState, make_optimizer, make_train_step, weighted_loss
from jaxpe.train.trainer import Trainer
from jaxpe.train.loop import NonFiniteLossError, TimeLimitReached
from jaxpe.train.experiments import (Run, compare_encodings, evaluate_checkpoint, restore_run, train_and_evaluate,
                                     train_seeds)

__all__ = [
    "METRICS", "Checkpoints", "ModelConfig", "NonFiniteLossError", "OptimConfig", "Run", "RunConfig", "TaskConfig",
    "TASK_NAMES", "TrainConfig", "TrainState", "Trainer", "apply_overrides", "build_config", "build_model",
    "build_task", "compare_encodings", "compute_metrics", "evaluate_checkpoint", "format_config", "initialize",
    "load_config", "load_preset", "make_mesh", "make_optimizer", "make_task", "make_train_step", "metrics_from_sums",
    "preset_names", "restore_run", "split_host_cpu", "TimeLimitReached", "train_and_evaluate", "train_seeds",
    "weighted_loss",
]
