"""Gather `jaxpe-compare` results (compare.json files) into one Markdown table, encodings as rows: mean over seeds
and its 95 % interval (`evaluate.interval95`: seed spread plus the evaluation set's binomial error), recomputed from
the per-seed runs each compare.json holds. A column's best mean is bold only when its interval overlaps no other
row's interval in that column: a difference the seeds and the evaluation set cannot explain.

  python -m jaxpe.train.report results/cpu_small/counting_1var results/cpu_small/counting_3var --splits test,len_x2
"""
from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Sequence
from typing import Any

from jaxpe.train.evaluate import PERCENT_METRICS, format_metric, summarize_seeds


def load_comparison(path: str | pathlib.Path) -> dict[str, Any]:
    """The compare.json of a jaxpe-compare workdir (or the file itself)."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "compare.json"
    if not path.is_file():
        raise ValueError(f"{str(path)!r} is not a compare.json (run jaxpe-compare first)")
    return json.loads(path.read_text())


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
    narrows the columns (default: every split); `labels` names the comparisons (default: their directory names)."""
    comparisons = [load_comparison(p) for p in paths]
    for c in comparisons:  # intervals from the per-seed runs, so older compare.json files get them too
        c["rows"] = summarize_seeds(c["runs"]) if c.get("runs") else c["rows"]
    labels = list(labels) or [pathlib.Path(p).name for p in paths]
    if len(labels) != len(comparisons):
        raise ValueError(f"{len(labels)=} must equal the number of comparisons {len(comparisons)}")
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
            f"[95 % interval: seed spread + evaluation-set binomial error]; bold: the best interval overlaps no other; "
            f"seeds: {', '.join(seeds)}\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One Markdown table from several jaxpe-compare results.")
    parser.add_argument("paths", nargs="+", help="jaxpe-compare workdirs or compare.json files")
    parser.add_argument("--splits", default="", help="comma-separated splits to show (default: all)")
    parser.add_argument("--labels", default="", help="comma-separated column labels (default: directory names)")
    args = parser.parse_args(argv)
    try:
        print(comparison_table(args.paths, splits=[s for s in args.splits.split(",") if s],
                               labels=[s for s in args.labels.split(",") if s]), end="")
    except ValueError as error:
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
