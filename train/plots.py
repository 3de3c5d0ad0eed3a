"""Plot helpers: loss curves, result bars, gate/position heatmaps and position curves.

Figures are built with `matplotlib.figure.Figure` and rendered by the Agg canvas, so nothing
here needs a display or touches pyplot's global state; every helper returns the Figure and
saves it when given a path (notebooks display the returned Figure).
"""
from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _figure(width: float, height: float, ncols: int = 1) -> tuple[Figure, list[Any]]:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    return fig, axes


def _save(fig: Figure, path: str | pathlib.Path | None) -> Figure:
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def read_metrics(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file."""
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]


def loss_curves(
    curves: Mapping[str, Sequence[Mapping[str, Any]]], path: str | pathlib.Path | None = None, *, key: str = "loss"
) -> Figure:
    """Training `key` against step, one line per label; curves: label -> metrics records."""
    fig, (ax,) = _figure(6, 4)
    for label, records in curves.items():
        train = [r for r in records if r.get("split") == "train"]
        ax.plot([r["step"] for r in train], [r[key] for r in train], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(f"train {key}")
    ax.set_yscale("log")
    ax.legend()
    return _save(fig, path)


def result_bars(
    rows: Sequence[Mapping[str, Any]],
    *,
    metric: str,
    splits: Sequence[str],
    label_key: str = "pe",
    path: str | pathlib.Path | None = None,
) -> Figure:
    """Grouped bars: one group per split, one bar per row (error bars from `<metric>_std`)."""
    fig, (ax,) = _figure(max(6.0, 1.2 * len(splits) * max(len(rows), 1) / 2), 4)
    width = 0.8 / max(len(rows), 1)
    x = np.arange(len(splits))
    scale = 1.0 if metric == "bits_per_byte" else 100.0
    for i, row in enumerate(rows):
        values = [scale * row["splits"].get(s, {}).get(metric, np.nan) for s in splits]
        errors = [scale * row["splits"].get(s, {}).get(f"{metric}_std", 0.0) for s in splits]
        ax.bar(x + (i - (len(rows) - 1) / 2) * width, values, width, yerr=errors, label=str(row[label_key]), capsize=3)
    ax.set_xticks(x, list(splits))
    ax.set_ylabel(metric + ("" if metric == "bits_per_byte" else " (%)"))
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
    scale = 1.0 if metric == "bits_per_byte" else 100.0
    right.bar(splits, [scale * result["splits"][s][metric] for s in splits])
    right.set_ylabel(metric + ("" if metric == "bits_per_byte" else " (%)"))
    fig.suptitle(f"{result['task']} / {result['pe']} / seed {result['seed']}")
    return _save(fig, path)


def position_heatmap(
    values: np.ndarray,
    *,
    title: str = "",
    xlabel: str = "key j",
    ylabel: str = "query i",
    path: str | pathlib.Path | None = None,
) -> Figure:
    """A [L, L] (or [H, L, L]: one panel per head) map such as CoPE gates g_ij or positions p_ij."""
    values = np.asarray(values, np.float32)
    if values.ndim == 2:
        values = values[None]
    if values.ndim != 3:
        raise ValueError(f"values.shape={values.shape} must be [L, L] or [H, L, L]")
    fig, axes = _figure(3.2 * values.shape[0] + 0.8, 3.2, ncols=values.shape[0])
    for h, ax in enumerate(axes):
        image = ax.imshow(values[h], aspect="auto", interpolation="nearest", cmap="viridis")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel if h == 0 else "")
        ax.set_title(f"{title} head {h}" if values.shape[0] > 1 else title)
        fig.colorbar(image, ax=ax, shrink=0.8)
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
