"""Metrics and evaluation: per-split sums on device, the task's metric on the host.

`compute_metrics` is the one definition of what is counted, for training (jaxpe.train.step) and evaluation alike;
`metrics_from_sums` turns the sums into metrics (jaxpe.train.tables shows them). Metrics (lower is better for all
three):
- `seq_error`: fraction of sequences with any weighted token predicted wrong (counting);
- `token_error`: fraction of weighted tokens predicted wrong (flip-flop reads, copied tokens);
- `bits_per_byte`: mean NLL over weighted byte positions / ln 2 (language modelling).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpe.train.tasks.base import scored_lengths, trim_batch

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
        "wrong": jnp.sum(jnp.where(wrong, weights, 0.0)),
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


def split_arrays(split: Any, *, by_length: bool = True) -> dict[str, np.ndarray]:
    """A split's arrays [N, L] (inputs, targets int32; weights float32), by_length sorted by scored length
    (tasks.base.scored_lengths), so that short sequences share short batches."""
    arrays = {
        "inputs": np.asarray(split.inputs, np.int32),
        "targets": np.asarray(split.targets, np.int32),
        "weights": np.asarray(split.weights, np.float32),
    }
    if not by_length:
        return arrays
    order = np.argsort(scored_lengths(arrays["weights"]), kind="stable")  # [N]
    return {name: array[order] for name, array in arrays.items()}


def batch_longest(split: Any, batch_size: int) -> np.ndarray:
    """int [ceil(N / batch_size)]: the longest scored sequence of each batch `split_sums` makes of the split (sorted
    by length, as `split_arrays` sorts it)."""
    lengths = np.sort(scored_lengths(np.asarray(split.weights, np.float32)))
    return np.array([lengths[start:start + batch_size].max(initial=0) for start in range(0, lengths.size, batch_size)])


def split_sums(
    eval_step: Callable[[Any, Mapping[str, Any]], Mapping[str, Any]],
    params: Any,
    split: Any,
    *,
    batch_size: int,
    put_batch: Callable[[Mapping[str, np.ndarray]], Mapping[str, Any]],
    to_host: Callable[[Any], Any],
    lengths: Sequence[int] | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, np.ndarray]:
    """The compute_metrics sums of one split (float64, shaped as eval_step returns them: [] for one model, [S] for
    S stacked ones).

    `on_batch(rows)` (e.g. a progress bar's update) is called after each batch with its number of real sequences.

    `lengths`: the length each batch is cut to (at least its longest scored sequence: `batch_longest`), the
    sequences first sorted by length (`split_arrays`), so that short ones share short batches; None: batches of the
    full length, in the split's order. The metrics are sums over sequences: neither changes them (the loss up to
    float rounding).
    """
    arrays = split_arrays(split, by_length=lengths is not None)
    totals: dict[str, np.ndarray] = {}
    n = arrays["inputs"].shape[0]
    for index, (start, batch) in enumerate(zip(range(0, n, batch_size), padded_batches(arrays, batch_size))):
        if lengths is not None and lengths[index] < batch["inputs"].shape[1]:
            batch = trim_batch(batch, int(lengths[index]))
        sums = to_host(eval_step(params, put_batch(batch)))
        for name, value in sums.items():
            totals[name] = totals.get(name, 0.0) + np.asarray(value, np.float64)
        if on_batch is not None:
            on_batch(min(batch_size, n - start))
    return totals
