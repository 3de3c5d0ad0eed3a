"""The training entry point's one nested config, presets and `key=value` overrides.

`TrainConfig{task, model, optim, run}` is a tree of frozen dataclasses; `model` is jaxpe's own
`ModelConfig`, its vocabulary size and maximum length left None for the trainer to take from the
task. It is built from the defaults (or a run's saved `config.json`), then a preset (a name from
the package's `presets/`, or a path to a JSON file), then `--task`/`--pe`, then `key=value`
overrides such as `model.num_layers=2`, `task.nvars=3` or `model.pe_options.npos=32`. Every
override is parsed against the field's type; an unknown key or a value of the wrong type raises
ValueError naming the key. The values of one step (a preset, a list of overrides) are set
together, so that checks across fields (d_model against num_heads) see them all. Every error names a key as the
command line writes it (`model.d_model=64 must be a multiple of model.num_heads=3`, `task.seed='abc' must be an
int`), whatever words the class that checks it (jaxpe.ModelConfig, a task's config) uses for itself.
`format_config` prints a resolved config with the comment of every field. `build_task` and `build_model` make what
a config names: its task, and its model with the vocabulary and length filled in from the task.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib.resources
import inspect
import io
import json
import math
import numbers
import os
import pathlib
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from importlib.resources.abc import Traversable
from typing import Any

import numpy as np

from jaxpe.model import ModelConfig, TransformerLM
from jaxpe.registry import pe_config, pe_names
from jaxpe.train.tasks import TASK_NAMES, Task, make_task, task_config_class
from jaxpe.train.tasks.base import PAD_TO, config_from_options, json_object

COMPILE_AHEAD = ("auto", "on", "off")  # run.compile_ahead: when Trainer.compile_ahead compiles the eval steps early


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    name: str = "flipflop"  # a jaxpe.train.tasks registry name (counting, flipflop, selective_copy, lm)
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # make_task(name, **options)


def _check_at_least(config: object, section: str, names: Sequence[str], minimum: int | None, *,
                    integer: bool) -> None:
    """TypeError unless each field `names` of `config` is an int (`integer`) or a real number that float32 holds
    (a bool is neither; check_float32), ValueError unless it is >= `minimum` (None: any); each error names
    `section`.field and its value."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
            raise TypeError(f"{section}.{name}={value!r} must be {'an int' if integer else 'a number'}")
        if not integer:
            check_float32(f"{section}.{name}", value)
        if minimum is not None and value < minimum:
            raise ValueError(f"{section}.{name}={value!r} must be >= {minimum}")


FLOAT32 = np.finfo(np.float32)  # the dtype the device computes the float settings in


def check_float32(key: str, value: float) -> None:
    """ValueError naming `key` unless the real number `value` is finite and float32, in which the device computes
    with it, keeps it: within float32's range (|value| <= 3.4e38, else it becomes inf) and, when nonzero, not
    rounded to 0 (|value| >= 1.4e-45)."""
    if not math.isfinite(value):
        raise ValueError(f"{key}={value!r} must be a finite number")
    with np.errstate(over="ignore", under="ignore"):
        single = np.float32(value)
    if not np.isfinite(single):
        raise ValueError(f"{key}={value!r} is past float32's range (|x| <= {FLOAT32.max:.4g}), in which the device "
                         "computes with it: it would be inf")
    if value and not single:
        raise ValueError(f"{key}={value!r} rounds to 0 in float32, in which the device computes with it; use 0 or "
                         f"a value of magnitude >= {FLOAT32.smallest_subnormal:.2g}")


def _check_float32_fields(node: Any, prefix: str) -> None:
    """check_float32 on every field of the dataclass `node` annotated float that holds a number (a bool, None or a
    string is none), each named prefix + field."""
    hints = typing.get_type_hints(type(node))
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if float in _options(hints[field.name]) and isinstance(value, numbers.Real) and not isinstance(value, bool):
            check_float32(f"{prefix}{field.name}", value)


