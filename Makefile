# `make run` and `make test` set themselves up on a fresh machine (a .venv in this folder).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_INDEX ?=
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup run test test-fast bench bench-baseline clean

# The project's own modules are byte-compiled here (unchanged ones are skipped): an editable
# install leaves that to the first import, which PYTHONDONTWRITEBYTECODE (set on these machines)
# turns into compiling them again in every process (~70 ms a start).
setup: $(VENV)/.installed
	@$(PY) -m compileall -q framework policies backends models experiments

# torch==2.13.0 goes in first, pinned: anything looser would pull several GB of CUDA packages.
# On these machines pip's configuration serves the CPU wheel; elsewhere, on a CPU machine, pass
# TORCH_INDEX=https://download.pytorch.org/whl/cpu (PyPI's Linux wheel is the CUDA build).
# A torch already in the venv is kept.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

run: setup
	$(PY) -m framework.run $(ARGS)

# Two workers (pytest-xdist) nearly halve the suite's time on 2 cores (much of it waits on subprocesses); a file's
# tests stay on one worker, in their order. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile) $(ARGS)

# A quick check (under 2 minutes) of the core: the layers, the common types, the allocator, the scheduler and the
# policies (their property tests left out); no model parity, config composition, subprocess runs, benchmarks or slow tests.
FAST_TESTS := tests/framework/test_layers.py tests/framework/common tests/framework/kv tests/framework/scheduling \
	tests/policies
FAST_SKIP  := --ignore=tests/policies/test_plugin.py --ignore=tests/policies/test_parity_hf.py \
	--ignore=tests/policies/test_properties.py

test-fast: setup
	$(PY) -m pytest -m 'not slow and not gpu' $(FAST_TESTS) $(FAST_SKIP) $(ARGS)

# Each run is shown against the saved baseline of this platform (tests/benchmarks/baselines, 0001): read the
# ratios, measured minutes apart on a machine that drifts; `make bench-baseline` replaces the baseline.
BENCH := $(PY) -m pytest tests/benchmarks --benchmark-enable --benchmark-only -p no:randomly \
	--benchmark-storage=file://tests/benchmarks/baselines

bench: setup
	$(BENCH) --benchmark-compare=0001 --benchmark-columns=min,median,mean,stddev,rounds $(ARGS)

bench-baseline: setup
	rm -f tests/benchmarks/baselines/$$($(PY) -c "from pytest_benchmark.utils import get_machine_id; print(get_machine_id())")/0001_*.json
	$(BENCH) --benchmark-save=baseline $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks outputs multirun
