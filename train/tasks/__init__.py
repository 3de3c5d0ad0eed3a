"""Tasks by name: `make_task("counting", nvars=3)` builds a task from its options."""

from __future__ import annotations

from typing import Any

from jaxpe.train.tasks.base import Batch, Split, Task, config_from_options
from jaxpe.train.tasks.counting import CountingConfig, CountingTask, read_jsonl, write_jsonl
from jaxpe.train.tasks.flipflop import FlipFlopConfig, FlipFlopTask
from jaxpe.train.tasks.lm import LMConfig, LMTask
from jaxpe.train.tasks.selective_copy import SelectiveCopyConfig, SelectiveCopyTask

TASKS: dict[str, tuple[type, type]] = {  # name -> (config dataclass, task class)
    "counting": (CountingConfig, CountingTask),
    "flipflop": (FlipFlopConfig, FlipFlopTask),
    "selective_copy": (SelectiveCopyConfig, SelectiveCopyTask),
    "lm": (LMConfig, LMTask),
}
TASK_NAMES: tuple[str, ...] = tuple(TASKS)


def task_config_class(name: str) -> type:
    """The frozen config dataclass of task `name` (its fields are the task's options)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASK_NAMES)}")
    return TASKS[name][0]


def make_task(name: str, **options: Any) -> Task:
    """Task `name` built from its options; an unknown name or option is a ValueError naming it."""
    config_cls = task_config_class(name)
    return TASKS[name][1](config_from_options(config_cls, name, options))


__all__ = ["TASKS", "TASK_NAMES", "Batch", "CountingConfig", "CountingTask", "FlipFlopConfig", "FlipFlopTask",
           "LMConfig", "LMTask", "SelectiveCopyConfig", "SelectiveCopyTask", "Split", "Task", "make_task", "read_jsonl",
           "task_config_class", "write_jsonl"]
