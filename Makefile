# The two commands a reader needs: `make demo` and `make test`. Each bootstraps .venv on
# its own (created when missing, reinstalled when pyproject.toml is newer than it), so
# either works as the first command on a fresh clone.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo lint unit integration devstack-up devstack-down bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check service tests bench
	$(BIN)/ruff format --check service tests bench
	$(BIN)/mypy

# Unit and integration tests; the integration tests bring the dev stack up themselves
# (tests/conftest.py runs devstack/up), so nothing else has to be started first.
test: lint
	$(BIN)/pytest

unit: $(STAMP)
	$(BIN)/pytest tests/unit

integration: $(STAMP)
	$(BIN)/pytest -m integration

demo: $(STAMP)
	$(BIN)/crs-consumer demo

devstack-up:
	devstack/up

devstack-down:
	devstack/down

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
