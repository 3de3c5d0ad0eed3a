"""jaxpe.train.tables and its command line jaxpe.train.report: each encoding's mean and 95 % interval in the right
column, bold only for a best whose interval overlaps no other."""
import json
import math

import numpy as np
import pytest

from jaxpe.train import report, tables
from jaxpe.train.tables import interval95, summarize_seeds


def comparison(tmp_path, name, metric, rows=None, runs=None, task=None):
    path = tmp_path / name
    path.mkdir()
    rows = rows if rows is not None else summarize_seeds(runs)
    data = {"task": task or name, "metric": metric, "splits": list(rows[0]["splits"]), "rows": rows, "seeds": [0, 1]}
    if runs is not None:
        data["runs"] = runs
    (path / "compare.json").write_text(json.dumps(data), encoding="utf-8")
    return path


def run(pe, seed, **splits):
    """One result.json: splits as name=(error rate, evaluated sequences)."""
    return {"pe": pe, "seed": seed, "splits": {name: {"seq_error": rate, "sequences": n}
                                              for name, (rate, n) in splits.items()}}


def test_interval_by_hand():
    # two seeds at 10 % and 20 % on 96 sequences: seed variance of the mean 0.005/2, Agresti–Coull (14.4+2)/100
    low, high = interval95([0.1, 0.2], 96, rate=True)
    half = 1.96 * math.sqrt(0.005 / 2 + 0.164 * 0.836 / 100)
    assert low == pytest.approx(0.15 - half) and high == pytest.approx(0.15 + half)
    low, high = interval95([0.0], 1000, rate=True)  # no error seen: still a width, clipped at 0
    assert low == 0.0 and high == pytest.approx(1.96 * math.sqrt((2 / 1004) * (1002 / 1004) / 1004))
    assert interval95([2.5], None, rate=False) is None  # one seed of bits per byte: nothing measures the spread
    low, high = interval95([2.0, 2.2, 2.4], None, rate=False)
    assert (low + high) / 2 == pytest.approx(2.2) and high - low == pytest.approx(2 * 1.96 * 0.2 / math.sqrt(3))


def test_interval_covers_the_truth_about_95_percent_of_the_time():
    """Simulated experiments: three seeds whose true rates scatter around 0.2, each scored on one shared set of 500."""
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(2000):
        truth = 0.2
        seeds = np.clip(truth + 0.02 * rng.standard_normal(3), 0, 1)
        shared = rng.binomial(500, truth) / 500 - truth  # the evaluation set's own luck, shared by the seeds
        low, high = interval95(np.clip(seeds + shared, 0, 1), 500, rate=True)
        hits += low <= truth <= high
    assert 0.9 < hits / 2000 < 0.99


def test_table_places_each_value_and_bolds_only_clear_bests(tmp_path):
    a = comparison(tmp_path, "copy", "seq_error", runs=[
        run("cope", 0, valid=(0.01, 1000), ood=(0.50, 1000)), run("cope", 1, valid=(0.014, 1000), ood=(0.52, 1000)),
        run("rope", 0, valid=(0.20, 1000), ood=(0.51, 1000)), run("rope", 1, valid=(0.30, 1000), ood=(0.53, 1000))])
    b = comparison(tmp_path, "lm", "bits_per_byte", rows=[
        {"pe": "rope", "splits": {"valid": {"bits_per_byte": 2.12345}}}])
    lines = tables.comparison_table([a, b], splits=["valid"], labels=["copy", "lm"]).splitlines()
    assert lines[0] == "| pe | copy: valid | lm: valid |"
    cope = summarize_seeds([run("cope", 0, valid=(0.01, 1000)), run("cope", 1, valid=(0.014, 1000))])[0]
    low, high = cope["splits"]["valid"]["seq_error_ci95"]
    assert lines[2] == f"| cope | **1.2** [{100 * low:.1f}, {100 * high:.1f}] | — |"  # far below rope's interval
    assert lines[3].startswith("| rope | 25.0 [") and lines[3].endswith("| 2.123 |")  # alone: nothing to beat
    full = tables.comparison_table([a]).splitlines()
    assert full[0] == "| pe | copy: valid | copy: ood |"
    assert "**" not in full[2].split(" | ")[2] and "**" not in full[3]  # ood: 51 % against 52 %, within noise
    with pytest.raises(ValueError, match="is not a compare.json"):
        tables.comparison_table([tmp_path / "missing"])
    with pytest.raises(ValueError, match=r"labels: 1 given \(x\) for 2 comparison"):
        tables.comparison_table([a, b], labels=["x"])


