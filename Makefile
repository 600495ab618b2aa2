# Set-up commands (README): `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PEER   := .venv-kvpress

.PHONY: demo test test-all lint install setup clean peer-venv reports

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
	$(BIN)/ruff check sparsekv_jax tests scripts notebooks experiments

# Two pytest-xdist workers (CI has 2 cores; an XLA compile uses about one): tests are dealt out one by one
# and idle workers steal queued ones, so one long file (test_contract's pair matrix) does not bound the run.
TEST_WORKERS ?= 2

# The two venvs the tests need, built side by side: pip is mostly one process on one core, and on 2 cores the
# two installs took 157 s together against 211 s one after the other (2026-11-29).
setup:
	$(MAKE) --no-print-directory -j2 $(STAMP) $(PEER)/.installed

test: setup
	$(MAKE) --no-print-directory lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15 tests

# Every parametrization of the tests marked `share` (`make test` runs a seeded share of them; tests/conftest.py)
test-all: setup
	$(MAKE) --no-print-directory lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15 --every-case tests

# Every results report the docs link to, and the README's plot, regenerated from the committed records.
reports: $(STAMP)
	$(BIN)/python scripts/regenerate_reports.py

clean:
	rm -rf $(VENV) $(PEER) build *.egg-info

# kvpress (the peer the baselines are cross-checked against) needs transformers < 5.3: its own venv.
$(PEER)/.installed:
	$(PYTHON) -m venv $(PEER)
	$(PEER)/bin/python -m pip install -q "torch==2.13.0" "transformers==5.2.0" "tokenizers==0.22.2" "kvpress==0.5.5" gguf
	touch $(PEER)/.installed

peer-venv: $(PEER)/.installed
