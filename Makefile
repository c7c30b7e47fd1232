# Two commands: `make demo` and `make test`. Both set up .venv first (idempotent).
# For developers: `make test-fast` (unit tests, no real runs, < 3 min) and `make lint` (ruff, mypy).
PYTHON ?= python3
VENV := .venv
ARGS ?=

.PHONY: setup demo test test-fast lint clean

setup:
	@$(PYTHON) tools/setup_env.py

demo: setup
	$(VENV)/bin/loomrl run recipes/demo.yaml $(ARGS)

test: setup
	$(VENV)/bin/python -m pytest -q --durations=15 tests $(ARGS)

test-fast: setup
	$(VENV)/bin/python -m pytest -q --durations=10 -m "not slow" tests $(ARGS)

lint: setup
	$(VENV)/bin/ruff check loomrl tests tools
	$(VENV)/bin/ruff format --check loomrl tests tools
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) runs data/demo
