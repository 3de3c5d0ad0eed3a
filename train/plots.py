"""Plot helpers for the CLI and the notebooks: a run's summary, result bars, position curves, labelled heatmap
panels (gates, positions, tables; N panels, R rows, C columns), benchmark curves and learning curves.

Figures are built with `matplotlib.figure.Figure` and rendered by the Agg canvas, so nothing
here needs a display or touches pyplot's global state; every helper returns the Figure and
saves it when given a path (notebooks display the returned Figure).
"""
from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxpe.train.tables import metric_label, metric_scale
from jaxpe.train.tasks.base import json_object

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _canvas(width: float, height: float) -> Figure:
    """An empty figure `width` x `height` inches on the Agg canvas."""
    # matplotlib loads when a figure is drawn, not with jaxpe.train: importing it takes a second, and its releases
    # before 3.10.7 warn of deprecation on import under pyparsing >= 3.3 (an error under -W error)
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # drawing only (above)
    from matplotlib.figure import Figure  # drawing only (above)

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _figure(width: float, height: float, ncols: int = 1, nrows: int = 1) -> tuple[Figure, list[Any]]:
    """A figure `width` inches wide of nrows x ncols panels, each row `height` inches; its axes row by row."""
    fig = _canvas(width, height * nrows)
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(ncols * nrows)]
    return fig, axes


def _save(fig: Figure, path: str | pathlib.Path | None) -> Figure:
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def read_metrics(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file. A last line cut short (no newline, not JSON: a run killed as it wrote)
    is left out; any other line that is not a JSON object is a ValueError naming the file and the line."""
    text = pathlib.Path(path).read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")  # the last one "" after a whole line
    records = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                records.append(json_object(line, f"{str(path)!r}, line {number},"))
            except ValueError:
                if number < len(lines):
                    raise
    return records


def _error_bar(split: Mapping[str, Any], metric: str) -> tuple[float, float]:
    """(below, above) the mean: from the 95 % interval when there is one, else ± std, else 0."""
    if metric not in split:
        return 0.0, 0.0
    if split.get(f"{metric}_ci95") is not None:
        low, high = split[f"{metric}_ci95"]
        return split[metric] - low, high - split[metric]
    std = split.get(f"{metric}_std", 0.0)
    return std, std


def result_bars(
    rows: Sequence[Mapping[str, Any]],
    *,
    metric: str,
    splits: Sequence[str],
    label_key: str = "pe",
    path: str | pathlib.Path | None = None,
) -> Figure:
    """Grouped bars: one group per split, one bar per row (error bars: the 95 % interval `<metric>_ci95`, else
    `<metric>_std`)."""
    fig, (ax,) = _figure(max(6.0, 1.2 * len(splits) * max(len(rows), 1) / 2), 4)
    width = 0.8 / max(len(rows), 1)
    x = np.arange(len(splits))
    scale = metric_scale(metric)
    for i, row in enumerate(rows):
        values = [scale * row["splits"].get(s, {}).get(metric, np.nan) for s in splits]
        errors = np.array([_error_bar(row["splits"].get(s, {}), metric) for s in splits]).T * scale  # [2, splits]
        # yerr as lists: matplotlib 3.8 takes a float of each row of an array (deprecated by numpy for one split)
        ax.bar(x + (i - (len(rows) - 1) / 2) * width, values, width, yerr=errors.tolist(), label=str(row[label_key]),
               capsize=3)
    ax.set_xticks(x, list(splits))
    ax.set_ylabel(metric_label(metric))
    ax.legend()
    return _save(fig, path)


def run_summary(metrics_path: str | pathlib.Path, result: Mapping[str, Any], path: str | pathlib.Path) -> Figure:
    """One run: its training loss curve beside its final metric per split."""
    records = read_metrics(metrics_path) if pathlib.Path(metrics_path).exists() else []
    fig, (left, right) = _figure(11, 4, ncols=2)
    train = [r for r in records if r.get("split") == "train"]
    left.plot([r["step"] for r in train], [r["loss"] for r in train])
    left.set_xlabel("step")
    left.set_ylabel("train loss")
    left.set_yscale("log")
    metric, splits = result["metric"], list(result["splits"])
    right.bar(splits, [metric_scale(metric) * result["splits"][s][metric] for s in splits])
    right.set_ylabel(metric_label(metric))
    fig.suptitle(f"{result['task']} / {result['pe']} / seed {result['seed']}")
    return _save(fig, path)


def position_curves(
    curves: Mapping[str, np.ndarray],
    *,
    xlabel: str = "token index",
    ylabel: str = "position",
    path: str | pathlib.Path | None = None,
) -> Figure:
    """Lines of a per-token quantity (e.g. the contextual position of each key seen from the last query)."""
    fig, (ax,) = _figure(6, 4)
    for label, values in curves.items():
        ax.plot(np.asarray(values), label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    return _save(fig, path)


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
    fig = _canvas(panel_size * n + 0.8, panel_size)
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
    fig = _canvas(6, 4)
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


def learning_curves(data: Mapping[str, Any], *, path: str | pathlib.Path | None = None) -> Figure:
    """One panel per setting of `jaxpe.train.curves.collect`'s data: the setting's metric (error rates in %) against
    steps, one colour per encoding (its seeds alike), the plateau split solid with each run's plateau marked, the
    others dashed; a split evaluated only once (at the end) is left out."""
    settings = data["settings"]
    if not settings:
        raise ValueError("no runs to plot")
    ncols = min(len(settings), 3)
    nrows = -(-len(settings) // ncols)
    fig, axes = _figure(5.5 * ncols, 4, ncols=ncols, nrows=nrows)
    main = data["split"]
    pes = sorted({pe for pes in settings.values() for pe in pes})
    for ax, (setting, by_pe) in zip(axes, settings.items()):
        metric = data["metrics"][setting]
        scale = metric_scale(metric)
        for pe, seeds in by_pe.items():
            colour = f"C{pes.index(pe) % 10}"
            for number, (seed, curve) in enumerate(seeds.items()):
                for split, points in curve["splits"].items():
                    if len(points["steps"]) < 2:  # evaluated at the end only (the final evaluation's extra splits)
                        continue
                    first = number == 0
                    ax.plot(points["steps"], [scale * e for e in points[metric]], color=colour,
                            linestyle="-" if split == main else "--", linewidth=1.0, alpha=0.8,
                            label=f"{pe} {split}" + (f" ({len(seeds)} seeds)" if len(seeds) > 1 else "")
                            if first else None)
                if curve["plateau"] is not None:
                    p = curve["plateau"]
                    ax.plot([p["step"]], [scale * p["error"]], marker="o", color=colour)
        ax.set_title(setting)
        ax.set_xlabel("step")
        ax.set_ylabel(metric_label(metric))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    for ax in axes[len(settings):]:
        ax.set_visible(False)
    return _save(fig, path)
