"""The training batches of several steps at once, as one dispatch of `Trainer.train_steps` reads them.

A Feed hands the loop, for steps first + 1 .. first + n (n at most the K asked for), a source of rows `data`
({name: [N, L]}) on the device and `rows` int32 [K, B] into it: step k < n trains on `data[name][rows[k], :length]`;
the rows of steps n .. K − 1 are padding, never computed (`Trainer.train_steps` loops n times), so every dispatch has
one shape and each length compiles once. A task with a fixed training set (tasks.base.FixedTrainSet, e.g.
counting's 10k programs) is put on the device once and only the row indices travel per dispatch; any other task's
batches are made on the host and sent together, one transfer per dispatch.

Lengths: a dispatch holds steps of one length and ends before a step of another, so that steps compute at their own
length, not at the longest of K batches (at cpu-small, counting's batches pad to 48 but one in 60 to 64, so nearly
every 50-step dispatch cut to its longest would run at 64). A step's own length is its batch's longest scored prefix,
bucketed as run.pad_to says (Trainer.bucket); with a fixed training set the run's lengths are known ahead, and a length
that few of the run's steps need runs at a longer one (tasks.base.planned_lengths: at the paper preset 5 of 2000
batches pad to 480 or 496, the rest to 512, and two more compilations would cost far more than the padding they
save). Batches made on the host run at their own length.

B batch, L length, N rows of the source, K steps (run.steps_per_dispatch), n steps of this dispatch.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxpe.train import distributed
from jaxpe.train.tasks import Task
from jaxpe.train.tasks.base import FixedTrainSet, planned_lengths, scored_lengths


@dataclasses.dataclass(frozen=True)
class Chunk:
    """n steps' batches: `data` {name: [N, L]} and `rows` int32 [K, B] on the device, cut to `length`."""

    data: dict[str, jax.Array]
    rows: jax.Array
    steps: int  # n, the steps of this dispatch (rows past them are padding)
    length: int  # positions computed (static: each length is one compilation)
    tokens: int  # n × B × length, the tokens computed
    real_tokens: int  # the tokens up to each sequence's last scored one


class Feed:
    """Batches of a task for a Trainer, several steps at a time (see the module's docstring)."""

    def __init__(self, trainer: Any, task: Task):
        self.trainer, self.task = trainer, task
        # Several steps a dispatch, one process only (the whole set on every device; several processes each feed
        # their own rows, put_batch): one step a dispatch is the host batch as ever.
        self.on_device = (isinstance(task, FixedTrainSet) and jax.process_count() == 1
                          and trainer.config.run.steps_per_dispatch > 1)
        self._data: dict[str, jax.Array] | None = None
        self._lengths: np.ndarray | None = None
        self._step_lengths: np.ndarray | None = None

    def _device_set(self) -> tuple[dict[str, jax.Array], np.ndarray]:
        """The fixed training set on the device (put there once, replicated) and its rows' scored lengths [N]."""
        if self._data is None:
            arrays = self.task.train_set()
            self._lengths = scored_lengths(arrays["weights"])
            self._data = jax.device_put(dict(arrays), distributed.replicated(self.trainer.mesh))
        return self._data, self._lengths

    def step_lengths(self) -> np.ndarray:
        """int [run.steps]: the length each step of the run computes at, with a fixed training set: its batch's own,
        planned over the whole run (tasks.base.planned_lengths)."""
        if self._step_lengths is None:
            data, lengths = self._device_set()
            full, batch_size = next(iter(data.values())).shape[1], self.trainer.config.optim.batch_size
            rows = (self.task.train_rows(step, batch_size) for step in range(self.trainer.config.run.steps))
            self._step_lengths = planned_lengths([self.trainer.bucket(lengths[r], full) for r in rows])
        return self._step_lengths

    def steps(self, step: int, count: int) -> Chunk:
        """The batches of steps step + 1 .. step + n (task batches step .. step + n − 1): the first `count` of them,
        or fewer where a batch pads to another length than the first one (see the module's docstring)."""
        batch_size, capacity = self.trainer.config.optim.batch_size, self.trainer.config.run.steps_per_dispatch
        if not 1 <= count <= capacity:
            raise ValueError(f"count={count} must be between 1 and run.steps_per_dispatch={capacity}")
        if self.on_device:
            data, lengths = self._device_set()
            full, planned = next(iter(data.values())).shape[1], self.step_lengths()

            def batch_at(k: int) -> tuple[Any, np.ndarray, int]:
                rows = self.task.train_rows(step + k, batch_size)
                return rows, lengths[rows], int(planned[step + k])
        else:
            first = self.task.train_batch(step, batch_size)
            full = first["inputs"].shape[1]

            def batch_at(k: int) -> tuple[Any, np.ndarray, int]:
                batch = first if k == 0 else self.task.train_batch(step + k, batch_size)
                batch_scored = scored_lengths(batch["weights"])
                return batch, batch_scored, self.trainer.bucket(batch_scored, full)
        taken, scored, length = [], [], 0
        for k in range(count):
            item, item_scored, item_length = batch_at(k)
            if k and item_length != length:
                break
            taken.append(item)
            scored.append(item_scored)
            length = item_length
        steps = len(taken)
        self.trainer.note_length("train", length, full)
        rows = np.zeros((capacity, batch_size), np.int32)  # the rows of steps n .. K − 1: never computed
        if self.on_device:
            rows[:steps] = np.stack(taken)
        else:
            rows[:steps] = np.arange(steps * batch_size).reshape(steps, batch_size)
            padding = (capacity - steps) * batch_size
            host = {name: np.concatenate([b[name][:, :length] for b in taken]
                                         + [np.zeros((padding, length), taken[0][name].dtype)])
                    for name in taken[0]}  # [K·B, length]: one shape a length
            data = {name: jax.make_array_from_process_local_data(distributed.replicated(self.trainer.mesh), array,
                                                                 array.shape)
                    for name, array in host.items()}
        rows_on_device = distributed.put_batch({"rows": rows}, self.trainer.mesh, axis=1)["rows"]
        return Chunk(data=data, rows=rows_on_device, steps=steps, length=length,
                     tokens=steps * batch_size * length, real_tokens=int(np.sum(scored)))
