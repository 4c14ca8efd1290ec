# The two commands of the README: `make serve` and `make test`. Both set up what they need.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint typecheck conformance models clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

models: $(STAMP)
	$(BIN)/python examples/make_example_repository.py examples/model_repository

serve: models
	$(BIN)/kiln serve --model-repository examples/model_repository --http-port $${KILN_HTTP_PORT:-8000}

# CI (.ci/run) runs this target: lint and type errors fail it before the tests run
test: lint typecheck
	$(BIN)/python -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; fi; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check engine_core server tests load_tests examples tools bench kiln_cli.py

typecheck: $(STAMP)
	$(BIN)/mypy

conformance: $(STAMP)
	$(BIN)/kiln conformance --backend cpu --markdown docs/conformance.md

clean:
	rm -rf $(VENV) .pytest_cache
