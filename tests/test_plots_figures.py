"""jaxpe.train.plots figures: the plotted data must be the data given (read back from the Figure's artists)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from jaxpe.train import plots as figures


def test_heatmap_panels_draw_each_panel_with_its_title_and_token_ticks(tmp_path):
    values = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    values[1, 0, 3] = np.nan  # a masked cell
    fig = figures.heatmap_panels(values, ["first", "second"], xticklabels=list("abcd"), yticklabels=list("xyz"),
                                 path=tmp_path / "panels.png")
    assert (tmp_path / "panels.png").stat().st_size > 0
    panels = [ax for ax in fig.axes if ax.images]  # colour bars are axes too
    assert [ax.get_title() for ax in panels] == ["first", "second"]
    for ax, expected in zip(panels, values):
        np.testing.assert_array_equal(np.asarray(ax.images[0].get_array().filled(np.nan)), expected)
        assert [t.get_text() for t in ax.get_xticklabels()] == list("abcd")
    assert [t.get_text() for t in panels[0].get_yticklabels()] == list("xyz")
    assert all(t.get_text() == "" for t in panels[1].get_yticklabels())


def test_heatmap_panels_shared_scale_uses_global_range():
    values = np.stack([np.zeros((2, 2)), np.full((2, 2), 5.0)])
    fig = figures.heatmap_panels(values, ["a", "b"], shared_scale=True)
    for ax in (ax for ax in fig.axes if ax.images):
        assert ax.images[0].get_clim() == (0.0, 5.0)
    single = figures.heatmap_panels(np.eye(3), ["eye"])  # a 2-D input is one panel
    assert len([ax for ax in single.axes if ax.images]) == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(values=np.zeros(3), titles=["a"]), "values.shape"),
    (dict(values=np.zeros((2, 3, 3)), titles=["a"]), "len\\(titles\\)=1"),
    (dict(values=np.zeros((3, 4)), titles=["a"], xticklabels=list("abc")), "len\\(xticklabels\\)=3"),
    (dict(values=np.zeros((3, 4)), titles=["a"], yticklabels=list("ab")), "len\\(yticklabels\\)=2"),
])
def test_heatmap_panels_rejects_bad_input(kwargs, match):
    values, titles = kwargs.pop("values"), kwargs.pop("titles")
    with pytest.raises(ValueError, match=match):
        figures.heatmap_panels(values, titles, **kwargs)


RECORDS = [
    {"op": "cope", "impl": "pallas", "length": 1024, "ms": 2.0},
    {"op": "cope", "impl": "pallas", "length": 256, "ms": 0.5},
    {"op": "cope", "impl": "reference", "length": 256, "ms": 1.0},
    {"op": "cope", "impl": "reference", "length": 1024, "ms": None},  # out of memory: not drawn
    {"op": "corope", "impl": "pallas", "length": 256, "ms": 9.0},  # filtered out by `where`
]


def test_benchmark_curves_one_sorted_line_per_label(tmp_path):
    fig = figures.benchmark_curves(RECORDS, x="length", y="ms", label="impl", where={"op": "cope"},
                                   path=tmp_path / "bench.png")
    (ax,) = fig.axes
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    assert lines == {"pallas": ([256.0, 1024.0], [0.5, 2.0]), "reference": ([256.0], [1.0])}
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert ax.get_title() == "op=cope"


def test_benchmark_curves_rejects_empty_selection_and_incomplete_records():
    with pytest.raises(ValueError, match="no record matches"):
        figures.benchmark_curves(RECORDS, x="length", y="ms", label="impl", where={"op": "alibi"})
    with pytest.raises(ValueError, match="lacks x='seq'"):
        figures.benchmark_curves(RECORDS, x="seq", y="ms", label="impl")


def test_the_training_package_imports_matplotlib_only_to_draw():
    """Importing jaxpe.train, its command line and the curves tool loads no matplotlib, whose releases before 3.10.7
    warn of deprecation on import under pyparsing >= 3.3 (`python -W error -c "import jaxpe.train"` failed); drawing a
    figure loads it."""
    code = ("import sys, jaxpe.train, jaxpe.train.cli, jaxpe.train.curves\n"
            "loaded = lambda: sorted(m for m in sys.modules if m.partition('.')[0] == 'matplotlib')\n"
            "print(loaded())\n"
            "jaxpe.train.plots.benchmark_curves([{'x': 1, 'y': 2.0, 'l': 'a'}], x='x', y='y', label='l')\n"
            "print('matplotlib.figure' in loaded())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["[]", "True"], result.stdout
