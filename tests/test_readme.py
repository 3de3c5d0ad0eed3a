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
