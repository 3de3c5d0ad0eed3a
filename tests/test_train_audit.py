"""The training package as a user running their own runs meets it: size checks of every layer pattern, a corpus of
one's own files, resuming, hostile config values; each a case that once failed."""
from __future__ import annotations

import codecs
import dataclasses
import json
import logging
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.train import cli, experiments
from jaxpe.train.config import build_config, to_dict
from jaxpe.train.loop import MetricsLog
from jaxpe.train.tasks import base, make_task
from jaxpe.train.tasks.counting import generate_samples, write_jsonl
from jaxpe.train.workdir import write_json

from tiny_config import TINY, tiny


def exit_status(main, argv) -> int:
    """The command's exit status, whether it returns it or argparse exits."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def test_state_size_counts_every_layer_pattern_exactly():
    """A pattern of period 3 (not 1, 2 or 4) with a table of its own in every third layer: state_size equals the
    count of the whole model's parameters traced in full."""
    overrides = ["model.num_layers=14", "model.layer_pe=cope,none,none", "model.pe_options.shared_table=false"]
    _, model = experiments.validate_config(tiny(*overrides, pe="cope"))
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
    count = sum(leaf.size for leaf in jax.tree.leaves(shapes))
    assert experiments.state_size(model) == (count, 3 * 4 * count)  # float32 parameters and two moments


@pytest.mark.parametrize("override, message", [
    ("task.eval_multiples=2", "task.eval_multiples=2 must be a list, e.g. task.eval_multiples=[2,4]"),
    ("task.eval_multiples=2,4", "task.eval_multiples='2,4' must be a list"),
    ("task.suffixes=5", "task.suffixes=5 must be a list"),
    ("task.suffixes=true", "task.suffixes=True must be a list"),
])
def test_a_list_option_given_one_value_is_a_usage_error_naming_it(override, message, tmp_path, capsys, monkeypatch):
    """A number where the lm task takes a list was 'int' object is not iterable, naming no key."""
    (tmp_path / "book.txt").write_text("some text to model, " * 50, encoding="utf-8")
    monkeypatch.setattr(cli.experiments, "train_seeds", None)  # a call would fail with a TypeError
    status = exit_status(cli.train_main, ["--task", "lm", "--workdir", str(tmp_path / "run"),
                                          f"task.source={tmp_path}", override])
    err = capsys.readouterr().err
    assert status == 2 and f"jaxpe-train: error: {message}" in err and "Traceback" not in err


def test_a_resume_may_change_how_many_steps_a_dispatch_runs_and_compile_ahead(tmp_path):
    """run.steps_per_dispatch and run.compile_ahead change no result (a dispatch of K steps computes K single steps);
    a resume that changes them was refused as another config. It ends where the uninterrupted run does."""
    steps = ["run.checkpoint_every=2", "run.async_checkpoints=false", "model.dropout=0.1"]
    whole = experiments.train_and_evaluate(tiny("run.steps=4", *steps), tmp_path / "whole")
    experiments.train_and_evaluate(tiny("run.steps=2", *steps), tmp_path / "cut")
    resumed = experiments.train_and_evaluate(
        tiny("run.steps=4", "run.steps_per_dispatch=2", "run.compile_ahead=off", *steps), tmp_path / "cut")
    assert resumed["resumed_from"] == 2
    for split, values in whole["splits"].items():
        assert resumed["splits"][split] == pytest.approx(values, rel=1e-5)


@pytest.mark.parametrize("every, why", [(0, "the run saves none (run.checkpoint_every=0"),
                                        (5, "the run has saved none yet (run.checkpoint_every=5)")])
