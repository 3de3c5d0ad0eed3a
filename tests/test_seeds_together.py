"""Seeds trained as one program, several steps a dispatch, and the time limit (jaxpe.train.trainer, feed, loop).

The reference is always the plain path as it was: one run at a time, one step a dispatch, batches from the host.
Stacked seeds run the same maths vmapped, so their results agree with separate runs up to float32 rounding of the
batched matmuls (a stated tolerance, 1e-5 relative); several steps a dispatch and the on-device training set give
the same batches and the same steps (exactly equal on CPU, asserted with that tolerance too).
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tiny_config import TINY
from jaxpe.train import experiments
from jaxpe.train.cli import compare_main
from jaxpe.train.config import TrainConfig, build_config, build_task
from jaxpe.train.loop import Hook, TimeLimitReached, chunk_end
from jaxpe.train.tasks.base import FixedTrainSet

RTOL = 1e-5  # stacked models against separate runs: float32 rounding of batched (vmapped) matmuls
COUNTING = ["task.seq_len=24", "task.n_train=96", "task.max_steps=5", "task.n_valid=16", "task.n_test=16",
            "run.eval_batch_size=16"]


def counting(*overrides: str, pe: str = "cope") -> TrainConfig:
    """A tiny counting config (a fixed training set: the on-device path) with `overrides` on top."""
    tiny = [o for o in TINY if not o.startswith(("task.", "model.max_len", "run.eval_batch_size"))]
    return build_config(task="counting", pe=pe, overrides=[*tiny, *COUNTING, "optim.batch_size=8", *overrides])


def seeded(config: TrainConfig, seed: int) -> TrainConfig:
    return dataclasses.replace(config, run=dataclasses.replace(config.run, seed=seed))


def train_records(run_dir: pathlib.Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines())
            if r["split"] == "train"]


def assert_same_runs(ours: list[dict], theirs: list[dict], dirs: tuple[list, list]) -> None:
    """Same splits' metrics, and the same train loss at every logged step, within RTOL."""
    for a, b, dir_a, dir_b in zip(ours, theirs, *dirs, strict=True):
        assert a["seed"] == b["seed"]
        for split in b["splits"]:
            for metric in ("loss", "seq_error", "token_error"):
                assert a["splits"][split][metric] == pytest.approx(b["splits"][split][metric], rel=RTOL), (split,
                                                                                                            metric)
        rec_a, rec_b = train_records(dir_a), train_records(dir_b)
        assert [r["step"] for r in rec_a] == [r["step"] for r in rec_b]
        np.testing.assert_allclose([r["loss"] for r in rec_a], [r["loss"] for r in rec_b], rtol=RTOL)


def test_seeds_as_one_program_match_separate_runs(tmp_path):
    """jaxpe-compare's default (seeds stacked, several steps a dispatch, the set on the device) against three
    separate one-step-a-dispatch runs: every metric and every logged train loss, and the seeds really differ."""
    base = counting("run.steps=6", "run.log_every=2", "run.checkpoint_every=3")
    separate = [experiments.train_and_evaluate(seeded(base, s), tmp_path / "alone" / str(s)) for s in (0, 1, 2)]
    fast = dataclasses.replace(base, run=dataclasses.replace(base.run, steps_per_dispatch=4))
    together = experiments.compare_encodings([fast], [0, 1, 2], tmp_path / "cmp")["runs"]
    dirs = ([tmp_path / "cmp" / "cope" / f"seed{s}" for s in (0, 1, 2)], [tmp_path / "alone" / str(s) for s in (0, 1, 2)])
    assert_same_runs(together, separate, dirs)
    assert len({r["splits"]["valid"]["loss"] for r in separate}) == 3  # three different models
    assert {r["config"]["run"]["steps_per_dispatch"] for r in together} == {4}


