"""The command line: help that lists the choices, clean usage errors, --show-config, --config reruns, and a tiny run's
outputs (TensorBoard event files read back, with and without tensorboardX), and the paper preset end to end."""
import argparse
import io
import json
import logging
import math
import pathlib
import struct
import subprocess
import sys

import jax
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

import jaxpe
from jaxpe.train import cli, distributed, experiments, loop, tables
from jaxpe.train.config import build_config, preset_names
from jaxpe.train.tasks import TASK_NAMES

TINY = [
    "--task", "flipflop", "--pe", "rope",
    "task.seq_len=16", "task.n_eval=24", "model.d_model=16", "model.num_layers=1", "model.num_heads=2",
    "model.max_len=16", "optim.batch_size=16", "optim.warmup_steps=2", "run.steps=3", "run.log_every=1",
    "run.eval_every=2", "run.checkpoint_every=0", "run.eval_batch_size=16", "run.progress=false", "run.num_devices=1",
]


def read_events(logdir: pathlib.Path) -> list[event_pb2.Event]:
    """Every event of the TFRecord files in logdir: [uint64 length, uint32 crc, data, uint32 crc] records."""
    events = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            events.append(event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length]))
            offset += 12 + length + 4
    return events


def scalars(logdir: pathlib.Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of the scalar summaries in logdir."""
    out: dict[str, dict[int, float]] = {}
    for event in read_events(logdir):
        for value in event.summary.value:
            out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


@pytest.mark.parametrize("main, prog", [(cli.train_main, "jaxpe-train"), (cli.compare_main, "jaxpe-compare")])
def test_help_lists_the_encodings_tasks_and_presets(main, prog, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert text.startswith(f"usage: {prog} ")
    assert ", ".join(jaxpe.PE_NAMES) in text and ", ".join(TASK_NAMES) in text
    assert ", ".join(preset_names()) in text and "cpu-small" in text
    assert "--show-config" in text and "--config FILE" in text and "later wins" in text


@pytest.mark.parametrize("main, argv, message", [
    (cli.train_main, ["--task", "countin"], "jaxpe-train: error: argument --task: invalid choice: 'countin'"),
    (cli.train_main, ["--pe", "cop"], "jaxpe-train: error: argument --pe: invalid choice: 'cop'"),
    (cli.compare_main, ["--pe", "cope,ropey"], "jaxpe-compare: error: argument --pe: unknown encoding(s) ['ropey']"),
    (cli.compare_main, ["--seeds", "0,x"], "jaxpe-compare: error: argument --seeds: '0,x' must be"),
    (cli.compare_main, ["--seeds", "-1"], "argument --seeds: '-1' must be comma-separated integers in [0, 2147483647]"),
    (cli.compare_main, ["--seeds", "1,1"], "argument --seeds: '1,1' repeats 1: give each once"),
    (cli.compare_main, ["--seeds", "0,,1"], "argument --seeds: '0,,1' must be comma-separated integers"),
    (cli.compare_main, ["--seeds", "0,"], "argument --seeds: '0,' must be comma-separated integers"),
    (cli.compare_main, ["--seeds", "\u0661"], "argument --seeds: '\u0661' must be comma-separated integers"),
    (cli.train_main, ["--preset", "cpu-smal"], "jaxpe-train: error: preset name='cpu-smal' not found"),
    (cli.train_main, ["model.num_layer=2"], "jaxpe-train: error: unknown config key 'model.num_layer'"),
    (cli.train_main, ["--config", "nowhere/config.json"], "jaxpe-train: error: config file 'nowhere/config.json'"),
    (cli.train_main, ["--show-config", "task.nvarz=3"], "unknown option 'nvarz' for task 'flipflop'"),
    (cli.train_main, ["--show-config", "task.seed=abc"], "jaxpe-train: error: task.seed='abc' must be an int"),
    (cli.compare_main, ["--show-config", "--pe", "rope", "task.seq_len=1.5"], "error: task.seq_len=1.5 must be an int"),
    # keys as they are typed, however jaxpe.ModelConfig and the tasks' configs name their fields
    (cli.train_main, ["--show-config", "model.d_model=64", "model.num_heads=3"],
     "jaxpe-train: error: model.d_model=64 must be a multiple of model.num_heads=3\n"),
    (cli.train_main, ["--show-config", "--pe", "cope", "model.pe_options.npos=1"],
     "jaxpe-train: error: model.pe_options.npos=1 must be an int >= 2\n"),
    (cli.train_main, ["--show-config", "--task", "lm", "task.valid_fraction=0.5", "task.test_fraction=0.5"],
     "jaxpe-train: error: task.valid_fraction=0.5 + task.test_fraction=0.5 = 1.0 must be < 1\n"),
    (cli.train_main, ["--show-config", "--task", "lm", "task.eval_multiples=[2,1]"],
     "jaxpe-train: error: task.eval_multiples[1]=1 must be >= 2\n"),
    (cli.train_main, ["--show-config", "--task", "counting", "task.nvars=0"],
     "jaxpe-train: error: task.nvars=0 must be in [1, 26]\n"),
    (cli.train_main, [], "jaxpe-train: error: the following arguments are required: --workdir"),
    (cli.eval_main, [], "jaxpe-eval: error: the following arguments are required: --workdir"),
])
def test_usage_errors_exit_2_naming_the_argument(main, argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_show_config_prints_every_key_and_runs_nothing(monkeypatch, tmp_path, capsys):
    def forbidden(*args, **kwargs):
        raise AssertionError("--show-config must not start anything")

    monkeypatch.setattr(experiments, "train_and_evaluate", forbidden)
    monkeypatch.setattr(experiments, "compare_encodings", forbidden)
    monkeypatch.setattr(distributed, "initialize", forbidden)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.train_main(["--preset", "cpu-small", "--pe", "cope", "--workdir", "runs/x", "--show-config",
                        "model.num_layers=3"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("# resolved config, one key=value override a line")
    settings = {line.split("  # ")[0].strip(): line for line in out.splitlines() if not line.startswith("#")}
    assert "model.num_layers=3" in settings and "model.pe=cope" in settings and "task.name=selective_copy" in settings
    assert "# TensorBoard event files in workdir/tb/" in settings["run.tensorboard=true"]
    assert "model.pe_options.npos=64" in settings  # the preset's per-encoding options
    assert len(settings) > 50
    assert list(tmp_path.iterdir()) == []

    with pytest.raises(SystemExit) as exit_:
        cli.compare_main(["--pe", "cope,rope", "--show-config"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.count("resolved config") == 2 and "# model.pe=rope: resolved config" in out


@pytest.mark.parametrize("main, flags", [(cli.train_main, ["--pe", "rope"]), (cli.compare_main, ["--pe", "rope"])])
def test_overrides_may_come_before_between_and_after_the_flags(main, flags, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run.steps=60", "--task", "flipflop", "run.seed=3", "--show-config", *flags, "model.d_model=32",
              "--preset", "cpu-small", "model.num_layers=3"])
    assert exit_.value.code == 0
    settings = {line.split("  # ")[0].strip() for line in capsys.readouterr().out.splitlines()}
    assert {"run.steps=60", "run.seed=3", "model.d_model=32", "model.num_layers=3", "model.pe=rope",
            "task.name=flipflop"} <= settings


def test_tiny_run_writes_tensorboard_and_a_config_rerun_works_without_tensorboardx(monkeypatch, tmp_path, capsys):
    first = tmp_path / "first"
    assert cli.train_main([*TINY, "--workdir", str(first)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].startswith("| flipflop | rope | 0 |")
    assert err.splitlines()[-1] == (f"outputs in {first}: config.json, metrics.jsonl, result.json, result.md, "
                                    f"result.png, tb/ (tensorboard --logdir {first})")
    records = [json.loads(line) for line in (first / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    logged = scalars(first / "tb")
    train = {r["step"]: r["loss"] for r in records if r["split"] == "train"}
    assert sorted(train) == [1, 2, 3]
    assert logged["train/loss"] == pytest.approx(train, rel=1e-6)
    assert set(logged["train/accuracy"]) == set(logged["train/tokens_per_s"]) == {1, 2, 3}
    valid = {r["step"]: r["token_error"] for r in records if r["split"] == "valid"}
    assert sorted(valid) == [2, 3] and logged["valid/token_error"] == pytest.approx(valid, rel=1e-6)
    assert set(logged["ood_dense/loss"]) == {2, 3}

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # `import tensorboardX` now raises ImportError
    second = tmp_path / "second"
    assert cli.train_main(["--config", str(first / "config.json"), "--workdir", str(second), "run.seed=1"]) == 0
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"outputs in {second}: config.json, metrics.jsonl, result.json, result.md, result.png"
    saved, rerun = (json.loads((d / "config.json").read_text(encoding="utf-8")) for d in (first, second))
    assert rerun["run"].pop("seed") == 1 and saved["run"].pop("seed") == 0 and rerun == saved
    assert not (second / "tb").exists()
    assert len((second / "metrics.jsonl").read_text(encoding="utf-8").splitlines()) == len(records)


def test_repeated_commands_in_one_process_log_to_the_stderr_of_the_moment(monkeypatch, tmp_path, capsys):
    """A notebook's session: jaxpe-train with stderr captured elsewhere (a cell's capture, closed since), then a run
    through the library and jaxpe-train again: their INFO lines reach today's stderr, none goes to the closed stream
    ("--- Logging error ---"), and the root logger holds one handler however many commands ran."""
    earlier = io.StringIO()
    monkeypatch.setattr(sys, "stderr", earlier)
    assert cli.train_main([*TINY, "--workdir", str(tmp_path / "first"), "run.tensorboard=false"]) == 0
    monkeypatch.undo()
    assert "INFO jaxpe.train.trainer: train step" in earlier.getvalue()
    earlier.close()
    capsys.readouterr()
    overrides = [word for word in TINY if "=" in word]
    config = build_config(task="flipflop", pe="rope", overrides=[*overrides, "run.tensorboard=false"])
    experiments.train_and_evaluate(config, tmp_path / "library")
    err = capsys.readouterr().err
    assert "INFO jaxpe.train.trainer: train step" in err and "Logging error" not in err
    assert cli.train_main([*TINY, "--workdir", str(tmp_path / "second"), "run.tensorboard=false"]) == 0
    err = capsys.readouterr().err
    assert "INFO jaxpe.train.trainer: train step" in err and "Logging error" not in err
    assert sum(isinstance(h, cli._CurrentStderr) for h in logging.getLogger().handlers) == 1


def test_logging_keeps_the_users_handlers_and_adds_its_own_once(monkeypatch):
    """A program's own root handlers (a file, a list) stay and get jaxpe's lines; a bare basicConfig() handler on
    stderr (what absl adds when orbax logs at import) gives way to jaxpe's, which two commands add once: every line
    once on stderr."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    logging.basicConfig()  # as absl does
    records: list[logging.LogRecord] = []
    mine = logging.Handler()
    mine.emit = records.append
    root.addHandler(mine)
    on_stdout = logging.StreamHandler(sys.stdout)
    on_stdout.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
    root.addHandler(on_stdout)
    for _ in range(2):  # two commands in one process
        cli._start(argparse.Namespace(coordinator=None, num_processes=None, process_id=None))
    assert root.handlers[:2] == [mine, on_stdout] and [type(h) for h in root.handlers[2:]] == [cli._CurrentStderr]
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # on_stdout keeps the stream it was made with
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    records.clear()
    logging.getLogger("jaxpe.train.trainer").info("train step %d", 3)
    assert sys.stderr.getvalue() == "INFO jaxpe.train.trainer: train step 3\n"
    assert [r.getMessage() for r in records] == ["train step 3"]


