"""Multi-host start-up with a mocked environment: which launchers make jaxpe call jax.distributed.initialize, and
with which arguments; one process calls nothing; every process logs its index; only process 0 writes metrics."""
import logging

import jax
import pytest

from jaxpe.train import cli, distributed, experiments, loop

VARIABLES = (
    "JAXPE_COORDINATOR", "JAXPE_NUM_PROCESSES", "JAXPE_PROCESS_ID",
    "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
    "SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_MCA_orte_hnp_uri",
    "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_ADDRESSES_PATH", "TPU_WORKER_ID",
    "MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES",
)
SLURM = {"SLURM_JOB_ID": "1234", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "4", "SLURM_PROCID": "2",
         "SLURM_LOCALID": "0"}


@pytest.fixture
def calls(monkeypatch) -> list[dict]:
    """A clean environment and a recording jax.distributed.initialize; returns the recorded keyword arguments."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    recorded: list[dict] = []

    def fake_initialize(*args, **kwargs):
        assert not args, "jaxpe passes keyword arguments only"
        recorded.append(kwargs)

    monkeypatch.setattr(jax.distributed, "initialize", fake_initialize)
    return recorded


def set_env(monkeypatch, **variables: str) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def test_single_process_joins_nothing(calls):
    assert distributed.launcher() is None
    distributed.initialize()
    assert calls == []


@pytest.mark.parametrize("variables, name", [
    (SLURM, "slurm"),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_MCA_orte_hnp_uri": "123.0;tcp://10.0.0.1:4000"}, "openmpi"),
    ({"TPU_WORKER_HOSTNAMES": "t1v-0,t1v-1", "TPU_WORKER_ID": "1"}, "tpu"),
    ({"TPU_PROCESS_ADDRESSES": "10.0.0.1:8476,10.0.0.2:8476"}, "tpu"),
    ({"TPU_PROCESS_ADDRESSES_PATH": "addresses", "TPU_WORKER_HOSTNAMES": "ignored"}, "tpu"),
    ({"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.1", "MEGASCALE_NUM_SLICES": "2"}, "tpu"),
])
def test_detected_launchers_initialize_with_no_arguments(monkeypatch, calls, variables, name, tmp_path):
    (tmp_path / "addresses").write_text("10.0.0.1:8476,10.0.0.2:8476\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    set_env(monkeypatch, **variables)
    assert distributed.launcher() == name
    distributed.initialize()
    assert calls == [{}]


@pytest.mark.parametrize("variables", [
    {**SLURM, "SLURM_NTASKS": "1"},  # a one-task job step
    {key: value for key, value in SLURM.items() if key != "SLURM_STEP_NODELIST"},  # a batch script, not srun
    {"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"},
    {"TPU_WORKER_HOSTNAMES": "localhost"},  # a single-host TPU VM
    {"TPU_PROCESS_ADDRESSES_PATH": "one-address", "TPU_WORKER_HOSTNAMES": "h0,h1"},  # the file wins, as in jax
    {"MEGASCALE_NUM_SLICES": "1"},
])
def test_one_process_launches_stay_single(monkeypatch, calls, variables, tmp_path):
    (tmp_path / "one-address").write_text("10.0.0.1:8476", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    set_env(monkeypatch, **variables)
    assert distributed.launcher() is None
    distributed.initialize()
    assert calls == []


def test_cloud_tpu_vm_metadata_through_jax(monkeypatch, calls):
    """On a GCE TPU VM the host list is in metadata: jax's own GceTpuCluster is asked (mocked here)."""
    from jax._src.clusters import GceTpuCluster

    assert distributed._gce_tpu_workers() == 0  # the real detector, off a TPU VM
    monkeypatch.setattr(GceTpuCluster, "is_env_present", classmethod(lambda cls: True))
    monkeypatch.setattr(GceTpuCluster, "get_process_count", classmethod(lambda cls: 1))
    assert distributed.launcher() is None  # a single-host TPU VM
    monkeypatch.setattr(GceTpuCluster, "get_process_count", classmethod(lambda cls: 4))
    assert distributed.launcher() == "tpu"
    distributed.initialize()
    assert calls == [{}]