MAX_SEED = 2**31 - 1  # the largest run.seed: int32, as the seeds a program stacks are
MAX_STEPS = 2**31 - 1  # the largest run.steps: the state's step counter is int32


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    batch_size: int = 32  # global batch (sequences per optimizer step, over all devices and hosts)
    learning_rate: float = 1e-3  # peak learning rate after warmup
    warmup_steps: int = 100  # linear warmup from 0 to learning_rate
    min_lr_ratio: float = 0.1  # cosine decay ends at learning_rate * min_lr_ratio
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    b1: float = 0.9  # Adam first-moment decay
    b2: float = 0.98  # Adam second-moment decay
    eps: float = 1e-9  # Adam epsilon
    clip_norm: float = 1.0  # global gradient-norm clipping threshold
    grad_accum: int = 1  # micro-batches per step (batch_size must divide evenly)

    def __post_init__(self):
        _check_at_least(self, "optim", ("batch_size", "grad_accum"), 1, integer=True)
        _check_at_least(self, "optim", ("warmup_steps",), 0, integer=True)
        _check_at_least(self, "optim", ("learning_rate", "weight_decay", "eps", "clip_norm"), 0, integer=False)
        _check_at_least(self, "optim", ("min_lr_ratio", "b1", "b2"), None, integer=False)  # ranges below
        if self.batch_size % self.grad_accum:
            raise ValueError(f"optim.batch_size={self.batch_size} must be a multiple of "
                             f"optim.grad_accum={self.grad_accum}")
        if self.clip_norm <= 0:
            raise ValueError(f"optim.clip_norm={self.clip_norm!r} must be > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio={self.min_lr_ratio!r} must be in [0, 1] "
                             "(a fraction of learning_rate)")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optim.{name}={getattr(self, name)!r} must be in [0, 1)")
        if self.eps <= 0:
            raise ValueError(f"optim.eps={self.eps!r} must be > 0")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    steps: int = 1000  # optimizer steps in total
    seed: int = 0  # parameter init and dropout seed (the task has its own seed in task.options)
    log_every: int = 50  # steps between metrics lines (metrics.jsonl) and NaN checks
    eval_every: int = 500  # steps between evaluations (0 = only at the end)
    checkpoint_every: int = 500  # steps between checkpoints (0 = no checkpoints)
    keep: int = 2  # latest checkpoints kept (the best one by the eval metric is kept too)
    async_checkpoints: bool = True  # orbax saves in a background thread
    eval_batch_size: int = 64  # sequences per evaluation batch (global)
    eval_splits: tuple[str, ...] = ()  # splits evaluated during training; () = all (the final eval always uses all)
    # batch length: "multiple" pads each batch to its longest sequence rounded up to a multiple of pad_multiple,
    # "pow2" to pad_multiple times a power of two, "block" to the task's full length L (one shape, as before); never
    # past L. The same loss and metrics (only counting has padding to cut); dropout masks are drawn for the shape
    pad_to: str = "multiple"
    pad_multiple: int = 16  # bucket step of pad_to="multiple", the shortest bucket of "pow2"
    num_devices: int = 0  # devices in the data-parallel mesh; 0 = all (on one CPU: the most that divide the batches)
    fsdp: bool = False  # shard params and optimizer state over the "data" axis instead of replicating
    # optimizer steps per dispatch (one jitted loop; a dispatch ends early where logging, evaluation or a checkpoint
    # is due, or before a batch of another padded length); above 1, a task with a fixed training set (counting) keeps
    # it on the device
    steps_per_dispatch: int = 1
    # stacked seeds (jaxpe-compare --seeds) a step computes side by side (vmap), the groups of them in turn in the same
    # program; 0 = auto: one on a CPU (each seed's arrays stay cache-sized), all on an accelerator (filling it)
    seeds_at_once: int = 0
    # compile the evaluation steps in a background thread while training runs (Trainer.compile_ahead): "auto" on
    # accelerators (their host is idle), "on" on a CPU too, "off" never
    compile_ahead: str = "auto"
    progress: bool = True  # tqdm progress bar
    tensorboard: bool = True  # TensorBoard event files in workdir/tb/ if tensorboardX is installed (jaxpe[tensorboard])

    def __post_init__(self):
        _check_at_least(self, "run", ("steps", "log_every", "keep", "eval_batch_size", "pad_multiple",
                                      "steps_per_dispatch"), 1,
                        integer=True)
        _check_at_least(self, "run", ("eval_every", "checkpoint_every", "num_devices", "seed", "seeds_at_once"), 0,
                        integer=True)
        if self.seed > MAX_SEED:  # stacked seeds are int32, and PRNGKey keeps 32 bits of a seed: 2^32 is seed 0
            raise ValueError(f"run.seed={self.seed} must be <= {MAX_SEED} (seeds are 32-bit)")
        if self.steps > MAX_STEPS:
            raise ValueError(f"run.steps={self.steps} must be <= {MAX_STEPS} (the step counter is 32-bit)")
        for name in ("async_checkpoints", "fsdp", "progress", "tensorboard"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"run.{name}={getattr(self, name)!r} must be a bool")
        if self.pad_to not in PAD_TO:
            raise ValueError(f"run.pad_to={self.pad_to!r} must be one of {', '.join(PAD_TO)}")
        if self.compile_ahead not in COMPILE_AHEAD:
            raise ValueError(f"run.compile_ahead={self.compile_ahead!r} must be one of {', '.join(COMPILE_AHEAD)}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)  # which data
    # which network: jaxpe.ModelConfig; vocab_size and max_len None = the task's vocabulary and longest sequence
    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(max_len=None))
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)  # how to fit it
    run: RunConfig = dataclasses.field(default_factory=RunConfig)  # how long, how often, where

    def __post_init__(self):
        for name, section in typing.get_type_hints(TrainConfig).items():  # TrainConfig(run={"steps": 5}) in a notebook
            if not isinstance(getattr(self, name), section):
                raise TypeError(f"TrainConfig's {name}={getattr(self, name)!r} must be a {section.__name__}; a config "
                                "from nested dicts is jaxpe.train.config.from_dict({...}), or build_config(overrides="
                                f"['{name}.<field>=<value>'])")
        # the model's float fields and its encoding's options (the optimizer's are OptimConfig's own check)
        _check_float32_fields(self.model, "model.")
        _check_float32_fields(self.model.pe_config, "model.pe_options.")
        if not self.model.causal:
            raise ValueError("model.causal=False: every task trains next-token prediction, which bidirectional "
                             "attention would answer by reading the target; keep model.causal=true (encoder "
                             "layers are for models of your own)")
        half = [f"model.{name}=float16" for name in ("dtype", "param_dtype") if getattr(self.model, name) == "float16"]
        if half:
            raise ValueError(f"{', '.join(half)}: float16 training needs loss scaling (its gradients underflow), "
                             "which jaxpe.train does not do; use bfloat16 (float32 weights) or float32")


