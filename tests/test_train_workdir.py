"""Training runs that cannot go silently wrong: one run per workdir, everything validated before anything
is written, data checked as it is read, jaxpe-eval's fallback and read-only workdir, messages in one line."""
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxpe.train import cli, experiments
from jaxpe.train.config import build_task, load_config, to_dict
from jaxpe.train.experiments import compare_encodings, evaluate_checkpoint, train_and_evaluate
from jaxpe.train.tasks import read_jsonl, write_jsonl
from jaxpe.train.tasks.counting import generate_samples
from jaxpe.train.workdir import LOCK_NAME, WorkdirLock

from tiny_config import TINY, cli_command, cli_env, tiny, wait_for


# 1. One run per workdir.

def test_a_second_process_on_a_workdir_is_refused_at_once_and_a_killed_holder_does_not_block(tmp_path):
    first = subprocess.Popen(cli_command(tmp_path, "run.steps=100000"), env=cli_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        lock = tmp_path / LOCK_NAME
        wait_for(lambda: lock.is_file() and lock.read_text(encoding="utf-8").strip() == str(first.pid), first,
                 "the first run's lock")
        second = subprocess.run(cli_command(tmp_path, "run.steps=100000"), env=cli_env(), capture_output=True,
                                text=True, timeout=600)
        assert second.returncode == 1, second.stderr
        assert f"workdir {str(tmp_path)!r} is in use by another run (pid {first.pid})" in second.stderr
        assert "Traceback" not in second.stderr
        assert "train step" not in second.stderr  # refused at once: no step compiled (the Trainer logs each one)
        assert first.poll() is None
    finally:
        first.kill()
        first.communicate()
    with WorkdirLock(tmp_path):  # the kernel dropped the dead holder's lock: a restart is not blocked
        pass


def test_compare_refuses_a_locked_workdir_before_any_run(tmp_path, capsys):
    argv = ["--task", "flipflop", "--pe", "rope,none", "--seeds", "0", "--workdir", str(tmp_path), *TINY,
            "run.steps=2"]
    with WorkdirLock(tmp_path):  # another run holds the comparison's workdir (this process: a lock of its own)
        assert cli.compare_main(argv) == 1
    err = capsys.readouterr().err
    assert f"jaxpe-compare: error: workdir {str(tmp_path)!r} is in use by another run (pid {os.getpid()})" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # no run directory, no compare.json


def test_a_workdir_holds_one_run_whatever_the_new_run_saves(tmp_path, capsys):
    first = train_and_evaluate(tiny("run.steps=4", "run.checkpoint_every=4", "run.async_checkpoints=false"), tmp_path)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    # another config without checkpoints: refused before writing anything (it would leave the first run's
    # checkpoints beside its own result, and jaxpe-eval would score them under its config)
    with pytest.raises(ValueError, match=re.escape("model.d_model: 16 -> 32")):
        train_and_evaluate(tiny("run.steps=4", "model.d_model=32"), tmp_path)
    # fewer steps than the saved checkpoint: refused, no result.json whose steps disagree with the model
    with pytest.raises(ValueError, match=r"run\.steps=2 is below the checkpoint at step 4"):
        train_and_evaluate(tiny("run.steps=2", "run.checkpoint_every=2"), tmp_path)
    # the same config without checkpointing: refused too (it would train afresh beside the checkpoints it ignores)
    with pytest.raises(ValueError, match=r"checkpoints \(up to step 4\) that run\.checkpoint_every=0 would neither"):
        train_and_evaluate(tiny("run.steps=2"), tmp_path)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before
    assert cli.eval_main(["--workdir", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "eval.json").read_text(encoding="utf-8"))["step"] == 4 == first["steps"]
    # a jaxpe-compare run directory holding another config is refused before any run trains
    (tmp_path / "cmp" / "alibi").mkdir(parents=True)
    shutil.copytree(tmp_path, tmp_path / "cmp" / "alibi" / "seed0", ignore=shutil.ignore_patterns("cmp"))
    with pytest.raises(ValueError, match=re.escape("model.pe: 'rope' -> 'alibi'")):
        compare_encodings([tiny("run.steps=2"), tiny("run.steps=2", pe="alibi")], [0], tmp_path / "cmp")
    assert not (tmp_path / "cmp" / "rope").exists()
    # a workdir mixed before this guard existed (config.json of another run beside the checkpoints): each checkpoint
    # carries its run's config, so jaxpe-eval and a resume refuse it
    (tmp_path / "config.json").write_text(json.dumps(to_dict(tiny("run.steps=4", "optim.learning_rate=0.5"))),
                                          encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape("written by a run with another config (optim.learning_rate: "
                                                   "0.003 -> 0.5)")):
        evaluate_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=re.escape("optim.learning_rate: 0.003 -> 0.5")):
        train_and_evaluate(tiny("run.steps=6", "run.checkpoint_every=2", "optim.learning_rate=0.5"), tmp_path)


