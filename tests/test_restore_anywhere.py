"""A jaxpe-train run read back in your own code: `restore_run` in a process with another device count, and the
resolved values a run saves (config.json, result.json) that still compare equal to the unresolved config."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxpe.train.cli import eval_main
from jaxpe.train.config import build_task, resolve_config, to_dict
from jaxpe.train.experiments import _finished_result, restore_run, train_and_evaluate
from jaxpe.train.workdir import check_same_run
from tiny_config import ROOT, cli_env, tiny

# What docs/training.md shows: a run restored by hand in a process of 1 CPU device, its logits on a batch.
RESTORE = textwrap.dedent("""
    import sys, numpy as np, jax
    from jaxpe.train import restore_run
    run = restore_run(sys.argv[1])
    tokens = np.load(sys.argv[2])
    logits = run.model.apply({"params": run.state.params}, tokens)
    np.save(sys.argv[3], np.asarray(logits))
    print(jax.device_count(), run.config.run.num_devices, int(run.state.step))
""")


def test_a_two_device_run_restores_in_a_one_device_process(tmp_path, capsys):
    config = tiny("run.steps=3", "run.checkpoint_every=3", "run.async_checkpoints=false", "run.num_devices=2",
                  "run.fsdp=true")
    train_and_evaluate(config, tmp_path / "run")
    run = restore_run(tmp_path / "run")  # here, on the suite's 8 devices
    assert run.trainer.mesh.size == 2 and int(run.state.step) == 3
    tokens = run.task.eval_splits()["valid"].inputs[:2]
    expected = np.asarray(run.model.apply({"params": run.state.params}, tokens))
    np.save(tmp_path / "tokens.npy", tokens)
    env = cli_env(XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", RESTORE, str(tmp_path / "run"), str(tmp_path / "tokens.npy"),
                           str(tmp_path / "logits.npy")], env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1", "0", "3"]  # one device, the mesh over all of them (0), step 3
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), expected, rtol=1e-5, atol=1e-5)
    # jaxpe-eval shows its progress on stderr: a bar over the sequences of every split (24 in each of 3), with
    # --progress even though the run was trained with run.progress=false, and none without it
    assert [s.inputs.shape[0] for s in run.task.eval_splits().values()] == [24, 24, 24]
    capsys.readouterr()
    assert eval_main(["--workdir", str(tmp_path / "run"), "--progress"]) == 0
    bar = capsys.readouterr().err
    assert "eval: 100%" in bar and "72/72" in bar
    assert eval_main(["--workdir", str(tmp_path / "run")]) == 0
    assert "eval:" not in capsys.readouterr().err


def test_saved_configs_hold_the_resolved_values_and_still_match(tmp_path):
    config = tiny("run.steps=2", "model.max_len=none")  # max_len and vocab_size left to the task
    assert config.model.max_len is None and config.model.vocab_size is None
    task = build_task(config)
    result = train_and_evaluate(config, tmp_path)
    resolved = resolve_config(config, task)
    assert (resolved.model.vocab_size, resolved.model.max_len) == (task.vocab_size, 16)
    for saved in (json.loads((tmp_path / "config.json").read_text()), result["config"],
                  json.loads((tmp_path / "result.json").read_text())["config"]):
        assert (saved["model"]["vocab_size"], saved["model"]["max_len"]) == (task.vocab_size, 16)
    check_same_run(tmp_path, config, task)  # the unresolved config is the same run
    assert _finished_result(tmp_path, config, task) is not None
    with pytest.raises(ValueError, match="model.max_len: 16 -> 32"):
        check_same_run(tmp_path, tiny("run.steps=2", "model.max_len=32"), task)
    assert _finished_result(tmp_path, tiny("run.steps=2", "model.max_len=32"), task) is None
    # a config saved before runs resolved it (nulls) is the same run as the resolved one, and resumes
    old = to_dict(config)
    (tmp_path / "config.json").write_text(json.dumps(old))
    check_same_run(tmp_path, resolved, task)
    again = train_and_evaluate(config, tmp_path)
    assert again["config"] == result["config"]
