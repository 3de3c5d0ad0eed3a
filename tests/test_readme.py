"""The README's layer example runs as written."""
import pathlib
import re

import jax.numpy as jnp
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_layer_example_runs():
    text = README.read_text()
    block = re.search(r"<!-- readme-example .*?-->\s*```python\n(.*?)```", text, re.S).group(1)
    assert len(block.strip().splitlines()) <= 14
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    x, y = scope["x"], scope["y"]
    assert y.shape == (2, 32, 64) and y.dtype == jnp.float32
    assert not np.allclose(x, y)
    assert "pos_emb" in scope["params"]["params"]["Attention_0"]["pe"]


def test_readme_nnx_example_runs():
    """The NNX section's blocks run in order, as a reader pastes them."""
    blocks = re.findall(r"<!-- readme-example-nnx.*?-->\s*```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 2 and all(len(block.strip().splitlines()) <= 16 for block in blocks)
    scope: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), scope)
    assert scope["y"].shape == (2, 32, 64)
    assert np.isfinite(scope["loss"]) and scope["model"].deterministic
    out, tokens = scope["out"], scope["tokens"]
    assert out.shape == (8, 16)
    np.testing.assert_array_equal(out[:, :8], tokens[:, :8])


def test_readme_real_model_examples_run():
    """The "Layers for real models" blocks run in order, as a reader pastes them."""
    blocks = re.findall(r"<!-- readme-example-real.*?-->\s*```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 5
    scope: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), scope)
    packed, padded, out = scope["packed"], scope["padded"], scope["out"]
    assert packed.shape == padded.shape == (2, 12, 32) and np.isfinite(packed).all()
    assert out.shape == (2, 13)
    np.testing.assert_allclose(padded[1, :9], scope["model"].apply({"params": scope["params"]},
                                                                    scope["tokens"][1:, :9])[0], atol=2e-5)
    assert scope["o"].shape == (1, 256, 4, 32)
    assert scope["rope"].scaling and scope["phi2_like"].rotary_dim == 32
    assert scope["x_cope"].talking_heads and scope["corope"].rotary_dim == 16
    assert scope["sharded"]["embed"]["embedding"].shape == (32, 64)
