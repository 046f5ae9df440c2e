# Quick start: `make demo` runs the main job on the built-in demo corpus; `make test` runs the tests.
# Both create .venv on first use and install the project into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,cpu]' && $(BIN)/python -m pip install -q --no-deps 'lm-eval>=0.4.13,<0.5'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ingest run

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check ingest actors jax_side benchmarks tests

# The benchmark harness: tokenizer limit, `ingest run`, grain and Ray Data on the demo corpus.
# Writes benchmarks/results.json (and results-workers.png, with matplotlib from the `bench`
# extra); `make bench ARGS=--quick` is the smoke test (about 2 minutes).
bench: $(STAMP)
	$(BIN)/python -c "import matplotlib" 2>/dev/null || $(BIN)/python -m pip install -q -e '.[bench]' \
		|| echo "make bench: matplotlib did not install; the bench runs without its plot"
	$(BIN)/ingest bench $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
