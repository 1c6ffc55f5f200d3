# `make example` and `make test` set up everything from nothing (a .venv in this directory) and run.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup example test lint bench

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	# torch==2.13.0 is a CPU build on this machine's disk; a looser range pulls a multi-GB CUDA build.
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -e ".[lightning,dev]"
	touch $(STAMP)

setup: $(STAMP)

example: $(STAMP)
	$(VENV)/bin/python examples/train_lightning.py

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/prediction_accuracy.py
	$(VENV)/bin/python benchmarks/callback_overhead.py
