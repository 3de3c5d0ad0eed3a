"""The training loop: a pure, jitted `train_step(state, batch) -> (state, metrics)` and hooks.

B batch, L length, V vocabulary. A batch is {"inputs": int32 [B, L], "targets": int32 [B, L],
"weights": float32 [B, L]}; the loss is cross-entropy weighted by "weights" (the answer tokens,
read bits, ...), normalised by the total weight of the whole (global) batch. Metrics come back
as sums plus a count ("count" = total weight), so that they add across steps and devices.

`train_and_evaluate(config, workdir)` wires task, model, mesh, checkpoints and evaluation;
the CLI and notebooks call it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jaxpe.model import TransformerLM
from jaxpe.train import distributed, evaluate, plots
from jaxpe.train.checkpoint import Checkpoints
from jaxpe.train.config import ModelConfig, OptimConfig, TrainConfig, from_dict, to_dict

log = logging.getLogger(__name__)

Batch = Mapping[str, Any]
LossFn = Callable[[Any, Batch, jax.Array], tuple[jax.Array, tuple[jax.Array, jax.Array]]]


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient norm became NaN/inf; the run stopped."""


class TrainState(flax.struct.PyTreeNode):
    """Everything that changes during training; a pytree (checkpointed as a whole)."""

    params: Any  # model parameters
    opt_state: Any  # optax state
    step: jax.Array  # int32 [], optimizer steps done (= the data position)
    rng: jax.Array  # uint32 [2], dropout key; split inside every step


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
    """loss(params, batch, dropout_key) -> (sum of weighted NLL, (weighted correct, total weight))."""

    def loss(params: Any, batch: Batch, key: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        logits = logits_fn(params, batch["inputs"], key).astype(jnp.float32)  # [B, L, V]
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])  # [B, L]
        weights = batch["weights"]
        correct = jnp.sum((jnp.argmax(logits, axis=-1) == batch["targets"]) * weights)
        return jnp.sum(nll * weights), (correct, jnp.sum(weights))

    return loss


def make_train_step(
    loss_fn: LossFn, tx: optax.GradientTransformation, grad_accum: int = 1
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """train_step(state, batch) -> (state, metrics); pure, jit it with the state donated.

    The batch [B, L] is scanned as `grad_accum` micro-batches of B / grad_accum rows (micro-batch
    a holds rows a, a + grad_accum, ...); gradients of the weighted NLL sums add up and are
    divided by the batch's total weight, so any grad_accum gives the same update.
    """

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        key, next_key = jax.random.split(state.rng)
        micro = jax.tree.map(
            lambda x: x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1), batch
        )  # [A, B/A, L]
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

        def accumulate(carry: Any, xs: tuple[jax.Array, Batch]) -> tuple[Any, None]:
            index, micro_batch = xs
            (loss, (correct, weight)), grads = grad_fn(state.params, micro_batch, jax.random.fold_in(key, index))
            return jax.tree.map(jnp.add, carry, (grads, loss, correct, weight)), None

        zeros = (jax.tree.map(jnp.zeros_like, state.params), *(jnp.zeros((), jnp.float32),) * 3)
        (grads, loss, correct, weight), _ = jax.lax.scan(accumulate, zeros, (jnp.arange(grad_accum), micro))
        grads = jax.tree.map(lambda g: g / jnp.maximum(weight, 1e-9), grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads))
        metrics = {"loss": loss, "correct": correct, "count": weight, "nonfinite": (~finite).astype(jnp.int32)}
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1, rng=next_key), metrics

    return train_step


def build_model(model: ModelConfig, vocab_size: int, max_len: int) -> TransformerLM:
    """jaxpe.TransformerLM for `model`, its vocab_size and max_len filled in where None (the task's vocabulary and
    longest sequence); a vocab_size that is set must hold the task's `vocab_size` tokens."""
    if model.vocab_size is not None and model.vocab_size < vocab_size:
        raise ValueError(f"model.vocab_size={model.vocab_size} is smaller than the task's {vocab_size=}; "
                         "leave it unset (none) to take the task's")
    return TransformerLM(dataclasses.replace(model, vocab_size=model.vocab_size or vocab_size,
                                             max_len=model.max_len or max_len))


