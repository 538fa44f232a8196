# Loopline: one entry point for development and CI. Every target installs what it
# needs first (a virtual environment in .venv, the buf CLI in node_modules), so a fresh
# clone needs only python3 (>= 3.11), npm and make.
#
#   make run                  set up, migrate, seed and start all four services
#   make test                 the whole test suite (embedded SQLite, in-memory backends)
#   make test PYTEST_ARGS='-k sse -x'   (TESTS=tests/e2e narrows the paths)
#   make help                 every target

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST := $(VENV)/bin/pytest
VENV_STAMP := $(VENV)/.installed
# Every dependency pinned with its hashes, written from pyproject.toml by `make lock`:
# LOCK for the image (runtime), DEV_LOCK (runtime and dev extras, same versions) for .venv.
LOCK := requirements.lock
DEV_LOCK := requirements-dev.lock
# The integration workers' own environment (services/tools/workers): Python >= 3.12, which the
# pinned modulex-integrations needs; the first of these that runs is used.
INT_VENV := .venv-integrations
INT_STAMP := $(INT_VENV)/.installed
INT_LOCK := requirements-integrations.lock
INTEGRATIONS_PYTHON ?= $(shell for p in python3.12 python3.13 \
	$(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3 $(HOME)/.pyenv/versions/3.13*/bin/python3); do \
	$$p -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { echo $$p; break; }; done)
UV := $(VENV)/bin/uv
UV_VERSION := $(shell sed -n 's/^ *"uv==\([^"]*\)".*/\1/p' pyproject.toml)
UV_COMPILE := $(UV) pip compile pyproject.toml --quiet --universal --python-version 3.11 \
	--generate-hashes --custom-compile-command 'make lock' --excludes requirements-excludes.txt
LOCK_ARGS ?=
# What `pip check` may report: the one dependency requirements-excludes.txt leaves out.
PIP_CHECK_EXCLUDED := requires sentence-transformers, which is not installed
BUF := node_modules/.bin/buf
SERVICES := gateway orchestrator billing tools
PY_SOURCES := services tests bench scripts

TESTS ?= tests
PYTEST_ARGS ?=
DEV_ARGS ?=
BENCH_ARGS ?=
LOOPLINE_TEST_POSTGRES_URL ?= postgresql+asyncpg://postgres@127.0.0.1:5432/test
LOOPLINE_TEST_REDIS_URL ?= redis://127.0.0.1:6379/0

# The console's browser tests (tests/console) drive Debian's chromium; LOOPLINE_CHROMIUM names another.
APT_GET := DEBIAN_FRONTEND=noninteractive $(if $(filter 0,$(shell id -u)),,sudo) apt-get

.PHONY: help venv lock buf pgvector chromium gen gen-check catalogue lint format breaking migrate run test test-pg test-faults bench clean distclean

help: ## list the targets
	@echo "Loopline make targets:"
	@awk 'BEGIN {FS = ":[^#]*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-10s %s\n", $$1, $$2}' $(firstword $(MAKEFILE_LIST))
	@echo "Variables: TESTS (test paths, default tests), PYTEST_ARGS (extra pytest options), DEV_ARGS (options of scripts/dev.py, e.g. --logs), BENCH_ARGS (options of the benchmark, e.g. --quick, --backend postgres), LOCK_ARGS (options of uv pip compile, e.g. --upgrade), PYTHON (default python3)."

venv: $(VENV_STAMP) $(INT_STAMP) ## create .venv (requirements-dev.lock, then the project) and .venv-integrations (Python >= 3.12)

