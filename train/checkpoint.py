"""Checkpoints with orbax: asynchronous saves, the last K plus the best, fall back past bad ones.

A checkpoint holds the train state (params, optimizer state, step, RNG key) and a small JSON
`meta` item with the data position. The data position is the step: a task's training batch
is a deterministic function of (task seed, step, batch size), so resuming at step s replays
exactly the batches an uninterrupted run would have seen.
"""
from __future__ import annotations

import logging
import pathlib
import shutil
import sys
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpoints:
    """Saves and restores train states under `directory` (an orbax CheckpointManager).

    keep: latest checkpoints kept; the best by `best_metric` (lower is better) is kept as well.
    """

    def __init__(self, directory: str | pathlib.Path, *, keep: int, best_metric: str, async_save: bool = True):
        if keep < 1:
            raise ValueError(f"{keep=} must be >= 1")
        self.directory = pathlib.Path(directory).absolute()
        try:
            str(self.directory).encode("utf-8")
        except UnicodeEncodeError:  # surrogates: bytes that the file system's encoding could not decode
            raise ValueError(
                f"checkpoint directory {str(self.directory)!r} is no text in the file system's encoding "
                f"({sys.getfilesystemencoding()}): orbax's TensorStore, which writes the checkpoints, takes UTF-8 "
                "paths only; run under a UTF-8 locale (PYTHONUTF8=1, or LC_ALL=C.UTF-8), or use a workdir whose "
                "path is ASCII") from None
        self.best_metric = best_metric
        policy = ocp.checkpoint_managers.AnyPreservationPolicy(
            [
                ocp.checkpoint_managers.LatestN(n=keep),
                ocp.checkpoint_managers.BestN(
                    get_metric_fn=lambda metrics: metrics[best_metric],
                    reverse=True,  # sorted descending, the last (kept) one is the lowest
                    n=1,
                    keep_checkpoints_without_metrics=False,
                ),
            ]
        )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policy, enable_async_checkpointing=async_save, create=True
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def save(self, step: int, state: Any, meta: Mapping[str, Any], metrics: Mapping[str, float] | None = None) -> None:
        """Starts saving (returns before the write ends when async); `metrics` rank it for 'best'."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta)))
        self.manager.save(step, args=args, metrics=dict(metrics) if metrics is not None else None, force=True)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """(state, meta) of the checkpoint at `step`; a ValueError naming it, and why, if it is unreadable."""
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore())
        try:
            restored = self.manager.restore(step, args=args)
        except Exception as error:  # noqa: BLE001 -- any failure to read (orbax's, the file system's, JSON's)
            raise ValueError(f"checkpoint at step {step} in {self.directory} is unreadable "
                             f"({type(error).__name__}: {error})") from error
        return restored["state"], dict(restored["meta"])

    def restore_latest(self, abstract_state: Any, *, quarantine: bool = True, max_step: int | None = None
                       ) -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
        """(state, meta, problems) from the newest readable checkpoint (at most `max_step`), or (None, {}, problems).

        An unreadable checkpoint (partial or corrupt) is reported in `problems`, logged, moved
        to `<directory>/../corrupt_checkpoints/<step>` (so that the run can save that step
        again; only with `quarantine`, which a reader such as jaxpe-eval leaves off), and the
        previous one is tried.
        """
        problems: list[dict[str, Any]] = []
        steps = [s for s in self.manager.all_steps() if max_step is None or s <= max_step]
        for step in sorted(steps, reverse=True):
            try:
                return (*self.restore(step, abstract_state), problems)
            except ValueError as error:  # unreadable: use the previous one
                message = str(error)
                log.warning("%s; falling back to the previous checkpoint", message)
                problems.append({"step": step, "error": message})
                if quarantine:
                    self._quarantine(step)
        return None, {}, problems

    def _quarantine(self, step: int) -> None:
        if jax.process_index() != 0:  # one process moves it; the others only re-read the directory
            self.manager.reload()
            return
        target = self.directory.parent / "corrupt_checkpoints" / str(step)
        if target.exists():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(self.directory / str(step)), str(target))
        self.manager.reload()

    def delete_after(self, step: int) -> list[int]:
        """Deletes the checkpoints past `step` (a run rewound there trains those steps again, and orbax refuses to
        save a step that exists); returns their steps."""
        later = [s for s in self.all_steps() if s > step]
        for s in later:
            self.manager.delete(s)
        return later

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def best_step(self) -> int | None:
        return self.manager.best_step()

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
