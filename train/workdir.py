"""One run per workdir: a lock held for the whole run, and the guard that keeps two runs' state apart.

`WorkdirLock(workdir)` holds an exclusive `fcntl.flock` on `workdir/.jaxpe.lock` (the holder's pid written in it) for
as long as a run writes there; a second writer is refused at once. The kernel drops the lock when its holder dies, so
a killed run never blocks its restart; `locked_workdir` is the block a run writes in (the main process holding the
lock). `check_same_run(workdir, config, task)` refuses a config that differs from the one
saved in `workdir/config.json` in anything but RESUMABLE_FIELDS, whether or not the new run saves checkpoints:
whatever the new run would resume, reuse or leave beside its own results for `jaxpe-eval` was written under the
saved config. Both are compared resolved (`resolved_pair`: every task option, model.vocab_size and model.max_len
filled in), so a config that leaves them unset is the same run as the resolved one a run saves, and as one saved
unresolved. A task read from outside data (lm's corpus, counting's data_dir: `Task.corpus`) leaves its fingerprint in
`corpus.json` (`write_corpus`), and `check_same_corpus` refuses to resume, reuse or read back the run once that data
changed.
`write_json` writes a workdir's JSON files atomically (`write_atomically`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any

from jaxpe.train.config import TrainConfig, load_config, resolve_config, resolve_task, to_dict
from jaxpe.train.tasks import Task
from jaxpe.train.tasks.base import json_object

LOCK_NAME = ".jaxpe.lock"

# Run fields that may change between a run and its resumption: length, bookkeeping, the device layout and how steps
# are dispatched and compiled; batch lengths, steps a dispatch and seeds at once change no metric and no data position.
RESUMABLE_RUN_FIELDS = ("steps", "log_every", "eval_every", "checkpoint_every", "keep", "async_checkpoints",
                        "eval_batch_size", "eval_splits", "num_devices", "fsdp", "progress", "tensorboard",
                        "pad_to", "pad_multiple", "steps_per_dispatch", "seeds_at_once", "compile_ahead")
# Model fields that may change too: how the same maths is computed (model.impl: the attention kernel; model.remat: what
# the backward recomputes). The parameters and optimizer state are the same trees: a run started on a CPU resumes on a
# GPU with impl="triton", or with remat after running out of memory (its steps then equal to float rounding).
RESUMABLE_MODEL_FIELDS = ("impl", "remat")
RESUMABLE_FIELDS = (*(f"run.{name}" for name in RESUMABLE_RUN_FIELDS),
                    *(f"model.{name}" for name in RESUMABLE_MODEL_FIELDS))
# The run fields a finished run's result.json does not depend on (the cadence of logs, evaluations during training and
# checkpoints, the display, how many steps a dispatch): jaxpe-compare reuses a finished run that differs in these only
# (and in RESUMABLE_MODEL_FIELDS).
REUSABLE_RESULT_FIELDS = ("log_every", "eval_every", "checkpoint_every", "keep", "async_checkpoints", "eval_splits",
                          "progress", "tensorboard", "steps_per_dispatch", "seeds_at_once", "compile_ahead")

# What a run leaves in its workdir: one of these without a config.json is state of unknown origin.
RUN_STATE = ("checkpoints", "metrics.jsonl", "result.json")
CORPUS_NAME = "corpus.json"  # the run's Task.corpus, for tasks that have one (write_corpus, check_same_corpus)
NONFINITE_NAME = "nonfinite.json"  # a run stopped by a NaN/inf loss, until it finishes: its error, and its seed


class WorkdirBusyError(RuntimeError):
    """Another live process holds the workdir's lock."""


