"""Evaluation: per-split sums on device, the task's metric on the host, JSON and Markdown.

`compute_metrics` is the one definition of what is counted, for training (jaxpe.train.step) and evaluation alike;
`metrics_from_sums` turns the sums into metrics, `metric_scale`/`metric_label` are the one rule for showing them.
Metrics (lower is better for all three):
- `seq_error`: fraction of sequences with any weighted token predicted wrong (counting);
- `token_error`: fraction of weighted tokens predicted wrong (flip-flop reads, copied tokens);
- `bits_per_byte`: mean NLL over weighted byte positions / ln 2 (language modelling).
"""
from __future__ import annotations

import datetime
import json
import math
import pathlib
import platform
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpe.train.tasks.base import scored_lengths

METRICS = ("seq_error", "token_error", "bits_per_byte")

LogitsFn = Callable[[Any, jax.Array], jax.Array]  # (params, inputs [B, L]) -> logits [B, L, V]


def compute_metrics(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> dict[str, jax.Array]:
    """Float32 sums over a batch: logits [B, L, V], targets [B, L] int, weights [B, L] float.

    nll: weighted negative log-likelihood (the training loss), wrong: weight of wrong argmax predictions, weight:
    total weight, seq_wrong: rows with any weighted token wrong, seqs: rows with weight. Rows whose weights are all
    zero (padding) count nowhere. Sums add across micro-batches, steps and devices; see metrics_from_sums.
    """
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)  # [B, L]
    wrong = (jnp.argmax(logits, axis=-1) != targets) & (weights > 0)  # [B, L]
    row_used = jnp.sum(weights, axis=-1) > 0  # [B]
    return {
        "nll": jnp.sum(nll * weights),
        "wrong": jnp.sum(wrong * weights),
        "weight": jnp.sum(weights),
        "seq_wrong": jnp.sum(jnp.any(wrong, axis=-1) & row_used, dtype=jnp.float32),
        "seqs": jnp.sum(row_used, dtype=jnp.float32),
    }


