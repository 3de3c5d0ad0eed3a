"""Seeds trained as one program in the cases a user meets: members that stand at different checkpoints, a member
whose loss becomes NaN, and bad values for the seeds and the time limit (jaxpe.train.experiments, trainer).

The references are separate runs (or the uninterrupted run), never values of the code under test alone; stacked
members agree with them to test_seeds_together's tolerance (RTOL).
"""
from __future__ import annotations

import json
import logging
import pathlib
import shutil

import jax
import pytest

from test_seeds_together import COUNTING, RTOL, assert_same_runs, counting, seeded
from tiny_config import TINY
from jaxpe.train import experiments
from jaxpe.train.checkpoint import Checkpoints
from jaxpe.train.cli import compare_main
from jaxpe.train.loop import NonFiniteLossError, TimeLimitReached
from jaxpe.train.trainer import Trainer
from jaxpe.train.workdir import NONFINITE_NAME

# Two seeds, dropout, a checkpoint and an evaluation every 2 of 6 steps, 2 steps a dispatch: the runs the tests
# below compare, cut and resume.
CUTTABLE = ("run.steps=6", "run.log_every=2", "run.checkpoint_every=2", "run.eval_every=2", "run.keep=3",
            "run.steps_per_dispatch=2", "run.async_checkpoints=false", "model.dropout=0.2")


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, list[dict]]:
    """The uninterrupted comparison of CUTTABLE's seeds, given as 1, 0 (its workdir, and its runs in seed order):
    the tests' reference."""
    workdir = tmp_path_factory.mktemp("whole")
    runs = experiments.compare_encodings([counting(*CUTTABLE)], [1, 0], workdir)["runs"]
    return workdir, sorted(runs, key=lambda run: run["seed"])


def cut_copy(whole: tuple[pathlib.Path, list[dict]], workdir: pathlib.Path) -> list[pathlib.Path]:
    """A copy of the whole comparison in `workdir` with the runs unfinished (result.json deleted); its run dirs."""
    shutil.copytree(whole[0], workdir)
    run_dirs = [workdir / "cope" / f"seed{s}" for s in (0, 1)]
    for run_dir in run_dirs:
        (run_dir / "result.json").unlink()
    return run_dirs


def test_seeds_out_of_order_with_dropout_and_evaluations_match_their_separate_runs(whole, tmp_path):
    """Seeds given out of order (1, 0), dropout (each member draws its own run's masks) and evaluations during
    training, 2 steps a dispatch: each run's results and every train and evaluation record equal its separate
    run's (one step a dispatch) within RTOL, and the two seeds' models differ."""
    alone = counting(*CUTTABLE, "run.steps_per_dispatch=1", "run.checkpoint_every=0")
    separate = [experiments.train_and_evaluate(seeded(alone, s), tmp_path / str(s)) for s in (0, 1)]
    ours, theirs = [whole[0] / "cope" / f"seed{s}" for s in (0, 1)], [tmp_path / str(s) for s in (0, 1)]
    assert_same_runs(whole[1], separate, (ours, theirs))
    for mine, its in zip(ours, theirs, strict=True):
        evals = [[r for r in map(json.loads, (d / "metrics.jsonl").read_text(encoding="utf-8").splitlines())
                  if r["split"] != "train"]
                 for d in (mine, its)]
        assert [(r["step"], r["split"]) for r in evals[0]] == [(r["step"], r["split"]) for r in evals[1]]
        assert [r["loss"] for r in evals[0]] == pytest.approx([r["loss"] for r in evals[1]], rel=RTOL)
    assert whole[1][0]["splits"]["valid"]["loss"] != whole[1][1]["splits"]["valid"]["loss"]


def test_members_rewound_to_a_common_checkpoint_save_the_later_steps_again(whole, tmp_path):
    """A member whose newest checkpoint is lost sends the others back to their common step; their own later
    checkpoints are deleted, not left to collide with the step saved again (orbax refused it:
    StepAlreadyExistsError, on every rerun), and the runs end as the uninterrupted ones."""
    cut = cut_copy(whole, tmp_path / "cut")
    shutil.rmtree(cut[1] / "checkpoints" / "6")  # seed 1's last save was cut: both resume from step 4
    resumed = experiments.compare_encodings([counting(*CUTTABLE)], [0, 1], tmp_path / "cut")["runs"]
    assert [r["resumed_from"] for r in resumed] == [4, 4]
    assert [experiments.latest_checkpoint_step(d) for d in cut] == [6, 6]
    assert_same_runs(resumed, whole[1], (cut, [whole[0] / "cope" / f"seed{s}" for s in (0, 1)]))