def test_a_run_resumes_with_another_attention_impl_and_remat(tmp_path):
    """How the same maths is computed may change on resume (a run moved to a GPU, or out of memory): model.impl and
    model.remat; the resumed run ends as the uninterrupted one, to float rounding."""
    common = ("run.checkpoint_every=2", "run.async_checkpoints=false")
    whole = train_and_evaluate(tiny("run.steps=4", *common, pe="cope"), tmp_path / "whole")
    train_and_evaluate(tiny("run.steps=2", *common, pe="cope"), tmp_path / "moved")
    with pytest.raises(ValueError, match=re.escape("model.d_model: 16 -> 32")):  # the model itself may not change
        train_and_evaluate(tiny("run.steps=4", *common, "model.d_model=32", "model.remat=full", pe="cope"),
                           tmp_path / "moved")
    moved = train_and_evaluate(tiny("run.steps=4", *common, "model.impl=blockwise", "model.remat=full", pe="cope"),
                               tmp_path / "moved")
    assert moved["steps"] == whole["steps"] == 4
    for split, metrics in whole["splits"].items():
        assert moved["splits"][split]["loss"] == pytest.approx(metrics["loss"], rel=1e-4), split
    assert load_config(tmp_path / "moved" / "config.json").model.remat == "full"  # the config it resumed under


def test_a_run_that_failed_before_its_first_step_does_not_hold_its_workdir(tmp_path):
    """A run that failed after writing config.json (and an empty metrics.jsonl, an empty checkpoints folder) but
    before any step is no run to resume: a corrected config trains there. One metrics record makes it a run."""
    tiny_dir = tmp_path / "run"
    tiny_dir.mkdir()
    (tiny_dir / "config.json").write_text(json.dumps(to_dict(tiny("run.steps=4", "optim.batch_size=4096"))),
                                          encoding="utf-8")
    (tiny_dir / "metrics.jsonl").touch()
    (tiny_dir / "checkpoints").mkdir()
    result = train_and_evaluate(tiny("run.steps=2"), tiny_dir)
    assert result["steps"] == 2
    assert load_config(tiny_dir / "config.json").optim.batch_size != 4096
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(to_dict(tiny("run.steps=4", "optim.batch_size=4096"))),
                                       encoding="utf-8")
    (other / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 1.0}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape("optim.batch_size: 4096 -> ")):
        train_and_evaluate(tiny("run.steps=2"), other)


# 2. Validate first, write later.

