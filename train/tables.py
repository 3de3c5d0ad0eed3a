"""How results are shown: error rates in %, 95 % intervals over seeds, Markdown tables of runs and of comparisons
(jaxpe.train.report prints `comparison_table` from the command line).

`summarize_seeds` turns per-seed results into rows (mean, spread and the 95 % interval of `interval95`: seed spread
plus the evaluation set's binomial error); `results_markdown` is the table jaxpe-train, jaxpe-eval and jaxpe-compare
print; `merge_comparisons` adds a later jaxpe-compare's encodings to an earlier comparison of the same setting;
`comparison_table` gathers several `jaxpe-compare` results (compare.json files) into one table, encodings as
rows, the intervals recomputed from the per-seed runs each compare.json holds. A column's best mean is bold only when
its interval overlaps no other row's interval in that column: a difference the seeds and the evaluation set cannot
explain.
"""
from __future__ import annotations

import pathlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import numpy as np

from jaxpe.train.tasks import task_config_class
from jaxpe.train.tasks.base import json_object

PERCENT_METRICS = ("token_error", "seq_error")  # error rates, shown in %; others (bits per byte) as they are
INTERVAL = "95 % interval: seed spread + evaluation-set binomial error"  # the [low, high] after a mean (interval95)


def show(text: str, stream: TextIO | None = None) -> None:
    """Writes `text` as it is (no newline added) to `stream` (default: sys.stdout as it is now); where the stream's
    encoding cannot hold a character (the tables' "—", "±", "·" under an ASCII locale), it is written as a backslash
    escape instead of failing with UnicodeEncodeError."""
    stream = sys.stdout if stream is None else stream
    try:
        stream.write(text)  # a text stream encodes the whole text first: a failure writes none of it
    except UnicodeEncodeError:
        encoding = stream.encoding
        stream.write(text.encode(encoding, "backslashreplace").decode(encoding))


def metric_scale(metric: str) -> float:
    """Factor from a stored metric to its shown value: 100 for error rates, 1 otherwise."""
    return 100.0 if metric in PERCENT_METRICS else 1.0


def metric_label(metric: str) -> str:
    """The metric's name with the unit it is shown in: "token_error (%)", "bits_per_byte"."""
    return f"{metric} (%)" if metric in PERCENT_METRICS else metric


def comparison_heading(task: str, metric: str, seeds: Sequence[int]) -> str:
    """The line above a comparison's table (jaxpe-compare, compare.md): task, metric and unit, and what a cell is."""
    return (f"{task}: {metric_label(metric)}, lower is better; each cell: mean over seeds {','.join(map(str, seeds))} "
            f"[{INTERVAL}]")


def interval95(values: Sequence[float], samples: int | None, *, rate: bool) -> tuple[float, float] | None:
    """A 95 % interval for the mean of per-seed values: normal approximation with the variance of the mean over seeds
    (sample variance / S) plus, for an error rate on `samples` evaluation examples shared by the seeds, the binomial
    variance of that evaluation set (Agresti–Coull: 2 errors and 2 successes added, so 0 % still has a width).
    None when nothing measures the spread (one seed of a metric that is not a rate)."""
    values = np.asarray(values, np.float64)
    mean = float(values.mean())
    variance = float(values.var(ddof=1)) / len(values) if len(values) > 1 else 0.0
    if rate and samples:
        shrunk = (mean * samples + 2.0) / (samples + 4.0)
        variance += shrunk * (1.0 - shrunk) / (samples + 4.0)
    elif len(values) == 1:
        return None
    half = 1.96 * float(np.sqrt(variance))
    low, high = mean - half, mean + half
    return (max(low, 0.0), min(high, 1.0)) if rate else (low, high)


def format_metric(split: Mapping[str, Any], metric: str, digits: int) -> tuple[str, str] | None:
    """(mean, " [low, high]" for the 95 % interval, else " ± std", else "") of `metric` in one split's summary,
    scaled and rounded for display; None if absent."""
    if metric not in split:
        return None
    scale = metric_scale(metric)
    if split.get(f"{metric}_ci95") is not None:
        low, high = split[f"{metric}_ci95"]
        spread = f" [{scale * low:.{digits}f}, {scale * high:.{digits}f}]"
    else:
        spread = f" ± {scale * split[metric + '_std']:.{digits}f}" if f"{metric}_std" in split else ""
    return f"{scale * split[metric]:.{digits}f}", spread


