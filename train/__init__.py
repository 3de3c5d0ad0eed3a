"""jaxpe's training package: tasks, an optax loop with orbax checkpoints, evaluation, a CLI.

    from jaxpe.train import build_config, train_and_evaluate
    config = build_config(preset="cpu-small", task="flipflop", pe="cope", overrides=["run.steps=200"])
    result = train_and_evaluate(config, "runs/ff-cope")
"""
from jaxpe.train.checkpoint import Checkpoints
from jaxpe.train.config import (
    ModelConfig,
    OptimConfig,
    RunConfig,
    TaskConfig,
    TrainConfig,
    apply_overrides,
    build_config,
    format_config,
    load_config,
    load_preset,
    preset_names,
)
from jaxpe.train.distributed import initialize, make_mesh
from jaxpe.train.evaluate import METRICS, metrics_from_sums
from jaxpe.train.tasks import TASK_NAMES, make_task
from jaxpe.train.loop import (
    NonFiniteLossError,
    Trainer,
    TrainState,
    compare_encodings,
    evaluate_checkpoint,
    make_optimizer,
    make_train_step,
    train_and_evaluate,
    weighted_loss,
)

__all__ = [
    "METRICS", "Checkpoints", "ModelConfig", "NonFiniteLossError", "OptimConfig", "RunConfig", "TaskConfig",
    "TASK_NAMES", "TrainConfig", "TrainState", "Trainer", "apply_overrides", "build_config", "compare_encodings",
    "evaluate_checkpoint", "format_config", "initialize", "load_config", "load_preset", "make_mesh", "make_optimizer",
    "make_task", "make_train_step", "metrics_from_sums", "preset_names", "train_and_evaluate", "weighted_loss",
]