@pytest.mark.parametrize("main, argv, message", [
    (cli.train_main, ["optim.min_lr_ratio=-0.5"], "optim.min_lr_ratio=-0.5 must be in [0, 1]"),
    (cli.train_main, ["optim.min_lr_ratio=1.5"], "optim.min_lr_ratio=1.5 must be in [0, 1]"),
    (cli.train_main, ["optim.b1=2"], "optim.b1=2.0 must be in [0, 1)"),
    (cli.train_main, ["optim.b2=1"], "optim.b2=1.0 must be in [0, 1)"),
    (cli.train_main, ["optim.eps=0"], "optim.eps=0.0 must be > 0"),
    (cli.train_main, ["optim.learning_rate=nan"], "optim.learning_rate=nan must be a finite number"),
    (cli.train_main, ["optim.weight_decay=inf"], "optim.weight_decay=inf must be a finite number"),
    (cli.train_main, ["optim.learning_rate=-1"], "optim.learning_rate=-1.0 must be >= 0"),
    # past float32's range (training stopped on NaN parameters at its first step), or rounded to 0 by it
    (cli.train_main, ["optim.learning_rate=1e39"], "optim.learning_rate=1e+39 is past float32's range"),
    (cli.train_main, ["optim.clip_norm=1e39"], "optim.clip_norm=1e+39 is past float32's range"),
    (cli.train_main, ["optim.eps=1e-46"], "optim.eps=1e-46 rounds to 0 in float32"),
    (cli.train_main, ["model.pe_options.theta=1e39"], "model.pe_options.theta=1e+39 is past float32's range"),
    (cli.train_main, ["optim.batch_size=0"], "optim.batch_size=0 must be >= 1"),
    (cli.train_main, ["optim.grad_accum=3"], "optim.batch_size=16 must be a multiple of optim.grad_accum=3"),
    (cli.train_main, ["optim.clip_norm=0"], "optim.clip_norm=0.0 must be > 0"),
    (cli.train_main, ["optim.warmup_steps=-2"], "optim.warmup_steps=-2 must be >= 0"),
    (cli.train_main, ["run.steps=0"], "run.steps=0 must be >= 1"),
    (cli.train_main, ["run.steps=2147483648"], "run.steps=2147483648 must be <= 2147483647 (the step counter is "),
    (cli.train_main, ["model.d_model=1000000000"], "the model has 1.2e+19 parameters"),  # XLA would abort the process
    (cli.compare_main, ["--pe", "rope", "model.num_layers=100000000000"], "GiB of memory here; lower model.d_model"),
    (cli.train_main, ["run.eval_every=-1"], "run.eval_every=-1 must be >= 0"),
    (cli.train_main, ["run.eval_splits=valid,bogus"], "run.eval_splits: unknown split(s) ['bogus'] for task "
                                                      "'flipflop'; choose from valid, ood_sparse, ood_dense"),
    (cli.train_main, ["model.pe_options.theta=0"], "theta=0 must be > 0 and finite"),
    (cli.train_main, ["task.nvars=3"], "unknown option 'nvars' for task 'flipflop'"),
    (cli.train_main, ["model.causal=false"], "model.causal=False: every task trains next-token prediction"),
    (cli.compare_main, ["--pe", "rope,bogus"], "unknown encoding(s) ['bogus']"),
    (cli.compare_main, ["--pe", "rope,alibi,rope"], "'rope,alibi,rope' repeats rope"),
    (cli.compare_main, ["--seeds", "0,1,0"], "'0,1,0' repeats 0"),
    (cli.compare_main, ["--pe", "rope,corope", "model.pe_options.theta=-1"], "theta=-1 must be > 0 and finite"),
    (cli.compare_main, ["--pe", "rope,cope", "model.pe_options.theta=100"],
     "unknown option 'theta' for model.pe='cope'"),
    (cli.train_main, ["--pe", "rope", "model.pe_options.npos=3"], "unknown option 'npos' for model.pe='rope'"),
])
def test_bad_values_fail_before_anything_is_written_or_trained(main, argv, message, tmp_path, capsys, monkeypatch):
    workdir = tmp_path / "run"
    for trains in ("train_seeds", "_compare"):  # a call would fail with a TypeError
        monkeypatch.setattr(cli.experiments, trains, None)
    flags, overrides = (argv[:2], argv[2:]) if argv[0].startswith("--") else ([], argv)
    status = exit_status(main, [*flags, "--task", "flipflop", "--workdir", str(workdir), *TINY, *overrides])
    err = capsys.readouterr().err
    assert status == 2
    assert message in err and f"{main.__name__.split('_')[0]}: error:" in err and "Traceback" not in err
    assert not workdir.exists()