def results_markdown(
    rows: Sequence[Mapping[str, Any]], *, metric: str, splits: Sequence[str], label_keys: Sequence[str]
) -> str:
    """A Markdown table: one row per run, columns label_keys then `metric` (error rates in %) per split."""
    header = [*label_keys, *(f"{s} {metric_label(metric)}" for s in splits)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [str(row[k]) for k in label_keys]
        for split in splits:
            shown = format_metric(row["splits"].get(split, {}), metric, 2)
            cells.append("-" if shown is None else "".join(shown))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summarize_seeds(results: Sequence[Mapping[str, Any]], *, label_key: str = "pe") -> list[dict[str, Any]]:
    """Groups run results by `label_key`; each split's metrics become the mean over seeds plus `<name>_std` (with
    more than one seed) and `<name>_ci95`, the 95 % interval of `interval95` (over seeds and, for error rates, the
    evaluation samples; None when nothing measures it)."""
    groups: dict[Any, list[Mapping[str, Any]]] = {}
    for result in results:
        groups.setdefault(result[label_key], []).append(result)
    rows = []
    for label, runs in groups.items():
        splits: dict[str, dict[str, float]] = {}
        for split in runs[0]["splits"]:
            names = [k for k, v in runs[0]["splits"][split].items() if isinstance(v, float)]
            splits[split] = {}
            for name in names:
                values = np.array([run["splits"][split][name] for run in runs], np.float64)
                splits[split][name] = float(values.mean())
                if len(runs) > 1:
                    splits[split][f"{name}_std"] = float(values.std())
                samples = runs[0]["splits"][split].get("sequences")
                splits[split][f"{name}_ci95"] = interval95(values, samples, rate=name in PERCENT_METRICS)
        rows.append({label_key: label, "seeds": ",".join(str(r["seed"]) for r in runs), "splits": splits})
    return rows


COMPARISON_KEYS = ("task", "metric", "splits", "rows")  # what every compare.json holds (experiments._compare)


def load_comparison(path: str | pathlib.Path) -> dict[str, Any]:
    """The compare.json of a jaxpe-compare workdir (or the file itself); ValueError naming the file when there is none,
    or it is no JSON object with COMPARISON_KEYS."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "compare.json"
    if not path.is_file():
        raise ValueError(f"{str(path)!r} is not a compare.json (run jaxpe-compare first)")
    comparison = json_object(path.read_text(encoding="utf-8", errors="replace"), f"{str(path)!r}")
    missing = [key for key in COMPARISON_KEYS if key not in comparison]
    if missing:
        raise ValueError(f"{str(path)!r} is not a compare.json of jaxpe-compare: it has no {', '.join(missing)}")
    return comparison


def _task_config(task: Mapping[str, Any]) -> Any:
    """A run's task config ({"name", "options"}) resolved: the options over the task's defaults, so that a record
    of the overrides alone equals one of every option."""
    return task_config_class(task["name"])(**task["options"])


def merge_comparisons(base: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """One comparison from two compare.json contents of the same setting (task, metric, splits, task and optimizer
    configs, steps): each encoding `new` ran replaces all of that encoding's runs in `base`; base's other encodings
    keep their place, new ones follow. Rows are recomputed from the runs with `summarize_seeds`, as jaxpe-compare
    computes them; seeds are both lists' union, the environment is new's."""
    for name, comparison in (("base", base), ("new", new)):
        if not comparison.get("runs"):
            raise ValueError(f"{name} comparison of {comparison.get('task')!r} holds no per-seed runs to merge")
    for key in ("task", "metric", "splits"):
        if base[key] != new[key]:
            raise ValueError(f"cannot merge comparisons with different {key}: {base[key]!r} and {new[key]!r}")
    setting = [(_task_config(run["config"]["task"]), run["config"]["optim"], run["config"]["run"]["steps"])
               for run in (base["runs"][0], new["runs"][0])]
    if setting[0] != setting[1]:
        raise ValueError(f"cannot merge runs of different settings (task, optim, steps): {setting[0]} and {setting[1]}")
    replaced = {run["pe"] for run in new["runs"]}
    runs = [run for run in base["runs"] if run["pe"] not in replaced] + list(new["runs"])
    order = list(dict.fromkeys(run["pe"] for run in [*base["runs"], *new["runs"]]))
    runs.sort(key=lambda run: order.index(run["pe"]))  # stable: each encoding's seeds stay in their order
    return {"task": new["task"], "metric": new["metric"], "splits": list(new["splits"]),
            "rows": summarize_seeds(runs), "seeds": list(dict.fromkeys([*base["seeds"], *new["seeds"]])),
            "environment": new.get("environment", {}), "runs": runs}


def _cell(split: dict[str, Any] | None, metric: str, bold: bool) -> str:
    """mean [95 % interval] as shown, the mean in bold when it is a column's clear best."""
    shown = None if split is None else format_metric(split, metric, 1 if metric in PERCENT_METRICS else 3)
    if shown is None:
        return "—"
    mean, spread = shown
    return (f"**{mean}**" if bold else mean) + spread


def clear_best(cells: Sequence[dict[str, Any] | None], metric: str) -> int | None:
    """Index of the lowest mean among `cells` (one split's summaries; None: absent) when its 95 % interval lies below
    every other present cell's interval; None with fewer than two present, one without an interval, or an overlap."""
    present = [i for i, c in enumerate(cells) if c is not None and metric in c]
    if len(present) < 2 or any(cells[i].get(f"{metric}_ci95") is None for i in present):
        return None
    best = min(present, key=lambda i: cells[i][metric])
    high = cells[best][f"{metric}_ci95"][1]
    return best if all(high < cells[i][f"{metric}_ci95"][0] for i in present if i != best) else None


def comparison_table(paths: Sequence[str | pathlib.Path], *, splits: Sequence[str] = (),
                     labels: Sequence[str] = ()) -> str:
    """Markdown: one row per encoding, one column per (comparison, split); errors in %, bits per byte as is,
    mean over seeds [95 % interval], a column's best mean in bold only when its interval overlaps no other. `splits`
    narrows the columns (default: every split; a split no comparison has is a ValueError listing those they have);
    `labels` names the comparisons (default: their directory names)."""
    comparisons = [load_comparison(p) for p in paths]
    known = list(dict.fromkeys(split for c in comparisons for split in c["splits"]))
    unknown = [split for split in splits if split not in known]
    if unknown:
        raise ValueError(f"splits: unknown split(s) {', '.join(unknown)}; these comparisons have {', '.join(known)}")
    for c in comparisons:  # intervals from the per-seed runs, so older compare.json files get them too
        c["rows"] = summarize_seeds(c["runs"]) if c.get("runs") else c["rows"]
    labels = list(labels) or [pathlib.Path(p).name for p in paths]
    if len(labels) != len(comparisons):
        raise ValueError(f"labels: {len(labels)} given ({', '.join(labels)}) for {len(comparisons)} comparison(s); "
                         "give one per comparison")
    columns = [(c, label, split) for c, label in zip(comparisons, labels)
               for split in c["splits"] if not splits or split in splits]
    pes = list(dict.fromkeys(row["pe"] for c in comparisons for row in c["rows"]))
    header = ["pe"] + [f"{label}: {split}" for _, label, split in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    grid = [[next((r["splits"].get(split) for r in c["rows"] if r["pe"] == pe), None) for c, _, split in columns]
            for pe in pes]  # [encoding][column] summaries
    best = [clear_best([grid[i][j] for i in range(len(pes))], c["metric"]) for j, (c, _, _) in enumerate(columns)]
    for i, pe in enumerate(pes):
        cells = [pe] + [_cell(grid[i][j], c["metric"], best[j] == i) for j, (c, _, _) in enumerate(columns)]
        lines.append("| " + " | ".join(cells) + " |")
    metrics = sorted({c["metric"] for c in comparisons})
    seeds = sorted({str(c.get("seeds", "")) for c in comparisons})
    unit = "errors in %" if set(metrics) <= set(PERCENT_METRICS) else "errors in %, bits per byte as is"
    return ("\n".join(lines) + f"\n\nmetric: {', '.join(metrics)} ({unit}; lower is better), mean over seeds "
            f"[{INTERVAL}]; bold: the best interval overlaps no other; "
            f"seeds: {', '.join(seeds)}\n")
