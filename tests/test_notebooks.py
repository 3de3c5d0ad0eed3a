"""The notebooks in notebooks/: their saved copies are complete, and they execute without error.

Each notebook checks its own figures with `assert` cells (against formulas, the reference implementation or the
claims of its conclusion), so executing it is a test that can fail. Execution goes through nbclient in a fresh
kernel whose working directory is notebooks/ (as when opened in Jupyter), with the repository on PYTHONPATH and
without the 8 simulated devices of conftest (the notebooks run on one device).
"""
from __future__ import annotations

import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ("01_encodings_tour.ipynb", "02_what_cope_counts.ipynb", "03_kernels.ipynb")
TIMEOUT_S = 600  # per cell


def read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(ROOT / "notebooks" / name, as_version=4)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_saved_notebook_has_intro_outputs_figures_and_conclusion(name):
    nb = read(name)
    markdown = [c for c in nb.cells if c.cell_type == "markdown"]
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert nb.cells[0].cell_type == "markdown", "a notebook opens by saying what it shows"
    assert nb.cells[-1].cell_type == "markdown", "a notebook ends with its conclusion in words"
    assert any(c.source.lstrip().startswith("## Conclusion") for c in markdown)
    assert code and all(c.execution_count is not None for c in code), "saved without outputs"
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), f"cells were not run top to bottom in one kernel: {counts}"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"], "saved with an error"
    assert any("image/png" in o.get("data", {}) for o in outputs), "no embedded figure"


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, monkeypatch):
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    monkeypatch.setenv("XLA_FLAGS", " ".join(flags))  # conftest's flags but its 8 devices: the notebooks use one
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = read(name)
    client = NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks")}})
    client.execute()  # raises CellExecutionError, with the failing cell and traceback, on any error
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, f"{name} drew no figure"