def test_seeds_side_by_side_or_in_turn_step_as_separate_runs():
    """run.seeds_at_once: three stacked seeds one at a time (jax.lax.map), two side by side and then the third (a
    remainder), or all three (vmap): two training steps, one dispatch at a time and both in one (train_steps), and
    an evaluation of each member (a batch, and a split through evaluate_members) equal those of the seed alone (its
    own initial state through one lone Trainer's steps), and the evaluation metrics differ between seeds."""
    import jax

    from jaxpe.train import Trainer
    from jaxpe.train.config import build_model, longest_length
    from jaxpe.train.feed import Feed

    config = counting("run.steps_per_dispatch=2", "run.pad_to=block")  # one length: one compilation a program
    task = build_task(config)
    valid = {"valid": task.eval_splits()["valid"]}
    model = build_model(config.model, task.vocab_size, longest_length(task))
    lone = Trainer(model=model, config=config, seq_len=task.seq_len)
    batches = [lone.put(lone.pad(task.train_batch(step, 8))) for step in range(2)]
    alone = []  # per seed: (state after the steps, the last step's metric sums, the evaluations)
    for seed in (0, 1, 2):
        state = Trainer(model=model, config=seeded(config, seed), seq_len=task.seq_len).init_state()
        for batch in batches:
            state, sums = lone.train_step(state, batch)
        alone.append((state, sums, lone.eval_step(state.params, batches[0]), lone.evaluate(state.params, valid)))
    for at_once in (1, 2, 3):
        stacked = Trainer(model=model, config=dataclasses.replace(
            config, run=dataclasses.replace(config.run, seeds_at_once=at_once)), seq_len=task.seq_len, seeds=(0, 1, 2))
        state = stacked.init_state()
        for batch in batches:
            state, sums = stacked.train_step(state, batch)
        chunk = Feed(stacked, task).steps(0, len(batches))  # both steps: every batch at the block's length
        assert chunk.steps == len(batches)
        dispatched, _ = stacked.train_steps(stacked.init_state(), chunk.data, chunk.rows, np.int32(chunk.steps),
                                            chunk.length)
        evaluated = stacked.eval_step(state.params, batches[0])
        members = zip(stacked.unstack(state), stacked.unstack(dispatched), stacked.unstack(sums),
                      stacked.evaluate_members(state.params, valid), alone, strict=True)
        for member, (ours, in_one, our_sums, our_split, (own, own_sums, own_eval, own_split)) in enumerate(members):
            for a, b, c in zip(jax.tree.leaves(ours), jax.tree.leaves(in_one), jax.tree.leaves(own), strict=True):
                np.testing.assert_allclose(a, c, rtol=RTOL, atol=1e-7, err_msg=f"{at_once} at once")
                np.testing.assert_allclose(b, c, rtol=RTOL, atol=1e-7, err_msg=f"{at_once} at once, one dispatch")
            for name, value in own_eval.items():
                np.testing.assert_allclose(evaluated[name][member], value, rtol=RTOL, err_msg=f"{name}, {at_once}")
            for name, value in own_sums.items():
                np.testing.assert_allclose(our_sums[name], value, rtol=RTOL, err_msg=f"{name}, {at_once}")
            for name, value in own_split["valid"].items():
                assert our_split["valid"][name] == pytest.approx(value, rel=RTOL), (name, at_once)
        assert len({float(nll) for nll in evaluated["nll"]}) == 3


def test_seeds_at_once_resolves_per_platform_and_is_checked():
    """0 (auto) is one seed at a time on a CPU and every seed elsewhere; a number is taken up to the seeds there
    are; a negative or fractional run.seeds_at_once is a ValueError naming it."""
    from jaxpe.train.trainer import members_at_once

    assert [members_at_once(0, 3, p) for p in ("cpu", "gpu", "tpu")] == [1, 3, 3]
    assert [members_at_once(n, 3, "cpu") for n in (1, 2, 3, 8)] == [1, 2, 3, 3]
    for bad in ("-1", "1.5"):
        with pytest.raises(ValueError, match="run.seeds_at_once"):
            counting(f"run.seeds_at_once={bad}")


