"""Data parallelism over a `jax.sharding.Mesh` and multi-host start-up.

One mesh axis, "data". The global batch is sharded along it; parameters and optimizer state
are replicated, or (FSDP-style, `run.fsdp=true`) sharded along the largest dimension that
the device count divides. Every process feeds only its own slice of the global batch.
"""
from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

DATA_AXIS = "data"
_FSDP_MIN_SIZE = 2**12  # smaller arrays stay replicated: sharding them costs more than it saves


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """Joins a multi-process run, or does nothing for a single process; then logs "process i of n".

    The first of these that applies decides:
    1. the arguments, else $JAXPE_COORDINATOR, $JAXPE_NUM_PROCESSES, $JAXPE_PROCESS_ID (jaxpe's own flags):
       `jax.distributed.initialize(coordinator, num_processes, process_id)`; num_processes 1 is a single process;
    2. $JAX_COORDINATOR_ADDRESS (read by jax itself) with $JAX_NUM_PROCESSES and $JAX_PROCESS_ID where set (jax
       does not read those two; unset, jax takes them from a detected cluster); $JAX_NUM_PROCESSES=1 is a single
       process;
    3. a launcher of several processes that jax detects by itself (`launcher()`: TPU pod, Slurm, Open MPI):
       `jax.distributed.initialize()` with no arguments;
    4. otherwise a single process: nothing to join.

    CPU collectives between processes use gloo (jax's default CPU implementation; set explicitly so that an
    older default cannot silently leave processes unconnected).
    """
    explicit = any(v is not None for v in (coordinator, num_processes, process_id)) or any(
        name in os.environ for name in ("JAXPE_COORDINATOR", "JAXPE_NUM_PROCESSES", "JAXPE_PROCESS_ID"))
    if explicit:
        coordinator = coordinator or os.environ.get("JAXPE_COORDINATOR")
        num_processes = _env_int("JAXPE_NUM_PROCESSES", 1) if num_processes is None else num_processes
        process_id = _env_int("JAXPE_PROCESS_ID", 0) if process_id is None else process_id
        if num_processes < 1:
            raise ValueError(f"--num-processes={num_processes} ($JAXPE_NUM_PROCESSES) must be >= 1")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"--process-id={process_id} ($JAXPE_PROCESS_ID) must be in [0, {num_processes}), "
                             f"below --num-processes={num_processes}")
        if num_processes > 1 and not coordinator:
            raise ValueError(f"--coordinator ($JAXPE_COORDINATOR), host:port of process 0, is needed with "
                             f"--num-processes={num_processes}")
        how = "--coordinator/--num-processes/--process-id or $JAXPE_*"
        kwargs = dict(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
        single = num_processes == 1
    elif "JAX_COORDINATOR_ADDRESS" in os.environ:
        kwargs = {arg: _env_int(name, 0) for arg, name in (("num_processes", "JAX_NUM_PROCESSES"),
                                                          ("process_id", "JAX_PROCESS_ID")) if name in os.environ}
        how, single = "$JAX_COORDINATOR_ADDRESS", kwargs.get("num_processes") == 1
    else:
        how, kwargs = launcher(), {}
        single = how is None
    if not single:
        log.info("joining a multi-process run (%s): jax.distributed.initialize(%s)", how,
                 ", ".join(f"{k}={v!r}" for k, v in kwargs.items()))
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(**kwargs)
    log.info("process %d of %d", jax.process_index(), jax.process_count())


def launcher() -> str | None:
    """The launcher of several processes that `jax.distributed.initialize()` configures itself from, or None.

    The criteria mirror jax's cluster detection (jax._src.clusters in jax 0.10-0.12), with more than one
    process required so that a one-task job stays a single-process run:
    - "slurm": SlurmCluster's variables (SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID,
      SLURM_LOCALID: a job step started by srun) with SLURM_NTASKS > 1;
    - "openmpi": OmpiCluster, processes started by mpirun/mpiexec: OMPI_COMM_WORLD_SIZE > 1 (Open MPI < 5 also
      sets OMPI_MCA_orte_hnp_uri, which jax 0.10 and 0.11 need; Open MPI 5 needs jax >= 0.12 and mpi4py);
    - "tpu": a TPU pod slice or multislice job: more than one host in GkeTpuCluster's host list
      (TPU_PROCESS_ADDRESSES_PATH, TPU_PROCESS_ADDRESSES or TPU_WORKER_HOSTNAMES), MEGASCALE_COORDINATOR_ADDRESS or
      MEGASCALE_NUM_SLICES > 1, or jax's GceTpuCluster: a Cloud TPU VM whose metadata lists several workers (asked
      through jax's own detector, which queries metadata only on a TPU VM).
    """
    env = os.environ
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(name in env for name in slurm) and _env_int("SLURM_NTASKS", 1) > 1:
        return "slurm"
    if _env_int("OMPI_COMM_WORLD_SIZE", 1) > 1:
        return "openmpi"
    if (_tpu_hosts() > 1 or "MEGASCALE_COORDINATOR_ADDRESS" in env or _env_int("MEGASCALE_NUM_SLICES", 1) > 1
            or _gce_tpu_workers() > 1):
        return "tpu"
    return None


def _tpu_hosts() -> int:
    """Hosts of the TPU slice as jax's GkeTpuCluster reads them: the file $TPU_PROCESS_ADDRESSES_PATH, else
    $TPU_PROCESS_ADDRESSES, else $TPU_WORKER_HOSTNAMES (comma-separated)."""
    path = os.environ.get("TPU_PROCESS_ADDRESSES_PATH")
    if path:
        try:
            text = pathlib.Path(path).read_text(encoding="utf-8")
        except OSError as error:
            raise ValueError(f"$TPU_PROCESS_ADDRESSES_PATH={path!r} cannot be read: {error.strerror}") from error
    else:
        text = os.environ.get("TPU_PROCESS_ADDRESSES") or os.environ.get("TPU_WORKER_HOSTNAMES") or ""
    return len([host for host in text.split(",") if host.strip()])


def _gce_tpu_workers() -> int:
    """Workers of this Cloud TPU VM's slice by jax's own GceTpuCluster (a private API: 0 where it is missing)."""
    try:
        from jax._src.clusters import GceTpuCluster  # a private module that may move: imported only when needed
    except ImportError:
        return 0
    if not GceTpuCluster.is_env_present():  # False at once off a TPU VM
        return 0
    return GceTpuCluster.get_process_count()


def _env_int(name: str, default: int) -> int:
    """An integer environment variable; ValueError naming it when it is not one."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"${name}={text!r} must be an integer") from None


CPU_DEVICES_FLAG = "--xla_force_host_platform_device_count"
MAX_CPU_DEVICES = 8  # beyond this a shard per core gets too small to keep a core busy


def split_host_cpu() -> int | None:
    """Present the host CPU as one device per core, so that data parallelism runs a batch shard on each core.

    XLA's CPU backend runs a small model's ops one after another on a pool that stays half idle; a shard per core
    keeps every core busy: on 2 cores a counting training step takes ~0.85× the time (benchmarks/train_step.py).
    Call before JAX starts its backends (XLA reads $XLA_FLAGS once); the entry points do. Puts
    --xla_force_host_platform_device_count=N first in $XLA_FLAGS (XLA stops reading at a word without "--"),
    N = $JAXPE_CPU_DEVICES, else the cores this process may use, at most MAX_CPU_DEVICES; leaves $XLA_FLAGS alone
    when it already sets a count. Where an accelerator is the default backend the CPU devices go unused. Returns
    the N put there, or None.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if CPU_DEVICES_FLAG in flags:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    count = _env_int("JAXPE_CPU_DEVICES", min(cores, MAX_CPU_DEVICES))
    if count < 1:
        raise ValueError(f"$JAXPE_CPU_DEVICES={count} must be >= 1")
    os.environ["XLA_FLAGS"] = f"{CPU_DEVICES_FLAG}={count} {flags}".strip()
    return count


def dividing_count(devices: int, divides: Sequence[int]) -> int:
    """The most of `devices` devices (at least 1) that split every size in `divides` evenly."""
    return max(n for n in range(1, devices + 1) if all(size % n == 0 for size in divides))


def make_mesh(num_devices: int = 0, *, divides: Sequence[int] = (), what: str = "num_devices") -> Mesh:
    """A 1-D ("data",) mesh over the first `num_devices` devices (0 = all, of every process).

    With 0 on a single-process CPU, the most devices that split every size in `divides` (the batch sizes) evenly:
    the host's per-core devices (`split_host_cpu`) need not divide a user's batch. A ValueError names the count
    `what`.
    """
    devices = jax.devices()
    if num_devices == 0:
        num_devices = len(devices)
        if devices[0].platform == "cpu" and jax.process_count() == 1:
            num_devices = dividing_count(num_devices, divides)
    if not 1 <= num_devices <= len(devices):
        raise ValueError(f"{what}={num_devices} must be in [1, {len(devices)}] (the devices present)")
    if num_devices != len(devices) and jax.process_count() > 1:
        raise ValueError(f"{what}={num_devices} must be 0 (all devices) in a multi-process run")
    return Mesh(np.asarray(devices[:num_devices]), (DATA_AXIS,))


def batch_sharding(mesh: Mesh, *, axis: int = 0) -> NamedSharding:
    """The batch dimension (`axis`: 0 for a batch [B, ...], 1 for a stack of batches [K, B, ...]) split over
    "data"."""
    return NamedSharding(mesh, PartitionSpec(*[None] * axis, DATA_AXIS))


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


def put_batch(batch: Mapping[str, np.ndarray], mesh: Mesh, *, axis: int = 0) -> dict[str, jax.Array]:
    """Global arrays from a *global* host batch (its batch dimension at `axis`, see batch_sharding); each process
    uploads only its own rows."""
    sharding = batch_sharding(mesh, axis=axis)
    count, index = jax.process_count(), jax.process_index()
    out = {}
    for name, array in batch.items():
        rows = array.shape[axis] // count
        local = np.asarray(np.take(array, np.arange(index * rows, (index + 1) * rows), axis=axis))
        out[name] = jax.make_array_from_process_local_data(sharding, local, array.shape)
    return out


def on_cpu(mesh: Mesh) -> bool:
    """Whether every device of the mesh is a CPU."""
    return all(device.platform == "cpu" for device in mesh.devices.flat)


def one_program_at_a_time(mesh: Mesh) -> bool:
    """Whether programs on this mesh must run one after another: several CPU devices in one process (e.g.
    `split_host_cpu`'s). XLA's in-process CPU all-reduce can deadlock when a program is queued on the devices while
    the previous one is still running (jax 0.10, a device per core on 2 cores: "waiting for `all reduce
    RendezvousKey...` ... may be stuck", then the process aborts), so callers wait for each before the next."""
    return mesh.size > 1 and on_cpu(mesh)


def to_host(tree: Any) -> Any:
    """NumPy copies of replicated (e.g. reduced metrics) arrays; works in every process."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)
