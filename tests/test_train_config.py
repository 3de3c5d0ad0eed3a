"""jaxpe.train.config: presets, key=value overrides, bad input; the paper preset's model by eval_shape."""
import dataclasses

import jax
import numpy as np
import pytest

from jaxpe.train.config import TrainConfig, apply_overrides, build_config, from_dict, load_preset, preset_names, to_dict
from jaxpe.train.loop import Trainer, build_model


def test_overrides_reach_nested_fields():
    config = build_config(
        task="counting",
        pe="cope",
        overrides=["model.num_layers=2", "task.nvars=3", "model.pe_options.npos=32", "optim.learning_rate=3e-4",
                   "model.num_kv_heads=none", "run.fsdp=true", "run.eval_splits=valid,test"],
    )
    assert config.task.name == "counting" and dict(config.task.options) == {"nvars": 3}
    assert config.model.num_layers == 2 and config.model.pe == "cope"
    assert dict(config.model.pe_options) == {"npos": 32}
    assert config.optim.learning_rate == pytest.approx(3e-4)
    assert config.model.num_kv_heads is None and config.run.fsdp is True
    assert config.run.eval_splits == ("valid", "test")
    assert from_dict(to_dict(config)) == config


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.num_layers=abc", "model.num_layers"),
        ("model.layers=2", "model.layers"),
        ("modle.num_layers=2", "modle"),
        ("run.fsdp=maybe", "run.fsdp"),
        ("optim.learning_rate=fast", "optim.learning_rate"),
        ("model=3", "model"),
        ("model.num_layers.x=1", "model.num_layers.x"),
    ],
)
def test_bad_override_names_the_key(override, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        build_config(overrides=[override])


def test_malformed_override_and_invalid_values():
    with pytest.raises(ValueError, match="key=value"):
        apply_overrides(TrainConfig(), ["model.num_layers"])
    with pytest.raises(ValueError, match="grad_accum"):
        build_config(overrides=["optim.batch_size=10", "optim.grad_accum=3"])
    with pytest.raises(ValueError, match="steps"):
        build_config(overrides=["run.steps=0"])
    with pytest.raises(ValueError, match="preset"):
        build_config(preset="no-such-preset")


def test_unknown_task_option_names_the_key():
    from jaxpe.train.loop import build_task

    with pytest.raises(ValueError, match="nvarz"):
        build_task(build_config(task="counting", overrides=["task.nvarz=3"]))


def test_presets_apply_in_order():
    assert {"paper", "cpu-small"} <= set(preset_names())
    paper = build_config(preset="paper", task="counting")
    raw = load_preset("paper")
    assert paper.model.d_model == raw["model"]["d_model"] == 256
    assert paper.model.prenorm is False and paper.optim.learning_rate == pytest.approx(7e-5)
    assert paper.optim.batch_size == 64 and dict(paper.task.options)["max_steps"] == 512
    # 100 epochs of 10k programs at batch 64
    assert paper.run.steps == int(np.ceil(100 * 10_000 / 64))
    later = build_config(preset="paper", task="counting", overrides=["model.d_model=128", "task.max_steps=64"])
    assert later.model.d_model == 128 and dict(later.task.options)["max_steps"] == 64
    small = build_config(preset="cpu-small")
    assert small.task.name == "selective_copy" and dict(small.task.options)["n_blanks_sparse"] == 32


def test_paper_model_shapes_without_compute():
    """The paper's full-size model and optimizer state, by jax.eval_shape only."""
    config = build_config(preset="paper", task="counting", pe="cope", overrides=["run.num_devices=1"])
    vocab = 40
    trainer = Trainer(model=build_model(config.model, vocab, 1024), config=config, seq_len=512)
    state = jax.eval_shape(trainer.init_state)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    d, layers = 256, 4
    # per block: q, k, v, o (4 d^2) + MLP d -> 4d -> d (8 d^2); the tied embedding V x d;
    # CoPE's position table per layer, npos = max_len + 1 rows of head dim d / 4
    core = layers * 12 * d * d + vocab * d + layers * (1024 + 1) * (d // 4)
    assert core <= n_params <= core + layers * 16 * d, n_params  # plus biases and norm scales
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.shape and x.dtype == np.float32]
    assert sum(int(np.prod(x.shape)) for x in moments) == 2 * n_params  # Adam mu and nu
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(state.params))
    assert dataclasses.asdict(config.model)["num_layers"] == layers


def test_preset_task_and_encoding_sections_apply_only_when_chosen(tmp_path, monkeypatch):
    import json

    import jaxpe.train.config

    (tmp_path / "mine.json").write_text(json.dumps({
        "model": {"d_model": 48}, "run": {"steps": 7},
        "tasks": {"counting": {"nvars": 5}, "flipflop": {"seq_len": 32}},
        "encodings": {"cope": {"npos": 17}},
    }))
    monkeypatch.setattr(jaxpe.train.config, "PRESET_DIR", tmp_path)
    cope = build_config(preset="mine", task="counting", pe="cope")
    rope = build_config(preset="mine", task="flipflop", pe="rope", overrides=["model.pe_options.theta=500.0"])
    assert cope.model.d_model == rope.model.d_model == 48 and cope.run.steps == 7
    assert dict(cope.task.options) == {"nvars": 5} and dict(rope.task.options) == {"seq_len": 32}
    assert dict(cope.model.pe_options) == {"npos": 17} and dict(rope.model.pe_options) == {"theta": 500.0}
