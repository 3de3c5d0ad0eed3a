"""The Trainer: one model on one mesh, its jitted train and eval steps with their shardings and its initial state.
The model and task it trains are built from the config by jaxpe.train.config (build_model, build_task).

B batch, L length, V vocabulary.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpe.train import distributed, evaluate
from jaxpe.train.config import TrainConfig
from jaxpe.train.step import Batch, Metrics, StepFn, TrainState, make_optimizer, make_train_step, weighted_loss
from jaxpe.train.tasks.base import bucket_length, scored_lengths, trim_batch

log = logging.getLogger(__name__)


def positions_depend_on_length(model: Any) -> bool:
    """Whether the model's positions depend on how long the padded batch is, not only on the tokens before each one
    (RoPE with dynamic NTK scaling reads the length): then cutting a batch's padding would change its scores."""
    pe = getattr(getattr(model, "config", None), "pe_config", None)
    scaling = getattr(pe, "scaling", None)
    return scaling is not None and dict(scaling).get("rope_type") == "dynamic"


@dataclasses.dataclass
class Trainer:
    """The jitted step functions, shardings and initial state for one model on one mesh.

    `pad(batch, kind)` cuts a host batch to its bucket length (run.pad_to, run.pad_multiple), so that a batch is no
    longer than its longest sequence needs; each new length is one more compilation of the step, and
    `batch_lengths[kind]` ("train", "eval") holds the lengths seen so far.
    """

    model: Any  # a flax linen module: apply({"params": p}, tokens [B, L], deterministic=, rngs=) -> [B, L, V]
    config: TrainConfig
    seq_len: int  # training length L (for init)
    mesh: jax.sharding.Mesh = dataclasses.field(init=False)
    state_sharding: Any = dataclasses.field(init=False)
    train_step: StepFn = dataclasses.field(init=False)
    eval_step: Callable[[Any, Batch], Metrics] = dataclasses.field(init=False)
    init_state: Callable[[], TrainState] = dataclasses.field(init=False)
    pad_to: str = dataclasses.field(init=False)  # run.pad_to, or "block" where padding changes the model's scores
    batch_lengths: dict[str, set[int]] = dataclasses.field(init=False)  # kind -> padded lengths compiled

    def __post_init__(self) -> None:
        config, model = self.config, self.model
        self.pad_to, self.batch_lengths = config.run.pad_to, {"train": set(), "eval": set()}
        if self.pad_to != "block" and positions_depend_on_length(model):
            log.warning("run.pad_to=%s: the encoding's positions depend on the padded length (dynamic NTK "
                        "scaling), so every batch is padded to the full block", self.pad_to)
            self.pad_to = "block"
        batch_sizes = (config.optim.batch_size, config.optim.batch_size // config.optim.grad_accum,
                       config.run.eval_batch_size)
        self.mesh = distributed.make_mesh(config.run.num_devices, divides=batch_sizes)
        distributed.check_batch_size(config.optim.batch_size, self.mesh)
        distributed.check_batch_size(config.optim.batch_size // config.optim.grad_accum, self.mesh,
                                     "optim.batch_size / optim.grad_accum")
        distributed.check_batch_size(config.run.eval_batch_size, self.mesh, "run.eval_batch_size")
        tx = make_optimizer(config.optim, config.run.steps)

        def logits_train(params: Any, inputs: jax.Array, key: jax.Array) -> jax.Array:
            return model.apply({"params": params}, inputs, deterministic=False, rngs={"dropout": key})

        def logits_eval(params: Any, inputs: jax.Array) -> jax.Array:
            return model.apply({"params": params}, inputs, deterministic=True)

        def init() -> TrainState:
            root = jax.random.PRNGKey(config.run.seed)
            tokens = jnp.zeros((1, self.seq_len), jnp.int32)
            params = nn.meta.unbox(model.init(jax.random.fold_in(root, 0), tokens)["params"])
            return TrainState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32),
                              rng=jax.random.fold_in(root, 1))

        self.state_sharding = distributed.state_shardings(jax.eval_shape(init), self.mesh, fsdp=config.run.fsdp)
        replicated = distributed.replicated(self.mesh)
        batch_sharding = distributed.batch_sharding(self.mesh)
        self.init_state = jax.jit(init, out_shardings=self.state_sharding)
        self.train_step = jax.jit(
            make_train_step(weighted_loss(logits_train), tx, config.optim.grad_accum),
            in_shardings=(self.state_sharding, batch_sharding),
            out_shardings=(self.state_sharding, replicated),
            donate_argnums=0,
        )
        self.eval_step = jax.jit(
            evaluate.make_eval_step(logits_eval),
            in_shardings=(self.state_sharding.params, batch_sharding),
            out_shardings=replicated,
        )

    def abstract_state(self) -> Any:
        """ShapeDtypeStructs (with shardings) of the state, for restoring."""
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            jax.eval_shape(self.init_state),
            self.state_sharding,
        )

    def put(self, batch: Batch) -> dict[str, jax.Array]:
        return distributed.put_batch(batch, self.mesh)

    def pad(self, batch: Mapping[str, Any], kind: str = "train") -> dict[str, Any]:
        """The host batch [B, L] cut to [B, bucket]: its longest scored prefix (tasks.base.scored_lengths) rounded
        up as run.pad_to says. A length new to `kind` is logged: the step compiles once more."""
        full = batch["inputs"].shape[1]
        longest = int(scored_lengths(batch["weights"]).max(initial=0))
        length = bucket_length(longest, full, pad_to=self.pad_to, multiple=self.config.run.pad_multiple)
        if length not in self.batch_lengths[kind]:
            self.batch_lengths[kind].add(length)
            log.info("%s step: batches of length %d (of %d), %d length(s) compiled so far", kind, length, full,
                     len(self.batch_lengths[kind]))
        return trim_batch(batch, length) if length < full else dict(batch)

    def evaluate(self, params: Any, splits: Mapping[str, Any], *,
                 on_batch: Callable[[int], None] | None = None) -> dict[str, dict[str, float]]:
        """Metrics per split (see jaxpe.train.evaluate); batches cut by `pad` unless run.pad_to is "block";
        `on_batch(rows)` after each batch (a progress bar)."""
        pad = None if self.pad_to == "block" else lambda batch: self.pad(batch, "eval")
        return {
            name: evaluate.evaluate_split(
                self.eval_step, params, split, batch_size=self.config.run.eval_batch_size,
                put_batch=self.put, to_host=distributed.to_host, pad=pad, on_batch=on_batch,
            )
            for name, split in splits.items()
        }
