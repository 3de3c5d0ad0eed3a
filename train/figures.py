"""Figures for the notebooks and reports: labelled heatmap panels (gates, positions, tables) and benchmark curves.

Like `train.plots`, every helper builds a `matplotlib.figure.Figure` on the Agg canvas (no pyplot state, no
display needed), returns it, and saves it when given a path. N panels, R rows, C columns.
"""
from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _save(fig: Figure, path: str | pathlib.Path | None) -> Figure:
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def heatmap_panels(
    values: np.ndarray,
    titles: Sequence[str],
    *,
    xlabel: str = "key j",
    ylabel: str = "query i",
    xticklabels: Sequence[str] | None = None,
    yticklabels: Sequence[str] | None = None,
    cmap: str = "viridis",
    shared_scale: bool = False,
    panel_size: float = 3.2,
    path: str | pathlib.Path | None = None,
) -> Figure:
    """One heatmap per panel of values [N, R, C] (or one [R, C]), titled by `titles` (N of them).

    NaN cells are left blank (use them for masked, e.g. future, keys). Tick labels (tokens of a sentence, say)
    must number C (x) and R (y). `shared_scale` gives every panel the same colour range.
    """
    values = np.asarray(values, np.float32)
    if values.ndim == 2:
        values = values[None]
    if values.ndim != 3:
        raise ValueError(f"values.shape={values.shape} must be [R, C] or [N, R, C]")
    n, rows, cols = values.shape
    if len(titles) != n:
        raise ValueError(f"len(titles)={len(titles)} must equal the number of panels N={n}")
    if xticklabels is not None and len(xticklabels) != cols:
        raise ValueError(f"len(xticklabels)={len(xticklabels)} must equal the number of columns C={cols}")
    if yticklabels is not None and len(yticklabels) != rows:
        raise ValueError(f"len(yticklabels)={len(yticklabels)} must equal the number of rows R={rows}")
    limits = {}
    if shared_scale:
        limits = dict(vmin=float(np.nanmin(values)), vmax=float(np.nanmax(values)))
    fig = Figure(figsize=(panel_size * n + 0.8, panel_size), layout="constrained")
    FigureCanvasAgg(fig)
    for i in range(n):
        ax = fig.add_subplot(1, n, i + 1)
        image = ax.imshow(values[i], aspect="auto", interpolation="nearest", cmap=cmap, **limits)
        ax.set_title(titles[i])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel if i == 0 else "")
        if xticklabels is not None:
            ax.set_xticks(np.arange(cols), list(xticklabels), rotation=90, fontsize=7)
        if yticklabels is not None:
            ax.set_yticks(np.arange(rows), list(yticklabels) if i == 0 else [""] * rows, fontsize=7)
        fig.colorbar(image, ax=ax, shrink=0.8)
    return _save(fig, path)


def benchmark_curves(
    records: Sequence[Mapping[str, Any]],
    *,
    x: str,
    y: str,
    label: str,
    where: Mapping[str, Any] | None = None,
    ylabel: str | None = None,
    log: bool = True,
    path: str | pathlib.Path | None = None,
) -> Figure:
    """`y` against `x`, one line per distinct value of `label`, from flat benchmark records (dicts).

    Only records matching every `where` item and holding a number for `y` are drawn; each line is sorted by x.
    """
    where = dict(where or {})
    lines: dict[str, list[tuple[float, float]]] = {}
    for record in records:
        if any(record.get(k) != v for k, v in where.items()):
            continue
        value = record.get(y)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not np.isfinite(value):
            continue
        if x not in record or label not in record:
            raise ValueError(f"record {dict(record)!r} lacks x={x!r} or label={label!r}")
        lines.setdefault(str(record[label]), []).append((float(record[x]), float(value)))
    if not lines:
        raise ValueError(f"no record matches {where=} with a number for {y=}")
    fig = Figure(figsize=(6, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name, points in lines.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=name)
    if log:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel or y)
    ax.set_title(", ".join(f"{k}={v}" for k, v in where.items()))
    ax.legend()
    return _save(fig, path)