def test_several_steps_a_dispatch_match_one_at_a_time_with_host_batches(tmp_path):
    """flip-flop (batches made on the host, sent K at a time) with 5 steps a dispatch equals one step a dispatch."""
    from tiny_config import tiny

    one = experiments.train_and_evaluate(tiny("run.steps=7", "run.log_every=3"), tmp_path / "one")
    five = experiments.train_and_evaluate(tiny("run.steps=7", "run.log_every=3", "run.steps_per_dispatch=5"),
                                          tmp_path / "five")
    assert_same_runs([five], [one], ([tmp_path / "five"], [tmp_path / "one"]))


def test_a_time_limit_checkpoints_and_the_rerun_ends_where_an_uninterrupted_run_does(tmp_path):
    """A time limit that has passed at once stops every seed after the first dispatch with a checkpoint there;
    running again resumes all of them and ends with the uninterrupted run's results. A member whose newest checkpoint
    is lost (a save cut between members) sends the others back to their common step, in train_seeds and in
    compare_encodings, so that the rerun still ends where the uninterrupted one does."""
    config = counting("run.steps=8", "run.log_every=2", "run.checkpoint_every=4", "run.steps_per_dispatch=3",
                      "run.async_checkpoints=false")
    whole = experiments.compare_encodings([config], [0, 1, 2], tmp_path / "whole")["runs"]
    with pytest.raises(TimeLimitReached) as stop:
        experiments.compare_encodings([config], [0, 1, 2], tmp_path / "cut", time_limit=1e-9)
    assert stop.value.step == 2  # the first dispatch ends at the first log step
    cut = [tmp_path / "cut" / "cope" / f"seed{s}" for s in (0, 1, 2)]
    assert all(experiments.latest_checkpoint_step(d) == 2 for d in cut)
    with pytest.raises(TimeLimitReached):  # on to step 4 (a checkpoint), then past the limit at the next dispatch
        experiments.compare_encodings([config], [0, 1, 2], tmp_path / "cut", time_limit=1e-9)
    with pytest.raises(TimeLimitReached):
        experiments.compare_encodings([config], [0, 1, 2], tmp_path / "cut", time_limit=1e-9)
    assert [experiments.latest_checkpoint_step(d) for d in cut] == [6, 6, 6]
    shutil.copytree(tmp_path / "cut", tmp_path / "cut2")
    for parent in (tmp_path / "cut", tmp_path / "cut2"):
        shutil.rmtree(parent / "cope" / "seed1" / "checkpoints" / "6")  # seed 1 lost its newest save: back to 4
    task, model = experiments.validate_config(config)
    resumed = experiments.train_seeds([seeded(config, s) for s in (0, 1, 2)], cut, task=task, model=model)
    assert {r["resumed_from"] for r in resumed} == {4}
    whole_dirs = [tmp_path / "whole" / "cope" / f"seed{s}" for s in (0, 1, 2)]
    assert_same_runs(resumed, whole, (cut, whole_dirs))
    compared = experiments.compare_encodings([config], [0, 1, 2], tmp_path / "cut2")["runs"]
    assert {r["resumed_from"] for r in compared} == {4}
    assert_same_runs(compared, whole, ([tmp_path / "cut2" / "cope" / f"seed{s}" for s in (0, 1, 2)], whole_dirs))


def test_dispatches_end_where_a_hook_is_due():
    class Every(Hook):
        def __init__(self, *periods: int):
            self.periods = periods

    hooks = [Every(4), Every(0, 6)]
    ends, step = [], 0
    while step < 13:
        step = chunk_end(step, 13, hooks, steps_per_dispatch=5)
        ends.append(step)
    assert ends == [4, 6, 8, 12, 13]
    assert chunk_end(12, 13, hooks, steps_per_dispatch=1) == 13


