# Quick start: `make demo` runs the main job on the built-in demo corpus; `make test` runs the tests.
# Both create .venv on first use and install the project into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-floor lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,cpu]' && $(BIN)/python -m pip install -q --no-deps 'lm-eval>=0.4.13,<0.5'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ingest run

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

# The oldest versions pyproject.toml allows (.ci/floor-constraints.txt), installed together in
# .venv-floor: the tests of Ray actors, several JAX processes, orbax resume, grain, the formats,
# HF tokenizers.
FLOOR := .venv-floor
FLOOR_TESTS := deps layering actors multihost checkpoint grain_iter formats sources_api spill \
	stream feed pack_shift plan plan_cache paths warm_start host_local eval_feed mixture materialize \
	hf_fast hf_data

$(FLOOR)/.installed: pyproject.toml .ci/floor-constraints.txt
	test -x $(FLOOR)/bin/python || $(PYTHON) -m venv $(FLOOR)
	$(FLOOR)/bin/python -m pip install -q --upgrade pip
	$(FLOOR)/bin/python -m pip install -q -e '.[test,cpu]' -c .ci/floor-constraints.txt
	touch $@

test-floor: $(FLOOR)/.installed
	$(FLOOR)/bin/python -m pytest -q $(patsubst %,tests/test_%.py,$(FLOOR_TESTS))

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
	rm -rf $(VENV) $(FLOOR) .pytest_cache build *.egg-info
