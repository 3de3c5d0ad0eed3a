"""The Trainer: one model on one mesh, its jitted train and eval steps with their shardings and its initial state.
The model and task it trains are built from the config by jaxpe.train.config (build_model, build_task).

Several seeds of one configuration can train as one program: with `seeds`, the state holds S models stacked along a
leading member axis (parameters, optimizer state, step and dropout key each [S, ...]), initialised as the S separate
runs would be, and the train and eval steps are mapped over it with the batch shared (a task's data does not depend
on run.seed): run.seeds_at_once members side by side (`vmap`), those groups in turn in the same program
(`jax.lax.map`; `over_members`). Steps run several at a time (`train_steps`: a loop over up to K batches in one
dispatch, each member's or group's K steps before the next's). Members evaluated one at a time run a lone run's eval
step on each member's parameters in turn (`member_eval_step`: a lone run's compilation, not a loop over members).

B batch, L length, V vocabulary, S members (seeds), K steps per dispatch.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import numbers
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxpe.train import distributed, evaluate
from jaxpe.train.config import MAX_SEED, TrainConfig
from jaxpe.train.step import Batch, Metrics, StepFn, TrainState, make_optimizer, make_train_step, weighted_loss
from jaxpe.train.tasks.base import bucket_length, planned_lengths, scored_lengths, trim_batch

log = logging.getLogger(__name__)


def positions_depend_on_length(model: Any) -> bool:
    """Whether the model's positions depend on how long the padded batch is, not only on the tokens before each one
    (RoPE with dynamic NTK scaling reads the length): then cutting a batch's padding would change its scores."""
    pe = getattr(getattr(model, "config", None), "pe_config", None)
    scaling = getattr(pe, "scaling", None)
    return scaling is not None and dict(scaling).get("rope_type") == "dynamic"


def batch_sizes(config: TrainConfig) -> dict[str, int]:
    """{what: size} of every batch config's steps split over the mesh's devices (the global batch, a micro-batch,
    an evaluation batch)."""
    optim = config.optim
    return {"optim.batch_size": optim.batch_size,
            "optim.batch_size / optim.grad_accum": optim.batch_size // optim.grad_accum,
            "run.eval_batch_size": config.run.eval_batch_size}


def run_mesh(config: TrainConfig) -> jax.sharding.Mesh:
    """The data-parallel mesh of run.num_devices devices (0: as distributed.make_mesh chooses) for config's batches;
    a ValueError naming the key when there are not that many devices or a batch does not split over them evenly."""
    sizes = batch_sizes(config)
    mesh = distributed.make_mesh(config.run.num_devices, divides=tuple(sizes.values()), what="run.num_devices")
    for what, size in sizes.items():
        distributed.check_batch_size(size, mesh, what)
    return mesh


def members_at_once(seeds_at_once: int, members: int, platform: str) -> int:
    """How many of `members` stacked seeds a step computes side by side: run.seeds_at_once, or for 0 (auto) one on a
    CPU (each member's arrays stay the size of a lone run's, in the caches: a cpu-small CoPE step at L 128 then costs
    a member 1.01x a lone step, against 1.33x all side by side, benchmarks/paper_step.py --seeds-at-once) and all of
    them on an accelerator (one program as wide as S runs fills it)."""
    if seeds_at_once == 0:
        return 1 if platform == "cpu" else members
    return min(seeds_at_once, members)


def over_members(fn: Callable[[Any, Any], Any], at_once: int) -> Callable[[Any, Any], Any]:
    """fn(member, shared) -> out as a function of (members, shared): mapped over the leading member axis S of the
    `members` tree (`shared`, e.g. a batch, the same for each), `at_once` members side by side (vmap) and those
    groups in turn (jax.lax.map), in one program; out leaves [S, ...]."""

    def mapped(members: Any, shared: Any) -> Any:
        count = jax.tree.leaves(members)[0].shape[0]
        if at_once >= count:
            return jax.vmap(fn, in_axes=(0, None))(members, shared)
        return jax.lax.map(lambda member: fn(member, shared), members, batch_size=None if at_once == 1 else at_once)

    return mapped