$(VENV_STAMP): $(DEV_LOCK) pyproject.toml
	@test -x $(PY) || { echo "creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install --disable-pip-version-check --quiet --no-deps --require-hashes -r $(DEV_LOCK)
	$(PY) -m pip install --disable-pip-version-check --quiet --no-deps -e .
	@problems=$$($(PY) -m pip check 2>&1 | grep -v -e "$(PIP_CHECK_EXCLUDED)" -e "^No broken" || true); \
	if [ -n "$$problems" ]; then echo "$$problems" >&2; \
	  echo "venv: $(DEV_LOCK) does not satisfy pyproject.toml: run 'make lock'" >&2; exit 1; fi
	@touch $@

$(INT_STAMP): $(INT_LOCK)
	@test -n "$(INTEGRATIONS_PYTHON)" || { echo "venv: the integration workers need Python >= 3.12:" \
	  "put python3.12 or python3.13 on PATH (or under pyenv), or set INTEGRATIONS_PYTHON" >&2; exit 1; }
	@test -x $(INT_VENV)/bin/python || { echo "creating $(INT_VENV) with $(INTEGRATIONS_PYTHON)"; \
	  $(INTEGRATIONS_PYTHON) -m venv $(INT_VENV); }
	$(INT_VENV)/bin/python -m pip install --disable-pip-version-check --quiet --require-hashes -r $(INT_LOCK)
	@touch $@

lock: ## write requirements.lock and requirements-dev.lock from pyproject.toml (keeps the pins that still fit; LOCK_ARGS=--upgrade moves them all)
	@test -x $(PY) || { echo "creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@test "$$($(UV) --version 2>/dev/null | cut -d ' ' -f 2)" = "$(UV_VERSION)" || \
	  $(PY) -m pip install --disable-pip-version-check --quiet "uv==$(UV_VERSION)"
	$(UV_COMPILE) $(LOCK_ARGS) --extra dev -o $(DEV_LOCK)
	$(UV_COMPILE) $(LOCK_ARGS) -c $(DEV_LOCK) -o $(LOCK)
	$(UV) pip compile requirements-integrations.in --quiet --universal --python-version 3.12 \
	  --generate-hashes --custom-compile-command 'make lock' $(LOCK_ARGS) -o $(INT_LOCK)

buf: $(BUF) ## install the buf CLI (npm package @bufbuild/buf) into node_modules

$(BUF): package.json $(wildcard package-lock.json)
	npm install --no-audit --no-fund
	@touch $@

pgvector: ## build pgvector into the local PostgreSQL where it is missing (scripts/install_pgvector.sh)
	@bash scripts/install_pgvector.sh

chromium: ## install Debian's chromium (the console's browser tests) where it is missing
	@if [ -n "$${LOOPLINE_CHROMIUM:-}" ] || command -v chromium >/dev/null; then exit 0; fi; \
	echo "installing Debian's chromium for the console's browser tests (tests/console)"; \
	$(APT_GET) install -y -qq --no-install-recommends chromium fonts-liberation >/dev/null || \
	  { $(APT_GET) update -qq && $(APT_GET) install -y -qq --no-install-recommends chromium fonts-liberation >/dev/null; }

gen: $(VENV_STAMP) ## regenerate the Python code in loopline/ from protos/
	$(PY) scripts/gen_protos.py

gen-check: gen ## regenerate, then fail if loopline/ differs from the committed tree
	@changes=$$(git status --porcelain --untracked-files=all -- loopline); \
	if [ -n "$$changes" ]; then \
	  echo "gen-check: FAILED: regenerated loopline/ differs from the committed tree:" >&2; \
	  echo "$$changes" >&2; \
	  git --no-pager diff --stat HEAD -- loopline >&2 || true; \
	  if [ -n "$$(git status --porcelain -- protos)" ]; then \
	    echo "(protos/ has uncommitted changes too)" >&2; \
	  fi; \
	  echo "Run 'make gen' and commit loopline/ together with protos/." >&2; \
	  exit 1; \
	fi; \
	echo "gen-check: loopline/ is up to date with protos/"

catalogue: $(INT_STAMP) ## regenerate services/tools/catalogue_data from the pinned modulex-integrations
	$(INT_VENV)/bin/python scripts/build_catalogue.py services/tools/catalogue_data

lint: $(VENV_STAMP) $(BUF) ## buf lint of protos/, ruff (lint and format) and mypy (rules in buf.yaml and pyproject.toml)
	$(BUF) lint
	$(VENV)/bin/ruff format --check --quiet $(PY_SOURCES)
	$(VENV)/bin/ruff check --quiet $(PY_SOURCES)
	$(VENV)/bin/mypy
	@echo "lint: buf, ruff and mypy passed"

format: $(VENV_STAMP) ## ruff format and ruff check --fix of the Python tree
	$(VENV)/bin/ruff format --quiet $(PY_SOURCES)
	$(VENV)/bin/ruff check --fix --quiet $(PY_SOURCES)

breaking: $(BUF) ## buf breaking against the main branch (skipped when there is no main commit)
	@if git rev-parse --verify --quiet 'refs/heads/main^{commit}' >/dev/null; then \
	  $(BUF) breaking --against '.git#branch=main' && echo "breaking: no breaking change against main"; \
	elif git rev-parse --verify --quiet 'refs/remotes/origin/main^{commit}' >/dev/null; then \
	  $(BUF) breaking --against '.git#ref=refs/remotes/origin/main' && echo "breaking: no breaking change against origin/main"; \
	else \
	  echo "breaking: skipped, this repository has no main branch commit to compare against"; \
	fi

migrate: $(VENV_STAMP) ## apply the Alembic migrations of all four services (SQLite under LOOPLINE_DATA_DIR, default ./var)
	@for service in $(SERVICES); do \
	  echo "migrate: $$service"; \
	  $(PY) -m services.$$service migrate; \
	done

run: $(VENV_STAMP) $(INT_STAMP) ## set up, migrate, seed and start all four services; Ctrl-C stops them (scripts/dev.py)
	$(PY) scripts/dev.py $(DEV_ARGS)

test: $(VENV_STAMP) $(INT_STAMP) $(BUF) chromium pgvector ## run the whole test suite on the embedded backends
	$(PYTEST) -q $(TESTS) $(PYTEST_ARGS)

test-pg: $(VENV_STAMP) $(INT_STAMP) $(BUF) pgvector ## run the same suite on PostgreSQL and Redis (127.0.0.1:5432 db test, 127.0.0.1:6379), without tests/faults (make test-faults) and tests/console (the pages: make test)
	LOOPLINE_TEST_BACKEND=postgres \
	LOOPLINE_TEST_POSTGRES_URL='$(LOOPLINE_TEST_POSTGRES_URL)' \
	LOOPLINE_TEST_REDIS_URL='$(LOOPLINE_TEST_REDIS_URL)' \
	$(PYTEST) -q $(TESTS) --ignore=tests/faults --ignore=tests/console $(PYTEST_ARGS)

test-faults: $(VENV_STAMP) $(INT_STAMP) pgvector ## the fault suite on real processes: PostgreSQL (127.0.0.1:5432 db test) and a redis-server per test (tests/faults)
	LOOPLINE_TEST_BACKEND=postgres \
	LOOPLINE_TEST_POSTGRES_URL='$(LOOPLINE_TEST_POSTGRES_URL)' \
	LOOPLINE_TEST_REDIS_URL='$(LOOPLINE_TEST_REDIS_URL)' \
	$(PYTEST) -q tests/faults $(PYTEST_ARGS)

bench: $(VENV_STAMP) $(INT_STAMP) ## benchmark the real processes (latency, throughput, fan-out, admission, memory); BENCH_ARGS='--quick'; JSON in bench/results/
	$(PY) -m bench $(BENCH_ARGS)

clean: ## remove var/ (development databases and logs) and caches
	rm -rf var .pytest_cache .hypothesis build
	find . -name __pycache__ -type d -not -path './$(VENV)/*' -not -path './node_modules/*' -prune -exec rm -rf {} +

distclean: clean ## clean, and remove .venv and node_modules too
	rm -rf $(VENV) $(INT_VENV) node_modules
