"""jaxpe.train.config: presets, saved configs, key=value overrides, bad input, the printed config with its comments;
the paper preset's model by eval_shape."""
import dataclasses
import json
import math
import pathlib
import re

import jax
import numpy as np
import pytest

import jaxpe
from jaxpe.train.config import (ModelConfig, OptimConfig, RunConfig, TaskConfig, TrainConfig, apply_dict,
                                apply_overrides, build_config, build_model, build_task, field_comments, format_config,
                                from_dict, load_config, load_preset, longest_length, preset_names, resolve_task,
                                to_dict)
from jaxpe.train.experiments import (compare_encodings, evaluate_checkpoint, restore_run, train_and_evaluate,
                                     train_seeds)
from jaxpe.train.tasks import make_task
from jaxpe.train.trainer import Trainer

PRESET_FILES = pathlib.Path(__file__).resolve().parents[1] / "train" / "presets"


def test_overrides_reach_nested_fields():
    config = build_config(
        task="counting",
        pe="cope",
        overrides=["model.num_layers=2", "task.nvars=3", "model.pe_options.npos=32", "optim.learning_rate=3e-4",
                   "model.num_kv_heads=none", "run.fsdp=true", "run.eval_splits=valid,test"],
    )
    assert config.task.name == "counting" and dict(config.task.options) == {"nvars": 3}
    assert config.model.num_layers == 2 and config.model.pe == "cope"
    assert dict(config.model.pe_options) == {"npos": 32}
    assert config.optim.learning_rate == pytest.approx(3e-4)
    assert config.model.num_kv_heads is None and config.run.fsdp is True
    assert config.run.eval_splits == ("valid", "test")
    assert from_dict(to_dict(config)) == config


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.num_layers=abc", "model.num_layers"),
        ("model.layers=2", "model.layers"),
        ("modle.num_layers=2", "modle"),
        ("run.fsdp=maybe", "run.fsdp"),
        ("optim.learning_rate=fast", "optim.learning_rate"),
        ("model=3", "model"),
        ("model.num_layers.x=1", "model.num_layers.x"),
    ],
)
def test_bad_override_names_the_key(override, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        build_config(overrides=[override])


def test_malformed_override_and_invalid_values():
    with pytest.raises(ValueError, match="key=value"):
        apply_overrides(TrainConfig(), ["model.num_layers"])
    with pytest.raises(ValueError, match="grad_accum"):
        build_config(overrides=["optim.batch_size=10", "optim.grad_accum=3"])
    with pytest.raises(ValueError, match="steps"):
        build_config(overrides=["run.steps=0"])
    with pytest.raises(ValueError, match="preset"):
        build_config(preset="no-such-preset")


def test_unknown_task_option_names_the_key():
    with pytest.raises(ValueError, match="nvarz"):
        build_task(build_config(task="counting", overrides=["task.nvarz=3"]))


def test_model_is_jaxpe_model_config_filled_in_from_the_task():
    """TrainConfig.model is jaxpe's own ModelConfig; vocab_size and max_len stay None until the task fills them."""
    config = build_config(task="flipflop", overrides=["task.seq_len=16", "model.d_model=16", "model.num_heads=2"])
    assert type(config.model) is jaxpe.ModelConfig and ModelConfig is jaxpe.ModelConfig
    assert config.model.vocab_size is None and config.model.max_len is None
    task = build_task(config)
    filled = build_model(config.model, task.vocab_size, longest_length(task)).config
    assert (filled.vocab_size, filled.max_len) == (task.vocab_size, longest_length(task))
    assert dataclasses.replace(filled, vocab_size=None, max_len=None) == config.model
    set_model = build_config(config=config, overrides=["model.vocab_size=64", "model.max_len=40"]).model
    assert (build_model(set_model, task.vocab_size, 16).config.vocab_size, set_model.max_len) == (64, 40)
    with pytest.raises(ValueError, match="model.vocab_size=2 is smaller than the task's vocab_size="):
        build_model(dataclasses.replace(config.model, vocab_size=2), task.vocab_size, 16)


def test_overrides_are_set_together_and_checked_by_the_model_config():
    """One list of overrides (or one preset) is applied at once: 256 % 3 != 0 on the way to d_model=48 is no error;
    an invalid result is jaxpe.ModelConfig's error, its fields named as the overrides set them (model.<field>)."""
    config = build_config(overrides=["model.num_heads=3", "model.d_model=48"])
    assert (config.model.num_heads, config.model.d_model) == (3, 48)
    assert from_dict(to_dict(config)) == config
    with pytest.raises(ValueError, match=r"^model\.d_model=256 must be a multiple of model\.num_heads=3$"):
        build_config(overrides=["model.num_heads=3"])
    with pytest.raises(ValueError, match=r"^unknown option 'npoz' for model\.pe='cope'"):
        build_config(pe="cope", overrides=["model.pe_options.npoz=3"])
    with pytest.raises(ValueError, match=r"^model\.pe_options\.npos=1 must be an int >= 2$"):
        build_config(pe="cope", overrides=["model.pe_options.npos=1"])
    with pytest.raises(ValueError, match=r"^model\.num_layers=0 must be a positive int$"):
        apply_dict(build_config(), {"model": {"num_layers": 0}})  # a preset's or a saved config's value too


def test_training_refuses_float16_which_the_model_takes():
    """jaxpe.ModelConfig computes in float16 (tests/test_model.py); training in it needs loss scaling, which jaxpe.train
    does not do: refused, naming the fields, where bfloat16 trains."""
    with pytest.raises(ValueError, match=r"^model\.dtype=float16, model\.param_dtype=float16: float16 training needs"):
        build_config(overrides=["model.dtype=float16", "model.param_dtype=float16"])
    assert build_config(overrides=["model.dtype=bfloat16"]).model.dtype == "bfloat16"


def test_task_option_errors_name_the_key_as_the_command_line_sets_it(tmp_path):
    """task.seed=abc is refused as task.seed='abc', by --show-config, by resolving and by building the task, and so
    is a task's refusal of its data (lm's max_bytes); make_task, the Python API, keeps the option's own name."""
    bad = build_config(task="flipflop", overrides=["task.seed=abc"])
    for make in (lambda: format_config(bad), lambda: resolve_task(bad.task), lambda: build_task(bad)):
        with pytest.raises(TypeError, match=r"^task\.seed='abc' must be an int$"):
            make()
    with pytest.raises(TypeError, match=r"^seed='abc' must be an int$"):
        make_task("flipflop", seed="abc")
    (tmp_path / "big.txt").write_text("0123456789", encoding="utf-8")
    lm = build_config(task="lm", overrides=[f"task.source={tmp_path}", "task.max_bytes=5"])
    with pytest.raises(ValueError, match=re.escape(f"task.source={str(tmp_path)!r}: every file is larger than "
                                                   "task.max_bytes=5 (the smallest")):
        build_task(lm)


def test_presets_apply_in_order():
    assert {"paper", "cpu-small"} <= set(preset_names())
    paper = build_config(preset="paper", task="counting")
    raw = load_preset("paper")
    assert paper.model.d_model == raw["model"]["d_model"] == 256
    assert paper.model.prenorm is False and paper.optim.learning_rate == pytest.approx(7e-5)
    assert paper.optim.batch_size == 64 and dict(paper.task.options)["max_steps"] == 512
    # 100 epochs of 10k programs at batch 64
    assert paper.run.steps == int(np.ceil(100 * 10_000 / 64))
    later = build_config(preset="paper", task="counting", overrides=["model.d_model=128", "task.max_steps=64"])
    assert later.model.d_model == 128 and dict(later.task.options)["max_steps"] == 64
    small = build_config(preset="cpu-small")
    assert small.task.name == "selective_copy" and dict(small.task.options)["n_blanks_sparse"] == 32


def test_paper_model_shapes_without_compute():
    """The paper's full-size model and optimizer state, by jax.eval_shape only."""
    config = build_config(preset="paper", task="counting", pe="cope", overrides=["run.num_devices=1"])
    vocab = 40
    trainer = Trainer(model=build_model(config.model, vocab, 1024), config=config, seq_len=512)
    state = jax.eval_shape(trainer.init_state)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    d, layers = 256, 4
    # per block: q, k, v, o (4 d^2) + MLP d -> 4d -> d (8 d^2); the tied embedding V x d;
    # CoPE's position table per layer, npos = max_len + 1 rows of head dim d / 4
    core = layers * 12 * d * d + vocab * d + layers * (1024 + 1) * (d // 4)
    assert core <= n_params <= core + layers * 16 * d, n_params  # plus biases and norm scales
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.shape and x.dtype == np.float32]
    assert sum(int(np.prod(x.shape)) for x in moments) == 2 * n_params  # Adam mu and nu
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(state.params))
    assert dataclasses.asdict(config.model)["num_layers"] == layers


