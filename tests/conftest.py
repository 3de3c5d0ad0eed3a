"""Shared test settings: 8 simulated CPU devices (XLA's CPU backend set to compile fast), strict rank promotion,
a compilation cache of the run's own, Triton's interpreter without a GPU, a `key` fixture, and `--each-value-once`
and `--one-case-in` (samples of each test's parametrized cases, for the other jax versions' runs).

What each leg of CI (.ci/run: 20–45 minutes on 2 cores from a clean clone, 2026-11-30 to 2026-12-02, the hosts
differing more than two-fold; 19–30 minutes on 2026-12-02, both cores busy 95 % of it: main suite 751–1203 s, then
the newest jax 357–576 s beside compile 338–516 s; it prints each leg's time) runs of this suite:
- main, `make test`: every file, Python 3.11 with jax 0.10, two xdist workers; every parametrized case. The tests
  that need jax's CUDA plugin, ptxas or nvdisasm skip, saying why.
- newest jax, `make test-newest` (.ci/newest_jax): Python 3.12 with the newest jax and flax; the files of the public
  API, the kernels' launch through jax, the transformations, decoding, export and the README, with
  `--each-value-once` (`--one-case-in` some files); then a model lowered and exported for CUDA
  (test_cuda_lowering.py) and the native kernels' launches compiled by Triton with jax-triton 0.4 (one case of
  test_triton_ownership.py).
- compile, `make test-compile`: test_compile_report.py, test_cuda_lowering.py, test_kernel_cost.py and
  test_triton_ownership.py with the CUDA plugin, ptxas and nvdisasm (.venv-compile): every kernel compiled for an
  H100 and held to its budgets and cost model.
- the wheel smoke, `make test-wheel`, runs no tests of this folder (.ci/wheel_smoke).
Tests marked `gpu` run on a GPU only (`pytest -m gpu`)."""
import atexit
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator


def _has_cuda_plugin() -> bool:
    """Whether jax's CUDA plugin is installed (a GPU machine, or the CUDA compile checks), without importing jax."""
    names = ((d.metadata["Name"] or "").lower().replace("_", "-") for d in importlib.metadata.distributions())
    return any(name.startswith("jax-cuda") for name in names)


def _xla_accepts(flags: list[str]) -> bool:
    """Whether this jaxlib's XLA knows every one of `flags`, asked in one child process: XLA aborts on a flag it does
    not know, and flags come and go between releases."""
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True)
    return probe.returncode == 0


# Compiling is most of this suite's time and its programs are tiny: XLA's CPU backend at optimisation level 0 (LLVM
# without its optimisation passes) compiles them about 30 % faster, and, where XLA still has its elemental emitter
# beside the newer fusion emitters (jax 0.10), emitting fusions with it saves about a third again (tests/test_model.py
# on 2 cores: 80 s against 53 s), and compiling each program's LLVM module whole rather than split for parallel
# codegen threads saves about an eighth more of the CPU time with two xdist workers on two cores (tests/test_model.py
# and tests/test_edge_inputs.py: 157–164 CPU-s against 179–187; jax 0.12, without the elemental emitter, gains
# nothing from it). All of them change how XLA generates the code, not the program. With jax's CUDA plugin XLA
# keeps its defaults (its GPU compiler reads the same flags), and so does a run given its own XLA_FLAGS (the
# newest-jax CI leg); pytest-xdist's workers inherit the flags chosen here.
if "XLA_FLAGS" not in os.environ:
    _flags = ["--xla_force_host_platform_device_count=8"]
    if not _has_cuda_plugin():
        _flags.append("--xla_backend_optimization_level=0")
        _codegen = ["--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1"]
        if _xla_accepts(_codegen):
            _flags += _codegen
    os.environ["XLA_FLAGS"] = " ".join(_flags)

