"""Logical axis names of jaxpe's parameters and the rules that map them onto a device mesh.

Every parameter is created through `partitioned`, so `model.init` returns `nn.LogicallyPartitioned` boxes:
`nn.get_partition_spec(abstract_params)` gives each parameter's logical spec, and
`nn.logical_to_mesh_sharding(specs, mesh, rules)` turns it into shardings for a mesh (see docs/layers.md, "Sharding").
`flax.linen.meta.unbox(params)` gives plain arrays; `apply` takes either form, and so does a function
exported with `jax.export` (the boxes serialize with their names). Names: "vocab", "embed" (d_model),
"heads" (query heads), "kv_heads", "head_dim", "mlp" (MLP hidden), "positions" (rows of a position table), "gates"
(a per-head gate network's outputs).

Stacked layers: `nn.scan` / `nn.vmap` over jaxpe layers with `variable_axes={"params": 0}` need no
`metadata_params`: the stacked axis gets no logical name (it is not sharded) unless
`metadata_params={nn.PARTITION_NAME: "layers"}` names one (then add a rule for "layers").
"""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any, Callable

import flax.linen as nn
import jax

# Tensor parallel over heads and the MLP hidden width on a mesh axis named "model", data parallel over "data".
# kv_heads must divide by the "model" axis size; for MQA (one key/value head) map "kv_heads" to None.
TENSOR_PARALLEL_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"), ("heads", "model"), ("kv_heads", "model"), ("mlp", "model"), ("gates", "model"),
    ("vocab", None), ("embed", None), ("head_dim", None), ("positions", None),
)

RESTORE_FIX = ("restore with a target (the boxed abstract parameters, e.g. jax.eval_shape(model.init, key, x)"
               "['params'], as orbax's StandardRestore(target)), or save flax.linen.meta.unbox(params) instead of "
               "the boxes")


class LogicalAxes(nn.LogicallyPartitioned):
    """`nn.LogicallyPartitioned` whose axis added by a lifted transform (`nn.scan`, `nn.vmap` over layers) has no
    logical name unless the transform's `metadata_params` give one under `nn.PARTITION_NAME`."""

    def add_axis(self, index: int, params: dict[Any, Any]) -> LogicalAxes:
        return super().add_axis(index, {nn.PARTITION_NAME: None, **params})

    def remove_axis(self, index: int, params: dict[Any, Any]) -> LogicalAxes:
        return super().remove_axis(index, {nn.PARTITION_NAME: None, **params})


def _serialize_logical_axes(aux: tuple[Any, ...]) -> bytes:
    """The box's logical names as JSON for `jax.export`; a box bound to a mesh or rules has no portable form."""
    names, mesh, rules = aux
    if mesh is not None or rules is not None:
        raise ValueError("a parameter box bound to a mesh or rules cannot be serialized with jax.export: export "
                         "with flax.linen.meta.unbox(params)")
    return json.dumps(list(names)).encode()


jax.export.register_pytree_node_serialization(
    LogicalAxes, serialized_name="jaxpe.sharding.LogicalAxes", serialize_auxdata=_serialize_logical_axes,
    deserialize_auxdata=lambda data: (tuple(json.loads(data)), None, None))


def partitioned(init: Callable[..., Any], *names: str | None) -> Callable[..., Any]:
    """`init` whose parameter carries the logical axis names `names` (one per axis), boxed as `LogicalAxes`."""

    @functools.wraps(init)
    def boxed(*args: Any, **kwargs: Any) -> LogicalAxes:
        return LogicalAxes(init(*args, **kwargs), names)

    return boxed


def _is_restored_box(node: Any) -> bool:
    """A {'value': array} dict: what an orbax restore without a target makes of a boxed parameter."""
    return isinstance(node, Mapping) and set(node) == {"value"} and hasattr(node["value"], "shape")


def check_restored_params(params: Any) -> None:
    """ValueError naming the fix when `params` holds {'value': array} dicts where arrays belong: boxed parameters
    (`nn.LogicallyPartitioned`) restored by orbax without a target."""
    for path, node in jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_restored_box):
        if _is_restored_box(node):
            raise ValueError(f"params{jax.tree_util.keystr(path)} is a dict {{'value': array}}, not an array: boxed "
                             f"parameters (nn.LogicallyPartitioned) restored by orbax without a target; {RESTORE_FIX}")


def unbox_params(params: Any) -> Any:
    """Plain arrays from parameters given as arrays, `nn.LogicallyPartitioned` boxes, or the {'value': array} dicts
    that an orbax restore without a target makes of boxes (use where the expected tree tells these apart)."""
    params = nn.meta.unbox(params)
    return jax.tree.map(lambda node: node["value"] if _is_restored_box(node) else node, params,
                        is_leaf=_is_restored_box)