def test_preset_task_and_encoding_sections_apply_only_when_chosen(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({
        "model": {"d_model": 48}, "run": {"steps": 7},
        "tasks": {"counting": {"nvars": 5}, "flipflop": {"seq_len": 32}},
        "encodings": {"cope": {"npos": 17}},
    }), encoding="utf-8")
    cope = build_config(preset=str(path), task="counting", pe="cope")
    rope = build_config(preset=str(path), task="flipflop", pe="rope", overrides=["model.pe_options.theta=500.0"])
    assert cope.model.d_model == rope.model.d_model == 48 and cope.run.steps == 7
    assert dict(cope.task.options) == {"nvars": 5} and dict(rope.task.options) == {"seq_len": 32}
    assert dict(cope.model.pe_options) == {"npos": 17} and dict(rope.model.pe_options) == {"theta": 500.0}


def test_packaged_presets_are_the_repository_files():
    """preset_names() reads the package's data (importlib.resources), which must be every file of train/presets/."""
    assert set(preset_names()) == {p.stem for p in PRESET_FILES.glob("*.json")} >= {"paper", "cpu-small"}
    assert load_preset("cpu-small") == json.loads((PRESET_FILES / "cpu-small.json").read_text(encoding="utf-8"))


def test_preset_paths_and_their_errors(tmp_path, monkeypatch):
    (tmp_path / "noext").write_text(json.dumps({"model": {"d_model": 24}}), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert build_config(preset="noext").model.d_model == 24  # an existing file without .json is a path too
    with pytest.raises(ValueError, match="'missing.json' cannot be read"):
        build_config(preset="missing.json")
    with pytest.raises(ValueError, match=r"preset name='cpu-smal' not found; choose one of \(.*'cpu-small'"):
        build_config(preset="cpu-smal")
    (tmp_path / "bad.json").write_text("{model: 1}", encoding="utf-8")
    with pytest.raises(ValueError, match="'bad.json' is not valid JSON"):
        build_config(preset="bad.json")
    (tmp_path / "list.json").write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ValueError, match="must hold a JSON object, got list"):
        build_config(preset="list.json")
    (tmp_path / "typo.json").write_text(json.dumps({"model": {"d_modle": 24}}), encoding="utf-8")
    with pytest.raises(ValueError, match="'model.d_modle'"):
        build_config(preset="typo.json")


