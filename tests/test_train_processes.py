"""Real subprocesses: a SIGKILLed run resumes to the uninterrupted result; two processes train together."""
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess

import numpy as np
import pytest

from jaxpe.train.experiments import train_and_evaluate

from tiny_config import cli_command, cli_env, tiny, wait_for, xla_flags


def records(workdir: pathlib.Path, split: str) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def test_sigkill_then_restart_matches_uninterrupted_run(tmp_path):
    steps = ["run.steps=150", "run.checkpoint_every=5", "run.keep=2", "run.num_devices=1", "model.dropout=0.1"]
    killed = tmp_path / "killed"
    process = subprocess.Popen(cli_command(killed, *steps), env=cli_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    # the first checkpoint, 145 steps before the end: orbax renames a finished save into place
    wait_for(lambda: (killed / "checkpoints" / "5").is_dir(), process, "the first checkpoint")
    os.kill(process.pid, signal.SIGKILL)
    process.communicate()
    assert not (killed / "result.json").exists(), "the run finished before the kill; make it longer"

    restarted = subprocess.run(cli_command(killed, *steps), env=cli_env(), capture_output=True, text=True,
                               timeout=600)
    assert restarted.returncode == 0, restarted.stderr
    resumed = json.loads((killed / "result.json").read_text(encoding="utf-8"))
    assert resumed["resumed_from"] is not None and 5 <= resumed["resumed_from"] < 150
    assert resumed["resumed_from"] % 5 == 0

    reference = train_and_evaluate(tiny(*steps), tmp_path / "reference")
    got, want = records(killed, "train"), records(tmp_path / "reference", "train")
    assert [r["step"] for r in got] == list(range(1, 151))
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-6)
    for split, values in reference["splits"].items():
        assert resumed["splits"][split] == pytest.approx(values, rel=1e-6)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_processes(workdir: pathlib.Path, steps: list[str]) -> list[str]:
    """Runs the CLI in two localhost processes of one CPU device each (gloo collectives); returns their stdout."""
    coordinator = f"127.0.0.1:{free_port()}"
    processes = [
        subprocess.Popen(
            cli_command(workdir, *steps, "run.num_devices=0"),
            env=cli_env(XLA_FLAGS=xla_flags(1), JAXPE_COORDINATOR=coordinator,
                    JAXPE_NUM_PROCESSES="2", JAXPE_PROCESS_ID=str(i)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600) for p in processes]
    for p, (out, err) in zip(processes, outputs):
        assert p.returncode == 0, err
    return [out for out, _ in outputs]


def test_two_processes_train_checkpoint_and_resume_together(tmp_path):
    """Two processes = one process with two devices; their checkpoints restore in both processes: dropping the
    last checkpoint and rerunning resumes from the one before and ends with the same result."""
    steps = ["run.steps=4", "run.checkpoint_every=2", "run.async_checkpoints=false", "model.dropout=0.1"]
    multi = tmp_path / "multi"
    outputs = launch_two_processes(multi, steps)
    tables = [out.strip().splitlines()[-1] for out in outputs]  # the result row of each process
    assert tables[0] == tables[1] and tables[0].startswith("| flipflop | rope | 0 |")

    reference = train_and_evaluate(tiny(*steps, "run.num_devices=2"), tmp_path / "reference")
    got, want = records(multi, "train"), records(tmp_path / "reference", "train")
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-5)
    first = json.loads((multi / "result.json").read_text(encoding="utf-8"))
    for split, values in reference["splits"].items():
        assert first["splits"][split] == pytest.approx(values, rel=1e-5)

    assert sorted(int(p.name) for p in (multi / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
    shutil.rmtree(multi / "checkpoints" / "4")
    (multi / "result.json").unlink()
    launch_two_processes(multi, steps)
    resumed = json.loads((multi / "result.json").read_text(encoding="utf-8"))
    assert resumed["resumed_from"] == 2
    assert resumed["splits"] == first["splits"]