def _packaged_presets() -> Traversable:
    """The presets/ folder shipped inside the jaxpe.train package (works from a wheel or a zip)."""
    return importlib.resources.files("jaxpe.train") / "presets"


def preset_names() -> tuple[str, ...]:
    """Names of the presets shipped with jaxpe (train/presets/*.json)."""
    files = _packaged_presets().iterdir()
    return tuple(sorted(p.name.removesuffix(".json") for p in files if p.name.endswith(".json")))


def load_preset(name: str) -> dict[str, Any]:
    """The preset's nested dict: sections task/model/optim/run, tasks: {task name: options} and
    encodings: {pe name: pe_options}, the last two applied only to the chosen task and encoding.

    `name` is a packaged preset (preset_names()) or else a path to a JSON file (one that ends in .json or exists).
    """
    if name in preset_names():
        text = (_packaged_presets() / f"{name}.json").read_text(encoding="utf-8")
    elif name.endswith(".json") or os.path.isfile(name):
        text = _read_text(name, f"preset file {name!r}")
    else:
        raise ValueError(f"preset {name=} not found; choose one of {preset_names()} or give a path to a .json file")
    return json_object(text, f"preset {name!r}")


def load_config(path: str | os.PathLike) -> TrainConfig:
    """The TrainConfig saved in a run's workdir (`config.json`, written by train_and_evaluate)."""
    text = _read_text(path, f"config file {str(path)!r}")
    return from_dict(json_object(text, f"config file {str(path)!r}"))


