"""jaxpe.train.step / loop / experiments / evaluate / checkpoint: the step's maths against NumPy, data parallelism,
end-to-end smoke run, NaN stop, corrupt-checkpoint fallback."""
import json
import logging
import math
import pathlib
import re
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxpe.train.checkpoint import Checkpoints
from jaxpe.train.cli import compare_main, eval_main
from jaxpe.train.config import OptimConfig, build_model, build_task, to_dict
from jaxpe.train.evaluate import compute_metrics, metrics_from_sums
from jaxpe.train.experiments import check_same_run, cpu_name, train_and_evaluate
from jaxpe.train.loop import NonFiniteLossError, TimeLimitReached
from jaxpe.train.step import TrainState, make_optimizer, make_train_step, weighted_loss
from jaxpe.train.trainer import Trainer

from tiny_config import TINY, tiny


def train_losses(workdir: pathlib.Path) -> np.ndarray:
    lines = (workdir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return np.array([r["loss"] for r in map(json.loads, lines) if r["split"] == "train"])


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_weighted_loss_matches_numpy(key):
    logits = jax.random.normal(key, (3, 5, 7))
    targets = np.array(jax.random.randint(jax.random.fold_in(key, 1), (3, 5), 0, 7), np.int32)
    weights = np.array(jax.random.bernoulli(jax.random.fold_in(key, 2), 0.5, (3, 5)), np.float32)
    loss = weighted_loss(lambda params, inputs, k: params)
    total, sums = loss(logits, {"inputs": targets, "targets": targets, "weights": weights}, key)
    correct, count = sums["weight"] - sums["wrong"], sums["weight"]
    lp = np_log_softmax(np.asarray(logits, np.float64))
    nll = -np.take_along_axis(lp, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(total, (nll * weights).sum(), rtol=1e-5)
    np.testing.assert_allclose(correct, ((np.asarray(logits).argmax(-1) == targets) * weights).sum())
    assert count == weights.sum()


def test_eval_sums_and_metrics_match_numpy(key):
    logits = np.array(jax.random.normal(key, (4, 6, 5)))
    targets = np.array(jax.random.randint(jax.random.fold_in(key, 1), (4, 6), 0, 5), np.int32)
    targets[0] = logits[0].argmax(-1)  # row 0 entirely right
    weights = np.zeros((4, 6), np.float32)
    weights[0, 2:] = weights[1, 3] = weights[2, :] = 1.0  # row 3 is padding (no weight)
    m = metrics_from_sums(jax.tree.map(float, compute_metrics(jnp.asarray(logits), targets, weights)))
    wrong = (logits.argmax(-1) != targets) & (weights > 0)
    nll = -np.take_along_axis(np_log_softmax(logits.astype(np.float64)), targets[..., None], -1)[..., 0]
    assert m["sequences"] == 3
    assert m["seq_error"] == pytest.approx(wrong[:3].any(-1).mean())
    assert m["token_error"] == pytest.approx(wrong.sum() / weights.sum())
    assert m["bits_per_byte"] == pytest.approx((nll * weights).sum() / weights.sum() / math.log(2), rel=1e-5)


def test_schedule_warmup_then_cosine():
    """With a constant gradient, Adam's bias-corrected step is exactly lr(t) per coordinate."""
    optim = OptimConfig(learning_rate=0.1, warmup_steps=4, min_lr_ratio=0.1, weight_decay=0.0, clip_norm=1e9,
                        eps=1e-12)  # eps must be > 0; this small it changes no update beyond the tolerance
    total = 12
    tx = make_optimizer(optim, total)
    params = jnp.zeros(3)
    state = tx.init(params)
    for t in range(total):
        updates, state = tx.update(jnp.ones(3), state, params)
        if t < 4:
            expected = 0.1 * t / 4
        else:
            expected = 0.01 + (0.1 - 0.01) * 0.5 * (1 + math.cos(math.pi * (t - 4) / (total - 4)))
        np.testing.assert_allclose(updates, -expected, rtol=1e-5, atol=1e-9)


def test_train_step_accumulation_equals_full_batch(key):
    """grad_accum=1 and 4 give the update of a full-batch weighted-mean loss (computed directly)."""
    vocab, batch, length = 6, 8, 5
    params = {"table": jax.random.normal(key, (vocab, vocab))}
    inputs = jax.random.randint(jax.random.fold_in(key, 1), (batch, length), 0, vocab)
    data = {
        "inputs": inputs, "targets": jnp.roll(inputs, -1, axis=1),
        "weights": jax.random.bernoulli(jax.random.fold_in(key, 2), 0.6, (batch, length)).astype(jnp.float32),
    }
    logits_fn = lambda p, tokens, k: p["table"][tokens]  # noqa: E731 -- a bigram model
    tx = optax.adamw(1e-2)

    def mean_loss(p):
        lp = jax.nn.log_softmax(logits_fn(p, data["inputs"], None))
        nll = -jnp.take_along_axis(lp, data["targets"][..., None], -1)[..., 0]
        return jnp.sum(nll * data["weights"]) / jnp.sum(data["weights"])

    grads = jax.grad(mean_loss)(params)
    updates, _ = tx.update(grads, tx.init(params), params)
    expected = optax.apply_updates(params, updates)
    for accum in (1, 4):
        state = TrainState(params=params, opt_state=tx.init(params), step=jnp.int32(0), rng=key)
        new, metrics = jax.jit(make_train_step(weighted_loss(logits_fn), tx, accum))(state, data)
        chex.assert_trees_all_close(new.params, expected, rtol=1e-5, atol=1e-6)
        assert int(new.step) == 1 and not np.array_equal(new.rng, key)
        np.testing.assert_allclose(metrics["nll"] / metrics["weight"], mean_loss(params), rtol=1e-5)
        assert int(metrics["nonfinite"]) == 0


def test_eight_devices_match_one_device(tmp_path):
    """Data parallel over 8 simulated devices (replicated, then FSDP) follows the 1-device loss curve."""
    steps = ["run.steps=4", "model.dropout=0.1", "model.d_model=32", "model.mlp_dim=128"]
    one = train_and_evaluate(tiny(*steps), tmp_path / "one")
    for fsdp in (False, True):
        eight = train_and_evaluate(tiny(*steps, "run.num_devices=8", f"run.fsdp={fsdp}"), tmp_path / f"{fsdp}")
        np.testing.assert_allclose(train_losses(tmp_path / f"{fsdp}"), train_losses(tmp_path / "one"), rtol=2e-4)
        for split in one["splits"]:
            assert eight["splits"][split]["loss"] == pytest.approx(one["splits"][split]["loss"], rel=2e-4)


def test_fsdp_shards_large_arrays():
    config = tiny("run.num_devices=8", "run.fsdp=true", "model.d_model=32", "model.mlp_dim=128")
    task = build_task(config)
    trainer = Trainer(model=build_model(config.model, task.vocab_size, 16), config=config, seq_len=16)
    specs = [s.spec for s in jax.tree.leaves(trainer.state_sharding.params)]
    assert any("data" in spec for spec in specs) and any("data" not in spec for spec in specs)


def test_cpu_name_reads_the_model_and_the_vector_extensions(tmp_path):
    """The environment names the CPU and the extensions XLA compiles for, in CPU_FEATURES' order; no cpuinfo falls
    back to platform.processor()."""
    import platform

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU @ 2.0GHz\nflags\t\t: fpu fma sse4_2 avx512f avx2 ht\n\n"
                    "processor\t: 1\nmodel name\t: Some CPU @ 2.0GHz\nflags\t\t: fpu fma sse4_2 avx512f avx2 ht\n",
                    encoding="utf-8")
    assert cpu_name(info) == "Some CPU @ 2.0GHz (sse4_2 avx2 fma avx512f)"
    info.write_text("flags : neon\n", encoding="utf-8")
    assert cpu_name(info) == f"{platform.processor()} ()"
    assert cpu_name(tmp_path / "absent") == platform.processor()


def test_a_tiny_run_writes_every_output_and_resumes_at_its_end(tmp_path):
    """A tiny run writes config, metrics, checkpoints, result JSON/Markdown/PNG and resumes when done."""
    config = tiny("run.steps=8", "run.checkpoint_every=4", "run.eval_every=4", "run.progress=true")
    result = train_and_evaluate(config, tmp_path)
    for name in ("config.json", "metrics.jsonl", "result.json", "result.md", "result.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "result.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((tmp_path / "result.json").read_text(encoding="utf-8"))
    assert saved["splits"].keys() == {"valid", "ood_sparse", "ood_dense"}
    assert saved["splits"] == result["splits"] and saved["metric"] == "token_error"
    assert saved["environment"]["cpu"] == cpu_name() and saved["environment"]["jax_version"] == jax.__version__
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, 9))
    assert {r["step"] for r in records if r["split"] == "valid"} == {4, 8}
    table = (tmp_path / "result.md").read_text(encoding="utf-8")
    assert f"{100 * result['splits']['valid']['token_error']:.2f}" in table
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [4, 8]
    again = train_and_evaluate(config, tmp_path)  # a finished run resumes at its end and re-evaluates
    assert again["resumed_from"] == 8 and again["splits"] == result["splits"]


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    """lr = 1e30 after warmup step 1 blows up the weights; the run stops, earlier checkpoints stay good."""
    config = tiny("run.steps=40", "run.checkpoint_every=1", "run.async_checkpoints=false",
                  "optim.learning_rate=1e30", "optim.warmup_steps=20", "optim.clip_norm=1e30")
    with pytest.raises(NonFiniteLossError, match=r"NaN/inf by step (\d+).*Last good checkpoint: step") as info:
        train_and_evaluate(config, tmp_path)
    bad_step = int(info.value.args[0].split("by step ")[1].split(" ")[0])
    task = build_task(config)
    trainer = Trainer(model=build_model(config.model, task.vocab_size, 16), config=config, seq_len=16)
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=2, best_metric="valid/token_error")
    latest = checkpoints.latest_step()
    assert latest is not None and latest < bad_step
    assert f"step {latest} in" in info.value.args[0]
    state, meta = checkpoints.restore(latest, trainer.abstract_state())
    checkpoints.close()
    assert meta["data_position"] == latest == int(state.step)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))


