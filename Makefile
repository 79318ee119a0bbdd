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

.PHONY: demo test venv bench clean

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(PIN) $(TORCH)
	$(PY) -m pip install --quiet $(PIN) -e '.[test]'
	touch $@

venv: $(VENV)/.installed

demo: venv  ## the main job on the embedded default (digits, offline), logged to ./mlflow.db
	$(VENV)/bin/rayfl run

test: venv  ## the whole test suite (CPU only, no network)
	$(PY) -m pytest -q

bench: venv  ## rayfl vs pfl-research and raw Ray on the same FedAvg work; see benchmarks/README.md
	$(PY) -m pip install --quiet -e '.[bench]' $(TORCH)
	$(PY) benchmarks/bench_peers.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