@pytest.mark.parametrize("main", [cli.train_main, cli.eval_main, cli.compare_main])
def test_an_empty_workdir_is_a_usage_error_not_the_current_directory(main, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main([*([] if main is cli.eval_main else TINY), "--workdir", ""])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "error: argument --workdir: '' names no directory" in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("main", [cli.train_main, cli.eval_main, cli.compare_main])
def test_a_path_from_the_home_directory_after_an_equals_sign(main, monkeypatch, tmp_path, capsys):
    """--workdir=~/runs, --preset=~/p.json, --config=~/c.json: a shell expands no ~ after a flag's '='; the command
    does, rather than make (or look for) a folder named ~ in the current directory."""
    home, here = tmp_path / "home", tmp_path / "here"
    here.mkdir()
    home.mkdir()
    (home / "runs").write_text("", encoding="utf-8")  # a file: each command refuses it as a workdir, first
    (home / "p.json").write_text(json.dumps({"model": {"d_model": 24}}), encoding="utf-8")
    (home / "c.json").write_text(json.dumps({"model": {"num_layers": 3}}), encoding="utf-8")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(here)
    assert main([*([] if main is cli.eval_main else TINY), "--workdir=~/runs"]) == 2
    assert f"error: workdir {str(home / 'runs')!r} exists and is not a directory" in capsys.readouterr().err
    if main is not cli.eval_main:
        with pytest.raises(SystemExit) as exit_:
            main(["--show-config", "--preset=~/p.json", "--config=~/c.json", "--pe=rope"])
        out = capsys.readouterr().out
        assert exit_.value.code == 0 and "model.d_model=24 " in out and "model.num_layers=3 " in out
    assert list(here.iterdir()) == []

@pytest.mark.parametrize("error", [MemoryError("Unable to allocate 186. TiB for an array with shape (10**11, 256)"),
                                   RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2 TiB.\n"
                                                "more lines")])