def make_eval_step(logits_fn: LogitsFn) -> Callable[[Any, Mapping[str, jax.Array]], dict[str, jax.Array]]:
    """eval_step(params, batch) -> compute_metrics sums (not jitted; the caller jits with its shardings)."""

    def eval_step(params: Any, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        logits = logits_fn(params, batch["inputs"])
        return compute_metrics(logits, batch["targets"], batch["weights"])

    return eval_step


def metrics_from_sums(sums: Mapping[str, float]) -> dict[str, float]:
    """All metrics of METRICS plus loss (mean weighted NLL, nats) from summed counts."""
    weight = max(float(sums["weight"]), 1e-9)
    return {
        "loss": float(sums["nll"]) / weight,
        "seq_error": float(sums["seq_wrong"]) / max(float(sums["seqs"]), 1.0),
        "token_error": float(sums["wrong"]) / weight,
        "bits_per_byte": float(sums["nll"]) / weight / math.log(2),
        "sequences": int(sums["seqs"]),
    }


def padded_batches(
    arrays: Mapping[str, np.ndarray], batch_size: int
) -> list[dict[str, np.ndarray]]:
    """Splits [N, L] arrays into batches of `batch_size` rows; the last is padded with weight-0 rows."""
    n = next(iter(arrays.values())).shape[0]
    out = []
    for start in range(0, n, batch_size):
        batch = {}
        for name, array in arrays.items():
            chunk = array[start : start + batch_size]
            if chunk.shape[0] < batch_size:
                pad = np.zeros((batch_size - chunk.shape[0], *chunk.shape[1:]), chunk.dtype)
                chunk = np.concatenate([chunk, pad])
            batch[name] = chunk
        out.append(batch)
    return out


def evaluate_split(
    eval_step: Callable[[Any, Mapping[str, Any]], Mapping[str, Any]],
    params: Any,
    split: Any,
    *,
    batch_size: int,
    put_batch: Callable[[Mapping[str, np.ndarray]], Mapping[str, Any]],
    to_host: Callable[[Any], Any],
    pad: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
) -> dict[str, float]:
    """Metrics of one split (a jaxpe.train.tasks Split: inputs, targets, weights [N, L]).

    `pad` (e.g. Trainer.pad) cuts each host batch [B, L] to the length it needs; with it, the sequences are first
    sorted by length (tasks.base.scored_lengths), so that short ones share short batches. The metrics are sums
    over sequences: neither changes them (the loss up to float rounding).
    """
    arrays = {
        "inputs": np.asarray(split.inputs, np.int32),
        "targets": np.asarray(split.targets, np.int32),
        "weights": np.asarray(split.weights, np.float32),
    }
    if pad is not None:
        order = np.argsort(scored_lengths(arrays["weights"]), kind="stable")  # [N]
        arrays = {name: array[order] for name, array in arrays.items()}
    totals: dict[str, float] = {}
    for batch in padded_batches(arrays, batch_size):
        if pad is not None:
            batch = pad(batch)
        sums = to_host(eval_step(params, put_batch(batch)))
        for name, value in sums.items():
            totals[name] = totals.get(name, 0.0) + float(value)
    return metrics_from_sums(totals)


PERCENT_METRICS = ("token_error", "seq_error")  # error rates, shown in %; others (bits per byte) as they are


def metric_scale(metric: str) -> float:
    """Factor from a stored metric to its shown value: 100 for error rates, 1 otherwise."""
    return 100.0 if metric in PERCENT_METRICS else 1.0


def metric_label(metric: str) -> str:
    """The metric's name with the unit it is shown in: "token_error (%)", "bits_per_byte"."""
    return f"{metric} (%)" if metric in PERCENT_METRICS else metric


def interval95(values: Sequence[float], samples: int | None, *, rate: bool) -> tuple[float, float] | None:
    """A 95 % interval for the mean of per-seed values: normal approximation with the variance of the mean over seeds
    (sample variance / S) plus, for an error rate on `samples` evaluation examples shared by the seeds, the binomial
    variance of that evaluation set (Agresti–Coull: 2 errors and 2 successes added, so 0 % still has a width).
    None when nothing measures the spread (one seed of a metric that is not a rate)."""
    values = np.asarray(values, np.float64)
    mean = float(values.mean())
    variance = float(values.var(ddof=1)) / len(values) if len(values) > 1 else 0.0
    if rate and samples:
        shrunk = (mean * samples + 2.0) / (samples + 4.0)
        variance += shrunk * (1.0 - shrunk) / (samples + 4.0)
    elif len(values) == 1:
        return None
    half = 1.96 * float(np.sqrt(variance))
    low, high = mean - half, mean + half
    return (max(low, 0.0), min(high, 1.0)) if rate else (low, high)


def format_metric(split: Mapping[str, Any], metric: str, digits: int) -> tuple[str, str] | None:
    """(mean, " [low, high]" for the 95 % interval, else " ± std", else "") of `metric` in one split's summary,
    scaled and rounded for display; None if absent."""
    if metric not in split:
        return None
    scale = metric_scale(metric)
    if split.get(f"{metric}_ci95") is not None:
        low, high = split[f"{metric}_ci95"]
        spread = f" [{scale * low:.{digits}f}, {scale * high:.{digits}f}]"
    else:
        spread = f" ± {scale * split[metric + '_std']:.{digits}f}" if f"{metric}_std" in split else ""
    return f"{scale * split[metric]:.{digits}f}", spread


def results_markdown(
    rows: Sequence[Mapping[str, Any]], *, metric: str, splits: Sequence[str], label_keys: Sequence[str]
) -> str:
    """A Markdown table: one row per run, columns label_keys then `metric` (error rates in %) per split."""
    header = [*label_keys, *(f"{s} {metric_label(metric)}" for s in splits)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [str(row[k]) for k in label_keys]
        for split in splits:
            shown = format_metric(row["splits"].get(split, {}), metric, 2)
            cells.append("-" if shown is None else "".join(shown))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def environment() -> dict[str, Any]:
    """Where and when a result was measured: device, process/device counts, jax/flax versions, UTC date."""
    device = jax.devices()[0]
    return {
        "device": f"{device.platform}:{getattr(device, 'device_kind', '')}", "device_count": jax.device_count(),
        "process_count": jax.process_count(), "jax_version": jax.__version__, "flax_version": flax.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_json(path: pathlib.Path, data: Any) -> None:
    """Writes `data` as indented JSON, atomically (write then rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def summarize_seeds(results: Sequence[Mapping[str, Any]], *, label_key: str = "pe") -> list[dict[str, Any]]:
    """Groups run results by `label_key`; each split's metrics become the mean over seeds plus `<name>_std` (with
    more than one seed) and `<name>_ci95`, the 95 % interval of `interval95` (over seeds and, for error rates, the
    evaluation samples; None when nothing measures it)."""
    groups: dict[Any, list[Mapping[str, Any]]] = {}
    for result in results:
        groups.setdefault(result[label_key], []).append(result)
    rows = []
    for label, runs in groups.items():
        splits: dict[str, dict[str, float]] = {}
        for split in runs[0]["splits"]:
            names = [k for k, v in runs[0]["splits"][split].items() if isinstance(v, float)]
            splits[split] = {}
            for name in names:
                values = np.array([run["splits"][split][name] for run in runs], np.float64)
                splits[split][name] = float(values.mean())
                if len(runs) > 1:
                    splits[split][f"{name}_std"] = float(values.std())
                samples = runs[0]["splits"][split].get("sequences")
                splits[split][f"{name}_ci95"] = interval95(values, samples, rate=name in PERCENT_METRICS)
        rows.append({label_key: label, "seeds": ",".join(str(r["seed"]) for r in runs), "splits": splits})
    return rows
