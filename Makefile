VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: setup test lint bench-core

setup:
	python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev,bench,models,llamacpp,serve,ray]'
	$(VENV)/bin/adaspec models prepare

test:
	$(VENV)/bin/ruff check src tests experiments
	$(PY) -m pytest -q -rs  # -rs: each skipped test with its reason (a missing extra)

lint:
	$(VENV)/bin/ruff check src tests experiments

bench-core:
	$(PY) experiments/core_humaneval.py