def build_task(config: TrainConfig) -> Any:
    """The jaxpe.train.tasks Task named in config.task."""
    from jaxpe.train.tasks import make_task

    return make_task(config.task.name, **config.task.options)


def longest_length(task: Any) -> int:
    """The longest sequence the model will see (training or any evaluation split)."""
    return max([task.seq_len, *(s.inputs.shape[1] for s in task.eval_splits().values())])


@dataclasses.dataclass
class Trainer:
    """The jitted step functions, shardings and initial state for one model on one mesh."""

    model: Any  # a flax linen module: apply({"params": p}, tokens [B, L], deterministic=, rngs=) -> [B, L, V]
    config: TrainConfig
    seq_len: int  # training length L (for init)
    mesh: jax.sharding.Mesh = dataclasses.field(init=False)
    state_sharding: Any = dataclasses.field(init=False)
    train_step: Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]] = dataclasses.field(init=False)
    eval_step: Callable[[Any, Batch], dict[str, jax.Array]] = dataclasses.field(init=False)
    init_state: Callable[[], TrainState] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        config, model = self.config, self.model
        self.mesh = distributed.make_mesh(config.run.num_devices)
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
            params = model.init(jax.random.fold_in(root, 0), tokens)["params"]
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

    def evaluate(self, params: Any, splits: Mapping[str, Any]) -> dict[str, dict[str, float]]:
        """Metrics per split (see jaxpe.train.evaluate)."""
        return {
            name: evaluate.evaluate_split(
                self.eval_step, params, split, batch_size=self.config.run.eval_batch_size,
                put_batch=self.put, to_host=distributed.to_host,
            )
            for name, split in splits.items()
        }