def test_a_member_whose_loss_becomes_nan_leaves_the_others_to_finish_as_their_separate_runs(whole, tmp_path):
    """Seed 1 resumes from a checkpoint of NaN parameters: its loss is NaN at once. Trained alone (--separate-seeds)
    seed 0 still finishes; stacked, seed 0 stopped with it, on every rerun, and its result was never written. Now
    seed 0 trains on without it (here cut by the time limit), and a rerun trains seed 1 apart, after seed 0, so that
    seed 0 goes on from where it stood, not from seed 1's step (under a time limit it never got past it), and ends
    as the uninterrupted run; the next rerun names seed 1 in its error."""
    config, cut = counting(*CUTTABLE), cut_copy(whole, tmp_path / "cut")
    for run_dir in cut:
        for step in (4, 6):
            shutil.rmtree(run_dir / "checkpoints" / str(step))
    run = experiments.restore_run(cut[1], step=2)
    checkpoints = Checkpoints(cut[1] / "checkpoints", keep=config.run.keep, best_metric="unused", async_save=False)
    _, meta = checkpoints.restore(2, run.trainer.abstract_state())
    checkpoints.delete_after(1)
    checkpoints.save(2, run.state.replace(params=jax.tree.map(lambda x: x * float("nan"), run.state.params)), meta)
    checkpoints.close()
    with pytest.raises(TimeLimitReached):  # seed 1 NaN by step 4; seed 0 on from step 2, cut at step 4
        experiments.compare_encodings([config], [0, 1], tmp_path / "cut", time_limit=1e-9)
    assert [experiments.latest_checkpoint_step(d) for d in cut] == [4, 2]
    with pytest.raises(TimeLimitReached):  # seed 0 on from step 4 to the end; seed 1, past the limit, not begun
        experiments.compare_encodings([config], [0, 1], tmp_path / "cut", time_limit=1e-9)
    finished = json.loads((cut[0] / "result.json").read_text(encoding="utf-8"))
    assert finished["resumed_from"] == 4
    assert_same_runs([finished], whole[1][:1], ([cut[0]], [whole[0] / "cope" / "seed0"]))
    with pytest.raises(NonFiniteLossError, match=r"by step 4 \(seed 1;") as error:
        experiments.compare_encodings([config], [0, 1], tmp_path / "cut")
    assert not (cut[1] / "result.json").exists() and experiments.latest_checkpoint_step(cut[1]) == 2
    assert error.value.seeds == (1,)
    assert (cut[1] / NONFINITE_NAME).is_file() and not (cut[0] / NONFINITE_NAME).exists()


@pytest.mark.parametrize("time_limit, error, message", [
    ("5", TypeError, "time_limit='5' must be a number of seconds"),
    (float("nan"), ValueError, "time_limit=nan must be >= 0 seconds"),
    (-1.0, ValueError, "time_limit=-1.0 must be >= 0 seconds"),
])
def test_a_time_limit_that_is_no_number_of_seconds_is_refused_before_anything_is_written(time_limit, error, message,
                                                                                         tmp_path):
    """NaN was no limit at all, a negative one stopped at the first dispatch, a string failed deep inside the loop
    (unsupported operand type(s) for +)."""
    config = counting("run.steps=2")
    with pytest.raises(error, match=message):
        experiments.compare_encodings([config], [0, 1], tmp_path / "cmp", time_limit=time_limit)
    with pytest.raises(error, match=message):
        experiments.train_and_evaluate(config, tmp_path / "run", time_limit=time_limit)
    assert not (tmp_path / "cmp").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("seeds, error, message", [
    ((0, 1.5), TypeError, r"seeds=\(0, 1.5\) must be ints"),  # was truncated to seed 1 (int32)
    ((0, True), TypeError, r"seeds=\(0, True\) must be ints"),
    ((-1, 0), ValueError, r"seeds=\(-1, 0\) must each be in \[0, 2147483647\]"),  # run.seed=-1 is refused
    ((0, 2**31), ValueError, r"must each be in \[0, 2147483647\]"),  # would wrap around as int32
])
def test_trainer_seeds_are_run_seeds(seeds, error, message):
    """Trainer(seeds=...) takes what run.seed takes: ints in [0, MAX_SEED]."""
    config = counting()
    task, model = experiments.validate_config(config)
    with pytest.raises(error, match=message):
        Trainer(model=model, config=config, seq_len=task.seq_len, seeds=seeds)


