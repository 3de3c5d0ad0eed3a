"""jaxpe.train.curves: learning curves read back from jaxpe-compare workdirs, with plateaus worked out by hand."""
from __future__ import annotations

import json
import math
import time

import pytest

from jaxpe.train import curves


def test_plateau_by_hand():
    """Best 0.10 at step 400 of 1000 sequences: within 1.96·sqrt(0.1·0.9/1000) = 0.0186 of it, 0.118 (step 300) is
    the first; 0.12 (step 200) is not."""
    p = curves.plateau([100, 200, 300, 400, 500], [0.5, 0.12, 0.118, 0.10, 0.105], 1000)
    assert p["best_step"] == 400 and p["best"] == 0.10
    assert p["within"] == pytest.approx(1.96 * math.sqrt(0.09 / 1000))
    assert (p["step"], p["error"]) == (300, 0.118)


def test_plateau_of_a_perfect_run_still_has_a_width():
    """An error of 0 gives the interval of one error in the set, not zero: noise can still hide below it."""
    p = curves.plateau([1, 2, 3], [0.01, 0.0005, 0.0], 1000)
    assert p["within"] == pytest.approx(1.96 / 1000)
    assert p["step"] == 2


@pytest.mark.parametrize("steps, errors, sequences", [([], [], 10), ([1], [0.1, 0.2], 10), ([1], [0.1], 0)])
def test_plateau_refuses_bad_input(steps, errors, sequences):
    with pytest.raises(ValueError, match="steps|sequences"):
        curves.plateau(steps, errors, sequences)


METRICS = ("seq_error", "token_error", "bits_per_byte")


def _write_run(root, setting, pe, seed, valid, task="counting"):
    """A run's metrics.jsonl and config.json: each evaluation record holds every metric, as Trainer.evaluate writes
    them; the task's own metric is `valid`'s values (+ 0.2 on len_x2), the others are decoys (0.9, 0.8, 0.7)."""
    run = root / setting / pe / f"seed{seed}"
    run.mkdir(parents=True)
    own = {"counting": "seq_error", "flipflop": "token_error", "selective_copy": "token_error",
           "lm": "bits_per_byte"}[task]
    lines = []
    for step, error in valid:
        lines.append({"step": step, "split": "train", "loss": 2.0 - step / 1000, "accuracy": 0.5})
        for split, value in (("valid", error), ("len_x2", error + 0.2)):
            decoys = {m: d for m, d in zip(METRICS, (0.9, 0.8, 0.7))}
            lines.append({"step": step, "split": split, **decoys, own: value, "loss": 1.0, "sequences": 100})
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    (run / "config.json").write_text(json.dumps({"task": {"name": task}, "optim": {"learning_rate": 0.003}}),
                                     encoding="utf-8")


def test_collect_reads_every_run_and_writes_json_table_and_figure(tmp_path):
    _write_run(tmp_path / "runs", "counting_3var", "cope", 0, [(100, 0.5), (200, 0.2), (300, 0.21)])
    _write_run(tmp_path / "runs", "counting_5var", "relative", 0, [(100, 0.6)])
    assert curves.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    data = json.loads((tmp_path / "out" / "curves.json").read_text(encoding="utf-8"))
    run = data["settings"]["counting_3var"]["cope"]["seed0"]
    assert run["splits"]["valid"]["steps"] == [100, 200, 300]
    assert run["splits"]["len_x2"]["seq_error"] == pytest.approx([0.7, 0.4, 0.41])
    assert run["plateau"]["step"] == 200  # 0.21 is within 1.96·sqrt(0.16/100) = 0.078 of 0.2 too, but later
    assert data["configs"]["counting_3var/cope/seed0"]["optim"]["learning_rate"] == 0.003
    table = (tmp_path / "out" / "curves.md").read_text(encoding="utf-8")
    assert "| counting_5var | relative | seed0 | 100 | 60.0 (100) | 100 (60.0," in table
    assert (tmp_path / "out" / "curves.png").stat().st_size > 1000


def test_collect_without_runs_names_the_layout(tmp_path):
    with pytest.raises(SystemExit):
        curves.main([str(tmp_path), "--out", str(tmp_path / "out")])
    with pytest.raises(ValueError, match="metrics.jsonl"):
        curves.collect(tmp_path)