class MetricsLog:
    """The run's metrics in the workdir, written by process 0: metrics.jsonl, and TensorBoard event files in tb/ when
    `tensorboard` is set and tensorboardX is installed (scalars `<split>/<metric>`, e.g. train/loss, valid/token_error).

    On resume, records past the resume step are dropped: lines of metrics.jsonl, and TensorBoard events through
    the writer's purge_step (TensorBoard hides older events from that step on).
    """

    def __init__(self, workdir: pathlib.Path, *, resume_step: int, enabled: bool, tensorboard: bool):
        self.path, self.enabled = workdir / "metrics.jsonl", enabled
        if enabled and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if self._step(line) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.writer = None
        if enabled and tensorboard:
            self.writer = _tensorboard_writer(workdir / "tb", purge_step=resume_step + 1)

    @staticmethod
    def _step(line: str) -> float:
        """The record's step; a line cut short by a kill counts as past any resume point."""
        try:
            return json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            return float("inf")

    def write(self, record: Mapping[str, Any]) -> None:
        """One record {"step": int, "split": str, metric: number, ...}."""
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for name, value in record.items():
                if name not in ("step", "split") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(f"{record['split']}/{name}", value, global_step=record["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _tensorboard_writer(logdir: pathlib.Path, *, purge_step: int) -> Any:
    """A tensorboardX SummaryWriter, or None (with a note) when tensorboardX is not installed."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        log.info("tensorboardX is not installed: no TensorBoard event files (pip install 'jaxpe[tensorboard]'); "
                 "metrics.jsonl has every metric")
        return None
    return SummaryWriter(str(logdir), purge_step=purge_step)


def train_and_evaluate(
    config: TrainConfig, workdir: str | pathlib.Path, *, task: Any = None, model: Any = None
) -> dict[str, Any]:
    """Trains (resuming from workdir's checkpoints if any), evaluates every split, writes results.

    task: a jaxpe.train.tasks Task (default: built from config.task); model: a flax module with
    jaxpe.TransformerLM's call signature (default: built from config.model).
    Writes in workdir: config.json, metrics.jsonl, tb/ (TensorBoard, see MetricsLog), checkpoints/, result.json,
    result.md, result.png; only process 0 writes files (checkpoints are saved by every process together).
    Returns the result dict. Raises NonFiniteLossError on a NaN/inf loss (the last checkpoint written is the
    last good one).
    """
    workdir = pathlib.Path(workdir).absolute()
    is_main = jax.process_index() == 0
    check_same_run(workdir, config)
    if is_main:
        workdir.mkdir(parents=True, exist_ok=True)
        evaluate.write_json(workdir / "config.json", to_dict(config))
    task = task if task is not None else build_task(config)
    splits = task.eval_splits()
    model = model if model is not None else build_model(config.model, task.vocab_size, longest_length(task))
    trainer = Trainer(model=model, config=config, seq_len=task.seq_len)
    run = config.run
    eval_splits = {k: v for k, v in splits.items() if not run.eval_splits or k in run.eval_splits}
    best_split = "valid" if "valid" in splits else next(iter(splits))

    checkpoints = None
    state, problems = None, []
    if run.checkpoint_every:
        checkpoints = Checkpoints(workdir / "checkpoints", keep=run.keep, best_metric=f"{best_split}/{task.metric}",
                                  async_save=run.async_checkpoints)
        state, _, problems = checkpoints.restore_latest(trainer.abstract_state())
    resumed_from = None if state is None else int(distributed.to_host(state.step))
    if state is None:
        state = trainer.init_state()
    start = resumed_from or 0
    if resumed_from is not None:
        log.info("resuming from the checkpoint at step %d in %s", start, workdir)
    metrics_log = MetricsLog(workdir, resume_step=start, enabled=is_main, tensorboard=run.tensorboard)

    pending = None  # device-side sums of metrics since the last check
    last_good = resumed_from
    tokens_per_step = config.optim.batch_size * task.seq_len
    progress = _progress_bar(run, start, enabled=is_main)
    clock, clock_step = time.perf_counter(), start
    try:
        for step in range(start + 1, run.steps + 1):
            batch = trainer.put(task.train_batch(step - 1, config.optim.batch_size))
            state, metrics = trainer.train_step(state, batch)
            pending = metrics if pending is None else jax.tree.map(jnp.add, pending, metrics)
            save_now = run.checkpoint_every and (step % run.checkpoint_every == 0 or step == run.steps)
            if step % run.log_every == 0 or save_now or step == run.steps:
                sums = distributed.to_host(pending)
                pending = None
                if sums["nonfinite"]:
                    raise NonFiniteLossError(
                        f"loss or gradient became NaN/inf by step {step} (loss sum {float(sums['loss'])}); "
                        f"stopped. Last good checkpoint: "
                        + (f"step {last_good} in {workdir / 'checkpoints'}" if last_good is not None else "none")
                    )
                now = time.perf_counter()
                record = {
                    "step": step, "split": "train",
                    "loss": float(sums["loss"]) / max(float(sums["count"]), 1e-9),
                    "accuracy": float(sums["correct"]) / max(float(sums["count"]), 1e-9),
                    "tokens_per_s": (step - clock_step) * tokens_per_step / max(now - clock, 1e-9),
                }
                clock, clock_step = now, step
                metrics_log.write(record)
                if progress is not None:
                    progress.set_postfix(loss=f"{record['loss']:.4f}", acc=f"{record['accuracy']:.3f}",
                                         tok_s=f"{record['tokens_per_s']:.0f}")
            eval_metrics = None
            if step == run.steps or (run.eval_every and step % run.eval_every == 0):
                results = trainer.evaluate(state.params, splits if step == run.steps else eval_splits)
                for name, values in results.items():
                    metrics_log.write({"step": step, "split": name, **values})
                if best_split in results:
                    eval_metrics = {f"{best_split}/{task.metric}": results[best_split][task.metric]}
                final = results
            if save_now and checkpoints is not None:
                checkpoints.save(step, state, {"step": step, "data_position": step}, eval_metrics)
                last_good = step
            if eval_metrics is not None or save_now:
                clock, clock_step = time.perf_counter(), step  # tokens/s measures training only
            if progress is not None:
                progress.update(1)
        if start >= run.steps:  # resumed a finished run: evaluate its final state
            final = trainer.evaluate(state.params, splits)
    finally:
        metrics_log.close()
        if progress is not None:
            progress.close()
        if checkpoints is not None:
            checkpoints.wait()
            checkpoints.close()

    result = {
        "task": config.task.name, "pe": config.model.pe, "seed": run.seed, "metric": task.metric,
        "steps": run.steps, "resumed_from": resumed_from, "checkpoint_problems": problems,
        "splits": final, "config": to_dict(config), "encoding": _resolved_encoding(model),
        "environment": evaluate.environment(),
    }
    if is_main:
        evaluate.write_json(workdir / "result.json", result)
        (workdir / "result.md").write_text(
            evaluate.results_markdown([result], metric=task.metric, splits=list(final), label_keys=("task", "pe", "seed"))
        )
        plots.run_summary(workdir / "metrics.jsonl", result, workdir / "result.png")
    return result


# Run fields that may change between a run and its resumption: length, bookkeeping and the device layout.
RESUMABLE_RUN_FIELDS = ("steps", "log_every", "eval_every", "checkpoint_every", "keep", "async_checkpoints",
                        "eval_batch_size", "eval_splits", "num_devices", "fsdp", "progress", "tensorboard")


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_same_run(workdir: pathlib.Path, config: TrainConfig) -> None:
    """ValueError when `config` would resume a checkpoint in `workdir` whose run (config.json) differs from it in
    anything but RESUMABLE_RUN_FIELDS: that would mix two experiments in one set of checkpoints and metrics.
    Without a checkpoint to resume, the run starts afresh and replaces what is there."""
    path, saved_steps = workdir / "config.json", workdir / "checkpoints"
    resumes = config.run.checkpoint_every and saved_steps.is_dir() and any(
        p.name.isdigit() for p in saved_steps.iterdir())
    if not (resumes and path.is_file()):
        return
    saved, new = _flat(json.loads(path.read_text())), _flat(to_dict(config))
    allowed = {f"run.{name}" for name in RESUMABLE_RUN_FIELDS}
    changed = sorted(k for k in saved.keys() | new.keys() if k not in allowed and saved.get(k) != new.get(k))
    if changed:
        diff = ", ".join(f"{k}: {saved.get(k, '<unset>')!r} -> {new.get(k, '<unset>')!r}" for k in changed)
        raise ValueError(f"workdir={str(workdir)!r} holds a run with another config ({diff}); "
                         "use a new workdir, or the saved config to resume it")


def _resolved_encoding(model: Any) -> dict[str, Any] | None:
    """The encoding's config with every default filled in (None for a model without a jaxpe ModelConfig)."""
    pe_config = getattr(getattr(model, "config", None), "pe_config", None)
    if pe_config is None:
        return None
    return {"name": pe_config.name, **json.loads(json.dumps(dataclasses.asdict(pe_config), default=list))}


def _progress_bar(run: Any, start: int, *, enabled: bool) -> Any:
    if not (run.progress and enabled):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=run.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)



def compare_encodings(
    configs: Sequence[TrainConfig], seeds: Sequence[int], workdir: str | pathlib.Path
) -> dict[str, Any]:
    """Trains every (config, seed) in workdir/<pe>/seed<seed> and writes one comparison: compare.json,
    compare.md and compare.png (mean ± std over seeds). Each run resumes by itself; one that finished with
    the same config is read back from its result.json, so a rerun or a wider sweep redoes nothing.

    configs: one per encoding (same task), e.g. build_config(preset=..., pe=pe) for each pe.
    """
    if not configs or not seeds:
        raise ValueError(f"configs ({len(configs)}) and {seeds=} must both be non-empty")
    if any(c.task != configs[0].task for c in configs):
        raise ValueError(f"configs must share one task config, got {[c.task for c in configs]}")
    workdir = pathlib.Path(workdir).absolute()
    results = []
    for config in configs:
        for seed in seeds:
            run_config = dataclasses.replace(config, run=dataclasses.replace(config.run, seed=seed))
            run_dir = workdir / config.model.pe / f"seed{seed}"
            finished = _finished_result(run_dir, run_config)
            if finished is not None:
                log.info("%s seed %d finished before with this config: reusing %s", config.model.pe, seed,
                         run_dir / "result.json")
                results.append(finished)
                continue
            log.info("training %s seed %d", config.model.pe, seed)
            results.append(train_and_evaluate(run_config, run_dir))
    metric = results[0]["metric"]
    splits = list(build_task(configs[0]).eval_splits())  # the task's order (result.json sorts its keys)
    rows = evaluate.summarize_seeds(results)
    table = evaluate.results_markdown(rows, metric=metric, splits=splits, label_keys=("pe", "seeds"))
    task_name = configs[0].task.name
    comparison = {"task": task_name, "metric": metric, "splits": splits, "rows": rows, "seeds": list(seeds),
                  "environment": evaluate.environment(), "runs": results}
    if jax.process_index() == 0:
        evaluate.write_json(workdir / "compare.json", comparison)
        (workdir / "compare.md").write_text(f"# {task_name}: {metric}, lower is better\n\n{table}")
        plots.result_bars(rows, metric=metric, splits=splits, path=workdir / "compare.png")
    return {**comparison, "table": table}


def _finished_result(run_dir: pathlib.Path, config: TrainConfig) -> dict[str, Any] | None:
    """result.json of a run in run_dir that finished with `config` (its saved config read back equals it), else None."""
    path = run_dir / "result.json"
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    try:
        saved = from_dict(result["config"])
    except (KeyError, ValueError):
        return None
    return result if saved == config else None


def evaluate_checkpoint(workdir: str | pathlib.Path, *, step: int | None = None) -> dict[str, Any]:
    """Evaluates a run's checkpoint (the latest, or `step`) on every split; writes eval.json and eval.md."""
    workdir = pathlib.Path(workdir).absolute()
    config_path = workdir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{str(workdir)!r} holds no config.json; is it a jaxpe-train workdir?")
    config = from_dict(json.loads(config_path.read_text()))
    task = build_task(config)
    model = build_model(config.model, task.vocab_size, longest_length(task))
    trainer = Trainer(model=model, config=config, seq_len=task.seq_len)
    checkpoints = Checkpoints(workdir / "checkpoints", keep=config.run.keep, best_metric="unused", async_save=False)
    try:
        steps = checkpoints.all_steps()
        if not steps or (step is not None and step not in steps):
            raise ValueError(f"{step=}: no such checkpoint in {workdir / 'checkpoints'} (have {steps})")
        state, _ = checkpoints.restore(step if step is not None else steps[-1], trainer.abstract_state())
    finally:
        checkpoints.close()
    splits = trainer.evaluate(state.params, task.eval_splits())
    result = {"task": config.task.name, "pe": config.model.pe, "seed": config.run.seed, "metric": task.metric,
              "step": int(distributed.to_host(state.step)), "splits": splits}
    table = evaluate.results_markdown([result], metric=task.metric, splits=list(splits),
                                      label_keys=("task", "pe", "seed", "step"))
    if jax.process_index() == 0:
        evaluate.write_json(workdir / "eval.json", result)
        (workdir / "eval.md").write_text(table)
    return {**result, "table": table}
