# Set-up lives here so the README's two commands work on a fresh machine:
#   make run   -> venv + install + tiny model, then `dyngraph run in=http out=echo_core` on it
#   make test  -> venv + install, then the default (fast) test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL_DIR ?= .cache/tiny-model
HTTP_PORT ?= 8080

.PHONY: setup run test test-all lint bench

$(BIN)/dyngraph: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

setup: $(BIN)/dyngraph

$(MODEL_DIR)/tokenizer.json: | $(BIN)/dyngraph
	$(BIN)/dyngraph dev tiny-model $(MODEL_DIR)

run: setup $(MODEL_DIR)/tokenizer.json
	$(BIN)/dyngraph run in=http out=echo_core $(MODEL_DIR) --http-port $(HTTP_PORT)

test: setup
	$(BIN)/ruff check dynamo_graph tests benchmarks
	$(BIN)/pytest -q

test-all: setup
	$(BIN)/pytest -q -m ''

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup $(MODEL_DIR)/tokenizer.json
	$(BIN)/python benchmarks/bench_frontend.py --model $(MODEL_DIR)
