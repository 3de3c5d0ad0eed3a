"""A jaxpe-train run read back in your own code: `restore_run` in a process with another device count, and the
resolved values a run saves (config.json, result.json) that still compare equal to the unresolved config."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from jaxpe.train.cli import eval_main
from jaxpe.train.config import build_config, build_task, resolve_config, to_dict
from jaxpe.train.experiments import finished_result, restore_run, train_and_evaluate
from jaxpe.train.workdir import check_same_run
from tiny_config import ROOT, cli_env, tiny, xla_flags

DOCS = ROOT / "docs" / "training.md"


def docs_block() -> str:
    """The Python block of docs/training.md that loads a trained run (the one after its needs-a-trained-run note)."""
    text = DOCS.read_text(encoding="utf-8")
    after = text[text.index("<!-- needs a trained run: tests/test_restore_anywhere.py"):]
    return after[after.index("```python\n") + len("```python\n"):after.index("```\n", 10)]


def test_a_two_device_run_restores_in_a_one_device_process(tmp_path, capsys):
    """An lm run trained on 2 devices (of the suite's 8) loads in a process of 1 device with the docs' own code,
    and gives there the logits it gives here; jaxpe-eval shows its progress."""
    (tmp_path / "book.txt").write_text("def main(args):\n    return sum(args)\n" * 40, encoding="utf-8")
    config = build_config(task="lm", pe="rope", overrides=[
        f"task.source={tmp_path / 'book.txt'}", "task.seq_len=16", "task.eval_bytes=64", "task.eval_multiples=[]",
        "model.d_model=16", "model.num_layers=1", "model.num_heads=2", "optim.batch_size=8", "run.steps=3",
        "run.checkpoint_every=3", "run.eval_every=0", "run.eval_batch_size=8", "run.async_checkpoints=false",
        "run.progress=false", "run.num_devices=2"])
    workdir = tmp_path / "runs" / "book"
    train_and_evaluate(config, workdir)
    run = restore_run(workdir)  # here, on 2 of the suite's 8 devices
    assert run.trainer.mesh.size == 2 and int(run.state.step) == 3
    prompt = np.frombuffer(b"def main(", np.uint8).astype(np.int32)[None]
    expected = np.asarray(run.model.apply({"params": run.state.params}, prompt))
    check = 'np.save("logits.npy", np.asarray(logits)); print(jax.device_count(), run.config.run.num_devices)'
    env = cli_env(XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", f"import jax\n{docs_block()}\n{check}"], env=env,
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].split() == ["1", "1"]  # one device, the count the run is read on
    assert done.stdout.startswith("def main(")  # the decoded prompt and what the model generated after it
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), expected, rtol=1e-5, atol=1e-5)
    # jaxpe-eval shows its progress on stderr: a bar over the sequences of every split, with --progress even though
    # the run was trained with run.progress=false, and none without it
    total = sum(split.inputs.shape[0] for split in run.task.eval_splits().values())
    assert total == 4 + 4  # valid and test: 64 bytes in windows of 16
    capsys.readouterr()
    assert eval_main(["--workdir", str(workdir), "--progress"]) == 0
    bar = capsys.readouterr().err
    assert "eval: 100%" in bar and f"{total}/{total}" in bar
    assert eval_main(["--workdir", str(workdir)]) == 0
    assert "eval:" not in capsys.readouterr().err


READ_BACK = """
import sys
import types
import jax
from jaxpe.train.cli import eval_main
from jaxpe.train.experiments import restore_run


class Accelerators(list):
    \"\"\"The host's devices as a host of accelerators lists them to distributed.make_mesh, whose rule for
    run.num_devices=0 on a CPU (the devices that divide the batches) then does not apply.\"\"\"

    def __getitem__(self, index):
        return types.SimpleNamespace(platform="gpu") if index == 0 else super().__getitem__(index)


if sys.argv[2] == "gpu":
    jax.devices = lambda devices=jax.devices: Accelerators(devices())
run = restore_run(sys.argv[1])
print(jax.device_count(), run.trainer.mesh.size, run.config.run.num_devices)
sys.exit(eval_main(["--workdir", sys.argv[1]]))
"""


@pytest.mark.parametrize("trained_on, platform", [(0, "cpu"), (0, "gpu"), (4, "gpu")])
def test_a_run_is_read_on_the_devices_that_split_its_batches(trained_on, platform, tmp_path):
    """A run of batch 4 trained on all devices (run.num_devices=0: here 4 of the suite's 8) or on 4 of them, read in
    a process of 3 devices: restore_run and jaxpe-eval take the most of them that split its batches, 2, and
    Run.config says so, on a CPU and on a host of accelerators (its devices listed as a GPU's). Before,
    run.num_devices stayed 0 ("all"), which on accelerators takes all 3 and refused batch 4 ("optim.batch_size=4
    must be a multiple of the 3 devices"); only a CPU mesh of 0 took the devices that divide it."""
    config = tiny("optim.batch_size=4", "run.eval_batch_size=4", f"run.num_devices={trained_on}", "run.steps=2",
                  "run.checkpoint_every=2", "run.async_checkpoints=false")
    workdir = tmp_path / "run"
    train_and_evaluate(config, workdir)
    env = cli_env(XLA_FLAGS=xla_flags(3), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", READ_BACK, str(workdir), platform], env=env, capture_output=True,
                          text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[0].split() == ["3", "2", "2"]
    evaluated = json.loads((workdir / "eval.json").read_text(encoding="utf-8"))
    assert evaluated["step"] == 2 and evaluated["splits"].keys() == {"valid", "ood_sparse", "ood_dense"}


def test_saved_configs_hold_the_resolved_values_and_still_match(tmp_path):
    config = tiny("run.steps=2", "model.max_len=none")  # max_len and vocab_size left to the task
    assert config.model.max_len is None and config.model.vocab_size is None
    task = build_task(config)
    result = train_and_evaluate(config, tmp_path)
    resolved = resolve_config(config, task)
    assert (resolved.model.vocab_size, resolved.model.max_len) == (task.vocab_size, 16)
    for saved in (json.loads((tmp_path / "config.json").read_text(encoding="utf-8")), result["config"],
                  json.loads((tmp_path / "result.json").read_text(encoding="utf-8"))["config"]):
        assert (saved["model"]["vocab_size"], saved["model"]["max_len"]) == (task.vocab_size, 16)
        assert saved["task"]["options"]["p_ignore_train"] == 0.8  # every task option, defaults included
        assert saved["task"]["options"]["seq_len"] == 16
    check_same_run(tmp_path, config, task)  # the unresolved config is the same run
    assert finished_result(tmp_path, config, task) is not None
    with pytest.raises(ValueError, match="model.max_len: 16 -> 32"):
        check_same_run(tmp_path, tiny("run.steps=2", "model.max_len=32"), task)
    assert finished_result(tmp_path, tiny("run.steps=2", "model.max_len=32"), task) is None
    # a config saved before runs resolved it (nulls, the options given only) is the same run as the resolved one
    old = to_dict(config)
    assert old["model"]["max_len"] is None and "p_ignore_train" not in old["task"]["options"]
    (tmp_path / "config.json").write_text(json.dumps(old), encoding="utf-8")
    (tmp_path / "result.json").write_text(json.dumps({**result, "config": old}), encoding="utf-8")
    check_same_run(tmp_path, resolved, task)
    check_same_run(tmp_path, config, task)
    assert finished_result(tmp_path, resolved, task) is not None
    with pytest.raises(ValueError, match="model.max_len: 16 -> 32"):
        check_same_run(tmp_path, tiny("run.steps=2", "model.max_len=32"), task)