def test_older_comparisons_without_runs_still_print(tmp_path):
    old = comparison(tmp_path, "old", "seq_error", rows=[
        {"pe": "cope", "splits": {"test": {"seq_error": 0.004, "seq_error_std": 0.001}}},
        {"pe": "none", "splits": {"test": {"seq_error": 0.02}}}])
    lines = tables.comparison_table([old]).splitlines()
    assert lines[2] == "| cope | 0.4 ± 0.1 |" and lines[3] == "| none | 2.0 |"  # no intervals: nothing is bold


def test_command_line_prints_the_table_and_refuses_a_missing_comparison(tmp_path, capsys):
    old = comparison(tmp_path, "old", "seq_error", rows=[{"pe": "cope", "splits": {"test": {"seq_error": 0.004}}}])
    assert report.main([str(old), "--labels", "first"]) == 0
    assert capsys.readouterr().out.splitlines()[:3] == ["| pe | first: test |", "|---|---|", "| cope | 0.4 |"]
    with pytest.raises(SystemExit) as exit_:
        report.main([str(tmp_path / "missing")])
    assert exit_.value.code == 2 and "is not a compare.json" in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "compare.json' must hold a JSON object, got list"),
    ("{not json", "compare.json' is not valid JSON"),
    ('{"task": "counting"}', "compare.json' is not a compare.json of jaxpe-compare: it has no metric, splits, rows"),
])
def test_a_file_that_is_no_comparison_is_one_line_naming_it(text, message, tmp_path, capsys):
    (tmp_path / "compare.json").write_text(text, encoding="utf-8")
    for argv in ([str(tmp_path)], ["--merge-into", str(tmp_path / "merged"), str(tmp_path / "compare.json")]):
        with pytest.raises(SystemExit) as exit_:
            report.main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"error: '{tmp_path}/{message}" in err and "Traceback" not in err
    (tmp_path / "file").write_text("", encoding="utf-8")
    with pytest.raises(SystemExit):
        report.main(["--merge-into", str(tmp_path / "file"), str(tmp_path)])
    assert f"error: --merge-into '{tmp_path}/file' exists and is not a directory" in capsys.readouterr().err


