"""Gather `jaxpe-compare` results (compare.json files) into one Markdown table, encodings as rows, the best
value of each column in bold.

  python -m jaxpe.train.report results/cpu_small/counting_1var results/cpu_small/counting_3var --splits test,len_x2
"""
from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Sequence
from typing import Any

from jaxpe.train.evaluate import PERCENT_METRICS, format_metric, metric_scale

def load_comparison(path: str | pathlib.Path) -> dict[str, Any]:
    """The compare.json of a jaxpe-compare workdir (or the file itself)."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "compare.json"
    if not path.is_file():
        raise ValueError(f"{str(path)!r} is not a compare.json (run jaxpe-compare first)")
    return json.loads(path.read_text())


def _cell(split: dict[str, float], metric: str, best: float | None) -> str:
    """mean ± std as shown; bold when the shown mean equals the column's best (lowest) shown mean."""
    digits = 1 if metric in PERCENT_METRICS else 3
    shown = format_metric(split, metric, digits)
    if shown is None:
        return "—"
    mean, std = shown
    bold = best is not None and mean == f"{metric_scale(metric) * best:.{digits}f}"
    return (f"**{mean}**" if bold else mean) + std


def comparison_table(paths: Sequence[str | pathlib.Path], *, splits: Sequence[str] = (),
                     labels: Sequence[str] = ()) -> str:
    """Markdown: one row per encoding, one column per (comparison, split); errors in %, bits per byte as is,
    mean ± std over seeds, the best mean of each column (of two or more) in bold. `splits` narrows the columns
    (default: every split); `labels` names the comparisons (default: their directory names)."""
    comparisons = [load_comparison(p) for p in paths]
    labels = list(labels) or [pathlib.Path(p).name for p in paths]
    if len(labels) != len(comparisons):
        raise ValueError(f"{len(labels)=} must equal the number of comparisons {len(comparisons)}")
    columns = [(c, label, split) for c, label in zip(comparisons, labels)
               for split in c["splits"] if not splits or split in splits]
    pes = list(dict.fromkeys(row["pe"] for c in comparisons for row in c["rows"]))
    header = ["pe"] + [f"{label}: {split}" for _, label, split in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    values = [[r["splits"][split][c["metric"]] for r in c["rows"] if c["metric"] in r["splits"][split]]
              for c, _, split in columns]
    best = [min(v) if len(v) > 1 else None for v in values]  # nothing to beat in a column of one
    for pe in pes:
        cells = [pe]
        for (c, _, split), column_best in zip(columns, best):
            row = next((r for r in c["rows"] if r["pe"] == pe), None)
            cells.append("—" if row is None else _cell(row["splits"][split], c["metric"], column_best))
        lines.append("| " + " | ".join(cells) + " |")
    metrics = sorted({c["metric"] for c in comparisons})
    seeds = sorted({str(c.get("seeds", "")) for c in comparisons})
    unit = "errors in %" if set(metrics) <= set(PERCENT_METRICS) else "errors in %, bits per byte as is"
    return "\n".join(lines) + f"\n\nmetric: {', '.join(metrics)} ({unit}; lower is better); seeds: {', '.join(seeds)}\n"


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
