# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the suite).
# CI (.ci/run) adds `make test-wheel` (the built wheel in a fresh venv, outside the repo), `make test-newest`
# (Python 3.12 with the newest jax; then a model lowered for CUDA) and `make test-compile` (every kernel compiled for an
# H100, within budget; a model lowered and exported for CUDA).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-wheel test-newest test-compile compile-report bench clean ci-venvs

# pip --no-compile, here and in .ci/: no byte-compiling of every installed file at install time (imports compile the
# modules they load), a CPU minute or so of each CI run. The bytecode of what is imported is kept, in .pycache/ (outside
# the source tree and the venvs' packages; `make clean` removes it), even where PYTHONDONTWRITEBYTECODE is set, as on
# CI's hosts: each Python process the suites start (pytest's workers, the CLIs and training runs that tests start, the
# compile report's workers) imports jax, flax, optax, orbax and triton, and compiled them all from source again, about
# 3 CPU-seconds a process (tests/test_cli.py on the newest jax, 2 workers: 115 CPU-s without the cache, 92 with it cold).
unexport PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX ?= $(CURDIR)/.pycache

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile --upgrade pip
	$(BIN)/pip install -q --no-compile -e ".[test]"
	touch $@

.venv: $(VENV)/.installed

demo: .venv
	$(BIN)/jaxpe-compare --task selective_copy --pe cope,rope,learned --seeds 0 --preset cpu-small --workdir runs/demo

# --durations: the slowest tests at the end of every run, to keep CI's main leg within its minutes
test: .venv
	$(BIN)/python -m pytest -n 2 --dist worksteal -q --durations=25

# The built wheel in a fresh venv outside the repository, on Python 3.13 (the newest jax; also the native kernels in
# the interpreter of Triton 3.6, which a user's torch may pin). The wheel's files are the same on every Python; jax
# 0.10 on Python 3.11 runs the whole suite (make test), Python 3.12 the newest jax editable (make test-newest).
test-wheel:
	.ci/wheel_smoke "$$(.ci/find_python 3.13)" 3.6.0

# The kernels compiled for an H100 (sm_90a) without a GPU: XLA's Triton compiler from jax's CUDA plugin (pinned to
# the installed jaxlib; jax 0.10 is the last whose plugin exposes it), ptxas and nvdisasm (its version), in their own
# venv, so that the main suite never sees the plugin (it makes jax try CUDA first, and impl="auto" stage the CUDA
# kernels). The native Triton kernels (impl="triton") compile through triton (from the test extra) and jax-triton
# 0.3.1, the release for jax 0.10, installed without its dependencies (they would move jax) but absl-py, which it
# imports.
COMPILE_VENV := .venv-compile
NVCC ?= nvidia-cuda-nvcc

$(COMPILE_VENV)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(COMPILE_VENV)
	$(COMPILE_VENV)/bin/pip install -q --no-compile --upgrade pip
	$(COMPILE_VENV)/bin/pip install -q --no-compile -e ".[test]" "jax>=0.10,<0.11"
	$(COMPILE_VENV)/bin/pip install -q --no-compile \
	  "jax-cuda13-plugin==$$($(COMPILE_VENV)/bin/python -c 'import jaxlib; print(jaxlib.__version__)')"
	$(COMPILE_VENV)/bin/pip install -q --no-compile --no-deps "$(NVCC)" "jax-triton==0.3.1" absl-py
	nvcc=$$($(COMPILE_VENV)/bin/python -c 'import importlib.metadata as m; print(m.version("nvidia-cuda-nvcc"))') && \
	  $(COMPILE_VENV)/bin/pip install -q --no-compile --no-deps "nvidia-cuda-nvdisasm==$$nvcc"
	touch $@

# Every kernel of the report held to its budget, a TransformerLM lowered and exported for CUDA with each GPU path
# (tests/test_cuda_lowering.py; TRITON_INTERPRET=0: jax-triton compiles, not Triton's interpreter), and the cost model's
# report checked against kernels compiled again (tests/test_kernel_cost.py), and the native backward kernels' in-place
# adds held to values each thread owns (tests/test_triton_ownership.py): about 5 minutes on 2 cores.
test-compile: $(COMPILE_VENV)/.installed
	JAX_PLATFORMS=cpu TRITON_INTERPRET=0 $(COMPILE_VENV)/bin/python -m pytest -q tests/test_compile_report.py \
	  tests/test_cuda_lowering.py tests/test_kernel_cost.py tests/test_triton_ownership.py

# The committed report (results/compile/sm90a.json and .md) from tools/compile_report.py, a tool outside the wheel.
compile-report: $(COMPILE_VENV)/.installed
	JAX_PLATFORMS=cpu $(COMPILE_VENV)/bin/python tools/compile_report.py --out results/compile

test-newest:
	.ci/newest_jax

# The environments of test-newest and test-compile, without their tests (.ci/run builds them beside `make test`).
ci-venvs: $(COMPILE_VENV)/.installed
	.ci/newest_jax --prepare

bench: .venv
	$(BIN)/python benchmarks/attention.py --quick --out results/bench

clean:
	rm -rf $(VENV) .venv-newest $(COMPILE_VENV) .pycache