def test_saved_config_reruns_with_changes(tmp_path):
    """A saved config.json is the start; --task/--pe that change start from that task's/encoding's own options."""
    saved = build_config(preset="cpu-small", task="counting", pe="cope", overrides=["model.num_layers=3"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(to_dict(saved)), encoding="utf-8")
    assert load_config(path) == saved
    assert build_config(config=load_config(path), overrides=["run.seed=4"]) == dataclasses.replace(
        saved, run=dataclasses.replace(saved.run, seed=4))
    same = build_config(config=load_config(path), task="counting", pe="cope")
    assert same == saved  # naming the saved task and encoding keeps their options
    other = build_config(config=load_config(path), task="flipflop", pe="rope")
    assert other.task == TaskConfig(name="flipflop") and other.model.pe == "rope" and not other.model.pe_options
    assert other.model.num_layers == 3 and other.optim == saved.optim
    with_preset = build_config(config=load_config(path), preset="paper", task="flipflop")
    assert with_preset.model.d_model == 256 and dict(with_preset.task.options)["seq_len"] == 512
    (tmp_path / "broken.json").write_text(json.dumps({"model": {"num_layers": "three"}}), encoding="utf-8")
    with pytest.raises(ValueError, match="'model.num_layers'"):
        load_config(tmp_path / "broken.json")
    with pytest.raises(ValueError, match="nowhere.json"):
        load_config(tmp_path / "nowhere.json")


@pytest.mark.parametrize("cls", [TaskConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig])
def test_every_config_field_has_a_comment(cls):
    comments = field_comments(cls)
    assert set(comments) == {f.name for f in dataclasses.fields(cls)}
    assert all(len(text) > 5 and not text.startswith("#") for text in comments.values())


@dataclasses.dataclass(frozen=True)
class _Base:
    a: int = 1  # the base field


@dataclasses.dataclass(frozen=True)
class _Commented(_Base):
    """A docstring # that is not a comment."""

    # said above
    # on two lines
    b: int = 2
    c: tuple[int, ...] = (  # where it starts
        1, 2)
    d: int = 4
    e: str = "# not a comment"  # the comment


def test_field_comments_are_read_from_the_source():
    assert field_comments(_Commented) == {"a": "the base field", "b": "said above on two lines",
                                         "c": "where it starts", "e": "the comment"}


def test_printed_config_lists_every_key_with_its_comment_and_reads_back():
    config = build_config(preset="cpu-small", pe="cope", overrides=["run.eval_splits=valid,ood_dense"])
    text = format_config(config)
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    settings = [line.split("  # ")[0].strip() for line in lines]
    keys = [s.split("=")[0] for s in settings]
    for section in ("model", "optim", "run"):
        for field in dataclasses.fields(getattr(config, section)):
            if field.name != "pe_options":
                assert f"{section}.{field.name}" in keys
    assert re.search(r"^model\.d_model=64 +# width of the residual stream$", text, re.M)
    assert "run.eval_splits=valid,ood_dense" in settings and "model.num_kv_heads=none" in settings
    # the task's and the encoding's options in full, defaults filled in, with their comments
    assert any(line.startswith("task.n_blanks_sparse=32 ") and "(selective_copy option) blanks" in line
               for line in lines)
    assert any(line.startswith("model.pe_options.npos=64 ") for line in lines)
    assert any(line.startswith("model.pe_options.gates=keys ") and "(cope option)" in line for line in lines)
    assert all("  # " in line for line in lines)
    # every line is a key=value override: applied to the defaults they give the same config again
    again = build_config(overrides=settings)
    assert format_config(again) == text
    assert (again.model, again.optim, again.run) == (
        dataclasses.replace(config.model, pe_options=again.model.pe_options), config.optim, config.run)
    with pytest.raises(ValueError, match="npoz"):
        format_config(build_config(pe="cope", overrides=["model.pe_options.npoz=3"]))


def holds(saved: dict, loaded: dict) -> bool:
    """Whether every value of the nested dict `saved` is in `loaded` at the same key."""
    return all(holds(v, loaded.get(k, {})) if isinstance(v, dict) else k in loaded and loaded[k] == v
               for k, v in saved.items())


RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
SAVED_CONFIGS = sorted(RESULTS.glob("*/*/compare.json"))


@pytest.mark.skipif(not SAVED_CONFIGS, reason="no committed results")
@pytest.mark.parametrize("path", SAVED_CONFIGS, ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}")
def test_committed_run_configs_load_and_keep_every_saved_value(path):
    runs = json.loads(path.read_text(encoding="utf-8"))["runs"]
    assert runs
    for run in runs:
        loaded = to_dict(from_dict(run["config"]))
        assert holds(run["config"], loaded)  # fields added since keep their defaults
        assert loaded["task"]["name"] == run["task"] and loaded["model"]["pe"] == run["pe"]


@pytest.mark.parametrize("cls, field, value, message", [
    (OptimConfig, "batch_size", "8", "optim.batch_size='8' must be an int"),
    (OptimConfig, "batch_size", True, "optim.batch_size=True must be an int"),
    (OptimConfig, "learning_rate", None, "optim.learning_rate=None must be a number"),
    (OptimConfig, "b1", True, "optim.b1=True must be a number"),
    (RunConfig, "steps", 1.5, "run.steps=1.5 must be an int"),
    (RunConfig, "progress", 1, "run.progress=1 must be a bool"),
])
def test_configs_built_in_python_name_a_field_of_the_wrong_type(cls, field, value, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        cls(**{field: value})


@pytest.mark.parametrize("text", ["1e39", "-3.5e38", "inf", "-inf", "nan"])
@pytest.mark.parametrize("key", ["learning_rate", "weight_decay", "eps", "clip_norm", "b1", "min_lr_ratio"])
def test_float_settings_outside_float32_are_refused_where_the_config_is_made(key, text):
    """Every optimizer float is computed in float32 on the device: 1e39 passed the checks and the run stopped on
    NaN parameters at its first step. Refused by OptimConfig itself and through a key=value override alike, naming
    the key; the largest float32 still passes."""
    value = float(text)
    message = (f"optim.{key}={value!r} must be a finite number" if not math.isfinite(value)
               else f"optim.{key}={value!r} is past float32's range (|x| <= 3.403e+38)")
    with pytest.raises(ValueError, match=re.escape(message)):
        OptimConfig(**{key: value})
    with pytest.raises(ValueError, match=re.escape(message)):
        build_config(overrides=[f"optim.{key}={text}"])
    largest = float(np.finfo(np.float32).max)
    assert build_config(overrides=["optim.learning_rate=3.4028234663852886e38"]).optim.learning_rate == largest


@pytest.mark.parametrize("key, text", [("optim.eps", "1e-46"), ("optim.learning_rate", "1e-300"),
                                       ("model.dropout", "1e-50"), ("model.pe_options.theta", "1e39")])
def test_model_and_encoding_floats_outside_float32_are_refused_by_the_train_config(key, text):
    """A nonzero value that float32 rounds to 0 (eps, checked > 0, would divide by sqrt(v) + 0), and the model's
    and its encoding's floats (RoPE's base theta) past float32's range, are refused too."""
    with pytest.raises(ValueError, match=re.escape(f"{key}={float(text)!r} ")):
        build_config(pe="rope", overrides=[f"{key}={text}"])


@pytest.mark.parametrize("seed, message", [
    (-1, "run.seed=-1 must be >= 0"),
    (2**31, "run.seed=2147483648 must be <= 2147483647"),  # int32 overflow when seeds are stacked
    (2**32, "run.seed=4294967296 must be <= 2147483647"),  # PRNGKey would train seed 0's model
    (10**20, "must be <= 2147483647"),
])
def test_seeds_outside_32_bits_are_refused(seed, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RunConfig(seed=seed)
    assert RunConfig(seed=2**31 - 1).seed == 2**31 - 1


def test_configs_built_from_dicts_in_python_are_refused_with_the_way_to_build_them(tmp_path):
    """A notebook's TrainConfig(run={"steps": 5}) (which the dataclass took as it was, to fail deep in training),
    TrainConfig(model={...}), build_config(overrides="run.steps=5") (a string: its characters taken as overrides)
    and train_and_evaluate or compare_encodings given a dict are TypeErrors naming the argument and the way to build a
    config; from_dict builds the one that was meant."""
    for section, cls in (("run", RunConfig), ("model", ModelConfig), ("optim", OptimConfig), ("task", TaskConfig)):
        with pytest.raises(TypeError, match=re.escape(f"TrainConfig's {section}={{'steps': 5}} must be a "
                                                      f"{cls.__name__}; a config from nested dicts is "
                                                      "jaxpe.train.config.from_dict")):
            TrainConfig(**{section: {"steps": 5}})
    assert from_dict({"run": {"steps": 5}}) == dataclasses.replace(TrainConfig(), run=RunConfig(steps=5))
    with pytest.raises(TypeError, match=re.escape("overrides='run.steps=5' must be a list of key=value strings, "
                                                  "e.g. ['run.steps=5']")):
        build_config(overrides="run.steps=5")
    assert build_config(overrides=("run.steps=5",)).run.steps == 5
    no_config = re.escape("{'run': {'steps': 5}} is no TrainConfig; make one with jaxpe.train.build_config")
    with pytest.raises(TypeError, match="config: " + no_config):
        train_and_evaluate({"run": {"steps": 5}}, tmp_path / "run")
    with pytest.raises(TypeError, match="configs: " + no_config):
        compare_encodings([{"run": {"steps": 5}}], [0], tmp_path / "cmp")
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_a_workdir_that_is_no_path_is_a_type_error_naming_it(tmp_path, monkeypatch):
    """train_and_evaluate(config, None) and the other entry points that take a workdir raised Python's own "expected
    str, bytes or os.PathLike object"; each names its argument and the value, before anything is built or written."""
    monkeypatch.chdir(tmp_path)
    config = build_config(task="flipflop", overrides=["run.steps=1"])
    calls = {"workdir": [lambda w: train_and_evaluate(config, w), restore_run, evaluate_checkpoint,
                         lambda w: compare_encodings([config], [0], w)],
             "workdirs[0]": [lambda w: train_seeds([config], [w], task=None, model=None)]}
    for bad in (None, 3, ["runs/a"]):
        for argument, entry_points in calls.items():
            for call in entry_points:
                with pytest.raises(TypeError, match=f"^{re.escape(f'{argument}={bad!r}')} must be a path"):
                    call(bad)
    for call in calls["workdir"]:
        with pytest.raises(ValueError, match=re.escape("workdir='' names no directory; give a path ('.' for the")):
            call("")
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_train_seeds_given_one_run_instead_of_lists_names_the_argument(tmp_path, monkeypatch):
    """train_seeds(configs, "runs/x"): a string is a sequence too, of one-character workdirs, which then failed to
    pair up with the configs ("configs (1) and workdirs (6) must pair up"); one config instead of a list raised
    "'TrainConfig' object is not iterable". Each is a TypeError naming the argument."""
    monkeypatch.chdir(tmp_path)
    config = build_config(task="flipflop", overrides=["run.steps=1"])
    for configs, workdirs, argument in (([config], "runs/x", "workdirs"), ([config], pathlib.Path("runs/x"),
                                        "workdirs"), (config, ["runs/x"], "configs")):
        with pytest.raises(TypeError, match=f"^{argument}=.* must be a list, an entry per run"):
            train_seeds(configs, workdirs, task=None, model=None)
    assert not any(tmp_path.iterdir())