def test_a_config_too_large_for_the_memory_is_one_line(error, monkeypatch, tmp_path, capsys):
    """numpy's MemoryError and XLA's RESOURCE_EXHAUSTED (sizes that pass every check but not the machine) end in one
    line naming the sizes to lower, exit 2; --debug shows the traceback."""
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(cli, "_start", lambda args: None)
    monkeypatch.setattr(experiments, "train_and_evaluate", fail)
    argv = [*TINY, "--workdir", str(tmp_path)]
    assert cli.train_main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"jaxpe-train: error: out of memory ({str(error).splitlines()[0]}); lower the sizes of the "
                   "config: optim.batch_size, run.eval_batch_size, task.seq_len, the task's set sizes or the model's "
                   "(model.d_model, model.num_layers)\n")
    with pytest.raises(type(error)):
        cli.train_main([*argv, "--debug"])


def test_resumed_metrics_drop_what_came_after_the_checkpoint(tmp_path):
    """metrics.jsonl keeps the records up to the resume step; TensorBoard gets a purge from the next step on."""
    first = loop.MetricsLog(tmp_path, resume_step=0, enabled=True, tensorboard=True)
    for step in range(1, 5):
        first.write({"step": step, "split": "train", "loss": float(step), "accuracy": 0.5})
    first.close()
    resumed = loop.MetricsLog(tmp_path, resume_step=2, enabled=True, tensorboard=True)
    resumed.write({"step": 3, "split": "train", "loss": 30.0, "accuracy": 0.5})
    resumed.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [(r["step"], r["loss"]) for r in lines] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    events = read_events(tmp_path / "tb")
    restart = [i for i, e in enumerate(events) if e.session_log.status == event_pb2.SessionLog.START]
    assert [events[i].step for i in restart] == [3]  # TensorBoard hides the first run's steps >= 3
    before = [(e.step, v.simple_value) for e in events[:restart[0]] for v in e.summary.value if v.tag == "train/loss"]
    assert before == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]  # the first run's file survives the resume
    after = [(e.step, v.simple_value) for e in events[restart[0]:] for v in e.summary.value if v.tag == "train/loss"]
    assert after == [(3, 30.0)]
    assert jax.process_index() == 0