def test_an_update_that_overflows_stops_before_its_state_is_saved(tmp_path):
    """A learning rate near float32's largest (3e38, no warmup) times a weight decay of 10 overflows the first update
    (lr · (adam + 10 · param) > 3.4e38 for |param| > 0.1) while that step's loss and gradient are finite: the NaN/inf
    check of that step stops the run there, with no checkpoint (the step's inf state was saved at step 1 and named
    the last good checkpoint, found only by step 2's loss). A rate past float32's range is refused by the config."""
    config = tiny("run.steps=4", "run.checkpoint_every=1", "run.async_checkpoints=false",
                  "optim.learning_rate=3e38", "optim.weight_decay=10", "optim.warmup_steps=0")
    with pytest.raises(NonFiniteLossError, match=r"parameters became NaN/inf by step 1 .*Last good checkpoint: none"):
        train_and_evaluate(config, tmp_path)
    assert not list((tmp_path / "checkpoints").iterdir())


def test_a_run_stopped_by_its_time_limit_between_records_resumes_to_the_uninterrupted_records(tmp_path):
    """A time limit that has passed stops each call after one step (one step a dispatch) with a checkpoint there.
    The stop wrote a train record of its own at steps 1, 2, 4, 5 (log_every=3), and the resumed run's next record
    averaged only the steps after it: the log differed from the uninterrupted run's. Now the sums since the last
    record go into the checkpoint, and the run cut five times logs the uninterrupted run's records."""
    config = tiny("run.steps=6", "run.log_every=3", "run.checkpoint_every=6", "run.async_checkpoints=false")
    whole = train_and_evaluate(config, tmp_path / "whole")
    stops = []
    for _ in range(5):
        with pytest.raises(TimeLimitReached) as stop:
            train_and_evaluate(config, tmp_path / "cut", time_limit=1e-9)
        stops.append(stop.value.step)
    assert stops == [1, 2, 3, 4, 5]
    cut = train_and_evaluate(config, tmp_path / "cut")
    assert cut["resumed_from"] == 5

    def train_records(workdir: pathlib.Path) -> list[tuple[int, float, float]]:
        lines = (workdir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
        return [(r["step"], r["loss"], r["accuracy"]) for r in map(json.loads, lines) if r["split"] == "train"]

    assert [r[0] for r in train_records(tmp_path / "cut")] == [r[0] for r in train_records(tmp_path / "whole")] == [3, 6]
    np.testing.assert_allclose(train_records(tmp_path / "cut"), train_records(tmp_path / "whole"), rtol=1e-6)
    for split, metrics in whole["splits"].items():
        assert cut["splits"][split] == pytest.approx(metrics, rel=1e-6), split


def test_corrupt_latest_checkpoint_falls_back(tmp_path, caplog):
    config = tiny("run.steps=6", "run.checkpoint_every=3", "run.keep=3")
    first = train_and_evaluate(config, tmp_path / "run")
    steps = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert steps == [3, 6]
    for path in (tmp_path / "run" / "checkpoints" / "6" / "state").rglob("*"):
        if path.is_file():
            path.write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING, logger="jaxpe.train.checkpoint"):
        again = train_and_evaluate(config, tmp_path / "run")
    assert again["resumed_from"] == 3
    assert [p["step"] for p in again["checkpoint_problems"]] == [6]
    assert "step 6" in caplog.text and "unreadable" in caplog.text
    assert (tmp_path / "run" / "corrupt_checkpoints" / "6").is_dir()
    # steps 4..6 replayed from step 3's state give the first run's result again
    for split, values in first["splits"].items():
        assert again["splits"][split] == pytest.approx(values)
    # with no readable checkpoint left, the run says it trains from the start, and does
    for step in (3, 6):
        for path in (tmp_path / "run" / "checkpoints" / str(step) / "state").rglob("*"):
            if path.is_file():
                path.write_bytes(b"garbage")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxpe.train"):
        restarted = train_and_evaluate(config, tmp_path / "run")
    assert restarted["resumed_from"] is None
    assert f"no readable checkpoint is left in {tmp_path / 'run' / 'checkpoints'}: training from step 0" in caplog.text
    for split, values in first["splits"].items():
        assert restarted["splits"][split] == pytest.approx(values)
    shutil.rmtree(tmp_path / "run")


