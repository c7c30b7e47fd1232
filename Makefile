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

# Two pytest-xdist workers (a core each; a file's tests stay together), then the `two_cores`
# learning tests alone (exit 5: ARGS selected none of them).
test: setup
	$(VENV)/bin/python -m pytest -q --durations=15 -n 2 --dist loadgroup -m "not two_cores" tests $(ARGS)
	$(VENV)/bin/python -m pytest -q --durations=5 -m two_cores tests $(ARGS) || [ $$? -eq 5 ]

test-fast: setup
	$(VENV)/bin/python -m pytest -q --durations=10 -m "not slow" tests $(ARGS)

lint: setup
	$(VENV)/bin/ruff check loomrl tests tools
	$(VENV)/bin/ruff format --check loomrl tests tools
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) runs data/demo