def test_python_dash_m_runs_the_entry_points_from_outside_the_repo(tmp_path):
    """`python -m jaxpe.train train ...` is jaxpe-train; a user's own train.py and kernels/ do not shadow ours."""
    (tmp_path / "train.py").write_text("raise SystemExit('the user train.py was imported')\n", encoding="utf-8")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("raise SystemExit('the user kernels/ was imported')\n",
                                                      encoding="utf-8")
    shown = subprocess.run([sys.executable, "-m", "jaxpe.train", "train", "--show-config", "--preset", "cpu-small",
                            "--pe", "cope"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert "model.pe=cope" in shown.stdout.replace(" ", "")
    bare = subprocess.run([sys.executable, "-m", "jaxpe.train"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert bare.returncode == 2 and "train,eval,compare" in bare.stderr


def test_paper_preset_trains_counting_end_to_end(tmp_path, capsys):
    """The paper preset as it is (its 4-layer, 256-wide post-norm model with tied embeddings, dropout, schedule and
    block 512) trains two steps on counting with CoPE, checkpoints, evaluates every split and writes its result; only
    the sizes that cost CPU time are cut (batch, programs per split, one padded shape). It keeps the preset runnable."""
    workdir = tmp_path / "paper"
    assert cli.train_main(["--preset", "paper", "--task", "counting", "--pe", "cope", "--workdir", str(workdir),
                           "run.steps=2", "run.log_every=1", "run.eval_every=0", "run.checkpoint_every=2",
                           "optim.batch_size=4", "task.n_train=16", "task.n_valid=4", "task.n_test=4",
                           "run.eval_batch_size=4", "run.progress=false", "run.num_devices=1",
                           "run.pad_to=block"]) == 0
    capsys.readouterr()
    config = json.loads((workdir / "config.json").read_text(encoding="utf-8"))
    assert (config["model"]["d_model"], config["model"]["num_layers"], config["model"]["prenorm"]) == (256, 4, False)
    assert config["optim"]["learning_rate"] == 7e-5 and config["task"]["options"]["seq_len"] == 512
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(np.isfinite(r["loss"]) for r in train)
    result = json.loads((workdir / "result.json").read_text(encoding="utf-8"))
    assert set(result["splits"]) == {"valid", "test", "len_x2"} and result["steps"] == 2
    assert any((workdir / "checkpoints").iterdir())


def test_compare_says_its_cells_are_means_and_95_percent_intervals(monkeypatch, tmp_path, capsys):
    """Two seeds at 10 % and 20 % on 1000 sequences: the cell is 15.00 [low, high], the interval of the seed variance
    of the mean (0.005 / 2) plus Agresti–Coull's binomial variance ((150 + 2) / 1004), and the line above says so."""
    runs = [{"pe": "cope", "seed": seed, "splits": {"valid": {"seq_error": rate, "sequences": 1000}}}
            for seed, rate in ((0, 0.1), (1, 0.2))]
    comparison = {"task": "counting", "metric": "seq_error", "splits": ["valid"], "seeds": [0, 1],
                  "rows": tables.summarize_seeds(runs)}
    monkeypatch.setattr(cli, "_start", lambda args: None)
    monkeypatch.setattr(experiments, "compare_encodings",
                        lambda *a, **k: {**comparison, "table": experiments.comparison_markdown(comparison)})
    assert cli.compare_main(["--task", "counting", "--pe", "cope", "--seeds", "0,1", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    shrunk = 152 / 1004
    half = 1.96 * math.sqrt(0.005 / 2 + shrunk * (1 - shrunk) / 1004)
    assert f"| cope | 0,1 | 15.00 [{100 * (0.15 - half):.2f}, {100 * (0.15 + half):.2f}] |" in out
    assert ("counting: seq_error (%), lower is better; each cell: mean over seeds 0,1 [95 % interval: seed spread + "
            "evaluation-set binomial error]") in out
    assert "±" not in out and "std" not in out


@pytest.mark.parametrize("step, message", [("-1", "'-1' must be >= 1"), ("0", "'0' must be >= 1"),
                                           ("last", "'last' is not a step number")])
def test_eval_step_is_a_usage_error_naming_the_flag(step, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.eval_main(["--workdir", str(tmp_path), "--step", step])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"error: argument --step: {message}" in err