def test_splits_no_comparison_has_are_refused_listing_those_they_have(tmp_path, capsys):
    a = comparison(tmp_path, "a", "seq_error", rows=[{"pe": "cope", "splits": {"valid": {"seq_error": 0.1},
                                                                              "test": {"seq_error": 0.2}}}])
    b = comparison(tmp_path, "b", "seq_error", rows=[{"pe": "cope", "splits": {"len_x2": {"seq_error": 0.3}}}])
    assert report.main([str(a), str(b), "--splits", "test,len_x2"]) == 0  # each in one of them: shown
    assert capsys.readouterr().out.splitlines()[0] == "| pe | a: test | b: len_x2 |"
    with pytest.raises(SystemExit) as exit_:
        report.main([str(a), str(b), "--splits", "test,len_x4,tset"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert "error: splits: unknown split(s) len_x4, tset; these comparisons have valid, test, len_x2" in err
    with pytest.raises(ValueError, match="unknown split"):
        tables.comparison_table([a], splits=["len_x2"])
    with pytest.raises(SystemExit) as exit_:
        report.main([str(a), str(b), "--labels", "first"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "error: labels: 1 given (first) for 2 comparison(s); give one per" in err


def configured_run(pe, seed, rate, steps=500, options=None):
    """One result.json with the config a merge checks: its valid split at `rate` on 1000 sequences."""
    config = {"task": {"name": "selective_copy", "options": options or {}}, "optim": {"learning_rate": 0.003},
              "run": {"steps": steps}}
    return {**run(pe, seed, valid=(rate, 1000)), "config": config}


def test_merge_adds_encodings_and_replaces_those_run_again(tmp_path):
    base = comparison(tmp_path, "base", "seq_error", runs=[
        configured_run("cope", 0, 0.1), configured_run("cope", 1, 0.2), configured_run("rope", 0, 0.3),
        configured_run("rope", 1, 0.5)], task="copy")
    resolved = {"n_symbols": 16}  # the default, recorded by newer runs: the same setting
    new = comparison(tmp_path, "new", "seq_error", runs=[
        configured_run(pe, seed, rate, options=resolved)
        for pe, seed, rate in [("rope", 0, 0.0), ("rope", 1, 0.02), ("fox", 0, 0.4), ("fox", 1, 0.6)]], task="copy")
    assert report.main(["--merge-into", str(base), str(new)]) == 0
    merged = json.loads((base / "compare.json").read_text(encoding="utf-8"))
    assert [(r["pe"], r["seed"]) for r in merged["runs"]] == [("cope", 0), ("cope", 1), ("rope", 0), ("rope", 1),
                                                             ("fox", 0), ("fox", 1)]
    means = {row["pe"]: row["splits"]["valid"]["seq_error"] for row in merged["rows"]}
    assert means == pytest.approx({"cope": 0.15, "rope": 0.01, "fox": 0.5})  # rope's old runs are gone
    cope_interval = merged["rows"][0]["splits"]["valid"]["seq_error_ci95"]
    assert cope_interval == pytest.approx(interval95([0.1, 0.2], 1000, rate=True))
    assert merged["rows"] == json.loads(json.dumps(summarize_seeds(merged["runs"])))  # as jaxpe-compare has them
    table = (base / "compare.md").read_text(encoding="utf-8").splitlines()
    assert table[2] == "| pe | seeds | valid seq_error (%) |" and table[6].startswith("| fox | 0,1 | 50.00 [")
    assert (base / "compare.png").stat().st_size > 0
    longer = comparison(tmp_path, "longer", "seq_error", runs=[configured_run("alibi", 0, 0.1, steps=1500)],
                        task="copy")
    with pytest.raises(ValueError, match="different settings"):
        tables.merge_comparisons(merged, json.loads((longer / "compare.json").read_text(encoding="utf-8")))


def test_paths_from_the_home_directory_after_an_equals_sign(tmp_path, monkeypatch, capsys):
    """--merge-into=~/merged: a shell expands no ~ after a flag's '='; the command does, rather than make a folder
    named ~ in the current directory."""
    home, here = tmp_path / "home", tmp_path / "here"
    here.mkdir()
    home.mkdir()
    new = comparison(home, "new", "seq_error", runs=[configured_run("cope", 0, 0.1), configured_run("cope", 1, 0.2)],
                     task="copy")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(here)
    assert report.main(["--merge-into=~/merged", "~/new"]) == 0
    assert json.loads((home / "merged" / "compare.json").read_text(encoding="utf-8"))["rows"] == json.loads(
        (new / "compare.json").read_text(encoding="utf-8"))["rows"]
    assert list(here.iterdir()) == []
    with pytest.raises(SystemExit):
        report.main(["~/missing"])
    assert capsys.readouterr().err.splitlines()[-1].startswith(  # the command as it is run, the path expanded
        f"python -m jaxpe.train.report: error: '{home}/missing")
