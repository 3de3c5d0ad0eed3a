"""Data parallelism over a `jax.sharding.Mesh` and multi-host start-up.

One mesh axis, "data". The global batch is sharded along it; parameters and optimizer state
are replicated, or (FSDP-style, `run.fsdp=true`) sharded along the largest dimension that
the device count divides. Every process feeds only its own slice of the global batch.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"
_FSDP_MIN_SIZE = 2**12  # smaller arrays stay replicated: sharding them costs more than it saves


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """Joins a multi-process run; arguments default to $JAXPE_COORDINATOR, $JAXPE_NUM_PROCESSES,
    $JAXPE_PROCESS_ID. With one process (the default) nothing happens.

    CPU collectives between processes use gloo (jax's default CPU implementation; set
    explicitly so that an older default cannot silently leave processes unconnected).
    """
    coordinator = coordinator or os.environ.get("JAXPE_COORDINATOR")
    num_processes = num_processes or int(os.environ.get("JAXPE_NUM_PROCESSES", "1"))
    if process_id is None:
        process_id = int(os.environ.get("JAXPE_PROCESS_ID", "0"))
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"{num_processes=} must be >= 1 and {process_id=} in [0, num_processes)")
    if num_processes == 1:
        return
    if not coordinator:
        raise ValueError(f"{coordinator=} (host:port of process 0) is needed with {num_processes=}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def make_mesh(num_devices: int = 0) -> Mesh:
    """A 1-D ("data",) mesh over the first `num_devices` devices (0 = all, of every process)."""
    devices = jax.devices()
    if num_devices == 0:
        num_devices = len(devices)
    if not 1 <= num_devices <= len(devices):
        raise ValueError(f"{num_devices=} must be in [1, {len(devices)}] (the devices present)")
    if num_devices != len(devices) and jax.process_count() > 1:
        raise ValueError(f"{num_devices=} must be 0 (all devices) in a multi-process run")
    return Mesh(np.asarray(devices[:num_devices]), (DATA_AXIS,))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over "data"."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def state_shardings(abstract_state: Any, mesh: Mesh, *, fsdp: bool) -> Any:
    """Shardings for a state pytree of ShapeDtypeStructs: replicated, or FSDP-sharded.

    FSDP shards each array of at least _FSDP_MIN_SIZE elements along its largest dimension
    divisible by the mesh size; optimizer moments share their parameter's shape and so its
    sharding.
    """
    n = mesh.size

    def sharding(leaf: Any) -> NamedSharding:
        shape = getattr(leaf, "shape", ())
        if not fsdp or n == 1 or int(np.prod(shape)) < _FSDP_MIN_SIZE:
            return replicated(mesh)
        dims = [d for d in np.argsort(shape)[::-1] if shape[d] % n == 0]
        if not dims:
            return replicated(mesh)
        spec = [None] * len(shape)
        spec[int(dims[0])] = DATA_AXIS
        return NamedSharding(mesh, PartitionSpec(*spec))

    return jax.tree.map(sharding, abstract_state)


def check_batch_size(batch_size: int, mesh: Mesh, what: str = "optim.batch_size") -> None:
    """The global batch must split evenly over the devices (and so over the processes)."""
    if batch_size % mesh.size:
        raise ValueError(f"{what}={batch_size} must be a multiple of the {mesh.size} devices in the mesh")


def put_batch(batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Global arrays from a *global* host batch; each process uploads only its own rows."""
    sharding = batch_sharding(mesh)
    count, index = jax.process_count(), jax.process_index()
    out = {}
    for name, array in batch.items():
        rows = array.shape[0] // count
        local = np.asarray(array[index * rows : (index + 1) * rows])
        out[name] = jax.make_array_from_process_local_data(sharding, local, array.shape)
    return out


def to_host(tree: Any) -> Any:
    """NumPy copies of replicated (e.g. reduced metrics) arrays; works in every process."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)