class WorkdirLock:
    """An exclusive lock on `workdir` for one run (a context manager); WorkdirBusyError names the holder's pid."""

    def __init__(self, workdir: str | os.PathLike):
        self.workdir = workdir_path(workdir)
        self.path = self.workdir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise WorkdirBusyError(f"workdir {str(self.workdir)!r} is in use by another run (pid {holder}); "
                                   "wait for it to end or use another --workdir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock; the file stays (it holds no state)
            self._fd = None

    def __enter__(self) -> WorkdirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def locked_workdir(workdir: pathlib.Path, *, is_main: bool) -> Iterator[None]:
    """The main process creates `workdir` and holds its WorkdirLock for the block; other processes (which write no
    files there) take no lock."""
    if not is_main:
        yield
        return
    workdir.mkdir(parents=True, exist_ok=True)
    with WorkdirLock(workdir):
        yield


def write_atomically(path: pathlib.Path, text: str) -> None:
    """Writes `text` to `path` atomically (a file beside it, then a rename): a kill leaves the old file or the new."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def write_json(path: pathlib.Path, data: Any) -> None:
    """Writes `data` as indented JSON, atomically (write_atomically)."""
    write_atomically(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def resolved_pair(saved: TrainConfig, new: TrainConfig, task: Task) -> tuple[TrainConfig, TrainConfig]:
    """`saved` and `new` resolved for comparing: `new` with `task` (the task it names, resolve_config), `saved` with
    its task options filled in, and with `task` too when that makes its task the same (else that is the difference;
    a saved option the task no longer has is left as it is, a difference)."""
    new = resolve_config(new, task)
    try:
        saved = dataclasses.replace(saved, task=resolve_task(saved.task))
    except (TypeError, ValueError):
        return saved, new
    return (resolve_config(saved, task) if saved.task == new.task else saved), new


def config_differences(saved: TrainConfig, new: TrainConfig, task: Task) -> list[str]:
    """`key: old -> new` for every field, except RESUMABLE_FIELDS, in which the two configs differ, once both are
    resolved (resolved_pair)."""
    saved, new = resolved_pair(saved, new, task)
    old, now = _flat(to_dict(saved)), _flat(to_dict(new))
    changed = sorted(k for k in old.keys() | now.keys() if k not in RESUMABLE_FIELDS and old.get(k) != now.get(k))
    return [f"{k}: {old.get(k, '<unset>')!r} -> {now.get(k, '<unset>')!r}" for k in changed]


def write_corpus(workdir: pathlib.Path, task: Task) -> None:
    """Saves the task's `corpus` (source and fingerprint of its data) in workdir/corpus.json; nothing for a task
    without one (its data is generated from its options)."""
    corpus = getattr(task, "corpus", None)
    if corpus is not None:
        write_json(workdir / CORPUS_NAME, corpus)


def check_same_corpus(workdir: pathlib.Path, task: Task) -> None:
    """ValueError when workdir/corpus.json holds another fingerprint than `task.corpus`'s: the run's data (its
    documents' names or contents) changed since the run began. A corpus.json without "hash", saved when fingerprints
    hashed names and sizes only, is checked against `task.names_fingerprint`, that kind. A task without `corpus`, or
    a run that saved none (written before runs did), passes."""
    corpus, path = getattr(task, "corpus", None), workdir / CORPUS_NAME
    if corpus is None or not path.is_file():
        return
    saved = json_object(path.read_text(encoding="utf-8", errors="replace"), f"{str(path)!r}")
    if "hash" in saved:
        now, kind = corpus["fingerprint"], "names and contents"
    else:
        now, kind = getattr(task, "names_fingerprint", None), "names and sizes (saved before they hashed contents)"
    if saved.get("fingerprint") != now:
        remedy = "restore that data to resume the run, or use a new workdir"
        if "python" in corpus:  # the data comes with the interpreter: another Python reads other data
            began = f"Python {saved['python']}" if "python" in saved else "another Python (or this one's files changed)"
            remedy = (f"that data comes with the Python that runs the command, here {corpus['python']}, and the run "
                      f"began under {began}: resume it with that Python, or use a new workdir"
                      if saved.get("python") != corpus["python"] else
                      f"that data comes with Python {corpus['python']}, whose files changed since the run began; "
                      "use a new workdir")
        raise ValueError(
            f"the corpus of the run in {str(workdir)!r} changed: {corpus['option']}={corpus['source']!r} now gives "
            f"fingerprint {str(now)[:12]} ({corpus['bytes']} bytes), the run began on "
            f"{str(saved.get('fingerprint'))[:12]} ({saved.get('bytes')} bytes; fingerprints hash the documents' "
            f"{kind}, {CORPUS_NAME}); {remedy}")


def check_outside_data(workdir: pathlib.Path, task: Task) -> None:
    """ValueError when `workdir` is a directory of the task's outside data (`Task.corpus`'s source) or inside one:
    the run's own files (metrics.jsonl, result.md...) would join its data, and change its fingerprint."""
    corpus = getattr(task, "corpus", None)
    if corpus is None:
        return
    sources = corpus["source"] if isinstance(corpus["source"], list) else [corpus["source"]]
    for source in map(pathlib.Path, sources):
        if source.is_dir() and workdir.resolve().is_relative_to(source.resolve()):
            raise ValueError(f"workdir {str(workdir)!r} is inside {corpus['option']}={str(source)!r}: the run's own "
                             "files would become its data; use a workdir outside it")


def checkpoint_steps(workdir: pathlib.Path) -> list[int]:
    """The steps of the checkpoint directories in workdir/checkpoints (readable or not), ascending."""
    directory = workdir / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def holds_run_state(workdir: pathlib.Path) -> bool:
    """Whether a run left anything in `workdir` beside its config.json and corpus.json: a checkpoint, a result.json
    or a metrics.jsonl record (a run that failed before its first step leaves an empty one)."""
    metrics = workdir / "metrics.jsonl"
    return bool(checkpoint_steps(workdir) or (workdir / "result.json").exists()
                or metrics.is_file() and metrics.stat().st_size)


def workdir_path(workdir: str | os.PathLike, argument: str = "workdir") -> pathlib.Path:
    """`workdir`, a Python entry point's `argument`, as an absolute path: a TypeError naming the argument when it is
    no path (None, a number, a list), a ValueError when it is '' (it would be the current directory, as --workdir ''
    would, which the command line refuses)."""
    if not isinstance(workdir, (str, os.PathLike)):
        raise TypeError(f"{argument}={workdir!r:.80} must be a path (a str or a pathlib.Path)")
    if workdir == "":
        raise ValueError(f"{argument}='' names no directory; give a path ('.' for the current directory)")
    return pathlib.Path(workdir).absolute()


def check_workdir(workdir: pathlib.Path) -> None:
    """ValueError when `workdir` exists but is not a directory."""
    if workdir.exists() and not workdir.is_dir():
        raise ValueError(f"workdir {str(workdir)!r} exists and is not a directory; give a directory (new or a run's)")


def check_workdir_kind(workdir: pathlib.Path, *, comparison: bool) -> None:
    """ValueError when `workdir` holds the other kind of workdir than asked for: a comparison's root (jaxpe-compare:
    compare.json, or runs in <pe>/seed<n>/) where one run goes, or one run's (jaxpe-train: config.json) where a
    comparison goes. Mixed, one command's files would overwrite or hide the other's."""
    if comparison and (workdir / "config.json").is_file():
        raise ValueError(f"workdir {str(workdir)!r} holds the run of a jaxpe-train command (config.json): a comparison "
                         "needs a workdir of its own")
    if not comparison and ((workdir / "compare.json").is_file() or any(workdir.glob("*/seed*/config.json"))):
        raise ValueError(f"workdir {str(workdir)!r} holds a comparison (jaxpe-compare: compare.json or "
                         "<pe>/seed<n>/ runs): give a run a workdir of its own")


def check_same_run(workdir: pathlib.Path, config: TrainConfig, task: Task) -> None:
    """ValueError when `workdir` holds state of a run (holds_run_state: a config.json alone, left by a run that failed
    before its first step, is replaced) whose config (config.json) differs from `config` (both
    resolved with `task`, the one `config` names) in anything but RESUMABLE_FIELDS, or run state without a
    config.json, or a checkpoint past `config.run.steps` that the run would resume, or checkpoints that a run without
    checkpointing (run.checkpoint_every=0) would leave behind, or a run on a corpus that changed since
    (check_same_corpus). The saved config is read back first, so that a field added since it was written (with its
    default) is no difference. A workdir inside the task's data is refused too (check_outside_data)."""
    check_workdir(workdir)
    check_workdir_kind(workdir, comparison=False)
    check_outside_data(workdir, task)
    path = workdir / "config.json"
    if not path.is_file():
        present = [name for name in RUN_STATE if (workdir / name).exists()]
        if present:
            raise ValueError(f"workdir {str(workdir)!r} holds {', '.join(present)} but no config.json: state of an "
                             "unknown run; use a new workdir")
        return
    if not holds_run_state(workdir):  # a run that stopped before its first record: nothing to resume or mix with
        return
    differences = config_differences(load_config(path), config, task)
    if differences:
        raise ValueError(f"workdir {str(workdir)!r} holds a run with another config ({', '.join(differences)}); "
                         "use a new workdir, or the saved config (--config <workdir>/config.json) to resume it")
    check_same_corpus(workdir, task)
    steps = checkpoint_steps(workdir)
    if steps and not config.run.checkpoint_every:
        raise ValueError(f"workdir {str(workdir)!r} holds checkpoints (up to step {steps[-1]}) that "
                         "run.checkpoint_every=0 would neither resume nor replace; set run.checkpoint_every > 0 to "
                         "resume them, or use a new workdir")
    if steps and steps[-1] > config.run.steps:
        raise ValueError(f"run.steps={config.run.steps} is below the checkpoint at step {steps[-1]} in "
                         f"{str(workdir / 'checkpoints')!r}; set run.steps >= {steps[-1]} to resume it, or use a "
                         "new workdir")
