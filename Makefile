# Two commands do all the set-up on a fresh machine: `make demo` and `make test` (each creates .venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch and torchvision releases that match each other; override for another platform or CUDA build.
TORCH ?= torch==2.14.1 torchvision==0.29.1
# The versions the suite passes with (every dependency, pinned); `make CONSTRAINTS= ...` installs without them
# (as another TORCH needs).
CONSTRAINTS ?= constraints.txt
PIN := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

# The suite's three layers (tests/unit, tests/integration, tests/system). The unit layer has no Ray and no
# server, so both `make test` and `make test-fast` spread it over FAST_JOBS pytest-xdist workers; the Ray and
# subprocess layers run one test after another (parallel workers on two cores thrashed: each worker's own Ray
# instance, and the cluster fixtures' start-up timeouts).
FAST_JOBS ?= 2

.PHONY: demo test test-fast venv bench clean

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(PIN) $(TORCH)
	$(PY) -m pip install --quiet $(PIN) -e '.[test]'
	touch $@

venv: $(VENV)/.installed

demo: venv  ## the main job on the embedded default (digits, offline), logged to ./mlflow.db
	$(VENV)/bin/rayfl run

# pytest's exit status 5 (no test collected, as with a PYTEST_ARGS='-k' that selects nothing) is its own
# closing line, not a failure.
test: venv  ## the whole test suite, every layer (CPU only, no network)
	$(PY) -m pytest -q -n $(FAST_JOBS) $(PYTEST_ARGS) tests/unit || [ $$? -eq 5 ]
	$(PY) -m pytest -q $(PYTEST_ARGS) tests/integration tests/system || [ $$? -eq 5 ]

test-fast: venv  ## the unit layer only (no Ray, no server): under a minute
	$(PY) -m pytest -q -n $(FAST_JOBS) $(PYTEST_ARGS) tests/unit || [ $$? -eq 5 ]

bench: venv  ## rayfl vs pfl-research and raw Ray on the same FedAvg work; see benchmarks/README.md
	$(PY) -m pip install --quiet -e '.[bench]' $(TORCH)
	$(PY) benchmarks/bench_peers.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
