# Two commands set everything up on a fresh machine:
#   make demo   create .venv, install functopk with its extras, run the main example
#   make test   create .venv, install, run the whole test suite
# The venv is built once; later runs reuse it (the stamp is rebuilt only when
# pyproject.toml or the pins change).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.functopk-installed
PYTEST_ARGS ?=

.PHONY: all test test-fast lint demo bench gpu-check clean

all: test

$(STAMP): pyproject.toml requirements/pins.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c requirements/pins.txt -e '.[test,examples,integrations]'
	touch $@

# OpenMP threads spin-wait for each other on a shared machine; passive waiting is
# up to 2x faster there and costs nothing on a quiet one.
export OMP_WAIT_POLICY ?= PASSIVE

lint: $(STAMP)
	$(PY) -m ruff check functopk tests benchmarks examples docs
	$(PY) -m mypy

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: lint
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

DEMO_ARGS ?=

demo: $(STAMP)
	$(PY) examples/train_resnet.py $(DEMO_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/topk.py
	$(PY) benchmarks/optim.py
	$(PY) benchmarks/pure_floor.py
	$(PY) benchmarks/adapter_step.py
	$(PY) benchmarks/compiled_step.py
	$(PY) benchmarks/distributed.py
	$(PY) benchmarks/convergence.py

# On a machine with a CUDA GPU: CUDA tests and GPU benchmarks, tables in benchmarks/results/gpu/.
# No install: the script imports functopk from this checkout with the machine's own torch and Triton
# (GPU_PY=..., else .venv/bin/python if there is one, else python3).
gpu-check:
	PY="$${GPU_PY:-}" bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis out