@pytest.mark.parametrize("overrides", [["model.num_layers=16"], ["model.num_layers=15", "model.pe_options.every=2"]])
def test_a_deep_models_size_is_counted_from_a_few_layers(overrides):
    """state_size of 15 or 16 layers, counted from one period of the layer pattern (1 layer, or 2 with CoPE every
    second layer), equals the count of the whole model's parameters."""
    _, model = experiments.validate_config(tiny(*overrides, pe="cope"))
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
    count = sum(leaf.size for leaf in jax.tree.leaves(shapes))
    assert experiments.state_size(model) == (count, 3 * 4 * count)  # float32 parameters and two moments


@pytest.mark.parametrize("main, argv, message", [
    (cli.train_main, ["--task", "lm", "task.source="], "task.source='' names no file (an empty path would be the "
                                                       "current directory)"),
    (cli.compare_main, ["--task", "lm", "task.source=[]"], "task.source=() must be 'stdlib', 'hf:<name>', a path"),
    (cli.train_main, ["--task", "lm", "task.source=hf:"], "task.source='hf:' must be 'hf:<name>' or"),
    (cli.train_main, ["--task", "lm", "task.source=hf:wikitext"], "task.source='hf:wikitext' needs the Hugging Face "
                                                                  "`datasets` package: pip install 'jaxpe[hf]'"),
    (cli.train_main, ["--task", "counting", "task.data_dir="], "task.data_dir='' names no directory"),
    (cli.train_main, ["--preset", "{tmp}/preset.json"], "preset '{tmp}/preset.json': 'tasks' must map names to "
                                                        "their options, got 5"),
    (cli.train_main, ["--config", "{tmp}/latin1.json"], "config file '{tmp}/latin1.json' is not UTF-8 text"),
    (cli.compare_main, ["--task", "lm", "--pe", "rope", "task.source={tmp}"],
     "workdir '{tmp}/run/rope/seed0' is inside task.source='{tmp}': the run's own files would become its data"),
])
def test_bad_task_settings_and_files_are_one_line_before_anything_is_written(main, argv, message, tmp_path, capsys,
                                                                            monkeypatch):
    """Each a usage error naming the key or file, exit 2, nothing written, not even in the current directory (where an
    empty path would point); a TypeError of a task option and a missing optional package no traceback."""
    (tmp_path / "preset.json").write_text('{"tasks": 5}', encoding="utf-8")
    (tmp_path / "latin1.json").write_bytes('{"run": {"steps": "é"}}'.encode("latin-1"))
    (tmp_path / "cwd").mkdir()
    (tmp_path / "book.txt").write_text("some text to model, " * 50, encoding="utf-8")
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed: its import raises ImportError
    for trains in ("train_seeds", "_compare"):  # a call would fail with a TypeError
        monkeypatch.setattr(cli.experiments, trains, None)
    argv = [word.replace("{tmp}", str(tmp_path)) for word in argv]
    status = exit_status(main, [*argv, "--workdir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert f"error: {message.replace('{tmp}', str(tmp_path))}" in err
    assert not (tmp_path / "run").exists() and not any((tmp_path / "cwd").iterdir())


def exit_status(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(ValueError, match="run.eval_splits"):
        cli.train_main(["--debug", "--task", "flipflop", "--workdir", str(tmp_path), *TINY, "run.eval_splits=x"])
    with pytest.raises(ValueError, match="optim.b1"):
        cli.train_main(["--debug", "--task", "flipflop", "--workdir", str(tmp_path), "optim.b1=2"])


# 3. Data.

def test_counting_data_with_an_empty_answer_is_an_error_naming_file_and_line(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    good = {"context": "a = 1 ;", "question": "print a", "answer": "1"}
    (data / "train.jsonl").write_text(json.dumps(good) + "\n", encoding="utf-8")
    (data / "valid.jsonl").write_text(json.dumps(good) + "\n\n" + json.dumps({**good, "answer": " "}) + "\n",
                                      encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"{data / 'valid.jsonl'}:3: key 'answer' is empty")):
        read_jsonl(data / "valid.jsonl")
    status = exit_status(cli.train_main, ["--task", "counting", "--workdir", str(tmp_path / "run"),
                                          f"task.data_dir={data}"])
    err = capsys.readouterr().err
    assert status == 2 and "valid.jsonl:3: key 'answer' is empty" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_counting_data_that_changed_is_not_resumed(tmp_path, capsys):
    """A run on the user's own counting files (task.data_dir) saves their fingerprint (blake2b over each file's name
    and bytes, worked out here) in corpus.json; a resume after an answer changed, every size kept, is a usage error
    naming task.data_dir and both fingerprints, before anything is written; the files restored, it resumes."""
    data, workdir = tmp_path / "my data", tmp_path / "run"
    write_jsonl(data / "train.jsonl", generate_samples(16, nvars=2, min_steps=3, max_steps=8, seed=0))
    write_jsonl(data / "valid.jsonl", generate_samples(4, nvars=2, min_steps=3, max_steps=8, seed=1))
    original = (data / "valid.jsonl").read_text(encoding="utf-8")
    digest = hashlib.blake2b(digest_size=32)
    for name in ("train.jsonl", "valid.jsonl"):  # _load_dir's order: train, valid, test, the others by name
        for part in (name.encode(), (data / name).read_bytes()):
            digest.update(len(part).to_bytes(8, "little") + part)

    def run(steps: int) -> int:
        return cli.train_main(["--task", "counting", "--pe", "rope", "--workdir", str(workdir), f"task.data_dir={data}",
                               "task.seq_len=32", *[o for o in TINY if not o.startswith("task.")], "optim.batch_size=4",
                               "run.eval_batch_size=4", "run.checkpoint_every=2", "run.async_checkpoints=false",
                               "run.tensorboard=false", f"run.steps={steps}"])

    assert run(2) == 0
    saved = json.loads((workdir / "corpus.json").read_text(encoding="utf-8"))
    assert saved == {"option": "task.data_dir", "source": str(data), "fingerprint": digest.hexdigest(),
                     "hash": "blake2b", "bytes": (data / "train.jsonl").stat().st_size + len(original.encode())}
    answer = json.loads(original.splitlines()[0])["answer"]
    other = "1" if answer == "0" else "0"
    (data / "valid.jsonl").write_text(original.replace(f'"answer": "{answer}"', f'"answer": "{other}"', 1),
                                      encoding="utf-8")
    now = build_task(load_config(workdir / "config.json")).corpus["fingerprint"]
    before = {p.name: p.stat().st_mtime_ns for p in workdir.iterdir()}
    capsys.readouterr()
    assert run(4) == 2
    err = capsys.readouterr().err
    assert (f"jaxpe-train: error: the corpus of the run in {str(workdir)!r} changed: task.data_dir={str(data)!r} now "
            f"gives fingerprint {now[:12]} ({saved['bytes']} bytes), the run began on {saved['fingerprint'][:12]} "
            f"({saved['bytes']} bytes;") in err and "Traceback" not in err
    assert {p.name: p.stat().st_mtime_ns for p in workdir.iterdir()} == before
    (data / "valid.jsonl").write_text(original, encoding="utf-8")
    assert run(4) == 0
    assert json.loads((workdir / "result.json").read_text(encoding="utf-8"))["resumed_from"] == 2


def test_token_ids_outside_the_vocabulary_are_refused_before_the_run(tmp_path):
    config = tiny("run.steps=2")
    task = build_task(config)
    task.vocab_size = 2  # fewer tokens than the splits use: inside jit, NaN logits
    with pytest.raises(ValueError, match=r"task 'flipflop': split 'valid' holds token ids in \[0, \d+\], outside "
                                         r"the vocabulary \[0, 2\)"):
        train_and_evaluate(config, tmp_path / "run", task=task)
    assert not (tmp_path / "run").exists()


# 4. Evaluation and outputs.

def test_eval_falls_back_past_a_corrupt_checkpoint_and_reports_an_unwritable_workdir(tmp_path, capsys, monkeypatch):
    train_and_evaluate(tiny("run.steps=4", "run.checkpoint_every=2", "run.keep=3", "run.async_checkpoints=false"),
                       tmp_path)
    for path in (tmp_path / "checkpoints" / "4").rglob("*"):
        if path.is_file() and path.stat().st_size > 0 and "state" in path.parts:
            path.write_bytes(b"\0" * path.stat().st_size)  # every state file of the latest checkpoint zeroed
    result = evaluate_checkpoint(tmp_path)
    assert result["step"] == 2 and result["unwritten"] is None
    assert (tmp_path / "checkpoints" / "4").is_dir()  # a reader leaves the directory as it is

    def read_only(path, data):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(experiments, "write_json", read_only)
    capsys.readouterr()
    assert cli.eval_main(["--workdir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "| flipflop | rope | 0 | 2 |" in out
    assert f"jaxpe-eval: could not write eval.json, eval.md in {tmp_path}: Permission denied" in err
    assert "Traceback" not in err
    monkeypatch.undo()
    # asked for that checkpoint by its step, the reader says which one is unreadable, in one line
    (tmp_path / "checkpoints" / "2" / "meta" / "metadata").write_text("not json", encoding="utf-8")
    for step in ("4", "2"):
        assert cli.eval_main(["--workdir", str(tmp_path), "--step", step]) == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines()[-1].startswith(f"jaxpe-eval: error: checkpoint at step {step} in "
                                                       f"{tmp_path / 'checkpoints'} is unreadable ("), err
        assert "Traceback" not in err


# 5. Messages.

def test_resume_is_logged_and_full_disk_is_one_line(tmp_path, capsys, monkeypatch):
    argv = ["--task", "flipflop", "--pe", "rope", "--workdir", str(tmp_path), *TINY, "run.checkpoint_every=2",
            "run.async_checkpoints=false"]
    assert cli.train_main([*argv, "run.steps=2"]) == 0
    assert cli.train_main([*argv, "run.steps=4"]) == 0
    err = capsys.readouterr().err
    assert f"INFO jaxpe.train.experiments: resumed from step 2 (checkpoint in {tmp_path / 'checkpoints'})" in err
    assert f"outputs in {tmp_path}" in err

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(experiments, "write_json", full)
    assert cli.train_main([*argv, "run.steps=6"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"jaxpe-train: error: No space left on device: {tmp_path / 'config.json'}"
    assert "Traceback" not in err


def test_ctrl_c_ends_in_one_line_with_status_130(tmp_path):
    process = subprocess.Popen(cli_command(tmp_path, "run.steps=100000", "run.checkpoint_every=5"), env=cli_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (tmp_path / "checkpoints" / "5").is_dir(), process, "a checkpoint")
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, err
    ours = [line for line in err.splitlines() if line.startswith("jaxpe-train:")]  # libraries may log at exit
    assert len(ours) == 1, err
    assert re.fullmatch(r"jaxpe-train: interrupted at step \d+; rerun the same command to resume", ours[0]), err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def test_compare_says_how_many_finished_runs_it_reused(tmp_path, capsys):
    argv = ["--task", "flipflop", "--pe", "rope", "--seeds", "0", "--workdir", str(tmp_path), *TINY, "run.steps=2"]
    assert cli.compare_main(argv) == 0
    assert "reused" not in capsys.readouterr().err
    assert cli.compare_main(argv) == 0
    err = capsys.readouterr().err
    assert "INFO jaxpe.train.experiments: reused 1 finished run(s) with the same config: rope/seed0" in err
    assert f"outputs in {tmp_path}: compare.json" in err
    assert cli.compare_main([*argv, "model.remat=full", "model.impl=blockwise"]) == 0  # the same maths, another way
    assert "reused 1 finished run(s)" in capsys.readouterr().err


@pytest.mark.parametrize("pe", ["learned", "rope"])
def test_a_position_table_shorter_than_the_task_is_refused_before_training(tmp_path, pe):
    """model.max_len below the task's longest sequence: an additive encoding's table cannot hold it, which is refused
    naming the key before a step trains (it failed at the final evaluation, with no checkpoint saved); the
    encodings without such a table train."""
    config = tiny("run.steps=1", "model.max_len=8", pe=pe)
    if pe == "learned":
        with pytest.raises(ValueError, match=r"model\.max_len=8 is shorter than the longest sequence .*pe='learned'"):
            train_and_evaluate(config, tmp_path)
        assert not tmp_path.exists() or not any(tmp_path.iterdir())
    else:
        assert train_and_evaluate(config, tmp_path)["steps"] == 1
