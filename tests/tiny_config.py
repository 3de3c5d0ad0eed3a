"""The tiny training config the train tests share: a real jaxpe model on short flip-flop sequences that compiles in
seconds on a CPU."""
from __future__ import annotations

from jaxpe.train.config import TrainConfig, build_config

TINY = [
    "task.seq_len=16", "task.n_eval=24", "model.d_model=16", "model.num_layers=1", "model.num_heads=2",
    "model.max_len=16", "optim.batch_size=16", "optim.warmup_steps=2", "optim.learning_rate=3e-3",
    "run.log_every=1", "run.eval_every=0", "run.checkpoint_every=0", "run.eval_batch_size=16",
    "run.progress=false", "run.num_devices=1",
]


def tiny(*overrides: str, pe: str = "rope") -> TrainConfig:
    """The tiny flip-flop config with `pe` and `key=value` overrides on top."""
    return build_config(task="flipflop", pe=pe, overrides=[*TINY, *overrides])