def test_cli_compare_then_eval(tmp_path, capsys):
    """jaxpe-compare: encodings x seeds -> JSON/Markdown/PNG and a printed table; jaxpe-eval re-scores a run."""
    args = ["--task", "flipflop", "--pe", "rope,learned", "--seeds", "0", "--workdir", str(tmp_path),
            *TINY, "run.steps=3", "run.checkpoint_every=3"]
    assert compare_main(args) == 0
    printed = capsys.readouterr().out
    comparison = json.loads((tmp_path / "compare.json").read_text(encoding="utf-8"))
    assert [row["pe"] for row in comparison["rows"]] == ["rope", "learned"]
    for row, run in zip(comparison["rows"], comparison["runs"]):
        saved = json.loads((tmp_path / row["pe"] / "seed0" / "result.json").read_text(encoding="utf-8"))
        assert run["splits"] == saved["splits"]
        error = saved["splits"]["ood_dense"]["token_error"]
        assert row["splits"]["ood_dense"]["token_error"] == pytest.approx(error)  # one seed: the mean is the run
        assert f"| {row['pe']} | 0 | " in printed and f"{100 * error:.2f}" in printed
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert "ood_sparse token_error" in (tmp_path / "compare.md").read_text(encoding="utf-8")

    assert eval_main(["--workdir", str(tmp_path / "rope" / "seed0")]) == 0
    evaluated = json.loads((tmp_path / "rope" / "seed0" / "eval.json").read_text(encoding="utf-8"))
    assert evaluated["step"] == 3
    for split, values in comparison["runs"][0]["splits"].items():
        assert evaluated["splits"][split] == pytest.approx(values, rel=1e-6)
    with pytest.raises(SystemExit):
        compare_main(["--workdir", str(tmp_path), "model.layers=2"])
    assert "model.layers" in capsys.readouterr().err

    # A wider sweep over the same workdir reads the finished runs back (their files untouched) and trains the new one.
    stamps = {pe: (tmp_path / pe / "seed0" / "metrics.jsonl").stat().st_mtime_ns for pe in ("rope", "learned")}
    assert compare_main([*args[:3], "rope,learned,alibi", *args[4:]]) == 0
    wider = json.loads((tmp_path / "compare.json").read_text(encoding="utf-8"))
    assert [row["pe"] for row in wider["rows"]] == ["rope", "learned", "alibi"]
    assert wider["splits"] == comparison["splits"] == ["valid", "ood_sparse", "ood_dense"]  # the task's order
    assert wider["runs"][:2] == comparison["runs"]
    assert {pe: (tmp_path / pe / "seed0" / "metrics.jsonl").stat().st_mtime_ns for pe in stamps} == stamps
    result = json.loads((tmp_path / "alibi" / "seed0" / "result.json").read_text(encoding="utf-8"))
    assert result["encoding"]["name"] == "alibi"