def test_a_dispatch_holds_the_steps_of_one_length_and_each_length_compiles_once():
    """A step computes at its batch's own length (Trainer.pad of the host batch) where at least 1/PLAN_SHARE of the
    run's steps need that one, else at the shortest longer such length; a dispatch ends only at K steps or before a
    step of another length; a dispatch of n < K steps leaves the state of n single steps at those lengths; and however
    many steps the dispatches hold, each length compiles once."""
    import jax

    from jaxpe.train import Trainer
    from jaxpe.train.config import build_model, longest_length
    from jaxpe.train.feed import Feed
    from jaxpe.train.tasks.base import PLAN_SHARE

    config = counting("run.steps=48", "run.steps_per_dispatch=4", "run.pad_multiple=2", "task.max_steps=7")
    task = build_task(config)
    trainer = Trainer(model=build_model(config.model, task.vocab_size, longest_length(task)), config=config,
                      seq_len=task.seq_len)
    alone = [trainer.pad(task.train_batch(step, 8))["inputs"].shape[1] for step in range(48)]
    common = {n for n in alone if alone.count(n) * PLAN_SHARE >= 48} | {max(alone)}
    planned = [min(n for n in common if n >= own) for own in alone]
    assert len(common) > 1 and planned != alone  # the test needs several lengths, and rare ones
    feed, state, single, step, counts = Feed(trainer, task), trainer.init_state(), trainer.init_state(), 0, set()
    while step < 48:
        chunk = feed.steps(step, min(4, 48 - step))
        assert planned[step:step + chunk.steps] == [chunk.length] * chunk.steps
        assert chunk.steps == min(4, 48 - step) or planned[step + chunk.steps] != chunk.length
        state, _ = trainer.train_steps(state, chunk.data, chunk.rows, np.int32(chunk.steps), chunk.length)
        for k in range(step, step + chunk.steps):
            batch = {name: array[:, :chunk.length] for name, array in task.train_batch(k, 8).items()}
            single, _ = trainer.train_step(single, trainer.put(batch))
        counts.add(chunk.steps)
        step += chunk.steps
    assert counts & {1, 2, 3} and 4 in counts  # dispatches cut short and whole ones
    for ours, theirs in zip(jax.tree.leaves(state.params), jax.tree.leaves(single.params), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=1e-7)
    assert trainer.train_steps._cache_size() == len(common)


def test_compile_ahead_leaves_the_evaluation_nothing_to_compile():
    """Trainer.compile_ahead compiles every eval step of the planned evaluations in a background thread, ahead of
    time (the parameters' shapes and placements only); evaluating afterwards compiles nothing and gives the metrics
    of a trainer that did not compile ahead, on one device and on a mesh of two. On a CPU it starts nothing unless
    run.compile_ahead is "on"."""
    import jax
    import jax.monitoring

    from jaxpe.train import Trainer
    from jaxpe.train.config import build_model, longest_length

    compiles: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: compiles.append(event) if event.endswith("backend_compile_duration") else None)
    for devices in (1, 2):
        config = counting(f"run.num_devices={devices}", "run.compile_ahead=on")
        task = build_task(config)
        trainers = [Trainer(model=build_model(config.model, task.vocab_size, longest_length(task)), config=config,
                            seq_len=task.seq_len, seeds=(0, 1)) for _ in range(2)]
        state, splits = trainers[0].init_state(), task.eval_splits()
        trainers[0].compile_ahead(state.params, [{"valid": splits["valid"]}, splits])
        trainers[0]._ahead.join()
        before = len(compiles)
        ahead = trainers[0].evaluate_members(state.params, splits)
        assert len(compiles) == before, devices
        assert ahead == trainers[1].evaluate_members(state.params, splits)
    auto = counting("run.num_devices=1")  # "auto": not on a CPU
    cpu = Trainer(model=build_model(auto.model, task.vocab_size, longest_length(task)), config=auto,
                  seq_len=task.seq_len)
    cpu.compile_ahead(cpu.init_state().params, [splits])
    assert cpu._ahead is None


def test_the_fixed_training_set_holds_the_batches():
    """Counting's batches are rows of its training set, as the on-device feed reads them; flip-flop has none."""
    task = build_task(counting())
    assert isinstance(task, FixedTrainSet)
    rows, full = task.train_rows(7, 8), task.train_set()
    for name, array in task.train_batch(7, 8).items():
        np.testing.assert_array_equal(array, full[name][rows])
    from tiny_config import tiny

    assert not isinstance(build_task(tiny()), FixedTrainSet)