def test_compare_refuses_a_run_seed_override_it_would_drop(tmp_path, capsys):
    """jaxpe-compare sets every run's run.seed from --seeds: `run.seed=5` trained seed 0 (the default --seeds)."""
    with pytest.raises(SystemExit) as usage:
        compare_main(["--task", "counting", "--pe", "none", "--workdir", str(tmp_path / "cmp"), *COUNTING, "run.seed=5",
                      "model.d_model=16", "model.num_layers=1", "run.steps=1", "run.progress=false"])
    assert usage.value.code == 2
    assert "'run.seed=5': jaxpe-compare trains the seeds of --seeds" in capsys.readouterr().err
    assert not (tmp_path / "cmp").exists()


def test_seeds_past_the_memory_train_in_programs_that_fit(whole, tmp_path, monkeypatch, caplog):
    """Where one run's parameters and optimizer state fit in memory but the stacked seeds' do not, jaxpe-compare
    trains them in programs of as many as fit (each run as the uninterrupted comparison's), and train_seeds refuses
    to stack more, before anything is written: stacked, they would abort XLA or exhaust the host."""
    config = counting(*CUTTABLE)
    task, model = experiments.validate_config(config)
    one = experiments.held_bytes(model, config, task)  # one run's state and step; a second run's state does not fit
    monkeypatch.setattr(experiments, "memory_bytes", lambda devices=None: one + experiments.state_size(model)[1] // 2)
    with pytest.raises(ValueError, match=r"seeds \[0, 1\]: 2 runs stacked hold .* train at most 1 together"):
        experiments.train_seeds([config, seeded(config, 1)], [tmp_path / "a", tmp_path / "b"], task=task, model=model)
    assert not (tmp_path / "a").exists()
    with caplog.at_level(logging.INFO, logger="jaxpe"):
        runs = experiments.compare_encodings([config], [0, 1], tmp_path / "cmp")["runs"]
    assert "training cope seed(s) 0\n" in caplog.text + "\n" and "training cope seed(s) 1\n" in caplog.text + "\n"
    assert_same_runs(runs, whole[1], ([tmp_path / "cmp" / "cope" / f"seed{s}" for s in (0, 1)],
                                      [whole[0] / "cope" / f"seed{s}" for s in (0, 1)]))


def test_train_seeds_refuses_configs_that_differ_in_another_run_field(tmp_path):
    """Each member trains with the first config's run settings: a second config of another run.steps (or any run
    field but the seed) trained 2 steps and was saved as a run of 4."""
    config = counting("run.steps=2")
    task, model = experiments.validate_config(config)
    other = seeded(counting("run.steps=4"), 1)
    with pytest.raises(ValueError, match=r"configs must differ in run.seed only, each seed once; got seeds \[0, 1\]"):
        experiments.train_seeds([config, other], [tmp_path / "a", tmp_path / "b"], task=task, model=model)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_comparison_past_its_time_limit_begins_no_further_run(tmp_path, capsys):
    """An encoding whose runs end past the time limit ends the call (exit 3): the next encoding's runs began anyway,
    compiled and trained whole where a run is one dispatch long, however far past the limit."""
    tiny = [o for o in TINY if not o.startswith(("task.", "model.max_len", "run.eval_batch_size"))]
    argv = ["--task", "counting", "--pe", "none,rope", "--seeds", "0", "--workdir", str(tmp_path), *tiny, *COUNTING,
            "optim.batch_size=8", "run.steps=2", "run.log_every=2", "run.steps_per_dispatch=2"]
    assert compare_main([*argv, "--time-limit", "1e-9"]) == 3
    assert "time limit reached: stopped at step 2 with a checkpoint" in capsys.readouterr().err
    assert (tmp_path / "none" / "seed0" / "result.json").is_file()
    assert not (tmp_path / "rope" / "seed0").exists()
