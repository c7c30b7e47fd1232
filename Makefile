# Two commands: `make demo` and `make test`. Both set up .venv first (idempotent).
PYTHON ?= python3
VENV := .venv
ARGS ?=

.PHONY: setup demo test clean

setup:
	@$(PYTHON) tools/setup_env.py

demo: setup
	$(VENV)/bin/loomrl run recipes/demo.yaml $(ARGS)

test: setup
	$(VENV)/bin/python -m pytest -q --durations=15 tests $(ARGS)

clean:
	rm -rf $(VENV) runs data/demo