def test_collect_keeps_only_the_encodings_and_seeds_asked_for(tmp_path):
    for pe, seed in [("cope", 0), ("cope", 1), ("cope", 10), ("relative", 0), ("rope", 0)]:
        _write_run(tmp_path, "counting_3var", pe, seed, [(100, 0.5)])
    data = curves.collect(tmp_path, pes=["cope", "relative"], seeds=[0, 1])
    assert {pe: sorted(seeds) for pe, seeds in data["settings"]["counting_3var"].items()} == {
        "cope": ["seed0", "seed1"], "relative": ["seed0"]}  # seed10 is not seed1
    assert curves.main([str(tmp_path), "--out", str(tmp_path / "out"), "--seeds", "10"]) == 0
    assert sorted(json.loads((tmp_path / "out" / "curves.json").read_text(encoding="utf-8"))["configs"]) == [
        "counting_3var/cope/seed10"]
    with pytest.raises(ValueError, match=r"no runs of encodings \['relative'\] and seeds \[1\] together"):
        curves.collect(tmp_path, pes=["relative"], seeds=[1])  # each is held, never both in one run
    with pytest.raises(SystemExit):
        curves.main([str(tmp_path), "--out", str(tmp_path / "out"), "--seeds", "0,x"])


def test_seeds_compare_as_integers_and_one_seed_twice_is_an_error(tmp_path, capsys):
    """seed01 is seed 1 for --seeds 1 (and seed010 is 10, not 1); seed1 beside seed01 of one encoding and setting is a
    usage error naming both, as is a run directory that names no integer seed."""
    for pe, seed in [("cope", "01"), ("cope", "010"), ("rope", "1")]:
        _write_run(tmp_path / "sweep", "counting_3var", pe, seed, [(100, 0.5)])
    data = curves.collect(tmp_path / "sweep", seeds=[1])
    assert {pe: list(seeds) for pe, seeds in data["settings"]["counting_3var"].items()} == {
        "cope": ["seed01"], "rope": ["seed1"]}
    assert sorted(curves.collect(tmp_path / "sweep", seeds=[10])["configs"]) == ["counting_3var/cope/seed010"]
    with pytest.raises(ValueError, match="seeds: unknown seed.s. 2; the roots hold 1, 10"):
        curves.collect(tmp_path / "sweep", seeds=[2])
    _write_run(tmp_path / "sweep", "counting_3var", "cope", "1", [(100, 0.4)])
    runs = tmp_path / "sweep" / "counting_3var" / "cope"
    for argv in (["--seeds", "1"], []):
        with pytest.raises(SystemExit) as exit_:
            curves.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "out"), *argv])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "Traceback" not in err
        assert (f"error: {str(runs / 'seed01')!r} and {str(runs / 'seed1')!r} both hold seed 1 of cope in setting "
                f"'counting_3var'; keep one") in err
    assert curves.collect(tmp_path / "sweep", seeds=[10])["settings"]  # seed 1's pair is not read
    _write_run(tmp_path / "other", "counting_3var", "cope", "_old", [(100, 0.4)])
    with pytest.raises(ValueError, match=r"run directory .*seed_old' is not named seed<k> with k a non-negative"):
        curves.collect(tmp_path / "other")
    assert not (tmp_path / "out").exists()


def test_a_line_cut_short_ends_the_curve_and_a_bad_line_or_out_is_one_line(tmp_path, capsys):
    """A last metrics.jsonl line without its newline (a run killed as it wrote) is left out; a broken line before it
    is a usage error naming the file and line; so is an --out that is a file."""
    _write_run(tmp_path, "counting_3var", "cope", 0, [(100, 0.5), (200, 0.4)])
    metrics = tmp_path / "counting_3var" / "cope" / "seed0" / "metrics.jsonl"
    whole = metrics.read_text(encoding="utf-8")
    metrics.write_text(whole + '{"step": 300, "split": "val', encoding="utf-8")
    curve = curves.collect(tmp_path)["settings"]["counting_3var"]["cope"]["seed0"]
    assert curve["splits"]["valid"]["steps"] == [100, 200]
    metrics.write_text('{"step": 50, "split": "tra\n' + whole, encoding="utf-8")
    (tmp_path / "file").write_text("", encoding="utf-8")
    for out, message in ((tmp_path / "out", f"{str(metrics)!r}, line 1, is not valid JSON"),
                         (tmp_path / "file", f"--out={str(tmp_path / 'file')!r}: File exists")):
        if out.name == "file":
            metrics.write_text(whole, encoding="utf-8")
        with pytest.raises(SystemExit) as exit_:
            curves.main([str(tmp_path), "--out", str(out)])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"error: {message}" in err and "Traceback" not in err


