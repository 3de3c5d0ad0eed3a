"""Batches padded to their longest sequence's bucket (run.pad_to, run.pad_multiple) score exactly as batches padded to
the full block: per example, in a train step, in evaluation and over a whole run, resumed or not."""
import json
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpe.train.config import build_config, build_model, build_task, longest_length
from jaxpe.train.evaluate import compute_metrics
from jaxpe.train.experiments import train_and_evaluate
from jaxpe.train.tasks import make_task
from jaxpe.train.tasks.base import Split, bucket_length, planned_lengths, scored_lengths, trim_batch
from jaxpe.train.trainer import Trainer

COUNTING = [
    "task.max_steps=8", "task.seq_len=32", "task.n_train=64", "task.n_valid=40", "task.n_test=24",
    "model.d_model=16", "model.num_layers=1", "model.num_heads=2", "model.dropout=0.0", "optim.batch_size=16",
    "optim.warmup_steps=2", "optim.learning_rate=3e-3", "run.log_every=1", "run.eval_every=0",
    "run.checkpoint_every=0", "run.eval_batch_size=16", "run.progress=false", "run.num_devices=1",
    "run.pad_multiple=8",
]


def counting(*overrides: str, pe: str = "cope"):
    """Counting programs of 3..8 statements (9..~30 tokens) in 32-token blocks, a one-layer model, no dropout."""
    return build_config(task="counting", pe=pe, overrides=[*COUNTING, *overrides])


def make_trainer(config) -> tuple[Trainer, object]:
    task = build_task(config)
    model = build_model(config.model, task.vocab_size, longest_length(task))
    return Trainer(model=model, config=config, seq_len=task.seq_len), task


def records(workdir: pathlib.Path) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "train"]


@pytest.mark.parametrize("longest, pad_to, multiple, expected", [
    (0, "multiple", 16, 16), (1, "multiple", 16, 16), (16, "multiple", 16, 16), (17, "multiple", 16, 32),
    (78, "multiple", 16, 80), (127, "multiple", 16, 128), (128, "multiple", 16, 128), (100, "multiple", 48, 128),
    (17, "pow2", 16, 32), (33, "pow2", 16, 64), (78, "pow2", 16, 128), (5, "pow2", 16, 16), (100, "pow2", 1, 128),
    (3, "block", 16, 128), (128, "block", 1, 128),
])
def test_bucket_length(longest, pad_to, multiple, expected):
    assert bucket_length(longest, 128, pad_to=pad_to, multiple=multiple) == expected


def test_bucket_length_refuses_unknown_settings():
    with pytest.raises(ValueError, match="pad_to='longest'"):
        bucket_length(3, 8, pad_to="longest", multiple=4)
    with pytest.raises(ValueError, match="multiple=0"):
        bucket_length(3, 8, pad_to="multiple", multiple=0)
    with pytest.raises(ValueError, match="run.pad_to='pow3'"):
        build_config(overrides=["run.pad_to=pow3"])
    with pytest.raises(ValueError, match="run.pad_multiple=0"):
        build_config(overrides=["run.pad_multiple=0"])
    assert build_config(overrides=["run.pad_to=pow2", "run.pad_multiple=8"]).run.pad_to == "pow2"
    with pytest.raises(ValueError, match="run.compile_ahead='yes' must be one of auto, on, off"):
        build_config(overrides=["run.compile_ahead=yes"])


def test_scored_lengths_and_trim():
    weights = np.array([[0, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 0], [0, 0, 0, 0, 1]], np.float32)
    np.testing.assert_array_equal(scored_lengths(weights), [2, 0, 4, 5])
    batch = {"inputs": np.arange(20).reshape(4, 5), "weights": weights}
    cut = trim_batch(batch, 3)
    np.testing.assert_array_equal(cut["inputs"], batch["inputs"][:, :3])
    assert cut["weights"].shape == (4, 3) and cut["inputs"].flags.c_contiguous


