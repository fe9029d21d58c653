# Two entry points on a fresh machine: `make demo` (main job) and `make test` (the suite). Where CUDA is:
# `make gpu-test` (the kernels' GPU-marked tests in GPU_WORKERS processes sharing the GPU: they are compile-bound)
# and `make bench` (the kernel benchmark against fla, with its JSON). PYTHON=python3 runs the GPU targets with an
# environment of your own.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON ?= $(BIN)/python
GPU_WORKERS ?= 8
BENCH_JSON ?= bench-kernels.json
GPU_ENV := $(if $(filter $(BIN)/python,$(PYTHON)),venv)

.PHONY: venv demo test gpu-test bench lint clean

$(BIN)/deltalab: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(BIN)/deltalab

venv: $(BIN)/deltalab

demo: venv
	$(BIN)/deltalab app

test: venv
	$(BIN)/ruff check .
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not gpu" -n auto --maxprocesses 4 tests

gpu-test: $(GPU_ENV)
	TRITON_CACHE_AUTOTUNING=1 $(PYTHON) -m pytest -q -m gpu -n $(GPU_WORKERS) --timeout 300 -rfE $(PYTEST_ARGS) tests/kernels

bench: $(GPU_ENV)
	TRITON_CACHE_AUTOTUNING=1 $(PYTHON) -m benchmarks.kernels --json $(BENCH_JSON)

clean:
	rm -rf $(VENV) .pytest_cache