def _read_text(path: str | os.PathLike, what: str) -> str:
    """The UTF-8 text of the file at `path`; ValueError starting with `what` when it cannot be read or decoded."""
    try:
        return pathlib.Path(path).read_text(encoding="utf-8-sig")  # a byte order mark (Windows editors) skipped
    except OSError as error:
        raise ValueError(f"{what} cannot be read: {error.strerror}") from error
    except UnicodeDecodeError as error:
        raise ValueError(f"{what} is not UTF-8 text ({error})") from None


def build_config(
    *,
    config: TrainConfig | None = None,
    preset: str | None = None,
    task: str | None = None,
    pe: str | None = None,
    overrides: Sequence[str] = (),
) -> TrainConfig:
    """`config` (default: the defaults; e.g. a saved one from load_config), then the preset, then task and pe,
    then `key=value` overrides (last wins).

    A task or pe that differs from the one already set starts from that task's (encoding's) default options,
    then the preset's per-task (per-encoding) options.
    """
    config = TrainConfig() if config is None else config
    preset_tasks: Mapping[str, Any] = {}
    preset_encodings: Mapping[str, Any] = {}
    if preset is not None:
        data = load_preset(preset)
        preset_tasks = data.pop("tasks", {})
        preset_encodings = data.pop("encodings", {})
        for key, names, known in (("tasks", preset_tasks, TASK_NAMES), ("encodings", preset_encodings, pe_names())):
            if not isinstance(names, Mapping):
                raise ValueError(f"preset {preset!r}: {key!r} must map names to their options, got {names!r}")
            if unknown := sorted(str(name) for name in names if name not in known):
                raise ValueError(f"preset {preset!r}: {key!r} names unknown {key[:-1]}(s) {unknown}; "
                                 f"choose from {', '.join(known)}")
        config = apply_dict(config, {k: v for k, v in data.items() if not k.startswith("_")})
    if task is not None and task != config.task.name:
        config = apply_dict(dataclasses.replace(config, task=TaskConfig()), {"task": {"name": task}})
    if config.task.name in preset_tasks:
        config = apply_dict(config, {"task": {"options": preset_tasks[config.task.name]}})
    if pe is not None and pe != config.model.pe:
        config = apply_dict(dataclasses.replace(config, model=dataclasses.replace(config.model, pe_options={})),
                            {"model": {"pe": pe}})
    if config.model.pe in preset_encodings:
        config = apply_dict(config, {"model": {"pe_options": preset_encodings[config.model.pe]}})
    return apply_overrides(config, overrides)


def apply_overrides(config: TrainConfig, overrides: Sequence[str]) -> TrainConfig:
    """Applies `section.field=value` strings (last wins), all together; ValueError names a bad key or value."""
    if isinstance(overrides, str):  # a string is a sequence too: of one-character "overrides"
        raise TypeError(f"overrides={overrides!r} must be a list of key=value strings, e.g. [{overrides!r}]")
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like key=value (e.g. model.num_layers=2)")
        *sections, name = key.strip().split(".")
        node = tree
        for section in sections:
            if not isinstance(node.get(section), dict):
                node[section] = {}
            node = node[section]
        node[name] = text.strip()
    return _apply(config, tree, "", parse=True)


def apply_dict(config: TrainConfig, values: Mapping[str, Any]) -> TrainConfig:
    """Applies a nested dict of already-typed values (a preset, a saved config); ValueError names a bad key."""
    return _apply(config, values, "", parse=False)


def to_dict(config: Any) -> dict[str, Any]:
    """A JSON-serialisable dict of a config tree (mapping fields as dicts, whatever they are stored as)."""
    hints = typing.get_type_hints(type(config))
    tree = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            tree[field.name] = to_dict(value)
        else:
            tree[field.name] = dict(value) if _is_mapping(hints[field.name]) else value
    return json.loads(json.dumps(tree, default=list))


