"""Learning curves of `jaxpe-compare` runs: the evaluation metric against steps, where each run stopped improving,
and one JSON + one figure for all of them.

  python -m jaxpe.train.curves results/cpu_medium_converged --out results/cpu_medium_converged/curves

reads <root>/<setting>/<pe>/seed<k>/metrics.jsonl (a `jaxpe-compare --workdir <root>/<setting>` layout, as
results/run_cpu_medium_converged.sh writes it; unfinished runs too), or a `jaxpe-compare --workdir` itself
(<pe>/seed<k>/metrics.jsonl, one setting named by the workdir), and writes curves.json (every point, the plateau of
each run, the runs' configs and environments) and curves.png; several roots side by side name each setting by its
root (`python -m jaxpe.train.curves runs/lr_a runs/lr_b --out ...`). Each run is read in its task's metric
(`run_metric`: the task named in its config.json, e.g. seq_error for counting, token_error for flip-flop and
selective copy, bits_per_byte for lm), on the `valid` split. A run's plateau is the first evaluation whose error rate
lies within the 95 % binomial interval of its best (`plateau`): later evaluations improve on it by less than the
evaluation set can tell; bits per byte, which no binomial interval measures, plateaus at its best evaluation. Where a
run kept TensorBoard event files (<run>/tb/, `jaxpe[tensorboard]`), its wall time is read from them too
(`wall_seconds`), and each setting's total.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from jaxpe.train.cli import path_arg
from jaxpe.train.plots import learning_curves, read_metrics
from jaxpe.train.tables import PERCENT_METRICS, metric_label, metric_scale, show
from jaxpe.train.tasks import TASKS

SPLIT = "valid"  # the split the plateau is read from (every task has one)
SEED_DIR = re.compile(r"seed([0-9]+)")  # a run's directory: seed<k>, k as jaxpe-compare writes it or zero-padded


def plateau(steps: Sequence[int], errors: Sequence[float], sequences: int | None) -> dict[str, Any]:
    """{"best_step", "best", "step", "error", "within"}: the lowest error and its step, and the first step whose error
    is within `within` (1.96 binomial standard errors of the best, over `sequences` evaluated) of it. `sequences`
    None: the values are no error rate (bits per byte), no binomial interval measures them: within is 0, the plateau
    is the best evaluation.

    >>> plateau([1, 2, 3, 4], [0.5, 0.2, 0.21, 0.19], 1000)["step"]
    2
    """
    if not steps or len(steps) != len(errors):
        raise ValueError(f"steps ({len(steps)}) and errors ({len(errors)}) must be non-empty and of one length")
    if sequences is not None and sequences < 1:
        raise ValueError(f"sequences={sequences} must be >= 1 (None: not an error rate)")
    best_index = min(range(len(errors)), key=lambda i: (errors[i], steps[i]))
    best = errors[best_index]
    within = 0.0 if sequences is None else 1.96 * math.sqrt(max(best * (1.0 - best), 1.0 / sequences) / sequences)
    first = next(i for i, error in enumerate(errors) if error <= best + within)
    return {"best_step": steps[best_index], "best": best, "step": steps[first], "error": errors[first],
            "within": within}


def event_file_span(path: pathlib.Path) -> float | None:
    """Seconds from the first to the last event of one TensorBoard event file, None with fewer than two events.

    The file is TFRecord: each record is a little-endian uint64 length, a 4-byte CRC, the data, a 4-byte CRC; the data
    is an `Event` protobuf whose field 1, wall_time (a double, tag byte 0x09), comes first. A record cut short (a
    killed writer) ends the file.
    """
    data, offset, times = path.read_bytes(), 0, []
    while offset + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        record = data[offset + 12:offset + 12 + length]
        if len(record) < length:
            break
        if record[:1] == b"\x09" and len(record) >= 9:
            times.append(struct.unpack_from("<d", record, 1)[0])
        offset += 12 + length + 4
    return max(times) - min(times) if len(times) > 1 else None


def wall_seconds(run: pathlib.Path) -> float | None:
    """A run's wall time from its TensorBoard event files (<run>/tb/events.out.tfevents.*): the sum of each file's
    span, one file per start of the run (a resumed run adds the time it lost to its interruption, as it was spent);
    None without event files. The writer opens its file as the run starts, so compile time is inside."""
    spans = [span for path in sorted((run / "tb").glob("events.out.tfevents.*"))
             if (span := event_file_span(path)) is not None]
    return sum(spans) if spans else None


def run_metric(run: pathlib.Path) -> str:
    """The metric of the task a run trained: its config.json's task.name, that task's `metric`
    (jaxpe.train.tasks.TASKS). ValueError, naming the run, when config.json or its task name is missing or unknown."""
    path = run / "config.json"
    try:
        name = json.loads(path.read_text(encoding="utf-8"))["task"]["name"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"run {str(run)!r}: its task, and so its metric, is unknown: {str(path)!r} names no "
                         f"task.name ({type(error).__name__}: {error})") from None
    if name not in TASKS:
        raise ValueError(f"run {str(run)!r}: task.name={name!r} in {str(path)!r} is no known task "
                         f"({', '.join(TASKS)})")
    return TASKS[name][1].metric


def run_curve(metrics_path: pathlib.Path, metric: str) -> dict[str, Any]:
    """One run's curve in `metric`: steps and {split: [metric]} of every evaluation during training, the train loss at
    each logged step, and the plateau of SPLIT (None before its first evaluation)."""
    records = read_metrics(metrics_path)
    evals: dict[str, dict[int, float]] = {}
    sequences: dict[str, int] = {}
    train: dict[int, float] = {}
    for record in records:
        if record["split"] == "train":
            train[record["step"]] = record["loss"]
        elif metric in record:
            evals.setdefault(record["split"], {})[record["step"]] = record[metric]
            sequences[record["split"]] = int(record.get("sequences", sequences.get(record["split"], 0)))
    curve: dict[str, Any] = {
        "metric": metric,
        "splits": {split: {"steps": sorted(points), metric: [points[s] for s in sorted(points)],
                           "sequences": sequences[split]} for split, points in sorted(evals.items())},
        "train": {"steps": sorted(train), "loss": [train[s] for s in sorted(train)]},
        "plateau": None,
    }
    main = curve["splits"].get(SPLIT)
    if main and main["sequences"] > 0:
        rate = metric in PERCENT_METRICS
        curve["plateau"] = plateau(main["steps"], main[metric], main["sequences"] if rate else None)
    return curve


def run_seed(run: pathlib.Path) -> int:
    """The seed k of a run directory named seed<k> (seed1, seed01: 1); ValueError naming any other directory."""
    match = SEED_DIR.fullmatch(run.name)
    if match is None:
        raise ValueError(f"run directory {str(run)!r} is not named seed<k> with k a non-negative integer; rename it "
                         "or move it out of the roots")
    return int(match[1])


def _runs(root: pathlib.Path, several: bool) -> list[tuple[pathlib.Path, str, str, int]]:
    """(metrics.jsonl, setting, encoding, seed k) of every run under `root`: a folder of settings
    (<setting>/<pe>/seed<k>/metrics.jsonl; with `several` roots a setting is "<root's name>/<setting>") or one
    jaxpe-compare workdir (<pe>/seed<k>/metrics.jsonl: one setting, the root's name)."""
    own = [(path, root.resolve().name) for path in sorted(root.glob("*/seed*/metrics.jsonl"))]
    nested = [(path, f"{root.name}/{path.parents[2].name}" if several else path.parents[2].name)
              for path in sorted(root.glob("*/*/seed*/metrics.jsonl"))]
    return [(path, setting, path.parent.parent.name, run_seed(path.parent)) for path, setting in own + nested]


def collect(roots: str | pathlib.Path | Sequence[str | pathlib.Path], *, pes: Sequence[str] = (),
            seeds: Sequence[int] = ()) -> dict[str, Any]:
    """{"settings": {setting: {pe: {"seed<k>": curve}}}, "metrics": {setting: metric}, "metric", "split",
    "configs": {...}, "environments": {...}} of every run under the root(s) (<setting>/<pe>/seed<k>/metrics.jsonl), or
    of those of `pes` and `seeds` (empty: all); a root that is one jaxpe-compare workdir (<pe>/seed<k>/metrics.jsonl)
    is one setting, named by the root. Each curve is `run_curve`'s in its task's metric (`run_metric`), with
    the run's `wall_seconds`; "metric" is the one metric of every setting, None when they differ. With several roots a
    setting is named "<root's name>/<setting>" (e.g. sweeps at two learning rates). Seeds compare as integers (the
    directory seed01 is seed 1; a curve is keyed by its directory's name). ValueError when there is no run, when a
    run directory is not seed<k> or two of one setting and encoding name the same seed (seed1, seed01), when an
    encoding of `pes` or a seed of `seeds` has no run under the roots (naming those they hold), when no run is of
    both, or when a setting's runs trained tasks of different metrics."""
    roots = [pathlib.Path(roots)] if isinstance(roots, (str, pathlib.Path)) else [pathlib.Path(r) for r in roots]
    every = [run for root in roots for run in _runs(root, len(roots) > 1)]
    if not every:
        raise ValueError(f"no runs under {', '.join(map(str, roots))} (<setting>/<pe>/seed<k>/metrics.jsonl, or "
                         f"<pe>/seed<k>/metrics.jsonl of one jaxpe-compare workdir)")
    wanted = {"pes": list(pes), "seeds": [int(seed) for seed in seeds]}
    held = {"pes": sorted({pe for _, _, pe, _ in every}), "seeds": sorted({seed for _, _, _, seed in every})}
    for option, what in (("pes", "encoding"), ("seeds", "seed")):
        unknown = [str(value) for value in wanted[option] if value not in held[option]]
        if unknown:
            raise ValueError(f"{option}: unknown {what}(s) {', '.join(unknown)}; the roots hold "
                             f"{', '.join(map(str, held[option]))}")
    found = [(path, setting, pe, seed) for path, setting, pe, seed in every
             if (not pes or pe in wanted["pes"]) and (not seeds or seed in wanted["seeds"])]
    named: dict[tuple[str, str, int], pathlib.Path] = {}
    for path, setting, pe, seed in found:
        first = named.setdefault((setting, pe, seed), path.parent)
        if first != path.parent:
            raise ValueError(f"{str(first)!r} and {str(path.parent)!r} both hold seed {seed} of {pe} in setting "
                             f"{setting!r}; keep one of them under the roots")
    if not found:
        raise ValueError(f"no runs of encodings {wanted['pes']} and seeds {list(seeds)} together under "
                         f"{', '.join(map(str, roots))}")
    settings: dict[str, dict[str, dict[str, Any]]] = {}
    metrics: dict[str, str] = {}
    configs, environments = {}, {}
    for path, setting, pe, _ in found:
        run = path.parent
        seed = run.name
        name = f"{setting}/{pe}/{seed}"
        metric = run_metric(run)
        if metrics.setdefault(setting, metric) != metric:
            raise ValueError(f"setting {setting!r} mixes metrics: {name} is read in {metric}, the runs before it in "
                             f"{metrics[setting]}; a jaxpe-compare workdir holds runs of one task")
        curve = run_curve(path, metric)
        curve["wall_seconds"] = wall_seconds(run)
        settings.setdefault(setting, {}).setdefault(pe, {})[seed] = curve
        if (run / "config.json").exists():
            configs[name] = json.loads((run / "config.json").read_text(encoding="utf-8"))
        if (run / "result.json").exists():
            environments[name] = json.loads((run / "result.json").read_text(encoding="utf-8")).get("environment")
    shared = set(metrics.values())
    return {"split": SPLIT, "metric": shared.pop() if len(shared) == 1 else None, "metrics": metrics,
            "settings": settings, "configs": configs, "environments": environments}


def window_mean(curve: Mapping[str, Any], first: int, last: int) -> float | None:
    """The mean SPLIT value of a run's metric at its evaluations at steps first..last (both included); None when there
    is none.

    >>> window_mean({"metric": "seq_error", "splits": {"valid": {"steps": [1, 2, 3], "seq_error": [0.5, 0.2, 0.1]}}},
    ...             2, 3)
    0.15000000000000002
    """
    metric = curve["metric"]
    points = curve["splits"].get(SPLIT, {"steps": [], metric: []})
    inside = [e for s, e in zip(points["steps"], points[metric]) if first <= s <= last]
    return sum(inside) / len(inside) if inside else None


def _shown(value: float, metric: str) -> str:
    """A value of `metric` as the table shows it: error rates in % to 0.1, others (bits per byte) to 0.001."""
    return f"{metric_scale(metric) * value:.{1 if metric in PERCENT_METRICS else 3}f}"


def summary(data: Mapping[str, Any], window: tuple[int, int] | None = None) -> str:
    """A Markdown table: per setting and encoding, the steps run, the best value of the setting's metric and its step,
    the plateau, with `window` (first, last) the mean of the evaluations in those steps (`window_mean`), and the run's
    wall time; then, when the settings' metrics differ, which metric each is in; then each setting's total wall time
    over the runs that have one."""
    metric = data["metric"]
    what = "value" if metric is None else f"{metric} %" if metric in PERCENT_METRICS else metric
    unit = " %" if metric in PERCENT_METRICS else ""
    extra = "" if window is None else f" mean {what} over steps {window[0]}–{window[1]} |"
    header = (f"| setting | pe | seed | steps run | best {data['split']} {what} (step) | plateau step "
              f"({what}, within ±{unit}) |{extra} wall time (min) |")
    lines = [header, "|---" * header.count(" | ") + "|---|"]
    totals: dict[str, tuple[float, int]] = {}
    for setting, pes in data["settings"].items():
        for pe, seeds in pes.items():
            for seed, curve in seeds.items():
                ran = curve["train"]["steps"][-1] if curve["train"]["steps"] else 0
                p, measure = curve["plateau"], curve["metric"]
                cells = (["—", "—"] if p is None else
                         [f"{_shown(p['best'], measure)} ({p['best_step']})",
                          f"{p['step']} ({_shown(p['error'], measure)}, {_shown(p['within'], measure)})"])
                if window is not None:
                    mean = window_mean(curve, *window)
                    cells.append("—" if mean is None else _shown(mean, measure))
                wall = curve.get("wall_seconds")
                cells.append("—" if wall is None else f"{wall / 60:.1f}")
                if wall is not None:
                    seconds, runs = totals.get(setting, (0.0, 0))
                    totals[setting] = (seconds + wall, runs + 1)
                lines.append(f"| {setting} | {pe} | {seed} | {ran} | {' | '.join(cells)} |")
    if metric is None:
        lines += ["", "Values: " + "; ".join(f"{setting} in {metric_label(m)}" for setting, m in
                                             data["metrics"].items())]
    if totals:
        lines.append("")
        lines += [f"Wall time, {setting}: {seconds / 3600:.2f} h over {runs} runs" for setting, (seconds, runs)
                  in totals.items()]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxpe.train.curves",
                                     description="Learning curves of jaxpe-compare runs: JSON, table and figure.")
    parser.add_argument("roots", nargs="+", type=path_arg,
                        help="folder(s) of <setting>/<pe>/seed<k>/metrics.jsonl runs, or "
                        "jaxpe-compare workdirs (<pe>/seed<k>/metrics.jsonl)")
    parser.add_argument("--out", required=True, type=path_arg, help="folder for curves.json, curves.md and curves.png")
    parser.add_argument("--pes", default="",
                        help="only these encodings, each one the roots hold (comma-separated; default all)")
    parser.add_argument("--window", default="", help="FIRST:LAST: a column of the mean error over those steps")
    parser.add_argument("--seeds", default="",
                        help="only these seeds, each one the roots hold (comma-separated integers; default all)")
    args = parser.parse_args(argv)
    try:
        seeds = [int(seed) for seed in args.seeds.split(",") if seed]
    except ValueError:
        parser.error(f"--seeds={args.seeds!r} must be comma-separated integers")
    window = None
    if args.window:
        try:
            window = tuple(int(step) for step in args.window.split(":"))
        except ValueError:
            window = ()
        if len(window) != 2 or window[0] > window[1]:
            parser.error(f"--window={args.window!r} must be FIRST:LAST steps with FIRST <= LAST")
    try:
        data = collect(args.roots, pes=[pe for pe in args.pes.split(",") if pe], seeds=seeds)
    except ValueError as error:
        parser.error(str(error))
    out = pathlib.Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "curves.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        (out / "curves.md").write_text(summary(data, window), encoding="utf-8")
        learning_curves(data, path=out / "curves.png")
    except OSError as error:  # --out a file, or a folder that cannot be written
        parser.error(f"--out={args.out!r}: {error.strerror}: {error.filename}")
    show(summary(data, window))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
