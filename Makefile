# EdgeFleet: `make demo` and `make test` do all the set-up on a fresh Debian/Ubuntu machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-edgefleet
PYTEST_ARGS ?=

.PHONY: venv test lint typecheck unit demo bench check-arm64 clean

## venv: create .venv and install edgefleet with its dev tools (re-runs when pyproject changes)
venv: $(STAMP)

$(STAMP): pyproject.toml
	@scripts/ensure-system-deps python3-venv iproute2
	@$(PYTHON) scripts/check_python.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

## test: lint, type-check and run every test (real peers, no mocks)
test: lint typecheck unit

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy

unit: venv
	$(BIN)/pytest $(PYTEST_ARGS)

## demo: start the plant simulator and the agent against it, show it, stop by itself
demo: venv
	$(BIN)/edge-agent check-config examples/agent.toml
	$(BIN)/edge-agent run --config examples/agent.toml --simulate --duration 20

## bench: every benchmark in quick mode
bench: venv
	$(BIN)/python -m bench.perception --quick
	$(BIN)/python -m bench.modbus_poll --quick
	$(BIN)/python -m bench.can_ingest --quick

## check-arm64: every runtime dependency has a manylinux aarch64 wheel for CPython 3.11 and 3.12
check-arm64: venv
	$(BIN)/python scripts/check_arm64.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache *.egg-info