def from_dict(data: Mapping[str, Any]) -> TrainConfig:
    """Inverse of to_dict (checks every key and type)."""
    return apply_dict(TrainConfig(), data)


def build_task(config: TrainConfig) -> Task:
    """The jaxpe.train.tasks Task named in config.task; an error names an option as task.<option>."""
    with _named_as(_task_keys(config.task.name)):
        return make_task(config.task.name, **config.task.options)


def task_options(task: TaskConfig) -> Any:
    """The options dataclass of `task` (its task's config class over task.options, defaults filled in); an error
    names an option as task.<option>, as the command line sets it."""
    with _named_as(_task_keys(task.name)):
        return config_from_options(task_config_class(task.name), task.name, task.options)


def _task_keys(name: str) -> dict[str, str]:
    """{option: "task.<option>"} of task `name`'s options."""
    return {field.name: f"task.{field.name}" for field in dataclasses.fields(task_config_class(name))}


def _model_keys(model: ModelConfig, changes: Mapping[str, Any], prefix: str) -> dict[str, str]:
    """{field: prefix + field} of ModelConfig and {option: prefix + "pe_options." + option} of the encoding that
    `changes` (else `model`) names, the fields winning a clash."""
    pe = changes.get("pe", model.pe)
    options = [f.name for f in dataclasses.fields(pe_config(pe))] if pe in pe_names() else []
    return ({name: f"{prefix}pe_options.{name}" for name in options}
            | {f.name: f"{prefix}{f.name}" for f in dataclasses.fields(ModelConfig)})


@contextlib.contextmanager
def _named_as(keys: Mapping[str, str]) -> Iterator[None]:
    """Re-raises a ValueError, TypeError or ImportError (an option that needs a package not installed, lm's
    source='hf:...') of the block with each `name=` or `name[` of `keys` written as keys[name] (d_model=64 ->
    model.d_model=64); a name after a dot or inside a word is left as it is."""
    try:
        yield
    except (TypeError, ValueError, ImportError) as error:
        if not keys:
            raise
        names = "|".join(map(re.escape, sorted(keys, key=len, reverse=True)))
        text = re.sub(rf"(?<![\w.])({names})(?=[=\[])", lambda match: keys[match.group(1)], str(error))
        raise next(kind for kind in (TypeError, ImportError, ValueError) if isinstance(error, kind))(text) from error


def longest_length(task: Task) -> int:
    """The longest sequence the model will see (training or any evaluation split)."""
    return max([task.seq_len, *(s.inputs.shape[1] for s in task.eval_splits().values())])


def resolve_model(model: ModelConfig, vocab_size: int, max_len: int) -> ModelConfig:
    """`model` with its vocab_size and max_len filled in where None (the task's vocabulary and longest sequence);
    a vocab_size that is set must hold the task's `vocab_size` tokens."""
    if model.vocab_size is not None and model.vocab_size < vocab_size:
        raise ValueError(f"model.vocab_size={model.vocab_size} is smaller than the task's {vocab_size=}; "
                         "leave it unset (none) to take the task's")
    return dataclasses.replace(model, vocab_size=model.vocab_size or vocab_size, max_len=model.max_len or max_len)


def resolve_task(task: TaskConfig) -> TaskConfig:
    """`task` with every option of its task listed, defaults filled in (as JSON values: lists for tuples)."""
    options = task_options(task)
    return dataclasses.replace(task, options=json.loads(json.dumps(dataclasses.asdict(options), default=list)))


def resolve_config(config: TrainConfig, task: Task) -> TrainConfig:
    """The config a run saves: `config` with every task option (resolve_task) and what the run takes from `task`
    (model.vocab_size, model.max_len) filled in. Resolving a resolved config changes nothing, so a saved config and
    the one it was resolved from, both resolved with the same task, are equal."""
    return dataclasses.replace(config, task=resolve_task(config.task),
                               model=resolve_model(config.model, task.vocab_size, longest_length(task)))


