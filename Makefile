# `make example` and `make test` set up everything from nothing (a .venv in this directory) and run.
PYTHON ?= python3
# Horovod's build needs CMake 3.13 to 3.x (see the install recipe).
CMAKE ?= /usr/bin/cmake
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup example test lint bench mutants

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	# torch==2.13.0 is a CPU build on this machine's disk; a looser range pulls a multi-GB CUDA build.
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -e ".[lightning,horovod-tf,dev]"
	# Horovod 0.28.1 only builds from source, against the TensorFlow just installed: no build isolation
	# (so its build deps must be in the venv first), TF and Gloo on, MPI/PyTorch/MXNet off (our torch
	# side uses torch.distributed). CMake: the system's 3.25, named through HOROVOD_CMAKE so that no
	# cmake on PATH is used instead (a cmake 4, as PyPI ships, refuses Horovod's bundled gloo).
	# No cache: a cached wheel may have been built against another TF or other flags. ~3 min on 2 cores.
	$(VENV)/bin/pip install --quiet setuptools wheel packaging
	HOROVOD_CMAKE=$(CMAKE) HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
		HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
		$(VENV)/bin/pip install --quiet --no-build-isolation --no-cache-dir horovod==0.28.1
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

# Mutation testing ([tool.mutmut] in pyproject.toml: which files, against which fast tests); from
# scratch each time, so that no result cached before a change of code or tests is counted. Scores and
# survivors: TESTING.md. `make mutants MUTANTS=<names>` runs only those (mutmut's names or globs).
mutants: $(STAMP)
	rm -rf mutants
	$(VENV)/bin/mutmut run --max-children $$(nproc) $(MUTANTS)
	$(VENV)/bin/mutmut export-cicd-stats
	cat mutants/mutmut-cicd-stats.json
	$(VENV)/bin/mutmut results