# Tests compile the same programs again and again (a tiny config trained by test after test, each through new jitted
# functions): jax's persistent compilation cache, in a folder of this run's own that the first process makes (the
# xdist workers inherit its name) and removes at exit, hands a repeated program back instead of compiling it (a
# fifth of the CPU time of tests/test_train_workdir.py and tests/test_train_audit.py). A folder per process: jax writes
# an entry without a lock unless it may evict, and a worker could read another's entry half written. Set in jax's
# config, not its environment, so that the runs a test starts in a child process compile as a user's do.
if "JAXPE_TEST_XLA_CACHE" not in os.environ:
    os.environ["JAXPE_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jaxpe-tests-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAXPE_TEST_XLA_CACHE"], ignore_errors=True)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_compilation_cache_dir",
                  os.path.join(os.environ["JAXPE_TEST_XLA_CACHE"], os.environ.get("PYTEST_XDIST_WORKER", "main")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

ON_GPU = jax.default_backend() == "gpu"
# Without a GPU the native Triton kernels (impl="triton") run in Triton's interpreter, which is chosen when triton is
# first imported (jaxpe imports it only for impl="triton"). TRITON_INTERPRET=0 keeps them compiled: lowering for CUDA.
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--each-value-once", action="store_true",
                     help="of each parametrized test, run only cases enough that every value of every parameter "
                          "appears at least once (the newest-jax CI leg: every path and option, not every product)")
    parser.addoption("--one-case-in", action="append", default=[], metavar="FILE",
                     help="of each parametrized test in FILE (a path as collected, e.g. tests/test_fox.py; may be "
                          "repeated), only its first case; with --each-value-once, the other files' tests keep "
                          "their cover (the newest-jax CI leg: files whose values run the same jax APIs)")


def _each_value_once(cases: list[pytest.Item]) -> list[pytest.Item]:
    """Greedy cover of one test's cases: repeatedly the case with the most (parameter, value) pairs not yet run, the
    earliest on ties, until every pair has run. Values are compared by repr, so every xdist worker picks the same."""
    pairs = [{(name, repr(value)) for name, value in case.callspec.params.items()} for case in cases]
    uncovered, chosen = set().union(*pairs), []
    while uncovered:
        best = max(range(len(cases)), key=lambda i: (len(pairs[i] & uncovered), -i))
        chosen.append(best)
        uncovered -= pairs[best]
    return [cases[i] for i in sorted(chosen)]


def _select_cases(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Of each parametrized test, its first case in the files given to `--one-case-in`, and with `--each-value-once`
    the cover above elsewhere; every case otherwise."""
    first_only = set(config.getoption("--one-case-in"))
    cover = config.getoption("--each-value-once")
    by_test: dict[str, list[pytest.Item]] = {}  # parametrized cases by test (node id without its case)
    for item in items:
        if getattr(item, "callspec", None) is not None:
            by_test.setdefault(item.nodeid.split("[")[0], []).append(item)
    unknown = first_only - {item.nodeid.split("::")[0] for item in items}
    if unknown:
        raise pytest.UsageError(f"--one-case-in: no tests collected from {sorted(unknown)}")
    dropped: set[int] = set()
    for test, cases in by_test.items():
        if test.split("::")[0] in first_only:
            dropped |= {id(item) for item in cases[1:]}
        elif cover:
            chosen = {id(item) for item in _each_value_once(cases)}
            dropped |= {id(item) for item in cases if id(item) not in chosen}
    if dropped:
        config.hook.pytest_deselected(items=[item for item in items if id(item) in dropped])
        items[:] = [item for item in items if id(item) not in dropped]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`--each-value-once` and `--one-case-in`: a sample of each test's cases (above). Skip tests marked `gpu` when no
    GPU backend is present."""
    _select_cases(config, items)
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def key() -> jax.Array:
    return jax.random.PRNGKey(0)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs() -> Iterator[None]:
    """After each test module, jax's caches of compiled programs are dropped: a worker that keeps every program of a
    whole suite alive (each XLA CPU executable maps its code separately) reaches the kernel's limit of memory maps
    per process (vm.max_map_count, 65530 by default), and XLA's compiler then crashes (SIGSEGV) on the next program."""
    yield
    jax.clear_caches()