def build_model(model: ModelConfig, vocab_size: int, max_len: int) -> TransformerLM:
    """jaxpe.TransformerLM for `model` resolved (resolve_model) with the task's vocabulary and longest sequence."""
    return TransformerLM(resolve_model(model, vocab_size, max_len))


def field_comments(cls: type) -> dict[str, str]:
    """{field: the comment after it} for a dataclass, read from its source (and its dataclass bases').

    A field's comment is the `# ...` on the line where its definition ends (or starts), else the comment lines
    right above it. Without source code (e.g. only .pyc files installed) there are no comments: {}.
    """
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            comments.update(_own_field_comments(klass))
    return comments


def _own_field_comments(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    by_line = {tok.start[0]: tok.string.lstrip("#").strip()
               for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    class_node = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef))
    comments = {}
    for node in class_node.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        text = by_line.get(node.end_lineno) or by_line.get(node.lineno)
        if not text:
            above, line = [], node.lineno - 1
            while line in by_line and lines[line - 1].lstrip().startswith("#"):
                above.insert(0, by_line[line])
                line -= 1
            text = " ".join(above)
        if text:
            comments[node.target.id] = text
    return comments


def format_config(config: TrainConfig) -> str:
    """The resolved config, one `key=value  # comment` line per field, every line a valid override.

    The task's options and the encoding's options are listed in full (their config classes' defaults filled in),
    so a typo in them is a ValueError here too.
    """
    sections = field_comments(TrainConfig)
    lines: list[str | tuple[str, str]] = []  # a section heading, or (key=value, comment)
    for section in dataclasses.fields(config):
        node = getattr(config, section.name)
        lines.append(f"# {section.name}: {sections.get(section.name, '')}".rstrip(": "))
        comments = field_comments(type(node))
        for field in dataclasses.fields(node):
            key, value = f"{section.name}.{field.name}", getattr(node, field.name)
            if isinstance(node, TaskConfig) and field.name == "options":
                lines += _option_lines(section.name, task_options(node), f"{node.name} option")
            elif isinstance(node, ModelConfig) and field.name == "pe_options":
                lines += _option_lines(key, pe_config(node.pe, **dict(value)), f"{node.pe} option")
            else:
                lines.append((f"{key}={_override_text(value)}", comments.get(field.name, "")))
    width = max(len(line[0]) for line in lines if isinstance(line, tuple))
    return "".join(
        f"{line}\n" if isinstance(line, str) else f"{line[0]:<{width}}  # {line[1]}\n" if line[1] else f"{line[0]}\n"
        for line in lines
    )


def _option_lines(prefix: str, options: Any, what: str) -> list[tuple[str, str]]:
    """(key=value, comment) of every field of an options dataclass instance (a task's or an encoding's config)."""
    comments = field_comments(type(options))
    return [(f"{prefix}.{f.name}={_option_text(getattr(options, f.name))}",
             f"({what}) {comments.get(f.name, '')}".rstrip()) for f in dataclasses.fields(options)]


def _override_text(value: Any) -> str:
    """A TrainConfig field's value as `_parse` reads it back."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def _option_text(value: Any) -> str:
    """An option's value as `_parse_literal` reads it back (JSON, strings bare)."""
    return value if isinstance(value, str) else json.dumps(value, default=list)