def test_resuming_with_another_config_is_refused(tmp_path):
    """A checkpointed workdir belongs to one experiment: changing the model, data, optimizer or seed on resume is
    an error naming the field; the run's length and bookkeeping may change (here: train 4 more steps)."""
    train_and_evaluate(tiny("run.steps=4", "run.checkpoint_every=4"), tmp_path)
    for override, message in (("model.d_model=32", "model.d_model: 16 -> 32"), ("run.seed=3", "run.seed: 0 -> 3"),
                              ("model.pe_options.npos=8", "model.pe_options.npos: '<unset>' -> 8")):
        with pytest.raises(ValueError, match=re.escape(message)):
            train_and_evaluate(tiny("run.steps=4", "run.checkpoint_every=4", override, pe="cope"), tmp_path)
    result = train_and_evaluate(tiny("run.steps=8", "run.checkpoint_every=4", "run.log_every=2"), tmp_path)
    assert result["resumed_from"] == 4
    # Without checkpoints too, a workdir holds one run: another config is refused, the same one starts afresh.
    train_and_evaluate(tiny("run.steps=2", "run.checkpoint_every=0"), tmp_path / "fresh")
    with pytest.raises(ValueError, match=re.escape("model.d_model: 16 -> 32")):
        train_and_evaluate(tiny("run.steps=2", "run.checkpoint_every=0", "model.d_model=32"), tmp_path / "fresh")
    fresh = train_and_evaluate(tiny("run.steps=2", "run.checkpoint_every=0"), tmp_path / "fresh")
    assert fresh["resumed_from"] is None and fresh["config"]["model"]["d_model"] == 16
    assert json.loads((tmp_path / "result.json").read_text(encoding="utf-8"))["encoding"] == {
        "name": "rope", "theta": 10000.0, "rotary_dim": None, "interleaved": False, "scaling": None}


