"""The training batches of several steps at once, as one dispatch of `Trainer.train_steps` reads them.

A Feed hands the loop, for steps first + 1 .. first + K, a source of rows `data` ({name: [N, L]}) on the device and
`rows` int32 [K, B] into it: step k trains on `data[name][rows[k], :length]`. A task with a fixed training set
(tasks.base.FixedTrainSet, e.g. counting's 10k programs) is put on the device once and only the row indices travel
per dispatch; any other task's K batches are made on the host and sent together, one transfer per dispatch. The
length of a dispatch is the longest scored prefix among its K batches, bucketed as run.pad_to says (Trainer.pad),
so that a dispatch computes what K separate steps would, up to their padding.

B batch, L length, N rows of the source, K steps.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxpe.train import distributed
from jaxpe.train.tasks import Task
from jaxpe.train.tasks.base import FixedTrainSet, bucket_length, scored_lengths


@dataclasses.dataclass(frozen=True)
class Chunk:
    """K steps' batches: `data` {name: [N, L]} and `rows` int32 [K, B] on the device, cut to `length`."""

    data: dict[str, jax.Array]
    rows: jax.Array
    length: int  # positions computed (static: each length is one compilation)
    tokens: int  # K × B × length, the tokens computed
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

    def _device_set(self) -> tuple[dict[str, jax.Array], np.ndarray]:
        """The fixed training set on the device (put there once, replicated) and its rows' scored lengths [N]."""
        if self._data is None:
            arrays = self.task.train_set()
            self._lengths = scored_lengths(arrays["weights"])
            self._data = jax.device_put(dict(arrays), distributed.replicated(self.trainer.mesh))
        return self._data, self._lengths

    def steps(self, step: int, count: int) -> Chunk:
        """The batches of steps step + 1 .. step + count (task batches step .. step + count - 1)."""
        batch_size, run = self.trainer.config.optim.batch_size, self.trainer.config.run
        mesh = self.trainer.mesh
        if self.on_device:
            data, lengths = self._device_set()
            rows = np.stack([self.task.train_rows(step + k, batch_size) for k in range(count)])  # [K, B]
            scored = lengths[rows]  # [K, B]
        else:
            batches = [self.task.train_batch(step + k, batch_size) for k in range(count)]
            scored = np.stack([scored_lengths(b["weights"]) for b in batches])  # [K, B]
            rows = np.arange(count * batch_size).reshape(count, batch_size)
        full = next(iter(data.values())).shape[1] if self.on_device else batches[0]["inputs"].shape[1]
        length = bucket_length(int(scored.max(initial=0)), full, pad_to=self.trainer.pad_to,
                               multiple=run.pad_multiple)
        self.trainer.note_length("train", length, full)
        if not self.on_device:
            host = {name: np.concatenate([b[name][:, :length] for b in batches]) for name in batches[0]}  # [K·B, L]
            data = {name: jax.make_array_from_process_local_data(distributed.replicated(mesh), array, array.shape)
                    for name, array in host.items()}
        rows = distributed.put_batch({"rows": rows.astype(np.int32)}, mesh, axis=1)["rows"]
        return Chunk(data=data, rows=rows, length=length, tokens=count * batch_size * length,
                     real_tokens=int(scored.sum()))
