"""A device per CPU core for data parallelism: what split_host_cpu puts in $XLA_FLAGS, what a fresh process then
sees, and how the mesh picks a device count that divides the batches."""
import os
import subprocess
import sys

import jax
import pytest

from jaxpe.train import distributed

FLAG = "--xla_force_host_platform_device_count"


@pytest.fixture
def env(monkeypatch):
    """No $XLA_FLAGS and no $JAXPE_CPU_DEVICES; XLA_FLAGS is restored afterwards."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("JAXPE_CPU_DEVICES", raising=False)
    return monkeypatch


def test_one_device_per_core_up_to_the_cap(env):
    env.setattr(os, "sched_getaffinity", lambda pid: set(range(3)))
    assert distributed.split_host_cpu() == 3
    assert os.environ["XLA_FLAGS"] == f"{FLAG}=3"
    env.delenv("XLA_FLAGS")
    env.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert distributed.split_host_cpu() == distributed.MAX_CPU_DEVICES == 8


def test_the_flag_goes_first_and_a_set_count_wins(env):
    env.setenv("JAXPE_CPU_DEVICES", "5")
    env.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false stray=1")
    assert distributed.split_host_cpu() == 5
    assert os.environ["XLA_FLAGS"] == f"{FLAG}=5 --xla_cpu_multi_thread_eigen=false stray=1"
    env.setenv("XLA_FLAGS", f"{FLAG}=3")
    assert distributed.split_host_cpu() is None
    assert os.environ["XLA_FLAGS"] == f"{FLAG}=3"


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_a_bad_count_names_the_variable(env, value):
    env.setenv("JAXPE_CPU_DEVICES", value)
    with pytest.raises(ValueError, match="JAXPE_CPU_DEVICES"):
        distributed.split_host_cpu()
    assert "XLA_FLAGS" not in os.environ


@pytest.mark.parametrize("xla_flags", ["", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"])
def test_a_fresh_process_sees_the_devices(xla_flags):
    """Before the backend starts the split takes effect, also behind a word XLA would stop parsing at."""
    code = ("from jaxpe.train import distributed; distributed.split_host_cpu(); import jax; "
            "print(jax.device_count(), jax.devices()[0].platform)")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAXPE_CPU_DEVICES="3", JAX_PLATFORMS="cpu", **({"XLA_FLAGS": xla_flags} if xla_flags else {}))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["3", "cpu"]


@pytest.mark.skipif(jax.device_count() != 8, reason="tests/conftest.py's 8 host devices were overridden")
def test_the_mesh_takes_the_most_devices_that_divide_every_batch():
    assert distributed.make_mesh(0).size == 8
    assert distributed.make_mesh(0, divides=(32, 64)).size == 8
    assert distributed.make_mesh(0, divides=(12, 64)).size == 4
    assert distributed.make_mesh(0, divides=(6, 9)).size == 3
    assert distributed.make_mesh(0, divides=(7,)).size == 7
    assert distributed.make_mesh(0, divides=(11, 64)).size == 1
    assert distributed.make_mesh(2, divides=(11,)).size == 2  # an explicit count is the user's: checked elsewhere
