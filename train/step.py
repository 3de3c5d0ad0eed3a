"""Step mechanics: the train state, the optimizer, the weighted loss and a pure `train_step(state, batch)`.

B batch, L length, V vocabulary, A micro-batches. A batch is {"inputs": int32 [B, L], "targets": int32 [B, L],
"weights": float32 [B, L]}; the loss is cross-entropy weighted by "weights" (the answer tokens, read bits, ...),
normalised by the total weight of the whole (global) batch. Metrics come back as the sums of
`jaxpe.train.evaluate.compute_metrics` (the same as evaluation's), so that they add across steps and devices.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jaxpe.train.config import OptimConfig
from jaxpe.train.evaluate import compute_metrics

Batch = Mapping[str, Any]
Metrics = dict[str, jax.Array]  # sums (float32 []) of compute_metrics, plus "nonfinite" (int32 []) in training
LossFn = Callable[[Any, Batch, jax.Array], tuple[jax.Array, Metrics]]
StepFn = Callable[["TrainState", Batch], tuple["TrainState", Metrics]]


class TrainState(flax.struct.PyTreeNode):
    """Everything that changes during training; a pytree (checkpointed as a whole)."""

    params: Any  # model parameters
    opt_state: Any  # optax state
    step: jax.Array  # int32 [], optimizer steps done (= the data position)
    rng: jax.Array  # raw dropout key (uint32 [2] for threefry, [4] for rbg); split inside every step


def make_optimizer(optim: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on a linear-warmup + cosine-decay schedule."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=optim.learning_rate,
        warmup_steps=optim.warmup_steps,
        decay_steps=max(total_steps, optim.warmup_steps + 1),
        end_value=optim.learning_rate * optim.min_lr_ratio,
    )
    return optax.chain(
        optax.clip_by_global_norm(optim.clip_norm),
        optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay),
    )


def weighted_loss(logits_fn: Callable[[Any, jax.Array, jax.Array], jax.Array]) -> LossFn:
    """loss(params, batch, dropout_key) -> (sum of weighted NLL, compute_metrics sums); logits_fn(params, inputs
    [B, L], key) -> [B, L, V]."""

    def loss(params: Any, batch: Batch, key: jax.Array) -> tuple[jax.Array, Metrics]:
        logits = logits_fn(params, batch["inputs"], key).astype(jnp.float32)  # [B, L, V]
        sums = compute_metrics(logits, batch["targets"], batch["weights"])
        return sums["nll"], sums

    return loss


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, grad_accum: int = 1) -> StepFn:
    """train_step(state, batch) -> (state, metrics); pure, jit it with the state donated. metrics["nonfinite"] is 1
    where the loss, the gradient norm or an updated parameter is NaN/inf.

    The batch [B, L] is scanned as `grad_accum` micro-batches of B / grad_accum rows (micro-batch
    a holds rows a, a + grad_accum, ...); gradients of the weighted NLL sums add up and are
    divided by the batch's total weight, so any grad_accum gives the same update.
    """

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        key, next_key = jax.random.split(state.rng)
        micro = jax.tree.map(
            lambda x: x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1), batch
        )  # [A, B/A, L]
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

        def accumulate(carry: Any, xs: tuple[jax.Array, Batch]) -> tuple[Any, None]:
            index, micro_batch = xs
            (_, sums), grads = grad_fn(state.params, micro_batch, jax.random.fold_in(key, index))
            return jax.tree.map(jnp.add, carry, (grads, sums)), None

        if grad_accum == 1:  # no scan: a one-trip loop keeps XLA from fusing across it and copies its carry
            (_, sums), grads = grad_fn(state.params, batch, jax.random.fold_in(key, 0))
        else:
            sum_shapes = jax.eval_shape(loss_fn, state.params, jax.tree.map(lambda x: x[0], micro), key)[1]
            zeros = (jax.tree.map(jnp.zeros_like, state.params),
                     jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sum_shapes))
            (grads, sums), _ = jax.lax.scan(accumulate, zeros, (jnp.arange(grad_accum), micro))
        grads = jax.tree.map(lambda g: g / jnp.maximum(sums["weight"], 1e-9), grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # the new parameters too: an update that overflows (a learning rate past float32's range) leaves NaN/inf
        # parameters after a finite loss and gradient, and the state of this step is the one a checkpoint saves
        finite = (jnp.isfinite(sums["nll"]) & jnp.isfinite(optax.tree.norm(grads))
                  & jnp.all(jnp.stack([jnp.isfinite(p).all() for p in jax.tree.leaves(params)])))
        metrics = {**sums, "nonfinite": (~finite).astype(jnp.int32)}
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1, rng=next_key), metrics

    return train_step