def test_counting_scored_length_is_the_unpadded_length():
    """The answer ends a counting sequence: its scored prefix is every input up to the one that predicts the answer's
    last token (the answer as an input predicts padding)."""
    task = make_task("counting", max_steps=8, seq_len=32, n_train=64, n_valid=8, n_test=8)
    batch = task.train_batch(0, 64)
    np.testing.assert_array_equal(scored_lengths(batch["weights"]), (batch["inputs"] != 0).sum(axis=1) - 1)
    assert scored_lengths(batch["weights"]).max() < 32  # padding to be cut
    for name in ("flipflop", "selective_copy"):  # every sequence has the split's full length: nothing to cut
        other = make_task(name).train_batch(0, 4)
        np.testing.assert_array_equal(scored_lengths(other["weights"]), other["inputs"].shape[1])


@pytest.mark.parametrize("pe", ["cope", "learned"])
def test_a_bucketed_batch_scores_and_trains_like_the_full_block(pe):
    """Per example, the metrics of the batch cut to its bucket equal those of the batch padded to the block (causal
    attention: padding on the right never changes an earlier token); one train step gives the same update."""
    trainer, task = make_trainer(counting(pe=pe))
    batch = task.train_batch(0, 16)
    cut = trainer.pad(batch)
    assert cut["inputs"].shape == (16, 16) and batch["inputs"].shape == (16, 32)
    assert trainer.batch_lengths == {"train": {16}, "eval": set()}
    params = trainer.init_state().params

    @jax.jit
    def per_example(b):
        logits = trainer.model.apply({"params": params}, jnp.asarray(b["inputs"]), deterministic=True)  # [B, L, V]
        return jax.vmap(lambda lg, t, w: compute_metrics(lg[None], t[None], w[None]))(
            logits, jnp.asarray(b["targets"]), jnp.asarray(b["weights"]))  # each [B]

    full, short = per_example(batch), per_example(cut)
    for name in ("wrong", "weight", "seq_wrong", "seqs"):
        np.testing.assert_array_equal(short[name], full[name])
    np.testing.assert_allclose(short["nll"], full["nll"], rtol=1e-5)

    state_full, metrics_full = trainer.train_step(trainer.init_state(), trainer.put(batch))
    state_cut, metrics_cut = trainer.train_step(trainer.init_state(), trainer.put(cut))
    chex.assert_trees_all_close(state_cut.params, state_full.params, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(metrics_cut, metrics_full, rtol=1e-5)


def test_bucketed_evaluation_equals_the_full_block():
    """Evaluation sorts a split by length and cuts each batch: the same metrics, fewer and shorter rows computed."""
    bucketed, task = make_trainer(counting())
    block, _ = make_trainer(counting("run.pad_to=block"))
    params = bucketed.init_state().params
    splits = task.eval_splits()
    ours, theirs = bucketed.evaluate(params, splits), block.evaluate(params, splits)
    for name in splits:
        for metric in ("seq_error", "token_error", "sequences"):
            assert ours[name][metric] == theirs[name][metric]
        assert ours[name]["loss"] == pytest.approx(theirs[name]["loss"], rel=1e-5)
    assert bucketed.batch_lengths["eval"] <= {8, 16, 24, 32, 40, 48, 56, 64}  # len_x2 is 64 long
    assert block.batch_lengths["eval"] == set()


@pytest.mark.parametrize("own, expected", [
    ([48] * 492 + [64] * 8, [48] * 492 + [64] * 8),  # cpu-small counting: the rare length is the longest
    ([512] * 1995 + [480, 496, 480, 496, 496], [512] * 2000),  # the paper preset: rare shorter ones move up
    ([16, 32, 16, 48], [16, 32, 16, 48]),  # every length a quarter or more
    ([16] * 20 + [24] + [32] * 20, [16] * 20 + [32] + [32] * 20),  # 1 in 41 < 1/8: to the next kept one
    ([40] * 3 + [8] * 30, [40] * 3 + [8] * 30),  # 3 in 33 < 1/8, but the longest has nowhere to go
    ([], []),
])
def test_planned_lengths(own, expected):
    assert planned_lengths(own).tolist() == expected


def test_evaluation_runs_a_rare_batch_length_at_a_longer_one():
    """A split whose batches need 8 (8 batches), 16 (1) and 32 (8) tokens compiles two eval steps, not three,
    and scores exactly as the full block does."""
    bucketed, _ = make_trainer(counting("run.eval_batch_size=4"))
    block, _ = make_trainer(counting("run.eval_batch_size=4", "run.pad_to=block"))
    rng = np.random.default_rng(0)
    scored = np.repeat([8] * 8 + [16] + [32] * 8, 4)  # 17 batches of 4 (sorted by length, as evaluation sorts)
    weights = (np.arange(32)[None, :] < scored[:, None]).astype(np.float32)
    tokens = rng.integers(1, 10, size=(scored.size, 32)).astype(np.int32)
    split = Split(name="made", inputs=tokens, targets=np.roll(tokens, -1, axis=1), weights=weights)
    params = bucketed.init_state().params
    ours, theirs = bucketed.evaluate(params, {"made": split}), block.evaluate(params, {"made": split})
    assert bucketed.batch_lengths["eval"] == {8, 32}
    for metric in ("seq_error", "token_error", "sequences"):
        assert ours["made"][metric] == theirs["made"][metric]
    assert ours["made"]["loss"] == pytest.approx(theirs["made"]["loss"], rel=1e-5)


def test_bucketed_runs_match_and_resume(tmp_path):
    """A run with bucketing follows the block-padded run's losses and results; stopped at a checkpoint and resumed,
    it reproduces its uninterrupted self (the data position is the step, whatever the padding). The log counts real
    (unpadded) tokens beside the padded ones."""
    block = train_and_evaluate(counting("run.steps=6", "run.pad_to=block"), tmp_path / "block")
    whole = train_and_evaluate(counting("run.steps=6"), tmp_path / "whole")
    train_and_evaluate(counting("run.steps=3", "run.checkpoint_every=3"), tmp_path / "resumed")
    resumed = train_and_evaluate(counting("run.steps=6", "run.checkpoint_every=3"), tmp_path / "resumed")
    assert resumed["resumed_from"] == 3
    np.testing.assert_allclose([r["loss"] for r in records(tmp_path / "resumed")],
                               [r["loss"] for r in records(tmp_path / "whole")], rtol=1e-6)
    np.testing.assert_allclose([r["loss"] for r in records(tmp_path / "whole")],
                               [r["loss"] for r in records(tmp_path / "block")], rtol=1e-4)
    for name, values in whole["splits"].items():
        assert resumed["splits"][name] == pytest.approx(values, rel=1e-6)
        assert block["splits"][name] == pytest.approx(values, rel=1e-4)
    for record in records(tmp_path / "block"):  # padded to 32: fewer than half the tokens are real
        assert 0 < record["real_tokens_per_s"] < 0.7 * record["tokens_per_s"]
    for record in records(tmp_path / "whole"):  # padded to 16 or 24
        assert 0 < record["real_tokens_per_s"] <= record["tokens_per_s"]


def test_positions_that_read_the_padded_length_keep_the_full_block(caplog):
    """RoPE with dynamic NTK scaling reads the batch's length: cutting padding would change its scores."""
    scaling = ["model.pe_options.scaling.rope_type=dynamic", "model.pe_options.scaling.factor=2.0",
               "model.pe_options.scaling.original_max_position_embeddings=8"]
    trainer, task = make_trainer(counting(*scaling, pe="rope"))
    assert trainer.pad_to == "block" and "dynamic NTK" in caplog.text
    batch = task.train_batch(0, 16)
    assert trainer.pad(batch)["inputs"].shape == batch["inputs"].shape
    assert make_trainer(counting(pe="rope"))[0].pad_to == "multiple"
