"""Gather `jaxpe-compare` results (compare.json files) into one Markdown table, encodings as rows: mean over seeds
and its 95 % interval (jaxpe.train.tables.interval95: seed spread plus the evaluation set's binomial error); a
column's best mean is bold only when its interval overlaps no other row's interval in that column.

  python -m jaxpe.train.report results/cpu_small/counting_1var results/cpu_small/counting_3var --splits test,len_x2
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

from jaxpe.train.tables import comparison_table


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