@functools.partial(jax.jit, static_argnums=1)
def _split_members(tree: Any, members: int) -> tuple[Any, ...]:
    """A tree of [S, ...] leaves -> S trees of [...] leaves (S = members)."""
    return tuple(jax.tree.map(lambda x, i=i: x[i], tree) for i in range(members))


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
    seeds: tuple[int, ...] | None = None  # None: one run of config.run.seed; else S runs stacked as members
    mesh: jax.sharding.Mesh = dataclasses.field(init=False)
    state_sharding: Any = dataclasses.field(init=False)
    train_step: StepFn = dataclasses.field(init=False)  # one step: (state, batch [B, L]) -> (state, metrics)
    train_steps: StepFn = dataclasses.field(init=False)  # up to K steps (state, data, rows, count, length) -> sums
    member_state: Any = dataclasses.field(init=False)  # ShapeDtypeStructs (with shardings) of one run's state
    eval_step: Callable[[Any, Batch], Metrics] = dataclasses.field(init=False)
    member_eval_step: Callable[[Any, Batch], Metrics] | None = dataclasses.field(init=False)  # one member's params
    init_state: Callable[[], TrainState] = dataclasses.field(init=False)
    pad_to: str = dataclasses.field(init=False)  # run.pad_to, or "block" where padding changes the model's scores
    batch_lengths: dict[str, set[int]] = dataclasses.field(init=False)  # kind -> padded lengths compiled
    _ahead: threading.Thread | None = dataclasses.field(init=False, default=None)  # compile_ahead's, until joined

    def __post_init__(self) -> None:
        config, model = self.config, self.model
        self.pad_to, self.batch_lengths = config.run.pad_to, {"train": set(), "eval": set()}
        if self.pad_to != "block" and positions_depend_on_length(model):
            log.warning("run.pad_to=%s: the encoding's positions depend on the padded length (dynamic NTK "
                        "scaling), so every batch is padded to the full block", self.pad_to)
            self.pad_to = "block"
        self.mesh = run_mesh(config)
        tx = make_optimizer(config.optim, config.run.steps)

        def logits_train(params: Any, inputs: jax.Array, key: jax.Array) -> jax.Array:
            return model.apply({"params": params}, inputs, deterministic=False, rngs={"dropout": key})

        def logits_eval(params: Any, inputs: jax.Array) -> jax.Array:
            return model.apply({"params": params}, inputs, deterministic=True)

        def init_one(seed: jax.Array | int) -> TrainState:
            root = jax.random.PRNGKey(seed)
            tokens = jnp.zeros((1, self.seq_len), jnp.int32)
            params = nn.meta.unbox(model.init(jax.random.fold_in(root, 0), tokens)["params"])
            return TrainState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32),
                              rng=jax.random.fold_in(root, 1))

        step = make_train_step(weighted_loss(logits_train), tx, config.optim.grad_accum)
        eval_step = evaluate.make_eval_step(logits_eval)
        traced_once = jax.jit(step)  # inside `run_steps`: its shapes and its loop body share one trace

        def run_steps(state: TrainState, data: Batch, rows: jax.Array, count: jax.Array,
                      length: int) -> tuple[TrainState, Metrics]:
            """One run's steps 0 .. count − 1 (count <= K, traced) in one program, step k on rows[k] [B] of data
            {name: [N, L]} cut to `length`; the metrics summed over them (jaxpe.train.feed). rows [K, B]: one shape
            for every count."""
            cut = {name: array[:, :length] for name, array in data.items()}

            def one(k: jax.Array, carry: tuple[TrainState, Metrics]) -> tuple[TrainState, Metrics]:
                state, sums = carry
                state, metrics = traced_once(state, {name: array[rows[k]] for name, array in cut.items()})
                return state, jax.tree.map(jnp.add, sums, metrics)

            shapes = jax.eval_shape(traced_once, state, {name: array[rows[0]] for name, array in cut.items()})[1]
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            return jax.lax.fori_loop(0, count, one, (state, zeros))

        one_eval, at_once = eval_step, None
        if self.seeds is None:
            init, steps = functools.partial(init_one, config.run.seed), run_steps
        else:
            if not self.seeds:
                raise ValueError(f"seeds={self.seeds!r} must name at least one seed (or be None)")
            if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) for s in self.seeds):
                raise TypeError(f"seeds={self.seeds!r} must be ints (run.seed values)")
            if any(not 0 <= s <= MAX_SEED for s in self.seeds):
                raise ValueError(f"seeds={self.seeds!r} must each be in [0, {MAX_SEED}], as run.seed is")
            seeds = jnp.asarray(self.seeds, jnp.int32)  # [S]
            init = functools.partial(jax.vmap(init_one), seeds)
            at_once = members_at_once(config.run.seeds_at_once, len(self.seeds), self.mesh.devices.flat[0].platform)

            def steps(state: TrainState, data: Batch, rows: jax.Array, count: jax.Array,
                      length: int) -> tuple[TrainState, Metrics]:
                """Each member's `run_steps` on the same batches (one member's K steps in turn, the next member's
                after them: a member's state stays in the caches, and the loop body is a lone run's step)."""
                mapped = over_members(lambda member, shared: run_steps(member, *shared, length), at_once)
                return mapped(state, (data, rows, count))

            step, eval_step = over_members(step, at_once), over_members(eval_step, at_once)

        one_state = jax.eval_shape(functools.partial(init_one, 0))
        one_sharding = distributed.state_shardings(one_state, self.mesh, fsdp=config.run.fsdp)
        self.member_state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                         one_state, one_sharding)
        self.state_sharding = self._member_shardings(one_sharding)
        replicated = distributed.replicated(self.mesh)
        batch_sharding = distributed.batch_sharding(self.mesh)
        self.init_state = jax.jit(init, out_shardings=self.state_sharding)
        self.train_step = jax.jit(step, in_shardings=(self.state_sharding, batch_sharding),
                                  out_shardings=(self.state_sharding, replicated), donate_argnums=0)
        self.train_steps = jax.jit(
            steps, in_shardings=(self.state_sharding, replicated, distributed.batch_sharding(self.mesh, axis=1),
                                 replicated),
            out_shardings=(self.state_sharding, replicated), donate_argnums=0, static_argnums=4)
        self.eval_step = jax.jit(eval_step, in_shardings=(self.state_sharding.params, batch_sharding),
                                 out_shardings=replicated)
        # stacked members evaluated one at a time: by a lone run's eval step (a lone run's compilation), each
        # member's params split off first, not by a loop over the stacked ones in the program
        self.member_eval_step = None if at_once != 1 else jax.jit(
            one_eval, in_shardings=(one_sharding.params, batch_sharding), out_shardings=replicated)

    def seed(self, member: int) -> int:
        """The run seed of `member` (config.run.seed without seeds)."""
        return self.config.run.seed if self.seeds is None else self.seeds[member]

    @property
    def members(self) -> int:
        """S, the runs this Trainer trains together (1 without seeds)."""
        return 1 if self.seeds is None else len(self.seeds)

    def _member_shardings(self, shardings: Any) -> Any:
        """One run's state shardings, with the member axis (unsharded) in front when seeds are stacked."""
        if self.seeds is None:
            return shardings
        return jax.tree.map(lambda s: jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(None, *s.spec)),
                            shardings)

    def unstack(self, tree: Any) -> list[Any]:
        """Each member's part of a stacked tree (state, metric sums), in seed order; [tree] without seeds. A tree of
        device arrays is split by one jitted program (one compilation a tree structure, one dispatch a call), not by
        an indexing op a leaf and member (a compilation a leaf shape, S × leaves dispatches)."""
        if self.seeds is None:
            return [tree]
        if all(isinstance(x, jax.Array) for x in jax.tree.leaves(tree)):
            return list(_split_members(tree, self.members))
        return [jax.tree.map(lambda x, i=i: x[i], tree) for i in range(self.members)]

    def stack(self, trees: list[Any]) -> Any:
        """The inverse of `unstack`: members' trees (e.g. restored states) as one stacked tree, sharded as the
        state is when `trees` are states."""
        if self.seeds is None:
            (tree,) = trees
            return tree
        return jax.device_put(jax.tree.map(lambda *xs: jnp.stack(xs), *trees), self.state_sharding)

    def abstract_state(self) -> Any:
        """ShapeDtypeStructs (with shardings) of one run's state (one member's), for restoring its checkpoint."""
        return self.member_state

    def put(self, batch: Batch) -> dict[str, jax.Array]:
        return distributed.put_batch(batch, self.mesh)

    def bucket(self, scored: np.ndarray, full: int) -> int:
        """The length a batch whose sequences' scored lengths are `scored` [B] (tasks.base.scored_lengths; or their
        longest alone) and whose arrays are `full` long is cut to: the longest rounded up as run.pad_to says."""
        return bucket_length(int(np.max(scored, initial=0)), full, pad_to=self.pad_to,
                             multiple=self.config.run.pad_multiple)

    def pad(self, batch: Mapping[str, Any], kind: str = "train") -> dict[str, Any]:
        """The host batch [B, L] cut to [B, `bucket`]. A length new to `kind` is logged: the step compiles once
        more."""
        full = batch["inputs"].shape[1]
        length = self.bucket(scored_lengths(batch["weights"]), full)
        self.note_length(kind, length, full)
        return trim_batch(batch, length) if length < full else dict(batch)

    def note_length(self, kind: str, length: int, full: int) -> None:
        """Records a batch length of `kind` ("train", "eval"); a new one is logged: the step compiles once more."""
        if length not in self.batch_lengths[kind]:
            self.batch_lengths[kind].add(length)
            log.info("%s step: batches of length %d (of %d), %d length(s) compiled so far", kind, length, full,
                     len(self.batch_lengths[kind]))

    def eval_lengths(self, splits: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The length each evaluation batch of each split runs at (in `evaluate.split_sums`'s order): its own
        bucket (as `pad` cuts a batch), planned over the batches of every split of the same block length
        (tasks.base.planned_lengths: the paper preset's validation set would otherwise compile 14 eval steps of one
        pass each). New lengths are logged, as `pad` logs them."""
        batch_size = self.config.run.eval_batch_size
        own = {name: np.array([self.bucket(longest, split.inputs.shape[1])
                               for longest in evaluate.batch_longest(split, batch_size)])
               for name, split in splits.items()}
        planned = {}
        for full in {split.inputs.shape[1] for split in splits.values()}:
            names = [name for name, split in splits.items() if split.inputs.shape[1] == full]
            lengths = planned_lengths(np.concatenate([own[name] for name in names]))
            for name in names:
                planned[name], lengths = lengths[:own[name].size], lengths[own[name].size:]
                for length in planned[name]:
                    self.note_length("eval", int(length), full)
        return planned

    def compile_ahead(self, params: Any, evaluations: Sequence[Mapping[str, Any]]) -> None:
        """Compiles, in a background thread while training runs, the eval steps that evaluating each of `evaluations`
        (split sets evaluated together: `eval_lengths` plans each) will run, for params shaped and placed as `params`
        (ahead-of-time: nothing runs, nothing is read, so the state may be donated meanwhile): the first evaluation
        then finds them in jax's compilation cache (on a GPU, the idle host compiles while the device trains). As
        run.compile_ahead says: "auto" on accelerators only (on a CPU the compiler takes the cores training uses,
        and a run cut short compiles for nothing), "on" on a CPU too, "off" never; not with run.pad_to "block" (one
        eval step, compiled at once)."""
        setting = self.config.run.compile_ahead
        if setting == "off" or (setting == "auto" and distributed.on_cpu(self.mesh)) or self.pad_to == "block":
            return
        plans = [plan for splits in evaluations for plan in self.eval_lengths(splits).values()]
        lengths = sorted({int(n) for plan in plans for n in plan})
        shaped = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
        eval_step, stacked = self.eval_step, None
        if self.member_eval_step is not None:  # `unstack`'s program, then a lone run's eval steps
            eval_step, stacked, shaped = self.member_eval_step, shaped, self.member_state.params
        rows, sharding = self.config.run.eval_batch_size, distributed.batch_sharding(self.mesh)

        def compile_all() -> None:
            if stacked is not None:
                _split_members.lower(stacked, self.members).compile()
            for length in lengths:
                batch = {name: jax.ShapeDtypeStruct((rows, length), dtype, sharding=sharding)
                         for name, dtype in (("inputs", jnp.int32), ("targets", jnp.int32), ("weights", jnp.float32))}
                eval_step.lower(shaped, batch).compile()

        self._ahead = threading.Thread(target=compile_all, name="jaxpe-compile-ahead", daemon=True)
        self._ahead.start()

    def evaluate(self, params: Any, splits: Mapping[str, Any], *,
                 on_batch: Callable[[int], None] | None = None) -> dict[str, dict[str, float]]:
        """Metrics per split (see jaxpe.train.evaluate) of one run's params (a Trainer without seeds);
        `on_batch(rows)` after each batch (a progress bar)."""
        if self.seeds is not None:
            raise ValueError(f"this Trainer holds {self.members} stacked runs (seeds={self.seeds}); "
                             "use evaluate_members")
        return self.evaluate_members(params, splits, on_batch=on_batch)[0]

    def evaluate_members(self, params: Any, splits: Mapping[str, Any], *,
                         on_batch: Callable[[int], None] | None = None) -> list[dict[str, dict[str, float]]]:
        """Metrics per split, one dict a member (in seed order), of params as the state holds them (stacked with
        seeds); batches cut to `eval_lengths` unless run.pad_to is "block"; `on_batch(rows)` after each batch (each
        member's, where `member_eval_step` evaluates them one at a time). Waits for `compile_ahead`'s thread first (its
        programs are these)."""
        if self._ahead is not None:
            self._ahead.join()
            self._ahead = None
        lengths = None if self.pad_to == "block" else self.eval_lengths(splits)

        def sums(eval_step: Callable[[Any, Batch], Metrics], params: Any) -> dict[str, dict[str, np.ndarray]]:
            return {name: evaluate.split_sums(eval_step, params, split, batch_size=self.config.run.eval_batch_size,
                                              put_batch=self.put, to_host=distributed.to_host,
                                              lengths=None if lengths is None else lengths[name], on_batch=on_batch)
                    for name, split in splits.items()}

        if self.member_eval_step is not None:
            members = [sums(self.member_eval_step, member) for member in self.unstack(params)]
        else:
            stacked = {name: self.unstack(split) for name, split in sums(self.eval_step, params).items()}
            members = [{name: split[i] for name, split in stacked.items()} for i in range(self.members)]
        return [{name: evaluate.metrics_from_sums(split) for name, split in member.items()} for member in members]
