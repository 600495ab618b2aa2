# Set-up commands (README): `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch is pinned to the CPU build that lies on the machines' disk (an unpinned torch pulls CUDA).
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m sparsekv_jax.demo

lint: $(STAMP)
	$(BIN)/ruff check sparsekv_jax tests

test: $(STAMP) lint
	$(BIN)/python -m pytest -q --durations=15 tests

clean:
	rm -rf $(VENV) build *.egg-info
