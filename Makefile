# `make example` and `make test` set up everything from nothing (a .venv in this directory) and run.
PYTHON ?= python3
# Horovod's build needs CMake 3.13 to 3.x (see the install recipe).
CMAKE ?= /usr/bin/cmake
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup example test lint bench bench-quick mutants

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	# torch==2.13.0 is a CPU build on this machine's disk; a looser range pulls a multi-GB CUDA build.
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -e ".[lightning,horovod-tf,dev,plots,tvm]"
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

# Benchmarks (benchmarks/README.md). `make bench` runs every one at its full settings into
# benchmarks/results, then rewrites the README's marked tables from them (numbers to publish: an
# idle machine, a committed tree). `make bench-quick` runs every one with --quick (a smoke pass,
# under 10 minutes on 2 cores) into benchmarks/results/quick and writes the README with those tables
# to benchmarks/results/quick/README.md, leaving the README itself alone. A benchmark that fails
# leaves its table as it was, the others go on, and the target exits non-zero at the end.
# `make bench BENCHMARKS="models planning_time"` runs only those. The .venv's bin goes first on
# PATH for the Horovod ones (`horovodrun`, as the tests run it).
BENCHMARKS := models indicator_check callback_overhead planning_time training_quality \
	prediction_accuracy precision_plans decision_repeatability horovod_tf_accuracy horovod_timeline_cost \
	horovod_tf_plans memory_plans activation_costs ddp_buckets compiled_regions symbolic_estimate \
	op_cost_model tf_memory turns_decisions malloc_thresholds
BENCH_OUT := benchmarks/results
BENCH_QUICK_OUT := $(BENCH_OUT)/quick

# $(1): results folder, $(2): extra arguments of every benchmark, $(3): readme_tables.py's own
define run_benchmarks
	@failed=""; all=$$(date +%s); for b in $(BENCHMARKS); do \
		echo "== python benchmarks/$$b.py $(2) --out $(1)"; \
		rm -f $(1)/$$b.md $(1)/$$b.json; start=$$(date +%s); \
		PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/python benchmarks/$$b.py $(2) --out $(1) \
			|| failed="$$failed $$b"; \
		echo "== $$b: $$(( $$(date +%s) - start )) s"; \
	done; \
	$(VENV)/bin/python benchmarks/readme_tables.py --results $(1) $(3) || failed="$$failed readme_tables"; \
	echo "== all: $$(( $$(date +%s) - all )) s"; \
	if [ -n "$$failed" ]; then echo "FAILED:$$failed"; exit 1; fi
endef

bench: $(STAMP)
	$(call run_benchmarks,$(BENCH_OUT),,)

bench-quick: $(STAMP)
	$(call run_benchmarks,$(BENCH_QUICK_OUT),--quick,--output $(BENCH_QUICK_OUT)/README.md)

# Mutation testing ([tool.mutmut] in pyproject.toml: which files, against which fast tests); from
# scratch each time, so that no result cached before a change of code or tests is counted. Scores and
# survivors: TESTING.md. `make mutants MUTANTS=<names>` runs only those (mutmut's names or globs).
mutants: $(STAMP)
	rm -rf mutants
	ulimit -v 6000000; $(VENV)/bin/mutmut run --max-children $$(nproc) $(MUTANTS)
	$(VENV)/bin/mutmut export-cicd-stats
	cat mutants/mutmut-cicd-stats.json
	$(VENV)/bin/mutmut results