def test_encodings_and_seeds_no_run_has_are_refused_listing_those_the_roots_hold(tmp_path, capsys):
    """A name or seed that matches no run is a usage error (exit 2), even beside ones that match: not dropped."""
    _write_run(tmp_path / "a", "counting_3var", "cope", 0, [(100, 0.5)])
    _write_run(tmp_path / "a", "counting_3var", "cope", 10, [(100, 0.5)])
    _write_run(tmp_path / "b", "counting_3var", "relative", 2, [(100, 0.5)])
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    for flags, message in [(["--pes", "cope,corope,ropy"], "pes: unknown encoding(s) corope, ropy; the roots hold "
                                                           "cope, relative"),
                           (["--seeds", "0,1"], "seeds: unknown seed(s) 1; the roots hold 0, 2, 10"),
                           (["--pes", "rope"], "pes: unknown encoding(s) rope; the roots hold cope, relative")]:
        with pytest.raises(SystemExit) as exit_:
            curves.main([*roots, "--out", str(tmp_path / "out"), *flags])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"error: {message}\n" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert curves.main([*roots, "--out", str(tmp_path / "out"), "--pes", "cope,relative", "--seeds", "2,10"]) == 0
    assert sorted(json.loads((tmp_path / "out" / "curves.json").read_text(encoding="utf-8"))["configs"]) == [
        "a/counting_3var/cope/seed10", "b/counting_3var/relative/seed2"]


def test_several_roots_name_each_setting_by_its_root(tmp_path):
    _write_run(tmp_path / "lr_a", "counting_5var", "cope", 0, [(100, 0.5), (200, 0.4)])
    _write_run(tmp_path / "lr_b", "counting_5var", "cope", 0, [(100, 0.3)])
    data = curves.collect([tmp_path / "lr_a", tmp_path / "lr_b"])
    assert sorted(data["settings"]) == ["lr_a/counting_5var", "lr_b/counting_5var"]
    assert data["settings"]["lr_b/counting_5var"]["cope"]["seed0"]["splits"]["valid"]["seq_error"] == [0.3]
    assert sorted(data["configs"]) == ["lr_a/counting_5var/cope/seed0", "lr_b/counting_5var/cope/seed0"]
    assert curves.main([str(tmp_path / "lr_a"), str(tmp_path / "lr_b"), "--out", str(tmp_path / "out")]) == 0
    with pytest.raises(ValueError, match="lr_c"):
        curves.collect([tmp_path / "lr_c"])


def test_a_jaxpe_compare_workdir_is_one_setting_named_by_it(tmp_path):
    """`python -m jaxpe.train.curves <a jaxpe-compare --workdir>`: its <pe>/seed<k> runs are one setting, the
    workdir's name, beside a root of settings."""
    _write_run(tmp_path, "counting_3var", "cope", 0, [(100, 0.5), (200, 0.25)])
    _write_run(tmp_path, "counting_3var", "relative", 1, [(100, 0.4)])
    _write_run(tmp_path / "sweep", "counting_5var", "cope", 0, [(100, 0.6)])
    data = curves.collect(tmp_path / "counting_3var")
    assert {pe: sorted(seeds) for pe, seeds in data["settings"]["counting_3var"].items()} == {
        "cope": ["seed0"], "relative": ["seed1"]}
    assert data["settings"]["counting_3var"]["cope"]["seed0"]["splits"]["valid"]["seq_error"] == [0.5, 0.25]
    both = curves.collect([tmp_path / "counting_3var", tmp_path / "sweep"])
    assert sorted(both["configs"]) == ["counting_3var/cope/seed0", "counting_3var/relative/seed1",
                                       "sweep/counting_5var/cope/seed0"]
    assert curves.main([str(tmp_path / "counting_3var"), "--out", str(tmp_path / "out")]) == 0
    assert "| counting_3var | relative | seed1 |" in (tmp_path / "out" / "curves.md").read_text(encoding="utf-8")


