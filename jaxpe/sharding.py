"""Logical axis names of jaxpe's parameters and the rules that map them onto a device mesh.

Every parameter is created with `nn.with_logical_partitioning`, so `model.init` returns `nn.LogicallyPartitioned`
boxes: `nn.get_partition_spec(abstract_params)` gives each parameter's logical spec, and
`nn.logical_to_mesh_sharding(specs, mesh, rules)` turns it into shardings for a mesh (see README "Sharding").
`nn.meta.unbox(params)` gives plain arrays. Names: "vocab", "embed" (d_model), "heads" (query heads), "kv_heads",
"head_dim", "mlp" (MLP hidden), "positions" (rows of a position table), "gates" (a per-head gate network's outputs).
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn

# Tensor parallel over heads and the MLP hidden width on a mesh axis named "model", data parallel over "data".
# kv_heads must divide by the "model" axis size; for MQA (one key/value head) map "kv_heads" to None.
TENSOR_PARALLEL_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"), ("heads", "model"), ("kv_heads", "model"), ("mlp", "model"), ("gates", "model"),
    ("vocab", None), ("embed", None), ("head_dim", None), ("positions", None),
)


def partitioned(init: Callable[..., Any], *names: str | None) -> Callable[..., Any]:
    """`init` whose parameter carries the logical axis names `names` (one per axis)."""
    return nn.with_logical_partitioning(init, names)
