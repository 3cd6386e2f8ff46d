# EdgeFleet: `make demo` and `make test` do all the set-up on a fresh Debian/Ubuntu machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-edgefleet
PYTEST_ARGS ?=
# The fleet store tests also run on PostgreSQL when it answers here (CI always gives one).
PG_DEFAULT := postgresql://postgres@127.0.0.1:5432/test
EDGEFLEET_TEST_PG_URL ?= $(shell pg_isready -q -d $(PG_DEFAULT) 2>/dev/null && echo $(PG_DEFAULT))
export EDGEFLEET_TEST_PG_URL

TRAIN_VENV  := .venv-train
TFLITE_VENV := .venv-tflite

.PHONY: venv test lint typecheck unit test-tflite demo demo-agent bench model check-arm64 test-arm64 clean

## venv: create .venv and install edgefleet with its dev tools (re-runs when pyproject changes)
venv: $(STAMP)

$(STAMP): pyproject.toml
	@scripts/ensure-system-deps python3-venv iproute2 mosquitto
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
	@scripts/ensure-system-deps chromium chromium-driver  # the console's browser tests
	$(BIN)/pytest $(PYTEST_ARGS)

## test-tflite: the model, kernel and reasoning tests again on tflite_runtime (numpy < 2)
test-tflite: $(TFLITE_VENV)/.installed-edgefleet
	EDGEFLEET_TFLITE_BACKEND=tflite_runtime $(TFLITE_VENV)/bin/pytest $(PYTEST_ARGS) \
		tests/test_model_runtime.py tests/test_model_card.py tests/test_reasoning.py tests/test_rules.py \
		tests/test_model_kernels.py

$(TFLITE_VENV)/.installed-edgefleet: pyproject.toml
	@scripts/ensure-system-deps python3-venv
	$(PYTHON) -m venv $(TFLITE_VENV)
	$(TFLITE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TFLITE_VENV)/bin/python -m pip install --quiet -e '.[dev,tflite]'
	@touch $@

## model: regenerate the training data, train, quantize to INT8 and rewrite models/motor_drive/
##        (ARGS="--acquisition-from site.toml": a model for that config's acquisition,
##        written to models/motor_drive_site/)
model: $(TRAIN_VENV)/.installed-edgefleet
	$(TRAIN_VENV)/bin/python -m models.train $(ARGS)

$(TRAIN_VENV)/.installed-edgefleet: pyproject.toml
	@scripts/ensure-system-deps python3-venv
	$(PYTHON) -m venv $(TRAIN_VENV)
	$(TRAIN_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TRAIN_VENV)/bin/python -m pip install --quiet -e '.[train]'
	@touch $@

## demo: the whole story live: a broker, fleet serve, five agents on simulated plants, a model
##       v2 rollout in waves, then a too-slow v3 that halts at its canary and rolls back (~2 min)
demo: venv
	$(BIN)/python scripts/demo_fleet.py

## demo-agent: one agent with every stage in a live terminal view; a current spike is injected
##       20 s in; it ends by itself after 60 s (or Ctrl-C) with a summary
demo-agent: venv
	$(BIN)/edge-agent check-config examples/agent.toml
	$(BIN)/edge-agent run --config examples/agent.toml --simulate --dashboard \
		--duration 60 --anomaly spike:current@20+15x8

## bench: every benchmark in quick mode
bench: venv
	$(BIN)/python -m bench.perception --quick
	$(BIN)/python -m bench.modbus_poll --quick
	$(BIN)/python -m bench.can_ingest --quick
	$(BIN)/python -m bench.reasoning --quick
	$(BIN)/python -m bench.detection --quick
	$(BIN)/python -m bench.hot_swap --quick
	$(BIN)/python -m bench.memory --quick
	$(BIN)/python -m bench.gate --quick
	$(BIN)/python -m bench.e2e --quick
	$(BIN)/python -m bench.uplink --quick
	$(BIN)/python -m bench.fleet_ingest --quick
	$(BIN)/python -m bench.fleet_devices --quick
	$(BIN)/python -m bench.chaos --quick
	$(BIN)/python -m bench.ota --quick
	$(BIN)/python -m bench.ota_fetch --quick
	$(BIN)/python -m bench.rollout --quick
	$(BIN)/python -m bench.console --quick

## check-arm64: every runtime dependency has a manylinux aarch64 wheel for CPython 3.11 and 3.12
check-arm64: venv
	$(BIN)/python scripts/check_arm64.py

## test-arm64: the agent run for real on aarch64 (Debian 12 arm64 root under qemu-user, as
##       root): check-config, the known-answer self-test, a 20 s simulated run, 500 windows
##       (verdicts equal to x86), the model, rules and known-answer tests; qemu's SVE CPU
##       caught by the self-test (builtin kernels serve the reference outputs).
##       The root is cached in /var/cache/edgefleet, keyed on the dependency list (scripts/test-arm64)
test-arm64: venv
	scripts/test-arm64

clean:
	rm -rf $(VENV) $(TRAIN_VENV) $(TFLITE_VENV) .mypy_cache .ruff_cache .pytest_cache *.egg-info