def test_a_workdir_saved_before_new_config_fields_still_resumes(tmp_path):
    """A config.json written before a field existed (here model.vocab_size, run.tensorboard) reads back with the
    field's default: no difference for the workdir guard; a real difference still is one."""
    config = tiny("run.checkpoint_every=4")
    saved = to_dict(config)
    del saved["model"]["vocab_size"], saved["run"]["tensorboard"]
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(saved), encoding="utf-8")
    check_same_run(tmp_path, config, build_task(config))
    with pytest.raises(ValueError, match=re.escape("model.d_model: 16 -> 32")):
        check_same_run(tmp_path, tiny("run.checkpoint_every=4", "model.d_model=32"), build_task(config))


def test_bfloat16_compute_trains_like_float32(tmp_path):
    """model.dtype=bfloat16: parameters and optimizer state stay float32, the loss curve follows float32's
    within bf16 rounding but is not identical to it (the compute really ran in bf16), and the loss falls."""
    steps = ["run.steps=12", "run.checkpoint_every=12", "run.async_checkpoints=false"]
    f32 = train_and_evaluate(tiny(*steps), tmp_path / "f32")
    bf16_config = tiny(*steps, "model.dtype=bfloat16")
    bf16 = train_and_evaluate(bf16_config, tmp_path / "bf16")
    loss32, loss16 = train_losses(tmp_path / "f32"), train_losses(tmp_path / "bf16")
    np.testing.assert_allclose(loss16, loss32, rtol=3e-2)
    assert not np.array_equal(loss16, loss32)
    assert loss16[-3:].mean() < loss16[:3].mean()
    for split, metrics in f32["splits"].items():
        assert bf16["splits"][split]["loss"] == pytest.approx(metrics["loss"], rel=3e-2)
    task = build_task(bf16_config)
    trainer = Trainer(model=build_model(bf16_config.model, task.vocab_size, 16), config=bf16_config, seq_len=16)
    checkpoints = Checkpoints(tmp_path / "bf16" / "checkpoints", keep=1, best_metric="unused", async_save=False)
    try:
        state, _ = checkpoints.restore(12, trainer.abstract_state())
    finally:
        checkpoints.close()
    assert {leaf.dtype for leaf in jax.tree.leaves((state.params, state.opt_state)) if hasattr(leaf, "dtype")
            and jnp.issubdtype(leaf.dtype, jnp.floating)} == {jnp.dtype(jnp.float32)}