def test_window_mean_column(tmp_path):
    _write_run(tmp_path, "counting_5var", "cope", 0, [(100, 0.5), (200, 0.2), (300, 0.1), (400, 0.3)])
    assert curves.main([str(tmp_path), "--out", str(tmp_path / "out"), "--window", "200:300"]) == 0
    table = (tmp_path / "out" / "curves.md").read_text(encoding="utf-8")
    assert "mean seq_error % over steps 200–300 |" in table
    assert table.rstrip().endswith("| 15.0 | — |")  # (0.2 + 0.1) / 2; no event files, no wall time
    data = curves.collect(tmp_path)
    assert curves.window_mean(data["settings"]["counting_5var"]["cope"]["seed0"], 500, 600) is None
    for bad in ("300:200", "1:2:3", "a:b"):
        with pytest.raises(SystemExit):
            curves.main([str(tmp_path), "--out", str(tmp_path / "out"), "--window", bad])


def _write_events(run, scalars_after: tuple[float, ...], suffix: str) -> tuple[float, float]:
    """One start of a run: a tensorboardX writer in <run>/tb (its first event, the file version, at the time it opens)
    and scalars at `scalars_after` seconds after the moment just before it opened. Returns (before, after) it opened."""
    tensorboardX = pytest.importorskip("tensorboardX")
    before = time.time()
    writer = tensorboardX.SummaryWriter(str(run / "tb"), filename_suffix=suffix)
    after = time.time()
    for step, seconds in enumerate(scalars_after):
        writer.add_scalar("train/loss", 1.0, global_step=step, walltime=before + seconds)
    writer.close()
    return before, after


def test_wall_time_is_the_sum_of_each_start_of_the_run(tmp_path):
    """Two starts (a run resumed): 0 -> 90 s and 0 -> 20 s of writer time; the sum is 110 s, less the moments each
    writer took to open (its first event is stamped as it opens). An empty event file and a record cut short by a
    kill add nothing."""
    _write_run(tmp_path, "counting_3var", "cope", 0, [(100, 0.5)])
    run = tmp_path / "counting_3var" / "cope" / "seed0"
    b1, a1 = _write_events(run, (30.0, 90.0), ".a")
    b2, a2 = _write_events(run, (5.0, 20.0), ".b")
    (run / "tb" / "events.out.tfevents.0.empty").write_bytes(b"")
    assert 110.0 - (a1 - b1) - (a2 - b2) <= curves.wall_seconds(run) <= 110.0
    b3, a3 = _write_events(run, (40.0, 600.0), ".c")
    third = next(p for p in (run / "tb").iterdir() if p.name.endswith(".c"))
    third.write_bytes(third.read_bytes()[:-5])  # the 600 s record is cut short: the span ends at 40 s
    assert 150.0 - (a1 - b1) - (a2 - b2) - (a3 - b3) <= curves.wall_seconds(run) <= 150.0
    assert curves.wall_seconds(tmp_path / "nowhere") is None


def test_table_has_each_runs_wall_time_and_each_settings_total(tmp_path):
    _write_run(tmp_path, "counting_3var", "cope", 0, [(100, 0.5)])
    _write_run(tmp_path, "counting_3var", "relative", 0, [(100, 0.6)])
    _write_run(tmp_path, "counting_5var", "cope", 0, [(100, 0.7)])
    _write_events(tmp_path / "counting_3var" / "cope" / "seed0", (1800.0, 3600.0), ".a")
    _write_events(tmp_path / "counting_3var" / "relative" / "seed0", (5400.0,), ".a")
    assert curves.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    data = json.loads((tmp_path / "out" / "curves.json").read_text(encoding="utf-8"))
    assert data["settings"]["counting_3var"]["cope"]["seed0"]["wall_seconds"] == pytest.approx(3600.0, abs=1.0)
    assert data["settings"]["counting_5var"]["cope"]["seed0"]["wall_seconds"] is None
    table = (tmp_path / "out" / "curves.md").read_text(encoding="utf-8")
    assert "| counting_3var | relative | seed0 | 100 | 60.0 (100) | 100 (60.0, 9.6) | 90.0 |" in table
    assert "| counting_5var | cope | seed0 | 100 | 70.0 (100) | 100 (70.0, 9.0) | — |" in table
    assert "Wall time, counting_3var: 2.50 h over 2 runs" in table
    assert "counting_5var:" not in table