def test_compare_cli_time_limit_exits_3_and_resumes(tmp_path, capsys):
    """Stopped at step 1, between two records (log_every=2), the stacked seeds keep their sums of that step in their
    checkpoints, not in an extra record: the resumed comparison logs each seed's records as an uninterrupted one."""
    settings = [*[o for o in TINY if not o.startswith(("task.", "model.max_len", "run.eval_batch_size"))], *COUNTING,
                "optim.batch_size=8", "run.steps=4", "run.log_every=2", "run.checkpoint_every=2"]
    flags = ["--task", "counting", "--pe", "none", "--seeds", "0,1"]
    argv = [*flags, "--workdir", str(tmp_path / "cut"), *settings]
    assert compare_main([*argv, "--time-limit", "1e-9"]) == 3
    assert "time limit reached: stopped at step 1 with a checkpoint" in capsys.readouterr().err  # one step a dispatch
    assert compare_main(argv) == 0
    runs = [tmp_path / "cut" / "none" / f"seed{s}" for s in (0, 1)]
    assert [json.loads((run / "result.json").read_text(encoding="utf-8"))["resumed_from"] for run in runs] == [1, 1]
    assert compare_main([*flags, "--workdir", str(tmp_path / "whole"), *settings]) == 0
    for seed, run in enumerate(runs):
        ours, theirs = train_records(run), train_records(tmp_path / "whole" / "none" / f"seed{seed}")
        assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [2, 4]
        np.testing.assert_allclose([r["loss"] for r in ours], [r["loss"] for r in theirs], rtol=1e-6)
    with pytest.raises(SystemExit) as usage:
        compare_main([*argv, "--time-limit", "0"])
    assert usage.value.code == 2 and "'0' must be > 0 seconds" in capsys.readouterr().err


def test_bfloat16_matches_float32_within_the_seeds_spread_at_cpu_small(tmp_path):
    """Mixed precision (model.dtype=bfloat16; parameters, optimizer state and position arithmetic float32) at the
    cpu-small preset (selective copy, 500 steps; here 300), three seeds each as one program: each split's mean
    error and loss in bfloat16 lie within the float32 seeds' spread (twice the larger standard deviation of the two,
    plus 1 point of error / 0.02 nats of loss for seeds that agree closely). Each side runs `jaxpe-compare` in a
    process of its own at XLA's default settings, as a user's run: this suite's compile-fast settings (conftest.py)
    would make 900 training steps run about twice as long."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    main = "import sys; from jaxpe.train.cli import compare_main; sys.exit(compare_main(sys.argv[1:]))"

    def seeds(dtype: str) -> list[dict]:
        workdir = tmp_path / dtype
        subprocess.run([sys.executable, "-c", main, "--task", "selective_copy", "--pe", "cope", "--seeds", "0,1,2",
                        "--preset", "cpu-small", "--workdir", str(workdir), "run.steps=300", f"model.dtype={dtype}",
                        "run.progress=false", "run.tensorboard=false", "run.steps_per_dispatch=50",
                        "run.num_devices=1"], env=env, check=True, capture_output=True)
        return json.loads((workdir / "compare.json").read_text(encoding="utf-8"))["runs"]

    f32, bf16 = seeds("float32"), seeds("bfloat16")
    assert {r["config"]["model"]["dtype"] for r in bf16} == {"bfloat16"}
    assert {r["config"]["model"]["dtype"] for r in f32} == {"float32"}
    for split in f32[0]["splits"]:
        for metric, slack in (("token_error", 0.01), ("loss", 0.02)):
            a = np.array([r["splits"][split][metric] for r in f32])
            b = np.array([r["splits"][split][metric] for r in bf16])
            spread = 2 * max(a.std(ddof=1), b.std(ddof=1)) + slack
            assert abs(b.mean() - a.mean()) <= spread, (split, metric, a, b)
