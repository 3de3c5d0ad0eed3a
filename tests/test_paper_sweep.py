"""benchmarks/paper_sweep_gpu.sh --dry-run: the GPU sweep's every step on CPU at a tiny scale. It prints its plan,
stops at its time limit with the cut cell checkpointed (exit status 3), goes on from there when called again, ends
with each run's result.json, the variable count's compare.json and sweep.json (measured seconds, compile seconds,
the device), and redoes no finished run."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import paper_sweep  # noqa: E402


def sweep(dest: pathlib.Path, *flags: str) -> subprocess.CompletedProcess:
    """The dry run in a subprocess (the suite's XLA flags with it)."""
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    return subprocess.run([str(ROOT / "benchmarks" / "paper_sweep_gpu.sh"), "--dry-run", str(dest), "--nvars", "1",
                           "--pe", "none", "--seeds", "0,1", *flags], env=env, capture_output=True, text=True)


def test_the_dry_run_plans_is_cut_resumes_and_redoes_nothing(tmp_path):
    dest = tmp_path / "sweep"
    cut = sweep(dest, "--time-limit", "0.01")
    assert cut.returncode == 3, cut.stderr
    assert "1var/none        todo step      0" in cut.stdout
    assert "time limit reached at step 2 (checkpointed)" in cut.stdout
    runs = [dest / "counting_1var" / "none" / f"seed{s}" for s in (0, 1)]
    assert all((run / "checkpoints" / "2").is_dir() and not (run / "result.json").exists() for run in runs)

    again = sweep(dest)
    assert again.returncode == 0, again.stderr
    assert "1var/none        cut  step      2" in again.stdout
    results = [json.loads((run / "result.json").read_text(encoding="utf-8")) for run in runs]
    assert [r["resumed_from"] for r in results] == [2, 2] and [r["seed"] for r in results] == [0, 1]
    assert not any((run / "checkpoints").exists() for run in runs)  # finished: only the results are kept
    compare = json.loads((dest / "counting_1var" / "compare.json").read_text(encoding="utf-8"))
    assert [row["pe"] for row in compare["rows"]] == ["none"]
    record = json.loads((dest / "sweep.json").read_text(encoding="utf-8"))
    assert record["cells"]["1var/none"]["steps"] == 4 and record["cells"]["1var/none"]["compile_s"] > 0
    assert record["environment"]["device"].startswith("cpu")

    written = [(run / "result.json").stat().st_mtime_ns for run in runs]
    done = sweep(dest, "--plan-only")
    assert done.returncode == 0 and "1var/none        done" in done.stdout and "left: ~0 min, 0 call(s)" in done.stdout
    assert [(run / "result.json").stat().st_mtime_ns for run in runs] == written



def test_seconds_per_step_leave_out_the_record_that_holds_the_compilation(tmp_path):
    """A cell's speed is its steps' seconds over their count past the call's start, the first record after it (whose
    interval holds the compilation) left out, and the records of an earlier call (at or before `since`) too."""
    cell, = paper_sweep.cells(tmp_path, (1,), ("cope",), paper_sweep.DRY_RUN)
    tokens = cell.config.optim.batch_size * cell.config.task.options["seq_len"]  # 8 x 24 a step
    # (step, seconds since the record before): a first call to step 4, cut; this call from step 4 (compiling: 30 s)
    intervals = [(2, 50.0), (4, 1.0), (6, 30.0), (8, 1.0), (12, 3.0)]
    steps = [0] + [step for step, _ in intervals]
    lines = [json.dumps({"step": step, "split": "train", "tokens_per_s": tokens * (step - before) / seconds})
             for (step, seconds), before in zip(intervals, steps)]
    lines.insert(2, json.dumps({"step": 4, "split": "valid", "loss": 1.0}))
    for run_dir in cell.run_dirs((0, 1)):  # each seed's records: the stacked program's seconds
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert paper_sweep.seconds_per_step(cell, (0, 1), since=4) == pytest.approx((1.0 + 3.0) / 6)
    assert paper_sweep.seconds_per_step(cell, (0, 1), since=8) is None  # one record: only compilation and steps


def test_a_rerun_with_other_overrides_counts_no_run_of_the_old_config_as_done(tmp_path, capsys):
    """A finished cell is done only for the config that finished it: with another run.steps it is to do again (in
    the plan, under the time limit), not passed over and then trained whole by the closing comparison; with another
    learning rate the sweep refuses it in one line (exit 2), not with a traceback."""
    dest = tmp_path / "sweep"
    assert sweep(dest).returncode == 0
    runs = [dest / "counting_1var" / "none" / f"seed{s}" for s in (0, 1)]
    written = [(run / "result.json").stat().st_mtime_ns for run in runs]
    flags = [str(dest), "--dry-run", "--nvars", "1", "--pe", "none", "--seeds", "0,1"]
    assert paper_sweep.main([*flags, "--plan-only", "run.log_every=1"]) == 0  # a cadence: the results still hold
    assert "1var/none        done step      6" in capsys.readouterr().out
    assert paper_sweep.main([*flags, "--plan-only", "run.steps=8"]) == 0
    assert "1var/none        todo step      0" in capsys.readouterr().out
    assert paper_sweep.main([*flags, "optim.learning_rate=1e-3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("paper_sweep.py: error: 1var/none: workdir ") and "optim.learning_rate" in err
    assert len(err.splitlines()) == 1
    assert [(run / "result.json").stat().st_mtime_ns for run in runs] == written

def test_overrides_may_come_after_the_flags(tmp_path, capsys):
    """A bad override after a flag is read (and refused, exit 2); good ones between and after the flags plan as
    usual."""
    dest = str(tmp_path / "sweep")
    with pytest.raises(SystemExit) as exit_:
        paper_sweep.main([dest, "--dry-run", "--plan-only", "model.d_model=7", "--nvars", "1"])
    assert exit_.value.code == 2 and "d_model=7 must be a multiple of" in capsys.readouterr().err
    assert paper_sweep.main([dest, "--dry-run", "run.steps=8", "--plan-only", "model.d_model=32", "--nvars", "1",
                             "optim.batch_size=4"]) == 0
    assert "1var/cope        todo step      0" in capsys.readouterr().out


def test_an_override_before_dest_is_an_override_not_dest(tmp_path, capsys):
    """DEST is the one positional word without '=', before or after the overrides: an override first is still read
    (a bad one refused as such), and the plan is DEST's."""
    dest = str(tmp_path / "sweep")
    with pytest.raises(SystemExit) as exit_:
        paper_sweep.main(["model.d_model=7", dest, "--dry-run", "--plan-only", "--nvars", "1"])
    assert exit_.value.code == 2 and "d_model=7 must be a multiple of" in capsys.readouterr().err
    for words in (["run.steps=8", dest, "model.d_model=32"], [dest, "run.steps=8"],
                  ["run.steps=8", "--keep-checkpoints", dest]):
        assert paper_sweep.main([*words, "--dry-run", "--plan-only", "--nvars", "1", "--pe", "none"]) == 0
        assert capsys.readouterr().out.startswith(f"paper sweep in {dest} (dry run, CPU): 1 cells x 3 seeds\n")
    for words, got in ([["run.steps=8"], "got only key=value overrides"],
                       [[dest, "run.steps=8", "other"], f"got {dest!r}, 'other'"]):
        with pytest.raises(SystemExit) as exit_:
            paper_sweep.main([*words, "--dry-run", "--plan-only"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "Traceback" not in err
        assert f"error: give one DEST, the sweep's directory, beside the key=value overrides ({got})" in err
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("flags, message", [
    (["--nvars", "0"], "argument --nvars: '0' must be comma-separated integers >= 1"),
    (["--nvars", "3,x"], "argument --nvars: '3,x' must be comma-separated integers >= 1"),
    (["--nvars", "3,3"], "argument --nvars: '3,3' repeats 3: give each once"),
    (["--seeds", "0,0"], "argument --seeds: '0,0' repeats 0: give each once"),
    (["--seeds", "-1"], "argument --seeds: '-1' must be comma-separated integers in [0, 2147483647]"),
    (["--seeds", "2147483648"], "argument --seeds: '2147483648' must be comma-separated integers in [0, 2147483647]"),
    (["--pe", "cope,cope"], "argument --pe: 'cope,cope' repeats cope: give each once"),
    (["--pe", "cope,ropey"], "argument --pe: unknown encoding(s) ['ropey']"),
    (["--time-limit", "nan"], "argument --time-limit: 'nan' must be > 0 seconds"),
    (["--time-limit", "-5"], "argument --time-limit: '-5' must be > 0 seconds"),
    (["task.seed=abc"], "paper_sweep.py: error: task.seed='abc' must be an int"),
    (["run.steps=2147483648"], "paper_sweep.py: error: run.steps=2147483648 must be <= 2147483647"),
    (["run.seed=5"], "paper_sweep.py: error: 'run.seed=5': paper_sweep.py trains the seeds of --seeds (each run's "
                     "run.seed); give --seeds 5 instead"),
])
def test_bad_options_are_usage_errors_naming_the_option(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        paper_sweep.main([str(tmp_path / "sweep"), "--dry-run", "--plan-only", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "sweep").exists()


def test_a_dest_that_is_a_file_or_a_config_the_task_refuses_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("", encoding="utf-8")
    with pytest.raises(SystemExit) as exit_:
        paper_sweep.main([str(tmp_path / "file"), "--dry-run"])
    assert exit_.value.code == 2 and "exists and is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        paper_sweep.main(["", "--dry-run"])  # not the current directory
    assert exit_.value.code == 2 and "DEST '' names no directory" in capsys.readouterr().err
    # run.eval_splits names a split counting lacks: compare_encodings refuses it before training, in one line
    assert paper_sweep.main([str(tmp_path / "sweep"), "--dry-run", "--nvars", "1", "--pe", "none",
                             "run.eval_splits=bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("paper_sweep.py: error: 1var/none: run.eval_splits: unknown split(s) ['bogus']")
    assert len(err.splitlines()) == 1
