"""`python -m jaxpe.train {train,eval,compare} ...`: the console scripts jaxpe-train, jaxpe-eval, jaxpe-compare."""
from __future__ import annotations

import sys

from jaxpe.train.cli import compare_main, eval_main, train_main

COMMANDS = {"train": train_main, "eval": eval_main, "compare": compare_main}


def main(argv: list[str]) -> int:
    """Dispatches argv[0] to its entry point; usage and exit status 2 otherwise."""
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m jaxpe.train {{{','.join(COMMANDS)}}} [--help] ...", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
