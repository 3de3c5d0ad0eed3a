"""The training package as a user running their own runs meets it: size checks of every layer pattern, a corpus of
one's own files, resuming, hostile config values; each a case that once failed."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxpe.train import experiments
from tiny_config import tiny


def test_state_size_counts_every_layer_pattern_exactly():
    """A pattern of period 3 (not 1, 2 or 4) with a table of its own in every third layer: state_size equals the
    count of the whole model's parameters traced in full."""
    overrides = ["model.num_layers=14", "model.layer_pe=cope,none,none", "model.pe_options.shared_table=false"]
    _, model = experiments.validate_config(tiny(*overrides, pe="cope"))
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
    count = sum(leaf.size for leaf in jax.tree.leaves(shapes))
    assert experiments.state_size(model) == (count, 3 * 4 * count)  # float32 parameters and two moments
