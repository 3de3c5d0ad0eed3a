# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test bench clean

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

bench: .venv
	$(BIN)/python -m jaxpe.kernels.bench --quick

clean:
	rm -rf $(VENV)