def _apply(node: Any, values: Mapping[str, Any], prefix: str, *, parse: bool) -> Any:
    """A copy of the dataclass `node` with `values` set: {field: value, section: {...}, mapping field: {...}}.

    Each dataclass is replaced once, with all its new values, so that its checks across fields see them together.
    `parse`: the leaves are override text (parsed against the field's type), else typed values (checked).
    """
    shorthand = {k: v for k, v in values.items() if k not in ("name", "options")}
    if isinstance(node, TaskConfig) and shorthand:  # task.nvars=3 is task.options.nvars=3
        given = values.get("options", {})
        values = {**{k: v for k, v in values.items() if k not in shorthand},
                  "options": {**given, **shorthand} if isinstance(given, Mapping) else given}
    fields = {f.name for f in dataclasses.fields(node)}
    hints = typing.get_type_hints(type(node))
    changes = {}
    for name, value in values.items():
        key = f"{prefix}{name}"
        if name not in fields:
            raise ValueError(f"unknown config key {key!r}: {name!r} is not one of {sorted(fields)}")
        current = getattr(node, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, Mapping):
                raise ValueError(f"config key {key!r} is a section; set one of its fields, e.g. {key}.<field>=...")
            changes[name] = _apply(current, value, f"{key}.", parse=parse)
        elif _is_mapping(hints[name]):
            if not isinstance(value, Mapping):
                raise ValueError(f"config key {key!r} needs a mapping, got {value!r}")
            changes[name] = _merged(dict(current), value) if parse else {**dict(current), **value}
        elif isinstance(value, Mapping) and value:
            rest = _first_key(value)
            raise ValueError(f"unknown config key {f'{key}.{rest}'!r}: {name!r} has no field {rest!r}")
        else:
            changes[name] = _parse(key, value, hints[name]) if parse else _check(key, value, hints[name])
    keys = _model_keys(node, changes, prefix) if isinstance(node, ModelConfig) else {}
    with _named_as(keys):  # jaxpe.ModelConfig's own words (d_model=...) as the keys a user sets (model.d_model=...)
        return dataclasses.replace(node, **changes)


def _merged(mapping: dict[str, Any], texts: Mapping[str, Any]) -> dict[str, Any]:
    """`mapping` with override texts set at their (nested) keys, each read as a JSON literal."""
    out = dict(mapping)
    for name, text in texts.items():
        if isinstance(text, Mapping):
            inner = out.get(name)
            out[name] = _merged(dict(inner) if isinstance(inner, Mapping) else {}, text)
        else:
            out[name] = _parse_literal(text)
    return out


def _first_key(tree: Mapping[str, Any]) -> str:
    """The dotted key of the first leaf of a nested dict."""
    name, value = next(iter(tree.items()))
    return f"{name}.{_first_key(value)}" if isinstance(value, Mapping) and value else name


def _parse_literal(text: str) -> Any:
    """A JSON literal (3, 0.5, true, null, [1, 2]) or else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parse(key: str, text: str, hint: Any) -> Any:
    """Parses override text for a field annotated `hint`."""
    options = _options(hint)
    if type(None) in options and text.lower() in ("none", "null"):
        return None
    if bool in options:
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
    elif int in options:
        try:
            return int(text)
        except ValueError:
            pass
    elif float in options:
        try:
            return float(text)
        except ValueError:
            pass
    elif str in options:
        return text
    elif tuple in options:
        if not text.startswith("["):
            return tuple(s for s in text.split(",") if s)
        value = _parse_literal(text)  # a JSON list, the syntax of the task options' lists
        if isinstance(value, list):
            return tuple(value)
    raise ValueError(f"config key {key!r}: cannot read {text!r} as {_describe(hint)}")


def _check(key: str, value: Any, hint: Any) -> Any:
    """Checks an already-typed value (from a preset) against `hint`."""
    options = _options(hint)
    if value is None and type(None) in options:
        return None
    if tuple in options and isinstance(value, (list, tuple)):
        return tuple(value)
    if float in options and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    for kind in (bool, int, str):
        if kind in options and type(value) is kind:
            return value
    raise ValueError(f"config key {key!r}: {value!r} is not {_describe(hint)}")


def _is_mapping(hint: Any) -> bool:
    """Whether a field annotated `hint` holds a mapping (set key by key: task.options, model.pe_options)."""
    return Mapping in _options(hint)


def _options(hint: Any) -> set[Any]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return {typing.get_origin(a) or a for a in typing.get_args(hint)}
    return {typing.get_origin(hint) or hint}


def _describe(hint: Any) -> str:
    return " or ".join(sorted(getattr(o, "__name__", str(o)) for o in _options(hint)))
