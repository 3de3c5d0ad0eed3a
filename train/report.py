"""Gather `jaxpe-compare` results (compare.json files) into one Markdown table, encodings as rows: mean over seeds
and its 95 % interval (jaxpe.train.tables.interval95: seed spread plus the evaluation set's binomial error); a
column's best mean is bold only when its interval overlaps no other row's interval in that column.

  python -m jaxpe.train.report results/cpu_small/counting_1var results/cpu_small/counting_3var --splits test,len_x2

--merge-into DIR instead adds the given comparisons' encodings to DIR's (jaxpe.train.tables.merge_comparisons: an
encoding run again replaces its old runs) and rewrites DIR/compare.json, compare.md and compare.png; a DIR without a
compare.json takes the first comparison as it is:

  python -m jaxpe.train.report --merge-into results/cpu_small/flipflop runs/cpu_small/flipflop
"""
from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence

from jaxpe.train.cli import path_arg
from jaxpe.train.experiments import write_comparison
from jaxpe.train.tables import comparison_table, load_comparison, merge_comparisons, show


def merge_into(directory: str | pathlib.Path, paths: Sequence[str | pathlib.Path]) -> None:
    """Merges the comparisons at `paths`, in order, into directory's compare.json (if any) and writes the result
    there (compare.json, compare.md, compare.png)."""
    if pathlib.Path(directory).exists() and not pathlib.Path(directory).is_dir():
        raise ValueError(f"--merge-into {str(directory)!r} exists and is not a directory")
    comparisons = [load_comparison(p) for p in paths]
    if (pathlib.Path(directory) / "compare.json").is_file():
        comparisons.insert(0, load_comparison(directory))
    merged = comparisons[0]
    for comparison in comparisons[1:]:
        merged = merge_comparisons(merged, comparison)
    write_comparison(directory, merged)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxpe.train.report",
                                     description="One Markdown table from several jaxpe-compare results.")
    parser.add_argument("paths", nargs="+", type=path_arg, help="jaxpe-compare workdirs or compare.json files")
    parser.add_argument("--splits", default="",
                        help="comma-separated splits to show, each one the comparisons have (default: all)")
    parser.add_argument("--labels", default="", help="comma-separated column labels (default: directory names)")
    parser.add_argument("--merge-into", metavar="DIR", type=path_arg,
                        help="merge the comparisons into DIR's instead of printing")
    args = parser.parse_args(argv)
    try:
        if args.merge_into:
            merge_into(args.merge_into, args.paths)
            return 0
        show(comparison_table(args.paths, splits=[s for s in args.splits.split(",") if s],
                              labels=[s for s in args.labels.split(",") if s]))
    except ValueError as error:
        parser.error(str(error))
    except OSError as error:  # --merge-into a directory that cannot be written
        parser.error(f"{error.strerror}: {error.filename}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
