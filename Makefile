# Two commands: `make demo` and `make test`. Both set up .venv on first use.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
export MM_ASSETS_HOME ?= $(CURDIR)/.mm_assets
export DAGSTER_HOME ?= $(MM_ASSETS_HOME)/dagster_home
# Trained demo targets, keyed by the code, settings and torch/transformers versions that
# built them: `make test` and `make demo` (any home, any clone) train each once per user.
# Empty: every home trains its own.
export MM_ASSETS_DEMO_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/mm_assets/demo_targets

.PHONY: setup instance demo test test-fast test-long lint format bench bench-quality chaos dev clean

setup:
	@bash scripts/setup_env.sh

# $(DAGSTER_HOME) with the repo's instance config (accelerator pool limit, run monitoring):
# `dev` and `demo` run in the same instance.
instance:
	@mkdir -p "$(DAGSTER_HOME)"
	@[ -f "$(DAGSTER_HOME)/dagster.yaml" ] || cp dagster.yaml "$(DAGSTER_HOME)/dagster.yaml"
	@cmp -s dagster.yaml "$(DAGSTER_HOME)/dagster.yaml" || echo "note: $(DAGSTER_HOME)/dagster.yaml \
	differs from ./dagster.yaml (pool limit, run monitoring): diff them, or copy it over"

# `make demo DEMO_ARGS=--verbose` prints Dagster's per-step events too.
demo: setup instance
	$(PY) -m mm_assets.demo run $(DEMO_ARGS)

# test-fast runs in TEST_WORKERS processes (pytest-xdist, a session home each); `make test`
# in one, where the server tests share the session's servers (BENCHMARKS.md, test suite).
TEST_WORKERS ?= 2

test: setup lint
	$(PY) -m pytest -q -m "not long" --durations=15

# Whole-chain runs (~10 min; .ci/run runs it after `make test`): the text demo chain on two
# Celery workers with Redis and an S3 server, and killed three times then resumed.
test-long: setup
	$(PY) -m pytest -q -m long --durations=5

# What needs no vLLM server, no Dagster subprocess and no browser (a few minutes at most).
test-fast: setup lint
	$(PY) -m pytest -q -m "not slow and not long" -n $(TEST_WORKERS) --dist loadfile

# The Dagster UI on 127.0.0.1:3000 with run history in $(DAGSTER_HOME).
dev: setup instance
	$(VENV)/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

lint: setup
	$(VENV)/bin/ruff check mm_assets tests bench scripts
	$(VENV)/bin/ruff format --check mm_assets tests bench scripts
	$(VENV)/bin/lint-imports

format: setup
	$(VENV)/bin/ruff check --fix mm_assets tests bench scripts
	$(VENV)/bin/ruff format mm_assets tests bench scripts

bench: demo  # the storage bench reads the demo run (cached after the first)
	$(PY) -m bench.run_all

# The demo's multimodal draft on the whole demo benchmark (40 prompts per category) at
# depths 1, 3, 5 and 7, with 95% intervals (~10 min): `make demo` measures 3 per category.
bench-quality: demo
	$(PY) -m bench.quality

# The text demo chain killed with SIGKILL at 20 seeded points, each rerun checked against a
# clean run (bench/chaos.py; about an hour on 2 cores). A 3-point version is in `make test`.
chaos: setup
	$(PY) -m bench.chaos --points 20 --seed 0

clean:
	rm -rf .mm_assets .pytest_cache .cache