def test_jax_coordinator_variables(monkeypatch, calls):
    """jax reads $JAX_COORDINATOR_ADDRESS itself; the count and index are passed when set, left to jax when not."""
    set_env(monkeypatch, JAX_COORDINATOR_ADDRESS="10.0.0.1:1234", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1")
    distributed.initialize()
    monkeypatch.delenv("JAX_NUM_PROCESSES")
    monkeypatch.delenv("JAX_PROCESS_ID")
    distributed.initialize()
    assert calls == [{"num_processes": 2, "process_id": 1}, {}]
    set_env(monkeypatch, JAX_NUM_PROCESSES="1", JAX_PROCESS_ID="0")
    distributed.initialize()
    assert len(calls) == 2


def test_explicit_flags_and_variables_pass_their_values_and_win(monkeypatch, calls):
    set_env(monkeypatch, **SLURM, JAX_COORDINATOR_ADDRESS="10.9.9.9:1")
    distributed.initialize("10.0.0.1:1234", 2, 1)
    set_env(monkeypatch, JAXPE_COORDINATOR="10.0.0.2:99", JAXPE_NUM_PROCESSES="3", JAXPE_PROCESS_ID="2")
    distributed.initialize()
    distributed.initialize(process_id=0)  # a flag beats its variable; the others come from the variables
    assert calls == [
        {"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1},
        {"coordinator_address": "10.0.0.2:99", "num_processes": 3, "process_id": 2},
        {"coordinator_address": "10.0.0.2:99", "num_processes": 3, "process_id": 0},
    ]
    distributed.initialize(num_processes=1, process_id=0)  # explicitly one process, in a Slurm job: nothing to join
    assert len(calls) == 3


def test_cli_flags_reach_jax(monkeypatch, calls, tmp_path):
    def stop(config, workdir, **options):
        raise loop.NonFiniteLossError("stopped by the test")

    monkeypatch.setattr(experiments, "train_and_evaluate", stop)
    assert cli.train_main(["--workdir", str(tmp_path), "--coordinator", "10.0.0.1:1234", "--num-processes", "2",
                           "--process-id", "1"]) == 1
    assert calls == [{"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1}]


@pytest.mark.parametrize("kwargs, variables, message", [
    ({"num_processes": 2}, {}, r"--coordinator \(\$JAXPE_COORDINATOR\), host:port of process 0, is needed with "
                               "--num-processes=2"),
    ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, {},
     r"--process-id=2 \(\$JAXPE_PROCESS_ID\) must be in \[0, 2\), below --num-processes=2"),
    ({"num_processes": 0}, {"JAXPE_NUM_PROCESSES": "2"}, r"--num-processes=0 \(\$JAXPE_NUM_PROCESSES\) must be >= 1"),
    ({}, {"JAXPE_NUM_PROCESSES": "two"}, r"\$JAXPE_NUM_PROCESSES='two' must be an integer"),
    ({}, {**SLURM, "SLURM_NTASKS": "many"}, r"\$SLURM_NTASKS='many'"),
    ({}, {"TPU_PROCESS_ADDRESSES_PATH": "/no/such/file"}, r"\$TPU_PROCESS_ADDRESSES_PATH='/no/such/file' cannot be read"),
])
def test_bad_settings_name_the_argument(monkeypatch, calls, kwargs, variables, message):
    set_env(monkeypatch, **variables)
    with pytest.raises(ValueError, match=message):
        distributed.initialize(**kwargs)
    assert calls == []


def test_every_process_logs_its_index(monkeypatch, calls, caplog):
    set_env(monkeypatch, **SLURM)
    monkeypatch.setattr(jax, "process_index", lambda: 2)
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    with caplog.at_level(logging.INFO, logger="jaxpe.train.distributed"):
        distributed.initialize()
    assert "joining a multi-process run (slurm)" in caplog.text
    assert caplog.messages[-1] == "process 2 of 4"


def test_only_process_zero_writes_metrics_and_names_the_outputs(monkeypatch, tmp_path, capsys):
    other = loop.MetricsLog(tmp_path, resume_step=0, enabled=False, tensorboard=True)
    other.write({"step": 1, "split": "train", "loss": 1.0})
    other.close()
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "result.json").write_text("{}", encoding="utf-8")
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    cli._print_outputs(tmp_path, cli.RUN_OUTPUTS)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    cli._print_outputs(tmp_path, cli.RUN_OUTPUTS)
    assert capsys.readouterr().err == f"outputs in {tmp_path}: result.json\n"


def test_programs_run_one_at_a_time_only_on_several_cpu_devices():
    """XLA's in-process CPU all-reduce (jax 0.10) can deadlock when programs queue up on several CPU devices."""
    devices = jax.devices()
    assert distributed.one_program_at_a_time(jax.sharding.Mesh(devices[:2], ("data",))) == (
        devices[0].platform == "cpu")
    assert not distributed.one_program_at_a_time(jax.sharding.Mesh(devices[:1], ("data",)))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="runs on the simulated CPU devices")
def test_train_loop_waits_for_each_step_on_several_cpu_devices(monkeypatch, tmp_path):
    """On a mesh of CPU devices the loop dispatches step k + 1 only after step k finished (and before any hook):
    a jax 0.10 process with back-to-back dispatches aborted at a stuck all-reduce rendezvous."""
    from tiny_config import tiny
    from jaxpe.train.trainer import Trainer

    events = []
    real_wait, real_init = jax.block_until_ready, Trainer.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        step = self.train_step

        def dispatch(state, batch):
            state, metrics = step(state, batch)
            events.append(("step", id(metrics)))
            return state, metrics
        self.train_step = dispatch

    def wait(tree):
        events.append(("wait", id(tree)))
        return real_wait(tree)

    monkeypatch.setattr(Trainer, "__init__", init)
    monkeypatch.setattr(loop.jax, "block_until_ready", wait)
    experiments.train_and_evaluate(tiny("run.steps=4", "run.num_devices=2"), tmp_path)
    steps = [i for i, (kind, _) in enumerate(events) if kind == "step"]
    assert len(steps) == 4
    for this, following in zip(steps, steps[1:]):
        assert ("wait", events[this][1]) in events[this + 1:following], events