def test_each_run_is_read_in_its_tasks_metric(tmp_path):
    """Flip-flop and selective copy in token_error, lm in bits_per_byte, counting in seq_error: each from its
    config.json's task, never another metric of the same records (the decoys)."""
    _write_run(tmp_path, "flipflop", "cope", 0, [(100, 0.30), (200, 0.05), (300, 0.04)], task="flipflop")
    _write_run(tmp_path, "copy", "rope", 0, [(100, 0.5), (200, 0.25)], task="selective_copy")
    _write_run(tmp_path, "lm", "rope", 0, [(100, 2.5), (200, 1.91), (300, 1.9)], task="lm")
    _write_run(tmp_path, "counting_3var", "cope", 0, [(100, 0.2)])
    assert curves.main([str(tmp_path), "--out", str(tmp_path / "out"), "--window", "200:300"]) == 0
    data = json.loads((tmp_path / "out" / "curves.json").read_text(encoding="utf-8"))
    assert data["metrics"] == {"copy": "token_error", "counting_3var": "seq_error", "flipflop": "token_error",
                               "lm": "bits_per_byte"}
    assert data["metric"] is None and data["split"] == "valid"
    flipflop = data["settings"]["flipflop"]["cope"]["seed0"]
    assert flipflop["metric"] == "token_error" and flipflop["splits"]["valid"]["token_error"] == [0.30, 0.05, 0.04]
    assert "seq_error" not in flipflop["splits"]["valid"]
    # within 1.96·sqrt(0.04·0.96/100) = 0.0384 of 0.04: 0.05 (step 200) is the first
    assert (flipflop["plateau"]["step"], flipflop["plateau"]["best_step"]) == (200, 300)
    assert data["settings"]["copy"]["rope"]["seed0"]["splits"]["len_x2"]["token_error"] == pytest.approx([0.7, 0.45])
    lm = data["settings"]["lm"]["rope"]["seed0"]
    assert lm["metric"] == "bits_per_byte" and lm["splits"]["valid"]["bits_per_byte"] == [2.5, 1.91, 1.9]
    # bits per byte is no rate: no binomial interval, the plateau is the best evaluation (1.91 at step 200 would be
    # within a binomial "interval" of 1.9, which does not exist)
    assert lm["plateau"] == {"best_step": 300, "best": 1.9, "step": 300, "error": 1.9, "within": 0.0}
    table = (tmp_path / "out" / "curves.md").read_text(encoding="utf-8")
    assert "| lm | rope | seed0 | 300 | 1.900 (300) | 300 (1.900, 0.000) | 1.905 | — |" in table  # not in %
    assert "| flipflop | cope | seed0 | 300 | 4.0 (300) | 200 (5.0, 3.8) | 4.5 | — |" in table
    assert "lm in bits_per_byte" in table and "flipflop in token_error (%)" in table


def test_a_run_whose_task_is_unknown_is_refused_naming_it(tmp_path):
    _write_run(tmp_path, "counting_3var", "cope", 0, [(100, 0.2)])
    run = tmp_path / "counting_3var" / "cope" / "seed0"
    (run / "config.json").unlink()
    with pytest.raises(ValueError, match="seed0.*config.json.*task.name"):
        curves.collect(tmp_path)
    (run / "config.json").write_text(json.dumps({"task": {"name": "countin"}}), encoding="utf-8")
    with pytest.raises(ValueError, match="task.name='countin'.*no known task"):
        curves.collect(tmp_path)
    with pytest.raises(SystemExit):
        curves.main([str(tmp_path), "--out", str(tmp_path / "out")])


def test_a_setting_of_two_metrics_is_refused(tmp_path):
    _write_run(tmp_path, "mixed", "cope", 0, [(100, 0.2)])
    _write_run(tmp_path, "mixed", "rope", 0, [(100, 2.0)], task="lm")
    with pytest.raises(ValueError, match="setting 'mixed' mixes metrics"):
        curves.collect(tmp_path)


def test_paths_from_the_home_directory_after_an_equals_sign(tmp_path, monkeypatch, capsys):
    """--out=~/out: a shell expands no ~ after a flag's '='; the command does, rather than make a folder named ~ in
    the current directory. Errors name the command as it is run."""
    home, here = tmp_path / "home", tmp_path / "here"
    here.mkdir()
    _write_run(home / "runs", "counting_3var", "cope", 0, [(100, 0.5)])
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(here)
    assert curves.main(["~/runs", "--out=~/out"]) == 0
    assert list(json.loads((home / "out" / "curves.json").read_text(encoding="utf-8"))["settings"]) == ["counting_3var"]
    assert list(here.iterdir()) == []
    with pytest.raises(SystemExit):
        curves.main(["~/runs", "--out=~/out", "--seeds", "0,x"])
    assert capsys.readouterr().err.splitlines()[-1].startswith("python -m jaxpe.train.curves: error:")