def test_eval_of_a_run_without_a_checkpoint_says_why(every, why, tmp_path, capsys):
    """A workdir that holds a run's config.json but no checkpoint: jaxpe-eval said 'step=None: no such checkpoint'."""
    write_json(tmp_path / "config.json", to_dict(tiny(f"run.checkpoint_every={every}")))
    status = exit_status(cli.eval_main, ["--workdir", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert f"jaxpe-eval: error: no checkpoint in {tmp_path / 'checkpoints'}: {why}" in err


def test_a_run_on_a_relative_corpus_path_is_read_back_from_another_directory(tmp_path, monkeypatch, capsys):
    """`task.source=corpus` given in one directory: jaxpe-eval (and restore_run) of the run from another directory
    said "source path 'corpus' does not exist"; resuming there with the same relative path names another corpus,
    refused naming the setting."""
    (tmp_path / "here" / "corpus").mkdir(parents=True)
    (tmp_path / "here" / "corpus" / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40,
                                                        encoding="utf-8")
    (tmp_path / "elsewhere" / "corpus").mkdir(parents=True)
    (tmp_path / "elsewhere" / "corpus" / "a.txt").write_text("another text altogether, " * 60, encoding="utf-8")
    lm = ["--task", "lm", "task.source=corpus", "task.seq_len=16", "task.eval_bytes=64", "task.eval_multiples=[2]",
          "run.steps=2", "run.checkpoint_every=2", "run.async_checkpoints=false"]
    tiny_lm = [word for word in TINY if not word.startswith(("task.", "model.max_len"))]
    monkeypatch.chdir(tmp_path / "here")
    assert exit_status(cli.train_main, [*tiny_lm, *lm, "--workdir", str(tmp_path / "run")]) == 0
    monkeypatch.chdir(tmp_path / "elsewhere")
    capsys.readouterr()
    assert exit_status(cli.eval_main, ["--workdir", str(tmp_path / "run")]) == 0, capsys.readouterr().err
    assert experiments.restore_run(tmp_path / "run").task.corpus["bytes"] == 45 * 40
    status = exit_status(cli.train_main, [*tiny_lm, *lm, "--workdir", str(tmp_path / "run")])
    assert status == 2 and "task.options.source" in capsys.readouterr().err


@pytest.mark.parametrize("main", [cli.train_main, cli.compare_main])
def test_more_devices_than_present_is_refused_before_anything_is_written(main, tmp_path, capsys):
    """run.num_devices beyond the devices here was refused by the Trainer, after config.json and the lock were
    written, as 'num_devices=99 must be ...' (not the key a user sets)."""
    argv = ["--task", "flipflop", "--workdir", str(tmp_path / "run"), *TINY,
            f"run.num_devices={jax.device_count() + 1}"]
    status = exit_status(main, argv)
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert f"error: run.num_devices={jax.device_count() + 1} must be in [1, {jax.device_count()}]" in err
    assert not (tmp_path / "run").exists()


def test_counting_data_and_presets_saved_with_a_byte_order_mark_read_as_without(tmp_path):
    """Windows editors and PowerShell write UTF-8 with a byte order mark and CRLF line ends: such .jsonl files (and a
    preset) were refused as 'Unexpected UTF-8 BOM'; they now give the same samples (and settings) as plain ones."""
    plain, marked = tmp_path / "plain", tmp_path / "marked"
    for split, seed in (("train", 1), ("valid", 2), ("test", 3)):
        write_jsonl(plain / f"{split}.jsonl", generate_samples(16, nvars=2, min_steps=3, max_steps=8, seed=seed))
        marked.mkdir(exist_ok=True)
        data = (plain / f"{split}.jsonl").read_bytes()
        (marked / f"{split}.jsonl").write_bytes(codecs.BOM_UTF8 + data.replace(b"\n", b"\r\n"))
    want, got = (make_task("counting", data_dir=str(d), nvars=2, max_steps=8).eval_splits() for d in (plain, marked))
    assert list(got) == list(want)
    for name in want:
        np.testing.assert_array_equal(got[name].inputs, want[name].inputs)
        np.testing.assert_array_equal(got[name].targets, want[name].targets)
    (tmp_path / "preset.json").write_bytes(codecs.BOM_UTF8 + b'{"model": {"num_layers": 3}}\r\n')
    assert build_config(preset=str(tmp_path / "preset.json")).model.num_layers == 3


def test_eval_of_a_comparison_names_its_runs(tmp_path, capsys):
    """jaxpe-eval on a jaxpe-compare workdir (its runs one level down) said only 'is it a jaxpe-train workdir?'."""
    for pe in ("cope", "rope"):
        (tmp_path / pe / "seed0").mkdir(parents=True)
        write_json(tmp_path / pe / "seed0" / "config.json", to_dict(tiny(pe=pe)))
    status = exit_status(cli.eval_main, ["--workdir", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert (f"holds no config.json; it holds the runs of a comparison: give one of them ({tmp_path}/cope/seed0, "
            f"{tmp_path}/rope/seed0)") in err


def test_a_file_named_twice_in_the_corpus_is_refused(tmp_path):
    """task.source=[dir/a.txt, dir]: the file was read as two documents ('a.txt' and 'dir/a.txt'), which split by
    document could send to train and test alike."""
    (tmp_path / "texts").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "texts" / name).write_text(f"{name} holds some text to model. " * 20, encoding="utf-8")
    with pytest.raises(ValueError, match=r"source=\(\S*, \S*\) names the file .*a\.txt' twice \(as 'a\.txt' and "
                                         r"'texts/a\.txt'\)"):
        make_task("lm", source=[str(tmp_path / "texts" / "a.txt"), str(tmp_path / "texts")], seq_len=16)


def test_a_broken_link_in_the_corpus_is_a_usage_error(tmp_path, capsys):
    """A link to no file among the corpus' files ended as an OS error (exit 1), not as a setting to mend."""
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("some text to model. " * 20, encoding="utf-8")
    (tmp_path / "texts" / "b.txt").symlink_to(tmp_path / "gone.txt")
    status = exit_status(cli.train_main, ["--task", "lm", "--workdir", str(tmp_path / "run"),
                                          f"task.source={tmp_path / 'texts'}"])
    err = capsys.readouterr().err
    assert status == 2 and f"task.source={str(tmp_path / 'texts')!r} holds 1 link(s) to no file, e.g. " in err


@pytest.mark.parametrize("override, message", [
    (f"task.n_eval={10**20}", "jaxpe-train: error: a setting too large to store as an integer ("),
    (f"model.vocab_size={10**20}", "jaxpe-train: error: a setting too large to store as an integer ("),
    # its logits are counted (in Python's integers) before NumPy sees it
    (f"optim.batch_size={10**20}", "GiB of memory here; lower model.d_model"),
])
def test_a_size_too_large_to_store_is_one_line(override, message, tmp_path, capsys):
    """A size of 21 digits passes every bound and then overflowed NumPy or jax: an OverflowError traceback."""
    status = exit_status(cli.train_main, ["--task", "flipflop", "--workdir", str(tmp_path / "run"), *TINY, override])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert message in err and "optim.batch_size" in err
    assert not (tmp_path / "run").exists()


def test_a_kill_while_a_resume_trims_metrics_jsonl_loses_no_record(tmp_path, monkeypatch):
    """Resuming rewrites metrics.jsonl without the records past the resume step; a kill in the middle of that write
    left the file cut short (records before the resume step lost for good). Now the old file stays whole until the
    new one replaces it."""
    lines = [json.dumps({"step": step, "split": "train", "loss": 1.0 / step}) for step in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    write_text = pathlib.Path.write_text

    def killed_halfway(self: pathlib.Path, text: str, *args, **kwargs) -> int:
        write_text(self, text[:len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt  # the process dies here

    monkeypatch.setattr(pathlib.Path, "write_text", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        MetricsLog(tmp_path, resume_step=3, enabled=True, tensorboard=False)
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text(encoding="utf-8").splitlines() == lines


@pytest.mark.parametrize("preset, message", [
    ({"tasks": {"flipflopp": {"seq_len": 32}}}, "preset '{path}': 'tasks' names unknown task(s) ['flipflopp']"),
    ({"encodings": {"cpoe": {"npos": 8}}}, "preset '{path}': 'encodings' names unknown encoding(s) ['cpoe']"),
])
def test_a_preset_naming_an_unknown_task_or_encoding_is_refused(preset, message, tmp_path):
    """A misspelt task or encoding in a preset of one's own: its options were never applied, and nothing said so."""
    path = tmp_path / "preset.json"
    path.write_text(json.dumps(preset), encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(message.format(path=path))):
        build_config(preset=str(path), task="flipflop", pe="cope")


def test_longer_splits_of_documents_shorter_than_the_training_length_are_flagged(tmp_path, caplog):
    """Documents no longer than L bytes: len_x2 scores the very bytes and positions test does, and silently reported
    the same number as if the model generalised to twice its length. A warning says so; one long document is
    enough to silence it."""
    (tmp_path / "short").mkdir()
    for i in range(5):
        (tmp_path / "short" / f"{i}.txt").write_text(f"note {i}: a short line.\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="jaxpe.train.tasks.lm"):
        task = make_task("lm", source=str(tmp_path / "short"), seq_len=32, eval_multiples=[2])
    test, longer = task.eval_splits()["test"], task.eval_splits()["len_x2"]
    assert longer.weights.sum() == test.weights.sum() and not longer.weights[:, 32:].any()  # the premise
    assert "no test document is longer than task.seq_len=32 bytes: len_x2 scores" in caplog.text
    caplog.clear()
    (tmp_path / "short" / "long.txt").write_text("a much longer note that runs on well past the training length. " * 3,
                                                 encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="jaxpe.train.tasks.lm"):
        make_task("lm", source=str(tmp_path / "short"), seq_len=32, eval_multiples=[2], test_fraction=0.4)
    assert "len_x2 scores" not in caplog.text


def test_a_warmup_longer_than_the_run_is_flagged(caplog):
    """run.steps=50 with the default 100 warmup steps: the learning rate never reached optim.learning_rate (half of
    it at the end), and nothing said so; a comparison says it once, not once an encoding."""
    message = "optim.warmup_steps=100 >= run.steps=50: the learning rate never reaches optim.learning_rate"
    with caplog.at_level(logging.WARNING, logger="jaxpe.train.experiments"):
        experiments.warn_schedule([tiny("optim.warmup_steps=100", "run.steps=50", pe=pe) for pe in ("rope", "cope")])
    assert caplog.text.count(message) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxpe.train.experiments"):
        experiments.warn_schedule([tiny("optim.warmup_steps=10", "run.steps=50")])
    assert "warmup" not in caplog.text


def test_a_list_override_reads_json_as_the_task_options_do():
    """`model.layer_pe=["cope","none"]` (JSON, as task lists are written) was split at its commas into the unknown
    encodings '["cope"' and '"none"]'."""
    as_json = build_config(task="counting", pe="cope", overrides=['model.layer_pe=["cope","none"]'])
    assert as_json.model.layer_pe == ("cope", "none") == build_config(
        task="counting", pe="cope", overrides=["model.layer_pe=cope,none"]).model.layer_pe
    with pytest.raises(ValueError, match="config key 'model.layer_pe': cannot read"):
        build_config(task="counting", pe="cope", overrides=['model.layer_pe=["cope",'])


def test_a_run_and_a_comparison_do_not_share_a_workdir(tmp_path, capsys):
    """jaxpe-train into a jaxpe-compare root (or the reverse) mixed the two commands' files; now one line, exit 2."""
    comparison, run = tmp_path / "comparison", tmp_path / "run"
    (comparison / "rope" / "seed0").mkdir(parents=True)
    write_json(comparison / "rope" / "seed0" / "config.json", to_dict(tiny()))
    run.mkdir()
    write_json(run / "config.json", to_dict(tiny()))
    assert exit_status(cli.train_main, ["--task", "flipflop", "--pe", "rope", "--workdir", str(comparison), *TINY]) == 2
    assert "holds a comparison" in capsys.readouterr().err
    assert exit_status(cli.compare_main, ["--task", "flipflop", "--pe", "rope", "--seeds", "0", "--workdir", str(run),
                                          *TINY]) == 2
    assert "holds the run of a jaxpe-train command" in capsys.readouterr().err
    assert not (comparison / "config.json").exists() and not (run / "rope").exists()


@pytest.mark.parametrize("option", ["task.n_train=10000000000", "task.max_steps=1000000000000"])
def test_counting_programs_past_the_host_memory_are_refused_before_generating(option, capsys):
    """Generation of that many statements ran for hours (at least 5 bytes of text each, more than the host holds)."""
    status = exit_status(cli.train_main, ["--task", "counting", "--workdir", "unused", option])
    assert status == 2 and "GiB of text, more than this host's memory" in capsys.readouterr().err


@pytest.mark.parametrize("own, limited", [("0::/job/step\n", "job/memory.max"),
                                          ("4:memory:/job/step\n0::/\n", "memory/job/memory.limit_in_bytes")])
def test_a_model_past_its_control_groups_memory_is_refused(own, limited, tmp_path, monkeypatch, capsys):
    """In a container or a batch job whose control group (cgroup v2, or v1's memory hierarchy) holds less than the
    host's physical memory, a model past the group's limit passed the check and was killed by the kernel without a
    word (exit 137); the limit is read from the process's group up (its own here says "max": no limit)."""
    group_limit = tmp_path / "fs" / limited
    for path, text in ((group_limit, f"{2**20}\n"), (group_limit.parent / "step" / group_limit.name, "max\n")):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    (tmp_path / "cgroup").write_text(own, encoding="utf-8")
    monkeypatch.setattr(base, "CGROUP_ROOT", tmp_path / "fs")
    monkeypatch.setattr(base, "OWN_CGROUPS", tmp_path / "cgroup")
    assert base.host_memory_bytes() == 2**20
    status = exit_status(cli.train_main, ["--task", "flipflop", "--pe", "rope", "--workdir", str(tmp_path / "run"),
                                          *TINY, "model.d_model=256"])
    assert status == 2 and "GiB of memory here; lower model.d_model" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()

BIG_VOCAB = ["model.vocab_size=50000", "run.eval_batch_size=8"]  # TINY: d_model 16, 1 layer, batch 16, length 16


def test_a_run_whose_logits_do_not_fit_is_refused_before_its_first_step(tmp_path, monkeypatch, capsys):
    """A 50000-token vocabulary at d_model 16: 0.8M parameters, 9.6 MB with Adam's moments, but the training logits
    [16, 16, 50000] float32 and their gradient take 102 MB. The check counted the parameters and optimizer state
    only: under 64 MiB of memory the run passed it and would be killed at its first step (exit 137, no word). Now it
    is refused before anything is written, naming the sizes; the cpu-small preset fits in the same memory."""
    monkeypatch.setattr(experiments, "memory_bytes", lambda devices=None: 64 * 2**20)
    logits = 2 * 16 * 16 * 50000 * 4  # [B, L, V] float32, with the gradient
    layers = 1 * 16 * 16 * 16 * 4  # one layer's input [B, L, d_model] float32
    state = 3 * 4 * (50000 * 16 + 16 * 16 * 12 + 16 * 13)  # the parameters (the embedding dominates), Adam's moments
    status = exit_status(cli.train_main, ["--task", "flipflop", "--pe", "rope", "--workdir", str(tmp_path / "run"),
                                          *TINY, *BIG_VOCAB])
    err = capsys.readouterr().err
    assert status == 2 and not (tmp_path / "run").exists()
    assert f"{logits / 2**30:.3g} GiB of logits (float32 [batch, length, model.vocab_size=50000]" in err
    assert f"{layers / 2**30:.3g} GiB of layer inputs" in err and "more than the 0.0625 GiB of memory here" in err
    task, model = experiments.validate_config(tiny(pe="rope"))  # the model alone fits: the logits make the difference
    assert experiments.state_size(model)[1] < 64 * 2**20 and state < 64 * 2**20 < state + logits
    assert experiments.step_bytes(model, tiny(pe="rope"), task) == (2 * 16 * 16 * task.vocab_size * 4, layers)
    experiments.validate_config(build_config(preset="cpu-small", pe="cope"))


@pytest.mark.parametrize("at_once", [1, 3])
def test_stacked_seeds_count_the_logits_of_each_run_computed_side_by_side(at_once, tmp_path, monkeypatch):
    """Seeds stacked as one program: S runs' parameters and optimizer state, and the logits of the run.seeds_at_once
    of them a step computes side by side (vmap), each its own [B, L, V]. Memory for 3 runs' state and 2 runs' step:
    all 3 side by side do not fit (at most 2 together), one at a time more than 3 do. Stacked runs counted only the
    state before, and 3 side by side passed where their logits did not fit."""
    config = tiny("model.vocab_size=50000", f"run.seeds_at_once={at_once}")
    task, model = experiments.validate_config(config)
    state, step = experiments.state_size(model)[1], sum(experiments.step_bytes(model, config, task))
    assert experiments.held_bytes(model, config, task, 3) == 3 * state + at_once * step
    memory = 3 * state + 2 * step
    monkeypatch.setattr(experiments, "memory_bytes", lambda devices=None: memory)
    # side by side, S runs hold S (state + step); one at a time, S state + one step
    assert experiments.stackable(model, config, task) == (2 if at_once == 3 else (memory - step) // state)
    configs = [dataclasses.replace(config, run=dataclasses.replace(config.run, seed=s)) for s in (0, 1, 2)]
    if at_once == 3:
        with pytest.raises(ValueError, match=r"seeds \[0, 1, 2\]: 3 runs stacked hold .* train at most 2 together"):
            experiments.train_seeds(configs, [tmp_path / str(s) for s in (0, 1, 2)], task=task, model=model)
        assert not any(tmp_path.iterdir())


def test_a_replicated_state_counts_once_on_each_device_of_the_mesh(monkeypatch):
    """Without run.fsdp every device of a data-parallel mesh holds the parameters and Adam's moments whole (the CPU
    devices of one host too, each in its own buffers), while a step's batch is split over them. The check counted the
    state once: 4 devices' copies passed in memory for one. Memory for 2 copies and a step: 4 devices are refused,
    naming the devices and run.fsdp; 2 devices, or 4 with run.fsdp, fit, and stacked seeds count each run's copies."""
    def held(*overrides: str) -> int:
        config = tiny("model.vocab_size=5000", *overrides)
        task, model = experiments.validate_config(config)
        return experiments.held_bytes(model, config, task)

    config = tiny("model.vocab_size=5000", "run.num_devices=4")
    task, model = experiments.validate_config(config)
    state, step = experiments.state_size(model)[1], sum(experiments.step_bytes(model, config, task))
    assert held("run.num_devices=4") == 4 * state + step and held("run.num_devices=4", "run.fsdp=true") == state + step
    assert held("run.num_devices=2") == 2 * state + step
    monkeypatch.setattr(experiments, "memory_bytes", lambda devices=None: 2 * state + step)
    with pytest.raises(ValueError, match=r"GiB with the optimizer's state on each of the run's 4 devices \(.* GiB; "
                                         r"run.fsdp=true spreads one copy over them\)"):
        experiments.validate_config(config)
    experiments.validate_config(tiny("model.vocab_size=5000", "run.num_devices=2"))
    experiments.validate_config(tiny("model.vocab_size=5000", "run.num_devices=4", "run.fsdp=true"))
    # stacked seeds: two runs' state fit on one device, one run's two copies on two devices
    assert experiments.stackable(model, tiny("model.vocab_size=5000", "run.num_devices=1"), task) == 2
    assert experiments.stackable(model, tiny("model.vocab_size=5000", "run.num_devices=2"), task) == 1


class _Device:
    """A device that reports `limit` bytes as its memory (None: none, as a CPU)."""

    def __init__(self, limit: int | None):
        self.limit = limit

    def memory_stats(self) -> dict[str, int] | None:
        return None if self.limit is None else {"bytes_limit": self.limit}


def test_memory_bytes_gives_each_device_the_smallest_limit_or_the_host_memory(monkeypatch):
    """A data-parallel step needs the same bytes on each device: two accelerators of 16 and 80 GiB give a run 32 GiB,
    not 96; devices reporting no limit (CPUs, which share the host) give the host's memory."""
    monkeypatch.setattr(experiments, "host_memory_bytes", lambda: 7)
    assert experiments.memory_bytes([_Device(16 << 30), _Device(80 << 30)]) == 32 << 30
    assert experiments.memory_bytes([_Device(None), _Device(None)]) == 7
    assert experiments.memory_bytes() == 7  # this process's CPU devices


def test_compare_reuses_a_finished_run_that_differs_in_display_and_cadence_only(tmp_path, capsys):
    """A rerun with run.progress or the log cadence changed retrained every finished run (from scratch where it kept no
    checkpoint); a changed run.steps still trains again."""
    argv = ["--task", "flipflop", "--pe", "rope", "--seeds", "0", "--workdir", str(tmp_path), *TINY, "run.steps=2"]
    assert cli.compare_main(argv) == 0
    capsys.readouterr()
    assert cli.compare_main([*argv, "run.progress=true", "run.log_every=2", "run.steps_per_dispatch=2"]) == 0
    assert "reused 1 finished run(s)" in capsys.readouterr().err
    assert cli.compare_main([*argv, "run.steps=3"]) == 0
    assert "reused" not in capsys.readouterr().err


def test_compare_builds_a_shared_task_once(tmp_path, monkeypatch):
    """Every encoding of a comparison trains on one task: its corpus read (or its programs generated) once, not once
    an encoding."""
    built = []
    real = experiments.build_task
    monkeypatch.setattr(experiments, "build_task", lambda config: built.append(config.task) or real(config))
    argv = ["--task", "flipflop", "--pe", "rope,none", "--seeds", "0", "--workdir", str(tmp_path), *TINY, "run.steps=1"]
    assert cli.compare_main(argv) == 0
    assert len(built) == 1
