# Two commands set everything up on a fresh machine:
#   make demo   create .venv, install functopk with what the demo needs, run the main example
#   make test   create .venv, install functopk with every extra, lint, run the whole test suite
# The venv is built once; later runs reuse it (each stamp is rebuilt only when
# pyproject.toml or the pins change). Both install the newest supported torch
# (requirements/torch.txt). Against another torch, in its own venv:
#   make test-torch TORCH=2.11.0   the test suite but the integrations' on torch 2.11.0 (torchvision to match)
#   make test-oldest               what CI runs at the old end: OLDEST_TORCH, then the compile tests on COMPILE_TORCH

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.functopk-installed
DEMO_STAMP := $(VENV)/.functopk-demo-installed
PINS   := requirements/pins.txt requirements/torch.txt
PIP_INSTALL := -m pip install --quiet --disable-pip-version-check
PYTEST_ARGS ?=

# The oldest torch functopk supports, and the oldest that compiles it (docs/design.md, "Supported versions").
OLDEST_TORCH  := 2.9.1
COMPILE_TORCH := 2.10.0
TORCH       ?= $(OLDEST_TORCH)
TORCH_TESTS ?= not integrations
TORCH_VENV  ?= .venv-torch
TORCH_PY    := $(TORCH_VENV)/bin/python

.PHONY: all test test-fast lint demo bench gpu-check test-torch test-oldest clean

all: test

$(STAMP): pyproject.toml $(PINS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) $(PIP_INSTALL) $(PINS:%=-c %) -e '.[test,examples,integrations]'
	touch $@

# the demo's own extra only: no test tools, no integrations (transformers, lightning, jax)
$(DEMO_STAMP): pyproject.toml $(PINS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) $(PIP_INSTALL) $(PINS:%=-c %) -e '.[examples]'
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

# One venv for every other torch: pip swaps torch and torchvision (the release that pairs with TORCH) in
# place. The registry's builds are CUDA builds, about 4-7 GB installed; they run on the CPU.
test-torch:
	test -x $(TORCH_PY) || $(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_PY) $(PIP_INSTALL) -c requirements/pins.txt 'torch==$(TORCH)' torchvision -e '.[test,examples]'
	$(TORCH_PY) -m pytest -m '$(TORCH_TESTS)' $(PYTEST_ARGS)

test-oldest:
	$(MAKE) test-torch TORCH=$(OLDEST_TORCH)
	$(MAKE) test-torch TORCH=$(COMPILE_TORCH) TORCH_TESTS=compile

DEMO_ARGS ?=

demo: $(DEMO_STAMP)
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
	rm -rf $(VENV) $(TORCH_VENV) .pytest_cache .hypothesis out
