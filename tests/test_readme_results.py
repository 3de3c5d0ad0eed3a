"""docs/reports/results.md's tables are what `bash results/tables.sh` prints from the committed
results/*/compare.json."""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from jaxpe.train.tasks import task_config_class

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_results_page_holds_the_tables_exactly():
    out = subprocess.run(["bash", str(REPO / "results" / "tables.sh")], capture_output=True, text=True,
                         env={"PY": sys.executable, "PATH": "/usr/bin:/bin"}, check=True).stdout
    tables = out.strip()
    assert tables.count("| pe |") >= 6, out
    page = (REPO / "docs" / "reports" / "results.md").read_text(encoding="utf-8")
    assert tables in page, "docs/reports/results.md's tables differ from `bash results/tables.sh`; paste its output"


def test_results_have_three_seeds_and_full_evaluation_sets():
    """Every committed comparison (cpu-small, cpu-medium): seeds 0-2 for every encoding, >= 1000 sequences per split
    (the task's resolved options: the run's overrides over the task's defaults)."""
    for path in sorted((REPO / "results").glob("cpu_*/*/compare.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        by_pe: dict[str, set[int]] = {}
        for run in record["runs"]:
            by_pe.setdefault(run["pe"], set()).add(run["seed"])
            task = run["config"]["task"]
            config = task_config_class(task["name"])(**task["options"])
            sizes = [getattr(config, k) for k in ("n_eval", "n_valid", "n_test", "eval_bytes") if hasattr(config, k)]
            assert sizes and min(sizes) >= 1000, (path, config)
        assert by_pe and all(seeds == {0, 1, 2} for seeds in by_pe.values()), (path, by_pe)
