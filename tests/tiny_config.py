"""The tiny training config the train tests share: a real jaxpe model on short flip-flop sequences that compiles in
seconds on a CPU; and jaxpe-train on it in a subprocess, with a wait for what that process writes."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable

from jaxpe.train.config import TrainConfig, build_config

TINY = [
    "task.seq_len=16", "task.n_eval=24", "model.d_model=16", "model.num_layers=1", "model.num_heads=2",
    "model.max_len=16", "optim.batch_size=16", "optim.warmup_steps=2", "optim.learning_rate=3e-3",
    "run.log_every=1", "run.eval_every=0", "run.checkpoint_every=0", "run.eval_batch_size=16",
    "run.progress=false", "run.num_devices=1",
]
ROOT = pathlib.Path(__file__).resolve().parents[1]
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
CLI = "import sys; from jaxpe.train.cli import train_main; sys.exit(train_main(sys.argv[1:]))"


def tiny(*overrides: str, pe: str = "rope") -> TrainConfig:
    """The tiny flip-flop config with `pe` and `key=value` overrides on top."""
    return build_config(task="flipflop", pe=pe, overrides=[*TINY, *overrides])


def cli_command(workdir: pathlib.Path, *overrides: str) -> list[str]:
    """jaxpe-train of the tiny config (rope) in `workdir`, `key=value` overrides on top."""
    # -P: the working directory (the checkout's root when pytest runs there) not on sys.path, as for jaxpe-train
    return [sys.executable, "-P", "-c", CLI, "--task", "flipflop", "--pe", "rope", "--workdir", str(workdir),
            *TINY, *overrides]


def cli_env(**extra: str) -> dict[str, str]:
    """This process's environment, `extra` set: the child imports jaxpe from where this process does (an editable
    install, or a wheel in site-packages). The checkout on PYTHONPATH would put its jaxpe/ folder, which lacks
    jaxpe.kernels and jaxpe.train (kernels/ and train/ beside it), before an installed wheel's."""
    return {**os.environ, **extra}


def xla_flags(devices: int) -> str:
    """This process's XLA_FLAGS (the suite's compile-fast settings, conftest.py) with `devices` host devices: a
    subprocess given only the device count compiles at XLA's defaults, several times slower."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    return " ".join([*kept, f"{DEVICE_COUNT_FLAG}={devices}"])


def wait_for(condition: Callable[[], bool], process: subprocess.Popen, what: str, timeout: float = 600) -> None:
    """Returns once `condition()` holds (a file the process writes); fails naming `what` if the process ends first
    (with its output) or `timeout` seconds pass, a bound for a slow machine, not a pace the test relies on."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the process ended before {what}: {process.communicate()}"
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.02)
