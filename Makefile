# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the suite).
# CI (.ci/run) adds `make test-wheel` (the built wheel in a fresh venv, outside the repo) and `make test-newest`
# (Python 3.12 with the newest jax).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-wheel test-newest bench clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test]"
	touch $@

.venv: $(VENV)/.installed

demo: .venv
	$(BIN)/jaxpe-compare --task selective_copy --pe cope,rope,learned --seeds 0 --preset cpu-small --workdir runs/demo

test: .venv
	$(BIN)/python -m pytest -n 2 -q

test-wheel:
	.ci/wheel_smoke $(PY)

test-newest:
	.ci/newest_jax

bench: .venv
	$(BIN)/python benchmarks/attention.py --quick

clean:
	rm -rf $(VENV) .venv-newest
