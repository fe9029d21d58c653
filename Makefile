# Two entry points on a fresh machine: `make demo` (main job) and `make test` (the suite).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv demo test lint clean

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

clean:
	rm -rf $(VENV) .pytest_cache
